// CoordinatorCore at scale, without gRPC: what lets 16k nodes cost little. A parked Sync keeps
// its node alive (the transport vouches for its connection), and a free node that holds a store
// port is joined to a new job by the coordinator itself, so its next answer is RUN.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "agent/coordinator/coordinator_core.h"
#include "tests/unit/coordinator_harness.h"

namespace accel::coordinator {
namespace {

CoordinatorOptions parked_options() {
  CoordinatorOptions o = default_options();
  o.idle_wait = milliseconds(30'000);
  o.dead_connection_within = milliseconds(5'000);
  return o;
}

pb::RegisterNodeRequest with_store(const std::string& id, int32_t port) {
  pb::RegisterNodeRequest r = Harness::node_req(id);
  r.set_store_port(port);
  return r;
}

// Registers `id` holding store port `port`, which its syncs repeat (as an agent's do).
RpcStatus add_with_store(Harness& h, const std::string& id, int32_t port) {
  h.store_port[id] = port;
  return h.register_req(with_store(id, port));
}

// ========================================================================== parked liveness

TEST(CoordinatorLiveness, AParkedSyncKeepsItsNodeAliveAndTheLeaseRunsFromWhatItVouchedFor) {
  Harness h(parked_options());
  pb::RegisterNodeResponse reg;
  ASSERT_TRUE(h.core.register_node(Harness::node_req("a"), &reg).is_ok());
  EXPECT_EQ(reg.idle_wait_ms(), 30'000);
  h.sync_resp("a");
  h.core.poll_started("a");
  h.clock.advance(milliseconds(60'000));  // six leases without a call
  h.core.tick();
  ASSERT_FALSE(h.node("a")->lost());
  EXPECT_EQ(h.node("a")->last_seen_ms_ago(), 0);  // connected: heard of now
  // Its poll ends (answered or cancelled): the connection was alive 5 s before at least.
  h.core.poll_ended("a");
  EXPECT_EQ(h.node("a")->last_seen_ms_ago(), 5'000);
  h.clock.advance(kLease - milliseconds(5'000));
  h.core.tick();
  EXPECT_FALSE(h.node("a")->lost());
  h.clock.advance(milliseconds(1));
  h.core.tick();
  EXPECT_TRUE(h.node("a")->lost()) << "a lease after what its connection vouched for";
}

TEST(CoordinatorLiveness, ANodeWithoutAParkedSyncIsLostAfterTheLeaseAsBefore) {
  Harness h(parked_options());
  ASSERT_TRUE(h.add_node("a").is_ok());
  ASSERT_TRUE(h.add_node("b").is_ok());
  h.core.poll_started("b");
  h.clock.advance(kLease);
  h.core.tick();
  EXPECT_FALSE(h.node("a")->lost());  // exactly the lease: not yet
  h.clock.advance(milliseconds(1));
  h.core.tick();
  EXPECT_TRUE(h.node("a")->lost());
  EXPECT_FALSE(h.node("b")->lost());
  // Two polls of one node (a retry while the first still waits): alive until both end.
  h.core.poll_started("b");
  h.core.poll_ended("b");
  h.clock.advance(kLease * 3);
  h.core.tick();
  EXPECT_FALSE(h.node("b")->lost());
  h.core.poll_ended("b");
  h.clock.advance(kLease);
  h.core.tick();
  EXPECT_TRUE(h.node("b")->lost());
}

TEST(CoordinatorLiveness, ANodeRegisteringAfterALongQuietIsCheckedFromItsRegistration) {
  Harness h(parked_options());
  ASSERT_TRUE(h.add_node("a").is_ok());
  h.core.poll_started("a");
  h.clock.advance(kLease * 5);
  h.core.tick();  // nothing may lapse: the next look is at b's lease
  ASSERT_TRUE(h.add_node("b").is_ok());
  h.clock.advance(kLease + milliseconds(1));
  h.core.tick();
  EXPECT_TRUE(h.node("b")->lost());
  EXPECT_FALSE(h.node("a")->lost());
}

TEST(CoordinatorLiveness, NodesRunningWorkersAreToldToReportLessOftenInALargeCluster) {
  CoordinatorOptions o = parked_options();  // sync_wait 2 s, idle wait 30 s
  o.max_nodes = 40'000;
  Harness h(o);
  ASSERT_TRUE(h.add_node("a").is_ok());
  auto told = [&] {
    pb::SyncRequest req;
    req.set_node_id("a");
    pb::SyncResponse resp;
    EXPECT_TRUE(h.core.sync(req, &resp).is_ok());
    return resp.progress_wait_ms();
  };
  EXPECT_EQ(told(), 2'000);
  for (int i = 0; i < 3'000; ++i) ASSERT_TRUE(h.add_node("n" + std::to_string(i)).is_ok());
  // 3001 nodes at 600 reports a second: every 5 s.
  EXPECT_EQ(told(), 3001 * 1000 / 600);
  for (int i = 3'000; i < 30'000; ++i) ASSERT_TRUE(h.add_node("n" + std::to_string(i)).is_ok());
  EXPECT_EQ(told(), 30'000) << "never longer than the idle wait";
}

// ============================================================================== auto-join

TEST(CoordinatorAutoJoin, FreeNodesWithAStorePortAreToldRunWithoutJoin) {
  Harness h;
  ASSERT_TRUE(add_with_store(h, "a", 40001).is_ok());
  ASSERT_TRUE(add_with_store(h, "b", 40002).is_ok());
  uint64_t idle_a = h.sync_resp("a").version();
  h.sync_resp("b");
  ASSERT_TRUE(h.submit("j", make_spec(2, 2)).is_ok());
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_RUNNING);  // closed at the submission
  pb::SyncResponse a = h.sync_resp("a");
  EXPECT_EQ(a.version(), idle_a + 1) << "one new instruction: RUN, no JOIN before it";
  EXPECT_EQ(a.instruction().action(), Ins::ACTION_RUN);
  EXPECT_EQ(a.instruction().assignment().node_rank(), 0);
  EXPECT_EQ(a.instruction().assignment().master_addr(), addr_of("a"));
  EXPECT_EQ(a.instruction().assignment().master_port(), 40001);  // the port a holds
  Ins b = h.ins("b");
  EXPECT_EQ(b.action(), Ins::ACTION_RUN);
  EXPECT_EQ(b.assignment().node_rank(), 1);
  EXPECT_EQ(b.assignment().master_port(), 40001);
  EXPECT_EQ(a.next_sync_within_ms(), 0) << "a small round: at once";
}

// A large round's RUN tells its nodes to come back within a spread, so that the answers still
// going out are not slowed by the polls of the nodes already answered.
TEST(CoordinatorAutoJoin, ALargeRoundsNodesAreToldToSyncAgainWithinASpread) {
  Harness h;
  for (int i = 0; i < 2'000; ++i) {
    ASSERT_TRUE(add_with_store(h, "n" + std::to_string(i), 20'000 + i).is_ok());
  }
  ASSERT_TRUE(h.submit("j", make_spec(2'000, 2'000)).is_ok());
  pb::SyncResponse run = h.sync_resp("n7");
  ASSERT_EQ(run.instruction().action(), Ins::ACTION_RUN);
  EXPECT_EQ(run.next_sync_within_ms(), 2'000 * 1000 / CoordinatorCore::kRunAnswersPerSecond);
  pb::SyncResponse again = h.sync_resp("n7");
  EXPECT_TRUE(again.instruction().action() == Ins::ACTION_RUN);  // what it holds
  pb::SyncRequest req;
  req.set_node_id("n7");
  req.set_known_version(run.version());
  req.set_omit_unchanged(true);
  pb::SyncResponse unchanged;
  ASSERT_TRUE(h.core.sync(req, &unchanged).is_ok());
  EXPECT_TRUE(unchanged.unchanged());
  EXPECT_EQ(unchanged.next_sync_within_ms(), 0) << "only with the new instruction";
}

TEST(CoordinatorAutoJoin, AnAutoJoinedNodeWaitsWithoutANewInstructionUntilTheRoundCloses) {
  Harness h;
  ASSERT_TRUE(add_with_store(h, "a", 40001).is_ok());
  ASSERT_TRUE(h.add_node("b").is_ok());  // an agent that holds no port: the JOIN path
  uint64_t idle_a = h.sync_resp("a").version();
  ASSERT_TRUE(h.submit("j", make_spec(2, 2)).is_ok());
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_RENDEZVOUS);
  EXPECT_EQ(h.sync_resp("a").version(), idle_a) << "a's parked poll is not woken for nothing";
  Ins b = h.ins("b");
  ASSERT_EQ(b.action(), Ins::ACTION_JOIN);
  ASSERT_TRUE(h.join("b", "j", b.round(), 40100).is_ok());
  ASSERT_EQ(h.core.job_state("j"), pb::JOB_STATE_RUNNING);
  Ins a = h.ins("a");
  EXPECT_EQ(a.action(), Ins::ACTION_RUN);
  EXPECT_EQ(a.assignment().node_rank(), 0);  // joined first
  EXPECT_EQ(a.assignment().master_port(), 40001);
}

TEST(CoordinatorAutoJoin, TheOldestOpenRoundGetsTheNodeAndARegistrationJoinsItToo) {
  Harness h;
  ASSERT_TRUE(add_with_store(h, "a", 40001).is_ok());
  ASSERT_TRUE(h.submit("old", make_spec(2, 2)).is_ok());  // a joins; one more needed
  ASSERT_TRUE(h.submit("new", make_spec(1, 1)).is_ok());  // no free node left
  EXPECT_EQ(h.core.job_state("new"), pb::JOB_STATE_RENDEZVOUS);
  ASSERT_TRUE(add_with_store(h, "b", 40002).is_ok());  // goes to the oldest
  EXPECT_EQ(h.core.job_state("old"), pb::JOB_STATE_RUNNING);
  EXPECT_EQ(h.core.job_state("new"), pb::JOB_STATE_RENDEZVOUS);
  EXPECT_EQ(h.ins("b").job_id(), "old");
}

TEST(CoordinatorAutoJoin, BusyOrLostNodesAndOnlyJobIdAreRespectedAndTheSyncUpdatesThePort) {
  Harness h;
  pb::RegisterNodeRequest other_only = with_store("c", 40003);
  other_only.set_only_job_id("elsewhere");
  ASSERT_TRUE(h.register_req(other_only).is_ok());
  ASSERT_TRUE(add_with_store(h, "a", 40001).is_ok());
  // a's store was used by a round and not yet replaced: its sync says so.
  h.store_port["a"] = 0;
  h.sync_resp("a");
  ASSERT_TRUE(h.submit("j", make_spec(1, 1)).is_ok());
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_RENDEZVOUS) << "neither a nor c was joined";
  EXPECT_EQ(h.ins("a").action(), Ins::ACTION_JOIN);
  EXPECT_EQ(h.ins("c").action(), Ins::ACTION_IDLE);
  pb::SyncRequest req;
  req.set_node_id("a");
  req.set_store_port(70000);
  pb::SyncResponse resp;
  EXPECT_EQ(h.core.sync(req, &resp).code, Code::kInvalidArgument);
  pb::RegisterNodeRequest bad = with_store("d", -1);
  EXPECT_EQ(h.register_req(bad).code, Code::kInvalidArgument);
}

TEST(CoordinatorAutoJoin, ARestartRoundAsksItsNodesToJoinAsBefore) {
  Harness h;
  ASSERT_TRUE(add_with_store(h, "a", 40001).is_ok());
  auto spec = make_spec(1, 1);
  spec.set_max_restarts(1);
  ASSERT_TRUE(h.submit("j", spec).is_ok());
  ASSERT_EQ(h.ins("a").action(), Ins::ACTION_RUN);
  ASSERT_TRUE(
      h.report("a", "j", 0, Rep::EVENT_FAILED, {exit_failure(0, 1, 0, h.clock.unix_ms())}).is_ok());
  // It may still run workers: it stops them and joins (and offers its last port) itself.
  Ins again = h.ins("a");
  EXPECT_EQ(again.action(), Ins::ACTION_JOIN);
  EXPECT_EQ(again.round(), 1);
  ASSERT_TRUE(h.join("a", "j", 1, 40001).is_ok());
  EXPECT_EQ(h.ins("a").action(), Ins::ACTION_RUN);
}

}  // namespace
}  // namespace accel::coordinator

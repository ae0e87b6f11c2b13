// CoordinatorCore unit tests (FakeClock, no gRPC): filled in below.
//
// Every test drives one CoordinatorCore with plain protobuf messages; time moves only through
// FakeClock::advance and is applied by core.tick(). No sleeps, no threads.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "agent/coordinator/coordinator_core.h"
#include "agent/coordinator/request_limits.h"
#include "tests/unit/coordinator_harness.h"

namespace accel::coordinator {
namespace {

// The line of `text` that contains `needle` ("" when none).
std::string line_with(const std::string& text, const std::string& needle) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.find(needle) != std::string::npos) return line;
  }
  return "";
}

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.rfind(prefix, 0) == 0;
}

// The failure table's line marked as the root cause ("" when none).
std::string marked_line(const std::string& text) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (starts_with(line, "* ")) return line;
  }
  return "";
}

int count_failure_events(const pb::WatchJobResponse& w) {
  return static_cast<int>(std::count_if(w.events().begin(), w.events().end(),
                                        [](const pb::JobEvent& e) { return e.has_failure(); }));
}

bool has_message(const pb::WatchJobResponse& w, const std::string& needle) {
  return std::any_of(w.events().begin(), w.events().end(), [&](const pb::JobEvent& e) {
    return e.has_message() && e.message().find(needle) != std::string::npos;
  });
}

// ================================================================================ register

TEST(CoordinatorCore, RegisterRejectsInvalidNodeIdsAndEmptyAddress) {
  Harness h;
  for (const std::string& bad : {std::string(), std::string("has space"), std::string("a/b"),
                                 std::string("semi;colon"), std::string(129, 'n')}) {
    EXPECT_EQ(h.add_node(bad).code, Code::kInvalidArgument) << "'" << bad << "'";
  }
  auto no_addr = Harness::node_req("node-a");
  no_addr.clear_address();
  EXPECT_EQ(h.register_req(no_addr).code, Code::kInvalidArgument);
  EXPECT_EQ(h.add_node("node-b", /*machine_rank=*/-2).code, Code::kInvalidArgument);

  auto impossible = Harness::node_req("node-c");
  impossible.mutable_current()->set_job_id("j");
  impossible.mutable_current()->mutable_spec()->set_processes_per_node(1);
  impossible.mutable_current()->mutable_assignment()->set_num_nodes(2);
  impossible.mutable_current()->mutable_assignment()->set_node_rank(2);
  EXPECT_EQ(h.register_req(impossible).code, Code::kInvalidArgument);

  // Nothing was registered by the rejected calls.
  EXPECT_EQ(h.status().nodes_size(), 0);
  EXPECT_EQ(h.status().jobs_size(), 0);
  EXPECT_EQ(h.sync_status("node-a").code, Code::kNotFound);
  EXPECT_EQ(h.sync_status("node-c").code, Code::kNotFound);

  // The edges of the id rule are accepted.
  EXPECT_TRUE(h.add_node(std::string(128, 'n')).is_ok());
  EXPECT_TRUE(h.add_node("A-z_0.9:x").is_ok());
  EXPECT_EQ(h.status().nodes_size(), 2);
}

TEST(CoordinatorCore, RegisterSameIdFromAnotherHostWhileAliveIsAlreadyExists) {
  Harness h;
  h.start_job("j", make_spec(1, 1), {"a"}, {29500});

  auto other_host = Harness::node_req("a");
  other_host.set_hostname("host-intruder");
  other_host.set_address("10.9.9.9");
  EXPECT_EQ(h.register_req(other_host).code, Code::kAlreadyExists);

  auto other_addr = Harness::node_req("a");
  other_addr.set_address("10.9.9.9");
  EXPECT_EQ(h.register_req(other_addr).code, Code::kAlreadyExists);

  // Nothing changed: same host and address, still node rank 0 of the running job.
  auto n = h.node("a");
  ASSERT_TRUE(n);
  EXPECT_EQ(n->hostname(), host_of("a"));
  EXPECT_EQ(n->address(), addr_of("a"));
  EXPECT_EQ(n->job_id(), "j");
  EXPECT_EQ(n->node_rank(), 0);
  auto j = h.job("j");
  ASSERT_TRUE(j);
  EXPECT_EQ(j->state(), pb::JOB_STATE_RUNNING);
  EXPECT_EQ(j->round(), 0);
  Ins in = h.ins("a");
  EXPECT_EQ(in.action(), Ins::ACTION_RUN);
  EXPECT_EQ(in.assignment().master_addr(), addr_of("a"));
}

TEST(CoordinatorCore, ReRegisterFromSameHostIsAcceptedAndRenewsLease) {
  Harness h;
  pb::RegisterNodeResponse resp;
  ASSERT_TRUE(h.core.register_node(Harness::node_req("a"), &resp).is_ok());
  EXPECT_EQ(resp.coordinator_id(), "coord-test");
  EXPECT_EQ(resp.lease_ms(), 10'000);
  EXPECT_EQ(resp.sync_wait_ms(), 2'000);

  h.clock.advance(milliseconds(7'000));
  EXPECT_EQ(h.node("a")->last_seen_ms_ago(), 7'000);
  pb::RegisterNodeResponse again;
  ASSERT_TRUE(h.core.register_node(Harness::node_req("a"), &again).is_ok());
  EXPECT_EQ(again.coordinator_id(), "coord-test");
  EXPECT_EQ(h.status().nodes_size(), 1);
  EXPECT_EQ(h.node("a")->last_seen_ms_ago(), 0);

  // The re-registration renewed the lease: 7 s + 7 s of silence is 14 s since the first
  // registration, but only 7 s since the second.
  h.clock.advance(milliseconds(7'000));
  h.core.tick();
  EXPECT_FALSE(h.node("a")->lost());
  EXPECT_TRUE(h.sync_status("a").is_ok());
}

TEST(CoordinatorCore, GeneratedCoordinatorIdWhenNoneGiven) {
  FakeClock clock;
  CoordinatorOptions o;
  CoordinatorCore core(clock, o);
  EXPECT_EQ(core.coordinator_id().size(), 12u);
  pb::GetStatusResponse st;
  core.get_status(&st);
  EXPECT_EQ(st.coordinator_id(), core.coordinator_id());
}

TEST(CoordinatorCore, LostNodeMayRegisterAgainFromAnotherHost) {
  Harness h;
  ASSERT_TRUE(h.add_node("a").is_ok());
  h.clock.advance(kLease + milliseconds(1));
  h.core.tick();
  ASSERT_TRUE(h.node("a")->lost());
  EXPECT_EQ(h.sync_status("a").code, Code::kNotFound);

  auto moved = Harness::node_req("a");
  moved.set_hostname("host-new");
  moved.set_address("10.1.1.1");
  ASSERT_TRUE(h.register_req(moved).is_ok());
  auto n = h.node("a");
  EXPECT_FALSE(n->lost());
  EXPECT_EQ(n->hostname(), "host-new");
  EXPECT_EQ(n->address(), "10.1.1.1");
  EXPECT_TRUE(h.sync_status("a").is_ok());
}

TEST(CoordinatorCore, ReRegisterWithoutWorkersRestartsRunningJobUncounted) {
  Harness h;
  auto spec = make_spec(2, 2);
  spec.set_max_restarts(0);  // a counted restart would fail the job
  h.start_job("j", spec, {"a", "b"});

  ASSERT_TRUE(h.add_node("a").is_ok());  // the agent restarted: no `current`
  auto j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_RENDEZVOUS);
  EXPECT_EQ(j->round(), 1);
  EXPECT_EQ(j->restart_count(), 0);
  Ins a = h.ins("a");
  EXPECT_EQ(a.action(), Ins::ACTION_JOIN);
  EXPECT_EQ(a.round(), 1);
  Ins b = h.ins("b");
  EXPECT_EQ(b.action(), Ins::ACTION_JOIN);
  EXPECT_EQ(b.round(), 1);
}

// ================================================================================== submit

TEST(CoordinatorCore, SubmitRejectsInvalidSpecs) {
  Harness h;
  struct Case {
    const char* what;
    void (*mutate)(pb::JobSpec&);
  };
  const Case cases[] = {
      {"empty argv", [](pb::JobSpec& s) { s.clear_argv(); }},
      {"empty program", [](pb::JobSpec& s) { s.set_argv(0, ""); }},
      {"processes_per_node 0", [](pb::JobSpec& s) { s.set_processes_per_node(0); }},
      {"processes_per_node -1", [](pb::JobSpec& s) { s.set_processes_per_node(-1); }},
      {"min_nodes 0", [](pb::JobSpec& s) { s.set_min_nodes(0); }},
      {"min > max",
       [](pb::JobSpec& s) {
         s.set_min_nodes(3);
         s.set_max_nodes(2);
       }},
      {"max_restarts -1", [](pb::JobSpec& s) { s.set_max_restarts(-1); }},
      {"join_timeout 0", [](pb::JobSpec& s) { s.set_join_timeout_ms(0); }},
      {"last_call -1", [](pb::JobSpec& s) { s.set_last_call_ms(-1); }},
      {"stop_timeout 0", [](pb::JobSpec& s) { s.set_stop_timeout_ms(0); }},
      {"port -1", [](pb::JobSpec& s) { s.set_master_port(-1); }},
      {"port 65536", [](pb::JobSpec& s) { s.set_master_port(65536); }},
  };
  for (const auto& c : cases) {
    pb::JobSpec s = make_spec(1, 2);
    c.mutate(s);
    EXPECT_EQ(h.submit("j", s).code, Code::kInvalidArgument) << c.what;
  }
  EXPECT_EQ(h.submit("bad id", make_spec(1, 1)).code, Code::kInvalidArgument);
  EXPECT_EQ(h.submit(std::string(129, 'j'), make_spec(1, 1)).code, Code::kInvalidArgument);

  // Nothing was created.
  EXPECT_EQ(h.status().jobs_size(), 0);
  EXPECT_FALSE(h.core.job_state("j").has_value());
  EXPECT_EQ(h.core.last_event_seq("j"), 0u);

  // The edges are valid.
  pb::JobSpec edge = make_spec(2, 2);
  edge.set_master_port(65535);
  edge.set_last_call_ms(0);
  EXPECT_TRUE(h.submit("j", edge).is_ok());
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_RENDEZVOUS);
}

TEST(CoordinatorCore, SubmitDuplicateJobIdIsAlreadyExists) {
  Harness h;
  ASSERT_TRUE(h.submit("j", make_spec(1, 2)).is_ok());
  uint64_t seq = h.core.last_event_seq("j");
  EXPECT_EQ(h.submit("j", make_spec(3, 4)).code, Code::kAlreadyExists);
  auto st = h.status();
  ASSERT_EQ(st.jobs_size(), 1);
  EXPECT_EQ(st.jobs(0).spec().min_nodes(), 1);
  EXPECT_EQ(st.jobs(0).spec().max_nodes(), 2);
  EXPECT_EQ(h.core.last_event_seq("j"), seq);

  // An empty id is generated.
  pb::SubmitJobRequest req;
  *req.mutable_spec() = make_spec(1, 1);
  pb::SubmitJobResponse resp;
  ASSERT_TRUE(h.core.submit_job(req, &resp).is_ok());
  EXPECT_TRUE(starts_with(resp.job_id(), "job-")) << resp.job_id();
  EXPECT_NE(resp.job_id(), "j");
  EXPECT_EQ(h.core.job_state(resp.job_id()), pb::JOB_STATE_RENDEZVOUS);
}

TEST(CoordinatorCore, SubmittedJobOpensRoundZero) {
  Harness h;
  auto spec = make_spec(2, 4);
  spec.set_submitted_by("ada@laptop");
  ASSERT_TRUE(h.submit("j", spec).is_ok());
  auto j = h.job("j");
  ASSERT_TRUE(j);
  EXPECT_EQ(j->state(), pb::JOB_STATE_RENDEZVOUS);
  EXPECT_EQ(j->round(), 0);
  EXPECT_EQ(j->restart_count(), 0);
  EXPECT_EQ(j->num_nodes(), 0);

  auto w = h.watch("j", 0);
  ASSERT_EQ(w.events_size(), 3);
  EXPECT_EQ(w.events(0).state(), pb::JOB_STATE_PENDING);
  EXPECT_EQ(w.events(1).state(), pb::JOB_STATE_RENDEZVOUS);
  EXPECT_NE(w.events(2).message().find(
                "round 0 open (submitted by ada@laptop): waiting for 2 to 4 nodes"),
            std::string::npos)
      << w.events(2).message();
  EXPECT_FALSE(w.done());
  EXPECT_EQ(w.state(), pb::JOB_STATE_RENDEZVOUS);
  EXPECT_EQ(w.coordinator_id(), "coord-test");
}

// ============================================================================== instructions

TEST(CoordinatorCore, IdleNodeJoinsWaitsAndRunsWithAssignment) {
  Harness h;
  ASSERT_TRUE(h.add_node("a").is_ok());
  ASSERT_TRUE(h.add_node("b").is_ok());
  EXPECT_EQ(h.ins("a").action(), Ins::ACTION_IDLE);  // no job yet

  auto spec = make_spec(2, 2, /*ppn=*/4);
  ASSERT_TRUE(h.submit("j", spec).is_ok());

  Ins a = h.ins("a");
  EXPECT_EQ(a.action(), Ins::ACTION_JOIN);
  EXPECT_EQ(a.job_id(), "j");
  EXPECT_EQ(a.round(), 0);
  EXPECT_EQ(a.spec().argv_size(), 2);
  EXPECT_EQ(a.spec().argv(1), "train.py");
  EXPECT_FALSE(a.has_assignment());

  const uint64_t before_join = h.sync_resp("a").version();
  ASSERT_TRUE(h.join("a", "j", 0, 29500).is_ok());
  // Joined: the same JOIN again, not a new version every joined node would have to be sent.
  EXPECT_EQ(h.sync_resp("a").version(), before_join);
  a = h.ins("a");
  EXPECT_EQ(a.action(), Ins::ACTION_JOIN);
  EXPECT_EQ(a.job_id(), "j");
  EXPECT_EQ(a.round(), 0);
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_RENDEZVOUS);

  Ins b = h.ins("b");
  EXPECT_EQ(b.action(), Ins::ACTION_JOIN);
  ASSERT_TRUE(h.join("b", "j", 0, 29600).is_ok());
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_RUNNING);

  a = h.ins("a");
  b = h.ins("b");
  ASSERT_EQ(a.action(), Ins::ACTION_RUN);
  ASSERT_EQ(b.action(), Ins::ACTION_RUN);
  EXPECT_EQ(a.job_id(), "j");
  EXPECT_EQ(a.round(), 0);
  EXPECT_EQ(a.spec().processes_per_node(), 4);
  EXPECT_EQ(a.assignment().node_rank(), 0);
  EXPECT_EQ(a.assignment().rank_offset(), 0);
  EXPECT_EQ(b.assignment().node_rank(), 1);
  EXPECT_EQ(b.assignment().rank_offset(), 4);
  for (const Ins* in : {&a, &b}) {
    EXPECT_EQ(in->assignment().num_nodes(), 2);
    EXPECT_EQ(in->assignment().world_size(), 8);
    EXPECT_EQ(in->assignment().master_addr(), addr_of("a"));
    EXPECT_EQ(in->assignment().master_port(), 29500);  // node rank 0's port, not b's
    EXPECT_EQ(in->assignment().restart_count(), 0);
  }

  auto j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_RUNNING);
  EXPECT_EQ(j->num_nodes(), 2);
  EXPECT_EQ(j->world_size(), 8);
  ASSERT_EQ(j->node_ids_size(), 2);
  EXPECT_EQ(j->node_ids(0), "a");
  EXPECT_EQ(j->node_ids(1), "b");
  EXPECT_EQ(h.node("b")->node_rank(), 1);
  EXPECT_EQ(h.node("b")->job_id(), "j");
}

TEST(CoordinatorCore, FixedMasterPortOverridesJoinedPort) {
  Harness h;
  auto spec = make_spec(2, 2);
  spec.set_master_port(23456);
  h.start_job("j", spec, {"a", "b"}, {29500, 29600});
  EXPECT_EQ(h.ins("a").assignment().master_port(), 23456);
  EXPECT_EQ(h.ins("b").assignment().master_port(), 23456);
}

TEST(CoordinatorCore, RetriedJoinIsIdempotentAndKeepsLatestPort) {
  Harness h;
  ASSERT_TRUE(h.add_node("a").is_ok());
  ASSERT_TRUE(h.add_node("b").is_ok());
  ASSERT_TRUE(h.submit("j", make_spec(2, 2)).is_ok());
  ASSERT_TRUE(h.join("a", "j", 0, 1111).is_ok());
  ASSERT_TRUE(h.join("a", "j", 0, 2222).is_ok());  // retried: not a second member
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_RENDEZVOUS);
  ASSERT_TRUE(h.join("b", "j", 0, 3333).is_ok());
  auto j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_RUNNING);
  EXPECT_EQ(j->num_nodes(), 2);
  EXPECT_EQ(h.ins("b").assignment().master_port(), 2222);
}

TEST(CoordinatorCore, MachineRankHintsOrderNodeRanks) {
  Harness h;
  ASSERT_TRUE(h.add_node("x", 1).is_ok());
  ASSERT_TRUE(h.add_node("y", 2).is_ok());
  ASSERT_TRUE(h.add_node("z", 0).is_ok());
  ASSERT_TRUE(h.submit("j", make_spec(3, 3, /*ppn=*/2)).is_ok());
  // Machine rank 0 joins last.
  h.join_all("j", {"x", "y", "z"}, {1001, 1002, 1003});
  ASSERT_EQ(h.core.job_state("j"), pb::JOB_STATE_RUNNING);

  Ins x = h.ins("x"), y = h.ins("y"), z = h.ins("z");
  EXPECT_EQ(z.assignment().node_rank(), 0);
  EXPECT_EQ(x.assignment().node_rank(), 1);
  EXPECT_EQ(y.assignment().node_rank(), 2);
  EXPECT_EQ(z.assignment().rank_offset(), 0);
  EXPECT_EQ(x.assignment().rank_offset(), 2);
  EXPECT_EQ(y.assignment().rank_offset(), 4);
  for (const Ins* in : {&x, &y, &z}) {
    EXPECT_EQ(in->assignment().master_addr(), addr_of("z"));
    EXPECT_EQ(in->assignment().master_port(), 1003);
    EXPECT_EQ(in->assignment().world_size(), 6);
  }
}

TEST(CoordinatorCore, NodesWithoutMachineRankComeAfterHintedOnesInJoinOrder) {
  Harness h;
  ASSERT_TRUE(h.add_node("p").is_ok());
  ASSERT_TRUE(h.add_node("q").is_ok());
  ASSERT_TRUE(h.add_node("r", 0).is_ok());
  ASSERT_TRUE(h.submit("j", make_spec(3, 3)).is_ok());
  h.join_all("j", {"q", "p", "r"});
  auto j = h.job("j");
  ASSERT_EQ(j->node_ids_size(), 3);
  EXPECT_EQ(j->node_ids(0), "r");
  EXPECT_EQ(j->node_ids(1), "q");
  EXPECT_EQ(j->node_ids(2), "p");
}

TEST(CoordinatorCore, OldestJobIsOfferedFirstAndOnlyJobIdIsRespected) {
  Harness h;
  ASSERT_TRUE(h.submit("zeta", make_spec(1, 1)).is_ok());   // submitted first
  ASSERT_TRUE(h.submit("alpha", make_spec(1, 1)).is_ok());  // sorts first by name
  ASSERT_TRUE(h.add_node("a").is_ok());
  ASSERT_TRUE(h.add_node("b", -1, "alpha").is_ok());

  Ins a = h.ins("a");
  EXPECT_EQ(a.action(), Ins::ACTION_JOIN);
  EXPECT_EQ(a.job_id(), "zeta");
  Ins b = h.ins("b");
  EXPECT_EQ(b.action(), Ins::ACTION_JOIN);
  EXPECT_EQ(b.job_id(), "alpha");
  EXPECT_EQ(h.join("b", "zeta", 0).code, Code::kFailedPrecondition);

  ASSERT_TRUE(h.join("a", "zeta", 0).is_ok());
  EXPECT_EQ(h.core.job_state("zeta"), pb::JOB_STATE_RUNNING);
  // a runs zeta: it may not join alpha as well.
  EXPECT_EQ(h.join("a", "alpha", 0).code, Code::kFailedPrecondition);
  EXPECT_EQ(h.ins("a").action(), Ins::ACTION_RUN);
  EXPECT_EQ(h.core.job_state("alpha"), pb::JOB_STATE_RENDEZVOUS);
}

// ================================================================================= elastic

TEST(CoordinatorCore, ElasticRoundClosesOnlyAfterLastCall) {
  Harness h;
  auto spec = make_spec(2, 4);
  spec.set_last_call_ms(5'000);
  ASSERT_TRUE(h.add_node("a").is_ok());
  ASSERT_TRUE(h.add_node("b").is_ok());
  ASSERT_TRUE(h.submit("j", spec).is_ok());

  h.join_all("j", {"a"});
  h.clock.advance(milliseconds(6'000));  // long past last_call, but only 1 of 2 nodes
  h.core.tick();
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_RENDEZVOUS);

  h.join_all("j", {"b"});  // min reached now
  h.core.tick();
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_RENDEZVOUS);
  auto w = h.watch("j", 0);
  ASSERT_GT(w.events_size(), 0);
  EXPECT_EQ(w.events(w.events_size() - 1).message(),
            "round 0: 2 of up to 4 nodes joined, enough to start; waiting up to 5s (last_call) "
            "for more");
  h.clock.advance(milliseconds(4'999));
  h.sync_resp("a");
  h.sync_resp("b");
  h.core.tick();
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_RENDEZVOUS);
  EXPECT_EQ(h.ins("a").action(), Ins::ACTION_JOIN);  // joined, waiting for the round to close

  h.clock.advance(milliseconds(1));
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_RENDEZVOUS);  // time alone changes nothing
  h.core.tick();
  auto j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_RUNNING);
  EXPECT_EQ(j->num_nodes(), 2);
  EXPECT_EQ(j->world_size(), 4);
  Ins b = h.ins("b");
  ASSERT_EQ(b.action(), Ins::ACTION_RUN);
  EXPECT_EQ(b.assignment().num_nodes(), 2);
  EXPECT_EQ(b.assignment().world_size(), 4);
}

TEST(CoordinatorCore, ElasticRoundClosesAtOnceWhenMaxNodesJoin) {
  Harness h;
  auto spec = make_spec(2, 3);
  spec.set_last_call_ms(60'000);
  for (const char* id : {"a", "b", "c"}) ASSERT_TRUE(h.add_node(id).is_ok());
  ASSERT_TRUE(h.submit("j", spec).is_ok());
  h.join_all("j", {"a", "b"});
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_RENDEZVOUS);
  h.join_all("j", {"c"});
  auto j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_RUNNING);  // no tick needed
  EXPECT_EQ(j->num_nodes(), 3);
  EXPECT_EQ(h.ins("c").assignment().world_size(), 6);
}

TEST(CoordinatorCore, JoinTimeoutWithFewerThanMinNodesFailsJob) {
  Harness h;
  auto spec = make_spec(2, 4);
  spec.set_join_timeout_ms(8'000);
  ASSERT_TRUE(h.add_node("a").is_ok());
  ASSERT_TRUE(h.submit("j", spec).is_ok());
  h.join_all("j", {"a"});

  h.clock.advance(milliseconds(7'999));
  h.core.tick();
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_RENDEZVOUS);
  h.clock.advance(milliseconds(1));
  h.core.tick();

  auto j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_FAILED);
  EXPECT_EQ(j->exit_code(), 1);
  auto w = h.watch("j", 0);
  EXPECT_TRUE(w.done());
  EXPECT_EQ(w.outcome().state(), pb::JOB_STATE_FAILED);
  EXPECT_EQ(w.outcome().exit_code(), 1);
  EXPECT_NE(w.outcome().summary().find(
                "only 1 of the 2 nodes it needs joined round 0 within join_timeout (8000 ms)"),
            std::string::npos)
      << w.outcome().summary();
  EXPECT_TRUE(has_message(w, "only 1 of the 2 nodes"));
  // No worker ever ran: the reason alone, not an empty failure table of "round -1".
  EXPECT_EQ(w.outcome().summary().find("round -1"), std::string::npos) << w.outcome().summary();
  EXPECT_EQ(w.outcome().summary().find("failures of job"), std::string::npos)
      << w.outcome().summary();

  Ins a = h.ins("a");
  EXPECT_EQ(a.action(), Ins::ACTION_IDLE);
  EXPECT_EQ(a.last_job().job_id(), "j");
  EXPECT_EQ(a.last_job().state(), pb::JOB_STATE_FAILED);
  EXPECT_EQ(a.last_job().exit_code(), 1);
  EXPECT_EQ(h.node("a")->job_id(), "");
}

// ====================================================================== stale / out of order

TEST(CoordinatorCore, StaleOrUnknownJoinChangesNothing) {
  Harness h;
  auto spec = make_spec(2, 2);
  spec.set_max_restarts(1);
  for (const char* id : {"a", "b", "c"}) ASSERT_TRUE(h.add_node(id).is_ok());
  ASSERT_TRUE(h.submit("j", spec).is_ok());
  h.join_all("j", {"a"});

  EXPECT_EQ(h.join("c", "nope", 0).code, Code::kNotFound);
  EXPECT_EQ(h.join("ghost", "j", 0).code, Code::kNotFound);
  EXPECT_EQ(h.join("c", "j", 1).code, Code::kFailedPrecondition);  // a round not open yet
  EXPECT_EQ(h.join("c", "j", 0, 70'000).code, Code::kInvalidArgument);
  EXPECT_EQ(h.join("c", "j", 0, -1).code, Code::kInvalidArgument);
  // c is still free and still told to join round 0; the round did not close.
  EXPECT_EQ(h.node("c")->job_id(), "");
  Ins c = h.ins("c");
  EXPECT_EQ(c.action(), Ins::ACTION_JOIN);
  EXPECT_EQ(c.round(), 0);
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_RENDEZVOUS);

  h.join_all("j", {"b"});
  ASSERT_EQ(h.core.job_state("j"), pb::JOB_STATE_RUNNING);
  EXPECT_EQ(h.join("c", "j", 0).code, Code::kFailedPrecondition);  // closed
  EXPECT_EQ(h.ins("c").action(), Ins::ACTION_IDLE);
  auto j = h.job("j");
  ASSERT_EQ(j->node_ids_size(), 2);
  EXPECT_EQ(j->node_ids(0), "a");
  EXPECT_EQ(j->node_ids(1), "b");

  // A failure opens round 1; a join of the old round is refused and changes nothing.
  ASSERT_TRUE(
      h.report("a", "j", 0, Rep::EVENT_FAILED, {exit_failure(0, 1, 0, h.clock.unix_ms())}).is_ok());
  ASSERT_EQ(h.job("j")->round(), 1);
  EXPECT_EQ(h.join("a", "j", 0).code, Code::kFailedPrecondition);
  Ins a = h.ins("a");
  EXPECT_EQ(a.action(), Ins::ACTION_JOIN);  // not WAIT: not joined
  EXPECT_EQ(a.round(), 1);
  j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_RENDEZVOUS);
  EXPECT_EQ(j->round(), 1);
  EXPECT_EQ(j->restart_count(), 1);

  // The new round is open to c too.
  Ins c1 = h.ins("c");
  EXPECT_EQ(c1.action(), Ins::ACTION_JOIN);
  EXPECT_EQ(c1.round(), 1);
  EXPECT_TRUE(h.join("c", "j", 1).is_ok());
  EXPECT_EQ(h.ins("c").action(), Ins::ACTION_JOIN);
  EXPECT_EQ(h.ins("c").round(), 1);
}

TEST(CoordinatorCore, ReportGroupRejectsNonMembersAndMalformedReports) {
  Harness h;
  auto spec = make_spec(2, 2);
  spec.set_max_restarts(1);
  h.start_job("j", spec, {"a", "b"});
  ASSERT_TRUE(h.add_node("c").is_ok());
  uint64_t seq = h.core.last_event_seq("j");
  const auto f = exit_failure(0, 1, 0, h.clock.unix_ms());

  EXPECT_EQ(h.report("c", "j", 0, Rep::EVENT_FAILED, {f}).code, Code::kFailedPrecondition);
  EXPECT_EQ(h.report("a", "j", 7, Rep::EVENT_STARTED).code, Code::kFailedPrecondition);
  EXPECT_EQ(h.report("a", "j", 7, Rep::EVENT_FAILED, {f}).code, Code::kFailedPrecondition);
  EXPECT_EQ(h.report("a", "j", 0, Rep::EVENT_FAILED).code, Code::kInvalidArgument);
  EXPECT_EQ(h.report("a", "j", 0, Rep::EVENT_UNSPECIFIED).code, Code::kInvalidArgument);
  EXPECT_EQ(h.report("ghost", "j", 0, Rep::EVENT_STARTED).code, Code::kNotFound);
  EXPECT_EQ(h.report("a", "nope", 0, Rep::EVENT_STARTED).code, Code::kNotFound);

  auto j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_RUNNING);
  EXPECT_EQ(j->round(), 0);
  EXPECT_EQ(j->restart_count(), 0);
  EXPECT_FALSE(j->has_last_failure());
  EXPECT_EQ(h.core.last_event_seq("j"), seq);

  // Round 1 is open but not closed: nobody is a member of it yet; round 0 is over.
  ASSERT_TRUE(h.report("a", "j", 0, Rep::EVENT_FAILED, {f}).is_ok());
  ASSERT_EQ(h.job("j")->round(), 1);
  EXPECT_EQ(h.report("a", "j", 1, Rep::EVENT_FAILED, {f}).code, Code::kFailedPrecondition);
  EXPECT_EQ(h.report("b", "j", 0, Rep::EVENT_SUCCEEDED).code, Code::kFailedPrecondition);
  EXPECT_EQ(h.report("b", "j", 0, Rep::EVENT_STARTED).code, Code::kFailedPrecondition);
  EXPECT_EQ(h.job("j")->restart_count(), 1);
  EXPECT_EQ(h.job("j")->state(), pb::JOB_STATE_RENDEZVOUS);
}

// ================================================================================ restarts

TEST(CoordinatorCore, RestartBudgetIsCountedOnceForTheWholeJob) {
  Harness h;
  auto spec = make_spec(2, 2);
  spec.set_max_restarts(1);
  h.start_job("j", spec, {"a", "b"}, {29500, 29600});
  const int64_t t = h.clock.unix_ms();

  // a's group fails first: one counted restart, round 1 opens.
  ASSERT_TRUE(
      h.report("a", "j", 0, Rep::EVENT_FAILED, {exit_failure(1, 1, 0, t + 100, "oops")}).is_ok());
  auto j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_RENDEZVOUS);
  EXPECT_EQ(j->round(), 1);
  EXPECT_EQ(j->restart_count(), 1);
  for (const char* id : {"a", "b"}) {
    Ins in = h.ins(id);
    EXPECT_EQ(in.action(), Ins::ACTION_JOIN) << id;
    EXPECT_EQ(in.round(), 1) << id;
  }

  // b's report of the same round arrives late: recorded, not counted again.
  ASSERT_TRUE(h.report("b", "j", 0, Rep::EVENT_FAILED, {exit_failure(2, 0, 15, t + 200)}).is_ok());
  j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_RENDEZVOUS);
  EXPECT_EQ(j->round(), 1);
  EXPECT_EQ(j->restart_count(), 1);
  EXPECT_EQ(count_failure_events(h.watch("j", 0)), 2);
  EXPECT_EQ(h.ins("b").round(), 1);

  h.join_all("j", {"a", "b"}, {29501, 29601});
  ASSERT_EQ(h.core.job_state("j"), pb::JOB_STATE_RUNNING);
  Ins a = h.ins("a");
  EXPECT_EQ(a.round(), 1);
  EXPECT_EQ(a.assignment().restart_count(), 1);
  EXPECT_EQ(a.assignment().master_port(), 29501);

  // The second failure finds no restart left: the job fails with 128 + SIGKILL.
  ASSERT_TRUE(h.report("b", "j", 1, Rep::EVENT_FAILED, {exit_failure(3, 0, 9, t + 5'000)}).is_ok());
  j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_FAILED);
  EXPECT_EQ(j->exit_code(), 137);
  EXPECT_EQ(j->restart_count(), 1);
  EXPECT_EQ(j->round(), 1);
  EXPECT_EQ(j->last_failure().signal(), 9);
  EXPECT_EQ(j->last_failure().node_id(), "b");

  for (const char* id : {"a", "b"}) {
    Ins in = h.ins(id);
    EXPECT_EQ(in.action(), Ins::ACTION_IDLE) << id;
    EXPECT_EQ(in.last_job().job_id(), "j");
    EXPECT_EQ(in.last_job().state(), pb::JOB_STATE_FAILED);
    EXPECT_EQ(in.last_job().exit_code(), 137);
  }
  auto w = h.watch("j", 0);
  ASSERT_TRUE(w.done());
  const std::string& summary = w.outcome().summary();
  EXPECT_NE(summary.find("no restarts left (max_restarts 1)"), std::string::npos) << summary;
  std::string root = marked_line(summary);
  EXPECT_NE(root.find("rank 3 on host-b (pid 1003) failed: SIGKILL (signal 9)"), std::string::npos)
      << summary;
  // Round 0's root cause (a's, the earlier of the two) is listed as an earlier round.
  std::string earlier = line_with(summary, "earlier: round 0");
  EXPECT_NE(earlier.find("rank 1 on host-a"), std::string::npos) << summary;
}

TEST(CoordinatorCore, FailedJobExitCodeIsTheRootCausesExitCode) {
  Harness h;
  h.start_job("j", make_spec(1, 1), {"a"});
  ASSERT_TRUE(h.report("a", "j", 0, Rep::EVENT_FAILED, {exit_failure(0, 42, 0, h.clock.unix_ms())})
                  .is_ok());
  EXPECT_EQ(h.job("j")->state(), pb::JOB_STATE_FAILED);
  EXPECT_EQ(h.job("j")->exit_code(), 42);
}

TEST(CoordinatorCore, RootCauseIsTheEarliestFailureEvenWhenReportedLater) {
  Harness h;
  h.start_job("j", make_spec(2, 2), {"a", "b"});
  const int64_t t = h.clock.unix_ms();

  // One report, earliest second in the list: the earliest still wins.
  ASSERT_TRUE(h.report("a", "j", 0, Rep::EVENT_FAILED,
                       {exit_failure(1, 6, 0, t + 3'000, "NCCL error"),
                        exit_failure(0, 3, 0, t + 2'000, "boom")})
                  .is_ok());
  auto j = h.job("j");
  ASSERT_EQ(j->state(), pb::JOB_STATE_FAILED);
  EXPECT_EQ(j->exit_code(), 3);
  EXPECT_EQ(j->last_failure().rank(), 0);
  EXPECT_EQ(j->last_failure().message(), "boom");

  // b's failure happened earlier but is reported after the job ended.
  auto late = exit_failure(2, 0, 11, t + 1'000, "segfault");
  late.add_stderr_tail("Segmentation fault (core dumped)");
  ASSERT_TRUE(h.report("b", "j", 0, Rep::EVENT_FAILED, {late}).is_ok());

  j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_FAILED);
  EXPECT_EQ(j->last_failure().node_id(), "b");
  EXPECT_EQ(j->last_failure().hostname(), host_of("b"));  // filled in from the registration
  EXPECT_EQ(j->last_failure().kind(), pb::Failure::KIND_EXIT);
  EXPECT_EQ(j->last_failure().signal(), 11);
  EXPECT_EQ(j->last_failure().round(), 0);

  auto w = h.watch("j", 0);
  ASSERT_TRUE(w.done());
  const std::string& summary = w.outcome().summary();
  EXPECT_NE(marked_line(summary).find(
                "rank 2 on host-b (pid 1002) failed: SIGSEGV (signal 11): segfault"),
            std::string::npos)
      << summary;
  EXPECT_TRUE(starts_with(line_with(summary, "  rank 0 on host-a"), "  "))
      << summary;  // table row, unmarked
  EXPECT_TRUE(starts_with(line_with(summary, "  rank 1 on host-a"), "  ")) << summary;
  // The exit code follows the root cause; the first line still says why the job ended.
  EXPECT_EQ(w.outcome().exit_code(), 128 + 11);
  EXPECT_TRUE(starts_with(summary, "accel: job j FAILED with exit code 139: rank 0 on host-a"))
      << summary;
  EXPECT_NE(summary.find("stderr| Segmentation fault (core dumped)"), std::string::npos) << summary;
  // Nodes are told the updated summary too.
  Ins a = h.ins("a");
  EXPECT_EQ(a.last_job().summary(), summary);
}

TEST(CoordinatorCore, LateFailureEventKeepsItsOwnRound) {
  Harness h;
  auto spec = make_spec(2, 2);
  spec.set_max_restarts(3);
  h.start_job("j", spec, {"a", "b"});
  const int64_t t = h.clock.unix_ms();
  ASSERT_TRUE(h.report("a", "j", 0, Rep::EVENT_FAILED, {exit_failure(0, 1, 0, t)}).is_ok());
  ASSERT_EQ(h.job("j")->round(), 1);
  ASSERT_TRUE(h.report("b", "j", 0, Rep::EVENT_FAILED, {exit_failure(2, 1, 0, t + 1)}).is_ok());

  auto w = h.watch("j", 0);
  int seen = 0;
  for (const auto& ev : w.events()) {
    if (!ev.has_failure()) continue;
    ++seen;
    EXPECT_EQ(ev.failure().round(), 0);
    EXPECT_EQ(ev.round(), 0) << "the failure event of node " << ev.failure().node_id()
                             << " is labelled with the job's current round";
  }
  EXPECT_EQ(seen, 2);
}

TEST(CoordinatorCore, FailureSummaryFormatting) {
  std::vector<pb::Failure> fs;
  auto f0 = exit_failure(0, 1, 0, 5'000);
  f0.set_round(0);
  f0.set_node_id("a");
  f0.set_hostname("host-a");
  fs.push_back(f0);
  auto f1 = exit_failure(0, 1, 0, 9'000, "late");
  f1.set_round(1);
  f1.set_node_id("a");
  f1.set_hostname("host-a");
  fs.push_back(f1);
  auto f2 = exit_failure(2, 0, 9, 8'000);
  f2.set_round(1);
  f2.set_node_id("b");
  f2.set_hostname("host-b");
  f2.add_stderr_tail("Killed");
  fs.push_back(f2);

  std::string s = format_failure_summary("j", fs, 1, 2);
  EXPECT_TRUE(
      starts_with(s, "accel: failures of job j, round 1 (root cause = the earliest, marked *):\n"))
      << s;
  EXPECT_NE(marked_line(s).find("rank 2 on host-b (pid 1002) failed: SIGKILL (signal 9)"),
            std::string::npos)
      << s;
  EXPECT_TRUE(
      starts_with(line_with(s, "rank 0 on host-a (pid 1000) failed: exit code 1: late"), "  "))
      << s;
  EXPECT_NE(s.find("      stderr| Killed\n"), std::string::npos) << s;
  EXPECT_NE(line_with(s, "earlier: round 0").find("rank 0 on host-a"), std::string::npos) << s;

  // No root: nothing marked.
  std::string unmarked = format_failure_summary("j", fs, 1, std::nullopt);
  EXPECT_EQ(marked_line(unmarked), "") << unmarked;

  EXPECT_EQ(failure_status_code(f2), 137);
  EXPECT_EQ(failure_status_code(exit_failure(0, 3, 0, 0)), 3);
  pb::Failure lost;
  lost.set_kind(pb::Failure::KIND_NODE_LOST);
  lost.set_node_id("c");
  lost.set_message("no heartbeat");
  EXPECT_EQ(failure_status_code(lost), 1);
  EXPECT_EQ(describe_failure(lost), "node c lost: no heartbeat");
  pb::Failure hang;
  hang.set_kind(pb::Failure::KIND_HANG);
  hang.set_rank(5);
  hang.set_hostname("h");
  hang.set_message("allreduce");
  EXPECT_EQ(failure_status_code(hang), 1);
  EXPECT_EQ(describe_failure(hang), "rank 5 on h hung: allreduce");
  EXPECT_EQ(job_state_name(pb::JOB_STATE_RESTARTING), "RESTARTING");
}

// =================================================================================== lease

TEST(CoordinatorCore, SilentNodeIsLostAndSurvivorsRunWithFewerNodes) {
  Harness h;
  auto spec = make_spec(2, 3, /*ppn=*/2);
  spec.set_max_restarts(0);  // a counted restart would fail the job
  h.start_job("j", spec, {"a", "b", "c"});
  ASSERT_EQ(h.job("j")->world_size(), 6);
  const int64_t c_last_seen = h.clock.unix_ms();

  h.clock.advance(milliseconds(5'000));
  h.sync_resp("a");
  h.sync_resp("b");
  h.clock.advance(milliseconds(5'000));  // c silent exactly one lease: not yet lost
  h.core.tick();
  EXPECT_FALSE(h.node("c")->lost());
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_RUNNING);

  h.clock.advance(milliseconds(1));
  h.core.take_changes();
  h.core.tick();
  EXPECT_TRUE(h.node("c")->lost());
  EXPECT_FALSE(h.node("a")->lost());
  EXPECT_TRUE(h.core.take_changes().nodes.contains("c"));

  auto j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_RENDEZVOUS);
  EXPECT_EQ(j->round(), 1);
  EXPECT_EQ(j->restart_count(), 0);
  EXPECT_EQ(j->last_failure().kind(), pb::Failure::KIND_NODE_LOST);
  EXPECT_EQ(j->last_failure().node_id(), "c");
  EXPECT_EQ(j->last_failure().round(), 0);
  EXPECT_EQ(j->last_failure().rank(), -1);
  EXPECT_EQ(j->last_failure().time_unix_ms(), c_last_seen);  // when it went silent
  EXPECT_EQ(count_failure_events(h.watch("j", 0)), 1);

  EXPECT_EQ(h.sync_status("c").code, Code::kNotFound);
  pb::SyncResponse ignored;
  EXPECT_EQ(h.core.instruction("c", &ignored).code, Code::kNotFound);
  EXPECT_EQ(h.join("c", "j", 1).code, Code::kNotFound);

  // The survivors (min_nodes 2) rejoin and run with world size 4.
  h.join_all("j", {"a", "b"});
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_RENDEZVOUS);  // last_call
  h.clock.advance(milliseconds(1'000));
  h.core.tick();
  j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_RUNNING);
  EXPECT_EQ(j->num_nodes(), 2);
  EXPECT_EQ(j->world_size(), 4);
  EXPECT_EQ(j->restart_count(), 0);
  Ins b = h.ins("b");
  ASSERT_EQ(b.action(), Ins::ACTION_RUN);
  EXPECT_EQ(b.round(), 1);
  EXPECT_EQ(b.assignment().num_nodes(), 2);
  EXPECT_EQ(b.assignment().world_size(), 4);
  EXPECT_EQ(b.assignment().node_rank(), 1);
  EXPECT_EQ(b.assignment().rank_offset(), 2);

  // The lost node comes back: the job grows again (not counted).
  ASSERT_TRUE(h.add_node("c").is_ok());
  h.core.tick();
  j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_RENDEZVOUS);
  EXPECT_EQ(j->round(), 2);
  EXPECT_EQ(j->restart_count(), 0);
}

TEST(CoordinatorCore, InstructionDoesNotRenewTheLease) {
  Harness h;
  ASSERT_TRUE(h.add_node("a").is_ok());
  h.clock.advance(milliseconds(9'000));
  pb::SyncResponse resp;
  ASSERT_TRUE(h.core.instruction("a", &resp).is_ok());
  EXPECT_EQ(resp.instruction().action(), Ins::ACTION_IDLE);
  h.clock.advance(milliseconds(1'001));
  h.core.tick();
  EXPECT_TRUE(h.node("a")->lost());
  EXPECT_EQ(h.core.instruction("a", &resp).code, Code::kNotFound);
}

TEST(CoordinatorCore, NodeLostWhileJoinedLeavesTheOpenRound) {
  Harness h;
  auto spec = make_spec(2, 3);
  spec.set_last_call_ms(0);
  ASSERT_TRUE(h.add_node("a").is_ok());
  ASSERT_TRUE(h.add_node("b").is_ok());
  ASSERT_TRUE(h.submit("j", spec).is_ok());
  h.join_all("j", {"a"});
  h.clock.advance(milliseconds(6'000));
  h.sync_resp("b");
  h.clock.advance(milliseconds(4'001));
  h.core.tick();  // a is lost before b joins
  ASSERT_TRUE(h.node("a")->lost());
  h.join_all("j", {"b"});
  h.core.tick();
  // Only one node is in the round now: it must not close with fewer than min_nodes.
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_RENDEZVOUS);
  EXPECT_EQ(h.job("j")->restart_count(), 0);
  EXPECT_FALSE(h.job("j")->has_last_failure());
}

// ============================================================================ elastic grow

TEST(CoordinatorCore, RunningElasticJobGrowsWhenANewNodeRegisters) {
  Harness h;
  auto spec = make_spec(1, 2, /*ppn=*/3);
  spec.set_last_call_ms(0);
  spec.set_max_restarts(0);
  ASSERT_TRUE(h.add_node("a").is_ok());
  ASSERT_TRUE(h.submit("j", spec).is_ok());
  h.join_all("j", {"a"});
  h.core.tick();
  ASSERT_EQ(h.core.job_state("j"), pb::JOB_STATE_RUNNING);
  ASSERT_EQ(h.job("j")->num_nodes(), 1);
  h.core.tick();  // nobody waiting: nothing happens
  EXPECT_EQ(h.job("j")->round(), 0);
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_RUNNING);

  ASSERT_TRUE(h.add_node("b").is_ok());
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_RUNNING);  // applied on tick
  h.core.tick();
  auto j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_RENDEZVOUS);
  EXPECT_EQ(j->round(), 1);
  EXPECT_EQ(j->restart_count(), 0);
  EXPECT_TRUE(has_message(h.watch("j", 0), "elastic grow"));

  Ins a = h.ins("a"), b = h.ins("b");
  EXPECT_EQ(a.action(), Ins::ACTION_JOIN);
  EXPECT_EQ(a.round(), 1);
  EXPECT_EQ(b.action(), Ins::ACTION_JOIN);
  EXPECT_EQ(b.round(), 1);
  h.join_all("j", {"a", "b"});
  j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_RUNNING);
  ASSERT_EQ(j->node_ids_size(), 2);
  EXPECT_EQ(j->node_ids(1), "b");
  EXPECT_EQ(h.ins("b").assignment().world_size(), 6);
  EXPECT_EQ(h.ins("b").assignment().rank_offset(), 3);

  // At max_nodes a new node does not restart it.
  ASSERT_TRUE(h.add_node("c").is_ok());
  h.core.tick();
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_RUNNING);
  EXPECT_EQ(h.job("j")->round(), 1);
  EXPECT_EQ(h.ins("c").action(), Ins::ACTION_IDLE);
}

// ================================================================================= success

TEST(CoordinatorCore, JobSucceedsWhenEveryMemberReportsSuccess) {
  Harness h;
  h.start_job("j", make_spec(2, 2, /*ppn=*/2), {"a", "b"});
  ASSERT_TRUE(h.report("a", "j", 0, Rep::EVENT_STARTED).is_ok());
  EXPECT_FALSE(has_message(h.watch("j", 0), "workers of round 0 started"));
  ASSERT_TRUE(h.report("b", "j", 0, Rep::EVENT_STARTED).is_ok());
  EXPECT_TRUE(has_message(h.watch("j", 0), "all 4 workers of round 0 started"));

  ASSERT_TRUE(h.report("a", "j", 0, Rep::EVENT_SUCCEEDED).is_ok());
  ASSERT_TRUE(h.report("a", "j", 0, Rep::EVENT_SUCCEEDED).is_ok());  // repeated: still one node
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_RUNNING);
  EXPECT_EQ(h.ins("a").action(), Ins::ACTION_RUN);
  ASSERT_TRUE(h.report("b", "j", 0, Rep::EVENT_SUCCEEDED).is_ok());

  auto j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(j->exit_code(), 0);
  for (const char* id : {"a", "b"}) {
    Ins in = h.ins(id);
    EXPECT_EQ(in.action(), Ins::ACTION_IDLE) << id;
    EXPECT_EQ(in.last_job().job_id(), "j");
    EXPECT_EQ(in.last_job().state(), pb::JOB_STATE_SUCCEEDED);
    EXPECT_EQ(in.last_job().exit_code(), 0);
    EXPECT_EQ(in.last_job().summary(), "");
    EXPECT_EQ(h.node(id)->job_id(), "");
  }
  EXPECT_EQ(h.report("a", "j", 0, Rep::EVENT_SUCCEEDED).code, Code::kFailedPrecondition);
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_SUCCEEDED);
}

TEST(CoordinatorCore, AFailureFromANodeThatAlreadySucceededRestartsNothing) {
  Harness h;
  h.start_job("j", make_spec(2, 2, /*ppn=*/1), {"a", "b"});
  ASSERT_TRUE(h.report("a", "j", 0, Rep::EVENT_SUCCEEDED).is_ok());
  // a's agent then flags a stale page of its exited worker: a late report, kept, nothing else.
  pb::Failure f = exit_failure(0, 0, 0, 1'000, "hang after success");
  f.set_kind(pb::Failure::KIND_HANG);
  ASSERT_TRUE(h.report("a", "j", 0, Rep::EVENT_FAILED, {f}).is_ok());
  auto j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_RUNNING);
  EXPECT_EQ(j->restart_count(), 0);
  EXPECT_EQ(j->round(), 0);
  ASSERT_TRUE(h.report("b", "j", 0, Rep::EVENT_SUCCEEDED).is_ok());
  EXPECT_EQ(h.job("j")->state(), pb::JOB_STATE_SUCCEEDED);
}

TEST(CoordinatorCore, NodesOfEarlierRoundsHearHowTheJobEnded) {
  Harness h;
  h.start_job("j", make_spec(1, 2, /*ppn=*/1), {"a", "b"});
  // b is lost; a runs round 1 alone and finishes. b comes back and must learn the outcome.
  h.clock.advance(std::chrono::milliseconds(5'000));
  (void)h.sync_resp("a");
  h.clock.advance(std::chrono::milliseconds(6'000));
  h.core.tick();
  ASSERT_EQ(h.job("j")->round(), 1);
  ASSERT_TRUE(h.join("a", "j", 1).is_ok());
  h.clock.advance(std::chrono::milliseconds(60'000));
  (void)h.sync_resp("a");
  h.core.tick();
  ASSERT_EQ(h.core.job_state("j"), pb::JOB_STATE_RUNNING);
  ASSERT_TRUE(h.report("a", "j", 1, Rep::EVENT_SUCCEEDED).is_ok());
  ASSERT_EQ(h.core.job_state("j"), pb::JOB_STATE_SUCCEEDED);
  ASSERT_TRUE(h.add_node("b").is_ok());  // re-registers after being declared lost
  EXPECT_EQ(h.ins("b").last_job().job_id(), "j");
  EXPECT_EQ(h.ins("b").last_job().state(), pb::JOB_STATE_SUCCEEDED);
}

// ================================================================================== cancel

TEST(CoordinatorCore, CancelEndsJobWithSignalExitCode) {
  Harness h;
  h.start_job("j", make_spec(2, 2), {"a", "b"});
  pb::CancelJobRequest req;
  req.set_job_id("j");
  req.set_signal(65);
  EXPECT_EQ(h.core.cancel_job(req).code, Code::kInvalidArgument);
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_RUNNING);

  req.set_signal(9);
  ASSERT_TRUE(h.core.cancel_job(req).is_ok());
  auto j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_CANCELLED);
  EXPECT_EQ(j->exit_code(), 137);
  Ins a = h.ins("a");
  EXPECT_EQ(a.action(), Ins::ACTION_IDLE);
  EXPECT_EQ(a.last_job().state(), pb::JOB_STATE_CANCELLED);
  EXPECT_EQ(a.last_job().exit_code(), 137);
  EXPECT_NE(a.last_job().summary().find("was cancelled"), std::string::npos);
  auto w = h.watch("j", 0);
  EXPECT_TRUE(w.done());
  EXPECT_EQ(w.outcome().exit_code(), 137);

  EXPECT_EQ(h.core.cancel_job(req).code, Code::kFailedPrecondition);
  EXPECT_EQ(h.job("j")->exit_code(), 137);
  req.set_job_id("nope");
  EXPECT_EQ(h.core.cancel_job(req).code, Code::kNotFound);

  // Signal 0 means SIGTERM; a job still in rendezvous can be cancelled too.
  ASSERT_TRUE(h.submit("k", make_spec(2, 2)).is_ok());
  pb::CancelJobRequest term;
  term.set_job_id("k");
  ASSERT_TRUE(h.core.cancel_job(term).is_ok());
  EXPECT_EQ(h.job("k")->state(), pb::JOB_STATE_CANCELLED);
  EXPECT_EQ(h.job("k")->exit_code(), 143);
}

// ============================================================================ port conflict

TEST(CoordinatorCore, PortConflictOpensNewRoundWithoutCountingRestart) {
  CoordinatorOptions o = default_options();
  o.max_port_retries = 2;
  Harness h(o);
  auto spec = make_spec(2, 2);
  spec.set_max_restarts(0);
  h.start_job("j", spec, {"a", "b"}, {30001, 30002});
  const int64_t t = h.clock.unix_ms();

  ASSERT_TRUE(
      h.report("a", "j", 0, Rep::EVENT_FAILED,
               {exit_failure(0, 1, 0, t,
                             "The server socket has failed to bind: Address already in use")})
          .is_ok());
  auto j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_RENDEZVOUS);
  EXPECT_EQ(j->round(), 1);
  EXPECT_EQ(j->restart_count(), 0);
  h.join_all("j", {"a", "b"}, {30003, 30004});
  EXPECT_EQ(h.ins("b").assignment().master_port(), 30003);  // a new port this round

  // Recognised in the stderr tail too.
  auto f = exit_failure(0, 1, 0, t + 10);
  f.add_stderr_tail("OSError: [Errno 98] EADDRINUSE");
  ASSERT_TRUE(h.report("a", "j", 1, Rep::EVENT_FAILED, {f}).is_ok());
  j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_RENDEZVOUS);
  EXPECT_EQ(j->round(), 2);
  EXPECT_EQ(j->restart_count(), 0);
  h.join_all("j", {"a", "b"}, {30005, 30006});

  // Port retries used up: now it is an ordinary failure (and no restarts are left).
  ASSERT_TRUE(h.report("a", "j", 2, Rep::EVENT_FAILED,
                       {exit_failure(0, 1, 0, t + 20, "Address already in use")})
                  .is_ok());
  j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_FAILED);
  EXPECT_EQ(j->exit_code(), 1);
  EXPECT_EQ(j->restart_count(), 0);
}

TEST(CoordinatorCore, PortConflictWithFixedMasterPortIsAnOrdinaryFailure) {
  Harness h;
  auto spec = make_spec(1, 1);
  spec.set_master_port(29500);
  h.start_job("j", spec, {"a"});
  ASSERT_TRUE(h.report("a", "j", 0, Rep::EVENT_FAILED,
                       {exit_failure(0, 1, 0, h.clock.unix_ms(), "Address already in use")})
                  .is_ok());
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_FAILED);
  EXPECT_EQ(h.job("j")->round(), 0);
}

// ========================================================================= adoption

pb::RegisterNodeRequest with_current(const std::string& id, int node_rank, int num_nodes,
                                     bool group_succeeded = false) {
  auto req = Harness::node_req(id);
  auto* cur = req.mutable_current();
  cur->set_job_id("j");
  cur->set_round(3);
  *cur->mutable_spec() = make_spec(num_nodes, num_nodes, /*ppn=*/2);
  cur->mutable_spec()->set_max_restarts(2);
  auto* a = cur->mutable_assignment();
  a->set_node_rank(node_rank);
  a->set_num_nodes(num_nodes);
  a->set_rank_offset(node_rank * 2);
  a->set_world_size(num_nodes * 2);
  a->set_master_addr("10.0.0.1");
  a->set_master_port(29500);
  a->set_restart_count(2);
  cur->set_group_succeeded(group_succeeded);
  return req;
}

TEST(CoordinatorCore, AdoptsRunningJobAfterCoordinatorRestart) {
  Harness h;
  ASSERT_TRUE(h.register_req(with_current("b", 1, 2)).is_ok());  // node rank 1 first
  auto j = h.job("j");
  ASSERT_TRUE(j);
  EXPECT_EQ(j->state(), pb::JOB_STATE_RUNNING);
  EXPECT_EQ(j->round(), 3);
  EXPECT_EQ(j->restart_count(), 2);
  ASSERT_EQ(j->node_ids_size(), 2);
  EXPECT_EQ(j->node_ids(0), "");
  EXPECT_EQ(j->node_ids(1), "b");
  EXPECT_TRUE(has_message(h.watch("j", 0), "adopted job j at round 3"));

  Ins b = h.ins("b");
  ASSERT_EQ(b.action(), Ins::ACTION_RUN);
  EXPECT_EQ(b.round(), 3);
  EXPECT_EQ(b.assignment().node_rank(), 1);
  EXPECT_EQ(b.assignment().rank_offset(), 2);
  EXPECT_EQ(b.assignment().world_size(), 4);
  EXPECT_EQ(b.assignment().master_addr(), "10.0.0.1");
  EXPECT_EQ(b.assignment().master_port(), 29500);
  EXPECT_EQ(b.assignment().restart_count(), 2);

  ASSERT_TRUE(h.register_req(with_current("a", 0, 2)).is_ok());
  j = h.job("j");
  EXPECT_EQ(j->node_ids(0), "a");
  EXPECT_EQ(j->node_ids(1), "b");
  EXPECT_TRUE(has_message(h.watch("j", 0), "all 2 nodes of round 3 are back"));

  // Well past the adoption deadline it still runs the same round.
  for (int i = 0; i < 3; ++i) {
    h.clock.advance(milliseconds(6'000));
    h.sync_resp("a");
    h.sync_resp("b");
    h.core.tick();
  }
  j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_RUNNING);
  EXPECT_EQ(j->round(), 3);
  EXPECT_EQ(j->restart_count(), 2);
  EXPECT_EQ(h.ins("a").action(), Ins::ACTION_RUN);

  // Reports for the adopted round are accepted.
  ASSERT_TRUE(h.report("a", "j", 3, Rep::EVENT_SUCCEEDED).is_ok());
  ASSERT_TRUE(h.report("b", "j", 3, Rep::EVENT_SUCCEEDED).is_ok());
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_SUCCEEDED);
  // The id stays taken.
  EXPECT_EQ(h.submit("j", make_spec(1, 1)).code, Code::kAlreadyExists);
}

TEST(CoordinatorCore, AdoptedJobRestartsWhenANodeNeverComesBack) {
  Harness h;
  ASSERT_TRUE(h.register_req(with_current("a", 0, 2)).is_ok());
  h.clock.advance(kLease - milliseconds(1));
  h.sync_resp("a");
  h.core.tick();
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_RUNNING);
  EXPECT_EQ(h.job("j")->round(), 3);

  h.clock.advance(milliseconds(1));
  h.core.tick();
  auto j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_RENDEZVOUS);
  EXPECT_EQ(j->round(), 4);
  EXPECT_EQ(j->restart_count(), 2);  // not counted
  EXPECT_EQ(j->last_failure().kind(), pb::Failure::KIND_NODE_LOST);
  EXPECT_NE(j->last_failure().message().find("node rank 1 did not come back"), std::string::npos)
      << j->last_failure().message();
  Ins a = h.ins("a");
  EXPECT_EQ(a.action(), Ins::ACTION_JOIN);
  EXPECT_EQ(a.round(), 4);
}

TEST(CoordinatorCore, AdoptedJobWhoseGroupsAllSucceededEnds) {
  Harness h;
  ASSERT_TRUE(h.register_req(with_current("a", 0, 2, /*group_succeeded=*/true)).is_ok());
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_RUNNING);
  ASSERT_TRUE(h.register_req(with_current("b", 1, 2, /*group_succeeded=*/true)).is_ok());
  EXPECT_EQ(h.core.job_state("j"), pb::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(h.ins("a").last_job().state(), pb::JOB_STATE_SUCCEEDED);
}

// ================================================================================== watch

TEST(CoordinatorCore, WatchJobReturnsEventsInOrderAndOutcomeWhenDone) {
  Harness h;
  EXPECT_EQ(h.core.last_event_seq("j"), 0u);
  h.start_job("j", make_spec(1, 1), {"a"});
  uint64_t mid = h.core.last_event_seq("j");
  ASSERT_GE(mid, 4u);

  auto w = h.watch("j", 0);
  ASSERT_EQ(w.events_size(), static_cast<int>(mid));
  for (int i = 0; i < w.events_size(); ++i)
    EXPECT_EQ(w.events(i).seq(), static_cast<uint64_t>(i + 1));
  EXPECT_FALSE(w.done());
  EXPECT_FALSE(w.has_outcome());
  EXPECT_EQ(w.dropped(), 0u);
  EXPECT_EQ(w.state(), pb::JOB_STATE_RUNNING);

  auto none = h.watch("j", mid);
  EXPECT_EQ(none.events_size(), 0);
  EXPECT_FALSE(none.done());

  ASSERT_TRUE(h.report("a", "j", 0, Rep::EVENT_SUCCEEDED).is_ok());
  uint64_t last = h.core.last_event_seq("j");
  ASSERT_GT(last, mid);
  auto rest = h.watch("j", mid);
  ASSERT_EQ(rest.events_size(), static_cast<int>(last - mid));
  EXPECT_EQ(rest.events(0).seq(), mid + 1);
  EXPECT_EQ(rest.events(rest.events_size() - 1).state(), pb::JOB_STATE_SUCCEEDED);
  EXPECT_TRUE(rest.done());
  EXPECT_EQ(rest.outcome().job_id(), "j");
  EXPECT_EQ(rest.outcome().state(), pb::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(rest.outcome().exit_code(), 0);

  // States in the order they happened.
  std::vector<pb::JobState> states;
  const auto everything = h.watch("j", 0);
  for (const auto& ev : everything.events()) {
    if (ev.what_case() == pb::JobEvent::kState) states.push_back(ev.state());
  }
  EXPECT_EQ(states, (std::vector<pb::JobState>{pb::JOB_STATE_PENDING, pb::JOB_STATE_RENDEZVOUS,
                                               pb::JOB_STATE_RUNNING, pb::JOB_STATE_SUCCEEDED}));

  auto caught_up = h.watch("j", last);
  EXPECT_EQ(caught_up.events_size(), 0);
  EXPECT_TRUE(caught_up.done());

  pb::WatchJobRequest unknown;
  unknown.set_job_id("nope");
  pb::WatchJobResponse resp;
  EXPECT_EQ(h.core.watch_job(unknown, &resp).code, Code::kNotFound);
}

TEST(CoordinatorCore, WatchJobIsNotDoneUntilEveryEventWasReturned) {
  Harness h;
  auto spec = make_spec(1, 1);
  spec.set_forward_logs(true);
  h.start_job("j", spec, {"a"});
  pb::PushLogsRequest logs;
  logs.set_node_id("a");
  logs.set_job_id("j");
  for (int i = 0; i < 2'500; ++i) {
    auto* l = logs.add_lines();
    l->set_rank(0);
    l->set_text("line " + std::to_string(i));
  }
  ASSERT_TRUE(h.core.push_logs(logs).is_ok());
  pb::CancelJobRequest cancel;
  cancel.set_job_id("j");
  ASSERT_TRUE(h.core.cancel_job(cancel).is_ok());

  auto first = h.watch("j", 0);
  ASSERT_GT(first.events_size(), 0);
  EXPECT_LT(static_cast<uint64_t>(first.events_size()), h.core.last_event_seq("j"));
  EXPECT_FALSE(first.done());  // ended, but events are left
  uint64_t after = first.events(first.events_size() - 1).seq();
  auto second = h.watch("j", after);
  ASSERT_GT(second.events_size(), 0);
  EXPECT_EQ(second.events(0).seq(), after + 1);
  EXPECT_EQ(second.events(second.events_size() - 1).seq(), h.core.last_event_seq("j"));
  EXPECT_TRUE(second.done());
  EXPECT_EQ(second.outcome().state(), pb::JOB_STATE_CANCELLED);
  EXPECT_EQ(second.outcome().exit_code(), 143);
}

TEST(CoordinatorCore, WatchJobReportsDroppedEventsBeyondTheBound) {
  CoordinatorOptions o = default_options();
  o.max_events_per_job = 5;
  Harness h(o);
  auto spec = make_spec(1, 1);
  spec.set_forward_logs(true);
  h.start_job("j", spec, {"a"});
  const uint64_t base = h.core.last_event_seq("j");
  pb::PushLogsRequest logs;
  logs.set_node_id("a");
  logs.set_job_id("j");
  for (int i = 0; i < 10; ++i) logs.add_lines()->set_text("l" + std::to_string(i));
  ASSERT_TRUE(h.core.push_logs(logs).is_ok());
  ASSERT_EQ(h.core.last_event_seq("j"), base + 10);

  auto w = h.watch("j", 0);
  EXPECT_EQ(w.dropped(), base + 5);  // everything before the last 5 is gone
  ASSERT_EQ(w.events_size(), 5);
  EXPECT_EQ(w.events(0).seq(), base + 6);
  EXPECT_EQ(w.events(4).seq(), base + 10);
  EXPECT_EQ(w.events(0).log().text(), "l5");

  auto w8 = h.watch("j", base + 5);
  EXPECT_EQ(w8.dropped(), 0u);
  EXPECT_EQ(w8.events_size(), 5);
  auto w10 = h.watch("j", base + 7);
  EXPECT_EQ(w10.dropped(), 0u);
  ASSERT_EQ(w10.events_size(), 3);
  EXPECT_EQ(w10.events(0).seq(), base + 8);
}

// A live watcher that is behind holds pushes back instead of losing lines: the push is refused
// as RESOURCE_EXHAUSTED (the node retries it), accepted once the watcher has read, and once the
// watcher has gone quiet for its poll's wait plus the grace, the bound drops old lines again.
TEST(CoordinatorCore, ASlowWatcherHoldsPushesBackInsteadOfLosingLines) {
  CoordinatorOptions o = default_options();
  o.max_events_per_job = 8;
  Harness h(o);
  auto spec = make_spec(1, 1);
  spec.set_forward_logs(true);
  h.start_job("j", spec, {"a"});
  auto push = [&](int n) {
    pb::PushLogsRequest logs;
    logs.set_node_id("a");
    logs.set_job_id("j");
    for (int i = 0; i < n; ++i) logs.add_lines()->set_text("line");
    return h.core.push_logs(logs);
  };
  pb::WatchJobRequest req;
  req.set_job_id("j");
  req.set_after_seq(h.core.last_event_seq("j"));
  req.set_wait_ms(1000);
  pb::WatchJobResponse resp;
  ASSERT_TRUE(h.core.watch_job(req, &resp).is_ok());  // a launcher, up to date, polling
  const uint64_t read = h.core.last_event_seq("j");

  ASSERT_TRUE(push(6).is_ok());
  RpcStatus held = push(6);  // 12 unread lines do not fit in 8
  EXPECT_EQ(held.code, Code::kResourceExhausted);
  EXPECT_NE(held.message.find("has not read its output yet"), std::string::npos) << held.message;
  EXPECT_EQ(h.core.last_event_seq("j"), read + 6) << "nothing of the refused push was kept";

  auto w = h.watch("j", read + 6);  // the launcher caught up
  EXPECT_EQ(w.dropped(), 0u);
  ASSERT_TRUE(push(6).is_ok());
  EXPECT_EQ(h.watch("j", read + 6).dropped(), 0u) << "every line is still there to read";

  h.clock.advance(std::chrono::milliseconds(1000) + o.watcher_grace);  // the launcher is gone
  ASSERT_TRUE(push(6).is_ok());
  EXPECT_GT(h.watch("j", read + 6).dropped(), 0u) << "with nobody reading, the bound drops";
}

// Only a node that takes part in the job may push its logs; a job must forward logs.
TEST(CoordinatorCore, PushLogsRequiresForwardLogsAndANodeOfTheJob) {
  Harness h;
  h.start_job("j", make_spec(1, 1), {"a"});
  uint64_t seq = h.core.last_event_seq("j");
  pb::PushLogsRequest logs;
  logs.set_node_id("a");
  logs.set_job_id("j");
  logs.add_lines()->set_text("hello");
  EXPECT_EQ(h.core.push_logs(logs).code, Code::kFailedPrecondition);
  EXPECT_EQ(h.core.last_event_seq("j"), seq);
  logs.set_job_id("nope");
  EXPECT_EQ(h.core.push_logs(logs).code, Code::kNotFound);

  auto spec = make_spec(1, 1);
  spec.set_forward_logs(true);
  ASSERT_TRUE(h.add_node("b").is_ok());
  ASSERT_TRUE(h.submit("k", spec).is_ok());
  logs.set_job_id("k");
  logs.set_node_id("ghost");
  EXPECT_EQ(h.core.push_logs(logs).code, Code::kNotFound);
  uint64_t kseq = h.core.last_event_seq("k");
  logs.set_node_id("b");
  EXPECT_EQ(h.core.push_logs(logs).code, Code::kFailedPrecondition) << "b has not joined k";
  logs.set_node_id("a");
  EXPECT_EQ(h.core.push_logs(logs).code, Code::kFailedPrecondition) << "a runs another job";
  EXPECT_EQ(h.core.last_event_seq("k"), kseq);
  ASSERT_TRUE(h.join("b", "k", 0).is_ok());
  kseq = h.core.last_event_seq("k");
  logs.set_node_id("b");
  ASSERT_TRUE(h.core.push_logs(logs).is_ok());
  EXPECT_EQ(h.core.last_event_seq("k"), kseq + 1);
  auto w = h.watch("k", kseq);
  ASSERT_EQ(w.events_size(), 1);
  EXPECT_EQ(w.events(0).log().text(), "hello");
}

// ================================================================================= limits
// What a peer holding the token can make the coordinator keep is bounded (request_limits.h).

TEST(CoordinatorLimits, AnAdoptedAssignmentOfTenMillionNodesIsRefusedAndAllocatesNothing) {
  Harness h;
  auto req = Harness::node_req("a");
  auto* cur = req.mutable_current();
  cur->set_job_id("j");
  *cur->mutable_spec() = make_spec(1, 2);
  cur->mutable_assignment()->set_num_nodes(10'000'000);
  cur->mutable_assignment()->set_node_rank(0);
  auto st = h.register_req(req);
  EXPECT_EQ(st.code, Code::kInvalidArgument);
  EXPECT_NE(st.message.find("impossible assignment"), std::string::npos) << st.message;
  EXPECT_EQ(h.core.node_count(), 0u);
  EXPECT_EQ(h.core.job_count(), 0u);
  cur->mutable_spec()->set_max_nodes(10'000'000);
  EXPECT_EQ(h.register_req(req).code, Code::kInvalidArgument) << "max_nodes is bounded too";
}

TEST(CoordinatorLimits, HugeOrControlCharacterHostNamesAndAddressesAreRefusedWithoutEchoingThem) {
  Harness h;
  auto req = Harness::node_req("a");
  req.set_hostname(std::string(3 << 20, 'h'));
  auto st = h.register_req(req);
  EXPECT_EQ(st.code, Code::kInvalidArgument);
  EXPECT_LT(st.message.size(), 400u) << "the error must not echo the 3 MB value";
  EXPECT_NE(st.message.find("3145728 bytes"), std::string::npos) << st.message;
  req = Harness::node_req("a");
  req.set_address("1.2.3.4\nINJECTED LINE");
  st = h.register_req(req);
  EXPECT_EQ(st.code, Code::kInvalidArgument);
  EXPECT_EQ(st.message.find('\n'), std::string::npos) << st.message;
  EXPECT_NE(st.message.find("\\x0a"), std::string::npos) << st.message;
  pb::RegisterNodeRequest long_id = Harness::node_req(std::string(50 << 20, 'n'));
  st = h.register_req(long_id);
  EXPECT_EQ(st.code, Code::kInvalidArgument);
  EXPECT_LT(st.message.size(), 400u);
  EXPECT_EQ(h.core.node_count(), 0u);
}

TEST(CoordinatorLimits, AMachineRankBeyondTheJobsNodesIsRefusedAtJoin) {
  Harness h;
  ASSERT_TRUE(h.add_node("a", 7).is_ok());
  ASSERT_TRUE(h.submit("j", make_spec(2, 2)).is_ok());
  auto st = h.join("a", "j", 0);
  EXPECT_EQ(st.code, Code::kInvalidArgument);
  EXPECT_NE(st.message.find("machine_rank 7"), std::string::npos) << st.message;
  EXPECT_NE(st.message.find("at most 2 nodes"), std::string::npos) << st.message;
  EXPECT_EQ(h.register_req(Harness::node_req("b", 1'000'000)).code, Code::kInvalidArgument);
}

TEST(CoordinatorLimits, LogsFromANodeOutsideTheJobAreNotStoredAndLongLinesAreCut) {
  Harness h;
  auto spec = make_spec(1, 1);
  spec.set_forward_logs(true);
  h.start_job("j", spec, {"a"});
  ASSERT_TRUE(h.add_node("intruder").is_ok());
  const size_t before = h.core.stored_bytes();
  pb::PushLogsRequest flood;
  flood.set_node_id("intruder");
  flood.set_job_id("j");
  for (int i = 0; i < 100; ++i) flood.add_lines()->set_text(std::string(60'000, 'x'));
  EXPECT_EQ(h.core.push_logs(flood).code, Code::kFailedPrecondition);
  EXPECT_EQ(h.core.stored_bytes(), before);
  pb::PushLogsRequest big;
  big.set_node_id("a");
  big.set_job_id("j");
  big.add_lines()->set_text(std::string(1 << 20, 'y'));
  ASSERT_TRUE(h.core.push_logs(big).is_ok());
  auto w = h.watch("j", h.core.last_event_seq("j") - 1);
  ASSERT_EQ(w.events_size(), 1);
  EXPECT_LT(w.events(0).log().text().size(), limits::kMaxLineBytes + 64);
  EXPECT_NE(w.events(0).log().text().find("bytes cut]"), std::string::npos);
}

TEST(CoordinatorLimits, AJobsEventsAreBoundedByBytes) {
  CoordinatorOptions o = default_options();
  o.max_event_bytes_per_job = 1 << 20;
  Harness h(o);
  auto spec = make_spec(1, 1);
  spec.set_forward_logs(true);
  h.start_job("j", spec, {"a"});
  pb::PushLogsRequest logs;
  logs.set_node_id("a");
  logs.set_job_id("j");
  for (int i = 0; i < 1000; ++i) logs.add_lines()->set_text(std::string(10'000, 'z'));
  for (int k = 0; k < 10; ++k) ASSERT_TRUE(h.core.push_logs(logs).is_ok());  // 100 MB pushed
  EXPECT_LT(h.core.stored_bytes(), (1u << 20) + (64u << 10));
  auto w = h.watch("j", 0);
  EXPECT_GT(w.dropped(), 9000u) << "a watcher is told how many it missed";
}

// A member of the last round repeats a late FAILED report of a job that has ended: what is kept
// stays bounded (one failure per local rank and one for the node, each cut).
TEST(CoordinatorLimits, RepeatedLateFailureReportsOfAnEndedJobKeepABoundedRecord) {
  Harness h;
  h.start_job("j", make_spec(1, 1, 2), {"a"});
  ASSERT_TRUE(h.report("a", "j", 0, Rep::EVENT_FAILED, {exit_failure(0, 1, 0, 1000)}).is_ok());
  ASSERT_EQ(h.core.job_state("j"), pb::JOB_STATE_FAILED);
  const size_t after_end = h.core.stored_bytes();
  std::vector<pb::Failure> fat{exit_failure(1, 2, 0, 900, std::string(1 << 20, 'm')),
                               exit_failure(0, 3, 0, 950, std::string(1 << 20, 'n'))};
  for (int i = 0; i < 40; ++i) h.report("a", "j", 0, Rep::EVENT_FAILED, fat);
  EXPECT_LT(h.core.stored_bytes() - after_end, 8 * limits::kMaxTextBytes) << "40 x 2 MB reports";
  std::vector<pb::Failure> too_many(10, exit_failure(0, 1, 0, 1));
  EXPECT_EQ(h.report("a", "j", 0, Rep::EVENT_FAILED, too_many).code, Code::kInvalidArgument);
}

TEST(CoordinatorLimits, EndedJobsAndLostNodesAreForgottenAfterTheRetention) {
  CoordinatorOptions o = default_options();
  o.retention = milliseconds(60'000);
  Harness h(o);
  h.start_job("j", make_spec(1, 1), {"a"});
  ASSERT_TRUE(h.report("a", "j", 0, Rep::EVENT_SUCCEEDED).is_ok());
  ASSERT_TRUE(h.add_node("b").is_ok());
  h.clock.advance(kLease + milliseconds(1));
  h.sync_resp("a");
  h.core.tick();  // b is lost now
  ASSERT_TRUE(h.node("b")->lost());
  h.clock.advance(milliseconds(30'000));
  h.sync_resp("a");
  h.core.tick();
  EXPECT_TRUE(h.job("j").has_value()) << "within the retention";
  EXPECT_TRUE(h.node("b").has_value());
  h.clock.advance(milliseconds(31'000));
  h.sync_resp("a");
  h.core.tick();
  EXPECT_FALSE(h.job("j").has_value()) << "an ended job is forgotten after the retention";
  EXPECT_FALSE(h.node("b").has_value()) << "a lost node is forgotten after the retention";
  EXPECT_TRUE(h.node("a").has_value()) << "a live node stays";
}

TEST(CoordinatorLimits, StatusListsTheMostRecentJobsWithCutCommandLines) {
  Harness h;
  auto spec = make_spec(1, 1);
  for (int i = 0; i < 20; ++i) spec.add_argv(std::string(1000, 'a'));
  for (int i = 0; i < 150; ++i) {
    ASSERT_TRUE(h.submit("j" + std::to_string(i), spec).is_ok());
    pb::CancelJobRequest c;
    c.set_job_id("j" + std::to_string(i));
    ASSERT_TRUE(h.core.cancel_job(c).is_ok());
  }
  auto st = h.status();
  ASSERT_EQ(st.jobs_size(), static_cast<int>(limits::kStatusJobs));
  EXPECT_EQ(st.jobs(0).job_id(), "j50");
  EXPECT_EQ(st.jobs(st.jobs_size() - 1).job_id(), "j149");
  size_t argv_bytes = 0;
  for (const auto& a : st.jobs(0).spec().argv()) argv_bytes += a.size();
  EXPECT_LE(argv_bytes, limits::kStatusArgvBytes);
  EXPECT_LT(st.ByteSizeLong(), 1u << 20);
}

TEST(CoordinatorLimits, TheJobAndNodeCapsForgetEndedOnesFirstAndThenRefuse) {
  Harness h;
  auto spec = make_spec(1, 1);
  for (size_t i = 0; i < limits::kMaxJobs; ++i)
    ASSERT_TRUE(h.submit("j" + std::to_string(i), spec).is_ok());
  auto st = h.submit("one-more", spec);
  EXPECT_EQ(st.code, Code::kResourceExhausted) << "every kept job is still waiting for nodes";
  pb::CancelJobRequest c;
  c.set_job_id("j3");
  ASSERT_TRUE(h.core.cancel_job(c).is_ok());
  EXPECT_TRUE(h.submit("one-more", spec).is_ok()) << "the ended job makes room";
  EXPECT_EQ(h.core.job_count(), limits::kMaxJobs);
  EXPECT_FALSE(h.job("j3").has_value());
}

// The bound docs/operations.md states: per node and per job, whatever the requests were.
TEST(CoordinatorLimits, StoredBytesStayWithinThePerNodeAndPerJobBound) {
  Harness h;
  auto spec = make_spec(1, 2, 4);
  spec.set_forward_logs(true);
  h.start_job("j", spec, {"a", "b"});
  pb::SyncRequest sync;
  sync.set_node_id("a");
  for (int r = 0; r < limits::kMaxProcessesPerNode; ++r) {
    auto* p = sync.add_progress();
    p->set_in_flight(std::string(10'000, 'p'));
    p->set_last_finished(std::string(10'000, 'q'));
    p->set_rank(-1);  // the longest varint
    p->set_started(~0ull);
    p->set_in_flight_ms(-1);
    p->set_heartbeat_age_ms(-1);
    p->set_steps(~0ull);
    p->set_step_age_ms(-1);
    p->set_steps_per_second(1e11);
    p->set_compute_seconds_per_step(1e11);
    p->set_wait_seconds_per_step(1e11);
    p->set_has_rate(true);
  }
  pb::SyncResponse resp;
  ASSERT_TRUE(h.core.sync(sync, &resp).is_ok());
  pb::PushLogsRequest logs;
  logs.set_node_id("b");
  logs.set_job_id("j");
  for (int i = 0; i < 1000; ++i) logs.add_lines()->set_text(std::string(100'000, 'l'));
  for (int k = 0; k < 5; ++k) ASSERT_TRUE(h.core.push_logs(logs).is_ok());
  // 2 nodes, 1 job: per node info + progress, per job spec + events + failures.
  const size_t per_node =
      2 * limits::kMaxHostBytes + 4 * limits::kMaxIdBytes +
      limits::kMaxProcessesPerNode * (2 * (limits::kMaxProgressBytes + 32) + 112) + 4096;
  const size_t per_job = limits::kMaxSpecBytes + default_options().max_event_bytes_per_job + 4096;
  EXPECT_LT(h.core.stored_bytes(), 2 * per_node + per_job);
}

// =============================================================================== versions

TEST(CoordinatorCore, SyncVersionChangesOnlyWhenTheInstructionChanges) {
  Harness h;
  ASSERT_TRUE(h.add_node("a").is_ok());
  uint64_t v1 = h.sync_resp("a").version();
  EXPECT_GE(v1, 1u);
  EXPECT_EQ(h.core.node_version("a"), v1);
  EXPECT_EQ(h.core.node_version("nobody"), 0u);

  pb::SyncRequest req;
  req.set_node_id("a");
  req.set_known_version(v1);
  pb::SyncResponse same;
  ASSERT_TRUE(h.core.sync(req, &same).is_ok());
  EXPECT_EQ(same.version(), v1);
  pb::SyncResponse via_instruction;
  ASSERT_TRUE(h.core.instruction("a", &via_instruction).is_ok());
  EXPECT_EQ(via_instruction.version(), v1);

  ASSERT_TRUE(h.submit("j", make_spec(1, 2)).is_ok());
  auto joined = h.sync_resp("a");
  EXPECT_EQ(joined.version(), v1 + 1);
  EXPECT_EQ(joined.instruction().action(), Ins::ACTION_JOIN);
  EXPECT_EQ(h.sync_resp("a").version(), v1 + 1);
}

TEST(CoordinatorCore, SyncVersionIsStableForASpecWithExtraEnv) {
  Harness h;
  ASSERT_TRUE(h.add_node("a").is_ok());
  auto spec = make_spec(1, 2);
  for (int i = 0; i < 16; ++i)
    (*spec.mutable_extra_env())["VAR_" + std::to_string(i)] = std::to_string(i);
  ASSERT_TRUE(h.submit("j", spec).is_ok());
  auto first = h.sync_resp("a");
  ASSERT_EQ(first.instruction().action(), Ins::ACTION_JOIN);
  EXPECT_EQ(first.instruction().spec().extra_env_size(), 16);
  // Nothing changed: the same version every time, or long polls would return at once.
  for (int i = 0; i < 20; ++i) {
    EXPECT_EQ(h.sync_resp("a").version(), first.version()) << "sync " << i;
  }
}

TEST(CoordinatorCore, TakeChangesReportsWhatChanged) {
  Harness h;
  ASSERT_TRUE(h.add_node("a").is_ok());
  ASSERT_TRUE(h.add_node("b").is_ok());
  auto c = h.core.take_changes();
  // A new node changes its own instruction only: an open round waits for joins, not
  // registrations (an elastic job grows at the next tick, which wakes everyone).
  EXPECT_FALSE(c.all_nodes);
  EXPECT_EQ(c.nodes, (std::set<std::string>{"a", "b"}));
  // A known node registering again may bring a new address or probe port: its peers hear.
  ASSERT_TRUE(h.add_node("a").is_ok());
  c = h.core.take_changes();
  EXPECT_TRUE(c.all_nodes);
  c = h.core.take_changes();
  EXPECT_FALSE(c.all_nodes);
  EXPECT_TRUE(c.nodes.empty());
  EXPECT_TRUE(c.jobs.empty());

  ASSERT_TRUE(h.submit("j", make_spec(2, 2)).is_ok());
  c = h.core.take_changes();
  EXPECT_TRUE(c.all_nodes);
  EXPECT_EQ(c.jobs, (std::set<std::string>{"j"}));

  ASSERT_TRUE(h.join("a", "j", 0).is_ok());
  c = h.core.take_changes();
  EXPECT_FALSE(c.all_nodes);
  EXPECT_EQ(c.nodes, (std::set<std::string>{"a"}));

  // A sync that changes nothing reports nothing.
  h.sync_resp("a");
  c = h.core.take_changes();
  EXPECT_FALSE(c.all_nodes);
  EXPECT_TRUE(c.nodes.empty());
  EXPECT_TRUE(c.jobs.empty());

  ASSERT_TRUE(h.join("b", "j", 0).is_ok());  // closes the round
  c = h.core.take_changes();
  EXPECT_TRUE(c.all_nodes);
  EXPECT_TRUE(c.nodes.contains("b"));
  EXPECT_EQ(c.jobs, (std::set<std::string>{"j"}));

  ASSERT_TRUE(h.report("a", "j", 0, Rep::EVENT_SUCCEEDED).is_ok());
  ASSERT_TRUE(h.report("b", "j", 0, Rep::EVENT_SUCCEEDED).is_ok());
  c = h.core.take_changes();
  EXPECT_TRUE(c.nodes.contains("a"));
  EXPECT_TRUE(c.nodes.contains("b"));
  EXPECT_TRUE(c.jobs.contains("j"));
}

}  // namespace
}  // namespace accel::coordinator

namespace accel::coordinator {
namespace {

// Registers `ids` with probe ports (7000 + index), submits `job` and has every node join.
void start_probed_job(Harness& h, const std::string& job, const pb::JobSpec& spec,
                      const std::vector<std::string>& ids) {
  for (size_t i = 0; i < ids.size(); ++i) {
    auto req = Harness::node_req(ids[i]);
    req.set_probe_port(7000 + static_cast<int>(i));
    ASSERT_TRUE(h.register_req(req).is_ok()) << ids[i];
  }
  ASSERT_TRUE(h.submit(job, spec).is_ok());
  h.join_all(job, ids);
  ASSERT_EQ(h.core.job_state(job), pb::JOB_STATE_RUNNING);
}

pb::Failure network_failure(int64_t time_ms, bool before_start = false) {
  pb::Failure f;
  f.set_kind(pb::Failure::KIND_NETWORK);
  f.set_rank(-1);
  f.set_local_rank(-1);
  f.set_message("host-b cannot reach host-c (c.cluster.internal) since 13:50:13.007 (for 10.2 s)");
  f.set_time_unix_ms(time_ms);
  f.set_before_start(before_start);
  return f;
}

TEST(CoordinatorPeers, EachNodeIsToldItsNeighboursAndNodeZeroWithTheirProbePorts) {
  Harness h;
  auto spec = make_spec(3, 3);
  spec.set_network_timeout_ms(10'000);
  start_probed_job(h, "j", spec, {"a", "b", "c"});
  Ins b = h.ins("b");
  ASSERT_EQ(b.action(), Ins::ACTION_RUN);
  ASSERT_EQ(b.assignment().peers_size(), 2);
  std::set<std::string> seen;
  for (const auto& p : b.assignment().peers()) {
    seen.insert(p.node_id());
    EXPECT_EQ(p.hostname(), host_of(p.node_id()));
    EXPECT_EQ(p.address(), addr_of(p.node_id()));
    EXPECT_EQ(p.probe_port(), p.node_id() == "a" ? 7000 : 7002);
    EXPECT_EQ(p.node_rank(), p.node_id() == "a" ? 0 : 2);
  }
  EXPECT_EQ(seen, (std::set<std::string>{"a", "c"}));

  // c's agent registers again with a new probe port (its workers still run): b is told it.
  auto again = Harness::node_req("c");
  again.set_probe_port(7777);
  auto* cur = again.mutable_current();
  cur->set_job_id("j");
  cur->set_round(0);
  *cur->mutable_spec() = spec;
  cur->mutable_assignment()->set_node_rank(2);
  cur->mutable_assignment()->set_num_nodes(3);
  ASSERT_TRUE(h.register_req(again).is_ok());
  int c_port = 0;
  const Ins told = h.ins("b");
  for (const auto& p : told.assignment().peers()) {
    if (p.node_id() == "c") c_port = p.probe_port();
  }
  EXPECT_EQ(c_port, 7777);

  // Off: no peers, and no probing.
  Harness off;
  auto quiet = make_spec(2, 2);
  quiet.set_network_timeout_ms(0);
  start_probed_job(off, "k", quiet, {"a", "b"});
  EXPECT_EQ(off.ins("a").assignment().peers_size(), 0);
}

TEST(CoordinatorPeers, ALargeJobsNodesProbeABoundedNumberOfPeers) {
  Harness h;
  auto spec = make_spec(40, 40, 1);
  spec.set_network_timeout_ms(10'000);
  std::vector<std::string> ids;
  for (int i = 0; i < 40; ++i) ids.push_back("n" + std::to_string(100 + i));
  start_probed_job(h, "j", spec, ids);
  for (const auto& id : {"n100", "n120", "n139"}) {
    Ins in = h.ins(id);
    EXPECT_LE(in.assignment().peers_size(), 2 * limits::kProbeNeighbours + 1) << id;
    bool has_zero = false;
    for (const auto& p : in.assignment().peers()) {
      EXPECT_NE(p.node_id(), id);
      has_zero = has_zero || p.node_rank() == 0;
    }
    EXPECT_EQ(has_zero, std::string(id) != "n100") << id;
  }
  EXPECT_EQ(h.ins("n120").assignment().peers_size(), 2 * limits::kProbeNeighbours + 1);
}

TEST(CoordinatorPeers, APartitionWhileRunningRestartsUncountedAndIsTheRootCause) {
  Harness h;
  auto spec = make_spec(3, 3);
  spec.set_network_timeout_ms(10'000);
  spec.set_max_restarts(0);
  start_probed_job(h, "j", spec, {"a", "b", "c"});
  const int64_t t = h.clock.unix_ms();
  ASSERT_TRUE(h.report("b", "j", 0, Rep::EVENT_FAILED, {network_failure(t)}).is_ok());
  auto j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_RENDEZVOUS);
  EXPECT_EQ(j->restart_count(), 0);  // no restarts allowed, and yet a new round
  auto w = h.watch("j", 0);
  EXPECT_TRUE(has_message(w, "restarting: network: host-b cannot reach host-c"));
  EXPECT_TRUE(has_message(w, "not counted against max_restarts"));

  // A partition that kept the next round's nodes apart for join_timeout counts: none are left.
  h.join_all("j", {"a", "b", "c"});
  ASSERT_TRUE(
      h.report("b", "j", 1, Rep::EVENT_FAILED, {network_failure(t + 60'000, true)}).is_ok());
  j = h.job("j");
  EXPECT_EQ(j->state(), pb::JOB_STATE_FAILED);
  EXPECT_EQ(j->exit_code(), 1);
  pb::Instruction told = h.ins("a");
  const std::string& summary = told.last_job().summary();
  EXPECT_NE(marked_line(summary).find("network: host-b cannot reach host-c"), std::string::npos)
      << summary;
  EXPECT_NE(summary.find("(host-b's workers of the round never started)"), std::string::npos)
      << summary;
  EXPECT_NE(summary.find("earlier: round 0"), std::string::npos) << summary;
}

TEST(CoordinatorLimits, ProbePortsAndPeerListsAreChecked) {
  Harness h;
  auto req = Harness::node_req("a");
  req.set_probe_port(70000);
  EXPECT_EQ(h.register_req(req).code, Code::kInvalidArgument);
  req.set_probe_port(-1);
  EXPECT_EQ(h.register_req(req).code, Code::kInvalidArgument);
  auto spec = make_spec(1, 1);
  spec.set_network_timeout_ms(-5);
  auto st = h.submit("j", spec);
  EXPECT_EQ(st.code, Code::kInvalidArgument);
  EXPECT_NE(st.message.find("network_timeout_ms"), std::string::npos) << st.message;
}

}  // namespace
}  // namespace accel::coordinator

namespace accel::coordinator {
namespace {

TEST(CoordinatorLimits, TheNodeAndJobCapsAreSettingsAndTheRefusalNamesThem) {
  CoordinatorOptions o = default_options();
  o.max_nodes = 3;
  o.max_jobs = 2;
  Harness h(o);
  for (const char* id : {"a", "b", "c"}) ASSERT_TRUE(h.add_node(id).is_ok()) << id;
  auto st = h.add_node("d");
  EXPECT_EQ(st.code, Code::kResourceExhausted);
  EXPECT_NE(st.message.find("keeps 3 nodes, its most (coordinator_max_nodes)"), std::string::npos)
      << st.message;
  // A lost node makes room.
  h.clock.advance(kLease + milliseconds(1));
  for (const char* id : {"a", "b"}) (void)h.sync_resp(id);
  h.core.tick();
  EXPECT_TRUE(h.add_node("d").is_ok());
  EXPECT_FALSE(h.node("c").has_value());

  auto spec = make_spec(1, 1);
  ASSERT_TRUE(h.submit("j1", spec).is_ok());
  ASSERT_TRUE(h.submit("j2", spec).is_ok());
  st = h.submit("j3", spec);
  EXPECT_EQ(st.code, Code::kResourceExhausted);
  EXPECT_NE(st.message.find("keeps 2 jobs, its most (coordinator_max_jobs)"), std::string::npos)
      << st.message;
}

}  // namespace
}  // namespace accel::coordinator

// LongPolls over a real CoordinatorCore (FakeClock, no gRPC): which parked Sync and WatchJob
// calls a change of the core, or the end of their wait, answers.
#include "agent/coordinator/long_polls.h"

#include <gtest/gtest.h>

namespace accel::coordinator {
namespace {

using std::chrono::milliseconds;
using Time = LongPolls::Time;

pb::JobSpec spec() {
  pb::JobSpec s;
  s.add_argv("/bin/true");
  s.set_processes_per_node(1);
  s.set_min_nodes(1);
  s.set_max_nodes(1);
  s.set_join_timeout_ms(60'000);
  s.set_stop_timeout_ms(5'000);
  return s;
}

struct PollsTest : ::testing::Test {
  PollsTest()
      : core(clock, CoordinatorOptions{.coordinator_id = "c", .verify_reused_instructions = true}) {
  }

  void add_node(const std::string& id, const std::string& only_job = "") {
    pb::RegisterNodeRequest req;
    req.set_only_job_id(only_job);
    req.set_node_id(id);
    req.set_hostname(id);
    req.set_address(id);
    req.set_machine_rank(-1);
    pb::RegisterNodeResponse resp;
    ASSERT_TRUE(core.register_node(req, &resp).is_ok());
  }
  uint64_t version_of(const std::string& id) {
    pb::SyncResponse resp;
    EXPECT_TRUE(core.instruction(id, &resp).is_ok());
    return resp.version();
  }
  // Parks a Sync of `id` at its current version; the answer lands in `out`.
  void park(const std::string& id, Time deadline, std::optional<pb::SyncResponse>& out,
            RpcStatus* status = nullptr, bool omit = false) {
    polls.park_sync(core, id, version_of(id), omit, deadline,
                    [&out, status](const RpcStatus& st, pb::SyncResponse& resp) {
                      if (status != nullptr) *status = st;
                      out = resp;
                    });
  }
  void submit(const std::string& job_id) {
    pb::SubmitJobRequest req;
    req.set_job_id(job_id);
    *req.mutable_spec() = spec();
    pb::SubmitJobResponse resp;
    ASSERT_TRUE(core.submit_job(req, &resp).is_ok());
  }
  size_t run(const CoordinatorCore::Changes& changes, Time now, bool expire) {
    auto finish = polls.collect(core, changes, now, expire);
    for (auto& f : finish) f();
    return finish.size();
  }

  FakeClock clock;
  CoordinatorCore core;
  LongPolls polls;
  Time t0 = std::chrono::steady_clock::now();
  Time later = t0 + milliseconds(30'000);
};

TEST_F(PollsTest, ASyncIsAnsweredWhenItsNodesInstructionChangesAndNotBefore) {
  add_node("a", "j");
  add_node("b", "another-job");  // the submit below changes nothing for b
  (void)core.take_changes();
  std::optional<pb::SyncResponse> a, b;
  park("a", later, a);
  park("b", later, b);
  EXPECT_EQ(run(core.take_changes(), t0, false), 0u);  // nothing changed
  submit("j");
  EXPECT_EQ(run(core.take_changes(), t0, false), 1u);
  ASSERT_TRUE(a);
  EXPECT_FALSE(b);  // still parked
  EXPECT_EQ(a->instruction().action(), pb::Instruction::ACTION_JOIN);
  EXPECT_EQ(a->instruction().job_id(), "j");
  EXPECT_GT(a->version(), 0u);
  EXPECT_EQ(polls.syncs(), 1u);
}

TEST_F(PollsTest, AnUnchangedSyncIsAnsweredWhenItsWaitEnds) {
  add_node("a");
  (void)core.take_changes();
  std::optional<pb::SyncResponse> a;
  park("a", t0 + milliseconds(100), a);
  EXPECT_EQ(run({}, t0 + milliseconds(99), /*expire=*/true), 0u);
  EXPECT_EQ(run({}, t0 + milliseconds(100), /*expire=*/false), 0u);  // only the tick expires
  EXPECT_EQ(run({}, t0 + milliseconds(100), /*expire=*/true), 1u);
  ASSERT_TRUE(a);
  EXPECT_EQ(a->version(), version_of("a"));  // the same instruction again: "nothing new"
  EXPECT_EQ(polls.syncs(), 0u);
}

// A node that asked for omit_unchanged gets the version alone when its wait ends, and the whole
// instruction when it changed while parked.
TEST_F(PollsTest, AnAgentsUnchangedInstructionIsLeftOutAndAChangedOneSent) {
  add_node("a", "j");
  (void)core.take_changes();
  std::optional<pb::SyncResponse> idle, woken;
  park("a", t0 + milliseconds(100), idle, nullptr, /*omit=*/true);
  EXPECT_EQ(run({}, t0 + milliseconds(100), /*expire=*/true), 1u);
  ASSERT_TRUE(idle);
  EXPECT_TRUE(idle->unchanged());
  EXPECT_FALSE(idle->has_instruction());
  EXPECT_EQ(idle->version(), version_of("a"));

  park("a", later, woken, nullptr, /*omit=*/true);
  submit("j");
  EXPECT_EQ(run(core.take_changes(), t0, false), 1u);
  ASSERT_TRUE(woken);
  EXPECT_FALSE(woken->unchanged());
  EXPECT_EQ(woken->instruction().action(), pb::Instruction::ACTION_JOIN);
  EXPECT_GT(woken->version(), idle->version());
}

// The tick looks only at syncs whose wait is over (a heap of deadlines), skipping those a change
// answered before.
TEST_F(PollsTest, OnlySyncsWhoseWaitIsOverAreAnsweredByTheTick) {
  add_node("a", "j");
  add_node("b", "j");
  add_node("c", "other");
  (void)core.take_changes();
  std::optional<pb::SyncResponse> a, b, c;
  park("a", t0 + milliseconds(100), a);
  park("b", t0 + milliseconds(200), b);
  park("c", t0 + milliseconds(300), c);
  submit("j");  // answers a and b now
  EXPECT_EQ(run(core.take_changes(), t0, false), 2u);
  a.reset();
  park("a", t0 + milliseconds(400), a);
  EXPECT_EQ(run({}, t0 + milliseconds(250), /*expire=*/true), 0u);
  EXPECT_EQ(run({}, t0 + milliseconds(300), /*expire=*/true), 1u);
  EXPECT_TRUE(c);
  EXPECT_FALSE(a);
  EXPECT_EQ(run({}, t0 + milliseconds(400), /*expire=*/true), 1u);
  EXPECT_TRUE(a);
  EXPECT_EQ(polls.syncs(), 0u);
}

// A cancelled sync (its connection closed) is answered UNAVAILABLE at once, once.
TEST_F(PollsTest, ACancelledSyncIsForgottenAndAnsweredOnce) {
  add_node("a");
  std::optional<pb::SyncResponse> first, second;
  RpcStatus status;
  uint64_t id = polls.park_sync(core, "a", version_of("a"), false, later,
                                [&](const RpcStatus& st, pb::SyncResponse& r) {
                                  status = st;
                                  first = r;
                                });
  park("a", later, second);
  auto finish = polls.cancel_sync(core, "a", id);
  ASSERT_TRUE(finish);
  finish();
  EXPECT_EQ(status.code, Code::kUnavailable);
  EXPECT_FALSE(polls.cancel_sync(core, "a", id)) << "already answered";
  EXPECT_FALSE(polls.cancel_sync(core, "nobody", 1));
  EXPECT_EQ(polls.syncs(), 1u);  // the other one still waits
  EXPECT_FALSE(second);
}

TEST_F(PollsTest, AWatchWaitsForTheJobsNextEvents) {
  add_node("a");
  submit("j");
  (void)core.take_changes();
  pb::WatchJobRequest req;
  req.set_job_id("j");
  req.set_after_seq(core.last_event_seq("j"));
  std::optional<pb::WatchJobResponse> got;
  polls.park_watch(req, later, [&got](const RpcStatus& st, pb::WatchJobResponse& r) {
    EXPECT_TRUE(st.is_ok());
    got = r;
  });
  EXPECT_EQ(run({}, t0, /*expire=*/true), 0u);  // no new event, wait not over
  pb::CancelJobRequest cancel;
  cancel.set_job_id("j");
  ASSERT_TRUE(core.cancel_job(cancel).is_ok());
  EXPECT_EQ(run(core.take_changes(), t0, false), 1u);
  ASSERT_TRUE(got);
  EXPECT_FALSE(got->events().empty());
  EXPECT_GT(got->events(0).seq(), req.after_seq());
}

TEST_F(PollsTest, TakeAllAnswersEveryParkedCallWithTheGivenStatus) {
  add_node("a");
  std::optional<pb::SyncResponse> a;
  RpcStatus status;
  park("a", later, a, &status);
  pb::WatchJobRequest req;
  req.set_job_id("nope");
  bool watch_answered = false;
  polls.park_watch(req, later, [&](const RpcStatus& st, pb::WatchJobResponse&) {
    watch_answered = st.code == Code::kUnavailable;
  });
  auto finish = polls.take_all(core, RpcStatus::error(Code::kUnavailable, "shutting down"));
  EXPECT_EQ(finish.size(), 2u);
  for (auto& f : finish) f();
  EXPECT_EQ(status.code, Code::kUnavailable);
  EXPECT_EQ(status.message, "shutting down");
  EXPECT_TRUE(watch_answered);
  EXPECT_EQ(polls.syncs() + polls.watches(), 0u);
}

}  // namespace
}  // namespace accel::coordinator

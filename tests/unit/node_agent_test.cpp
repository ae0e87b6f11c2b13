// NodeAgent against a fake coordinator: every call waits until the test answers it, so each
// path (register, join, run, report, refusal, re-registration, a coordinator gone for longer
// than the lease) is driven step by step. The workers are real short processes.
#include "agent/node/node_agent.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <csignal>
#include <deque>
#include <filesystem>
#include <fstream>

#include "agent/common/clock.h"
#include "agent/common/temp_dir.h"
#include "agent/node/local_coordinator.h"

namespace accel::node {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using rpc::CallCode;
using rpc::CallStatus;

template <class Req, class Resp>
struct Calls {
  struct Call {
    Req req;
    rpc::CoordinatorApi::Done<Resp> done;
  };
  std::deque<Call> pending;
  // Answers the oldest pending call.
  Req answer(CallStatus status = {}, Resp resp = {}) {
    EXPECT_FALSE(pending.empty());
    Call c = std::move(pending.front());
    pending.pop_front();
    c.done(status, resp);
    return c.req;
  }
};

class FakeCoordinator final : public rpc::CoordinatorApi {
 public:
  void register_node(const pb::RegisterNodeRequest& req, std::chrono::milliseconds,
                     Done<pb::RegisterNodeResponse> done) override {
    registers.pending.push_back({req, std::move(done)});
  }
  void sync(const pb::SyncRequest& req, std::chrono::milliseconds,
            Done<pb::SyncResponse> done) override {
    syncs.pending.push_back({req, std::move(done)});
  }
  void join_round(const pb::JoinRoundRequest& req, std::chrono::milliseconds,
                  Done<pb::JoinRoundResponse> done) override {
    joins.pending.push_back({req, std::move(done)});
  }
  void report_group(const pb::ReportGroupRequest& req, std::chrono::milliseconds,
                    Done<pb::ReportGroupResponse> done) override {
    reports.pending.push_back({req, std::move(done)});
  }
  void push_logs(const pb::PushLogsRequest& req, std::chrono::milliseconds,
                 Done<pb::PushLogsResponse> done) override {
    pushes.pending.push_back({req, std::move(done)});
  }
  [[nodiscard]] const std::string& target() const override { return target_; }

  Calls<pb::RegisterNodeRequest, pb::RegisterNodeResponse> registers;
  Calls<pb::SyncRequest, pb::SyncResponse> syncs;
  Calls<pb::JoinRoundRequest, pb::JoinRoundResponse> joins;
  Calls<pb::ReportGroupRequest, pb::ReportGroupResponse> reports;
  Calls<pb::PushLogsRequest, pb::PushLogsResponse> pushes;

 private:
  std::string target_ = "fake:1";
};

pb::JobSpec spec_of(const std::string& script, int processes = 2) {
  pb::JobSpec spec;
  spec.add_argv("/bin/sh");
  spec.add_argv("-c");
  spec.add_argv(script);
  spec.set_processes_per_node(processes);
  spec.set_min_nodes(1);
  spec.set_max_nodes(1);
  spec.set_stop_timeout_ms(2000);
  (*spec.mutable_worker_settings())["ACCEL_MIXED_PRECISION"] = "bf16";
  return spec;
}

class NodeAgentTest : public ::testing::Test {
 protected:
  void SetUp() override {
    state_dir_ = make_temp_dir("accel-node-agent-test-");
    ASSERT_FALSE(state_dir_.empty());
    options_.node_id = "node-a";
    options_.hostname = "host-a";
    options_.address = "127.0.0.1";
    options_.state_dir = state_dir_;
    options_.lease_fallback = 10s;
    options_.group.console_stdout_fd = -1;
    options_.group.console_stderr_fd = -1;
  }
  void TearDown() override {
    agent_.reset();
    std::error_code ec;
    fs::remove_all(state_dir_, ec);
  }

  void start() {
    NodeAgentHooks hooks;
    hooks.on_fatal = [this](const std::string& why) { fatal_ = why; };
    agent_ = std::make_unique<NodeAgent>(
        io_, fake_, options_,
        [this](supervisor::LogLevel, const std::string& m) { log_ += m + "\n"; }, hooks);
    agent_->start();
    run_until([&] { return !fake_->registers.pending.empty(); }, "the first RegisterNode");
  }

  // Runs the agent's io_context until `done` holds; fails after 5 s.
  template <class Pred>
  void run_until(Pred done, const std::string& what) {
    auto deadline = std::chrono::steady_clock::now() + 5s;
    while (!done()) {
      if (std::chrono::steady_clock::now() > deadline) {
        FAIL() << "timed out waiting for " << what << "; agent log:\n" << log_;
      }
      io_.run_for(5ms);
      io_.restart();
    }
  }

  void registered(int64_t lease_ms = 10'000) {
    pb::RegisterNodeResponse resp;
    resp.set_coordinator_id("coord-1");
    resp.set_lease_ms(lease_ms);
    resp.set_sync_wait_ms(lease_ms / 4);
    fake_->registers.answer({}, resp);
    run_until([&] { return !fake_->syncs.pending.empty(); }, "the first Sync");
  }

  // Answers the pending Sync with `ins` as instruction `version`.
  void instruct(uint64_t version, const pb::Instruction& ins) {
    pb::SyncResponse resp;
    resp.set_version(version);
    *resp.mutable_instruction() = ins;
    fake_->syncs.answer({}, resp);
  }

  pb::Instruction run_instruction(const pb::JobSpec& spec, int port) {
    pb::Instruction ins;
    ins.set_action(pb::Instruction::ACTION_RUN);
    ins.set_job_id("job-1");
    ins.set_round(0);
    *ins.mutable_spec() = spec;
    auto* a = ins.mutable_assignment();
    a->set_node_rank(0);
    a->set_num_nodes(1);
    a->set_rank_offset(0);
    a->set_world_size(spec.processes_per_node());
    a->set_master_addr("127.0.0.1");
    a->set_master_port(port);
    return ins;
  }

  // Joins job-1 round 0 and runs `spec` there; returns the port the agent reserved.
  int join_and_run(const pb::JobSpec& spec) {
    registered();
    pb::Instruction join;
    join.set_action(pb::Instruction::ACTION_JOIN);
    join.set_job_id("job-1");
    join.set_round(0);
    *join.mutable_spec() = spec;
    instruct(1, join);
    run_until([&] { return !fake_->joins.pending.empty(); }, "JoinRound");
    pb::JoinRoundRequest req = fake_->joins.answer();
    run_until([&] { return !fake_->syncs.pending.empty(); }, "the next Sync");
    instruct(2, run_instruction(spec, req.master_port()));
    return req.master_port();
  }

  pb::ReportGroupRequest next_report() {
    run_until([&] { return !fake_->reports.pending.empty(); }, "a ReportGroup");
    return fake_->reports.answer();
  }

  boost::asio::io_context io_;
  std::shared_ptr<FakeCoordinator> fake_ = std::make_shared<FakeCoordinator>();
  NodeAgentOptions options_;
  std::unique_ptr<NodeAgent> agent_;
  std::string state_dir_;
  std::string log_;
  std::optional<std::string> fatal_;
};

TEST_F(NodeAgentTest, RegistersJoinsWithAReservedStorePortRunsAndReportsSuccess) {
  start();
  EXPECT_EQ(fake_->registers.pending.front().req.node_id(), "node-a");
  EXPECT_FALSE(fake_->registers.pending.front().req.has_current());
  int port = join_and_run(spec_of("test \"$ACCEL_MIXED_PRECISION\" = bf16 && test $RANK -lt 2"));
  // The port was bound when the node joined: node rank 0 serves the store there.
  ASSERT_GT(port, 0);
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ::close(fd);

  pb::ReportGroupRequest started = next_report();
  EXPECT_EQ(started.event(), pb::ReportGroupRequest::EVENT_STARTED);
  EXPECT_EQ(started.job_id(), "job-1");
  pb::ReportGroupRequest done = next_report();
  EXPECT_EQ(done.event(), pb::ReportGroupRequest::EVENT_SUCCEEDED) << log_;
  EXPECT_EQ(done.failures_size(), 0);
}

TEST_F(NodeAgentTest, AFailingWorkerFailsTheRoundWithItsExitAndStderr) {
  start();
  join_and_run(spec_of("if [ $RANK = 1 ]; then echo boom >&2; exit 3; fi; sleep 30"));
  EXPECT_EQ(next_report().event(), pb::ReportGroupRequest::EVENT_STARTED);
  pb::ReportGroupRequest failed = next_report();
  ASSERT_EQ(failed.event(), pb::ReportGroupRequest::EVENT_FAILED);
  ASSERT_EQ(failed.failures_size(), 1);
  const pb::Failure& f = failed.failures(0);
  EXPECT_EQ(f.kind(), pb::Failure::KIND_EXIT);
  EXPECT_EQ(f.rank(), 1);
  EXPECT_EQ(f.exit_code(), 3);
  EXPECT_EQ(f.hostname(), "host-a");
  ASSERT_GE(f.stderr_tail_size(), 1);
  EXPECT_EQ(f.stderr_tail(f.stderr_tail_size() - 1), "boom");
  // The other rank (sleeping) is stopped by the agent itself.
  run_until([&] { return agent_->worker_pids().empty(); }, "the other worker to be stopped");
}

// Two agents may share a state folder (the default one is per node id: two Slurm jobs on one
// machine each start an agent of the same id). One that starts removes the round folders of
// agents that are gone, never those of a running one (its workers' progress pages and error
// files: without them its hang detection and failure messages go blind).
// An answer that leaves out the instruction this node holds keeps it (the workers run on); one
// that leaves out a version the node does not hold is a coordinator's mistake: the node says so
// and asks for the whole instruction.
TEST_F(NodeAgentTest, AnUnchangedAnswerKeepsTheInstructionAndAWrongOneAsksForItWhole) {
  start();
  join_and_run(spec_of("exec sleep 30", 1));
  run_until([&] { return !fake_->syncs.pending.empty(); }, "the Sync after RUN");
  pb::SyncRequest held = fake_->syncs.pending.front().req;
  EXPECT_EQ(held.known_version(), 2u);
  EXPECT_TRUE(held.omit_unchanged());
  EXPECT_EQ(next_report().event(), pb::ReportGroupRequest::EVENT_STARTED);

  pb::SyncResponse same;
  same.set_version(2);
  same.set_unchanged(true);
  fake_->syncs.answer({}, same);
  run_until([&] { return !fake_->syncs.pending.empty(); }, "the Sync after an unchanged answer");
  EXPECT_EQ(fake_->syncs.pending.front().req.known_version(), 2u);
  EXPECT_EQ(agent_->state_text().rfind("running job job-1 round 0", 0), 0u) << agent_->state_text();
  EXPECT_TRUE(fake_->reports.pending.empty());  // the workers were not touched

  pb::SyncResponse wrong;
  wrong.set_version(7);
  wrong.set_unchanged(true);
  fake_->syncs.answer({}, wrong);
  run_until([&] { return !fake_->syncs.pending.empty(); }, "the Sync after a wrong answer");
  const pb::SyncRequest& again = fake_->syncs.pending.front().req;
  EXPECT_EQ(again.known_version(), 0u);
  EXPECT_FALSE(again.omit_unchanged());
  EXPECT_NE(log_.find("the coordinator at fake:1 left out instruction version 7, which node "
                      "node-a does not hold (it holds 2)"),
            std::string::npos)
      << log_;
}

TEST_F(NodeAgentTest, AStartingAgentRemovesOnlyTheRoundFoldersOfAgentsThatAreGone) {
  start();
  pb::JobSpec spec = spec_of("sleep 30", 1);
  spec.set_hang_collective_timeout_ms(60'000);  // so the round has progress pages
  join_and_run(spec);
  const fs::path running = fs::path(state_dir_) / "job-1" / "attempt_0";
  run_until([&] { return fs::exists(running / "rank_0.progress"); }, "the round's folder");
  const fs::path gone = fs::path(state_dir_) / "job-gone" / "attempt_2";  // a SIGKILLed agent's
  fs::create_directories(gone);
  std::ofstream(gone / "rank_0.progress") << "left behind";

  std::string second_log;
  NodeAgent second(io_, std::make_shared<FakeCoordinator>(), options_,
                   [&](supervisor::LogLevel, const std::string& m) { second_log += m + "\n"; }, {});
  second.start();
  EXPECT_FALSE(fs::exists(gone.parent_path())) << second_log;
  EXPECT_TRUE(fs::exists(running / "rank_0.progress"))
      << "a starting agent removed the folder of a round running under another agent";
  EXPECT_NE(second_log.find("removed 1 job folder(s)"), std::string::npos) << second_log;

  bool stopped = false;
  agent_->shutdown(SIGTERM, [&] { stopped = true; });
  run_until([&] { return stopped; }, "the first agent to stop its worker");
  agent_.reset();
  EXPECT_FALSE(fs::exists(running.parent_path())) << "the round's folder stayed after the round";
}

TEST_F(NodeAgentTest, ARefusedRegistrationIsFatal) {
  start();
  fake_->registers.answer({CallCode::kUnauthenticated, "wrong token"});
  run_until([&] { return fatal_.has_value(); }, "on_fatal");
  EXPECT_NE(fatal_->find("refused this node: UNAUTHENTICATED: wrong token"), std::string::npos)
      << *fatal_;
}

TEST_F(NodeAgentTest, AForgottenNodeRegistersAgainWithTheWorkItRuns) {
  start();
  join_and_run(spec_of("sleep 30"));
  EXPECT_EQ(next_report().event(), pb::ReportGroupRequest::EVENT_STARTED);
  run_until([&] { return !fake_->syncs.pending.empty(); }, "a Sync");
  // A restarted coordinator does not know the node: it registers again, saying what it runs, so
  // the coordinator can adopt the running round instead of restarting it.
  fake_->syncs.answer({CallCode::kNotFound, "unknown node"});
  run_until([&] { return !fake_->registers.pending.empty(); }, "a second RegisterNode");
  const pb::RegisterNodeRequest& again = fake_->registers.pending.front().req;
  ASSERT_TRUE(again.has_current());
  EXPECT_EQ(again.current().job_id(), "job-1");
  EXPECT_EQ(again.current().round(), 0);
  EXPECT_EQ(again.current().spec().processes_per_node(), 2);
  EXPECT_EQ(agent_->worker_pids().size(), 2u);  // still running
}

TEST_F(NodeAgentTest, LosingTheCoordinatorForLongerThanTheLeaseStopsTheWorkers) {
  start();
  pb::RegisterNodeResponse resp;
  resp.set_coordinator_id("coord-1");
  resp.set_lease_ms(300);
  resp.set_sync_wait_ms(50);
  fake_->registers.answer({}, resp);
  run_until([&] { return !fake_->syncs.pending.empty(); }, "the first Sync");
  pb::Instruction join;
  join.set_action(pb::Instruction::ACTION_JOIN);
  join.set_job_id("job-1");
  *join.mutable_spec() = spec_of("sleep 30");
  instruct(1, join);
  run_until([&] { return !fake_->joins.pending.empty(); }, "JoinRound");
  int port = fake_->joins.answer().master_port();
  run_until([&] { return !fake_->syncs.pending.empty(); }, "the next Sync");
  instruct(2, run_instruction(spec_of("sleep 30"), port));
  EXPECT_EQ(next_report().event(), pb::ReportGroupRequest::EVENT_STARTED);
  ASSERT_EQ(agent_->worker_pids().size(), 2u);
  // From now on the coordinator is unreachable.
  pb::ReportGroupRequest lost;
  run_until(
      [&] {
        while (!fake_->syncs.pending.empty()) fake_->syncs.answer({CallCode::kUnavailable, "gone"});
        if (fake_->reports.pending.empty()) return false;
        lost = fake_->reports.answer();
        return true;
      },
      "the node-lost report");
  ASSERT_EQ(lost.event(), pb::ReportGroupRequest::EVENT_FAILED);
  ASSERT_EQ(lost.failures_size(), 1);
  EXPECT_EQ(lost.failures(0).kind(), pb::Failure::KIND_NODE_LOST);
  run_until(
      [&] {
        while (!fake_->syncs.pending.empty()) fake_->syncs.answer({CallCode::kUnavailable, "gone"});
        return agent_->worker_pids().empty();
      },
      "the workers to be stopped");
}

}  // namespace
}  // namespace accel::node

namespace accel::node {
namespace {

// A local launch's path without the launcher: the in-process coordinator and a node agent, a
// rank that fails on the first attempt, the restart, the same MASTER_PORT, the job's end.
TEST(LocalCoordinatorTest, ARestartedLocalJobKeepsItsPortAndSucceeds) {
  std::string dir = make_temp_dir("accel-local-coord-test-");
  ASSERT_FALSE(dir.empty());
  boost::asio::io_context io;
  SystemClock clock;
  coordinator::CoordinatorOptions co;
  co.coordinator_id = "local";
  co.sync_wait = 2s;
  LocalCoordinator coord(io, clock, co, 20ms);

  pb::JobSpec spec =
      spec_of("echo $MASTER_PORT > " + dir + "/port_$TORCHELASTIC_RESTART_COUNT; " +
              "[ $TORCHELASTIC_RESTART_COUNT = 0 ] && [ $RANK = 1 ] && exit 5; " + "exit 0");
  spec.set_max_restarts(1);
  spec.set_join_timeout_ms(60'000);
  pb::SubmitJobRequest submit;
  submit.set_job_id("local-job");
  *submit.mutable_spec() = spec;
  coordinator::RpcStatus st;
  coord.with_core([&](coordinator::CoordinatorCore& core) {
    pb::SubmitJobResponse resp;
    st = core.submit_job(submit, &resp);
  });
  ASSERT_TRUE(st.is_ok()) << st.message;

  NodeAgentOptions opts;
  opts.node_id = "local";
  opts.hostname = "host";
  opts.address = "127.0.0.1";
  opts.only_job_id = "local-job";
  opts.local = true;
  opts.state_dir = dir;
  opts.group.console_stdout_fd = -1;
  opts.group.console_stderr_fd = -1;
  std::optional<pb::JobOutcome> outcome;
  NodeAgentHooks hooks;
  hooks.on_job_end = [&](const pb::JobOutcome& o) { outcome = o; };
  std::string log;
  NodeAgent agent(
      io, std::shared_ptr<rpc::CoordinatorApi>(&coord, [](rpc::CoordinatorApi*) {}), opts,
      [&](supervisor::LogLevel, const std::string& m) { log += m + "\n"; }, hooks);
  coord.start();
  agent.start();
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!outcome && std::chrono::steady_clock::now() < deadline) {
    io.run_for(10ms);
    io.restart();
  }
  ASSERT_TRUE(outcome) << log;
  EXPECT_EQ(outcome->state(), pb::JOB_STATE_SUCCEEDED) << outcome->summary() << log;
  EXPECT_EQ(outcome->exit_code(), 0);
  std::ifstream p0(dir + "/port_0"), p1(dir + "/port_1");
  std::string port0, port1;
  p0 >> port0;
  p1 >> port1;
  EXPECT_FALSE(port0.empty());
  EXPECT_EQ(port0, port1) << "a restart keeps MASTER_PORT";
  EXPECT_NE(log.find("attempt 1: starting 2 workers"), std::string::npos) << log;
  bool stopped = false;
  agent.shutdown(SIGTERM, [&] { stopped = true; });
  while (!stopped) io.run_one_for(100ms);
  coord.stop();
  std::error_code ec;
  fs::remove_all(dir, ec);
}

}  // namespace
// --- addresses ----------------------------------------------------------------------------

TEST(NodeAddress, LoopbackLiteralsAndLocalhostAreMeantAndTheLoopbackInterfaceIsFound) {
  EXPECT_EQ(loopback_name_problem("127.0.0.1", "main_process_ip"), "");
  EXPECT_EQ(loopback_name_problem("127.0.1.1", "main_process_ip"), "");
  EXPECT_EQ(loopback_name_problem("::1", "main_process_ip"), "");
  EXPECT_EQ(loopback_name_problem("localhost", "main_process_ip"), "");
  EXPECT_EQ(loopback_name_problem("", "main_process_ip"), "");
  EXPECT_EQ(loopback_name_problem("no-such-host.invalid", "main_process_ip"), "")
      << "a name that does not resolve is left to the connection's own error";
  EXPECT_EQ(interface_of_address("127.0.0.1"), "lo");
  EXPECT_EQ(interface_of_address("192.0.2.77"), "") << "TEST-NET-1 is no interface's";
}

}  // namespace accel::node

// Control-plane failure scenarios with real processes: accel-agent daemons on loopback (distinct
// ports and node ids), the real coordinator over gRPC, accel-launch submitting, real kill -9.
// Every test ends by checking that no worker it started is still alive.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <thread>

#include "tests/integration/harness.h"

namespace accel::testing {
namespace {

constexpr const char* kToken = "control-plane-test-token";

// What one control_worker wrote about itself.
struct Marker {
  pid_t pid = 0;
  int rank = -1, world = -1, restart = -1, group = -1;
};

std::vector<Marker> markers(const fs::path& dir) {
  std::vector<Marker> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    std::string name = e.path().filename().string();
    if (name.rfind("w_", 0) != 0 || name.find(".tmp") != std::string::npos) continue;
    Marker m;
    m.pid = std::stoi(name.substr(2));
    std::istringstream in(read_file(e.path()));
    in >> m.rank >> m.world >> m.restart >> m.group;
    out.push_back(m);
  }
  return out;
}

std::vector<Marker> markers_with_world(const fs::path& dir, int world) {
  auto all = markers(dir);
  std::vector<Marker> out;
  std::copy_if(all.begin(), all.end(), std::back_inserter(out),
               [&](const Marker& m) { return m.world == world; });
  return out;
}

void expect_no_orphans(const fs::path& dir) {
  for (const auto& m : markers(dir)) {
    EXPECT_TRUE(wait_pid_gone(m.pid, 5s))
        << "worker pid " << m.pid << " (rank " << m.rank << ") outlived its job";
  }
}

// A coordinator and agents on loopback, each a real accel-agent process.
class Cluster {
 public:
  explicit Cluster(const TempDir& dir, std::string lease = "2s")
      : dir_(dir), port_(free_port()), lease_(std::move(lease)) {
    fs::create_directories(dir_.path() / "w");
  }

  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  // Added to every accel-agent and accel-launch command line (TLS flags).
  std::vector<std::string> common_args;
  fs::path worker_dir() const { return dir_.path() / "w"; }

  // The agent that also serves the coordinator.
  Launched& serve(const std::string& node_id, bool coordinator_only = false) {
    std::vector<std::string> args = {"--serve-coordinator", "127.0.0.1:" + std::to_string(port_),
                                     "--lease-timeout",     lease_,
                                     "--stop-timeout",      "2s"};
    if (coordinator_only) {
      args.push_back("--coordinator-only");
    } else {
      args.insert(args.end(), {"--node-id", node_id});
    }
    return add(args, node_id);
  }

  // serve() coordinator-only, under `ulimit -n nofile` (soft and hard): it cannot raise it.
  Launched& serve_with_file_limit(int nofile) {
    std::vector<std::string> args = {
        "-c",
        "ulimit -n " + std::to_string(nofile) + " && exec \"$0\" \"$@\"",
        ACCEL_AGENT_BIN,
        "--serve-coordinator",
        "127.0.0.1:" + std::to_string(port_),
        "--coordinator-only"};
    procs_.push_back(std::make_unique<Launched>(
        dir_, "/bin/sh", args, std::map<std::string, std::string>{{"ACCEL_TOKEN", kToken}},
        "coordinator_" + std::to_string(procs_.size())));
    return *procs_.back();
  }

  // accel status's result, bounded by `timeout`.
  RunResult status_result(std::chrono::milliseconds timeout) {
    Launched s(dir_, ACCEL_BIN, {"status", "--coordinator", target()}, {{"ACCEL_TOKEN", kToken}},
               "status_" + std::to_string(++statuses_));
    return s.wait(timeout);
  }
  int port() const { return port_; }

  Launched& agent_with_args(const std::string& node_id, std::vector<std::string> extra) {
    std::vector<std::string> args = {"--coordinator", target(),         "--node-id",
                                     node_id,         "--stop-timeout", "2s"};
    args.insert(args.end(), extra.begin(), extra.end());
    return add(args, node_id);
  }

  Launched& agent(const std::string& node_id, const std::string& token = kToken) {
    return add({"--coordinator", target(), "--node-id", node_id, "--stop-timeout", "2s"}, node_id,
               token);
  }

  std::unique_ptr<Launched> submit(std::vector<std::string> launch_args,
                                   std::vector<std::string> worker_args = {},
                                   const std::string& token = kToken) {
    std::vector<std::string> args = {"--coordinator", target()};
    args.insert(args.end(), common_args.begin(), common_args.end());
    args.insert(args.end(), launch_args.begin(), launch_args.end());
    args.insert(args.end(), {"--", CONTROL_WORKER_BIN, worker_dir().string()});
    args.insert(args.end(), worker_args.begin(), worker_args.end());
    return std::make_unique<Launched>(dir_, ACCEL_LAUNCH_BIN, args,
                                      std::map<std::string, std::string>{{"ACCEL_TOKEN", token}},
                                      "launch" + std::to_string(++launches_));
  }

  // Every agent's and coordinator's stderr so far, each under its name: for a failure message.
  std::string daemon_logs() const {
    std::string out;
    for (const auto& p : procs_) out += "--- " + p->err_path() + ":\n" + p->err_so_far();
    return out;
  }

  // accel status's output.
  std::string status() {
    Launched s(dir_, ACCEL_BIN, {"status", "--coordinator", target()}, {{"ACCEL_TOKEN", kToken}},
               "status");
    auto r = s.wait(10s);
    return r.out + r.err;
  }

 private:
  Launched& add(const std::vector<std::string>& args, const std::string& name,
                const std::string& token = kToken) {
    std::vector<std::string> all = args;
    all.insert(all.end(), common_args.begin(), common_args.end());
    procs_.push_back(std::make_unique<Launched>(
        dir_, ACCEL_AGENT_BIN, all, std::map<std::string, std::string>{{"ACCEL_TOKEN", token}},
        "agent_" + name + "_" + std::to_string(procs_.size())));
    return *procs_.back();
  }

  const TempDir& dir_;
  int port_;
  std::string lease_;
  int launches_ = 0;
  int statuses_ = 0;
  std::vector<std::unique_ptr<Launched>> procs_;  // SIGKILLed by ~Launched if still running
};

std::string done_file(const Cluster& c) { return (c.worker_dir().parent_path() / "done").string(); }

TEST(ControlPlane, TwoAgentsRunAJobAndItsOutputIsStreamed) {
  TempDir dir;
  Cluster c(dir);
  c.serve("node-a");
  c.agent("node-b");
  auto launch = c.submit({"--nodes", "2", "-n", "2"}, {"--run-ms", "100"});
  RunResult r = launch->wait(60s);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  auto ms = markers(c.worker_dir());
  ASSERT_EQ(ms.size(), 4u);
  std::set<int> ranks, groups;
  for (const auto& m : ms) {
    EXPECT_EQ(m.world, 4);
    EXPECT_EQ(m.restart, 0);
    ranks.insert(m.rank);
    groups.insert(m.group);
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2, 3}));
  EXPECT_EQ(groups, (std::set<int>{0, 1}));
  // Forwarded output carries [host:rank] prefixes.
  EXPECT_NE(r.out.find(":3] control_worker rank 3 of 4 restart 0"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("round 0 closed: 2 nodes"), std::string::npos) << r.err;
  std::string status = c.status();
  EXPECT_NE(status.find("node-a"), std::string::npos) << status;
  EXPECT_NE(status.find("SUCCEEDED"), std::string::npos) << status;
  expect_no_orphans(c.worker_dir());
}

TEST(ControlPlane, KilledWorkerRestartsTheWholeGroupAndTheBudgetIsGlobal) {
  TempDir dir;
  Cluster c(dir);
  c.serve("node-a");
  c.agent("node-b");
  auto launch =
      c.submit({"--nodes", "2", "-n", "2", "--max-restarts", "1"}, {"--until-file", done_file(c)});
  auto kill_rank = [&](int restart, int rank) {
    Marker victim;
    ASSERT_TRUE(wait_until(
        [&] {
          auto ms = markers(c.worker_dir());
          int n = 0;
          for (const auto& m : ms) {
            if (m.restart != restart) continue;
            ++n;
            if (m.rank == rank) victim = m;
          }
          return n == 4;
        },
        30s))
        << "restart " << restart << " never had 4 workers\n"
        << launch->err_so_far();
    ASSERT_EQ(::kill(victim.pid, SIGKILL), 0);
  };
  kill_rank(0, 3);  // node-b's worker: restart 1 of 1, for the whole job
  kill_rank(1, 0);  // node-a's worker: a per-node budget would restart again; ours is spent
  RunResult r = launch->wait(60s);
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << r.err;
  EXPECT_NE(r.err.find("restart 1 of 1"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("no restarts left (max_restarts 1)"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("* "), std::string::npos) << "root cause not marked:\n" << r.err;
  EXPECT_NE(r.err.find("rank 0 on"), std::string::npos) << r.err;
  for (const auto& m : markers(c.worker_dir()))
    EXPECT_LE(m.restart, 1) << "a third group was started";
  expect_no_orphans(c.worker_dir());
}

TEST(ControlPlane, KilledAgentIsNoticedWithinTheLeaseAndTheJobShrinks) {
  TempDir dir;
  Cluster c(dir, "2s");
  c.serve("node-a");
  c.agent("node-b");
  Launched& doomed = c.agent("node-c");
  auto launch =
      c.submit({"--nodes", "2:3", "-n", "1", "--last-call", "1s"}, {"--until-file", done_file(c)});
  ASSERT_TRUE(wait_until([&] { return markers_with_world(c.worker_dir(), 3).size() == 3; }, 30s))
      << launch->err_so_far();
  pid_t doomed_worker = 0;
  for (const auto& m : markers(c.worker_dir())) {
    if (m.group == 2) doomed_worker = m.pid;
  }
  auto killed_at = std::chrono::steady_clock::now();
  doomed.signal(SIGKILL);
  // Its worker dies with it (PR_SET_PDEATHSIG)...
  EXPECT_TRUE(wait_pid_gone(doomed_worker, 5s));
  // ...and within the lease (2 s) + a tick + last_call (1 s) the survivors run as a group of 2.
  ASSERT_TRUE(wait_until([&] { return markers_with_world(c.worker_dir(), 2).size() == 2; }, 15s))
      << launch->err_so_far();
  auto shrunk_after = std::chrono::steady_clock::now() - killed_at;
  EXPECT_LT(shrunk_after, 6s);
  write_file(done_file(c), "");
  RunResult r = launch->wait(30s);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("node node-c lost"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("not counted against max_restarts"), std::string::npos) << r.err;
  expect_no_orphans(c.worker_dir());
}

// An idle agent parks its Sync for 30 s, far past the lease; the parked call keeps it alive, and
// the coordinator's keepalive pings find it dead when it stops answering (SIGSTOP: its
// connection stays open, as in a partition or a hung machine).
TEST(ControlPlane, AnIdleAgentOutlivesItsLeaseParkedAndIsLostWithinItWhenItStopsAnswering) {
  TempDir dir;
  Cluster c(dir, "2s");
  c.serve("coordinator", /*coordinator_only=*/true);
  Launched& idle = c.agent("node-b");
  auto node_b = [&](const std::string& state) {
    std::string out = c.status();
    std::istringstream lines(out);
    for (std::string line; std::getline(lines, line);) {
      if (line.find("node-b") != std::string::npos && line.find(state) != std::string::npos)
        return true;
    }
    return false;
  };
  ASSERT_TRUE(wait_until([&] { return node_b("idle"); }, 15s)) << c.status() << c.daemon_logs();
  std::this_thread::sleep_for(5s);  // two and a half leases, with one Sync parked throughout
  ASSERT_TRUE(node_b("idle")) << c.status() << c.daemon_logs();
  auto stopped_at = std::chrono::steady_clock::now();
  idle.signal(SIGSTOP);
  ASSERT_TRUE(wait_until([&] { return node_b("LOST"); }, 10s)) << c.status() << c.daemon_logs();
  auto lost_after = std::chrono::steady_clock::now() - stopped_at;
  idle.signal(SIGCONT);
  // The lease (2 s), and a margin for accel status's own start: not the 30 s of the poll.
  EXPECT_LT(lost_after, 3500ms);
}

TEST(ControlPlane, TooFewNodesAfterALossFailsCleanly) {
  TempDir dir;
  Cluster c(dir, "2s");
  c.serve("node-a");
  Launched& doomed = c.agent("node-b");
  auto launch =
      c.submit({"--nodes", "2", "-n", "1", "--join-timeout", "3s"}, {"--until-file", done_file(c)});
  ASSERT_TRUE(wait_until([&] { return markers(c.worker_dir()).size() == 2; }, 30s))
      << launch->err_so_far();
  doomed.signal(SIGKILL);
  RunResult r = launch->wait(30s);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("only 1 of the 2 nodes it needs joined round 1 within join_timeout"),
            std::string::npos)
      << r.err;
  expect_no_orphans(c.worker_dir());
}

TEST(ControlPlane, ANewAgentMakesTheJobGrowAtTheNextRound) {
  TempDir dir;
  Cluster c(dir);
  c.serve("node-a");
  auto launch =
      c.submit({"--nodes", "1:2", "-n", "1", "--last-call", "0s"}, {"--until-file", done_file(c)});
  ASSERT_TRUE(wait_until([&] { return markers_with_world(c.worker_dir(), 1).size() == 1; }, 30s))
      << launch->err_so_far();
  c.agent("node-b");
  ASSERT_TRUE(wait_until([&] { return markers_with_world(c.worker_dir(), 2).size() == 2; }, 30s))
      << launch->err_so_far();
  write_file(done_file(c), "");
  RunResult r = launch->wait(30s);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("node-b is waiting to join (elastic grow)"), std::string::npos) << r.err;
  expect_no_orphans(c.worker_dir());
}

TEST(ControlPlane, JobFinishesAcrossACoordinatorRestart) {
  TempDir dir;
  Cluster c(dir, "4s");
  Launched& coordinator = c.serve("coordinator", /*coordinator_only=*/true);
  c.agent("node-a");
  c.agent("node-b");
  auto launch = c.submit({"--nodes", "2", "-n", "1"}, {"--until-file", done_file(c)});
  ASSERT_TRUE(wait_until([&] { return markers(c.worker_dir()).size() == 2; }, 30s))
      << launch->err_so_far();
  coordinator.signal(SIGKILL);
  coordinator.wait(5s);
  std::this_thread::sleep_for(500ms);
  c.serve("coordinator2", /*coordinator_only=*/true);
  // Both agents come back with their running work; nobody restarts anything.
  ASSERT_TRUE(wait_until([&] { return c.status().find("RUNNING") != std::string::npos; }, 15s));
  write_file(done_file(c), "");
  RunResult r = launch->wait(60s);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(markers(c.worker_dir()).size(), 2u) << "workers were restarted";
  EXPECT_NE(r.err.find("adopted job"), std::string::npos) << r.err;
  expect_no_orphans(c.worker_dir());
}

TEST(ControlPlane, HungRankGetsADesyncReportAndTheGroupRestarts) {
  TempDir dir;
  Cluster c(dir);
  c.serve("node-a");
  c.agent("node-b");
  // Rank 1 (node-b) spins in CPU code after three barriers; rank 0 waits in the fourth.
  Launched launch(dir, ACCEL_LAUNCH_BIN,
                  {"--coordinator", c.target(), "--nodes", "2", "-n", "1", "--hang-timeout", "2s",
                   "--max-restarts", "1", RUNTIME_WORKER_BIN, "hang", "1"},
                  {{"ACCEL_TOKEN", kToken}}, "hang");
  RunResult r = launch.wait(90s);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err << "\n" << c.status() << c.daemon_logs();
  // node-a sees only rank 0 waiting; the coordinator's job-wide report names rank 1 on node-b.
  EXPECT_NE(r.err.find("hung: rank 1 on "), std::string::npos) << r.err;
  EXPECT_NE(
      r.err.find("is outside any collective; its last was barrier #2; rank 0 waits in barrier #3"),
      std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("job-wide, from every agent's last sync:"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("outside any collective; last barrier #2; last heartbeat"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("<- lagging"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("restart 1 of 1"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("rank 1 done"), std::string::npos) << r.out;
}

TEST(ControlPlane, MutualTlsJobRunsAndAPlaintextClientIsTurnedAway) {
  TempDir dir;
  std::string d = dir.path().string();
  std::string script =
      "cd " + d +
      " && openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 1 "
      "-subj /CN=accel-test-ca && openssl req -newkey rsa:2048 -nodes -keyout node.key -out "
      "node.csr "
      "-subj /CN=accel-node && printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > ext.cnf && "
      "openssl x509 -req -in node.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out node.pem -days "
      "1 "
      "-extfile ext.cnf";
  ASSERT_EQ(std::system((script + " >/dev/null 2>&1").c_str()), 0) << script;
  Cluster c(dir);
  c.common_args = {"--tls-cert",    d + "/node.pem", "--tls-key",
                   d + "/node.key", "--tls-ca",      d + "/ca.pem"};
  // The launcher first: it must connect once the coordinator is up (gRPC's reconnect used to
  // wait for its 5 s backup poller and give a TLS handshake 100 ms, so it never did).
  auto launch = c.submit({"--nodes", "2", "-n", "1"}, {"--run-ms", "0"});
  std::this_thread::sleep_for(300ms);
  c.serve("node-a");
  c.agent("node-b");
  RunResult r = launch->wait(60s);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(markers(c.worker_dir()).size(), 2u);
  // A client with the site's certificates but another token reaches the coordinator, whose
  // refusals show in its log (at most once every 10 s).
  auto wrong = c.submit({"-n", "1"}, {"--run-ms", "0"}, "not-the-token");
  RunResult w = wrong->wait(30s);
  EXPECT_NE(w.exit_code, 0);
  EXPECT_NE(w.err.find("UNAUTHENTICATED"), std::string::npos) << w.err;
  EXPECT_TRUE(wait_until(
      [&] {
        return c.daemon_logs().find(
                   "call(s) with a wrong or missing token; the last from "
                   "ipv4:127.0.0.1:") != std::string::npos;
      },
      10s))
      << c.daemon_logs();
  // Without the site's CA the launcher trusts only the token's certificate, which this
  // coordinator does not present; nothing runs.
  c.common_args.clear();
  Launched plain(dir, ACCEL_LAUNCH_BIN,
                 {"--coordinator", c.target(), "-n", "1", "--", CONTROL_WORKER_BIN, d},
                 {{"ACCEL_TOKEN", kToken}}, "plain");
  RunResult p = plain.wait(60s);
  EXPECT_EQ(p.exit_code, 125) << p.err;  // the control plane failed
  EXPECT_NE(p.err.find("cannot submit the job to the coordinator"), std::string::npos) << p.err;
  EXPECT_EQ(markers(c.worker_dir()).size(), 2u);
}

// The coordinator stops answering (SIGSTOP: as a partition, its connections stay open) while a
// job runs; the workers end during the outage. The launcher must keep following, say that the
// job may still be running, and print the job's end once the coordinator answers again.
TEST(ControlPlane, ALauncherFollowsAJobThroughACoordinatorOutageToItsEnd) {
  TempDir dir;
  Cluster c(dir, "30s");  // a lease longer than the outage: the nodes are not lost
  Launched& coordinator = c.serve("coordinator", /*coordinator_only=*/true);
  c.agent("node-a");
  c.agent("node-b");
  const std::string go = (dir.path() / "go").string();
  auto launch = c.submit({"--nodes", "2", "-n", "1"}, {"--until-file", go, "--print-lines", "2"});
  ASSERT_TRUE(wait_until(
      [&] {
        auto out = launch->out_so_far();
        return out.find("line 0 1") != std::string::npos &&
               out.find("line 1 1") != std::string::npos;
      },
      60s))
      << launch->err_so_far() << c.daemon_logs();
  coordinator.signal(SIGSTOP);
  std::this_thread::sleep_for(8s);  // the launcher's 6 s call times out meanwhile
  std::ofstream(go) << "";          // the workers end during the outage
  std::this_thread::sleep_for(1s);
  coordinator.signal(SIGCONT);
  RunResult r = launch->wait(60s);
  EXPECT_EQ(r.exit_code, 0) << r.err << c.daemon_logs();
  EXPECT_NE(r.err.find("keeps running on its nodes meanwhile; following it again when the "
                       "coordinator answers"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("is back"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("succeeded"), std::string::npos) << r.err;
}

// With a short follow_timeout the launcher stops following (exit 124: the job may still be
// running) and says how to follow again; `accel logs JOB --follow` then prints the job's output
// and exits with the job's code once the coordinator is back.
TEST(ControlPlane, ALauncherThatStopsFollowingSaysHowAndAccelLogsFollowsTheJobToItsEnd) {
  TempDir dir;
  Cluster c(dir, "30s");
  Launched& coordinator = c.serve("coordinator", /*coordinator_only=*/true);
  c.agent("node-a");
  c.agent("node-b");
  const std::string go = (dir.path() / "go").string();
  auto launch =
      c.submit({"--nodes", "2", "-n", "1", "--job-id", "outage", "--follow-timeout", "2s"},
               {"--until-file", go, "--print-lines", "2"});
  ASSERT_TRUE(
      wait_until([&] { return launch->out_so_far().find("line 1 1") != std::string::npos; }, 60s))
      << launch->err_so_far() << c.daemon_logs();
  coordinator.signal(SIGSTOP);
  RunResult r = launch->wait(30s);
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 124) << r.err;
  EXPECT_NE(r.err.find("stopped following job outage: no answer from the coordinator at " +
                       c.target() + " for 2 s (follow_timeout"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("The job may still be running: `accel logs outage --follow --coordinator " +
                       c.target() + "`"),
            std::string::npos)
      << r.err;
  std::ofstream(go) << "";
  coordinator.signal(SIGCONT);
  Launched logs(dir, ACCEL_BIN, {"logs", "outage", "--follow", "--coordinator", c.target()},
                {{"ACCEL_TOKEN", kToken}}, "logs");
  RunResult l = logs.wait(60s);
  EXPECT_EQ(l.exit_code, 0) << l.err;
  EXPECT_NE(l.out.find("line 0 1"), std::string::npos) << l.out;
  EXPECT_NE(l.out.find("line 1 1"), std::string::npos) << l.out;
  Launched unknown(dir, ACCEL_BIN, {"logs", "no-such-job", "--coordinator", c.target()},
                   {{"ACCEL_TOKEN", kToken}}, "logs_unknown");
  RunResult u = unknown.wait(30s);
  EXPECT_EQ(u.exit_code, 1);
  EXPECT_NE(u.err.find("job no-such-job at " + c.target() + ": NOT_FOUND"), std::string::npos)
      << u.err;
}

TEST(ControlPlane, WrongTokenIsRejectedAndNothingRuns) {
  TempDir dir;
  Cluster c(dir);
  c.serve("node-a");
  auto launch = c.submit({"-n", "1"}, {"--run-ms", "0"}, "not-the-token");
  RunResult r = launch->wait(20s);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("UNAUTHENTICATED"), std::string::npos) << r.err;
  Launched& intruder = c.agent("intruder", "not-the-token");
  RunResult a = intruder.wait(20s);
  EXPECT_EQ(a.exit_code, 1) << a.err;
  EXPECT_NE(a.err.find("refused this node: UNAUTHENTICATED"), std::string::npos) << a.err;
  EXPECT_TRUE(markers(c.worker_dir()).empty());
  EXPECT_EQ(c.status().find("intruder"), std::string::npos);
  // Without certificates of the site's, the TLS certificate is the token's: a client with
  // another token refuses the coordinator's handshake, so it never makes a call (the coordinator
  // has none to log; with tls_cert it does: MutualTlsJobRuns...).
  EXPECT_NE(a.err.find("failed the TLS handshake that proves it holds this job's token"),
            std::string::npos)
      << a.err;
}

// Anyone who reaches the port, without the token: 1,100 connections that send half of the HTTP/2
// preface and wait, against a coordinator whose open-file limit is 1,024 (soft and hard, so it
// cannot raise it). gRPC's accept fails with EMFILE and its listener gives up; the coordinator
// must notice and listen again, so that once the flood closes, `accel status` answers.
TEST(ControlPlane, AConnectionFloodPastTheFileLimitDoesNotDisableTheCoordinator) {
  constexpr int kFlood = 1100;
  rlimit lim{};
  ::getrlimit(RLIMIT_NOFILE, &lim);
  if (lim.rlim_max < kFlood + 200)
    GTEST_SKIP() << "the test needs " << kFlood + 200 << " descriptors";
  rlimit raised{lim.rlim_max, lim.rlim_max};
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &raised), 0);
  TempDir dir;
  Cluster c(dir);
  c.serve_with_file_limit(1024);
  ASSERT_TRUE(wait_until([&] { return c.status_result(5s).exit_code == 0; }, 15s))
      << "the coordinator never answered";

  std::vector<int> flood;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(c.port()));
  const char half_preface[] = "PRI * HTTP/2.0\r\n";  // 16 of the preface's 24 bytes
  for (int i = 0; i < kFlood; ++i) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(fd, 0) << "socket " << i;
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
      (void)!::write(fd, half_preface, sizeof half_preface - 1);
    }
    flood.push_back(fd);
  }
  std::this_thread::sleep_for(5s);  // held, as the attack does
  auto during = c.status_result(5s);
  for (int fd : flood) ::close(fd);

  auto start = std::chrono::steady_clock::now();
  RunResult after;
  bool answered = wait_until([&] { return (after = c.status_result(5s)).exit_code == 0; }, 30s);
  EXPECT_TRUE(answered) << "accel status after the flood:\n" << after.out << after.err;
  EXPECT_LT(std::chrono::steady_clock::now() - start, 30s);
  std::cerr << "during the flood accel status exited " << during.exit_code << "; answered "
            << std::chrono::duration_cast<std::chrono::milliseconds>(
                   std::chrono::steady_clock::now() - start)
                   .count()
            << " ms after it ended\n";
}

// Every forwarded line of "line <rank> <i> xxx" in `out`, per rank, must be 0..n-1 in order.
void expect_every_line_in_order(const std::string& out, int ranks, int n) {
  std::vector<int> next(static_cast<size_t>(ranks), 0);
  int bad = 0;
  for (const auto& line : lines_of(out)) {
    auto at = line.find("] line ");
    if (at == std::string::npos) continue;
    std::istringstream in(line.substr(at + 7));
    int rank = -1, i = -1;
    in >> rank >> i;
    ASSERT_TRUE(rank >= 0 && rank < ranks) << line.substr(0, 120);
    if (i != next[static_cast<size_t>(rank)] && ++bad < 5) {
      ADD_FAILURE() << "rank " << rank << ": line " << i << " where "
                    << next[static_cast<size_t>(rank)] << " was due";
    }
    next[static_cast<size_t>(rank)] = i + 1;
  }
  for (int r = 0; r < ranks; ++r)
    EXPECT_EQ(next[static_cast<size_t>(r)], n) << "rank " << r << "'s lines";
}

// Mode 3 forwards output losslessly: a node's lines reach the coordinator before its report of
// the round, pushes stay under the message limit, so the launcher prints every line, in order per
// rank, before it exits. Long lines (100 x 60 KB: 6 MB a rank) and many short ones (20,000 a rank).
TEST(ControlPlane, ForwardedOutputArrivesWholeAndInOrderBeforeTheJobEnds) {
  TempDir dir;
  Cluster c(dir);
  c.serve("node-a");
  c.agent("node-b");
  struct Case {
    int lines, bytes;
  };
  for (Case k : {Case{100, 60'000}, Case{20'000, 40}}) {
    SCOPED_TRACE(std::to_string(k.lines) + " lines of " + std::to_string(k.bytes) + " bytes");
    auto launch = c.submit({"--nodes", "2", "-n", "2"},
                           {"--run-ms", "0", "--print-lines", std::to_string(k.lines),
                            "--line-bytes", std::to_string(k.bytes)});
    RunResult r = launch->wait(90s);
    ASSERT_EQ(r.exit_code, 0) << r.err.substr(0, 4000);
    expect_every_line_in_order(r.out, 4, k.lines);
    EXPECT_EQ(r.err.find("were dropped"), std::string::npos) << "no event may be dropped";
  }
  expect_no_orphans(c.worker_dir());
}

// A standing agent's workers cannot read the token from the agent (/proc/<pid>/environ shows the
// environment it started with), and each round's folder under --state-dir goes when the round is
// over (a standing agent runs job after job).
TEST(ControlPlane, AStandingAgentHidesItsTokenAndCleansItsStateFolder) {
  TempDir dir;
  Cluster c(dir);
  c.serve("node-a", /*coordinator_only=*/true);
  auto state = dir.path() / "state";
  Launched& agent = c.agent_with_args("node-b", {"--state-dir", state.string()});
  ASSERT_TRUE(wait_until([&] { return c.status().find("node-b") != std::string::npos; }, 15s));
  std::string environ_block = read_file("/proc/" + std::to_string(agent.pid()) + "/environ");
  EXPECT_EQ(environ_block.find(kToken), std::string::npos)
      << "the token is readable in /proc/<pid>/environ";
  for (int job = 0; job < 2; ++job) {
    auto launch = c.submit({"-n", "2"}, {"--run-ms", "0"});
    RunResult r = launch->wait(60s);
    ASSERT_EQ(r.exit_code, 0) << r.err;
  }
  EXPECT_TRUE(wait_until([&] { return fs::is_empty(state); }, 10s))
      << "left in " << state << ": "
      << (fs::is_empty(state) ? "" : fs::begin(fs::directory_iterator(state))->path().string());
  expect_no_orphans(c.worker_dir());
}

// An agent SIGKILLed while a worker's name is in /dev/shm (libaccel's rank 0 names its segment
// until every local rank has mapped it): the worker dies with the agent, unreaped, and the agent
// started next on the same state folder removes the name at once (the round's `workers` file),
// not a minute later at some later job's start.
TEST(ControlPlane, AnAgentRestartedAfterASigkillRemovesWhatItsWorkersLeftInDevShm) {
  TempDir dir;
  Cluster c(dir);
  c.serve("node-a", /*coordinator_only=*/true);
  const auto state = dir.path() / "state";
  Launched& doomed = c.agent_with_args("node-b", {"--state-dir", state.string()});
  const std::string tag = "cp-test-" + std::to_string(::getpid());
  const fs::path pid_file = dir.path() / "worker_pid";
  // The worker names accel-<its pid>-<tag>, then says its pid and sleeps as that pid.
  std::vector<std::string> args = {"--coordinator",
                                   c.target(),
                                   "-n",
                                   "1",
                                   "--",
                                   "/bin/sh",
                                   "-c",
                                   "touch /dev/shm/accel-$$-" + tag + "; echo $$ > " +
                                       pid_file.string() + ".tmp; mv " + pid_file.string() +
                                       ".tmp " + pid_file.string() + "; exec sleep 60"};
  Launched launch(dir, ACCEL_LAUNCH_BIN, args, {{"ACCEL_TOKEN", kToken}}, "launch");
  ASSERT_TRUE(wait_until([&] { return fs::exists(pid_file); }, 30s)) << launch.err_so_far();
  const pid_t worker = std::stoi(read_file(pid_file));
  fs::remove(pid_file);
  const fs::path left = "/dev/shm/accel-" + std::to_string(worker) + "-" + tag;
  ASSERT_TRUE(fs::exists(left));
  doomed.signal(SIGKILL);
  ASSERT_TRUE(wait_pid_gone(worker, 5s)) << "the worker outlived its agent";
  EXPECT_TRUE(fs::exists(left)) << "nobody reaped the worker: its name is still there";

  c.agent_with_args("node-b", {"--state-dir", state.string()});
  EXPECT_TRUE(wait_until([&] { return !fs::exists(left); }, 10s))
      << left << " is still there after the agent restarted\n"
      << c.daemon_logs();
  // The job runs again on the restarted agent; stopping it removes that worker's name too.
  ASSERT_TRUE(wait_until([&] { return fs::exists(pid_file); }, 30s)) << launch.err_so_far();
  const pid_t again = std::stoi(read_file(pid_file));
  launch.signal(SIGTERM);
  EXPECT_FALSE(launch.wait(30s).timed_out);
  EXPECT_TRUE(wait_pid_gone(again, 5s));
  std::error_code ec;
  fs::remove(left, ec);
  EXPECT_TRUE(wait_until(
      [&] { return !fs::exists("/dev/shm/accel-" + std::to_string(again) + "-" + tag); }, 5s));
}

// SIGTERM (systemd, Slurm, a CI runner's timeout) to a launcher that submitted to standing
// agents cancels the job: gRPC's threads start with the stop signals blocked, so none of them
// takes the signal and dies of it with the job left running.
TEST(ControlPlane, SigtermToASubmittingLauncherCancelsTheJob) {
  TempDir dir;
  Cluster c(dir);
  c.serve("node-a");
  auto launch = c.submit({"--nodes", "1", "-n", "1"}, {"--run-ms", "60000"});
  ASSERT_TRUE(wait_until([&] { return markers(c.worker_dir()).size() == 1; }, 30s))
      << launch->err_so_far() << c.daemon_logs();
  launch->signal(SIGTERM);
  RunResult r = launch->wait(30s);
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.err;
  EXPECT_NE(r.err.find("received SIGTERM: cancelling job"), std::string::npos) << r.err;
  ASSERT_TRUE(wait_until([&] { return c.status().find("CANCELLED") != std::string::npos; }, 20s))
      << c.status();
  expect_no_orphans(c.worker_dir());
}

TEST(ControlPlane, CtrlCOnAnyNodeCancelsTheJobEverywhere) {
  TempDir dir;
  fs::create_directories(dir.path() / "w");
  int port = free_port();
  auto node = [&](int rank) {
    return std::make_unique<Launched>(
        dir, ACCEL_LAUNCH_BIN,
        std::vector<std::string>{"--nodes", "2", "--machine-rank", std::to_string(rank), "-n", "1",
                                 "--coordinator-port", std::to_string(port), "--",
                                 CONTROL_WORKER_BIN, (dir.path() / "w").string()},
        std::map<std::string, std::string>{{"ACCEL_TOKEN", kToken}}, "node" + std::to_string(rank));
  };
  auto n0 = node(0);
  auto n1 = node(1);
  ASSERT_TRUE(wait_until([&] { return markers(dir.path() / "w").size() == 2; }, 30s))
      << n0->err_so_far();
  n1->signal(SIGINT);  // not the node that hosts the coordinator, and no --job-id given
  RunResult r1 = n1->wait(30s);
  RunResult r0 = n0->wait(30s);
  EXPECT_EQ(r1.exit_code, 128 + SIGINT) << r1.err;
  EXPECT_EQ(r0.exit_code, 128 + SIGINT) << r0.err;
  EXPECT_NE(r0.err.find("stopped by SIGINT (exit code 130)"), std::string::npos) << r0.err;
  expect_no_orphans(dir.path() / "w");
}

TEST(ControlPlane, EveryNodeRunsAccelLaunchAndTrainsTogether) {
  TempDir dir;
  int port = free_port();
  std::map<std::string, std::string> env = {{"ACCEL_TOKEN", kToken}};
  auto node = [&](int rank) {
    return std::make_unique<Launched>(
        dir, ACCEL_LAUNCH_BIN,
        std::vector<std::string>{"--nodes", "2", "--machine-rank", std::to_string(rank), "-n", "1",
                                 "--coordinator-port", std::to_string(port), TRAIN_MLP_BIN,
                                 "--epochs", "1"},
        env, "node" + std::to_string(rank));
  };
  auto n0 = node(0);
  auto n1 = node(1);
  RunResult r0 = n0->wait(120s);
  RunResult r1 = n1->wait(30s);
  EXPECT_EQ(r0.exit_code, 0) << r0.out << r0.err;
  EXPECT_EQ(r1.exit_code, 0) << r1.out << r1.err;
  // Both ranks trained in one process group: world size 2, the same final loss.
  EXPECT_NE(r0.out.find("train_mlp: 2 process(es)"), std::string::npos) << r0.out;
  auto final_loss = [](const std::string& out) {
    auto at = out.rfind("epoch 0 loss ");
    return at == std::string::npos ? std::string("?") : out.substr(at, 24);
  };
  EXPECT_EQ(final_loss(r0.out), final_loss(r1.out));
}

}  // namespace
}  // namespace accel::testing

namespace accel::testing {
namespace {

// A second Unix user for the length of a test (root only): created with useradd, removed with
// userdel however the test ends.
struct OtherUser {
  std::string name;
  uid_t uid = 0;
  OtherUser() {
    name = "accelprobe" + std::to_string(::getpid() % 100000);
    if (std::system(
            ("useradd --no-create-home --shell /usr/sbin/nologin " + name + " >/dev/null 2>&1")
                .c_str()) != 0)
      name.clear();
    if (!name.empty()) uid = static_cast<uid_t>(std::stoul(capture("id -u " + name)));
  }
  ~OtherUser() {
    if (!name.empty()) std::system(("userdel " + name + " >/dev/null 2>&1").c_str());
  }
  // Runs `script` with sh as this user; its exit status.
  int run(const std::string& script) const {
    return std::system(("runuser -u " + name + " -- sh -c '" + script + "'").c_str());
  }
  static std::string capture(const std::string& cmd) {
    std::string out;
    FILE* p = ::popen(cmd.c_str(), "r");
    if (p == nullptr) return "0";
    char buf[64];
    while (std::fgets(buf, sizeof buf, p) != nullptr) out += buf;
    ::pclose(p);
    return out.empty() ? "0" : out;
  }
};

// Another user of the machine gets at the agent's state folder first, at the name the agent
// will use ($TMPDIR/accel-agent-<uid>-<node id>, predictable), to plant links in it that the
// agent would write or remove through: the agent refuses that folder and says why, whether the
// other user owns it, made it a link into the victim's files, or left one of the victim's
// world-writable; the linked folder is not touched. A folder the agent makes itself is 0700.
TEST(ControlPlane, AStateFolderAnotherUserCouldControlIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to add a second user";
  OtherUser b;
  ASSERT_FALSE(b.name.empty()) << "useradd failed";
  TempDir dir;
  fs::permissions(dir.path(),
                  fs::perms::owner_all | fs::perms::others_exec | fs::perms::group_exec);
  const fs::path tmp = dir.path() / "tmp";
  fs::create_directories(tmp);
  fs::permissions(tmp, fs::perms::all | fs::perms::sticky_bit);  // like /tmp
  const std::string uid = std::to_string(::geteuid());
  auto start = [&](const std::string& node) {
    Launched agent(dir, ACCEL_AGENT_BIN,
                   {"--coordinator", "127.0.0.1:1", "--node-id", node, "--stop-timeout", "1s"},
                   {{"ACCEL_TOKEN", "t0ken-of-the-victim"}, {"TMPDIR", tmp.string()}},
                   "agent_" + node);
    return agent.wait(15s);
  };
  const std::string prefix = (tmp / ("accel-agent-" + uid + "-")).string();

  // B made the folder (mode 0777, so that the victim could write into it).
  ASSERT_EQ(b.run("mkdir -m 0777 " + prefix + "owned"), 0);
  auto r = start("owned");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("the state folder " + prefix + "owned: it belongs to user id " +
                       std::to_string(b.uid) + ", not to this user (" + uid + ")"),
            std::string::npos)
      << r.err;

  // B made it a link into the victim's files, shaped like round folders the sweep removes.
  fs::create_directories(dir.path() / "victim" / "data" / "attempt_0");
  ASSERT_EQ(b.run("ln -s " + (dir.path() / "victim").string() + " " + prefix + "linked"), 0);
  r = start("linked");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("the state folder " + prefix + "linked: it is a symbolic link"),
            std::string::npos)
      << r.err;
  EXPECT_TRUE(fs::exists(dir.path() / "victim" / "data" / "attempt_0"));

  // The victim's own folder, but writable by everyone.
  fs::create_directories(prefix + "open");
  fs::permissions(prefix + "open", fs::perms::all);
  r = start("open");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("it is writable by group or others (mode 0777)"), std::string::npos)
      << r.err;

  // Nothing there: the agent makes it, private, and runs (it waits for its coordinator).
  Launched fine(dir, ACCEL_AGENT_BIN,
                {"--coordinator", "127.0.0.1:1", "--node-id", "fresh", "--stop-timeout", "1s"},
                {{"ACCEL_TOKEN", "t0ken-of-the-victim"}, {"TMPDIR", tmp.string()}}, "agent_fresh");
  ASSERT_TRUE(wait_until([&] { return fs::exists(prefix + "fresh"); }, 10s)) << fine.err_so_far();
  EXPECT_EQ(fs::status(prefix + "fresh").permissions() & fs::perms::all, fs::perms::owner_all);
  fine.signal(SIGTERM);
  EXPECT_FALSE(fine.wait(15s).timed_out);
}

// A standing agent's workers get its environment, and a Python worker never reads
// ACCEL_KEEP_FREED_MEMORY itself (the agent reads it for the worker's malloc): a value that is
// neither true nor false stops the agent at its start, naming the variable.
TEST(ControlPlane, AnAgentRefusesAKeepFreedMemoryThatIsNeitherTrueNorFalse) {
  TempDir dir;
  Launched agent(dir, ACCEL_AGENT_BIN,
                 {"--coordinator", "127.0.0.1:1", "--node-id", "n0", "--stop-timeout", "1s"},
                 {{"ACCEL_TOKEN", "t0ken"}, {"ACCEL_KEEP_FREED_MEMORY", "ture"}}, "agent");
  auto r = agent.wait(15s);
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("environment variable ACCEL_KEEP_FREED_MEMORY=\"ture\": expected true or "
                       "false (1, true, yes or on; 0, false, no or off)"),
            std::string::npos)
      << r.err;
}

}  // namespace
}  // namespace accel::testing

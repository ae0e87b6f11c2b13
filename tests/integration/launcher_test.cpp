// accel-launch end to end: real binary, real worker processes, real signals.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <atomic>
#include <cstring>
#include <ctime>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "tests/integration/harness.h"

namespace accel::testing {
namespace {

std::vector<std::string> sh(const std::string& script) { return {"--", "/bin/sh", "-c", script}; }

std::vector<std::string> with(std::vector<std::string> opts, const std::vector<std::string>& tail) {
  opts.insert(opts.end(), tail.begin(), tail.end());
  return opts;
}

std::map<std::string, std::string> parse_env_file(const std::string& path) {
  std::map<std::string, std::string> env;
  for (const auto& line : lines_of(read_file(path))) {
    auto eq = line.find('=');
    if (eq != std::string::npos) env[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return env;
}

// The pids that workers wrote to <dir>/pid_<rank>; fewer if some never wrote within 10 s.
std::vector<pid_t> worker_pids(const TempDir& dir, int n) {
  std::vector<pid_t> pids;
  for (int rank = 0; rank < n; ++rank) {
    std::string file = dir / ("pid_" + std::to_string(rank));
    if (!wait_for_file(file, 10s)) break;
    pids.push_back(std::stoi(read_file(file)));
  }
  return pids;
}

TEST(Launcher, WorkerEnvironmentContract) {
  TempDir dir;
  auto r = run_launcher(dir, with({"-n", "3", "--job-id", "envjob", "--mixed-precision", "bf16",
                                   "--gradient-accumulation-steps", "4", "--cpu"},
                                  sh("env > " + dir.path().string() + "/env_$RANK")));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::set<std::string> ports;
  std::set<std::string> error_files;
  for (int rank = 0; rank < 3; ++rank) {
    auto env = parse_env_file(dir / ("env_" + std::to_string(rank)));
    std::string rs = std::to_string(rank);
    EXPECT_EQ(env["RANK"], rs);
    EXPECT_EQ(env["LOCAL_RANK"], rs);
    EXPECT_EQ(env["ROLE_RANK"], rs);
    EXPECT_EQ(env["GROUP_RANK"], "0");
    EXPECT_EQ(env["WORLD_SIZE"], "3");
    EXPECT_EQ(env["LOCAL_WORLD_SIZE"], "3");
    EXPECT_EQ(env["GROUP_WORLD_SIZE"], "1");
    EXPECT_EQ(env["ROLE_WORLD_SIZE"], "3");
    EXPECT_EQ(env["ROLE_NAME"], "default");
    EXPECT_EQ(env["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(env["TORCHELASTIC_RESTART_COUNT"], "0");
    EXPECT_EQ(env["TORCHELASTIC_MAX_RESTARTS"], "0");
    EXPECT_EQ(env["TORCHELASTIC_RUN_ID"], "envjob");
    EXPECT_EQ(env["TORCHELASTIC_USE_AGENT_STORE"], "True");
    EXPECT_EQ(env["TORCH_NCCL_ASYNC_ERROR_HANDLING"], "1");
    EXPECT_EQ(env["OMP_NUM_THREADS"], "1");
    EXPECT_EQ(env["ACCELERATE_MIXED_PRECISION"], "bf16");
    EXPECT_EQ(env["ACCELERATE_USE_CPU"], "true");
    EXPECT_EQ(env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"], "4");
    EXPECT_EQ(env["ACCEL_MIXED_PRECISION"], "bf16");
    EXPECT_EQ(env["ACCEL_GRADIENT_ACCUMULATION_STEPS"], "4");
    EXPECT_EQ(env["ACCEL_JOB_ID"], "envjob");
    EXPECT_EQ(env["ACCEL_RESTART_COUNT"], "0");
    EXPECT_EQ(env["ACCEL_ERROR_FILE"], env["TORCHELASTIC_ERROR_FILE"]);
    EXPECT_FALSE(env["ACCEL_ERROR_FILE"].empty());
    EXPECT_EQ(env["HOME"], dir.path().string());  // the launcher's environment is inherited
    ports.insert(env["MASTER_PORT"]);
    error_files.insert(env["ACCEL_ERROR_FILE"]);
  }
  ASSERT_EQ(ports.size(), 1u);
  int port = std::stoi(*ports.begin());
  EXPECT_GT(port, 0);
  EXPECT_LT(port, 65536);
  EXPECT_EQ(error_files.size(), 3u);
}

// A worker gets stdin, stdout and stderr and nothing else the launcher holds or inherited (an
// fd its caller left open without FD_CLOEXEC here), as torchrun's workers do.
TEST(Launcher, WorkersGetOnlyTheirThreeStandardStreams) {
  TempDir dir;
  int leaked = ::open("/dev/null", O_RDONLY);  // no O_CLOEXEC: the launcher inherits it
  ASSERT_GE(leaked, 3);
  // Why `exec >` and a last `true`: a redirected command makes dash save stdout on fd 10, and
  // a last command is exec'd in place (ls would list its own directory fd).
  auto r = run_launcher(dir, with({"-n", "2"}, sh("exec > " + dir.path().string() +
                                                  "/fds_$RANK; ls /proc/$$/fd; true")));
  ::close(leaked);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(read_file(dir / ("fds_" + std::to_string(rank))), "0\n1\n2\n") << "rank " << rank;
  }
}

TEST(Launcher, ExitCodeIsTheRootCause) {
  TempDir dir;
  auto ok = run_launcher(dir, with({"-n", "2"}, sh("exit 0")));
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  auto bad = run_launcher(dir, with({"-n", "3", "--stop-timeout", "5s"},
                                    sh("if [ $RANK = 2 ]; then echo 'boom on two' >&2; exit 7; fi; "
                                       "exec sleep 30")));
  EXPECT_EQ(bad.exit_code, 7) << bad.err;
  EXPECT_LT(bad.elapsed, 10s);  // the sleepers were stopped, not waited for
  EXPECT_NE(bad.err.find("FAILED with exit code 7"), std::string::npos) << bad.err;
  EXPECT_TRUE(std::regex_search(
      bad.err, std::regex(R"(\* [0-9:.]+ +rank 2 on \S+ \(pid \d+\) failed: exit code 7\n)")))
      << bad.err;
  EXPECT_NE(bad.err.find("stderr| boom on two"), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("failed: exit code 7; stopping the other workers"), std::string::npos)
      << bad.err;
}

TEST(Launcher, ErrorFileMessageInSummary) {
  TempDir dir;
  auto r = run_launcher(
      dir, with({"-n", "2"},
                sh("if [ $RANK = 1 ]; then printf '%s' '{\"message\": {\"message\": \"ValueError: "
                   "loss is nan\", \"extraInfo\": {\"py_callstack\": \"tb\"}}}' > "
                   "\"$TORCHELASTIC_ERROR_FILE\"; exit 1; fi; exec sleep 30")));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("failed: exit code 1: ValueError: loss is nan"), std::string::npos) << r.err;
}

TEST(Launcher, RestartsTheWholeGroupAndCountsAttempts) {
  TempDir dir;
  std::string d = dir.path().string();
  // Rank 1 fails on attempts 0 and 1 (once rank 0 has recorded its start); attempt 2 succeeds.
  auto r = run_launcher(
      dir,
      with(
          {"-n", "2", "--max-restarts", "3", "--stop-timeout", "5s"},
          sh("c=$TORCHELASTIC_RESTART_COUNT; touch " + d +
             "/ran_${c}_${ACCEL_RESTART_COUNT}_$RANK; "
             "if [ $RANK = 1 ] && [ $c -lt 2 ]; then "
             "while [ ! -e " +
             d +
             "/ran_${c}_${c}_0 ]; do sleep 0.02; done; exit 3; fi; "
             "if [ $RANK = 0 ] && [ $TORCHELASTIC_RESTART_COUNT -lt 2 ]; then exec sleep 30; fi")));
  EXPECT_EQ(r.exit_code, 0) << r.err;
  for (int attempt = 0; attempt < 3; ++attempt) {
    for (int rank = 0; rank < 2; ++rank) {
      std::string a = std::to_string(attempt);
      EXPECT_TRUE(fs::exists(dir / ("ran_" + a + "_" + a + "_" + std::to_string(rank))))
          << "attempt " << attempt << " rank " << rank << "\n"
          << r.err;
    }
  }
  EXPECT_FALSE(fs::exists(dir / "ran_3_3_0"));
  EXPECT_TRUE(std::regex_search(
      r.err,
      std::regex(
          R"(restarting: rank 1 on \S+ \(pid \d+\) failed: exit code 3 \(restart 2 of 3\))")))
      << r.err;
}

TEST(Launcher, RestartBudgetRunsOut) {
  TempDir dir;
  auto r = run_launcher(
      dir, with({"-n", "2", "--max-restarts", "2"},
                sh("touch " + dir.path().string() +
                   "/a_$TORCHELASTIC_RESTART_COUNT; [ $RANK = 0 ] && exit 4; exec sleep 30")));
  EXPECT_EQ(r.exit_code, 4);
  EXPECT_TRUE(fs::exists(dir / "a_2"));
  EXPECT_FALSE(fs::exists(dir / "a_3"));
  EXPECT_NE(r.err.find("FAILED with exit code 4"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("no restarts left (max_restarts 2)"), std::string::npos) << r.err;
  EXPECT_TRUE(std::regex_search(
      r.err,
      std::regex(R"(earlier: round 0 at [0-9:.]+: rank 0 on \S+ \(pid \d+\) failed: exit code 4)")))
      << r.err;
  EXPECT_TRUE(std::regex_search(
      r.err,
      std::regex(R"(earlier: round 1 at [0-9:.]+: rank 0 on \S+ \(pid \d+\) failed: exit code 4)")))
      << r.err;
}

TEST(Launcher, WorkerKilledWithSigkill) {
  TempDir dir;
  std::string d = dir.path().string();
  Launched l(dir, with({"-n", "2", "--stop-timeout", "5s"},
                       sh("echo $$ > " + d + "/pid_$RANK; exec sleep 30")));
  ASSERT_TRUE(wait_for_file(dir / "pid_1", 10s));
  ASSERT_TRUE(wait_for_file(dir / "pid_0", 10s));
  pid_t victim = std::stoi(read_file(dir / "pid_1"));
  pid_t other = std::stoi(read_file(dir / "pid_0"));
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  auto r = l.wait(20s);
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << r.err;
  EXPECT_TRUE(std::regex_search(
      r.err, std::regex(R"(\* [0-9:.]+ +rank 1 on \S+ \(pid \d+\) failed: SIGKILL \(signal 9\))")))
      << r.err;
  EXPECT_FALSE(pid_alive(other));
}

TEST(Launcher, WorkerIgnoringSigtermIsKilledAfterGrace) {
  TempDir dir;
  std::string d = dir.path().string();
  auto r = run_launcher(
      dir,
      with({"-n", "2", "--stop-timeout", "700ms"}, sh("if [ $RANK = 0 ]; then while [ ! -e " + d +
                                                      "/ready ]; do sleep 0.05; done; exit 1; fi; "
                                                      "trap '' TERM; echo $$ > " +
                                                      d + "/stubborn; touch " + d +
                                                      "/ready; "
                                                      "exec sleep 60")),
      20s);
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_GE(r.elapsed, 700ms);  // the grace was given...
  EXPECT_LT(r.elapsed, 10s);    // ...and then SIGKILL, not a wait for sleep 60
  EXPECT_TRUE(std::regex_search(
      r.err, std::regex(R"(rank 1 \(pid \d+\) did not stop within 700ms of SIGTERM: SIGKILLed)")))
      << r.err;
  pid_t stubborn = std::stoi(read_file(dir / "stubborn"));
  EXPECT_FALSE(pid_alive(stubborn));
}

TEST(Launcher, LauncherSigkilledLeavesNoWorkers) {
  TempDir dir;
  std::string d = dir.path().string();
  Launched l(dir, with({"-n", "3"}, sh("echo $$ > " + d + "/pid_$RANK; exec sleep 60")));
  std::vector<pid_t> workers = worker_pids(dir, 3);
  ASSERT_EQ(workers.size(), 3u);
  for (pid_t p : workers) ASSERT_TRUE(pid_alive(p));
  l.signal(SIGKILL);
  auto r = l.wait(10s);
  EXPECT_EQ(r.term_signal, SIGKILL);
  for (pid_t p : workers) EXPECT_TRUE(wait_pid_gone(p, 5s)) << "orphaned worker pid " << p;
}

// A launcher keeps its workers' error files and progress pages in a folder of $TMPDIR, which a
// SIGKILL leaves behind; the next launcher removes it, and never the folder of one still running.
TEST(Launcher, TheFolderOfASigkilledLauncherIsRemovedByTheNextOne) {
  TempDir dir;
  std::string d = dir.path().string();
  const fs::path tmp = dir.path() / "tmp";
  fs::create_directories(tmp);
  const std::map<std::string, std::string> env{{"TMPDIR", tmp.string()}};
  auto folders = [&] {
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(tmp)) names.insert(e.path().filename().string());
    return names;
  };
  Launched running(dir, with({"-n", "1"}, sh("echo $$ > " + d + "/pid_0; exec sleep 60")), env);
  ASSERT_EQ(worker_pids(dir, 1).size(), 1u);
  const auto live = folders();
  ASSERT_EQ(live.size(), 1u);
  fs::remove(dir / "pid_0");

  Launched killed(dir, with({"-n", "1"}, sh("echo $$ > " + d + "/pid_0; exec sleep 60")), env);
  auto victim = worker_pids(dir, 1);
  ASSERT_EQ(victim.size(), 1u);
  ASSERT_EQ(folders().size(), 2u);
  killed.signal(SIGKILL);
  EXPECT_EQ(killed.wait(10s).term_signal, SIGKILL);
  EXPECT_TRUE(wait_pid_gone(victim[0], 5s));
  ASSERT_EQ(folders().size(), 2u) << "the killed launcher's folder should still be there";
  // Another machine's (a $TMPDIR shared over NFS, whose locks may be local to each machine).
  fs::create_directories(tmp / "accel-elsewhere-abcdef");
  std::ofstream(tmp / "accel-elsewhere-abcdef" / ".owner") << "host not-this-machine\n";
  auto expected = live;
  expected.insert("accel-elsewhere-abcdef");

  Launched next(dir, with({"-n", "1"}, sh("true")), env);
  auto r = next.wait(30s);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(folders(), expected) << "the next launcher must remove the killed one's folder (and "
                                    "its own), and leave the running one's and another machine's";
  running.signal(SIGTERM);
  EXPECT_FALSE(running.wait(15s).timed_out);
  EXPECT_EQ(folders(), std::set<std::string>{"accel-elsewhere-abcdef"});
}

// The parent of `pid` from /proc, or -1 (gone, even while being read).
pid_t parent_of(pid_t pid) {
  char text[512] = {};
  FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (f == nullptr) return -1;
  std::size_t n = std::fread(text, 1, sizeof text - 1, f);
  std::fclose(f);
  std::string stat(text, n);
  auto close = stat.rfind(')');
  if (close == std::string::npos || close + 2 >= stat.size()) return -1;
  std::istringstream rest(stat.substr(close + 2));
  std::string state;
  long ppid = -1;
  rest >> state >> ppid;
  return static_cast<pid_t>(ppid);
}

// The pids whose parent is `parent`.
std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc", ec)) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    if (parent_of(std::stoi(name)) == parent) out.push_back(std::stoi(name));
  }
  return out;
}

// A launcher SIGKILLed at each moment of a 2-process job's start, prepare() and training (its
// workers die with it, and nobody reaps them): the moment a worker's shared-memory segment
// appears (the collectives' segment, then the gradient buckets' block, each named until every
// rank has mapped it), then at fixed delays. Whatever the workers left in /dev/shm is removed by
// the next launcher once it is a minute old (aged here by hand).
TEST(Launcher, SharedMemoryLeftByASigkilledLauncherIsRemovedByTheNextOne) {
  TempDir dir;
  std::set<pid_t> workers;
  std::vector<std::string> left;
  // A name accel-<worker pid>-<rest> of this job in /dev/shm whose rest starts with `kind` ("#":
  // a digit, the collectives' segment).
  auto seen = [&](pid_t launcher, const std::string& kind) {
    for (const auto& e : fs::directory_iterator("/dev/shm")) {
      const std::string name = e.path().filename().string();
      if (name.rfind("accel-", 0) != 0) continue;
      auto dash = name.find('-', 6);
      if (dash == std::string::npos) continue;
      pid_t pid = std::atoi(name.substr(6, dash - 6).c_str());
      if (pid <= 0 || parent_of(pid) != launcher) continue;
      workers.insert(pid);
      const bool digit =
          dash + 1 < name.size() && std::isdigit(static_cast<unsigned char>(name[dash + 1]));
      if (kind == "#" ? digit : name.compare(dash + 1, kind.size(), kind) == 0) return true;
    }
    return false;
  };
  struct Moment {
    std::string segment;  // kill once a name of this kind appears ("": at the delay)
    int delay_ms;
  };
  const std::vector<Moment> moments = {{"#", 0},   {"#", 0},   {"#", 0},  {"b1-", 0}, {"b1-", 0},
                                       {"b1-", 0}, {"b1-", 0}, {"", 600}, {"", 1200}, {"", 2000}};
  for (const auto& m : moments) {
    Launched l(dir,
               {"-n", "2", "--", RUNTIME_WORKER_BIN, "train", dir / "weights", "12", "3", "huge"},
               {{"OMP_NUM_THREADS", "1"}});
    auto until = std::chrono::steady_clock::now() +
                 (m.segment.empty() ? std::chrono::milliseconds(m.delay_ms) : 20s);
    while (std::chrono::steady_clock::now() < until && pid_alive(l.pid())) {
      for (pid_t p : children_of(l.pid())) workers.insert(p);
      if (!m.segment.empty() && seen(l.pid(), m.segment)) break;
    }
    l.signal(SIGKILL);
    l.wait(10s);
  }
  for (pid_t p : workers) ASSERT_TRUE(wait_pid_gone(p, 5s)) << "orphaned worker " << p;
  for (pid_t p : workers) {
    const std::string prefix = "accel-" + std::to_string(p) + "-";
    for (const auto& e : fs::directory_iterator("/dev/shm")) {
      if (e.path().filename().string().rfind(prefix, 0) != 0) continue;
      left.push_back(e.path().string());
      const timespec old[2] = {{::time(nullptr) - 120, 0}, {::time(nullptr) - 120, 0}};
      ::utimensat(AT_FDCWD, e.path().c_str(), old, AT_SYMLINK_NOFOLLOW);
    }
  }
  std::printf("the SIGKILLed launchers' workers left %zu name(s) in /dev/shm\n", left.size());
  auto next = run_launcher(dir, with({"-n", "1"}, sh("true")), 30s);
  EXPECT_EQ(next.exit_code, 0) << next.err;
  for (const auto& path : left) {
    EXPECT_FALSE(fs::exists(fs::symlink_status(path))) << path << " was not removed";
    fs::remove(path);
  }
}

void expect_signal_stops_job(int sig, int expected_exit) {
  TempDir dir;
  std::string d = dir.path().string();
  Launched l(dir, with({"-n", "2"}, sh("echo $$ > " + d + "/pid_$RANK; exec sleep 60")));
  std::vector<pid_t> workers = worker_pids(dir, 2);
  ASSERT_EQ(workers.size(), 2u);
  l.signal(sig);
  auto r = l.wait(15s);
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, expected_exit) << r.err;
  EXPECT_NE(r.err.find("stopped by " + std::string(sig == SIGINT    ? "SIGINT"
                                                   : sig == SIGTERM ? "SIGTERM"
                                                                    : "SIGUSR1")),
            std::string::npos)
      << r.err;
  for (pid_t p : workers) EXPECT_TRUE(wait_pid_gone(p, 1s)) << "worker pid " << p << " survived";
}

TEST(Launcher, CtrlCStopsEveryWorker) { expect_signal_stops_job(SIGINT, 130); }
TEST(Launcher, SigtermStopsEveryWorker) { expect_signal_stops_job(SIGTERM, 143); }

TEST(Launcher, SigusrOneStopsTheJobWith138) { expect_signal_stops_job(SIGUSR1, 138); }

// The codes in the first column of docs/launch.md's "Exit codes" table.
std::set<std::string> documented_exit_codes() {
  std::set<std::string> codes;
  bool in_section = false;
  for (const auto& line : lines_of(read_file(std::string(ACCEL_SOURCE_DIR) + "/docs/launch.md"))) {
    if (line.rfind("## ", 0) == 0) in_section = line == "## Exit codes";
    if (!in_section || line.rfind("| ", 0) != 0 || line.rfind("| code", 0) == 0) continue;
    codes.insert(line.substr(2, line.find(" |", 2) - 2));
  }
  return codes;
}

// Every row of docs/launch.md's exit-code table, each in the way a user meets it (SIGINT and
// SIGTERM: CtrlCStopsEveryWorker, SigtermStopsEveryWorker; SIGUSR1 just above; 124, a
// coordinator that stops answering: ControlPlane.ALauncherThatStopsFollowingSaysHow...).
TEST(Launcher, EveryRowOfTheExitCodeTable) {
  EXPECT_EQ(documented_exit_codes(),
            (std::set<std::string>{"`0`", "worker's code", "`130` / `143`", "`138`", "`2`", "`127`",
                                   "`1`", "`125`", "`124`"}));
  TempDir dir;
  auto code = [&](const std::vector<std::string>& args,
                  const std::map<std::string, std::string>& env = {}) {
    auto r = run_launcher(dir, args, 40s, env);
    EXPECT_FALSE(r.timed_out);
    return std::make_pair(r.exit_code, r.err);
  };
  auto expect = [&](int want, const std::vector<std::string>& args, const std::string& says,
                    const std::map<std::string, std::string>& env = {}) {
    auto [got, err] = code(args, env);
    EXPECT_EQ(got, want) << ::testing::PrintToString(args) << "\n" << err;
    EXPECT_NE(err.find(says), std::string::npos) << ::testing::PrintToString(args) << "\n" << err;
  };
  // 0
  EXPECT_EQ(code(with({"-n", "2"}, sh("exit 0"))).first, 0);
  for (const char* info : {"--help", "--version", "--print-config"})
    EXPECT_EQ(code({info}).first, 0) << info;
  // The worker's code, or 128 + its signal.
  // (Rank 1 waits: two ranks failing at once would make either one's code the job's.)
  expect(3, with({"-n", "2"}, sh("[ $RANK = 0 ] && exit 3; exec sleep 30")), "failed: exit code 3");
  expect(139, with({"-n", "1"}, sh("kill -SEGV $$")), "SIGSEGV");
  // 2: usage and configuration.
  expect(2, {"--no-such-flag", "/bin/true"}, "--no-such-flag");
  expect(2, {"--max-restarts", "many", "/bin/true"}, "max_restarts");
  expect(2, {"-n", "2"}, "no PROGRAM given");
  expect(2, {"--no-python", "-m", "json.tool"}, "--module and --no-python cannot be used together");
  expect(2, {"--nodes", "2", "/bin/true"}, "no token");
  // 127: not found.
  expect(127, {"no-such-program-xyz"}, "not found on PATH");
  expect(127, {"no_such_script.py"}, "Python script not found");
  std::ofstream(dir / "ok.py") << "print(1)\n";
  expect(127, {dir / "ok.py"}, "Python interpreter", {{"PYTHON_EXEC", "no-such-python-xyz"}});
  // 1: the workers could not be started; or a libaccel program's uncaught error.
  std::ofstream(dir / "noshebang") << "echo hi\n";
  fs::permissions(dir / "noshebang", fs::perms::owner_all);
  expect(1, {dir / "noshebang"}, "Exec format error");
  expect(1, {"-n", "2", RUNTIME_WORKER_BIN, "uncaught"},
         "accel: uncaught std::runtime_error: deliberately uncaught on rank");
  expect(1, {RUNTIME_WORKER_BIN, "config_error"}, "fp16 needs a CUDA device");
  // 125: the control plane failed (machine rank 1 never finds its coordinator).
  expect(125,
         {"--nodes", "2", "--machine-rank", "1", "--coordinator-port", std::to_string(free_port()),
          "--join-timeout", "2s", "/bin/true"},
         "coordinator", {{"ACCEL_TOKEN", "exit-code-test"}});
}

TEST(Launcher, SighupDoesNotKillTheJob) {
  TempDir dir;
  std::string d = dir.path().string();
  Launched l(dir, with({"-n", "2"}, sh("touch " + d + "/up_$RANK; while [ ! -e " + d +
                                       "/go ]; do sleep 0.05; done; echo finished")));
  ASSERT_TRUE(wait_for_file(dir / "up_0", 10s, 0));
  ASSERT_TRUE(wait_for_file(dir / "up_1", 10s, 0));
  l.signal(SIGHUP);
  std::ofstream(dir / "go") << "";
  auto r = l.wait(15s);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("SIGHUP: ignored"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("[rank 0] finished"), std::string::npos);
  EXPECT_NE(r.out.find("[rank 1] finished"), std::string::npos);
}

TEST(Launcher, HeavyOutputFromFourWorkersIsNeverInterleaved) {
  TempDir dir;
  const int kLines = 20000;
  std::string pad(120, 'x');
  auto r = run_launcher(dir,
                        with({"-n", "4"}, sh("i=0; while [ $i -lt " + std::to_string(kLines) +
                                             " ]; do echo \"r=$RANK i=$i " + pad +
                                             "\"; i=$((i+1)); done; echo \"r=$RANK done\" >&2")),
                        120s);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::regex line_re(R"(\[rank (\d)\] r=(\d) i=(\d+) x{120})");
  std::vector<int> next(4, 0);
  size_t bad = 0;
  for (const auto& line : lines_of(r.out)) {
    std::smatch m;
    if (!std::regex_match(line, m, line_re) || m[1] != m[2]) {
      if (++bad < 5) ADD_FAILURE() << "malformed line: " << line.substr(0, 200);
      continue;
    }
    int rank = std::stoi(m[1]);
    EXPECT_EQ(std::stoi(m[3]), next[rank]) << "rank " << rank << " out of order";
    next[rank] = std::stoi(m[3]) + 1;
  }
  EXPECT_EQ(bad, 0u);
  for (int rank = 0; rank < 4; ++rank) EXPECT_EQ(next[rank], kLines) << "rank " << rank;
  for (int rank = 0; rank < 4; ++rank) {
    std::string done = "[rank " + std::to_string(rank) + "] r=" + std::to_string(rank) + " done";
    EXPECT_NE(r.err.find(done), std::string::npos);  // stderr stays on stderr
    EXPECT_EQ(r.out.find(done), std::string::npos);
  }
}

TEST(Launcher, LogDirAndTee) {
  TempDir dir;
  std::string logs = dir / "logs";
  auto r = run_launcher(dir, with({"-n", "2", "--log-dir", logs, "--tee", "0", "--job-id", "lj"},
                                  sh("echo out-$RANK; echo err-$RANK >&2")));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.find("out-"), std::string::npos) << "tee 0 keeps the console clean";
  for (int rank = 0; rank < 2; ++rank) {
    std::string log = read_file(logs + "/lj/attempt_0/rank_" + std::to_string(rank) + ".log");
    EXPECT_NE(log.find("out-" + std::to_string(rank) + "\n"), std::string::npos) << log;
    EXPECT_NE(log.find("err-" + std::to_string(rank) + "\n"), std::string::npos) << log;
    EXPECT_EQ(log.find("[rank"), std::string::npos) << "log files are unprefixed";
  }
  auto tee = run_launcher(dir, with({"-n", "1", "--log-dir", logs, "--tee", "1", "--job-id", "lj2"},
                                    sh("echo out; echo err >&2")));
  EXPECT_NE(tee.out.find("[rank 0] out"), std::string::npos);
  EXPECT_EQ(tee.err.find("[rank 0] err"), std::string::npos);
  // A log folder others can write (a shared project folder): a link planted at a rank's log name
  // is refused, and the file it points to is left as it was.
  fs::create_directories(logs + "/lj3/attempt_0");
  std::ofstream(dir / "precious.txt") << "keep me\n";
  fs::create_symlink(dir / "precious.txt", logs + "/lj3/attempt_0/rank_0.log");
  auto planted = run_launcher(
      dir, with({"-n", "1", "--log-dir", logs, "--job-id", "lj3"}, sh("echo overwritten")));
  EXPECT_NE(planted.exit_code, 0) << planted.err;
  EXPECT_NE(planted.err.find("rank_0.log: it is a symbolic link (refused)"), std::string::npos)
      << planted.err;
  EXPECT_EQ(read_file(dir / "precious.txt"), "keep me\n");
}

TEST(Launcher, BadConfigAndFlagsAreClearErrors) {
  TempDir dir;
  std::ofstream(dir / "c.yaml") << "num_processes: 2\nnodes: \"4:2\"\n";
  auto r = run_launcher(dir, {"--config", dir / "c.yaml", "/bin/true"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.err,
            "accel-launch: error: " + (dir / "c.yaml") +
                ":2:8: nodes: minimum 4 is larger than maximum 2 in '4:2' (write MIN:MAX)\n");
  auto flag = run_launcher(dir, {"-n", "-3", "/bin/true"});
  EXPECT_EQ(flag.exit_code, 2);
  EXPECT_NE(flag.err.find(
                "num_processes: expected an integer from 1 to 4096, or auto, gpu or cpu, got '-3'"),
            std::string::npos)
      << flag.err;
  auto env = run_launcher(dir, {"/bin/true"}, 30s, {{"ACCEL_MAIN_PROCESS_PORT", "70000"}});
  EXPECT_EQ(env.exit_code, 2);
  EXPECT_NE(env.err.find("environment variable ACCEL_MAIN_PROCESS_PORT"), std::string::npos);
  auto none = run_launcher(dir, {"-n", "2"});
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_NE(none.err.find("no PROGRAM given"), std::string::npos) << none.err;
  auto missing = run_launcher(dir, {"-n", "2", "no-such-program-xyz"});
  EXPECT_EQ(missing.exit_code, 127);
  EXPECT_NE(missing.err.find("'no-such-program-xyz' not found on PATH"), std::string::npos);
  // Keys of `--nodes N` launches given with --coordinator used to be ignored (the job then
  // waited for nodes that never came).
  auto mixed = run_launcher(
      dir, {"--coordinator", "127.0.0.1:1", "--machine-rank", "1", "--nodes", "2", "/bin/true"});
  EXPECT_EQ(mixed.exit_code, 2);
  EXPECT_NE(mixed.err.find("machine_rank does not go with coordinator"), std::string::npos)
      << mixed.err;
  auto port = run_launcher(
      dir, {"--coordinator", "127.0.0.1:1", "--coordinator-port", "29411", "/bin/true"});
  EXPECT_EQ(port.exit_code, 2);
  EXPECT_NE(port.err.find("coordinator_port does not go with coordinator"), std::string::npos)
      << port.err;
}

// A rank log that cannot be written (the disk is full: here the log file is /dev/full) is said
// once in the run's output and again at the end, though the job succeeds; the terminal copy is
// whole.
TEST(Launcher, AFullLogDiskIsReportedAndTheConsoleKeepsEveryLine) {
  TempDir dir;
  auto attempt = dir.path() / "logs" / "full-job" / "attempt_0";
  fs::create_directories(attempt);
  // The disk that is full: /dev/full's device (char 1,7) at the log's name. Why not a link to
  // it: log files are never opened through a link.
  if (::mknod((attempt / "rank_0.log").c_str(), S_IFCHR | 0666, makedev(1, 7)) != 0)
    GTEST_SKIP() << "mknod of /dev/full's device needs root: " << std::strerror(errno);
  auto r = run_launcher(
      dir, {"-n", "1", "--log-dir", (dir.path() / "logs").string(), "--job-id", "full-job",
            "/bin/sh", "-c", "i=0; while [ $i -lt 1000 ]; do echo line $i; i=$((i+1)); done"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("line 999"), std::string::npos);
  const std::string problem = "cannot write the log file " + (attempt / "rank_0.log").string() +
                              ": No space left on device";
  size_t first = r.err.find(problem);
  ASSERT_NE(first, std::string::npos) << r.err;
  size_t again = r.err.find(problem, first + 1);
  EXPECT_NE(again, std::string::npos) << "said again at the end:\n" << r.err;
  EXPECT_NE(r.err.find("but its log is incomplete"), std::string::npos) << r.err;
}

// An HF Accelerate user's default_config.yaml launches as it is: HF's total process count over
// its machines, MULTI_CPU as use_cpu, the ignored keys said once each.
TEST(Launcher, AnHfAccelerateConfigFileLaunchesUnchanged) {
  TempDir dir;
  std::ofstream(dir / "default_config.yaml") << "compute_environment: LOCAL_MACHINE\n"
                                                "distributed_type: MULTI_CPU\n"
                                                "downcast_bf16: 'yes'\n"
                                                "machine_rank: 0\n"
                                                "main_training_function: main\n"
                                                "mixed_precision: 'no'\n"
                                                "num_machines: 1\n"
                                                "num_processes: 3\n"
                                                "rdzv_backend: static\n"
                                                "same_network: true\n";
  auto r = run_launcher(dir, {"--config_file", dir / "default_config.yaml", "--", "sh", "-c",
                              "echo \"$RANK/$WORLD_SIZE cpu=$ACCELERATE_USE_CPU\""});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_NE(
        r.out.find("[rank " + std::to_string(rank) + "] " + std::to_string(rank) + "/3 cpu=true"),
        std::string::npos)
        << r.out;
  }
  EXPECT_NE(r.err.find("default_config.yaml:3:16: downcast_bf16 is ignored: TPU only"),
            std::string::npos)
      << r.err;
  auto ds = run_launcher(
      dir, {"--config_file", dir / "default_config.yaml", "--distributed-type", "x", "/bin/true"});
  EXPECT_EQ(ds.exit_code, 2) << ds.err;  // not an accel flag: refused before anything starts
}

// accel config default / validate / import / show, as a person uses them: files written, read
// back by accel-launch, never overwritten without --force, bad files named.
TEST(AccelConfig, DefaultValidateImportAndShow) {
  TempDir dir;
  auto accel = [&](std::vector<std::string> args) {
    Launched l(dir, ACCEL_BIN, std::move(args), {}, "accel");
    return l.wait(30s);
  };
  const std::string mine = (dir.path() / "conf" / "accel.yaml").string();
  auto made = accel({"config", "default", "--config-file", mine, "-n", "4", "--max-restarts", "2"});
  ASSERT_EQ(made.exit_code, 0) << made.err;
  EXPECT_NE(made.out.find("wrote " + mine), std::string::npos) << made.out;
  EXPECT_EQ(read_file(mine),
            "# accel configuration (docs/configuration.md); a key not here has its default "
            "(accel-launch --print-config)\nnum_processes: 4\nmax_restarts: 2\n");
  auto again = accel({"config", "default", "--config-file", mine});
  EXPECT_EQ(again.exit_code, 1);
  EXPECT_NE(again.err.find(mine + " exists; it was left as it is (--force replaces it)"),
            std::string::npos)
      << again.err;
  EXPECT_NE(read_file(mine).find("num_processes: 4"), std::string::npos);  // untouched

  auto ok = accel({"config", "validate", mine});
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_NE(ok.out.find(mine + ": valid (2 keys set, 0 ignored)"), std::string::npos) << ok.out;
  std::ofstream(dir / "bad.yaml") << "num_processes: lots\n";
  auto bad = accel({"config", "validate", dir / "bad.yaml"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("bad.yaml:1:16: num_processes: expected an integer from 1 to 4096, or "
                         "auto, gpu or cpu, got "
                         "'lots'"),
            std::string::npos)
      << bad.err;

  std::ofstream(dir / "default_config.yaml") << "compute_environment: LOCAL_MACHINE\n"
                                                "distributed_type: MULTI_CPU\n"
                                                "num_machines: 1\n"
                                                "num_processes: 2\n"
                                                "rdzv_backend: c10d\n"
                                                "same_network: true\n";
  const std::string imported = dir / "imported.yaml";
  auto imp = accel({"config", "import", dir / "default_config.yaml", "--config-file", imported});
  ASSERT_EQ(imp.exit_code, 0) << imp.err;
  // Warnings go to stderr; a key at HF's default (same_network: true) is not one.
  EXPECT_NE(imp.err.find("rdzv_backend is ignored"), std::string::npos) << imp.err;
  EXPECT_EQ(imp.out.find("ignored"), std::string::npos) << imp.out;
  EXPECT_EQ(imp.err.find("same_network"), std::string::npos) << imp.err;
  std::string text = read_file(imported);
  EXPECT_NE(text.find("num_processes: 2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("use_cpu: true\n"), std::string::npos) << text;
  auto run = run_launcher(dir, {"--config", imported, "--", "sh", "-c", "echo ws=$WORLD_SIZE"});
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("[rank 1] ws=2"), std::string::npos) << run.out;

  auto show = accel({"config", "show", "--config", imported, "-n", "3"});
  EXPECT_EQ(show.exit_code, 0) << show.err;
  EXPECT_NE(show.out.find("num_processes: 3"), std::string::npos) << show.out;
  EXPECT_NE(show.out.find("# flag --num-processes"), std::string::npos) << show.out;
}

// A console that stops reading (a full pipe, a paused terminal) blocks the launcher; for longer
// than the cluster lease (10 s) it must still not pass for a lost node and restart the job.
TEST(Launcher, AConsoleThatBlocksForLongerThanALeaseDoesNotRestartTheJob) {
  TempDir dir;
  const std::string runs = dir / "runs";
  const std::string cmd = std::string(ACCEL_LAUNCH_BIN) + " -n 1 -- sh -c 'echo run >> " + runs +
                          "; yes line | head -c 5000000' | (sleep 12; cat > /dev/null)";
  Launched l(dir, "/bin/sh", {"-c", cmd}, {}, "blocked");
  auto r = l.wait(60s);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(read_file(runs), "run\n") << r.err;  // one attempt
  EXPECT_EQ(r.err.find("lost"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("succeeded"), std::string::npos) << r.err;
}

// The control plane's token stays with the launcher, in local mode too.
TEST(Launcher, WorkersNeverSeeTheToken) {
  TempDir dir;
  auto r = run_launcher(dir, {"-n", "1", "/bin/sh", "-c", "echo token=[$ACCEL_TOKEN]"}, 30s,
                        {{"ACCEL_TOKEN", "local-secret-123456"}});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("token=[]"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("local-secret"), std::string::npos) << r.out;
}

TEST(Launcher, ChildrenLeftBehindBySuccessfulWorkersAreStopped) {
  TempDir dir;
  auto r = run_launcher(dir, with({"-n", "2"}, sh("sleep 60 & echo $! > " + dir.path().string() +
                                                  "/bg_$RANK; exit 0")));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (int rank = 0; rank < 2; ++rank) {
    pid_t bg = std::stoi(read_file(dir / ("bg_" + std::to_string(rank))));
    EXPECT_TRUE(wait_pid_gone(bg, 5s)) << "background child of rank " << rank << " survived";
  }
}

TEST(Launcher, PrintConfigShowsOrigins) {
  TempDir dir;
  std::ofstream(dir / "c.yaml") << "max_restarts: 2\nnum_processes: 8\n";
  auto r = run_launcher(dir, {"--config", dir / "c.yaml", "--num_processes", "3", "--print-config"},
                        30s, {{"ACCEL_TEE", "1"}});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(std::regex_search(r.out, std::regex(R"(num_processes: 3 +# flag --num-processes)")))
      << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex(R"(max_restarts: 2 +# .*c\.yaml:1:15)")))
      << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex(R"(tee: 1 +# environment variable ACCEL_TEE)")))
      << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex(R"(log_dir: "" +# default)"))) << r.out;
}

// Written as HF users write it, `python3 train.py` rather than `train.py`: a print reaches the
// launcher when it is made, not at exit, and is not lost when the worker is killed (torchrun's
// `python -u`; the launcher's environment here has no PYTHONUNBUFFERED).
TEST(Launcher, APython3WorkersPrintArrivesBeforeItEnds) {
  TempDir dir;
  Launched l(dir, {"-n", "1", "--stop-timeout", "2s", "--", "/usr/bin/python3", "-c",
                   "import time; print('step 1 done'); time.sleep(60)"});
  EXPECT_TRUE(wait_until(
      [&] { return l.out_so_far().find("[rank 0] step 1 done") != std::string::npos; }, 20s))
      << l.out_so_far() << l.err_so_far();
  l.signal(SIGTERM);
  auto r = l.wait(30s);
  EXPECT_FALSE(r.timed_out);
}

// A Python worker does not load libaccel, yet gets its malloc thresholds from accel-launch: a
// 24 MiB allocation comes from the heap (brk: the [heap] mapping), where glibc's own start (a 128
// KiB mmap threshold) maps it afresh; ACCEL_KEEP_FREED_MEMORY=0 leaves glibc's. Asked of glibc
// itself, through ctypes.
TEST(Launcher, APythonWorkerGetsLibaccelsMallocThresholdsUnlessTurnedOff) {
  TempDir dir;
  const std::string script =
      "import ctypes\n"
      "libc = ctypes.CDLL(None)\n"
      "libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]\n"
      "p = libc.malloc(24 << 20)\n"
      "heap = [l.split()[0].split('-') for l in open('/proc/self/maps') if "
      "l.endswith('[heap]\\n')]\n"
      "inside = any(int(a, 16) <= p < int(b, 16) for a, b in heap)\n"
      "print('24 MiB from the', 'heap' if inside else 'mappings')\n";
  // Why: a malloc setting in the test's own environment would win over accel-launch's. An empty
  // GLIBC_TUNABLES sets nothing; glibc's older variables are read even empty (as 0).
  for (const char* name : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                           "MALLOC_MMAP_MAX_", "LD_PRELOAD"}) {
    if (std::getenv(name) != nullptr) GTEST_SKIP() << name << " is set in the test's environment";
  }
  std::map<std::string, std::string> env = {{"GLIBC_TUNABLES", ""}};
  auto launch = [&] {
    return run_launcher(dir, {"-n", "1", "--", "/usr/bin/python3", "-c", script}, 60s, env);
  };
  auto r = launch();
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("[rank 0] 24 MiB from the heap"), std::string::npos) << r.out;
  env["ACCEL_KEEP_FREED_MEMORY"] = "0";
  r = launch();
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("[rank 0] 24 MiB from the mappings"), std::string::npos) << r.out;
  // A value libaccel would refuse: refused before any worker starts, naming the variable.
  env["ACCEL_KEEP_FREED_MEMORY"] = "ture";
  r = launch();
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_NE(
      r.err.find("accel-launch: error: environment variable ACCEL_KEEP_FREED_MEMORY=\"ture\": "
                 "expected true or false"),
      std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find("[rank 0]"), std::string::npos) << r.out;
  // --env replaces the launcher's own value, and is the one checked.
  r = run_launcher(
      dir,
      {"-n", "1", "--env", "ACCEL_KEEP_FREED_MEMORY=off", "--", "/usr/bin/python3", "-c", script},
      60s, env);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("[rank 0] 24 MiB from the mappings"), std::string::npos) << r.out;
}

TEST(Launcher, PythonTorchDistributedAllReduce) {
  TempDir dir;
  auto r = run_launcher(dir, {"-n", "2", std::string(ACCEL_TEST_WORKERS_DIR) + "/allreduce.py"},
                        180s, {{"PYTHON_EXEC", "/usr/bin/python3"}});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("[rank 0] rank 0/2 allreduce=3"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[rank 1] rank 1/2 allreduce=3"), std::string::npos) << r.out;
}

// A script run by an interpreter without torch (the first python3 on PATH is often not the
// virtualenv's) ends with a summary that names the interpreter and PYTHON_EXEC.
TEST(Launcher, APythonWithoutTorchGetsAHintNamingTheInterpreterAndPythonExec) {
  TempDir dir;
  std::ofstream(dir / "train.py")
      << "import sys\n"
         "sys.path = [p for p in sys.path if 'packages' not in p]  # a Python without torch\n"
         "import torch\n";
  auto r =
      run_launcher(dir, {"-n", "1", dir / "train.py"}, 60s, {{"PYTHON_EXEC", "/usr/bin/python3"}});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("ModuleNotFoundError: No module named 'torch'"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("hint: the worker's Python, /usr/bin/python3, has no torch. accel-launch "
                       "runs a .py script with $PYTHON_EXEC, else the first python3 on PATH;"),
            std::string::npos)
      << r.err;
}

// Another user takes the coordinator's port first (a toy HTTP/2 server that records what it is
// sent, as the attack did), or runs accel there with a token of their own. The victim's launcher
// must send neither the token nor anything replayable, and stop at once, saying why: the control
// plane always runs over TLS, with a certificate only a token holder can present.
TEST(Launcher, ASquatterOnTheCoordinatorPortIsSentNothingAndTheLauncherStopsAtOnce) {
  TempDir dir;
  const std::string token = "victim-token-0123456789abcdef";
  int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(listener, 16), 0);
  socklen_t len = sizeof addr;
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
  const int port = ntohs(addr.sin_port);
  std::string received;
  std::atomic<bool> stop{false};
  std::thread squatter([&] {
    while (!stop) {
      pollfd p{listener, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      int c = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) continue;
      const char settings[] = {0, 0, 0, 4, 0, 0, 0, 0, 0};  // an HTTP/2 SETTINGS frame
      (void)!::write(c, settings, sizeof settings);
      char buf[4096];
      for (;;) {
        pollfd q{c, POLLIN, 0};
        if (::poll(&q, 1, 1000) <= 0) break;
        ssize_t n = ::read(c, buf, sizeof buf);
        if (n <= 0) break;
        received.append(buf, static_cast<size_t>(n));
      }
      ::close(c);
    }
  });
  auto victim = run_launcher(dir,
                             {"--nodes", "2", "--machine-rank", "1", "--main-process-ip",
                              "127.0.0.1", "--coordinator-port", std::to_string(port), "/bin/true"},
                             60s, {{"ACCEL_TOKEN", token}});
  stop = true;
  squatter.join();
  ::close(listener);
  EXPECT_EQ(victim.exit_code, 125) << victim.err;
  EXPECT_LT(victim.elapsed, 10s) << "the launcher kept retrying a server that failed the proof";
  EXPECT_NE(victim.err.find("failed the TLS handshake that proves it holds this job's token, so "
                            "it was sent nothing"),
            std::string::npos)
      << victim.err;
  ASSERT_FALSE(received.empty()) << "the launcher never reached the squatter";
  EXPECT_EQ(static_cast<unsigned char>(received[0]), 0x16) << "not a TLS handshake record";
  EXPECT_EQ(received.find(token), std::string::npos) << "the token was sent in the clear";
  EXPECT_EQ(received.find("authorization"), std::string::npos);

  // A squatter that runs accel with a token of its own: its TLS certificate is not the victim's.
  const int port2 = free_port();
  Launched impostor(
      dir, ACCEL_LAUNCH_BIN,
      {"--nodes", "2", "--machine-rank", "0", "--main-process-ip", "127.0.0.1",
       "--coordinator-port", std::to_string(port2), "--join-timeout", "30s", "/bin/true"},
      {{"ACCEL_TOKEN", "impostor-token-0123456789abcdef"}}, "impostor");
  ASSERT_TRUE(wait_until(
      [&] {
        return (impostor.err_so_far() + impostor.out_so_far()).find("coordinator listening") !=
               std::string::npos;
      },
      20s))
      << impostor.err_so_far();
  auto victim2 =
      run_launcher(dir,
                   {"--nodes", "2", "--machine-rank", "1", "--main-process-ip", "127.0.0.1",
                    "--coordinator-port", std::to_string(port2), "/bin/true"},
                   60s, {{"ACCEL_TOKEN", token}});
  EXPECT_EQ(victim2.exit_code, 125) << victim2.err;
  EXPECT_LT(victim2.elapsed, 10s);
  EXPECT_NE(victim2.err.find("failed the TLS handshake that proves it holds this job's token"),
            std::string::npos)
      << victim2.err;
  impostor.signal(SIGTERM);
  auto imp = impostor.wait(20s);
  EXPECT_EQ((imp.out + imp.err).find("succeeded"), std::string::npos)
      << "the impostor's job got its second node:\n"
      << imp.err;
}

// Debian's /etc/hosts maps the host's own name to 127.0.1.1: a main_process_ip given as that
// name left the other nodes retrying "connection refused" for the whole join_timeout. Each
// launcher now refuses it at once, naming loopback and the fix. /etc/hosts is replaced inside a
// mount namespace of the launcher's own (root only; skipped elsewhere).
TEST(Launcher, AMainAddressWhoseNameResolvesToLoopbackIsRefusedAtOnce) {
  if (std::system("unshare -m true >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "cannot make a mount namespace here (needs root)";
  TempDir dir;
  write_file(dir / "hosts", "127.0.0.1 localhost\n127.0.1.1 h1\n");
  const std::string port = std::to_string(free_port());
  for (const char* rank : {"0", "1"}) {
    Launched l(dir, "/usr/bin/unshare",
               {"-m", "/bin/sh", "-c", "mount --bind \"$0\" /etc/hosts && exec \"$@\"",
                dir / "hosts", ACCEL_LAUNCH_BIN, "--nodes", "2", "--machine-rank", rank,
                "--main-process-ip", "h1", "--coordinator-port", port, "/bin/true"},
               {{"ACCEL_TOKEN", "loopback-test-token-0123456789"}}, std::string("rank") + rank);
    auto r = l.wait(30s);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_LT(r.elapsed, 5s);
    EXPECT_NE(r.err.find("main_process_ip h1 resolves to 127.0.1.1, a loopback address: the other "
                         "machines cannot reach this one there"),
              std::string::npos)
        << r.err;
  }
}

// Each node's workers get GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME: the interface of the address
// the node registered with (gloo would otherwise pick it from the host name); a value the user
// set stays.
TEST(Launcher, EveryNodesWorkersGetTheInterfaceOfTheNodesAddress) {
  TempDir dir;
  const std::string port = std::to_string(free_port());
  const std::map<std::string, std::string> token = {
      {"ACCEL_TOKEN", "ifname-test-token-0123456789"}};
  auto args = [&](const char* rank) {
    return std::vector<std::string>{"--nodes",
                                    "2",
                                    "--machine-rank",
                                    rank,
                                    "--main-process-ip",
                                    "127.0.0.1",
                                    "--coordinator-port",
                                    port,
                                    "--",
                                    "/bin/sh",
                                    "-c",
                                    "echo \"gloo=$GLOO_SOCKET_IFNAME nccl=$NCCL_SOCKET_IFNAME\""};
  };
  Launched node0(dir, ACCEL_LAUNCH_BIN, args("0"), token, "node0");
  auto env1 = token;
  env1["GLOO_SOCKET_IFNAME"] = "mine0";
  Launched node1(dir, ACCEL_LAUNCH_BIN, args("1"), env1, "node1");
  auto r0 = node0.wait(60s);
  auto r1 = node1.wait(60s);
  ASSERT_EQ(r0.exit_code, 0) << r0.err;
  ASSERT_EQ(r1.exit_code, 0) << r1.err;
  EXPECT_NE(r0.out.find("gloo=lo nccl=lo"), std::string::npos) << r0.out;
  EXPECT_NE(r1.out.find("gloo=mine0 nccl=lo"), std::string::npos) << r1.out;
}

TEST(Launcher, HungRankGetsADesyncReportAndTheGroupRestarts) {
  TempDir dir;
  RunResult r = run_launcher(
      dir,
      {"-n", "2", "--hang-timeout", "2s", "--max-restarts", "1", RUNTIME_WORKER_BIN, "hang", "1"},
      90s);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("hang detected on this node: rank 0 has been in barrier #3 for"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("rank 1: outside any collective; last barrier #2 finished"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("<- lagging"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("rank 1 done"), std::string::npos) << r.out;
}

TEST(Launcher, CpuHangOutsideCollectivesIsCaughtByTheHeartbeat) {
  TempDir dir;
  RunResult r = run_launcher(dir,
                             {"-n", "1", "--heartbeat-timeout", "2s", "--hang-timeout", "0",
                              RUNTIME_WORKER_BIN, "hang", "0"},
                             90s);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("rank 0 has shown no progress for"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("hung: rank 0 is outside any collective; its last was barrier #2"),
            std::string::npos)
      << r.err;
}

}  // namespace
}  // namespace accel::testing

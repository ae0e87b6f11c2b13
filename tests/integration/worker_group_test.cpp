// WorkerGroup with real processes: exits seen at once, output drained first, stop escalation,
// process-group cleanup, spawn errors.
#include "agent/supervisor/worker_group.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <csignal>
#include <ctime>

#include "tests/integration/harness.h"

namespace accel::supervisor {
namespace {

using accel::testing::TempDir;
using namespace std::chrono_literals;

WorkerSpec shell(int rank, const std::string& script) {
  WorkerSpec s;
  s.rank = rank;
  s.local_rank = rank;
  s.argv = {"/bin/sh", "-c", script};
  s.env = {{"PATH", "/usr/bin:/bin"}, {"RANK", std::to_string(rank)}};
  s.stdout_to_console = false;
  s.stderr_to_console = false;
  return s;
}

// Runs the io_context until `done` or a bound, so a bug fails the test instead of hanging it.
void run_until(boost::asio::io_context& io, const bool& done, std::chrono::seconds bound = 20s) {
  auto deadline = std::chrono::steady_clock::now() + bound;
  while (!done && std::chrono::steady_clock::now() < deadline) io.run_one_for(100ms);
  ASSERT_TRUE(done) << "timed out";
}

TEST(WorkerGroup, ReportsExitsWithOutputDrained) {
  boost::asio::io_context io;
  WorkerGroup group(io, {});
  std::vector<WorkerExit> exits;
  bool done = false;
  ASSERT_TRUE(
      group
          .start(
              {shell(0, "i=0; while [ $i -lt 500 ]; do echo line $i >&2; i=$((i+1)); done; exit 5"),
               shell(1, "kill -USR1 $$")},
              [&](const WorkerExit& e) {
                exits.push_back(e);
                done = exits.size() == 2;
              })
          .is_ok());
  run_until(io, done);
  std::sort(exits.begin(), exits.end(), [](auto& a, auto& b) { return a.rank < b.rank; });
  EXPECT_FALSE(exits[0].signaled);
  EXPECT_EQ(exits[0].exit_code, 5);
  EXPECT_EQ(exits[0].status_code(), 5);
  ASSERT_FALSE(exits[0].stderr_tail.empty());
  EXPECT_EQ(exits[0].stderr_tail.back(), "line 499");  // read before the exit was reported
  EXPECT_TRUE(exits[1].signaled);
  EXPECT_EQ(exits[1].signal, SIGUSR1);
  EXPECT_EQ(exits[1].status_code(), 128 + SIGUSR1);
  EXPECT_EQ(exits[1].describe(), "SIGUSR1 (signal 10)");
  EXPECT_FALSE(exits[1].during_stop);
}

TEST(WorkerGroup, StopEscalatesToSigkill) {
  TempDir dir;
  boost::asio::io_context io;
  WorkerGroupOptions opts;
  opts.stop_timeout = 300ms;
  WorkerGroup group(io, opts);
  std::vector<WorkerExit> exits;
  ASSERT_TRUE(group
                  .start({shell(0, "exec sleep 60"),
                          shell(1, "trap '' TERM; touch " + (dir / "ready") + "; exec sleep 60")},
                         [&](const WorkerExit& e) { exits.push_back(e); })
                  .is_ok());
  ASSERT_TRUE(accel::testing::wait_for_file(dir / "ready", 10s, 0));
  EXPECT_EQ(group.running(), 2u);
  bool stopped = false;
  StopReport report;
  auto t0 = std::chrono::steady_clock::now();
  group.stop(SIGTERM, [&](const StopReport& r) {
    report = r;
    stopped = true;
  });
  run_until(io, stopped);
  auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_TRUE(report.escalated_to_sigkill);
  EXPECT_TRUE(report.unkillable.empty());
  EXPECT_GE(took, 300ms);
  EXPECT_LT(took, 5s);
  ASSERT_EQ(exits.size(), 2u);
  for (const auto& e : exits) {
    EXPECT_TRUE(e.during_stop);
    EXPECT_EQ(e.signal, e.rank == 0 ? SIGTERM : SIGKILL) << "rank " << e.rank;
  }
  EXPECT_EQ(group.running(), 0u);
}

// A worker stopped with SIGSTOP (Ctrl-Z, a detached debugger) gets SIGCONT after the stop's
// signal, so it ends at once instead of costing the whole stop_timeout.
TEST(WorkerGroup, AStoppedWorkerIsContinuedSoTheStopSignalActs) {
  TempDir dir;
  boost::asio::io_context io;
  WorkerGroupOptions opts;
  opts.stop_timeout = 30s;
  WorkerGroup group(io, opts);
  std::vector<WorkerExit> exits;
  ASSERT_TRUE(group
                  .start({shell(0, "touch " + (dir / "ready") + "; exec sleep 60")},
                         [&](const WorkerExit& e) { exits.push_back(e); })
                  .is_ok());
  ASSERT_TRUE(accel::testing::wait_for_file(dir / "ready", 10s, 0));
  ASSERT_EQ(::kill(group.pids().at(0), SIGSTOP), 0);
  bool stopped = false;
  StopReport report;
  auto t0 = std::chrono::steady_clock::now();
  group.stop(SIGTERM, [&](const StopReport& r) {
    report = r;
    stopped = true;
  });
  run_until(io, stopped);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s) << "waited for the 30 s stop_timeout";
  EXPECT_FALSE(report.escalated_to_sigkill);
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_EQ(exits[0].signal, SIGTERM);
}

TEST(WorkerGroup, StopKillsTheWorkersOwnChildren) {
  TempDir dir;
  boost::asio::io_context io;
  WorkerGroup group(io, {});
  std::string child_pid = dir / "child";
  ASSERT_TRUE(group
                  .start({shell(0, "sleep 60 & echo $! > " + child_pid + "; wait")},
                         [](const WorkerExit&) {})
                  .is_ok());
  ASSERT_TRUE(accel::testing::wait_for_file(child_pid, 10s));
  pid_t grandchild = std::stoi(accel::testing::read_file(child_pid));
  bool stopped = false;
  group.stop(SIGTERM, [&](const StopReport&) { stopped = true; });
  run_until(io, stopped);
  EXPECT_TRUE(accel::testing::wait_pid_gone(grandchild, 5s));
}

TEST(WorkerGroup, ChildrenLeftBehindGoWhenTheLastWorkerExits) {
  TempDir dir;
  boost::asio::io_context io;
  WorkerGroup group(io, {});
  bool done = false;
  std::string bg = dir / "bg";
  ASSERT_TRUE(group
                  .start({shell(0, "sleep 60 & echo $! > " + bg + "; exit 0")},
                         [&](const WorkerExit& e) {
                           EXPECT_TRUE(e.success());
                           done = true;
                         })
                  .is_ok());
  run_until(io, done);
  pid_t left_behind = std::stoi(accel::testing::read_file(bg));
  EXPECT_TRUE(accel::testing::wait_pid_gone(left_behind, 5s));
}

// A rank killed between creating a shared-memory segment and unlinking it leaves its name in
// /dev/shm; once reaped, the worker's names (accel-<its pid>-...) go, whoever else's stay.
TEST(WorkerGroup, AReapedWorkersSharedMemoryNamesAreRemoved) {
  TempDir dir;
  boost::asio::io_context io;
  WorkerGroup group(io, {});
  std::string other = "/dev/shm/accel-" + std::to_string(::getpid()) + "-test-kept";
  accel::testing::write_file(other, "x");
  int exits = 0;
  bool done = false;
  std::string pid0 = dir / "pid0", pid1 = dir / "pid1";
  // Worker 0 also leaves what must stay: a file it gives another user (as root), and a planted
  // link to a file of this test.
  ASSERT_TRUE(
      group
          .start({shell(0, "echo $$ > " + pid0 +
                               "; echo x > /dev/shm/accel-$$-b1-7; "
                               "echo x > /dev/shm/accel-$$-9; "
                               "echo x > /dev/shm/accel-$$-foreign; "
                               "chown 65534 /dev/shm/accel-$$-foreign 2>/dev/null; "
                               "ln -s " +
                               other + " /dev/shm/accel-$$-link; exit 0"),
                  shell(1, "echo $$ > " + pid1 + "; echo x > /dev/shm/accel-$$-5; kill -KILL $$")},
                 [&](const WorkerExit&) { done = ++exits == 2; })
          .is_ok());
  run_until(io, done);
  std::vector<std::string> left;
  for (const auto& file : {pid0, pid1}) {
    std::string pid = accel::testing::lines_of(accel::testing::read_file(file)).at(0);
    for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
      std::string name = e.path().filename().string();
      if (name.rfind("accel-" + pid + "-", 0) == 0) left.push_back(name);
    }
  }
  std::string w0 = "accel-" + accel::testing::lines_of(accel::testing::read_file(pid0)).at(0);
  std::vector<std::string> expected = {w0 + "-link"};
  // Only root can give a file away; as another user the worker still owns it, and it goes.
  if (::geteuid() == 0) expected.push_back(w0 + "-foreign");
  std::sort(left.begin(), left.end());
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(left, expected) << "exactly the worker's own plain files go";
  EXPECT_TRUE(std::filesystem::exists(other))
      << "another process's segment, the link's target, went";
  for (const auto& name : left) std::filesystem::remove("/dev/shm/" + name);
  std::filesystem::remove(other);
}

// A launcher SIGKILLed with its workers reaps nobody: a segment made in the moment before every
// rank had mapped it stays in /dev/shm. The next group's start removes this user's names whose
// process is gone and which are a minute old; a fresh one (a process of another pid namespace
// may be setting it up), a live process's, a link and another user's stay.
TEST(WorkerGroup, StartRemovesOldSharedMemoryNamesOfProcessesThatAreGone) {
  pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ASSERT_GT(dead, 0);
  ::waitpid(dead, nullptr, 0);
  const std::string d = "/dev/shm/accel-" + std::to_string(dead) + "-";
  const std::string live = "/dev/shm/accel-" + std::to_string(::getpid()) + "-test-live";
  const std::string target = "/dev/shm/accel-test-target-" + std::to_string(::getpid());
  struct Made {
    std::string path;
    bool old, goes;
  };
  std::vector<Made> made = {{d + "b1-7", true, true},    {d + "12", true, true},
                            {d + "fresh", false, false}, {live, true, false},
                            {d + "link", true, false},   {d + "given", true, ::geteuid() != 0}};
  accel::testing::write_file(target, "x");
  const timespec old[2] = {{::time(nullptr) - 120, 0}, {::time(nullptr) - 120, 0}};
  for (const auto& m : made) {
    if (m.path == d + "link") {
      ASSERT_EQ(::symlink(target.c_str(), m.path.c_str()), 0);
    } else {
      accel::testing::write_file(m.path, "x");
    }
    if (m.path == d + "given" && ::geteuid() == 0) {
      ASSERT_EQ(::chown(m.path.c_str(), 65534, -1), 0);
    }
    if (m.old) {
      ASSERT_EQ(::utimensat(AT_FDCWD, m.path.c_str(), old, AT_SYMLINK_NOFOLLOW), 0);
    }
  }
  boost::asio::io_context io;
  WorkerGroup group(io, {});
  bool done = false;
  ASSERT_TRUE(group.start({shell(0, "exit 0")}, [&](const WorkerExit&) { done = true; }).is_ok());
  run_until(io, done);
  for (const auto& m : made) {
    struct stat st {};
    bool there = ::lstat(m.path.c_str(), &st) == 0;
    EXPECT_EQ(there, !m.goes) << m.path << (m.goes ? " should have gone" : " should be kept");
    ::unlink(m.path.c_str());
  }
  EXPECT_TRUE(std::filesystem::exists(target)) << "the link's target went";
  ::unlink(target.c_str());
}

TEST(WorkerGroup, SpawnErrorNamesTheRankAndKillsTheOthers) {
  boost::asio::io_context io;
  WorkerGroup group(io, {});
  WorkerSpec bad = shell(1, "");
  bad.argv = {"/nonexistent/program"};
  Status s = group.start({shell(0, "exec sleep 60"), bad}, [](const WorkerExit&) {});
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("rank 1: cannot start /nonexistent/program"), std::string::npos)
      << s.message();
  for (pid_t p : group.pids()) {
    if (p > 0) {
      EXPECT_TRUE(accel::testing::wait_pid_gone(p, 2s));
    }
  }
}

TEST(WorkerGroup, WorkersHaveTheirOwnProcessGroupAndNullStdin) {
  TempDir dir;
  boost::asio::io_context io;
  WorkerGroup group(io, {});
  bool done = false;
  std::string out = dir / "ids";
  ASSERT_TRUE(group
                  .start({shell(0, "echo $$ $(ps -o pgid= -p $$) > " + out +
                                       "; readlink /proc/$$/fd/0 >> " + out)},
                         [&](const WorkerExit&) { done = true; })
                  .is_ok());
  run_until(io, done);
  auto lines = accel::testing::lines_of(accel::testing::read_file(out));
  ASSERT_EQ(lines.size(), 2u);
  std::istringstream ids(lines[0]);
  int pid = 0, pgid = 0;
  ids >> pid >> pgid;
  EXPECT_EQ(pid, pgid);
  EXPECT_EQ(lines[1], "/dev/null");
}

}  // namespace
}  // namespace accel::supervisor

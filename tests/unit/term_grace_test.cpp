// SIGTERM lets an in-flight background write finish, bounded, then the process dies of SIGTERM
// as it would have; with no write in flight it dies at once; a program's own SIGTERM handler is
// left alone. Real processes (fork) and real signals; this test process arms it first too, as
// the background saves of other tests in it do, so each child is a forked, armed process.
#include "runtime/term_grace.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

namespace accel::term_grace {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

struct Outcome {
  int status = 0;
  std::chrono::milliseconds elapsed{};
};

// Forks a child that runs `child` (then sleeps until killed), SIGTERMs it after 100 ms, and
// waits for it (SIGKILL after 10 s).
template <class F>
Outcome sigterm_child(F child) {
  arm();
  pid_t pid = ::fork();
  if (pid == 0) {
    child();
    for (;;) ::pause();
  }
  std::this_thread::sleep_for(100ms);
  const auto sent = std::chrono::steady_clock::now();
  ::kill(pid, SIGTERM);
  Outcome out;
  for (int i = 0; i < 1000 && ::waitpid(pid, &out.status, WNOHANG) == 0; ++i)
    std::this_thread::sleep_for(10ms);
  if (::waitpid(pid, &out.status, WNOHANG) == 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &out.status, 0);
  }
  out.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - sent);
  return out;
}

fs::path marker(const std::string& name) {
  return fs::temp_directory_path() / (name + "_" + std::to_string(::getpid()));
}

TEST(TermGrace, AWriteInFlightFinishesThenTheProcessDiesOfSigterm) {
  const auto done = marker("term_grace_done");
  fs::remove(done);
  auto out = sigterm_child([&] {
    arm();
    write_started();
    std::thread([&] {
      std::this_thread::sleep_for(600ms);  // the write, still going when SIGTERM comes
      std::ofstream(done) << "written";
      write_ended();
    }).detach();
  });
  ASSERT_TRUE(WIFSIGNALED(out.status)) << "status " << out.status;
  EXPECT_EQ(WTERMSIG(out.status), SIGTERM);
  EXPECT_TRUE(fs::exists(done)) << "the process died before its write ended";
  EXPECT_GE(out.elapsed, 300ms);
  fs::remove(done);
}

TEST(TermGrace, WithNoWriteInFlightSigtermKillsAtOnce) {
  auto out = sigterm_child([] { arm(); });
  ASSERT_TRUE(WIFSIGNALED(out.status)) << "status " << out.status;
  EXPECT_EQ(WTERMSIG(out.status), SIGTERM);
  EXPECT_LT(out.elapsed, 1000ms);
}

extern "C" void exit_seven(int) { ::_exit(7); }

TEST(TermGrace, AProgramsOwnSigtermHandlerIsKept) {
  auto out = sigterm_child([] {
    ::signal(SIGTERM, exit_seven);
    arm();
    write_started();  // would hold SIGTERM for 3 s if our handler were installed
  });
  ASSERT_TRUE(WIFEXITED(out.status)) << "status " << out.status;
  EXPECT_EQ(WEXITSTATUS(out.status), 7);
  EXPECT_LT(out.elapsed, 1000ms);
}

}  // namespace
}  // namespace accel::term_grace

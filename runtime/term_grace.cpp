// SIGTERM lets an in-flight background write finish first (term_grace.h).
#include "runtime/term_grace.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace accel::term_grace {

namespace {

// Why bounded: the agent SIGKILLs after its stop timeout anyway; a disk that hangs must not keep
// a stopped worker alive.
constexpr auto kGrace = std::chrono::seconds(3);

int g_pipe[2] = {-1, -1};
std::mutex g_mutex;
std::condition_variable g_idle;
int g_in_flight = 0;

extern "C" void on_sigterm(int) {
  const int saved = errno;
  const char c = 1;
  (void)!::write(g_pipe[1], &c, 1);  // async-signal-safe; the watcher does the rest
  errno = saved;
}

void watch() {
  char c = 0;
  while (::read(g_pipe[0], &c, 1) < 0 && errno == EINTR) {
  }
  {
    std::unique_lock lock(g_mutex);
    g_idle.wait_for(lock, kGrace, [] { return g_in_flight == 0; });
  }
  // Die of SIGTERM, as without this handler (the exit status says so).
  ::signal(SIGTERM, SIG_DFL);
  ::kill(::getpid(), SIGTERM);
}

}  // namespace

void arm() {
  static std::mutex arming;
  static pid_t armed_in = 0;  // Why a pid: a forked child inherits the handler, not the thread
  std::lock_guard guard(arming);
  if (armed_in == ::getpid()) return;
  armed_in = ::getpid();
  struct sigaction old {};
  if (::sigaction(SIGTERM, nullptr, &old) != 0) return;
  const bool ours = (old.sa_flags & SA_SIGINFO) == 0 && old.sa_handler == on_sigterm;
  if (!ours && ((old.sa_flags & SA_SIGINFO) != 0 || old.sa_handler != SIG_DFL)) return;
  if (ours) {  // a forked child: its parent's pipe, and its parent's writes, are not its own
    ::close(g_pipe[0]);
    ::close(g_pipe[1]);
    std::lock_guard lock(g_mutex);
    g_in_flight = 0;
  }
  if (::pipe2(g_pipe, O_CLOEXEC) != 0) {
    if (ours) ::signal(SIGTERM, SIG_DFL);
    return;
  }
  std::thread(watch).detach();
  struct sigaction sa {};
  sa.sa_handler = on_sigterm;
  ::sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGTERM, &sa, nullptr);
}

void write_started() {
  std::lock_guard lock(g_mutex);
  ++g_in_flight;
}

void write_ended() {
  {
    std::lock_guard lock(g_mutex);
    --g_in_flight;
  }
  g_idle.notify_all();
}

}  // namespace accel::term_grace

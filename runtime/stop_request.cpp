// The SIGUSR1 flag (stop_request.h).
#include "runtime/stop_request.h"

#include <atomic>
#include <csignal>
#include <mutex>

namespace accel::stop_request {
namespace {

std::atomic<int> g_pending{0};

extern "C" void on_signal(int sig) { g_pending.store(sig, std::memory_order_relaxed); }

}  // namespace

bool arm() {
  static std::once_flag once;
  static bool armed = false;
  std::call_once(once, [] {
    struct sigaction old {};
    if (::sigaction(SIGUSR1, nullptr, &old) != 0) return;
    bool has_own = (old.sa_flags & SA_SIGINFO) != 0 ||
                   (old.sa_handler != SIG_DFL && old.sa_handler != SIG_IGN);
    if (has_own) return;
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    armed = ::sigaction(SIGUSR1, &sa, nullptr) == 0;
  });
  return armed;
}

int pending() { return g_pending.load(std::memory_order_relaxed); }

}  // namespace accel::stop_request

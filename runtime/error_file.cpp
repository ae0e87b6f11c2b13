// Terminate and fatal-signal handlers that record why a worker died.
#include "runtime/error_file.h"

#include <c10/util/Backtrace.h>
#include <c10/util/Exception.h>
#include <cxxabi.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>

#include "contract/worker_contract.h"

namespace accel {
namespace {

std::once_flag g_installed;
char g_path[4096];  // Why: a fatal-signal handler may not allocate; the path is copied here up
                    // front.

std::string demangle(const char* name) {
  int status = 0;
  char* out = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string result = status == 0 && out ? out : name;
  std::free(out);
  return result;
}

[[noreturn]] void on_terminate() {
  std::string message = "std::terminate called without an active exception";
  std::string type = "std::terminate";
  const std::exception_ptr eptr = std::current_exception();
  const bool had_exception = eptr != nullptr;
  if (had_exception) {
    if (auto* t = abi::__cxa_current_exception_type()) type = demangle(t->name());
    try {
      std::rethrow_exception(eptr);
    } catch (const c10::Error& e) {
      message = e.what_without_backtrace();
    } catch (const std::exception& e) {
      message = e.what();
    } catch (...) {
      message = "an exception that is not a std::exception";
    }
  }
  std::fprintf(stderr, "accel: uncaught %s: %s\n", type.c_str(), message.c_str());
  std::fflush(stderr);
  if (g_path[0] != '\0') write_error_file(g_path, message, type, c10::get_backtrace(1));
  // Why exit 1 for an exception: as Python does for an uncaught one; the message above says what
  // went wrong, and SIGABRT's core dump and "134" only made a clear error look like a crash.
  // std::terminate without an exception (a noexcept violation, a joinable thread destroyed) is a
  // real bug and still aborts.
  if (had_exception) {
    std::fflush(nullptr);
    std::_Exit(1);
  }
  std::signal(SIGABRT, SIG_DFL);
  std::abort();
}

void on_fatal_signal(int sig) {
  // Async-signal-safe: open/write/close, then die of the same signal.
  if (g_path[0] != '\0') {
    int fd = ::open(g_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd >= 0) {
      const char* name = sig == SIGSEGV  ? "SIGSEGV"
                         : sig == SIGBUS ? "SIGBUS"
                         : sig == SIGFPE ? "SIGFPE"
                                         : "SIGILL";
      char buf[256];
      std::size_t n = 0;
      auto put = [&](const char* s) {
        while (*s && n + 1 < sizeof buf) buf[n++] = *s++;
      };
      put("{\"message\":\"fatal signal ");
      put(name);
      put("\",\"type\":\"signal\",\"stack\":\"\"}\n");
      ssize_t ignored = ::write(fd, buf, n);
      (void)ignored;
      ::close(fd);
    }
  }
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

}  // namespace

void write_error_file(const std::string& path, const std::string& message, const std::string& type,
                      const std::string& stack) {
  nlohmann::json j;
  j[contract::error_file::kMessage] = message;
  j[contract::error_file::kType] = type;
  j[contract::error_file::kStack] = stack;
  j[contract::error_file::kTime] = static_cast<long long>(std::time(nullptr));
  if (const char* rank = std::getenv(contract::kRank)) j[contract::error_file::kRank] = rank;
  // Why O_EXCL | O_NOFOLLOW and the pid: the temp name must be a new file of ours, never a
  // link planted beside the error file.
  std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  ::unlink(tmp.c_str());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) return;
  const std::string text = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  std::size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<std::size_t>(n);
  }
  ::close(fd);
  if (done != text.size() || std::rename(tmp.c_str(), path.c_str()) != 0) ::unlink(tmp.c_str());
}

void install_error_handlers() {
  std::call_once(g_installed, [] {
    std::set_terminate(on_terminate);
    const char* path = std::getenv(contract::kErrorFile);
    if (path == nullptr || *path == '\0') path = std::getenv(contract::kTorchelasticErrorFile);
    if (path == nullptr || std::strlen(path) >= sizeof g_path) return;
    std::strcpy(g_path, path);
    for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL}) std::signal(sig, on_fatal_signal);
  });
}

}  // namespace accel

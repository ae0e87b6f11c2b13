// Helpers for integration tests: run accel-launch as a real process with its output captured,
// signal it, and wait for it or for other pids with bounded timeouts.
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/common/files.h"
#include "tests/common/paths.h"

extern char** environ;  // NOLINT

namespace accel::testing {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

inline std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream s(text);
  for (std::string line; std::getline(s, line);) out.push_back(line);
  return out;
}

struct RunResult {
  int exit_code = -1;   // when it exited
  int term_signal = 0;  // when a signal ended it
  bool timed_out = false;
  std::string out;
  std::string err;
  std::chrono::milliseconds elapsed{0};
};

// True once `pid` (not necessarily our child) is gone, or false after `timeout`.
inline bool wait_pid_gone(pid_t pid, std::chrono::milliseconds timeout) {
  int fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (fd < 0) return errno == ESRCH;
  pollfd p{fd, POLLIN, 0};
  int rc = ::poll(&p, 1, static_cast<int>(timeout.count()));
  ::close(fd);
  return rc == 1;
}

// Polls `pred` every 20 ms until it holds or `timeout` passes; its last value.
inline bool wait_until(const std::function<bool()>& pred, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return pred();
}

// A TCP port on 127.0.0.1 for a server the test starts later, free now and held for this test
// process alone until it exits.
// Why not a port the kernel picks (bind to 0, close): that port comes from the ephemeral range,
// which every outgoing connection and c10d store of the tests running beside this one draws from
// too, and one of them can take it before our server binds it. Ports below the range are never
// handed out by connect(), and a lock per port keeps two test processes from choosing the same
// one: an abstract Unix socket named after the port, which lives in the network namespace as
// the port does and goes away with the process.
inline int free_port() {
  static std::mutex m;
  static std::vector<int> held;  // the lock sockets, open until the process exits
  static unsigned next =
      static_cast<unsigned>(::getpid()) * 7919u ^
      static_cast<unsigned>(std::chrono::steady_clock::now().time_since_epoch().count());
  std::lock_guard<std::mutex> lock(m);
  int ephemeral_low = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> ephemeral_low;
  // Why below 26000 too: clear of the default ports jobs use (29400, 29500).
  constexpr int kFirst = 10000;
  const int count = std::min(ephemeral_low, 26000) - kFirst;
  if (count < 100) {
    std::fprintf(stderr, "free_port: ip_local_port_range starts at %d, leaving no ports below it\n",
                 ephemeral_low);
    std::abort();
  }
  for (int attempt = 0; attempt < count; ++attempt) {
    const int port = kFirst + static_cast<int>(next++ % static_cast<unsigned>(count));
    int lock_fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un name{};
    name.sun_family = AF_UNIX;
    const std::string label = "accel-test-port-" + std::to_string(port);
    std::memcpy(name.sun_path + 1, label.data(), label.size());  // sun_path[0] = 0: abstract
    const auto name_len =
        static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + label.size());
    if (lock_fd < 0 || ::bind(lock_fd, reinterpret_cast<sockaddr*>(&name), name_len) != 0) {
      if (lock_fd >= 0) ::close(lock_fd);
      continue;  // another test process holds it
    }
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    if (fd >= 0) ::close(fd);
    if (!free) {
      ::close(lock_fd);
      continue;
    }
    held.push_back(lock_fd);
    return port;
  }
  std::fprintf(stderr, "free_port: no free port between %d and %d\n", kFirst, ephemeral_low);
  std::abort();
}

inline bool pid_alive(pid_t pid) { return ::kill(pid, 0) == 0; }

// The pids of `parent`'s children (a launcher's or an agent's workers).
inline std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  std::ifstream in("/proc/" + std::to_string(parent) + "/task/" + std::to_string(parent) +
                   "/children");
  for (pid_t pid; in >> pid;) out.push_back(pid);
  return out;
}

// Polls for a file to exist with at least `min_lines` lines (bounded).
inline bool wait_for_file(const fs::path& p, std::chrono::milliseconds timeout,
                          size_t min_lines = 1) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (fs::exists(p) && lines_of(read_file(p)).size() >= min_lines) return true;
    std::this_thread::sleep_for(10ms);
  }
  return false;
}

// accel-launch (ACCEL_LAUNCH_BIN) running with stdout/stderr into files of `dir`.
class Launched {
 public:
  Launched(const TempDir& dir, const std::vector<std::string>& args,
           const std::map<std::string, std::string>& extra_env = {})
      : Launched(dir, ACCEL_LAUNCH_BIN, args, extra_env, "launcher") {}

  // Any program, output in <dir>/<name>.out and <dir>/<name>.err.
  Launched(const TempDir& dir, const std::string& binary, const std::vector<std::string>& args,
           const std::map<std::string, std::string>& extra_env, const std::string& name)
      : out_(dir / (name + ".out")), err_(dir / (name + ".err")) {
    std::vector<std::string> argv = {binary};
    argv.insert(argv.end(), args.begin(), args.end());
    std::map<std::string, std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      std::string kv(*e);
      auto eq = kv.find('=');
      // Why not PYTHONUNBUFFERED: the launcher's own default must be what a test sees.
      if (eq != std::string::npos && kv.rfind("ACCEL_", 0) != 0 &&
          kv.rfind("PYTHONUNBUFFERED=", 0) != 0)
        env[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    // Why TMPDIR: an agent's default state folder ($TMPDIR/accel-agent-<uid>-<node id>) outlives
    // it by design, and in /tmp it would outlive the test too; a test may still give its own.
    env["TMPDIR"] = dir.path().string();
    for (const auto& [k, v] : extra_env) env[k] = v;
    env["HOME"] = dir.path().string();  // no user config file leaks into tests
    std::vector<std::string> env_strings;
    for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
    std::vector<char*> cargv, cenv;
    for (auto& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    for (auto& e : env_strings) cenv.push_back(e.data());
    cenv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 1, out_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&fa, 2, err_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    start_ = std::chrono::steady_clock::now();
    if (::posix_spawn(&pid_, cargv[0], &fa, nullptr, cargv.data(), cenv.data()) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&fa);
  }
  ~Launched() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  pid_t pid() const { return pid_; }
  // What it has written so far.
  std::string out_so_far() const { return read_file(out_); }
  std::string err_so_far() const { return read_file(err_); }
  const std::string& err_path() const { return err_; }
  void signal(int sig) const { ::kill(pid_, sig); }

  // Waits for the launcher to end; SIGKILLs it after `timeout`.
  RunResult wait(std::chrono::milliseconds timeout = 30s) {
    RunResult r;
    if (!wait_pid_gone(pid_, timeout)) {
      r.timed_out = true;
      ::kill(pid_, SIGKILL);
    }
    int status = 0;
    ::waitpid(pid_, &status, 0);
    reaped_ = true;
    r.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::steady_clock::now() - start_);
    if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
    if (WIFSIGNALED(status)) r.term_signal = WTERMSIG(status);
    r.out = read_file(out_);
    r.err = read_file(err_);
    return r;
  }

 private:
  std::string out_, err_;
  pid_t pid_ = -1;
  bool reaped_ = false;
  std::chrono::steady_clock::time_point start_;
};

inline RunResult run_launcher(const TempDir& dir, const std::vector<std::string>& args,
                              std::chrono::milliseconds timeout = 30s,
                              const std::map<std::string, std::string>& extra_env = {}) {
  Launched l(dir, args, extra_env);
  return l.wait(timeout);
}

}  // namespace accel::testing

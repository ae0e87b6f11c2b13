// WorkerGroup: spawns one attempt's local workers and watches them until they are gone.
//
// Each worker runs in its own process group with PR_SET_PDEATHSIG=SIGKILL (no worker outlives
// the process that spawned it), stdin from /dev/null, stdout/stderr through pipes into
// LineSinks. Exits are seen at once through a pidfd per worker, not by polling. Stopping is
// signal -> stop_timeout -> SIGKILL -> kill_timeout, and never waits longer than that: a worker
// that survives SIGKILL (D state) is reported, not waited for. When the last worker has exited,
// for whatever reason, anything still in the workers' process groups (children they left
// behind) is SIGKILLed.
//
// Thread: everything runs on the io_context passed in, which must be run by one long-lived
// thread. Why: PR_SET_PDEATHSIG fires when the *thread* that forked the worker exits.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "agent/common/defaults.h"
#include "agent/common/status.h"
#include "agent/supervisor/worker_env.h"

namespace accel::supervisor {

struct WorkerSpec {
  int rank = 0;
  int local_rank = 0;
  std::vector<std::string> argv;  // argv[0]: the executable's path (resolved by the caller)
  EnvMap env;                     // the worker's whole environment
  std::string working_dir;        // empty: the caller's
  std::string log_path;           // empty: no log file; else created/truncated
  bool stdout_to_console = true;
  bool stderr_to_console = true;
  std::string prefix;  // put before every console line: "[rank 0] "
  // Also handed every output line (the agent forwards them to watching launchers).
  std::function<void(bool is_stderr, std::string_view line)> forward;
};

struct WorkerExit {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = -1;
  bool signaled = false;
  int exit_code = 0;                           // when !signaled
  int signal = 0;                              // when signaled
  std::chrono::system_clock::time_point time;  // when the exit was seen
  bool during_stop = false;                    // the group was being stopped when this worker ended
  std::vector<std::string> stderr_tail;

  [[nodiscard]] bool success() const { return !signaled && exit_code == 0; }
  // The shell's convention: the exit code, or 128 + the signal number.
  [[nodiscard]] int status_code() const { return signaled ? 128 + signal : exit_code; }
  // "exit code 3" or "SIGKILL (signal 9)".
  [[nodiscard]] std::string describe() const;
};

struct StopReport {
  bool escalated_to_sigkill = false;
  std::vector<pid_t> unkillable;  // still alive kill_timeout after SIGKILL
};

struct WorkerGroupOptions {
  std::chrono::milliseconds stop_timeout{defaults::kStopTimeout};  // stop signal -> SIGKILL
  std::chrono::milliseconds kill_timeout{5'000};                   // SIGKILL -> give up waiting
  int console_stdout_fd = STDOUT_FILENO;
  int console_stderr_fd = STDERR_FILENO;
  size_t stderr_tail_lines = 8;
  // Told once per rank log file that cannot be written (the file and the error; see LineSink).
  std::function<void(const std::string& problem)> on_warning{};
};

// "SIGTERM" for 15; "signal 77" when the number has no name.
std::string signal_name(int signal);

class WorkerGroup {
 public:
  using ExitHandler = std::function<void(const WorkerExit&)>;
  using StopHandler = std::function<void(const StopReport&)>;

  WorkerGroup(boost::asio::io_context& io, WorkerGroupOptions options);
  // Invariant: no worker outlives the group: any still running are SIGKILLed here.
  ~WorkerGroup();
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  // Spawns every worker (Boost.Process). If one cannot be spawned, those already started are
  // killed and the status names the rank and the reason. `on_exit` runs once per worker on the
  // io thread, after the output the worker wrote has been read; it may call stop() but must not
  // destroy the group (post that instead).
  Status start(std::vector<WorkerSpec> specs, ExitHandler on_exit);

  // Sends `signal` to every worker's process group, SIGKILL after stop_timeout, then calls
  // `done` once all have exited (or kill_timeout after SIGKILL). Calling it again while stopping
  // adds `done`; with SIGKILL it escalates at once. `done` is always posted, never called inline.
  void stop(int signal, StopHandler done);

  [[nodiscard]] size_t running() const;
  [[nodiscard]] std::vector<pid_t> pids() const;
  // (rank, pid) of each worker that has not exited.
  [[nodiscard]] std::vector<std::pair<int, pid_t>> running_workers() const;

  struct State;  // defined in worker_group.cpp

 private:
  std::shared_ptr<State> state_;  // handlers hold a weak_ptr: the group may be gone by then
};

}  // namespace accel::supervisor

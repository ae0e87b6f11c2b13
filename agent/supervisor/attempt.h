// Attempt: one node's share of one attempt of a job (a restart, or a rendezvous round): its
// folders, its workers' specs and environment, the WorkerGroup, the hang watch, and the first
// failure with the worker's error file. The node agent runs every job's workers through it, in
// every launch mode; what happens next (a restart, the end) is the coordinator's decision.
//
// Thread: the io_context passed in (see WorkerGroup).
#pragma once

#include <boost/asio/io_context.hpp>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "agent/common/job_spec.h"
#include "agent/supervisor/error_file.h"
#include "agent/supervisor/hang_monitor.h"
#include "agent/supervisor/worker_env.h"
#include "agent/supervisor/worker_group.h"

namespace accel::supervisor {

enum class LogLevel { kInfo, kWarn, kError };
using JobLogger = std::function<void(LogLevel, const std::string&)>;

// Where this node's workers sit in the attempt.
struct Placement {
  std::string job_id;
  int attempt = 0;        // names the folders: attempt_<k> (the node agent: the round)
  int restart_count = 0;  // TORCHELASTIC_RESTART_COUNT
  int rank_offset = 0;
  int world_size = 1;
  int node_rank = 0;
  int num_nodes = 1;
  std::string master_addr;
  int master_port = 0;
};

// The first failure of an attempt: a worker that exited non-zero (with its error file), or a hang.
struct AttemptFailure {
  std::optional<WorkerExit> exit;
  std::optional<WorkerError> error;
  std::optional<Hang> hang;
  [[nodiscard]] int rank() const { return exit ? exit->rank : hang->rank; }
};

struct AttemptHooks {
  std::function<void(const WorkerExit&)> on_exit;  // every worker's exit, in the order seen
  // The first failure; the attempt then stops its other workers (SIGTERM, then SIGKILL).
  std::function<void(const AttemptFailure&)> on_failure;
  std::function<void()> on_success;  // every worker exited 0
  // No worker is left after a failure or stop(); called once.
  std::function<void(const StopReport&)> on_stopped;
  // Every output line, when set (the node agent forwards them to watching launchers).
  std::function<void(int rank, bool is_stderr, std::string_view line)> on_line;
  JobLogger log;  // warnings: a rank log file that cannot be written, a worker SIGKILLed
  // A rank log file that cannot be written (also logged), once per file.
  std::function<void(const std::string& problem)> on_log_problem;
};

struct AttemptOptions {
  Placement placement;
  EnvMap base_env;        // the launcher's or agent's environment, inherited by workers
  std::string error_dir;  // this attempt's error files and progress pages; empty: none
  std::string host;       // console prefix "[host:rank] "; empty: "[rank r] "
  WorkerGroupOptions group;
};

class Attempt {
 public:
  Attempt(boost::asio::io_context& io, const JobSpec& spec, AttemptOptions options,
          AttemptHooks hooks);
  ~Attempt();
  Attempt(const Attempt&) = delete;
  Attempt& operator=(const Attempt&) = delete;

  // Creates the attempt's log folder (<log_dir>/<job>/attempt_<k>) and starts every worker and
  // the hang watch; the workers' pids go to the error folder's `workers` file (shm_names.h). An
  // error means nothing runs and no hook will be called.
  Status start();
  // Stops the workers: `signal`, SIGKILL after the grace, then on_stopped. Again while stopping:
  // SIGKILL escalates at once; any other signal changes nothing.
  void stop(int signal);

  [[nodiscard]] bool stopping() const { return stopping_; }
  [[nodiscard]] bool failed() const { return failed_; }
  [[nodiscard]] std::vector<pid_t> pids() const;
  // (rank, pid) of each worker still running.
  [[nodiscard]] std::vector<std::pair<int, pid_t>> running_workers() const {
    return group_ ? group_->running_workers() : std::vector<std::pair<int, pid_t>>{};
  }
  [[nodiscard]] size_t running() const { return group_ ? group_->running() : 0; }
  [[nodiscard]] const Placement& placement() const { return options_.placement; }
  [[nodiscard]] const std::string& error_dir() const { return options_.error_dir; }
  // The workers' progress pages as of the watch's last check, with their step rates; null when
  // the attempt has no folder for pages.
  [[nodiscard]] const HangWatch* hang_watch() const { return hang_watch_.get(); }
  // "<root>/<job>/attempt_<k>"
  static std::string folder(const std::string& root, const std::string& job_id, int attempt);

 private:
  void on_worker_exit(const WorkerExit& exit);
  void on_hang(const Hang& hang);
  void fail(AttemptFailure failure);

  boost::asio::io_context& io_;
  JobSpec spec_;
  AttemptOptions options_;
  AttemptHooks hooks_;
  std::unique_ptr<WorkerGroup> group_;
  std::unique_ptr<HangWatch> hang_watch_;
  int succeeded_ = 0;
  bool failed_ = false;
  bool stopping_ = false;
  bool stopped_ = false;
  int stop_signal_ = 0;
  std::chrono::milliseconds stop_timeout_{0};
  // Why: a WorkerGroup completion may be queued when the owner destroys the attempt.
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
};

}  // namespace accel::supervisor

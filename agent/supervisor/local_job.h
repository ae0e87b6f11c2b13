// LocalJob: runs one job's workers on this node, attempt after attempt, within a restart
// budget: the supervision loop of accel-launch's local mode. It holds the job's rendezvous
// store, as torchrun's agent does: every worker is a client of it. A failing worker stops its
// group (signal -> grace -> SIGKILL) and, while the budget allows, the whole group starts
// again with TORCHELASTIC_RESTART_COUNT / ACCEL_RESTART_COUNT incremented.
// Thread: the io_context passed in (see WorkerGroup).
#pragma once

#include <boost/asio/io_context.hpp>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "agent/store/store_server.h"
#include "agent/supervisor/error_file.h"
#include "agent/supervisor/hang_monitor.h"
#include "agent/supervisor/worker_env.h"
#include "agent/supervisor/worker_group.h"

namespace accel::supervisor {

struct LocalJobOptions {
  std::string job_id;
  std::vector<std::string> argv;  // resolved command line of every worker
  int num_processes = 1;
  int max_restarts = 0;
  JobEnv env;             // master_port 0: the store's port is picked by the kernel
  EnvMap base_env;        // the launcher's environment, inherited by workers
  std::string log_dir;    // empty: console only
  int tee = 3;            // with log_dir: 1 stdout, 2 stderr, 3 both still on console
  std::string error_dir;  // where the workers' error files go (must exist)
  WorkerGroupOptions group;
  HangOptions hang;  // progress pages live beside the error files
};

struct AttemptRecord {
  int attempt = 0;
  int master_port = 0;
  std::chrono::system_clock::time_point started;
  std::vector<WorkerExit> exits;                // in the order seen
  std::optional<size_t> root_cause;             // index into exits: the first failure
  std::optional<WorkerError> root_cause_error;  // from its error file
  std::optional<Hang> hang;                     // the group was stopped because it hung
};

struct JobResult {
  int exit_code = 0;
  bool cancelled = false;
  int cancel_signal = 0;
  std::string spawn_error;  // set when workers could not be started
  std::vector<AttemptRecord> attempts;
  std::vector<pid_t> unkillable;
  std::vector<std::string> log_problems;  // rank log files that could not be written, once each
};

enum class LogLevel { kInfo, kWarn, kError };
using JobLogger = std::function<void(LogLevel, const std::string&)>;

class LocalJob {
 public:
  LocalJob(boost::asio::io_context& io, LocalJobOptions options, JobLogger log);
  ~LocalJob();
  LocalJob(const LocalJob&) = delete;
  LocalJob& operator=(const LocalJob&) = delete;

  // Starts attempt 0; `done` runs once, on the io thread, when the job has ended.
  void run(std::function<void(const JobResult&)> done);
  // Stops the job: the signal is forwarded to the workers' process groups (SIGKILL after the
  // grace). A second call escalates to SIGKILL at once.
  void cancel(int signal);

 private:
  void start_attempt();
  void on_worker_exit(const WorkerExit& exit);
  void on_hang(const Hang& hang);
  void on_group_stopped(const StopReport& report);
  void finish();

  boost::asio::io_context& io_;
  LocalJobOptions options_;
  JobLogger log_;
  std::function<void(const JobResult&)> done_;
  std::unique_ptr<WorkerGroup> group_;
  std::unique_ptr<HangWatch> hang_watch_;
  // The rendezvous store (TCPStore protocol) at MASTER_ADDR:MASTER_PORT, bound before the first
  // worker starts and held for the whole job; emptied before every attempt.
  std::unique_ptr<store::StoreServer> store_;
  JobResult result_;
  int restart_count_ = 0;
  size_t successes_ = 0;
  bool stopping_ = false;
  bool finished_ = false;
};

// The table printed when a job fails: every rank of the last attempt with its result, time
// and last stderr lines, the root cause marked, and the failures of earlier attempts.
std::string format_failure_summary(const LocalJobOptions& options, const JobResult& result);

}  // namespace accel::supervisor

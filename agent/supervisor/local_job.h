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

#include "agent/common/job_spec.h"
#include "agent/store/store_server.h"
#include "agent/supervisor/attempt.h"

namespace accel::supervisor {

struct LocalJobOptions {
  std::string job_id;
  JobSpec spec;             // its processes_per_node workers run on this node
  std::string master_addr;  // where the job's store listens (MASTER_ADDR)
  EnvMap base_env;          // the launcher's environment, inherited by workers
  // Error files and progress pages go to <error_root>/<job_id>/attempt_<k>/ (the folder must
  // exist); empty: failures are reported without their error messages.
  std::string error_root;
  WorkerGroupOptions group;
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
  void on_failure(const AttemptFailure& failure);
  void on_stopped(const StopReport& report);
  void finish();

  boost::asio::io_context& io_;
  LocalJobOptions options_;
  JobLogger log_;
  std::function<void(const JobResult&)> done_;
  std::unique_ptr<Attempt> attempt_;
  // The rendezvous store (TCPStore protocol) at MASTER_ADDR:MASTER_PORT, bound before the first
  // worker starts and held for the whole job; emptied before every attempt.
  std::unique_ptr<store::StoreServer> store_;
  JobResult result_;
  int restart_count_ = 0;
  bool finished_ = false;
};

// The table printed when a job fails: every rank of the last attempt with its result, time
// and last stderr lines, the root cause marked, and the failures of earlier attempts.
std::string format_failure_summary(const LocalJobOptions& options, const JobResult& result);

}  // namespace accel::supervisor

// One node's share of one attempt: folders, worker specs, group, hang watch, first failure.
#include "agent/supervisor/attempt.h"

#include <csignal>
#include <filesystem>

#include "agent/supervisor/shm_names.h"
#include "agent/supervisor/worker_specs.h"
#include "contract/duration.h"
#include "contract/worker_contract.h"

namespace accel::supervisor {

namespace fs = std::filesystem;

std::string Attempt::folder(const std::string& root, const std::string& job_id, int attempt) {
  return root + "/" + job_id + "/attempt_" + std::to_string(attempt);
}

Attempt::Attempt(boost::asio::io_context& io, const JobSpec& spec, AttemptOptions options,
                 AttemptHooks hooks)
    : io_(io), spec_(spec), options_(std::move(options)), hooks_(std::move(hooks)) {}

Attempt::~Attempt() {
  *alive_ = false;
  hang_watch_.reset();
  group_.reset();  // kills any worker still running (WorkerGroup's invariant)
}

Status Attempt::start() {
  const Placement& p = options_.placement;
  GroupPlan plan;
  plan.argv = spec_.argv;
  plan.local_world_size = spec_.processes_per_node;
  plan.rank_offset = p.rank_offset;
  plan.world_size = p.world_size;
  plan.node_rank = p.node_rank;
  plan.num_nodes = p.num_nodes;
  plan.env.job_id = p.job_id;
  plan.env.master_addr = p.master_addr;
  plan.env.master_port = p.master_port;
  plan.env.restart_count = p.restart_count;
  plan.env.max_restarts = spec_.max_restarts;
  plan.env.settings = spec_.worker_settings;
  plan.env.omp_num_threads = spec_.omp_num_threads;
  plan.base_env = options_.base_env;
  for (const auto& [k, v] : spec_.extra_env) plan.base_env[k] = v;
  std::error_code ec;
  if (!spec_.working_dir.empty() && fs::is_directory(spec_.working_dir, ec)) {
    plan.working_dir = spec_.working_dir;
  }
  if (!spec_.log_dir.empty()) {
    plan.log_dir = folder(spec_.log_dir, p.job_id, p.attempt);
    fs::create_directories(plan.log_dir, ec);
    if (ec) return Status::error("cannot create log folder " + plan.log_dir + ": " + ec.message());
    plan.tee = spec_.tee;
  }
  plan.error_dir = options_.error_dir;
  HangOptions hang;
  hang.heartbeat_timeout = spec_.heartbeat_timeout;
  hang.collective_timeout = spec_.hang_timeout;
  // Why always: the pages also give the step rates that metrics and straggler reports use.
  hang.observe = true;
  plan.progress_dir = options_.error_dir;
  plan.host = options_.host;
  std::vector<WorkerSpec> specs = make_worker_specs(plan);
  std::vector<std::pair<int, std::string>> pages;
  for (auto& w : specs) {
    auto it = w.env.find(contract::kProgressFile);
    if (it != w.env.end()) pages.emplace_back(w.rank, it->second);
    if (hooks_.on_line) {
      w.forward = [this, rank = w.rank](bool is_stderr, std::string_view line) {
        hooks_.on_line(rank, is_stderr, line);
      };
    }
  }

  WorkerGroupOptions group = options_.group;
  if (spec_.stop_timeout.count() > 0) group.stop_timeout = spec_.stop_timeout;
  group.on_warning = [this](const std::string& problem) {
    if (hooks_.log) hooks_.log(LogLevel::kWarn, problem);
    if (hooks_.on_log_problem) hooks_.on_log_problem(problem);
  };
  stop_timeout_ = group.stop_timeout;
  group_ = std::make_unique<WorkerGroup>(io_, group);
  if (Status s =
          group_->start(std::move(specs), [this](const WorkerExit& e) { on_worker_exit(e); });
      !s) {
    group_.reset();
    return s;
  }
  record_workers(options_.error_dir, group_->pids());
  if (!pages.empty()) {
    hang_watch_ = std::make_unique<HangWatch>(io_, hang, std::move(pages),
                                              options_.host.empty() ? "this node" : options_.host,
                                              [this](const Hang& h) { on_hang(h); });
    hang_watch_->start();
  }
  return Status::ok();
}

std::vector<pid_t> Attempt::pids() const { return group_ ? group_->pids() : std::vector<pid_t>{}; }

void Attempt::on_worker_exit(const WorkerExit& exit) {
  if (hang_watch_) hang_watch_->forget(exit.rank);  // an exited worker cannot hang
  if (hooks_.on_exit) hooks_.on_exit(exit);
  if (stopping_ || exit.during_stop) {  // a worker we are stopping
    if (exit.signaled && exit.signal == SIGKILL && stop_signal_ != SIGKILL && hooks_.log) {
      hooks_.log(LogLevel::kWarn, "rank " + std::to_string(exit.rank) + " (pid " +
                                      std::to_string(exit.pid) + ") did not stop within " +
                                      contract::format_duration(stop_timeout_) + " of " +
                                      signal_name(stop_signal_) + ": SIGKILLed");
    }
    return;
  }
  if (exit.success()) {
    if (++succeeded_ == spec_.processes_per_node && hooks_.on_success) hooks_.on_success();
    return;
  }
  AttemptFailure failure;
  failure.exit = exit;
  if (!options_.error_dir.empty()) {
    failure.error = read_error_file(error_file_path(options_.error_dir, exit.rank));
  }
  fail(std::move(failure));
}

void Attempt::on_hang(const Hang& hang) {
  if (stopping_) return;
  AttemptFailure failure;
  failure.hang = hang;
  fail(std::move(failure));
}

void Attempt::fail(AttemptFailure failure) {
  failed_ = true;
  if (hooks_.on_failure) hooks_.on_failure(failure);
  stop(SIGTERM);
}

void Attempt::stop(int signal) {
  if (!group_ || stopped_) return;
  if (stopping_) {
    if (signal == SIGKILL) group_->stop(SIGKILL, nullptr);
    return;
  }
  stopping_ = true;
  stop_signal_ = signal;
  group_->stop(signal, [this, alive = alive_](const StopReport& report) {
    if (!*alive || stopped_) return;
    stopped_ = true;
    // Why a copy: the owner may destroy this attempt from the hook.
    auto hook = hooks_.on_stopped;
    if (hook) hook(report);
  });
}

}  // namespace accel::supervisor

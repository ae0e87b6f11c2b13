// The local supervision loop: attempts, failure handling, restart budget, cancellation.
#include "agent/supervisor/local_job.h"

#include <boost/asio/post.hpp>
#include <csignal>
#include <ctime>
#include <filesystem>
#include <sstream>

#include "agent/common/clock.h"
#include "agent/common/exit_hints.h"
#include "agent/supervisor/worker_specs.h"
#include "contract/worker_contract.h"

namespace accel::supervisor {

namespace fs = std::filesystem;

namespace {

std::string clock_time(std::chrono::system_clock::time_point t) {
  return accel::clock_time(
      std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count());
}
std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) out.push_back(line);
  }
  return out;
}

std::string attempt_dir(const std::string& root, int attempt) {
  return root + "/attempt_" + std::to_string(attempt);
}

}  // namespace

LocalJob::LocalJob(boost::asio::io_context& io, LocalJobOptions options, JobLogger log)
    : io_(io), options_(std::move(options)), log_(std::move(log)) {
  // Why here: a full disk must not truncate a rank's log in silence; it is said at once and
  // again at the end, even when the job succeeds.
  options_.group.on_warning = [this](const std::string& problem) {
    log_(LogLevel::kWarn, problem);
    result_.log_problems.push_back(problem);
  };
}

LocalJob::~LocalJob() = default;

void LocalJob::run(std::function<void(const JobResult&)> done) {
  done_ = std::move(done);
  start_attempt();
}

void LocalJob::start_attempt() {
  if (finished_) return;
  const int attempt = restart_count_;
  successes_ = 0;
  stopping_ = false;
  AttemptRecord record;
  record.attempt = attempt;
  record.started = std::chrono::system_clock::now();

  JobEnv env = options_.env;
  env.job_id = options_.job_id;
  env.restart_count = attempt;
  env.max_restarts = options_.max_restarts;
  if (!store_) {
    store::StoreServerOptions so;
    so.host = env.master_addr;
    so.port = env.master_port;
    so.warn = [this](const std::string& w) { log_(LogLevel::kWarn, w); };
    auto server = store::StoreServer::listen(io_, std::move(so));
    if (!server) {
      result_.spawn_error = server.message();
      result_.attempts.push_back(std::move(record));
      finish();
      return;
    }
    store_ = std::move(*server);
  }
  // Why reset: nothing the last attempt's workers stored, or still send, may reach this one.
  store_->reset();
  env.master_port = store_->port();
  env.agent_store = true;
  record.master_port = env.master_port;

  std::error_code ec;
  std::string log_attempt_dir;
  if (!options_.log_dir.empty()) {
    log_attempt_dir = attempt_dir(options_.log_dir + "/" + options_.job_id, attempt);
    fs::create_directories(log_attempt_dir, ec);
    if (ec) {
      result_.spawn_error = "cannot create log directory " + log_attempt_dir + ": " + ec.message();
      result_.attempts.push_back(std::move(record));
      finish();
      return;
    }
  }
  std::string error_attempt_dir;
  if (!options_.error_dir.empty()) {
    error_attempt_dir = attempt_dir(options_.error_dir, attempt);
    fs::create_directories(error_attempt_dir, ec);
  }

  const int n = options_.num_processes;
  GroupPlan plan;
  plan.argv = options_.argv;
  plan.local_world_size = n;
  plan.world_size = n;
  plan.env = env;
  plan.base_env = options_.base_env;
  plan.log_dir = log_attempt_dir;
  plan.tee = options_.tee;
  plan.error_dir = error_attempt_dir;
  if (options_.hang.enabled()) plan.progress_dir = error_attempt_dir;
  std::vector<WorkerSpec> specs = make_worker_specs(plan);
  std::vector<std::pair<int, std::string>> pages;
  for (const auto& spec : specs) {
    auto it = spec.env.find(contract::kProgressFile);
    if (it != spec.env.end()) pages.emplace_back(spec.rank, it->second);
  }

  result_.attempts.push_back(std::move(record));
  log_(LogLevel::kInfo, "attempt " + std::to_string(attempt) + ": starting " + std::to_string(n) +
                            " worker" + (n == 1 ? "" : "s") + " (MASTER_ADDR=" + env.master_addr +
                            " MASTER_PORT=" + std::to_string(env.master_port) + ")");
  group_ = std::make_unique<WorkerGroup>(io_, options_.group);
  hang_watch_.reset();
  if (Status s =
          group_->start(std::move(specs), [this](const WorkerExit& e) { on_worker_exit(e); });
      !s) {
    result_.spawn_error = s.message();
    finish();
    return;
  }
  if (!pages.empty()) {
    hang_watch_ = std::make_unique<HangWatch>(io_, options_.hang, std::move(pages), "this node",
                                              [this](const Hang& h) { on_hang(h); });
    hang_watch_->start();
  }
}

void LocalJob::on_hang(const Hang& hang) {
  if (stopping_ || finished_) return;
  result_.attempts.back().hang = hang;
  log_(LogLevel::kError, hang.report + "stopping the workers");
  stopping_ = true;
  group_->stop(SIGTERM, [this](const StopReport& r) { on_group_stopped(r); });
}

void LocalJob::on_worker_exit(const WorkerExit& exit) {
  AttemptRecord& record = result_.attempts.back();
  record.exits.push_back(exit);
  if (hang_watch_) hang_watch_->forget(exit.rank);
  if (stopping_) return;  // a worker we are stopping
  if (exit.success()) {
    if (++successes_ == static_cast<size_t>(options_.num_processes)) finish();
    return;
  }
  record.root_cause = record.exits.size() - 1;
  if (!options_.error_dir.empty()) {
    record.root_cause_error = read_error_file(
        error_file_path(attempt_dir(options_.error_dir, record.attempt), exit.rank));
  }
  std::string what = "rank " + std::to_string(exit.rank) + " (pid " + std::to_string(exit.pid) +
                     ") failed: " + exit.describe();
  if (record.root_cause_error) what += ": " + record.root_cause_error->message;
  log_(LogLevel::kError, what + "; stopping the other workers");
  stopping_ = true;
  group_->stop(SIGTERM, [this](const StopReport& r) { on_group_stopped(r); });
}

void LocalJob::on_group_stopped(const StopReport& report) {
  if (finished_) return;
  if (!report.unkillable.empty()) {
    std::string pids;
    for (pid_t p : report.unkillable) pids += " " + std::to_string(p);
    log_(LogLevel::kWarn,
         "worker pids" + pids + " survived SIGKILL (stuck in the kernel, D state?); not waiting");
    result_.unkillable.insert(result_.unkillable.end(), report.unkillable.begin(),
                              report.unkillable.end());
  }
  if (!result_.cancelled && restart_count_ < options_.max_restarts) {
    ++restart_count_;
    log_(LogLevel::kWarn, "restarting the worker group (restart " + std::to_string(restart_count_) +
                              " of " + std::to_string(options_.max_restarts) + ")");
    group_.reset();
    start_attempt();
    return;
  }
  finish();
}

void LocalJob::cancel(int signal) {
  if (finished_) return;
  if (result_.cancelled || stopping_) {
    result_.cancelled = true;
    if (result_.cancel_signal == 0) result_.cancel_signal = signal;
    log_(LogLevel::kWarn, "stopping now: SIGKILL to every worker");
    if (group_) group_->stop(SIGKILL, nullptr);
    return;
  }
  result_.cancelled = true;
  result_.cancel_signal = signal;
  stopping_ = true;
  log_(LogLevel::kWarn,
       "received " + signal_name(signal) + ": stopping the workers (again to SIGKILL them now)");
  if (!group_) {
    finish();
    return;
  }
  group_->stop(signal, [this](const StopReport& r) { on_group_stopped(r); });
}

void LocalJob::finish() {
  if (finished_) return;
  finished_ = true;
  if (result_.cancelled) {
    result_.exit_code = 128 + result_.cancel_signal;
  } else if (!result_.spawn_error.empty()) {
    result_.exit_code = 1;
  } else if (!result_.attempts.empty() && result_.attempts.back().hang) {
    result_.exit_code = 1;
  } else if (!result_.attempts.empty() && result_.attempts.back().root_cause) {
    const AttemptRecord& last = result_.attempts.back();
    result_.exit_code = last.exits[*last.root_cause].status_code();
  } else {
    result_.exit_code = 0;
  }
  if (done_) {
    boost::asio::post(io_, [this] { done_(result_); });
  }
}

std::string format_failure_summary(const LocalJobOptions& options, const JobResult& result) {
  std::ostringstream out;
  out << "accel-launch: job " << options.job_id;
  if (!result.spawn_error.empty()) {
    out << " could not start its workers: " << result.spawn_error << "\n";
    return out.str();
  }
  if (result.cancelled) {
    out << " stopped by " << signal_name(result.cancel_signal) << " (exit code " << result.exit_code
        << ")\n";
  } else {
    out << " FAILED with exit code " << result.exit_code << " after " << result.attempts.size()
        << " attempt" << (result.attempts.size() == 1 ? "" : "s") << " (max_restarts "
        << options.max_restarts << ")\n";
  }
  for (const auto& problem : result.log_problems) out << "  log: " << problem << "\n";
  if (result.attempts.empty()) return out.str();
  const AttemptRecord& last = result.attempts.back();
  if (last.hang) out << "  root cause: " << last.hang->reason << "\n" << last.hang->report;
  char header[128];
  std::snprintf(header, sizeof header, "  %-6s %-9s %-24s %s\n", "rank", "pid", "result", "time");
  out << header;
  for (size_t i = 0; i < last.exits.size(); ++i) {
    const WorkerExit& e = last.exits[i];
    bool root = last.root_cause && *last.root_cause == i;
    std::string note = root ? "  <- root cause" : (e.during_stop ? "  (stopped)" : "");
    char row[256];
    std::snprintf(row, sizeof row, "%c %-6d %-9d %-24s %s%s\n", root ? '*' : ' ', e.rank, e.pid,
                  e.describe().c_str(), clock_time(e.time).c_str(), note.c_str());
    out << row;
    if (root) {
      const auto& error = last.root_cause_error;
      if (error) out << "         error: " << error->message << "\n";
      if (error && !error->stack.empty()) {  // it says what stderr's tail would repeat
        auto stack = split_lines(error->stack);
        size_t from = stack.size() > 6 ? stack.size() - 6 : 0;
        for (size_t l = from; l < stack.size(); ++l) out << "         stack| " << stack[l] << "\n";
      } else {
        for (const auto& line : e.stderr_tail) out << "         stderr| " << line << "\n";
      }
      if (auto hint = exit_hint(e.stderr_tail)) out << "         " << *hint << "\n";
    }
  }
  for (size_t a = 0; a + 1 < result.attempts.size(); ++a) {
    const AttemptRecord& rec = result.attempts[a];
    if (rec.hang) out << "  attempt " << rec.attempt << ": " << rec.hang->reason << "\n";
    if (!rec.root_cause) continue;
    const WorkerExit& e = rec.exits[*rec.root_cause];
    out << "  attempt " << rec.attempt << ": rank " << e.rank << " " << e.describe() << " at "
        << clock_time(e.time);
    if (rec.root_cause_error) out << ": " << rec.root_cause_error->message;
    out << "\n";
  }
  return out.str();
}

}  // namespace accel::supervisor

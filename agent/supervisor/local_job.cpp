// The local supervision loop: attempts, failure handling, restart budget, cancellation.
#include "agent/supervisor/local_job.h"

#include <boost/asio/post.hpp>
#include <csignal>
#include <ctime>
#include <filesystem>
#include <sstream>

#include "agent/common/clock.h"
#include "agent/common/exit_hints.h"

namespace accel::supervisor {

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

}  // namespace

LocalJob::LocalJob(boost::asio::io_context& io, LocalJobOptions options, JobLogger log)
    : io_(io), options_(std::move(options)), log_(std::move(log)) {}

LocalJob::~LocalJob() = default;

void LocalJob::run(std::function<void(const JobResult&)> done) {
  done_ = std::move(done);
  start_attempt();
}

void LocalJob::start_attempt() {
  if (finished_) return;
  const int attempt = restart_count_;
  AttemptRecord record;
  record.attempt = attempt;
  record.started = std::chrono::system_clock::now();

  if (!store_) {
    store::StoreServerOptions so;
    so.host = options_.master_addr;
    so.port = options_.spec.master_port;
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
  record.master_port = store_->port();

  AttemptOptions ao;
  const int n = options_.spec.processes_per_node;
  ao.placement = {.job_id = options_.job_id,
                  .attempt = attempt,
                  .restart_count = attempt,
                  .rank_offset = 0,
                  .world_size = n,
                  .node_rank = 0,
                  .num_nodes = 1,
                  .master_addr = options_.master_addr,
                  .master_port = store_->port()};
  ao.base_env = options_.base_env;
  if (!options_.error_root.empty()) {
    ao.error_dir = Attempt::folder(options_.error_root, options_.job_id, attempt);
    std::error_code ec;
    std::filesystem::create_directories(ao.error_dir, ec);
    if (ec) ao.error_dir.clear();
  }
  ao.group = options_.group;
  AttemptHooks hooks;
  hooks.on_exit = [this](const WorkerExit& e) { result_.attempts.back().exits.push_back(e); };
  hooks.on_failure = [this](const AttemptFailure& f) { on_failure(f); };
  hooks.on_success = [this] { finish(); };
  hooks.on_stopped = [this](const StopReport& r) { on_stopped(r); };
  // Why here: a full disk must not truncate a rank's log in silence; it is said at once and
  // again at the end, even when the job succeeds.
  hooks.log = [this](LogLevel level, const std::string& problem) {
    log_(level, problem);
    result_.log_problems.push_back(problem);
  };

  result_.attempts.push_back(std::move(record));
  log_(LogLevel::kInfo, "attempt " + std::to_string(attempt) + ": starting " + std::to_string(n) +
                            " worker" + (n == 1 ? "" : "s") +
                            " (MASTER_ADDR=" + options_.master_addr +
                            " MASTER_PORT=" + std::to_string(store_->port()) + ")");
  attempt_ = std::make_unique<Attempt>(io_, options_.spec, std::move(ao), std::move(hooks));
  if (Status s = attempt_->start(); !s) {
    result_.spawn_error = s.message();
    finish();
  }
}

void LocalJob::on_failure(const AttemptFailure& failure) {
  AttemptRecord& record = result_.attempts.back();
  if (failure.hang) {
    record.hang = failure.hang;
    log_(LogLevel::kError, failure.hang->report + "stopping the workers");
    return;
  }
  const WorkerExit& exit = *failure.exit;
  record.root_cause = record.exits.size() - 1;
  record.root_cause_error = failure.error;
  std::string what = "rank " + std::to_string(exit.rank) + " (pid " + std::to_string(exit.pid) +
                     ") failed: " + exit.describe();
  if (failure.error) what += ": " + failure.error->message;
  log_(LogLevel::kError, what + "; stopping the other workers");
}

void LocalJob::on_stopped(const StopReport& report) {
  if (finished_) return;
  if (!report.unkillable.empty()) {
    std::string pids;
    for (pid_t p : report.unkillable) pids += " " + std::to_string(p);
    log_(LogLevel::kWarn,
         "worker pids" + pids + " survived SIGKILL (stuck in the kernel, D state?); not waiting");
    result_.unkillable.insert(result_.unkillable.end(), report.unkillable.begin(),
                              report.unkillable.end());
  }
  if (!result_.cancelled && restart_count_ < options_.spec.max_restarts) {
    ++restart_count_;
    log_(LogLevel::kWarn, "restarting the worker group (restart " + std::to_string(restart_count_) +
                              " of " + std::to_string(options_.spec.max_restarts) + ")");
    // Why posted: the old attempt is still on the stack (its stop completion called us).
    boost::asio::post(io_, [this] {
      attempt_.reset();
      start_attempt();
    });
    return;
  }
  finish();
}

void LocalJob::cancel(int signal) {
  if (finished_) return;
  if (result_.cancelled || (attempt_ && attempt_->stopping())) {
    result_.cancelled = true;
    if (result_.cancel_signal == 0) result_.cancel_signal = signal;
    log_(LogLevel::kWarn, "stopping now: SIGKILL to every worker");
    if (attempt_) attempt_->stop(SIGKILL);
    return;
  }
  result_.cancelled = true;
  result_.cancel_signal = signal;
  log_(LogLevel::kWarn,
       "received " + signal_name(signal) + ": stopping the workers (again to SIGKILL them now)");
  if (!attempt_) {
    finish();
    return;
  }
  attempt_->stop(signal);
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
        << options.spec.max_restarts << ")\n";
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

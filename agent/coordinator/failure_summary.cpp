// Failure lines and summaries (failure_summary.h).
#include "agent/coordinator/failure_summary.h"

#include <cstring>
#include <map>
#include <sstream>

#include "agent/common/clock.h"
#include "agent/common/exit_hints.h"

namespace accel::coordinator {

int32_t failure_status_code(const pb::Failure& f) {
  if (f.kind() == pb::Failure::KIND_EXIT) return f.signal() != 0 ? 128 + f.signal() : f.exit_code();
  return 1;
}

std::string failure_cause(const pb::Failure& f) {
  switch (f.kind()) {
    case pb::Failure::KIND_NODE_LOST:
      return "node_lost";
    case pb::Failure::KIND_HANG:
      return "hang";
    case pb::Failure::KIND_NETWORK:
      return "network";
    case pb::Failure::KIND_SPAWN:
      return "spawn";
    default:
      return f.signal() != 0 ? "signal" : "exit";
  }
}

std::string describe_failure(const pb::Failure& f) {
  std::string where = f.hostname().empty() ? f.node_id() : f.hostname();
  switch (f.kind()) {
    case pb::Failure::KIND_NODE_LOST:
      return "node " + f.node_id() + " lost: " + f.message();
    case pb::Failure::KIND_HANG:
      return "rank " + std::to_string(f.rank()) + " on " + where + " hung: " + f.message();
    case pb::Failure::KIND_NETWORK:
      return "network: " + f.message() +
             (f.before_start() ? " (" + where + "'s workers of the round never started)" : "");
    case pb::Failure::KIND_SPAWN:
      return "rank " + std::to_string(f.rank()) + " on " + where +
             " could not start: " + f.message();
    default:
      break;
  }
  std::string what = "exit code " + std::to_string(f.exit_code());
  if (f.signal() != 0) {
    const char* abbrev = ::sigabbrev_np(f.signal());
    what = (abbrev ? "SIG" + std::string(abbrev) + " (signal " : "(signal ") +
           std::to_string(f.signal()) + ")";
  }
  std::string out = "rank " + std::to_string(f.rank()) + " on " + where + " (pid " +
                    std::to_string(f.pid()) + ") failed: " + what;
  if (!f.message().empty()) out += ": " + f.message();
  return out;
}

std::string format_failure_summary(const std::string& job_id,
                                   const std::vector<pb::Failure>& failures, int64_t last_round,
                                   std::optional<size_t> root, const std::string& program) {
  // Why the check: a job can fail with no failure of its own (no node joined before join_timeout);
  // then the caller's reason is the whole story, not an empty table of "round -1".
  const bool any_in_last =
      last_round >= 0 && std::any_of(failures.begin(), failures.end(),
                                     [&](const pb::Failure& f) { return f.round() == last_round; });
  std::string out = !any_in_last ? std::string()
                                 : "accel: failures of job " + job_id + ", round " +
                                       std::to_string(last_round) +
                                       " (root cause = the earliest, marked *):\n";
  for (size_t i = 0; i < failures.size() && any_in_last; ++i) {
    const auto& f = failures[i];
    if (f.round() != last_round) continue;
    bool is_root = root && *root == i;
    out += std::string(is_root ? "* " : "  ") + clock_time(f.time_unix_ms()) + "  " +
           describe_failure(f) + "\n";
    if (!is_root) continue;
    if (!f.report().empty()) out += f.report() + (f.report().back() == '\n' ? "" : "\n");
    if (!f.stack().empty()) {  // it says what stderr's tail would repeat: its last lines
      std::vector<std::string> lines;
      std::istringstream in(f.stack());
      for (std::string line; std::getline(in, line);) {
        if (!line.empty()) lines.push_back(line.substr(0, 500));
      }
      for (size_t l = lines.size() > 6 ? lines.size() - 6 : 0; l < lines.size(); ++l) {
        out += "      stack| " + lines[l] + "\n";
      }
    } else {
      for (const auto& line : f.stderr_tail()) out += "      stderr| " + line + "\n";
    }
    if (auto hint = exit_hint({f.stderr_tail().begin(), f.stderr_tail().end()}, program))
      out += "      " + *hint + "\n";
  }
  // Root causes of earlier rounds.
  std::map<int64_t, const pb::Failure*> earlier;
  for (const auto& f : failures) {
    if (any_in_last && f.round() >= last_round) continue;
    auto& slot = earlier[f.round()];
    if (slot == nullptr || f.time_unix_ms() < slot->time_unix_ms()) slot = &f;
  }
  for (const auto& [round, f] : earlier) {
    out += "  earlier: round " + std::to_string(round) + " at " + clock_time(f->time_unix_ms()) +
           ": " + describe_failure(*f) + "\n";
  }
  return out;
}

}  // namespace accel::coordinator

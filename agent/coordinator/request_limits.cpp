// The coordinator's bounds on stored request fields (request_limits.h).
#include "agent/coordinator/request_limits.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace accel::coordinator::limits {

namespace {

// Printable ASCII without spaces: host names, IPv4/IPv6 addresses ("[::1]"), DNS names.
bool host_like(const std::string& s) {
  return !s.empty() && s.size() <= kMaxHostBytes &&
         std::all_of(s.begin(), s.end(), [](unsigned char c) { return c > 0x20 && c < 0x7f; });
}

std::string shown(const std::string& s) {
  return "'" + printable(s.substr(0, 64)) +
         (s.size() > 64 ? "...' (" + std::to_string(s.size()) + " bytes)" : "'");
}

}  // namespace

std::size_t max_failures_per_node_round(const pb::JobSpec& spec) {
  return static_cast<std::size_t>(std::clamp(spec.processes_per_node(), 1, kMaxProcessesPerNode)) +
         1;
}

std::string check(const pb::RegisterNodeRequest& req) {
  if (!host_like(req.hostname())) {
    return "hostname " + shown(req.hostname()) + " must be 1-" + std::to_string(kMaxHostBytes) +
           " printable characters without spaces";
  }
  if (!host_like(req.address())) {
    return "address " + shown(req.address()) + " must be 1-" + std::to_string(kMaxHostBytes) +
           " printable characters without spaces";
  }
  if (req.machine_rank() < -1 || req.machine_rank() >= kMaxNodesPerJob) {
    return "machine_rank " + std::to_string(req.machine_rank()) + " is not -1 (none) or 0.." +
           std::to_string(kMaxNodesPerJob - 1);
  }
  if (req.only_job_id().size() > kMaxIdBytes)
    return "only_job_id is longer than " + std::to_string(kMaxIdBytes) + " bytes";
  if (req.probe_port() < 0 || req.probe_port() > 65535)
    return "probe_port " + std::to_string(req.probe_port()) + " is not a port";
  if (req.store_port() < 0 || req.store_port() > 65535)
    return "store_port " + std::to_string(req.store_port()) + " is not a port";
  if (req.has_current() && !req.current().job_id().empty()) {
    const auto& cur = req.current();
    if (cur.job_id().size() > kMaxIdBytes)
      return "current work: job id longer than " + std::to_string(kMaxIdBytes) + " bytes";
    if (auto why = check(cur.spec()); !why.empty())
      return "current work of job " + cur.job_id() + ": " + why;
    const auto& a = cur.assignment();
    if (a.num_nodes() < 1 || a.num_nodes() > kMaxNodesPerJob ||
        a.num_nodes() > cur.spec().max_nodes() || a.node_rank() < 0 ||
        a.node_rank() >= a.num_nodes()) {
      return "current work of job " + cur.job_id() + " has an impossible assignment (node rank " +
             std::to_string(a.node_rank()) + " of " + std::to_string(a.num_nodes()) +
             ", max_nodes " + std::to_string(cur.spec().max_nodes()) + ")";
    }
    if (a.peers_size() > 2 * kProbeNeighbours + 1) {
      return "current work of job " + cur.job_id() + " lists " + std::to_string(a.peers_size()) +
             " peers; the most is " + std::to_string(2 * kProbeNeighbours + 1);
    }
    if (!a.master_addr().empty() && !host_like(a.master_addr())) {
      return "current work of job " + cur.job_id() + ": master_addr " + shown(a.master_addr()) +
             " is not an address";
    }
  }
  return "";
}

std::string check(const pb::JobSpec& s) {
  if (s.ByteSizeLong() > kMaxSpecBytes) {
    return "the job spec is " + std::to_string(s.ByteSizeLong()) + " bytes; the most is " +
           std::to_string(kMaxSpecBytes) + " (command line and environment together)";
  }
  if (s.processes_per_node() < 1 || s.processes_per_node() > kMaxProcessesPerNode) {
    return "processes_per_node must be 1.." + std::to_string(kMaxProcessesPerNode) + ", got " +
           std::to_string(s.processes_per_node());
  }
  if (s.min_nodes() < 1 || s.max_nodes() < s.min_nodes() || s.max_nodes() > kMaxNodesPerJob) {
    return "nodes must satisfy 1 <= min_nodes <= max_nodes <= " + std::to_string(kMaxNodesPerJob) +
           ", got " + std::to_string(s.min_nodes()) + ":" + std::to_string(s.max_nodes());
  }
  if (s.tee() < 0 || s.tee() > 3) return "tee must be 0..3, got " + std::to_string(s.tee());
  if (s.network_timeout_ms() < 0) {
    return "network_timeout_ms must be >= 0 (0: off), got " +
           std::to_string(s.network_timeout_ms());
  }
  for (const auto& [name, value] : s.worker_settings()) {
    // Why only ACCEL_*: a setting must not pass for one of the contract's per-worker variables
    // (RANK, MASTER_PORT, ...), which the agent sets itself.
    bool ok = name.size() > 6 && name.size() <= 64 && name.rfind("ACCEL_", 0) == 0 &&
              std::all_of(name.begin(), name.end(), [](unsigned char c) {
                return (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
              });
    if (!ok) {
      return "worker setting '" + printable(name.substr(0, 64)) +
             "' is not an ACCEL_* variable name";
    }
  }
  return "";
}

std::string cut_text(std::string text, std::size_t max) {
  if (text.size() <= max) return text;
  std::size_t keep = max;
  // Why: never split a UTF-8 sequence (continuation bytes are 10xxxxxx).
  while (keep > 0 && (static_cast<unsigned char>(text[keep]) & 0xC0) == 0x80) --keep;
  std::size_t cut_bytes = text.size() - keep;
  text.resize(keep);
  text += " ... [" + std::to_string(cut_bytes) + " bytes cut]";
  return text;
}

void cut(pb::Failure& f) {
  f.set_message(cut_text(f.message(), kMaxTextBytes));
  f.set_stack(cut_text(f.stack(), kMaxTextBytes));
  f.set_report(cut_text(f.report(), kMaxTextBytes));
  f.set_hostname(cut_text(f.hostname(), kMaxHostBytes));
  auto* tail = f.mutable_stderr_tail();
  if (static_cast<std::size_t>(tail->size()) > kMaxTailLines) {
    tail->DeleteSubrange(0, tail->size() - static_cast<int>(kMaxTailLines));  // keep the last lines
  }
  for (auto& line : *tail) line = cut_text(std::move(line), kMaxTailLineBytes);
}

void cut(pb::LogLine& line) {
  line.set_text(cut_text(line.text(), kMaxLineBytes));
  line.set_hostname(cut_text(line.hostname(), kMaxHostBytes));
}

void cut(pb::RankProgress& p) {
  p.set_in_flight(cut_text(p.in_flight(), kMaxProgressBytes));
  p.set_last_finished(cut_text(p.last_finished(), kMaxProgressBytes));
  // Why: a rate that is not a finite non-negative number would poison every median and ratio
  // computed from it; such a rank counts as unmeasured.
  auto sane = [](double v) { return std::isfinite(v) && v >= 0 && v < 1e12; };
  if (!sane(p.steps_per_second()) || !sane(p.compute_seconds_per_step()) ||
      !sane(p.wait_seconds_per_step())) {
    p.set_has_rate(false);
    p.set_steps_per_second(0);
    p.set_compute_seconds_per_step(0);
    p.set_wait_seconds_per_step(0);
  }
}

std::string printable(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  auto escape = [&out](unsigned char c) {
    char buf[5];
    std::snprintf(buf, sizeof buf, "\\x%02x", c);
    out += buf;
  };
  for (std::size_t i = 0; i < text.size(); ++i) {
    auto c = static_cast<unsigned char>(text[i]);
    auto next = i + 1 < text.size() ? static_cast<unsigned char>(text[i + 1]) : 0;
    if (c < 0x20 || c == 0x7f) {
      escape(c);
    } else if (c == 0xC2 && next >= 0x80 && next <= 0x9F) {  // U+0080..U+009F: C1 controls (CSI)
      escape(c);
      escape(next);
      ++i;
    } else {
      out += static_cast<char>(c);  // UTF-8 text stays readable
    }
  }
  return out;
}

}  // namespace accel::coordinator::limits

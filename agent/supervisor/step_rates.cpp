// Step rates over a sliding window of page reads.
#include "agent/supervisor/step_rates.h"

namespace accel::supervisor {

void StepRates::add(int rank, std::uint64_t now_ns, std::uint64_t steps, std::uint64_t wait_ns) {
  auto& s = samples_[rank];
  // Why start over: fewer steps than before is a new worker (a restart that resumed earlier).
  if (!s.empty() && (steps < s.back().steps || now_ns < s.back().t_ns)) s.clear();
  s.push_back({now_ns, steps, wait_ns});
  while (s.size() > 2 && s.back().t_ns - s[1].t_ns >= kWindowNs) s.pop_front();
}

std::optional<StepRate> StepRates::rate(int rank) const {
  auto it = samples_.find(rank);
  if (it == samples_.end() || it->second.size() < 2) return std::nullopt;
  const Sample& a = it->second.front();
  const Sample& b = it->second.back();
  if (b.steps == 0 || b.t_ns <= a.t_ns) return std::nullopt;
  StepRate r;
  double span = static_cast<double>(b.t_ns - a.t_ns) / 1e9;
  double steps = static_cast<double>(b.steps - a.steps);
  double wait = static_cast<double>(b.wait_ns >= a.wait_ns ? b.wait_ns - a.wait_ns : 0) / 1e9;
  r.window_seconds = span;
  r.steps_per_second = steps / span;
  if (steps > 0) {
    r.wait_seconds_per_step = wait / steps;
    r.compute_seconds_per_step = (span > wait ? span - wait : 0) / steps;
  }
  return r;
}

}  // namespace accel::supervisor

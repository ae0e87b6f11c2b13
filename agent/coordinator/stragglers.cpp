// The straggler and stall rules.
#include "agent/coordinator/stragglers.h"

#include <algorithm>
#include <cstdio>

namespace accel::coordinator {

namespace {

std::string fixed(double v, int digits) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string whole_seconds(std::chrono::milliseconds d) {
  return std::to_string((d.count() + 500) / 1000) + " s";
}

// What every report of each kind says, and what is_speed_report looks for.
constexpr std::string_view kSlowerPhrase = " slower than the median for ";
constexpr std::string_view kStallPhrase = " has taken no step for ";

// Below this a rank's compute per step is noise (a step of a tiny model), whatever the ratio.
constexpr double kMinComputeSeconds = 0.001;

}  // namespace

bool is_speed_report(std::string_view message) {
  return message.rfind("rank ", 0) == 0 && (message.find(kSlowerPhrase) != std::string_view::npos ||
                                            message.find(kStallPhrase) != std::string_view::npos);
}

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  auto mid = values.begin() + static_cast<long>(values.size() / 2);
  std::nth_element(values.begin(), mid, values.end());
  if (values.size() % 2 == 1) return *mid;
  double upper = *mid;
  double lower = *std::max_element(values.begin(), mid);
  return (lower + upper) / 2;
}

void StragglerWatch::reset() {
  slow_.clear();
  flagged_.clear();
  stall_reported_ = false;
}

std::vector<SpeedReport> StragglerWatch::update(const std::vector<RankReport>& ranks,
                                                Clock::time_point now,
                                                const StragglerOptions& options) {
  std::vector<SpeedReport> lines;
  using std::chrono::milliseconds;

  // Stragglers: each measured rank against the median of the others.
  std::vector<std::pair<double, const RankReport*>> measured;
  for (const auto& r : ranks) {
    if (r.progress->has_rate() && r.progress->compute_seconds_per_step() > 0)
      measured.emplace_back(r.progress->compute_seconds_per_step(), &r);
  }
  std::map<int, double> slow_now;
  if (options.threshold > 0 && measured.size() >= 2) {
    std::vector<double> sorted;
    for (const auto& m : measured) sorted.push_back(m.first);
    std::sort(sorted.begin(), sorted.end());
    for (const auto& [compute, report] : measured) {
      // The median of the others: `sorted` without one copy of this rank's value.
      std::vector<double> others = sorted;
      others.erase(std::lower_bound(others.begin(), others.end(), compute));
      double typical = median(others);
      if (typical <= 0 || compute < kMinComputeSeconds) continue;
      double ratio = compute / typical;
      if (ratio >= options.threshold) slow_now[report->progress->rank()] = ratio;
    }
  }
  for (auto it = slow_.begin(); it != slow_.end();) {
    it = slow_now.count(it->first) ? std::next(it) : slow_.erase(it);
  }
  flagged_.clear();
  std::vector<double> waits;
  for (const auto& m : measured) waits.push_back(m.second->progress->wait_seconds_per_step());
  for (const auto& [rank, ratio] : slow_now) {
    auto [it, fresh] = slow_.try_emplace(rank, Slow{now, false});
    Slow& s = it->second;
    if (now - s.since < options.window) continue;
    flagged_[rank] = ratio;
    if (s.reported) continue;
    s.reported = true;
    const RankReport* report = nullptr;
    for (const auto& m : measured)
      if (m.second->progress->rank() == rank) report = m.second;
    const auto& p = *report->progress;
    lines.push_back(
        {false, "rank " + std::to_string(rank) + " on node " + report->node + " is " +
                    fixed(ratio, 1) + "x" + std::string(kSlowerPhrase) +
                    whole_seconds(std::chrono::duration_cast<milliseconds>(now - s.since)) +
                    " (in compute, not in collectives: " + fixed(p.compute_seconds_per_step(), 3) +
                    " s of compute per step against the others' median of " +
                    fixed(p.compute_seconds_per_step() / ratio, 3) + " s; it waits " +
                    fixed(p.wait_seconds_per_step(), 3) +
                    " s per step in collectives, the median rank " + fixed(median(waits), 3) +
                    " s)"});
  }

  // Stalls: no step for stall_timeout, after some steps.
  if (options.stall_timeout.count() > 0) {
    const RankReport* stalled = nullptr;
    milliseconds stalled_for{0};
    int waiting = 0;
    bool any_fresh = false;
    for (const auto& r : ranks) {
      const auto& p = *r.progress;
      if (p.steps() == 0 || p.step_age_ms() < 0) continue;
      milliseconds age = milliseconds(p.step_age_ms()) + r.report_age;
      if (age < options.stall_timeout) {
        any_fresh = true;
        continue;
      }
      if (!p.in_flight().empty()) ++waiting;
      // The one to name: outside any collective if one is (it is what the others wait for),
      // else the one with the fewest collectives started.
      bool better = !stalled || (stalled->progress->in_flight().empty() != p.in_flight().empty()
                                     ? p.in_flight().empty()
                                     : p.started() < stalled->progress->started());
      if (better) {
        stalled = &r;
        stalled_for = age;
      }
    }
    if (!stalled || any_fresh) {
      stall_reported_ = false;
    } else if (!stall_reported_) {
      stall_reported_ = true;
      const auto& p = *stalled->progress;
      std::string where =
          p.in_flight().empty()
              ? "outside any collective" + (p.last_finished().empty()
                                                ? std::string()
                                                : " (its last was " + p.last_finished() + ")")
              : "in " + p.in_flight();
      int others_waiting = waiting - (p.in_flight().empty() ? 0 : 1);
      lines.push_back({true, "rank " + std::to_string(p.rank()) + " on node " + stalled->node +
                                 std::string(kStallPhrase) + whole_seconds(stalled_for) +
                                 " after step " + std::to_string(p.steps()) + "; it is " + where +
                                 ", and " + std::to_string(others_waiting) + " other rank" +
                                 (others_waiting == 1 ? " waits" : "s wait") + " in collectives"});
    }
  }
  return lines;
}

}  // namespace accel::coordinator

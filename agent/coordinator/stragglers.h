// Stragglers and stalls, from the ranks' progress as their agents last reported it.
//
// A straggler is a rank whose compute time per step (wall time outside collectives) is
// `threshold` times the median of the other ranks' for `window`. Why compute time and not steps
// per second: in synchronous training every rank takes the same steps per second, since the fast
// ones wait in collectives for the slow one; what differs is where each spends the step.
// A stall is a rank that has taken no step for `stall_timeout` after taking some: named before
// the hang timeout stops the group, with where it is (in a collective or not).
//
// Thread: not thread-safe (the coordinator core's).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "accel/v1/coordinator.pb.h"
#include "agent/common/clock.h"

namespace accel::coordinator {

struct StragglerOptions {
  double threshold = 2.0;                            // 0: no straggler reports
  std::chrono::milliseconds window{60'000};          // slow this long before it is reported
  std::chrono::milliseconds stall_timeout{300'000};  // 0: no stall reports
};

// One rank as last reported: its progress, its node, and how old the report is.
struct RankReport {
  const ::accel::v1::RankProgress* progress = nullptr;
  std::string node;
  std::chrono::milliseconds report_age{0};
};

struct SpeedReport {
  bool stall = false;  // else a straggler
  std::string line;
};

class StragglerWatch {
 public:
  // Looks at the job's ranks at `now`; returns the reports newly due (each once per episode: a
  // rank reported slow is reported again only after it kept pace in between).
  std::vector<SpeedReport> update(const std::vector<RankReport>& ranks, Clock::time_point now,
                                  const StragglerOptions& options);
  // The ranks reported slow and still slow, with how many times slower than the median.
  [[nodiscard]] const std::map<int, double>& flagged() const { return flagged_; }
  [[nodiscard]] bool stalled() const { return stall_reported_; }
  // A new round: what was seen belongs to workers that are gone.
  void reset();

 private:
  struct Slow {
    Clock::time_point since;
    bool reported = false;
  };
  std::map<int, Slow> slow_;
  std::map<int, double> flagged_;
  bool stall_reported_ = false;
};

// Whether a job event's message is one of StragglerWatch's reports (a launcher that shows only
// some of the coordinator's lines shows these).
bool is_speed_report(std::string_view message);

// The median of `values` (empty: 0). Sorts a copy.
double median(std::vector<double> values);

}  // namespace accel::coordinator

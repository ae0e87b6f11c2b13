// StepRates: each rank's training speed from successive reads of its progress page: steps per
// second, and the wall time per step split into compute and time blocked in collectives. The
// split is what tells a slow rank from one that waits for it: in synchronous training every rank
// takes the same steps per second, but the slow one waits least.
//
// Thread: not thread-safe (the HangWatch's io thread).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>

namespace accel::supervisor {

struct StepRate {
  double steps_per_second = 0;
  // Per step over the window; both 0 when no step was taken in it.
  double compute_seconds_per_step = 0;
  double wait_seconds_per_step = 0;
  double window_seconds = 0;  // the span the figures cover
};

class StepRates {
 public:
  static constexpr std::uint64_t kWindowNs = 20'000'000'000ull;  // 20 s of samples

  // A read of `rank`'s page at `now_ns`: its step count and cumulative collective wait.
  void add(int rank, std::uint64_t now_ns, std::uint64_t steps, std::uint64_t wait_ns);
  // The rank's rate over the samples in the window; nullopt with fewer than two samples or no
  // step at all yet.
  [[nodiscard]] std::optional<StepRate> rate(int rank) const;
  void forget(int rank) { samples_.erase(rank); }

 private:
  struct Sample {
    std::uint64_t t_ns;
    std::uint64_t steps;
    std::uint64_t wait_ns;
  };
  std::map<int, std::deque<Sample>> samples_;
};

}  // namespace accel::supervisor

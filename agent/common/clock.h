// Clock: the time source of the control plane, injected so handler logic is unit-tested
// without sleeping (STYLE.md habit 6). SystemClock is the real one; tests use FakeClock.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <string>

namespace accel {

class Clock {
 public:
  using time_point = std::chrono::steady_clock::time_point;
  virtual ~Clock() = default;
  // Monotonic time: deadlines, leases.
  [[nodiscard]] virtual time_point now() const = 0;
  // Wall-clock milliseconds since the epoch: timestamps shown to people and compared between
  // nodes (failure times).
  [[nodiscard]] virtual int64_t unix_ms() const = 0;
};

class SystemClock final : public Clock {
 public:
  [[nodiscard]] time_point now() const override { return std::chrono::steady_clock::now(); }
  [[nodiscard]] int64_t unix_ms() const override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
};

// A clock that moves only when told to (tests).
class FakeClock final : public Clock {
 public:
  [[nodiscard]] time_point now() const override { return now_; }
  [[nodiscard]] int64_t unix_ms() const override {
    return kEpochMs +
           std::chrono::duration_cast<std::chrono::milliseconds>(now_.time_since_epoch()).count();
  }
  void advance(std::chrono::milliseconds d) { now_ += d; }

 private:
  static constexpr int64_t kEpochMs = 1'790'000'000'000;  // late 2026
  time_point now_{};
};

// "13:50:13.007" in local time: failure times in summaries and reports.
inline std::string clock_time(int64_t unix_ms) {
  std::time_t secs = static_cast<std::time_t>(unix_ms / 1000);
  std::tm tm{};
  ::localtime_r(&secs, &tm);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%02d:%02d:%02d.%03lld", tm.tm_hour, tm.tm_min, tm.tm_sec,
                static_cast<long long>(unix_ms % 1000));
  return buf;
}

// "2.5 s": ages and waits in hang reports.
inline std::string seconds_text(double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", seconds);
  return buf;
}

}  // namespace accel

// Clock: the time source of the control plane, injected so handler logic is unit-tested
// without sleeping (STYLE.md habit 6). SystemClock is the real one; tests use FakeClock.
#pragma once

#include <chrono>
#include <cstdint>

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
    return kEpochMs + std::chrono::duration_cast<std::chrono::milliseconds>(now_.time_since_epoch()).count();
  }
  void advance(std::chrono::milliseconds d) { now_ += d; }

 private:
  static constexpr int64_t kEpochMs = 1'790'000'000'000;  // late 2026
  time_point now_{};
};

}  // namespace accel

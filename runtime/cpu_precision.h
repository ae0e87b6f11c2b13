// Whether bf16 autocast is fast on this CPU: measured, not guessed from CPU flags. Without
// native bf16 (AVX-512 BF16, AMX) libtorch's bf16 matmuls can be an order of magnitude slower
// than fp32, and a job asked to run "mixed precision" then trains many times slower without a
// word; with it, bf16 is about as fast. CPU flags alone do not tell how fast a given libtorch
// is, so the two are timed on a small training step.
#pragma once

#include <string>

namespace accel::cpu_precision {

struct StepSpeed {
  double fp32_ms = 0;  // one step (2 linear layers of 512, batch 64, forward and backward)
  double bf16_ms = 0;
  [[nodiscard]] double ratio() const { return fp32_ms > 0 ? bf16_ms / fp32_ms : 0; }
};

// Times the step in fp32 and under bf16 autocast on this thread, best of 5 after a warm-up
// (about 15 ms in all with native bf16, a few tenths of a second without).
StepSpeed measure_step();

// "Intel(R) Xeon(R) ...", from /proc/cpuinfo; "" when unknown.
std::string cpu_model();

// bf16 is "slow" from this ratio of its step time to fp32's on. Why not 2: on a CPU with
// AVX-512 BF16 and no AMX (a VM of a 5th-generation Xeon), Debian's libtorch 1.13 runs model M
// about 1.6x slower under bf16 autocast than in fp32, and the small step measures 1.4-2.2x; a
// user who chose bf16 for speed loses a third of it there. Why not closer to 1: the small step's
// timing moves by about a tenth between runs, and bf16 at parity must not be called slow.
inline constexpr double kSlowRatio = 1.25;

// Whether the CPU has bf16 instructions: x86's avx512_bf16 or amx_bf16 flags; unknown where
// /proc/cpuinfo has no x86 flags (an ARM CPU, whose bf16 the line does not judge).
enum class Bf16Instructions { kUnknown, kNone, kPresent };
Bf16Instructions bf16_instructions();

// The line libaccel prints when bf16 takes at least kSlowRatio times fp32's time here, else "".
// It names what the CPU has or lacks, where that is known.
std::string slow_bf16_line(const StepSpeed& speed, const std::string& cpu,
                           Bf16Instructions instructions);

// "one small training step under bf16 autocast takes 0.99x fp32's time (...)": accel env's line.
std::string speed_text(const StepSpeed& speed);

}  // namespace accel::cpu_precision

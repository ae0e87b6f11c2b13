// Timing bf16 against fp32 on this CPU (cpu_precision.h).
#include "runtime/cpu_precision.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <limits>
#include <mutex>

#include "accel/mixed_precision.h"
#include "runtime/blas_kernels.h"

namespace accel::cpu_precision {

namespace {

std::string fixed(double v, const char* format) {
  char buf[32];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

}  // namespace

StepSpeed measure_step() {
  // A training step in miniature: two linear layers forward and backward, the way autocast runs
  // them (weights cast to bf16 each step, activations in bf16, gradients back in fp32).
  // Why the state put back: this runs inside the Accelerator's constructor, after the user's
  // manual_seed and before the model is made; its random layers must not move that stream.
  auto generator = at::detail::getDefaultCPUGenerator();
  const auto user_state = [&] {
    std::lock_guard<std::mutex> lock(generator.mutex());
    return generator.get_state();
  }();
  struct Restore {
    at::Generator& g;
    const at::Tensor& state;
    Restore(at::Generator& generator, const at::Tensor& saved) : g(generator), state(saved) {}
    ~Restore() {
      std::lock_guard<std::mutex> lock(g.mutex());
      g.set_state(state);
    }
    Restore(const Restore&) = delete;
    Restore& operator=(const Restore&) = delete;
  } restore(generator, user_state);
  torch::manual_seed(0);
  auto l1 = torch::nn::Linear(512, 512);
  auto l2 = torch::nn::Linear(512, 512);
  auto x = torch::randn({64, 512});
  auto time_one = [&](bool bf16) {
    const auto t0 = std::chrono::steady_clock::now();
    torch::Tensor y;
    if (bf16) {
      AutocastGuard autocast(torch::kCPU, torch::kBFloat16, true);
      y = l2(torch::relu(l1(x)));
    } else {
      y = l2(torch::relu(l1(x)));
    }
    y.to(torch::kFloat).sum().backward();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
  (void)time_one(false);  // warm-up: first-call allocations and kernel selection
  (void)time_one(true);
  // Why alternating: a burst of load from elsewhere then slows both, not one of the two.
  StepSpeed s{std::numeric_limits<double>::infinity(), std::numeric_limits<double>::infinity()};
  for (int i = 0; i < 5; ++i) {
    s.fp32_ms = std::min(s.fp32_ms, time_one(false));
    s.bf16_ms = std::min(s.bf16_ms, time_one(true));
  }
  return s;
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) != 0) continue;
    auto at = line.find(':');
    if (at == std::string::npos) continue;
    std::string v = line.substr(at + 1);
    v.erase(0, v.find_first_not_of(" \t"));
    return v;
  }
  return {};
}

Bf16Instructions bf16_instructions() {
  const auto flags = blas_kernels::cpu_flags();
  if (flags.empty()) return Bf16Instructions::kUnknown;
  const bool present = std::find(flags.begin(), flags.end(), "avx512_bf16") != flags.end() ||
                       std::find(flags.begin(), flags.end(), "amx_bf16") != flags.end();
  return present ? Bf16Instructions::kPresent : Bf16Instructions::kNone;
}

std::string slow_bf16_line(const StepSpeed& speed, const std::string& cpu,
                           Bf16Instructions instructions) {
  if (speed.ratio() < kSlowRatio) return {};
  std::string why;
  switch (instructions) {
    case Bf16Instructions::kPresent:
      why =
          "this CPU has bf16 instructions, but this libtorch's bf16 kernels train slower than "
          "its fp32 ones here";
      break;
    case Bf16Instructions::kNone:
      why = "without native bf16 (AVX-512 BF16 or AMX) autocast trains slower, not faster";
      break;
    case Bf16Instructions::kUnknown:
      why = "this libtorch's bf16 kernels train slower than its fp32 ones on this CPU";
      break;
  }
  return "mixed_precision bf16 is slow on this CPU" + (cpu.empty() ? "" : " (" + cpu + ")") +
         ": a small training step under bf16 autocast took " + fixed(speed.ratio(), "%.1f") +
         "x as long as in fp32 (" + fixed(speed.bf16_ms, "%.2f") + " ms against " +
         fixed(speed.fp32_ms, "%.2f") + " ms, measured at start); " + why +
         ": mixed_precision \"no\" (fp32) is the faster choice here";
}

std::string speed_text(const StepSpeed& speed) {
  return "a small training step under bf16 autocast takes " + fixed(speed.ratio(), "%.2f") +
         "x the time of fp32's (" + fixed(speed.bf16_ms, "%.3f") + " ms against " +
         fixed(speed.fp32_ms, "%.3f") + " ms)" +
         (speed.ratio() >= kSlowRatio
              ? ": bf16 autocast is slow on this CPU; libaccel says so at start"
              : "");
}

}  // namespace accel::cpu_precision

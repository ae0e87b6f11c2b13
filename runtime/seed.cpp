// set_seed: libtorch's generators, and the default shuffle seed of DataLoaders.
#include "accel/seed.h"

#include <ATen/Context.h>
#include <torch/torch.h>

#include <atomic>

#include "runtime/env.h"

namespace accel {
namespace {

std::atomic<bool> g_seeded{false};
std::atomic<uint64_t> g_seed{0};

}  // namespace

void set_seed(uint64_t seed, bool device_specific, bool deterministic) {
  uint64_t generators = seed;
  if (device_specific) generators += static_cast<uint64_t>(env::worker_env().rank);
  torch::manual_seed(generators);  // CPU, and every CUDA device where there are some
  if (deterministic) at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  g_seed = seed;
  g_seeded = true;
}

std::optional<uint64_t> last_seed() {
  if (!g_seeded) return std::nullopt;
  return g_seed.load();
}

}  // namespace accel

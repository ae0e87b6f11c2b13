// HF Accelerate's set_seed: one call makes a run reproducible.
#pragma once

#include <cstdint>
#include <optional>

namespace accel {

// Seeds libtorch's CPU generator and every CUDA device's (torch::manual_seed), and becomes the
// shuffle seed of every DataLoader constructed afterwards whose options leave `seed` unset.
// device_specific: each process adds its RANK, so ranks draw different random numbers (dropout
// masks, augmentation) while loaders still shuffle alike. deterministic: libtorch uses
// deterministic algorithms only (at::Context::setDeterministicAlgorithms), as HF's flag does;
// false leaves that setting as it is.
void set_seed(uint64_t seed, bool device_specific = false, bool deterministic = false);

// The seed of the last set_seed() call (without the rank), if any.
std::optional<uint64_t> last_seed();

}  // namespace accel

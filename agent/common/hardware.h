// What this machine has, as the launcher sees it without loading libtorch or CUDA: usable CPU
// cores and NVIDIA GPUs. Used for `--nproc-per-node auto|gpu|cpu`, `--multi_gpu`, the
// `accel config` wizard's defaults and `accel env`.
#pragma once

#include <string>
#include <vector>

namespace accel::hardware {

// Cores this process may run on (its CPU affinity mask), at least 1.
int usable_cpus();

// NVIDIA GPUs the workers would see: the driver's list (/proc/driver/nvidia/gpus), narrowed by
// CUDA_VISIBLE_DEVICES when it is set (an empty value hides every GPU). 0 without the driver.
int visible_gpus();

// One line per GPU from the driver ("NVIDIA H100 80GB HBM3 (0000:1b:00.0)"), all of them,
// CUDA_VISIBLE_DEVICES notwithstanding; empty without the driver.
std::vector<std::string> gpu_descriptions();

}  // namespace accel::hardware

// `accel env`: what a bug report needs, as Markdown ready to paste: accel's version and commit,
// the OS, CPU (model, the features libtorch's kernels use), cores and memory, GPUs with the
// driver, CUDA and NCCL versions when present, libtorch's version and build (from accel-check
// --info, which links it), gRPC and protobuf versions, the resolved configuration with the
// origin of each value, and the ACCEL_*/torchrun/NCCL/... variables set (secrets hidden).
#pragma once

#include "agent/config/config_loader.h"

namespace accel::launcher {

int print_env(const config::ConfigSources& sources);

}  // namespace accel::launcher

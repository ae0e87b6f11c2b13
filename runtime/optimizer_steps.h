// An optimizer's own step count, to notice steps taken around the prepared optimizer.
#pragma once

#include <torch/optim/optimizer.h>

#include <cstdint>

namespace accel::detail {

// The first parameter's step count for the optimizers that keep one (Adam, AdamW, Adagrad,
// RMSprop; 0 before their first step); -1 for those that keep none (SGD, LBFGS).
int64_t own_step_count(torch::optim::Optimizer& optimizer);

}  // namespace accel::detail

// The prepared optimizer's fused step: libtorch's Adam, AdamW and SGD take one elementwise op per
// line of their update rule, each a pass over the parameter's memory (AdamW: about ten passes over
// parameter, gradient and both moments, plus temporaries). The fused step reads and writes each
// element once, in one loop per parameter, with the same update rule, options and state objects
// (AdamParamState, AdamWParamState, SGDParamState: state_dict, serialization and accel's
// checkpoints see libtorch's own state, so a run may switch between the two at any step).
//
// Results: the same formula in the same order per element, each operation rounded to the
// parameter's dtype as libtorch's ops do. libtorch's vectorized kernels may fuse a multiply and an
// add into one rounding (FMA) where this loop rounds twice, so the two agree to within a few ulps
// per step, not bitwise (tests/unit/fused_optimizer_test.cpp measures it). Deterministic: the same
// inputs give the same bits, whatever the thread count.
#pragma once

#include <torch/optim/optimizer.h>

namespace accel::detail {

// Steps `optimizer` with the fused loop when it is exactly torch::optim::Adam or AdamW (amsgrad
// off) or SGD, and every parameter with a gradient is a contiguous CPU float or double tensor
// with a dense contiguous gradient (and state) of the same dtype. Returns false, having changed
// nothing, otherwise: the caller then runs optimizer.step().
bool fused_step(torch::optim::Optimizer& optimizer);

}  // namespace accel::detail

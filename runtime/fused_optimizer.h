// The prepared optimizer's fused step: libtorch's Adam, AdamW and SGD take one elementwise op per
// line of their update rule, each a pass over the parameter's memory (AdamW: about ten passes over
// parameter, gradient and both moments, plus temporaries). The fused step reads and writes each
// element once, in one loop per parameter, with the same update rule, options and state objects
// (AdamParamState, AdamWParamState, SGDParamState: state_dict, serialization and accel's
// checkpoints see libtorch's own state, so a run may switch between the two at any step).
//
// Results: bitwise libtorch's. Each operation is the one libtorch's step runs, in its order, and
// rounded as ATen's kernel for it rounds: where ATen dispatches its AVX2 kernels (x86-64 CPUs with
// AVX2 and FMA, unless ATEN_CPU_CAPABILITY=default), add-with-alpha and addcmul round once, as a
// fused multiply-add, and so does this loop; elsewhere both round each operation
// (tests/unit/fused_optimizer_test.cpp compares them bit for bit). Deterministic: the same inputs
// give the same bits, whatever the thread count.
#pragma once

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>

namespace accel::detail {

// Steps `optimizer` with the fused loop when it is exactly torch::optim::Adam or AdamW (amsgrad
// off) or SGD, and every parameter with a gradient is a contiguous CPU float or double tensor
// with a dense contiguous gradient (and state) of the same dtype. Returns false, having changed
// nothing, otherwise: the caller then runs optimizer.step().
bool fused_step(torch::optim::Optimizer& optimizer);
// Whether fused_step would step `optimizer` now (what it checks before changing anything).
bool fused_step_fits(torch::optim::Optimizer& optimizer);

// The pieces fused_step is made of, for ZeRO (runtime/zero.h), which updates one contiguous slice
// of a parameter with the slices of its state. Every tensor: CPU, contiguous, the parameter's
// dtype (float or double) and element count.
struct AdamRule {
  double lr, beta1, beta2, eps, weight_decay;
  bool decoupled;  // AdamW's decay of the weights; Adam's L2 term in the gradient otherwise
};
struct SgdRule {
  double lr, momentum, dampening, weight_decay;
  bool nesterov;
};
// A group of a torch::optim::AdamW (decoupled) or Adam; of a torch::optim::SGD.
AdamRule adam_rule(const torch::optim::OptimizerParamGroup& group, bool decoupled);
SgdRule sgd_rule(const torch::optim::OptimizerParamGroup& group);
// Which elements an update touches: [begin, end) of the (flattened) tensors, all of them by
// default; `written(b, e)`, where given, runs after elements [b, e) of the parameter were
// written, in order, a few hundred KiB at a time (while they are still in the cache), on the
// calling thread.
struct UpdateRange {
  int64_t begin = 0;
  int64_t end = -1;  // -1: to the end
  std::function<void(int64_t, int64_t)> written;
};
// One step; `step` counts this one (1 on the first).
void fused_adam_update(const torch::Tensor& param, const torch::Tensor& grad,
                       const torch::Tensor& exp_avg, const torch::Tensor& exp_avg_sq, int64_t step,
                       const AdamRule& rule, const UpdateRange& range = {});
// `momentum_buffer`: undefined without momentum; `first`: it holds nothing yet (set to d_p).
void fused_sgd_update(const torch::Tensor& param, const torch::Tensor& grad,
                      const torch::Tensor& momentum_buffer, bool first, const SgdRule& rule,
                      const UpdateRange& range = {});

}  // namespace accel::detail

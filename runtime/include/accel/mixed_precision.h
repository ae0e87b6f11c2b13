// Mixed precision: an autocast scope (bf16 on CPU and CUDA, fp16 on CUDA) and a dynamic loss
// scaler for fp16 (torch.cuda.amp.GradScaler's algorithm and defaults).
// Thread: the training thread; autocast state is thread-local, as in PyTorch.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

namespace accel {

// RAII: inside the scope, ops on `device_type` tensors that autocast covers (matmul, linear,
// conv, ...) run in `dtype`; ops that need range (losses, softmax, norms) stay in float32.
// Scopes nest; leaving the outermost clears autocast's weight-cast cache.
class [[nodiscard]] AutocastGuard {
 public:
  // enabled=false: a scope that changes nothing (mixed precision "no").
  AutocastGuard(torch::DeviceType device_type, torch::ScalarType dtype, bool enabled = true);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;
  AutocastGuard(AutocastGuard&& other) noexcept;
  AutocastGuard& operator=(AutocastGuard&&) = delete;

 private:
  torch::DeviceType device_type_;
  bool active_ = false;
  bool previous_enabled_ = false;
  torch::ScalarType previous_dtype_ = torch::kFloat;
};

struct GradScalerOptions {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;   // scale *= growth after growth_interval clean steps in a row
  double backoff_factor = 0.5;  // scale *= backoff after a step with inf/NaN gradients
  int64_t growth_interval = 2000;
  bool enabled = true;
};

// Dynamic loss scaling. Per step: backward(scale(loss)); optionally unscale_(opt) (to clip);
// step(opt) skips the optimizer step when any gradient is inf/NaN; update() adjusts the scale.
// On CUDA it uses ATen's fused kernels (_amp_foreach_non_finite_check_and_unscale_,
// _amp_update_scale_); on CPU, where libtorch 1.13 has no kernels for them, the same arithmetic
// with tensor ops. With enabled=false every method is a pass-through.
class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  bool is_enabled() const { return options_.enabled; }
  // loss * scale (the scale moves to the loss's device).
  torch::Tensor scale(const torch::Tensor& loss);
  // Divides `optimizer`'s gradients by the scale and records whether any is inf/NaN. Once per
  // optimizer between update()s; a second call throws UsageError (the gradients would be
  // divided twice).
  void unscale_(torch::optim::Optimizer& optimizer);
  // True when unscale_(optimizer) has run since the last update().
  bool was_unscaled(const torch::optim::Optimizer& optimizer) const {
    return found_inf_.count(&optimizer) != 0;
  }
  // Unscales (if not done yet) and runs optimizer.step() unless a gradient was inf/NaN.
  // Returns true when the optimizer stepped.
  bool step(torch::optim::Optimizer& optimizer);
  // The same, with `run_step` in place of optimizer.step() (a closure, or another step of the
  // same optimizer's update, as the prepared optimizer's fused one).
  bool step(torch::optim::Optimizer& optimizer, const std::function<void()>& run_step);
  // Backs the scale off if any optimizer saw inf/NaN since the last update, else counts a clean
  // step and grows the scale after growth_interval of them.
  void update();

  double get_scale() const;
  int64_t growth_tracker() const;
  const GradScalerOptions& options() const { return options_; }

  // {"scale": ..., "growth_tracker": ...} as JSON, for checkpoints.
  std::string state_dict() const;
  // Restores state_dict(); CheckpointError naming `where` when it is not such JSON.
  void load_state_dict(const std::string& json, const std::string& where);

 private:
  void lazy_init(const torch::Device& device);

  GradScalerOptions options_;
  torch::Tensor scale_;           // [1] float32, on the device of the first scaled loss
  torch::Tensor growth_tracker_;  // [1] int32, same device
  // Optimizers unscaled since the last update, and whether each found inf/NaN ([1] float32).
  std::unordered_map<const torch::optim::Optimizer*, torch::Tensor> found_inf_;
};

}  // namespace accel

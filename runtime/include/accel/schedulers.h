// Learning-rate schedules as HF users write them: PyTorch's LambdaLR (libtorch 1.13 has none) and
// transformers' get_*_schedule_with_warmup built on it. Prepare them like any scheduler
// (acc.prepare(model, opt, dl, sched)); save_state/load_state restore them by their step count.
// Thread: the training thread.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace accel {

// PyTorch's LambdaLR: after k calls of step(), each parameter group's learning rate is the one it
// had at construction times lambda(k). Construction already applies lambda(0), as PyTorch's does
// (a warmup starts at 0, not at the full rate). The optimizer must outlive the scheduler.
class LambdaLR : public torch::optim::LRScheduler {
 public:
  using Lambda = std::function<double(int64_t step)>;
  // One lambda for every group.
  LambdaLR(torch::optim::Optimizer& optimizer, Lambda lambda);
  // One lambda per group (ConfigError when the counts differ).
  LambdaLR(torch::optim::Optimizer& optimizer, std::vector<Lambda> lambdas);
  // step() calls so far (PyTorch's last_epoch).
  [[nodiscard]] int64_t last_step() const { return static_cast<int64_t>(step_count_); }
  // The groups' learning rates at construction (PyTorch's base_lrs).
  [[nodiscard]] const std::vector<double>& base_lrs() const { return base_lrs_; }

 protected:
  std::vector<double> get_lrs() override;

 private:
  std::vector<double> base_lrs_;
  std::vector<Lambda> lambdas_;
};

// transformers' schedules (same formulas, same names and argument order). Steps are optimizer
// steps: num_training_steps counts them over the whole run.
std::shared_ptr<LambdaLR> get_constant_schedule(torch::optim::Optimizer& optimizer);
// 0 -> 1 linearly over num_warmup_steps, then 1.
std::shared_ptr<LambdaLR> get_constant_schedule_with_warmup(torch::optim::Optimizer& optimizer,
                                                            int64_t num_warmup_steps);
// 0 -> 1 over num_warmup_steps, then linearly down to 0 at num_training_steps.
std::shared_ptr<LambdaLR> get_linear_schedule_with_warmup(torch::optim::Optimizer& optimizer,
                                                          int64_t num_warmup_steps,
                                                          int64_t num_training_steps);
// 0 -> 1 over num_warmup_steps, then a cosine down to 0 at num_training_steps (num_cycles 0.5:
// half a period).
std::shared_ptr<LambdaLR> get_cosine_schedule_with_warmup(torch::optim::Optimizer& optimizer,
                                                          int64_t num_warmup_steps,
                                                          int64_t num_training_steps,
                                                          double num_cycles = 0.5);

// The same, taking the optimizer as prepare() does (a shared pointer; it must outlive the
// scheduler, as with the reference).
template <class O, class... Args>
auto get_linear_schedule_with_warmup(const std::shared_ptr<O>& optimizer, Args... args) {
  return get_linear_schedule_with_warmup(*optimizer, args...);
}
template <class O, class... Args>
auto get_cosine_schedule_with_warmup(const std::shared_ptr<O>& optimizer, Args... args) {
  return get_cosine_schedule_with_warmup(*optimizer, args...);
}
template <class O, class... Args>
auto get_constant_schedule_with_warmup(const std::shared_ptr<O>& optimizer, Args... args) {
  return get_constant_schedule_with_warmup(*optimizer, args...);
}
template <class O>
auto get_constant_schedule(const std::shared_ptr<O>& optimizer) {
  return get_constant_schedule(*optimizer);
}

}  // namespace accel

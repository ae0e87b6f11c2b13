// LambdaLR and transformers' warmup schedules (see accel/schedulers.h).
#include "accel/schedulers.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>
#include <utility>

#include "accel/error.h"

namespace accel {

LambdaLR::LambdaLR(torch::optim::Optimizer& optimizer, Lambda lambda)
    : LambdaLR(optimizer, std::vector<Lambda>(optimizer.param_groups().size(), std::move(lambda))) {
}

LambdaLR::LambdaLR(torch::optim::Optimizer& optimizer, std::vector<Lambda> lambdas)
    : torch::optim::LRScheduler(optimizer), lambdas_(std::move(lambdas)) {
  auto& groups = optimizer.param_groups();
  if (lambdas_.size() != groups.size()) {
    throw ConfigError("accel: LambdaLR got " + std::to_string(lambdas_.size()) +
                      " lambdas for an optimizer with " + std::to_string(groups.size()) +
                      " parameter groups; give one, or one per group");
  }
  for (std::size_t i = 0; i < groups.size(); ++i) {
    if (!lambdas_[i]) throw ConfigError("accel: LambdaLR got an empty lambda");
    base_lrs_.push_back(groups[i].options().get_lr());
  }
  // Why now: PyTorch's scheduler takes its first step in its constructor, so the optimizer's
  // first step already runs at lambda(0) (0 in a warmup), not at the base rate.
  for (std::size_t i = 0; i < groups.size(); ++i)
    groups[i].options().set_lr(base_lrs_[i] * lambdas_[i](0));
}

std::vector<double> LambdaLR::get_lrs() {
  // Why + 1: LRScheduler::step() asks for the rates before it counts the step it is taking.
  const auto k = static_cast<int64_t>(step_count_) + 1;
  std::vector<double> out;
  for (std::size_t i = 0; i < base_lrs_.size(); ++i) out.push_back(base_lrs_[i] * lambdas_[i](k));
  return out;
}

namespace {

void check_steps(const char* name, int64_t warmup, int64_t total) {
  if (warmup < 0 || total < 0) {
    throw ConfigError(std::string("accel: ") + name +
                      ": num_warmup_steps and num_training_steps must be >= 0, got " +
                      std::to_string(warmup) + " and " + std::to_string(total));
  }
}

// transformers' warmup: step / max(1, num_warmup_steps) before num_warmup_steps.
double warmup_factor(int64_t step, int64_t warmup) {
  return static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup));
}

}  // namespace

std::shared_ptr<LambdaLR> get_constant_schedule(torch::optim::Optimizer& optimizer) {
  return std::make_shared<LambdaLR>(optimizer, [](int64_t) { return 1.0; });
}

std::shared_ptr<LambdaLR> get_constant_schedule_with_warmup(torch::optim::Optimizer& optimizer,
                                                            int64_t num_warmup_steps) {
  check_steps("get_constant_schedule_with_warmup", num_warmup_steps, 0);
  return std::make_shared<LambdaLR>(optimizer, [num_warmup_steps](int64_t step) {
    return step < num_warmup_steps ? warmup_factor(step, num_warmup_steps) : 1.0;
  });
}

std::shared_ptr<LambdaLR> get_linear_schedule_with_warmup(torch::optim::Optimizer& optimizer,
                                                          int64_t num_warmup_steps,
                                                          int64_t num_training_steps) {
  check_steps("get_linear_schedule_with_warmup", num_warmup_steps, num_training_steps);
  return std::make_shared<LambdaLR>(optimizer, [num_warmup_steps,
                                                num_training_steps](int64_t step) {
    if (step < num_warmup_steps) return warmup_factor(step, num_warmup_steps);
    return std::max(
        0.0, static_cast<double>(num_training_steps - step) /
                 static_cast<double>(std::max<int64_t>(1, num_training_steps - num_warmup_steps)));
  });
}

std::shared_ptr<LambdaLR> get_cosine_schedule_with_warmup(torch::optim::Optimizer& optimizer,
                                                          int64_t num_warmup_steps,
                                                          int64_t num_training_steps,
                                                          double num_cycles) {
  check_steps("get_cosine_schedule_with_warmup", num_warmup_steps, num_training_steps);
  return std::make_shared<LambdaLR>(optimizer, [num_warmup_steps, num_training_steps,
                                                num_cycles](int64_t step) {
    if (step < num_warmup_steps) return warmup_factor(step, num_warmup_steps);
    const double progress =
        static_cast<double>(step - num_warmup_steps) /
        static_cast<double>(std::max<int64_t>(1, num_training_steps - num_warmup_steps));
    return std::max(0.0, 0.5 * (1.0 + std::cos(std::numbers::pi * num_cycles * 2.0 * progress)));
  });
}

}  // namespace accel

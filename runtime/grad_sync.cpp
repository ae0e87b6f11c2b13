// Bucketed, overlapped gradient all-reduce (see grad_sync.h).
#include "runtime/grad_sync.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include "accel/error.h"

namespace accel {

std::shared_ptr<GradSync> GradSync::create(Comm& comm, std::vector<torch::Tensor> params, GradSyncOptions options) {
  std::shared_ptr<GradSync> sync(new GradSync(comm, std::move(params), options));
  sync->install_hooks();
  return sync;
}

GradSync::GradSync(Comm& comm, std::vector<torch::Tensor> params, GradSyncOptions options)
    : comm_(comm), params_(std::move(params)) {
  bucket_of_.assign(params_.size(), 0);
  ready_.assign(params_.size(), false);
  // Reverse order: the last layers' gradients are ready first in backward.
  Bucket current;
  std::size_t bytes = 0;
  std::size_t cap = options.first_bucket_cap_bytes;
  auto close = [&] {
    if (current.params.empty()) return;
    auto& first = params_[current.params.front()];
    current.flat = torch::zeros({current.offsets.back()}, first.options());
    current.offsets.pop_back();
    buckets_.push_back(std::move(current));
    current = Bucket{};
    bytes = 0;
    cap = options.bucket_cap_bytes;
  };
  for (std::size_t i = params_.size(); i-- > 0;) {
    const auto& p = params_[i];
    if (!current.params.empty() &&
        (p.scalar_type() != params_[current.params.front()].scalar_type() ||
         p.device() != params_[current.params.front()].device())) {
      close();
    }
    if (current.offsets.empty()) current.offsets.push_back(0);
    bucket_of_[i] = buckets_.size();
    current.params.push_back(i);
    current.offsets.push_back(current.offsets.back() + p.numel());
    bytes += static_cast<std::size_t>(p.numel()) * p.element_size();
    if (bytes >= cap) close();
  }
  close();
  for (auto& b : buckets_) b.pending = b.params.size();
}

GradSync::~GradSync() = default;

void GradSync::install_hooks() {
  std::weak_ptr<GradSync> weak = weak_from_this();
  for (std::size_t i = 0; i < params_.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    if (!acc) throw UsageError("accel: parameter " + std::to_string(i) + " does not require grad; prepare() syncs only trainable parameters");
    acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [weak, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          if (auto self = weak.lock()) self->on_grad_ready(i);
          return outputs;
        }));
    accumulators_.push_back(std::move(acc));
  }
}

void GradSync::on_grad_ready(std::size_t param) {
  if (!require_sync_) return;
  if (!round_active_) {
    round_active_ = true;
    std::weak_ptr<GradSync> weak = weak_from_this();
    // Why: runs when this backward has finished, so loss.backward() alone also syncs.
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto self = weak.lock()) self->finalize();
    });
  }
  if (ready_[param]) return;  // a parameter used twice fires once per use; count it once
  ready_[param] = true;
  auto& bucket = buckets_[bucket_of_[param]];
  if (--bucket.pending == 0) launch_ready_buckets();
}

void GradSync::launch(Bucket& bucket) {
  for (std::size_t k = 0; k < bucket.params.size(); ++k) {
    auto& p = params_[bucket.params[k]];
    auto slot = bucket.flat.narrow(0, bucket.offsets[k], p.numel());
    if (p.grad().defined()) slot.copy_(p.grad().reshape({-1}));
    else slot.zero_();  // unused in this forward: contributes zero, as DDP's find_unused does
  }
  bucket.work = comm_.allreduce_async(bucket.flat, c10d::ReduceOp::SUM);
  bucket.launched = true;
}

void GradSync::launch_ready_buckets() {
  while (next_to_launch_ < buckets_.size() && buckets_[next_to_launch_].pending == 0) {
    launch(buckets_[next_to_launch_++]);
  }
}

void GradSync::finalize() {
  if (!round_active_) return;
  // Buckets with parameters that got no gradient are launched now, still in index order.
  while (next_to_launch_ < buckets_.size()) launch(buckets_[next_to_launch_++]);
  const double scale = 1.0 / comm_.world_size();
  try {
    for (auto& bucket : buckets_) {
      comm_.wait(bucket.work);
      bucket.flat.mul_(scale);
      for (std::size_t k = 0; k < bucket.params.size(); ++k) {
        auto& p = params_[bucket.params[k]];
        auto slot = bucket.flat.narrow(0, bucket.offsets[k], p.numel()).view(p.sizes());
        if (p.grad().defined()) p.mutable_grad().copy_(slot);
        else p.mutable_grad() = slot.clone();
      }
    }
  } catch (...) {
    reset_round();
    throw;
  }
  reset_round();
}

void GradSync::reset_round() {
  for (auto& b : buckets_) {
    b.pending = b.params.size();
    b.launched = false;
    b.work = {};
  }
  std::fill(ready_.begin(), ready_.end(), false);
  next_to_launch_ = 0;
  round_active_ = false;
}

}  // namespace accel

namespace accel {

void GradSync::broadcast_parameters() {
  if (comm_.world_size() == 1 || params_.empty()) return;
  torch::NoGradGuard no_grad;
  // One broadcast per bucket (same dtype and device), not one per parameter.
  for (auto& bucket : buckets_) {
    for (std::size_t k = 0; k < bucket.params.size(); ++k) {
      auto& p = params_[bucket.params[k]];
      bucket.flat.narrow(0, bucket.offsets[k], p.numel()).copy_(p.reshape({-1}));
    }
    comm_.broadcast(bucket.flat, 0);
    for (std::size_t k = 0; k < bucket.params.size(); ++k) {
      auto& p = params_[bucket.params[k]];
      p.copy_(bucket.flat.narrow(0, bucket.offsets[k], p.numel()).view(p.sizes()));
    }
  }
}

}  // namespace accel

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
  for (auto& b : buckets_) {
    b.pending = b.params.size();
    for (std::size_t k = 0; k < b.params.size(); ++k) attach_grad(b, k);
  }
}

// Why: DDP's gradient_as_bucket_view. With .grad a view into the bucket, autograd accumulates
// straight into the buffer that is all-reduced, saving a copy in and a copy out of every
// gradient per step (46 MB per step for model M).
void GradSync::attach_grad(Bucket& bucket, std::size_t k) {
  torch::NoGradGuard no_grad;
  auto& p = params_[bucket.params[k]];
  // Why set_ and not a view: libtorch's Optimizer::zero_grad() calls detach_() on every grad,
  // which autograd refuses on a view; a tensor that only shares the bucket's storage is fine.
  auto alias = torch::empty({0}, bucket.flat.options());
  alias.set_(bucket.flat.storage(), bucket.flat.storage_offset() + bucket.offsets[k], p.sizes(), {});
  if (p.grad().defined()) alias.copy_(p.grad());
  p.mutable_grad() = alias;
}

bool GradSync::is_attached(const Bucket& bucket, std::size_t k) const {
  if (params_[bucket.params[k]].numel() == 0) return true;  // nothing to sync
  const auto& g = params_[bucket.params[k]].grad();
  const auto* slot = static_cast<const char*>(bucket.flat.data_ptr()) + bucket.offsets[k] * bucket.flat.element_size();
  return g.defined() && g.data_ptr() == slot;
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
  // Why a lock: CPU and CUDA gradients of one model are accumulated on different engine threads.
  std::lock_guard lock(mu_);
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
  torch::NoGradGuard no_grad;
  for (std::size_t k = 0; k < bucket.params.size(); ++k) {
    if (is_attached(bucket, k)) continue;  // accumulated in place: nothing to copy
    // The grad was replaced (zero_grad(set_to_none), or assigned by the user): copy it in.
    auto& p = params_[bucket.params[k]];
    auto slot = bucket.flat.narrow(0, bucket.offsets[k], p.numel());
    if (p.grad().defined()) slot.copy_(p.grad().reshape({-1}));
    else slot.zero_();  // unused in this forward: contributes zero, as DDP's find_unused does
  }
  bucket.work = comm_.allreduce_async(bucket.flat, c10d::ReduceOp::SUM, /*average=*/true);
  bucket.launched = true;
}

void GradSync::launch_ready_buckets() {
  while (next_to_launch_ < buckets_.size() && buckets_[next_to_launch_].pending == 0) {
    launch(buckets_[next_to_launch_++]);
  }
}

void GradSync::abort_round() {
  std::lock_guard lock(mu_);
  reset_round();
}

void GradSync::finalize() {
  std::lock_guard lock(mu_);
  if (!round_active_) return;
  // Buckets with parameters that got no gradient are launched now, still in index order.
  while (next_to_launch_ < buckets_.size()) launch(buckets_[next_to_launch_++]);
  try {
    torch::NoGradGuard no_grad;
    for (auto& bucket : buckets_) {
      comm_.wait(bucket.work);  // averaged by now
      for (std::size_t k = 0; k < bucket.params.size(); ++k) {
        if (!is_attached(bucket, k)) {
          params_[bucket.params[k]].mutable_grad() = torch::Tensor();  // attach_grad copies nothing then
          attach_grad(bucket, k);
        }
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
  // One broadcast per bucket (same dtype and device), not one per parameter. Not through
  // bucket.flat: that holds the gradients.
  for (auto& bucket : buckets_) {
    auto staging = torch::empty_like(bucket.flat);
    for (std::size_t k = 0; k < bucket.params.size(); ++k) {
      auto& p = params_[bucket.params[k]];
      staging.narrow(0, bucket.offsets[k], p.numel()).copy_(p.reshape({-1}));
    }
    comm_.broadcast(staging, 0);
    for (std::size_t k = 0; k < bucket.params.size(); ++k) {
      auto& p = params_[bucket.params[k]];
      p.copy_(staging.narrow(0, bucket.offsets[k], p.numel()).view(p.sizes()));
    }
  }
}

}  // namespace accel

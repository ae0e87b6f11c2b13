// Bucketed, overlapped gradient all-reduce (see grad_sync.h).
#include "runtime/grad_sync.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "accel/error.h"
#include "runtime/log.h"

namespace accel {

std::shared_ptr<GradSync> GradSync::create(Comm& comm, std::vector<torch::Tensor> params,
                                           GradSyncOptions options) {
  std::shared_ptr<GradSync> sync(new GradSync(comm, std::move(params), options));
  sync->install_hooks();
  return sync;
}

GradSync::GradSync(Comm& comm, std::vector<torch::Tensor> params, GradSyncOptions options)
    : comm_(comm), params_(std::move(params)) {
  bucket_of_.assign(params_.size(), 0);
  ready_.assign(params_.size(), false);
  reopened_.assign(params_.size(), false);
  // Reverse order: the last layers' gradients are ready first in backward.
  Bucket current;
  std::size_t bytes = 0;
  std::size_t cap = options.first_bucket_cap_bytes;
  std::vector<std::pair<int64_t, torch::TensorOptions>> sizes;
  auto close = [&] {
    if (current.params.empty()) return;
    auto& first = params_[current.params.front()];
    current.flags = current.offsets.back();
    sizes.emplace_back(current.flags + static_cast<int64_t>(current.params.size()),
                       first.options());
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
  // Why shared: the machine's ranks all-reduce a bucket by reading each other's where it lies,
  // without copying it into shared memory first (private memory where that is not possible).
  auto flats = comm_.shared_zeros(sizes, "gradient buckets");
  for (std::size_t i = 0; i < buckets_.size(); ++i) buckets_[i].flat = std::move(flats[i]);
  // Why timed: whether splitting the sum between the ranks beats every rank summing it all
  // depends on the machine (its caches and memory); the buckets are what every step all-reduces.
  if (!buckets_.empty()) {
    auto largest = std::max_element(buckets_.begin(), buckets_.end(), [](auto& a, auto& b) {
      return a.flat.numel() < b.flat.numel();
    });
    const std::string chosen = comm_.choose_allreduce(largest->flat);
    if (!chosen.empty()) {
      char mb[32];
      std::snprintf(
          mb, sizeof mb, "%.1f MB",
          static_cast<double>(largest->flat.numel() * largest->flat.element_size()) / 1e6);
      log::debug("rank " + std::to_string(comm_.rank()) +
                 ": shared-memory all-reduce of the largest gradient bucket (" + std::string(mb) +
                 "), the slowest rank's best of 3: " + chosen);
    }
  }
  for (auto& b : buckets_) {
    b.pending = b.params.size();
    // Why only defined ones: a parameter that never gets a gradient must keep an undefined one.
    for (std::size_t k = 0; k < b.params.size(); ++k) {
      if (params_[b.params[k]].grad().defined()) attach_grad(b, k);
    }
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
  alias.set_(bucket.flat.storage(), bucket.flat.storage_offset() + bucket.offsets[k], p.sizes(),
             {});
  if (p.grad().defined()) alias.copy_(p.grad());
  p.mutable_grad() = alias;
}

bool GradSync::is_attached(const Bucket& bucket, std::size_t k) const {
  if (params_[bucket.params[k]].numel() == 0) return true;  // nothing to sync
  const auto& g = params_[bucket.params[k]].grad();
  const auto* slot = static_cast<const char*>(bucket.flat.data_ptr()) +
                     bucket.offsets[k] * bucket.flat.element_size();
  return g.defined() && g.data_ptr() == slot;
}

GradSync::~GradSync() = default;

void GradSync::install_hooks() {
  struct BeforeAccumulate : torch::autograd::FunctionPreHook {
    std::weak_ptr<GradSync> sync;
    std::size_t param;
    BeforeAccumulate(std::weak_ptr<GradSync> s, std::size_t i) : sync(std::move(s)), param(i) {}
    torch::autograd::variable_list operator()(
        const torch::autograd::variable_list& grads) override {
      if (auto self = sync.lock()) self->before_accumulate(param);
      return grads;
    }
  };
  std::weak_ptr<GradSync> weak = weak_from_this();
  for (std::size_t i = 0; i < params_.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    if (!acc)
      throw UsageError("accel: parameter " + std::to_string(i) +
                       " does not require grad; prepare() syncs only trainable parameters");
    acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [weak, i](const torch::autograd::variable_list& outputs,
                  const torch::autograd::variable_list&) {
          if (auto self = weak.lock()) self->on_grad_ready(i);
          return outputs;
        }));
    // Why a pre hook as well: a second accumulation must be refused before it writes into the
    // bucket, which the other ranks may be summing.
    acc->add_pre_hook(std::make_unique<BeforeAccumulate>(weak, i));
    accumulators_.push_back(std::move(acc));
  }
}

void GradSync::before_accumulate(std::size_t param) {
  if (!require_sync_) return;
  std::lock_guard lock(mu_);
  // A parameter's first gradient of a backward, or one of a round whose backward has ended.
  if (!round_active_ || token_.expired() || !ready_[param]) return;
  auto& bucket = buckets_[bucket_of_[param]];
  if (!bucket.launched) {
    // Its bucket not yet launched: the second gradient is summed with the rest, as on one
    // process. Why count it again: with gradients on several engine threads (CPU and CUDA),
    // another thread could launch the bucket before this accumulation; now it waits for it.
    // Not covered: the same parameter accumulated on two threads at once (its first gradient's
    // post hook not yet run, or a third gradient in flight beside the second).
    if (!reopened_[param]) {
      reopened_[param] = true;
      ++bucket.pending;
    }
    return;
  }
  std::ostringstream shape;
  shape << params_[param].sizes();
  throw UsageError(
      "accel: backward accumulated a second gradient into trainable parameter #" +
      std::to_string(param) + " (shape " + shape.str() +
      "; counting each trainable tensor of the prepared model once, in parameters() order) "
      "after its gradient had been handed to the all-reduce: a backward ran inside this one "
      "(reentrant activation checkpointing, or an autograd Function whose backward calls "
      "backward) and used a parameter that this backward had already finished. Its gradient "
      "would miss the average (DistributedDataParallel refuses this too: \"Expected to mark a "
      "variable ready only once\"). Compute that part in the outer backward (non-reentrant "
      "checkpointing), or run the whole (outer) backward under no_sync(model) and average the "
      "gradients with reduce(). This step's gradients are incomplete; zero_grad() and the next "
      "step start clean.");
}

// Rides in the engine's final callback of one round. When backward throws, the engine drops its
// callbacks with the graph task, before the exception leaves backward(): a token that dies with
// its round still open ends that round then (drained), whichever way backward was called.
struct GradSync::RoundToken {
  std::weak_ptr<GradSync> sync;
  std::uint64_t round = 0;
  RoundToken(std::weak_ptr<GradSync> s, std::uint64_t r) : sync(std::move(s)), round(r) {}
  RoundToken(const RoundToken&) = delete;
  RoundToken& operator=(const RoundToken&) = delete;
  ~RoundToken() {
    if (auto self = sync.lock()) self->end_round(round);
  }
};

void GradSync::on_grad_ready(std::size_t param) {
  if (!require_sync_) return;
  // Why a lock: CPU and CUDA gradients of one model are accumulated on different engine threads.
  std::lock_guard lock(mu_);
  // Why: a round whose callback is gone belongs to a backward that ended without finalize. The
  // token's destructor normally ends it first; this holds even if an engine kept it longer.
  if (round_active_ && token_.expired()) drain_and_reset_round();
  if (!round_active_) {
    auto token = std::make_shared<RoundToken>(weak_from_this(), round_ + 1);
    try {
      // Why: runs when this backward has finished, so loss.backward() alone also syncs.
      torch::autograd::Engine::get_default_engine().queue_callback([token] {
        if (auto self = token->sync.lock()) self->finalize();
      });
    } catch (...) {
      token->sync.reset();  // Why: it dies here, under mu_, and must not try to end a round
      throw;
    }
    ++round_;
    token_ = token;
    round_active_ = true;
  }
  if (ready_[param]) {
    // A second gradient in this backward (a backward run inside it), admitted by
    // before_accumulate while the bucket was still open: the bucket waited for it.
    if (reopened_[param]) {
      reopened_[param] = false;
      if (--buckets_[bucket_of_[param]].pending == 0) launch_ready_buckets();
    }
    return;
  }
  ready_[param] = true;
  auto& bucket = buckets_[bucket_of_[param]];
  if (--bucket.pending == 0) launch_ready_buckets();
}

void GradSync::launch(Bucket& bucket) {
  torch::NoGradGuard no_grad;
  const auto n = static_cast<int64_t>(bucket.params.size());
  std::vector<float> had_grad(bucket.params.size(), 1.0f);
  bucket.all_had_grad = true;
  for (std::size_t k = 0; k < bucket.params.size(); ++k) {
    auto& p = params_[bucket.params[k]];
    if (!p.grad().defined()) {
      had_grad[k] = 0.0f;
      bucket.all_had_grad = false;
    }
    if (is_attached(bucket, k)) continue;  // accumulated in place: nothing to copy
    // The grad was replaced (zero_grad(set_to_none), or assigned by the user), or is new: copy it
    // in.
    auto slot = bucket.flat.narrow(0, bucket.offsets[k], p.numel());
    if (p.grad().defined())
      slot.copy_(p.grad().reshape({-1}));
    else
      slot.zero_();  // unused here: contributes zero, as DDP's find_unused does
  }
  bucket.flat.narrow(0, bucket.flags, n)
      .copy_(torch::from_blob(had_grad.data(), {n}, torch::kFloat));
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
  if (round_active_) drain_and_reset_round();
}

void GradSync::end_round(std::uint64_t round) {
  std::lock_guard lock(mu_);
  if (round_active_ && round_ == round) drain_and_reset_round();
}

void GradSync::finalize() {
  std::lock_guard lock(mu_);
  if (!round_active_) return;
  // Buckets with parameters that got no gradient are launched now, still in index order.
  while (next_to_launch_ < buckets_.size()) launch(buckets_[next_to_launch_++]);
  try {
    torch::NoGradGuard no_grad;
    for (auto& bucket : buckets_) {
      bucket.launched = false;  // Why first: a failed wait must not be waited for again
      comm_.wait(bucket.work);  // averaged by now
      attach_reduced(bucket);
    }
  } catch (...) {
    drain_and_reset_round();
    throw;
  }
  drain_and_reset_round();
}

// After the wait: a parameter some rank had a gradient for gets the average as its .grad (a
// view of the bucket); one no rank had one for keeps an undefined .grad, as on one process.
void GradSync::attach_reduced(Bucket& bucket) {
  torch::Tensor had_grad;  // summed flags, read only when this rank lacked a gradient
  if (!bucket.all_had_grad) {
    had_grad = bucket.flat.narrow(0, bucket.flags, static_cast<int64_t>(bucket.params.size()))
                   .to(torch::kCPU, torch::kFloat)
                   .contiguous();
  }
  for (std::size_t k = 0; k < bucket.params.size(); ++k) {
    auto& p = params_[bucket.params[k]];
    bool any_rank = bucket.all_had_grad || had_grad.data_ptr<float>()[k] > 0.0f;
    if (!any_rank) continue;  // undefined here, as everywhere
    if (!is_attached(bucket, k) || !p.grad().defined()) {
      p.mutable_grad() = torch::Tensor();  // attach_grad copies nothing then
      attach_grad(bucket, k);
    }
  }
}

// Invariant: after this no collective of the round is in flight, so nothing writes into the
// gradients later, and every progress entry the round opened is closed.
void GradSync::drain_and_reset_round() {
  for (auto& b : buckets_) {
    if (b.launched) {
      b.launched = false;
      try {
        comm_.wait(b.work);
      } catch (const std::exception& e) {
        std::fprintf(stderr,
                     "accel: a gradient all-reduce of a backward that failed also failed: %s\n",
                     e.what());
      }
    }
    b.pending = b.params.size();
    b.work = {};
  }
  std::fill(ready_.begin(), ready_.end(), false);
  std::fill(reopened_.begin(), reopened_.end(), false);
  next_to_launch_ = 0;
  round_active_ = false;
}

}  // namespace accel

namespace accel {

void GradSync::broadcast_parameters() {
  if (!comm_.has_group() || params_.empty()) return;
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

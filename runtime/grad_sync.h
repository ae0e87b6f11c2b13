// GradSync: DDP's gradient synchronization for one model. Parameters are grouped into buckets in
// reverse registration order (about backward order); when every gradient of a bucket has been
// accumulated (a post hook on each parameter's AccumulateGrad node) the bucket is all-reduced
// asynchronously while backward goes on; the end of backward waits for all buckets and averages
// them in place. Each .grad aliases its bucket's storage (DDP's gradient_as_bucket_view), so
// autograd accumulates straight into the buffer that is all-reduced. Buckets are launched strictly
// in index order on every rank, so the collectives match even when ranks finish gradients in a
// different order. Each bucket also carries one "has a gradient" flag per parameter, summed with
// the gradients: a parameter no rank gave a gradient keeps an undefined .grad, as on one process
// (the optimizer then skips it, as DDP's find_unused_parameters does), with no extra collective. A
// backward that throws is drained before the exception leaves backward: every launched bucket is
// waited for (so no reduction lands in .grad after the caller's zero_grad) and its progress entry
// closed (so the agent does not take it for a hang). A gradient accumulated into a parameter a
// second time in one backward after its bucket was launched (a backward run inside this one, as
// reentrant activation checkpointing does) is refused before it is added: it would land in a
// buffer the other ranks are summing, or after the sum, and DDP refuses it too. Thread: hooks run
// on the autograd engine's thread (the caller's, on CPU); everything else on the training thread.
// Backward passes do not overlap.
#pragma once

#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "runtime/comm.h"

namespace torch::autograd {
struct Node;
}

namespace accel {

struct GradSyncOptions {
  std::size_t bucket_cap_bytes = 25u << 20;       // DDP's bucket_cap_mb default
  std::size_t first_bucket_cap_bytes = 1u << 20;  // DDP's smaller first bucket: starts comms early
};

class GradSync : public std::enable_shared_from_this<GradSync> {
 public:
  static std::shared_ptr<GradSync> create(Comm& comm, std::vector<torch::Tensor> params,
                                          GradSyncOptions options);
  ~GradSync();

  // Makes every rank's parameters equal to rank 0's.
  void broadcast_parameters();

  // Off: hooks do nothing and gradients only accumulate locally (no_sync / accumulate).
  void set_require_sync(bool sync) { require_sync_ = sync; }
  bool require_sync() const { return require_sync_; }

  // Waits for the buckets of the current backward and writes the averaged gradients. Called at
  // the end of backward (engine callback); a no-op when nothing is pending.
  void finalize();

  std::size_t num_buckets() const { return buckets_.size(); }

  // Ends a round whose backward threw before it finished: waits for the buckets it launched
  // (their errors are printed, not thrown) and forgets the rest, so the next backward syncs.
  // Also runs by itself when the engine drops this round's finalize (a plain loss.backward()
  // that threw); calling it with no round open does nothing.
  void abort_round();

 private:
  struct Bucket {
    std::vector<std::size_t> params;  // indices into params_
    std::vector<int64_t> offsets;     // element offset of each param in `flat`
    int64_t flags = 0;          // offset of the has-a-gradient flags (one per param) in `flat`
    torch::Tensor flat;         // the gradients, then the flags
    std::size_t pending = 0;    // gradients not yet ready this backward
    bool launched = false;      // all-reduce started and not yet waited for
    bool all_had_grad = false;  // every param of this rank had a gradient at launch
    Comm::Pending work;
  };
  struct RoundToken;

  GradSync(Comm& comm, std::vector<torch::Tensor> params, GradSyncOptions options);
  void install_hooks();
  void on_grad_ready(std::size_t param);
  void before_accumulate(std::size_t param);
  void launch_ready_buckets();
  void launch(Bucket& bucket);
  void attach_grad(Bucket& bucket, std::size_t k);
  bool is_attached(const Bucket& bucket, std::size_t k) const;
  void drain_and_reset_round();
  void end_round(std::uint64_t round);
  void attach_reduced(Bucket& bucket);

  Comm& comm_;
  std::vector<torch::Tensor> params_;
  std::vector<std::size_t> bucket_of_;  // param index -> bucket index
  std::vector<Bucket> buckets_;
  std::vector<bool> ready_;
  // A parameter whose second gradient of this backward was admitted (its bucket not yet
  // launched) and is not yet accumulated: its bucket's `pending` counts it again.
  std::vector<bool> reopened_;
  // Why: hooks live on these nodes
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::size_t next_to_launch_ = 0;
  bool round_active_ = false;
  std::uint64_t round_ = 0;          // counts rounds; a RoundToken names the one it belongs to
  std::weak_ptr<RoundToken> token_;  // the open round's, held by the engine's callback
  bool require_sync_ = true;
  std::mutex mu_;  // guards the round state (ready_, buckets_' counters, next_to_launch_,
                   // round_active_, round_, token_, reopened_)
};

}  // namespace accel

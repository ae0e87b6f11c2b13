// GradSync: DDP's gradient synchronization for one model. Parameters are grouped into buckets in
// reverse registration order (about backward order); when every gradient of a bucket has been
// accumulated (a post hook on each parameter's AccumulateGrad node) the bucket is all-reduced
// asynchronously while backward goes on; the end of backward waits for all buckets and averages
// them in place. Each .grad aliases its bucket's storage (DDP's gradient_as_bucket_view), so
// autograd accumulates straight into the buffer that is all-reduced. Buckets are launched strictly in index order on every rank, so the
// collectives match even when ranks finish gradients in a different order.
// Thread: hooks run on the autograd engine's thread (the caller's, on CPU); everything else on
// the training thread. Backward passes do not overlap.
#pragma once

#include <torch/types.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "runtime/comm.h"

namespace torch::autograd {
struct Node;
}

namespace accel {

struct GradSyncOptions {
  std::size_t bucket_cap_bytes = 25u << 20;      // DDP's bucket_cap_mb default
  std::size_t first_bucket_cap_bytes = 1u << 20;  // DDP's smaller first bucket: starts comms early
};

class GradSync : public std::enable_shared_from_this<GradSync> {
 public:
  static std::shared_ptr<GradSync> create(Comm& comm, std::vector<torch::Tensor> params, GradSyncOptions options);
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

  // Forgets a round whose backward threw before it finished (the engine then drops finalize);
  // otherwise the next backward would find its parameters already counted and never sync.
  void abort_round();

 private:
  struct Bucket {
    std::vector<std::size_t> params;  // indices into params_
    std::vector<int64_t> offsets;     // element offset of each param in `flat`
    torch::Tensor flat;
    std::size_t pending = 0;          // gradients not yet ready this backward
    bool launched = false;
    Comm::Pending work;
  };

  GradSync(Comm& comm, std::vector<torch::Tensor> params, GradSyncOptions options);
  void install_hooks();
  void on_grad_ready(std::size_t param);
  void launch_ready_buckets();
  void launch(Bucket& bucket);
  void attach_grad(Bucket& bucket, std::size_t k);
  bool is_attached(const Bucket& bucket, std::size_t k) const;
  void reset_round();

  Comm& comm_;
  std::vector<torch::Tensor> params_;
  std::vector<std::size_t> bucket_of_;  // param index -> bucket index
  std::vector<Bucket> buckets_;
  std::vector<bool> ready_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // Why: hooks live on these nodes
  std::size_t next_to_launch_ = 0;
  bool round_active_ = false;
  bool require_sync_ = true;
  std::mutex mu_;  // guards the round state (ready_, buckets_' counters, next_to_launch_, round_active_)
};

}  // namespace accel

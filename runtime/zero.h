// ZeRO stage 1 for one prepared optimizer: each rank keeps the optimizer state of one slice of
// the parameters and updates only that slice; the updated parameters are then all-gathered.
//
// The parameters of the optimizer (its groups in order, each parameter's elements in order) are
// one sequence of N elements; rank r owns elements [r*S, (r+1)*S) with S = ceil(N / world). The
// gradients are all-reduced as without ZeRO (GradSync), so every rank holds the same averaged
// gradient; each rank then runs the fused update rule (fused_optimizer.h) on its slices with its
// slices of the state, and one all-gather of S elements per rank brings every rank the whole
// updated parameters. Each element's update is the same arithmetic as the unsharded fused step,
// so the result is bitwise the unsharded run's.
//
// Checkpoints stay libtorch's per-parameter format: gather_state() all-gathers the slices, in
// pieces, into libtorch's own state objects on the main process for the save, and adopt_state()
// keeps this rank's slices of a loaded (full) state. A ZeRO checkpoint therefore loads at any world
// size, with or without ZeRO, and an unsharded one loads under ZeRO. Thread: the training thread.
#pragma once

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "accel/state.h"
#include "runtime/comm.h"

namespace accel::detail {

class ZeroOptimizer {
 public:
  // Throws UsageError, naming what, when `optimizer` cannot be sharded: not exactly
  // torch::optim::Adam, AdamW (without amsgrad) or SGD, or parameters not contiguous CPU tensors
  // of one floating dtype (float or double). A state the optimizer already holds (loaded before
  // prepare()) is sliced and kept (CheckpointError when it does not fit). `state`: the process
  // group it all-gathers through, held as long as this lives.
  ZeroOptimizer(torch::optim::Optimizer& optimizer, std::shared_ptr<State> state);

  // Every rank, on a synchronizing step: updates this rank's slices, then all-gathers. UsageError,
  // before anything changes, when the optimizer's parameters or their gradients changed since
  // prepare() (another group, a replaced or retyped parameter) or its own state() was filled by
  // a step through the original handle.
  void step();
  // Every rank (a collective): libtorch's full state objects from every rank's slices, installed
  // in the optimizer's state() on the ranks where `install` is true (the others only send).
  void gather_state(bool install);
  // Removes what gather_state installed (the optimizer's state() is empty under ZeRO).
  void clear_installed();
  // Throws CheckpointError naming `where` when a state the optimizer's state() holds (loaded
  // from a checkpoint) does not fit its parameter; changes nothing.
  void check_loaded(const std::string& where) const;
  // After the optimizer loaded a full state (a checkpoint) that check_loaded() accepted: keeps
  // this rank's slices of it and empties the optimizer's state().
  void adopt_state();

  // Bytes of optimizer state memory this rank holds, its slices' whether stepped yet or not.
  int64_t state_bytes() const;
  // Bytes of the blocks map_state() mapped that are still held, all optimizers of this
  // process together: memory malloc's statistics do not see (bench_train adds it to them).
  static int64_t mapped_bytes();
  // "elements [a, b) of N", for messages.
  std::string describe_shard() const;

 private:
  enum class Kind { kAdam, kAdamW, kSgd };
  struct Param {
    torch::Tensor param;
    std::size_t group = 0;
    int64_t offset = 0;  // of its first element in the sequence of all elements
    int64_t numel = 0;   // its element count at prepare()
    int64_t begin = 0;   // this rank's elements of it: [begin, end) (may be empty)
    int64_t end = 0;
    int64_t step = 0;             // Adam/AdamW: steps taken (every rank counts, owner or not)
    bool has_state = false;       // it has stepped (SGD: it has a momentum buffer)
    torch::Tensor first, second;  // this rank's slices: exp_avg, exp_avg_sq (SGD: momentum)
    bool in_block = false;        // first and second are views of a block map_state() made
  };

  torch::Tensor slice(const torch::Tensor& full, const Param& p) const;
  // Whether `z` has state: Adam and AdamW always, SGD where its group has momentum.
  bool keeps_state(const Param& z) const;
  // Gives every parameter for which `needs` holds and which has no state memory yet its slices
  // (first, and second for Adam) in one new block mapped apart from malloc's heap: at prepare(),
  // those that require a gradient, as DeepSpeed makes its partitions when it starts; at a step,
  // any that steps without memory. has_state stays false until a slice's first step, which
  // zeroes it (SGD: overwrites it with the first update), so a slice that never steps is not
  // saved; its memory is held all the same (state_bytes() counts it). False, changing nothing,
  // when the block cannot be mapped.
  bool map_state(const std::function<bool(const Param&)>& needs);
  // This rank's slice of `full` into `mine`: into its block's view when it has one, else a copy
  // of its own.
  void keep_slice(torch::Tensor& mine, const torch::Tensor& full, const Param& z) const;
  void check_unchanged() const;
  Comm& comm() const { return state_->comm(); }
  // Copies elements [from, from + count) of the sequence between `buffer` (count elements) and
  // the parameters (elements past the end, a last shard's padding, are left alone); with
  // `tensors` (one per parameter, of its element count; undefined ones skipped), between
  // `buffer` and those instead ("to_params" then means into them).
  void copy_sequence(int64_t from, int64_t count, const torch::Tensor& buffer, bool to_params,
                     const std::vector<torch::Tensor>* tensors = nullptr);

  torch::optim::Optimizer& optimizer_;
  std::shared_ptr<State> state_;
  std::vector<std::size_t> first_of_group_;  // index in params_ of each group's first
  Kind kind_;
  std::vector<Param> params_;
  int64_t total_ = 0;  // N
  int64_t shard_ = 0;  // S
  torch::TensorOptions options_;
  torch::Tensor send_, gathered_;  // step()'s all-gather pieces: C and world * C elements
  // Or, where the ranks share a machine's memory: 2 * C elements of a shared block, two pieces
  // that alternate; each rank copies the others' straight into its parameters.
  torch::Tensor exchange_;
  void gather_through_exchange();
};

}  // namespace accel::detail

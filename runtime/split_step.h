// The optimizer step split between the ranks of one machine (zero_stage 0, the fused step, every
// rank of the job on this machine with shared memory between them).
//
// Without it every rank runs the same whole step on the same averaged gradients: the same work,
// N times over. With it, the parameters of the optimizer (its groups in order, each parameter's
// elements in order) are one sequence of N elements, and rank r updates elements [r*S, (r+1)*S)
// (S = ceil(N / world)) with the fused rule (fused_optimizer.h), writing each updated piece into
// its own parameters and, while the piece is still in its cache, into every other rank's. For
// that the parameters move, at the first step, into a shared-memory block (each rank its own copy,
// which the others can write), and the optimizer's state tensors are one copy per machine
// (Comm::machine_zeros: each rank reserves 1/world of its pages), seen by every rank's
// optimizer.state(): each rank updates its elements of it. The step opens with a collective that
// every rank reaches only after its own work on the parameters is done (a background save's
// copies), and ends with a barrier, so no rank sees another's writes outside its own step().
//
// Results: bitwise the unsplit fused step's (each element's update is the same arithmetic on the
// same averaged gradient), and every rank's optimizer.state() holds the whole state, so saving,
// loading and resuming are unchanged. A state loaded from a checkpoint (new tensors) is moved into
// the shared copy at the next step, each rank its own elements. What differs: the state tensors
// are shared, so a program that edits optimizer state in place on one rank edits it for all.
// Thread: the training thread.
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

class SplitStep {
 public:
  // Null unless `state`'s job has more than one rank, all on this machine with shared memory,
  // and `optimizer` is exactly torch::optim::Adam or AdamW (amsgrad off) or SGD. `averaged(p)`:
  // p's gradient is averaged across the ranks (p belongs to a prepared model). Without
  // `any_size`, optimizers of fewer than kMinElements elements step unsplit.
  static std::unique_ptr<SplitStep> create(torch::optim::Optimizer& optimizer,
                                           std::shared_ptr<State> state,
                                           std::function<bool(const torch::Tensor&)> averaged,
                                           bool any_size = false);

  // Why a floor: the split step costs two collectives (a few microseconds each on shared
  // memory), and below about this many elements the half of the update it saves costs less than
  // that (a small model's whole step would slow down).
  static constexpr int64_t kMinElements = int64_t{1} << 18;

  // Every rank, on a synchronizing step: steps the optimizer split between the ranks and returns
  // true, or returns false, having changed nothing, on every rank alike (a parameter outside every
  // prepared model, parameters the fused step does not take, a group switched to amsgrad, no room
  // in /dev/shm): the caller then steps as without it.
  bool step();

  // "elements [a, b) of N" once placed, for the debug line.
  std::string describe() const;

  // Gives every state tensor of the optimizer that lies in the machine's shared copy a private
  // copy of its own, and forgets the placement (a later step() places again). Run where the
  // optimizer steps unsplit from now on (a refusal, free_memory()): each rank's whole step would
  // otherwise update the one copy at once. Reads the shared copy only, so it needs no barrier
  // while no rank writes it: between the entry collective and the update, or on every rank after
  // the last step.
  void unshare();

 private:
  enum class Kind { kAdam, kAdamW, kSgd };
  enum Check : int { kReady = 0, kPlace = 1, kRefuse = 2 };
  struct Param {
    const void* impl = nullptr;  // the parameter's TensorImpl when placed
    std::size_t group = 0;
    int64_t offset = 0;  // its first element in the sequence
    int64_t numel = 0;
  };

  SplitStep(torch::optim::Optimizer& optimizer, std::shared_ptr<State> state, Kind kind,
            std::function<bool(const torch::Tensor&)> averaged, int64_t min_elements);
  Comm& comm() const { return state_->comm(); }
  // What this rank needs before the step can run: nothing, placing, or the unsplit step.
  Check check() const;
  // Collective: the parameters into a fresh shared block, the state's homes into the machine's
  // one copy each. False on every rank when /dev/shm has no room.
  bool place();
  // A view of the machine's one copy of state tensor `k` (0: exp_avg or momentum, 1: exp_avg_sq)
  // for the parameter at `z`, shaped like `param`.
  torch::Tensor home(int k, const Param& z, const torch::Tensor& param) const;
  // Makes `held` (a state tensor, maybe loaded from a checkpoint) the home view: copies this
  // rank's elements [lo, hi) of it there (fresh: zeroes them) unless it already is. Returns the
  // home view.
  torch::Tensor adopt(const torch::Tensor& held, int k, const Param& z, const torch::Tensor& param,
                      int64_t lo, int64_t hi) const;
  void update(const torch::Tensor& param, const Param& z, int64_t lo, int64_t hi);

  torch::optim::Optimizer& optimizer_;
  std::shared_ptr<State> state_;
  Kind kind_;
  std::function<bool(const torch::Tensor&)> averaged_;
  int64_t min_elements_;
  bool off_ = false;  // refused for good (the same on every rank)
  std::vector<Param> params_;
  int64_t total_ = 0;
  int64_t mine_begin_ = 0, mine_end_ = 0;  // this rank's elements of the sequence
  torch::Tensor flat_;                     // this rank's parameters, in its part of the block
  std::vector<char*> peers_;               // every other rank's copy of flat_
  std::vector<torch::Tensor> state_home_;  // the machine's one copy of each state tensor
};

}  // namespace accel::detail

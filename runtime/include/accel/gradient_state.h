// GradientState: whether this step synchronizes gradients, and where the active data loader is.
// Shared by an Accelerator, its prepared optimizers and schedulers, and its prepared loaders.
// Thread: the training thread only.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace accel {

// Where one pass over a prepared data loader stands; written by the loader as it yields.
struct LoaderPosition {
  bool end_of_dataloader = false;  // the batch being handed out is the last of the pass
  int64_t remainder = -1;          // real samples in the last global batch; -1: none duplicated
  bool even_batches = true;  // ranks get equally sized batches (gather needs no size exchange)
};

class GradientState {
 public:
  bool sync_gradients() const { return sync_gradients_; }
  void set_sync_gradients(bool sync) { sync_gradients_ = sync; }
  int num_steps() const { return num_steps_; }
  void set_num_steps(int steps) { num_steps_ = steps; }
  bool sync_with_dataloader() const { return sync_with_dataloader_; }
  void set_sync_with_dataloader(bool v) { sync_with_dataloader_ = v; }
  // Micro-steps since the last synchronizing step (accumulate() counts them).
  int64_t step() const { return step_; }
  void set_step(int64_t step) { step_ = step; }
  // The most recent optimizer step was skipped for inf/NaN gradients (schedulers then hold).
  bool optimizer_step_overflowed() const { return overflowed_; }
  void set_optimizer_step_overflowed(bool v) { overflowed_ = v; }

  // The loaders being iterated, innermost last (an evaluation loop inside a training loop).
  void push_loader(std::shared_ptr<const LoaderPosition> position) {
    active_.push_back(std::move(position));
  }
  void pop_loader(const LoaderPosition* position);
  bool in_dataloader() const { return !active_.empty(); }
  bool end_of_dataloader() const { return !active_.empty() && active_.back()->end_of_dataloader; }
  int64_t remainder() const { return active_.empty() ? -1 : active_.back()->remainder; }
  bool even_batches() const { return active_.empty() || active_.back()->even_batches; }

 private:
  bool sync_gradients_ = true;
  int num_steps_ = 1;
  bool sync_with_dataloader_ = true;
  int64_t step_ = 0;
  bool overflowed_ = false;
  std::vector<std::shared_ptr<const LoaderPosition>> active_;
};

inline void GradientState::pop_loader(const LoaderPosition* position) {
  for (auto it = active_.end(); it != active_.begin();) {
    --it;
    if (it->get() == position) {
      active_.erase(it);
      return;
    }
  }
}

}  // namespace accel

// What an Accelerator holds besides its options and states: the prepared objects, checkpoint
// and tracker state (the public header keeps them behind Accelerator::Impl).
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <filesystem>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "accel/accelerator.h"
#include "runtime/checkpoint_snapshot.h"
#include "runtime/grad_sync.h"
#include "runtime/split_step.h"
#include "runtime/tracking.h"
#include "runtime/zero.h"

namespace accel {

namespace detail {

// A prepared optimizer's shared state: copies of its PreparedOptimizer and the Accelerator see it.
struct OptimizerSlot {
  std::shared_ptr<torch::optim::Optimizer> optimizer;
  bool skipped = false;   // the last step() did nothing
  bool overflow = false;  // ...because the loss scaler found inf/NaN gradients
  int64_t steps = 0;      // step() calls on synchronizing steps (stepped or overflowed)
  // The optimizer's own step count (Adam, AdamW, Adagrad, RMSprop keep one per parameter) after
  // the last step through the prepared optimizer, or -1 when it keeps none: a larger count means
  // someone stepped the original optimizer.
  int64_t own_steps = -1;
  bool fused = true;                    // AcceleratorOptions::fused_optimizer
  std::unique_ptr<ZeroOptimizer> zero;  // ZeRO stage 1 (zero.h); null without it
  // The step split between the machine's ranks (split_step.h); null where it cannot be.
  std::unique_ptr<SplitStep> split;
  // ZeRO: throws UsageError for a parameter outside every prepared model; run at the first step
  // (the models may be prepared after the optimizer), then cleared.
  std::function<void()> check_membership;
  // A background save's copies of the parameters and optimizer states: a step waits for them.
  std::shared_ptr<ckpt::SnapshotCopies> snapshot;
};

struct SchedulerSlot {
  std::shared_ptr<torch::optim::LRScheduler> scheduler;
  int64_t steps = 0;  // scheduler->step() calls made through the PreparedScheduler
};

// An object saved with the checkpoint (register_for_checkpointing), as bytes.
struct CustomState {
  std::function<std::string()> save;
  std::function<void(const std::string&)> load;
};

// This rank's part of a checkpoint (random_states_<rank>): its RNG states, its loaders' positions.
std::string rank_state(int rank, const std::vector<DataLoader>& loaders);
}  // namespace detail

struct Accelerator::Impl {
  std::string mixed_precision_ = "no";
  // How prepared models' m(x) run: autocast with mixed precision and options_.autocast_forward.
  std::shared_ptr<ForwardPrecision> forward_precision_ = std::make_shared<ForwardPrecision>();
  // Autocast regions (AutocastGuard scopes) entered on this thread when this was made; the same
  // count at a backward(), with mixed precision on, means every forward so far ran in float32.
  int64_t autocast_regions_at_start_ = 0;
  bool warned_no_autocast_ = false;
  int zero_stage_ = 0;  // options_.zero_stage, else ACCEL_ZERO_STAGE
  std::unordered_map<const torch::nn::Module*, std::shared_ptr<GradSync>> syncs_;
  std::unordered_map<const torch::nn::Module*, bool> prepared_;
  bool trigger_ = false;
  std::shared_ptr<GradScaler> scaler_;
  ProjectConfiguration project_;
  // Prepared objects, in prepare order (checkpoints save and load them by position).
  std::vector<torch::nn::Module*> models_;
  std::vector<std::shared_ptr<detail::OptimizerSlot>> optimizers_;
  std::vector<std::shared_ptr<detail::SchedulerSlot>> schedulers_;
  std::vector<DataLoader> loaders_;
  std::vector<detail::CustomState> custom_;
  bool resume_checked_ = false;
  bool training_started_ = false;  // maybe_resume() ran (free_memory() clears it)
  // Pre-hooks by id (ids only grow, so removing one keeps the others' order).
  std::shared_ptr<std::map<int64_t, StateHook>> save_hooks_ =
      std::make_shared<std::map<int64_t, StateHook>>();
  std::shared_ptr<std::map<int64_t, StateHook>> load_hooks_ =
      std::make_shared<std::map<int64_t, StateHook>>();
  int64_t next_hook_id_ = 0;
  std::string resumed_from_;     // the checkpoint automatic resume loaded, if any
  int64_t resumed_at_step_ = 0;  // completed_steps() just after it
  // The last automatic checkpoint (save_state() with no folder, or one loaded from the automatic
  // folder) and completed_steps() then; a save to a folder of the program's own counts for
  // neither the periodic save nor SIGUSR1's. Step 0 counts as saved for the periodic save.
  int64_t last_auto_save_ = 0;
  std::filesystem::path last_auto_save_dir_;
  // SIGUSR1 means "save a checkpoint, then stop" (with a checkpoint folder): checked once a step.
  bool stop_on_signal_ = false;
  int64_t last_signal_check_ = -1;
  std::unique_ptr<detail::Tracking> tracking_;
  // A background save (SaveStateOptions::async). Every rank: its outcome is not yet agreed on.
  bool save_in_flight_ = false;
  std::filesystem::path save_target_;
  // Main process: the writer thread's result ("" = written), until joined into save_error_.
  std::future<std::string> save_writer_;
  // Main process: what a background save copies of the state, and the memory it keeps (laid out
  // as the checkpoint's files).
  std::shared_ptr<ckpt::SnapshotCopies> snapshot_ = std::make_shared<ckpt::SnapshotCopies>();
  std::string save_error_;
  // The save in flight is an in-memory snapshot: each node's local main writes one, and its
  // failure turns snapshots off instead of failing the run.
  bool save_is_snapshot_ = false;
  // In-memory snapshots: every `snapshot_interval_` optimizer steps (0: off) into snapshot_dir_
  // (the node's, from the agent); the step of the last one (taken or loaded).
  int64_t snapshot_interval_ = 0;
  std::filesystem::path snapshot_dir_;
  int64_t last_snapshot_ = -1;
  // Main process, not a collective: waits for the writer; its error ("" = none or not main).
  const std::string& join_background_save();
  // Starts the writer thread: the deferred copies of the CPU state first (the next optimizer
  // step waits for them), then `write`; without copies_first, `write` itself lets the step go
  // (an in-memory snapshot, written from the live state).
  // `target`: the checkpoint's folder, whose disk decides where the writer runs after its copies
  // (`copies_first`; an in-memory snapshot's writer is not placed).
  void start_background_write(std::function<void()> write, const std::filesystem::path& target,
                              bool copies_first = true);
  // Main process, CPU training with async_checkpoints, once the optimizer has its state and
  // before the first background save: makes the memory such a save copies into and maps its
  // pages in the background (prefault()).
  void prefault_background_copies();
  bool prefaulted_ = false;
  // Loaders' boundary hooks hold this weakly: a loader may outlive its Accelerator.
  std::shared_ptr<Accelerator*> self_;
};

}  // namespace accel

// accel::Accelerator: the API training programs are written against (HF Accelerate's, in C++).
// Construct one, prepare() the model, optimizer, loader and scheduler, call backward(loss), and
// the same program runs on 1 or N processes with the result of 1 process on the global batch.
// Thread: one training thread per process; collectives must be called by every rank in order.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>
#include <torch/serialize.h>
#include <torch/serialize/archive.h>

#include <chrono>
#include <concepts>
#include <cstddef>
#include <exception>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <variant>
#include <vector>

#include "accel/data.h"
#include "accel/error.h"
#include "accel/gradient_state.h"
#include "accel/mixed_precision.h"
#include "accel/prepared_model.h"
#include "accel/state.h"

namespace accel {

class GradSync;

enum class ReduceOp { kSum, kMean, kMax, kMin };

// Where checkpoints go (HF Accelerate's ProjectConfiguration). With ACCEL_CHECKPOINT_DIR set (by
// `accel-launch --checkpoint-dir`) and project_dir unset, project_dir is that folder and
// automatic naming and automatic resume are on.
struct ProjectConfiguration {
  std::optional<std::string> project_dir{};  // unset: ACCEL_CHECKPOINT_DIR, else none
  // save_state() with no folder writes project_dir/checkpoints/checkpoint_<iteration>.
  // Unset: on when project_dir is set.
  std::optional<bool> automatic_checkpoint_naming{};
  // Keep at most this many automatic checkpoints; older ones are removed after each save.
  // Unset: ACCEL_CHECKPOINT_TOTAL_LIMIT, else 3 when project_dir comes from ACCEL_CHECKPOINT_DIR,
  // else no limit.
  std::optional<int64_t> total_limit{};
  int64_t iteration = 0;  // the <n> of the next automatic checkpoint
  // Save automatically every N optimizer steps (at the next batch, once the step is done).
  // Unset: ACCEL_CHECKPOINT_INTERVAL, else 0 (only explicit save_state()).
  std::optional<int64_t> save_interval{};
  // The automatic saves (every save_interval steps) write in the background, as
  // save_state(dir, {.async = true}) does; and on the CPU the main process makes the memory that
  // background saves copy into once the optimizer has its state, before the first save. Unset:
  // ACCEL_ASYNC_CHECKPOINTS (accel-launch --async-checkpoints), else false.
  std::optional<bool> async_checkpoints{};
  // With automatic naming, the newest complete checkpoint is loaded when training starts, so a
  // restarted job continues where it was. Unset: on when the folder came from the launcher
  // (ACCEL_CHECKPOINT_DIR or ACCEL_PROJECT_DIR: accel-launch --checkpoint-dir or --project-dir),
  // off for a project_dir set in code alone (HF never resumes by itself); true turns it on
  // there. It happens the first time a prepared loader is iterated or asked
  // its epoch() or state(), or at the first backward() or save_state(), whichever comes first
  // (every rank gets there: the first of those calls is a collective). A backward() that comes
  // first while there is a checkpoint to load throws UsageError (the forward pass already used
  // the weights). Objects are matched by prepare order. A model prepared after that point (an
  // evaluation copy) is not in the checkpoints; prepare() of another object or
  // register_for_checkpointing() after it throws UsageError on the first run already, since a
  // restarted run could not restore it.
  std::optional<bool> automatic_resume{};
  // Automatic resume refuses a checkpoint saved by another run (other dataset sizes, model
  // parameters or optimizers) and names the difference; true resumes from it anyway.
  // Unset: ACCEL_RESUME=force (accel-launch --resume force), else false.
  std::optional<bool> resume_other_run{};
  // Where experiment trackers write: each run in logging_dir/<init_trackers' project_name>.
  // Unset: ACCEL_PROJECT_DIR (accel-launch --project-dir), else project_dir.
  std::optional<std::string> logging_dir{};
};

// What save_model writes (HF's save_pretrained with safe_serialization).
struct SaveModelOptions {
  std::string max_shard_size = "10GB";  // "500MB", "2GiB", or bytes
};

// How save_state writes (docs/checkpointing.md).
struct SaveStateOptions {
  // Return at once; a background thread of the main process copies the state and writes,
  // fsyncs and publishes the files while training goes on. What a forward pass may change
  // (models' buffers), GPU tensors and the small state are copied during the call; the CPU
  // parameters and optimizer states by the thread, and the next step() of a prepared optimizer
  // waits for that copy: until then, change the parameters only through it (or call
  // wait_for_checkpoint() first). The next save_state, load_state, wait_for_checkpoint or
  // end_training waits for the whole save, and reports its failure. Costs a copy of the models'
  // parameters and optimizer states in memory, kept between saves (free_memory() releases it).
  bool async = false;
};

// Tracker names as HF's log_with takes them: one string ("all", "tensorboard,jsonl") or a list
// ({"tensorboard", "jsonl"}); empty means unset. Not an optional: std::optional of a list cannot
// be initialized from a braced list of names.
struct TrackerNames : std::vector<std::string> {
  TrackerNames() = default;
  TrackerNames(const char* names) : std::vector<std::string>{std::string(names)} {}
  TrackerNames(std::string names) : std::vector<std::string>{std::move(names)} {}
  TrackerNames(std::initializer_list<std::string> names) : std::vector<std::string>(names) {}
  TrackerNames(std::vector<std::string> names) : std::vector<std::string>(std::move(names)) {}
};

class Accelerator;

// HF's get_tracker(name): one of the run's experiment trackers ("tensorboard", "jsonl", "csv").
struct Tracker {
  // A record in this tracker alone, as Accelerator::log writes one in all of them (main process
  // only; a no-op elsewhere).
  void log(const std::map<std::string, double>& values, std::optional<int64_t> step = {});
  // The file it writes, to add what log() cannot (main process, once the trackers are open:
  // after init_trackers and the start of training or the first log()); empty elsewhere.
  std::filesystem::path file() const;
  const std::string& name() const { return name_; }

 private:
  friend class Accelerator;
  Tracker(Accelerator* acc, std::string name) : acc_(acc), name_(std::move(name)) {}
  Accelerator* acc_;
  std::string name_;
};

struct AcceleratorOptions {
  // Unset: ACCEL_MIXED_PRECISION / ACCELERATE_MIXED_PRECISION, else "no".
  std::optional<std::string> mixed_precision{};
  // Unset: ACCEL_GRADIENT_ACCUMULATION_STEPS / ACCELERATE_GRADIENT_ACCUMULATION_STEPS, else 1.
  std::optional<int> gradient_accumulation_steps{};
  // Unset: ACCEL_USE_CPU / ACCELERATE_USE_CPU, else false.
  std::optional<bool> cpu{};
  // Unset: ACCEL_COLLECTIVE_TIMEOUT, else 30 min. Applies to every collective and the store.
  std::optional<std::chrono::milliseconds> collective_timeout{};
  bool device_placement = true;      // prepare() moves models and batches to device()
  bool split_batches = false;        // a loader's batch_size is global and split between processes
  bool even_batches = true;          // pad the last round so every rank gets as many full batches
  bool sync_with_dataloader = true;  // the end of a loader always ends an accumulation window
  bool sync_each_batch = false;      // all-reduce on every micro-step even when accumulating
  bool step_scheduler_with_optimizer = true;
  std::size_t bucket_cap_bytes = 25u << 20;  // gradient all-reduce bucket size (DDP's 25 MB)
  // Loss scaling (HF's GradScalerKwargs). fp16 always scales, with these options or the
  // defaults; in other modes a scaler is used only when this is set with enabled = true.
  std::optional<GradScalerOptions> grad_scaler{};
  ProjectConfiguration project{};
  // Experiment trackers (docs/tracking.md): "tensorboard", "jsonl", "csv" or "all"; several as
  // items or separated by commas ("none": none). Empty: ACCEL_LOG_WITH (accel-launch --log-with),
  // else none.
  TrackerNames log_with{};
  // A progress display of each prepared loader's passes on the main process (a bar on a
  // terminal, a line every 30 s otherwise) with the values last given to log(). Unset:
  // ACCEL_PROGRESS (on or off), else on.
  std::optional<bool> progress_bar{};
  // With mixed precision, a prepared model's m(x) runs its forward under autocast and returns
  // float32 outputs, as HF's prepared model(x) (accel/prepared_model.h); nothing else does.
  // false: only acc.autocast() scopes autocast.
  bool autocast_forward = true;
  // The prepared optimizer steps torch::optim::Adam, AdamW and SGD on CPU float/double parameters
  // in one pass over each parameter's memory instead of libtorch's one pass per operation: the
  // same update rule, options and state (state_dict and checkpoints are unchanged), and the same
  // bits (each operation rounded as ATen rounds it). false: libtorch's own step().
  bool fused_optimizer = true;
  // ZeRO stage 1 (docs/runtime.md#zero-stage-1): 1 shards each prepared optimizer's state (Adam,
  // AdamW or SGD on CPU float/double parameters) across the processes; each updates its slice of
  // the parameters, then they are all-gathered. The results are the unsharded run's, bitwise.
  // Unset: ACCEL_ZERO_STAGE (accel-launch --zero-stage), else 0.
  std::optional<int> zero_stage{};
};

namespace detail {
// A prepared optimizer's and scheduler's shared state (runtime/accelerator_impl.h).
struct OptimizerSlot;
struct SchedulerSlot;
}  // namespace detail

// An optimizer whose step()/zero_grad() act only on gradient-synchronizing steps, through the
// loss scaler when there is one (a step with inf/NaN gradients is skipped and the scale backs off).
class PreparedOptimizer {
 public:
  void step();
  // As the linked libtorch's own zero_grad(), and PyTorch's optimizer.zero_grad() of the same
  // release: gradients zeroed in place in 1.13 (Debian's libtorch), set to none from 2.0 on.
  void zero_grad();
  // set_to_none true: every gradient becomes undefined, so a parameter that gets none before the
  // next step() is not stepped (AdamW then leaves it and its moments as they are); false: zeroed
  // in place, kept defined. Both do nothing on an accumulation micro-step, as step() does.
  void zero_grad(bool set_to_none);
  torch::optim::Optimizer& inner() const;
  torch::optim::Optimizer* operator->() const { return &inner(); }
  const std::shared_ptr<torch::optim::Optimizer>& shared() const;
  // True when the last step() did nothing: an accumulation micro-step, or inf/NaN gradients.
  bool step_was_skipped() const;

 private:
  friend class Accelerator;
  PreparedOptimizer(std::shared_ptr<detail::OptimizerSlot> slot,
                    std::shared_ptr<GradientState> state, std::shared_ptr<GradScaler> scaler)
      : slot_(std::move(slot)), state_(std::move(state)), loss_scaler_(std::move(scaler)) {}
  std::shared_ptr<detail::OptimizerSlot> slot_;
  std::shared_ptr<GradientState> state_;
  std::shared_ptr<GradScaler> loss_scaler_;
};

// A learning-rate scheduler stepped as HF Accelerate steps it: only on synchronizing steps, and
// num_processes times per step unless batches are split (each step saw num_processes batches).
// It does not step when the optimizer step was skipped for inf/NaN gradients.
class PreparedScheduler {
 public:
  void step();
  torch::optim::LRScheduler& inner() const;

 private:
  friend class Accelerator;
  PreparedScheduler(std::shared_ptr<detail::SchedulerSlot> slot,
                    std::shared_ptr<GradientState> state, int steps_per_call,
                    bool step_with_optimizer)
      : slot_(std::move(slot)),
        state_(std::move(state)),
        steps_per_call_(steps_per_call),
        step_with_optimizer_(step_with_optimizer) {}
  std::shared_ptr<detail::SchedulerSlot> slot_;
  std::shared_ptr<GradientState> state_;
  int steps_per_call_;
  bool step_with_optimizer_;
};

class Accelerator;

// RAII: holds gradient sync off (no_sync) or decided by the accumulation window (accumulate) for
// some models, and restores it when it goes out of scope.
class [[nodiscard]] SyncScope {
 public:
  SyncScope(std::vector<std::shared_ptr<GradSync>> syncs, bool require_sync);
  ~SyncScope();
  SyncScope(const SyncScope&) = delete;
  SyncScope& operator=(const SyncScope&) = delete;

 private:
  std::vector<std::shared_ptr<GradSync>> syncs_;
  std::vector<bool> previous_;
};

// RAII: the main (or local main) process runs the scope first, the others after it.
class [[nodiscard]] ProcessOrder {
 public:
  ProcessOrder(Accelerator& acc, bool first);
  ~ProcessOrder() noexcept(false);
  ProcessOrder(const ProcessOrder&) = delete;
  ProcessOrder& operator=(const ProcessOrder&) = delete;

 private:
  Accelerator& acc_;
  bool first_;
  int uncaught_;
};

namespace detail {
template <class T>
struct SharedModule : std::false_type {};
template <class M>
struct SharedModule<std::shared_ptr<M>>
    : std::bool_constant<std::is_base_of_v<torch::nn::Module, M>> {};
template <class T>
struct SharedOptimizer : std::false_type {};
template <class O>
struct SharedOptimizer<std::shared_ptr<O>>
    : std::bool_constant<std::is_base_of_v<torch::optim::Optimizer, O>> {};
template <class T>
struct SharedScheduler : std::false_type {};
template <class S>
struct SharedScheduler<std::shared_ptr<S>>
    : std::bool_constant<std::is_base_of_v<torch::optim::LRScheduler, S>> {};
template <class T>
struct IsPreparedModel : std::false_type {};
template <class M>
struct IsPreparedModel<PreparedModel<M>> : std::true_type {};
template <class T>
concept ModuleHolderType = requires {
  typename T::ContainedType;
}
&&std::is_base_of_v<torch::nn::ModuleHolder<typename T::ContainedType>, T>;
template <class T>
inline constexpr bool kAlwaysFalse = false;

// The nested forms the collectives take (HF's recursively_apply): a tensor, a Batch, or a
// std::map<std::string, T> / std::vector<T> of them, to any depth.
template <class T>
struct IsNested : std::bool_constant<std::is_same_v<T, torch::Tensor> || std::is_same_v<T, Batch>> {
};
template <class T>
struct IsNested<std::map<std::string, T>> : IsNested<T> {};
template <class T>
struct IsNested<std::vector<T>> : IsNested<T> {};
template <class T>
concept NestedTensors = IsNested<T>::value && !std::is_same_v<T, torch::Tensor>;

// `value` with f applied to each tensor, in a fixed order every rank shares (map keys sorted,
// vectors by index, a Batch's input, target, then fields by name): collectives line up.
template <class T, class F>
T apply_nested(const T& value, F&& f) {
  if constexpr (std::is_same_v<T, torch::Tensor>) {
    return value.defined() ? f(value) : value;
  } else if constexpr (std::is_same_v<T, Batch>) {
    Batch out;
    out.input = apply_nested(value.input, f);
    out.target = apply_nested(value.target, f);
    for (const auto& [name, t] : value.fields) out.fields[name] = apply_nested(t, f);
    return out;
  } else if constexpr (requires { typename T::key_type; }) {
    T out;
    for (const auto& [key, v] : value) out.emplace(key, apply_nested(v, f));
    return out;
  } else {
    T out;
    out.reserve(value.size());
    for (const auto& v : value) out.push_back(apply_nested(v, f));
    return out;
  }
}
}  // namespace detail

class Accelerator {
 public:
  explicit Accelerator(AcceleratorOptions options = {});
  ~Accelerator();
  Accelerator(const Accelerator&) = delete;
  Accelerator& operator=(const Accelerator&) = delete;

  // --- who am I ----------------------------------------------------------------------------
  torch::Device device() const { return state_->device(); }
  int process_index() const { return state_->process_index(); }
  int local_process_index() const { return state_->local_process_index(); }
  int num_processes() const { return state_->num_processes(); }
  bool is_main_process() const { return state_->is_main_process(); }
  bool is_local_main_process() const { return state_->is_local_main_process(); }
  bool is_last_process() const { return state_->is_last_process(); }
  bool use_distributed() const { return state_->use_distributed(); }
  DistributedType distributed_type() const { return state_->distributed_type(); }
  const std::string& mixed_precision() const;
  const AcceleratorOptions& options() const { return options_; }
  State& state() { return *state_; }
  GradientState& gradient_state() { return *gradient_state_; }

  // --- prepare -----------------------------------------------------------------------------
  // Models (std::shared_ptr<M> or a module holder such as torch::nn::Linear), optimizers
  // (std::shared_ptr<torch::optim::X>), DataLoaders and LR schedulers, in any order; returns them
  // prepared, in the same order (one object: that object; several: a tuple for structured
  // bindings).
  template <class... Ts>
  auto prepare(Ts&&... objects) {
    static_assert(sizeof...(Ts) > 0, "accel::Accelerator::prepare needs at least one object");
    if constexpr (sizeof...(Ts) == 1)
      return prepare_one(std::forward<Ts>(objects)...);
    else
      return std::tuple{prepare_one(std::forward<Ts>(objects))...};
  }
  // A model comes back as accel::PreparedModel<M> (accel/prepared_model.h): the model itself,
  // whose m(x) runs forward under mixed precision autocast with float32 outputs, as HF's.
  template <class M>
  PreparedModel<M> prepare_model(std::shared_ptr<M> model) {
    if (!model) throw UsageError("accel: prepare() got a null model");
    register_model(*model);
    return PreparedModel<M>(std::move(model), forward_precision());
  }
  PreparedOptimizer prepare_optimizer(std::shared_ptr<torch::optim::Optimizer> optimizer);
  DataLoader prepare_data_loader(const DataLoader& loader);
  PreparedScheduler prepare_scheduler(std::shared_ptr<torch::optim::LRScheduler> scheduler);

  // --- training step -----------------------------------------------------------------------
  // loss / gradient_accumulation_steps, then backward; gradients of prepared models are averaged
  // over processes by the time it returns (on synchronizing steps).
  void backward(const torch::Tensor& loss);
  // No gradient all-reduce inside the scope: gradients accumulate locally.
  template <class... Ms>
  SyncScope no_sync(const Ms&... models) {
    return SyncScope({sync_of(module_of(models))...}, false);
  }
  // Counts a micro-step; inside the scope gradients sync only at the end of the accumulation
  // window (every gradient_accumulation_steps micro-steps, and at the end of the loader).
  template <class... Ms>
  SyncScope accumulate(const Ms&... models) {
    bool sync = begin_accumulation_step();
    return SyncScope({sync_of(module_of(models))...}, sync);
  }
  bool sync_gradients() const { return gradient_state_->sync_gradients(); }
  int gradient_accumulation_steps() const { return gradient_state_->num_steps(); }
  void set_gradient_accumulation_steps(int steps);
  int64_t step() const { return gradient_state_->step(); }
  // Optimizer steps taken so far on synchronizing steps (the first prepared optimizer's count,
  // overflow-skipped ones included); restored by load_state.
  int64_t completed_steps() const;

  // --- mixed precision ---------------------------------------------------------------------
  // RAII: runs the scope's forward pass in mixed_precision() (a no-op scope for "no").
  AutocastGuard autocast() const;
  // Divides every prepared optimizer's gradients by the loss scale (no-op without a scaler, on a
  // non-synchronizing step, or when already done this step). clip_grad_* call it first.
  void unscale_gradients();
  // True when the last step of a prepared optimizer was skipped for inf/NaN gradients.
  bool optimizer_step_was_skipped() const;
  // The loss scaler (fp16, or AcceleratorOptions::grad_scaler); null without one.
  GradScaler* scaler() const;

  // --- checkpoints (docs/checkpointing.md) ---------------------------------------------------
  // Every rank calls it. Writes the prepared models (safetensors), optimizers, schedulers, the
  // loss scaler, registered objects, every rank's RNG state and every prepared loader's position
  // to `dir` (or, empty, project_dir/checkpoints/checkpoint_<iteration>) atomically: a crash at
  // any point leaves the previous checkpoint intact and nothing load_state would accept.
  // Returns the folder.
  std::filesystem::path save_state(const std::filesystem::path& dir = {});
  std::filesystem::path save_state(const std::filesystem::path& dir,
                                   const SaveStateOptions& options);
  // Every rank calls it. Waits until a background save (SaveStateOptions::async) is on disk;
  // CheckpointError on every rank when it failed (the previous checkpoint is then intact).
  // Returns at once when none is in flight.
  void wait_for_checkpoint();
  // Every rank calls it, after prepare(). Restores what save_state wrote, from `dir` or (empty)
  // the newest complete checkpoint under project_dir/checkpoints. CheckpointError, naming the
  // file and the problem, for a missing, truncated, corrupt or foreign checkpoint, or one that
  // does not match the prepared objects. Returns the folder loaded.
  std::filesystem::path load_state(const std::filesystem::path& dir = {});
  // The newest complete checkpoint under project_dir/checkpoints; empty when there is none.
  std::filesystem::path latest_checkpoint() const;
  // Saves `object` with every checkpoint. It needs either save(torch::serialize::OutputArchive&)
  // const and load(torch::serialize::InputArchive&) (modules, optimizers), or
  // std::string state_dict() const and void load_state_dict(const std::string&).
  template <class T>
  void register_for_checkpointing(std::shared_ptr<T> object);
  // HF's save_model: the model's parameters and buffers as safetensors in `dir`, sharded by
  // max_shard_size with model.safetensors.index.json. Only the main process writes; call it on
  // every process or on the main one alone (`if (acc.is_main_process())`): it is not a
  // collective. Read it back with accel::load_model (accel/model_io.h) after
  // wait_for_everyone(). CheckpointError, on the main process, when it cannot be written.
  void save_model(const torch::nn::Module& model, const std::filesystem::path& dir,
                  const SaveModelOptions& options = {});
  template <class M>
  void save_model(const std::shared_ptr<M>& model, const std::filesystem::path& dir,
                  const SaveModelOptions& options = {}) {
    save_model(*model, dir, options);
  }
  template <class M>
  void save_model(const PreparedModel<M>& model, const std::filesystem::path& dir,
                  const SaveModelOptions& options = {}) {
    save_model(*model, dir, options);
  }
  template <class C>
  void save_model(const torch::nn::ModuleHolder<C>& model, const std::filesystem::path& dir,
                  const SaveModelOptions& options = {}) {
    save_model(*model, dir, options);
  }
  // HF's get_state_dict: the model's parameters then buffers, by qualified name (detached; they
  // share storage with the model), as save_model writes them.
  std::vector<std::pair<std::string, torch::Tensor>> get_state_dict(
      const torch::nn::Module& model) const;
  template <class M>
  std::vector<std::pair<std::string, torch::Tensor>> get_state_dict(
      const std::shared_ptr<M>& model) const {
    return get_state_dict(*model);
  }
  template <class M>
  std::vector<std::pair<std::string, torch::Tensor>> get_state_dict(
      const PreparedModel<M>& model) const {
    return get_state_dict(*model);
  }
  template <class C>
  std::vector<std::pair<std::string, torch::Tensor>> get_state_dict(
      const torch::nn::ModuleHolder<C>& model) const {
    return get_state_dict(*model);
  }
  // HF's register_save_state_pre_hook / register_load_state_pre_hook: `hook(models, dir)` runs
  // on every process at the start of each save_state / load_state (automatic resume included),
  // before anything is written or read, with the prepared models in prepare order. Hooks run in
  // registration order; one that throws stops the save or load. remove() on the returned handle
  // unregisters it.
  using StateHook = std::function<void(const std::vector<torch::nn::Module*>& models,
                                       const std::filesystem::path& dir)>;
  struct HookHandle {
    std::function<void()> remove;
  };
  HookHandle register_save_state_pre_hook(StateHook hook);
  HookHandle register_load_state_pre_hook(StateHook hook);
  // A loader that skips the first `n` batches of its first pass (resuming by hand).
  DataLoader skip_first_batches(const DataLoader& loader, std::size_t n) const {
    return loader.skip_first_batches(n);
  }
  const ProjectConfiguration& project_configuration() const;
  // HF's project_dir and logging_dir: the folders in effect (set in code, else the launcher's);
  // empty when there is none.
  std::filesystem::path project_dir() const;
  std::filesystem::path logging_dir() const;
  // HF's save(obj, f): torch::save of `value` (a tensor, tensors, a module, an optimizer, a
  // prepared model) to `path`, on the main process only (not a collective). Written to a
  // temporary name beside `path`, then renamed over it, so a reader never sees half a file.
  // CheckpointError naming the file when it cannot be written.
  template <class T>
  void save(const T& value, const std::filesystem::path& path) {
    if (!is_main_process()) return;
    save_file(path, [&](const std::string& temp) {
      if constexpr (detail::is_prepared_model_v<T>) {
        torch::save(value.ptr(), temp);
      } else {
        torch::save(value, temp);
      }
    });
  }
  // torch::load of `path` into `value`, on the process that calls it. CheckpointError naming
  // the file when it is missing or does not hold a `value`.
  template <class T>
  void load(T& value, const std::filesystem::path& path) {
    load_file(path, [&](const std::string& file) {
      if constexpr (detail::is_prepared_model_v<T>) {
        auto model = value.ptr();
        torch::load(model, file);
      } else {
        torch::load(value, file);
      }
    });
  }

  // Global gradient norm of `parameters` clipped to max_norm; returns the norm before clipping.
  double clip_grad_norm_(const std::vector<torch::Tensor>& parameters, double max_norm,
                         double norm_type = 2.0);
  template <class M>
  double clip_grad_norm_(const M& model, double max_norm, double norm_type = 2.0) {
    return clip_grad_norm_(module_of(model)->parameters(), max_norm, norm_type);
  }
  void clip_grad_value_(const std::vector<torch::Tensor>& parameters, double clip_value);
  template <class M>
  void clip_grad_value_(const M& model, double clip_value) {
    clip_grad_value_(module_of(model)->parameters(), clip_value);
  }

  // --- experiment tracking (docs/tracking.md) ----------------------------------------------
  using ConfigValue = std::variant<std::string, double, int64_t, bool>;
  // HF's init_trackers: starts the run `project_name` of the log_with trackers, in
  // logging_dir/project_name, with `config` (hyperparameters) written to its config.json.
  // Call it on every process; only the main process writes. A no-op without trackers.
  // ConfigError when there is no folder to write to.
  void init_trackers(const std::string& project_name,
                     const std::map<std::string, ConfigValue>& config = {});
  // HF's log: one record of `values` at `step` (unset: completed_steps()) in every tracker, on
  // disk when it returns (a killed run keeps it). The main process writes; elsewhere, and
  // without trackers, a no-op. A run resumed from a checkpoint first cuts the files back to what
  // they held at that checkpoint, so no step appears twice.
  void log(const std::map<std::string, double>& values, std::optional<int64_t> step = {});
  // HF's get_tracker: the tracker `name` of log_with. UsageError naming the trackers that are on
  // when it is not one of them.
  Tracker get_tracker(const std::string& name);
  // HF's end_training: waits for a background save (the main process throws CheckpointError if
  // it failed; not a collective) and closes the trackers' files (the destructor does both).
  void end_training();
  // logging_dir/project_name after init_trackers with trackers on; empty otherwise.
  std::filesystem::path tracker_dir() const;

  // --- collectives (every rank must call them, in the same order) --------------------------
  // Concatenates every rank's tensor along dim 0 (same shape on every rank; ACCEL_DEBUG checks).
  torch::Tensor gather(const torch::Tensor& tensor);
  // gather() for evaluation: sizes may differ between ranks, and the samples the loader
  // duplicated to even out the last round are dropped, so each sample is counted once.
  torch::Tensor gather_for_metrics(const torch::Tensor& tensor);
  torch::Tensor reduce(const torch::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  // Rank `from`'s tensor on every rank (others pass a tensor of the same shape and dtype).
  torch::Tensor broadcast(const torch::Tensor& tensor, int from = 0);
  // Pads `tensor` along `dim` to the largest size any rank has.
  torch::Tensor pad_across_processes(const torch::Tensor& tensor, int64_t dim = 0,
                                     double pad_index = 0, bool pad_first = false);
  // The same on nested structures: each tensor of a Batch, or of a std::map<std::string, T> /
  // std::vector<T> of tensors (to any depth), in a fixed order; the result has the same shape.
  template <detail::NestedTensors T>
  T gather(const T& value) {
    return detail::apply_nested(value, [this](const torch::Tensor& t) { return gather(t); });
  }
  template <detail::NestedTensors T>
  T gather_for_metrics(const T& value) {
    return detail::apply_nested(value,
                                [this](const torch::Tensor& t) { return gather_for_metrics(t); });
  }
  template <detail::NestedTensors T>
  T reduce(const T& value, ReduceOp op = ReduceOp::kSum) {
    return detail::apply_nested(value,
                                [this, op](const torch::Tensor& t) { return reduce(t, op); });
  }
  template <detail::NestedTensors T>
  T broadcast(const T& value, int from = 0) {
    return detail::apply_nested(
        value, [this, from](const torch::Tensor& t) { return broadcast(t, from); });
  }
  template <detail::NestedTensors T>
  T pad_across_processes(const T& value, int64_t dim = 0, double pad_index = 0,
                         bool pad_first = false) {
    return detail::apply_nested(value, [&](const torch::Tensor& t) {
      return pad_across_processes(t, dim, pad_index, pad_first);
    });
  }
  std::vector<std::string> gather_object(const std::string& object);
  std::string broadcast_object(const std::string& object, int from = 0);
  void wait_for_everyone();
  ProcessOrder main_process_first() { return ProcessOrder(*this, is_main_process()); }
  ProcessOrder local_main_process_first() { return ProcessOrder(*this, is_local_main_process()); }
  // Early stopping: any rank sets, every rank sees it at the next check (a collective).
  void set_trigger();
  bool check_trigger();

  // --- process control ---------------------------------------------------------------------
  template <class F>
  void on_main_process(F&& f) {
    if (is_main_process()) std::forward<F>(f)();
  }
  template <class F>
  void on_local_main_process(F&& f) {
    if (is_local_main_process()) std::forward<F>(f)();
  }
  template <class F>
  void on_last_process(F&& f) {
    if (is_last_process()) std::forward<F>(f)();
  }
  template <class F>
  void on_process(int index, F&& f) {
    if (process_index() == index) std::forward<F>(f)();
  }
  // Prints once per machine (the local main process), arguments separated by spaces.
  template <class... Args>
  void print(const Args&... args) {
    if (!is_local_main_process()) return;
    std::ostringstream out;
    int i = 0;
    ((out << (i++ ? " " : "") << args), ...);
    out << '\n';
    std::cout << out.str() << std::flush;
  }
  // This rank's contiguous share of `items` (the first len % n ranks get one more); with
  // apply_padding every rank gets as many, padded with the last item.
  template <class T>
  std::vector<T> split_between_processes(const std::vector<T>& items,
                                         bool apply_padding = false) const {
    auto [begin, end, width] = split_range(items.size());
    std::vector<T> out;
    if (begin >= items.size()) {
      if (!items.empty()) out.push_back(items.back());
    } else {
      out.assign(items.begin() + static_cast<std::ptrdiff_t>(begin),
                 items.begin() + static_cast<std::ptrdiff_t>(end));
    }
    if (apply_padding) {
      while (!out.empty() && out.size() < width) out.push_back(out.back());
    }
    return out;
  }
  torch::Tensor split_between_processes(const torch::Tensor& items,
                                        bool apply_padding = false) const;

  template <class M>
  M unwrap_model(const M& model) const {
    return model;
  }
  // HF's unwrap_model: the model without what prepare() added (its calls run without autocast).
  template <class M>
  std::shared_ptr<M> unwrap_model(const PreparedModel<M>& model) const {
    return model.ptr();
  }
  // Forgets prepared models (their gradients stop syncing) and resets the step counter.
  void free_memory();

 private:
  template <class T>
  auto prepare_one(T&& object) {
    using D = std::decay_t<T>;
    if constexpr (detail::SharedModule<D>::value)
      return prepare_model(object);
    else if constexpr (detail::ModuleHolderType<D>)
      return prepare_model(object.ptr());
    else if constexpr (detail::IsPreparedModel<D>::value)
      return prepare_model(object.ptr());
    else if constexpr (detail::SharedOptimizer<D>::value)
      return prepare_optimizer(object);
    else if constexpr (std::is_same_v<D, DataLoader>)
      return prepare_data_loader(object);
    else if constexpr (detail::SharedScheduler<D>::value)
      return prepare_scheduler(object);
    else
      static_assert(
          detail::kAlwaysFalse<D>,
          "accel::Accelerator::prepare takes std::shared_ptr<Module>, module holders, "
          "std::shared_ptr<Optimizer>, accel::DataLoader and std::shared_ptr<LRScheduler>");
  }
  template <class M>
  static const torch::nn::Module* module_of(const std::shared_ptr<M>& m) {
    return m.get();
  }
  template <class M>
  static const torch::nn::Module* module_of(const PreparedModel<M>& m) {
    return m.get();
  }
  template <class M>
  requires detail::ModuleHolderType<M>
  static const torch::nn::Module* module_of(const M& m) { return m.ptr().get(); }
  static const torch::nn::Module* module_of(const torch::nn::Module& m) { return &m; }
  // How prepared models' calls run (mixed precision), shared by all of them.
  std::shared_ptr<const ForwardPrecision> forward_precision() const;

  void register_model(torch::nn::Module& model);
  // load_state of `source`; without verify_checksums only file sizes are checked.
  std::filesystem::path load_from(const std::filesystem::path& source, bool verify_checksums);
  friend struct Tracker;
  void log_to(const std::string& only, const std::map<std::string, double>& values,
              std::optional<int64_t> step);
  void save_file(const std::filesystem::path& path,
                 const std::function<void(const std::string& temp)>& write);
  void load_file(const std::filesystem::path& path,
                 const std::function<void(const std::string& file)>& read);
  // Automatic resume, once, when training starts (ProjectConfiguration::automatic_resume);
  // then the trackers open (they wait for it to know whether to continue their files).
  // forward_done: called from backward(), after a forward pass used the current weights.
  void maybe_resume(bool forward_done = false);
  void resume_from_newest(bool forward_done);
  // Every rank alike: what automatic resume may load, newest first: the automatic checkpoints'
  // folders, and "snapshot:<step>" for an in-memory snapshot every rank's node holds.
  std::vector<std::string> resume_candidates();
  // The writer's half of a save to `target` (the main process's for a checkpoint, each node's
  // local main's for a snapshot): collects the files and the manifest, and returns what writes
  // them (at once, or on the background thread).
  std::function<void()> prepare_write(const std::filesystem::path& target, bool async,
                                      bool snapshot, std::vector<std::string> rank_blobs,
                                      std::optional<int64_t> limit, uint64_t began);
  // An in-memory snapshot of this step (ACCEL_SNAPSHOT_INTERVAL): each node's local main writes
  // the whole state into the node's ACCEL_SNAPSHOT_DIR in the background. A failure is a
  // warning that turns snapshots off, never an error.
  void save_snapshot();
  // From setup_project: snapshots on when the launcher asks (ACCEL_SNAPSHOT_INTERVAL) and gives
  // this node's folder (ACCEL_SNAPSHOT_DIR), unless automatic resume is off in code.
  void setup_snapshots(bool resume_off_in_code);
  // Every rank (a collective): agrees on a snapshot's outcome, `error` being this rank's part
  // ("" = written, or not its node's writer); a failure anywhere turns snapshots off with a
  // warning.
  void snapshot_outcome(const std::string& error);
  void open_trackers();
  void on_loader_progress(std::size_t loader, const PassProgress& progress);
  // UsageError when a prepared optimizer was stepped through its original handle.
  void check_optimizers_not_stepped_elsewhere() const;
  // Once, on the main process: mixed precision is on, yet no forward ran under autocast.
  void warn_if_forward_ran_without_autocast();
  bool automatic_resume_on() const;
  // UsageError when `what` is prepared or registered after maybe_resume() ran with automatic
  // resume on: a restarted run would not restore it.
  void check_not_started(const char* what) const;
  // Runs before a prepared loader hands out a batch: the periodic automatic save, and the stop
  // on SIGUSR1.
  void on_step_boundary();
  [[noreturn]] void stop_after_checkpoint(int signal);
  void setup_mixed_precision(const std::string& which);
  void setup_project();
  std::shared_ptr<GradSync> sync_of(const torch::nn::Module* model) const;
  bool begin_accumulation_step();
  std::tuple<std::size_t, std::size_t, std::size_t> split_range(std::size_t n) const;
  // Every rank's size along dim 0 (or any one number), in rank order.
  std::vector<int64_t> all_sizes(int64_t mine);
  torch::Tensor gather_uneven(const torch::Tensor& tensor, std::vector<int64_t>* sizes = nullptr);
  void check_same_shape(const torch::Tensor& tensor, const char* op);

  void add_custom_state(std::function<std::string()> save,
                        std::function<void(const std::string&)> load);

  AcceleratorOptions options_;
  std::shared_ptr<State> state_;
  std::shared_ptr<GradientState> gradient_state_ = std::make_shared<GradientState>();
  // Everything else: prepared objects, checkpoint and tracker state (runtime/accelerator_impl.h).
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

template <class T>
void Accelerator::register_for_checkpointing(std::shared_ptr<T> object) {
  if (!object) throw UsageError("accel: register_for_checkpointing got a null object");
  std::function<std::string()> save;
  std::function<void(const std::string&)> load;
  if constexpr (requires(const T& t, torch::serialize::OutputArchive& a, T& u,
                         torch::serialize::InputArchive& b) {
                  t.save(a);
                  u.load(b);
                }) {
    save = [object] {
      torch::serialize::OutputArchive archive;
      object->save(archive);
      std::ostringstream out;
      archive.save_to(out);
      return out.str();
    };
    load = [object](const std::string& bytes) {
      torch::serialize::InputArchive archive;
      archive.load_from(bytes.data(), bytes.size());
      object->load(archive);
    };
  } else if constexpr (requires(const T& t, T& u, const std::string& s) {
                         { t.state_dict() } -> std::convertible_to<std::string>;
                         u.load_state_dict(s);
                       }) {
    save = [object] { return std::string(object->state_dict()); };
    load = [object](const std::string& bytes) { object->load_state_dict(bytes); };
  } else {
    static_assert(
        detail::kAlwaysFalse<T>,
        "register_for_checkpointing needs save(OutputArchive&) const + load(InputArchive&), or "
        "std::string state_dict() const + load_state_dict(const std::string&)");
  }
  add_custom_state(std::move(save), std::move(load));
}

}  // namespace accel

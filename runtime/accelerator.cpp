// Accelerator: prepare, backward, gradient sync scopes, optimizer and scheduler gating.
#include "accel/accelerator.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <exception>
#include <mutex>
#include <unordered_set>

#include "contract/worker_contract.h"
#include "runtime/accelerator_impl.h"
#include "runtime/autocast_compat.h"
#include "runtime/blas_kernels.h"
#include "runtime/comm.h"
#include "runtime/cpu_precision.h"
#include "runtime/env.h"
#include "runtime/fused_optimizer.h"
#include "runtime/grad_sync.h"
#include "runtime/heap_tuning.h"
#include "runtime/large_blocks.h"
#include "runtime/log.h"
#include "runtime/optimizer_steps.h"
#include "runtime/progress.h"
#include "runtime/tracking.h"

namespace accel {

// --- PreparedOptimizer / PreparedScheduler ---------------------------------------------------

int64_t detail::own_step_count(torch::optim::Optimizer& optimizer) {
  namespace o = torch::optim;
  if (!dynamic_cast<o::Adam*>(&optimizer) && !dynamic_cast<o::AdamW*>(&optimizer) &&
      !dynamic_cast<o::Adagrad*>(&optimizer) && !dynamic_cast<o::RMSprop*>(&optimizer)) {
    return -1;
  }
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      auto it = optimizer.state().find(detail::state_key(p));
      if (it == optimizer.state().end()) continue;
      auto* state = it->second.get();
      if (auto* s = dynamic_cast<o::AdamParamState*>(state)) return s->step();
      if (auto* s = dynamic_cast<o::AdamWParamState*>(state)) return s->step();
      if (auto* s = dynamic_cast<o::AdagradParamState*>(state)) return s->step();
      if (auto* s = dynamic_cast<o::RMSpropParamState*>(state)) return s->step();
    }
  }
  return 0;
}

namespace {

// Every prepared model's parameters (their TensorImpls): the ones whose gradients are averaged.
std::unordered_set<const void*> averaged_parameters(const std::vector<torch::nn::Module*>& models) {
  std::unordered_set<const void*> known;
  for (auto* model : models)
    for (auto& p : model->parameters()) known.insert(p.unsafeGetTensorImpl());
  return known;
}

// Why: the original handle steps on accumulation micro-steps and past the loss scaler's
// inf/NaN check; nothing else would say so, and the run would just train differently.
void check_own_steps(const detail::OptimizerSlot& slot, const std::string& which) {
  if (slot.own_steps < 0) return;
  int64_t now = detail::own_step_count(*slot.optimizer);
  if (now <= slot.own_steps) return;
  throw UsageError(
      "accel: " + which + " (" + c10::demangle(typeid(*slot.optimizer).name()) +
      ") was stepped through its original handle: it has taken " + std::to_string(now) +
      " steps, " + std::to_string(now - slot.own_steps) +
      " more than went through the prepared optimizer. Call step() and zero_grad() on the object "
      "prepare() returned (auto [m, o, dl] = acc.prepare(model, opt, loader); o.step()): the "
      "original also steps on accumulation micro-steps and past the loss scaler's inf/NaN check");
}

}  // namespace

void PreparedOptimizer::step() {
  auto& slot = *slot_;
  check_own_steps(slot, "the optimizer");
  slot.overflow = false;
  slot.skipped = !state_->sync_gradients();
  if (slot.skipped) return;
  // Why: a background save may still be copying the weights and this optimizer's state (usually
  // done during the forward and backward since the save).
  if (slot.snapshot) slot.snapshot->wait();
  if (slot.check_membership) {
    slot.check_membership();
    slot.check_membership = nullptr;
  }
  ++slot.steps;
  // Why: one pass over each parameter's memory instead of libtorch's one per operation.
  auto run_step = [&slot] {
    if (slot.zero)
      slot.zero->step();
    else if (slot.split && slot.split->step())
      return;
    else if (!slot.fused || !detail::fused_step(*slot.optimizer))
      slot.optimizer->step();
  };
  if (loss_scaler_ && loss_scaler_->is_enabled()) {
    slot.overflow = !loss_scaler_->step(*slot.optimizer, run_step);
    loss_scaler_->update();
    slot.skipped = slot.overflow;
  } else {
    run_step();
  }
  // Why: autocast keeps low-precision copies of the weights until its outermost scope ends, and
  // a program's own acc.autocast() scope may span the step (a GAN step): its next forward would
  // run on copies of the weights this step just changed.
  at::autocast::clear_cache();
  if (slot.own_steps >= 0 && !slot.overflow)
    slot.own_steps = detail::own_step_count(*slot.optimizer);
  state_->set_optimizer_step_overflowed(slot.overflow);
  progress::step_done(static_cast<std::uint64_t>(slot.steps));
}

void PreparedOptimizer::zero_grad() {
  if (state_->sync_gradients()) slot_->optimizer->zero_grad();
}

namespace {
// libtorch's in-place zeroing of the gradients: zero_grad(false) from 2.0 on (true, the default,
// sets them to none), zero_grad() in 1.13 (always in place). A template so that only the branch
// for this libtorch is compiled.
template <class Optimizer>
void zero_grads_in_place(Optimizer& optimizer) {
  if constexpr (requires { optimizer.zero_grad(false); })
    optimizer.zero_grad(false);
  else
    optimizer.zero_grad();
}
}  // namespace

void PreparedOptimizer::zero_grad(bool set_to_none) {
  if (!state_->sync_gradients()) return;
  auto& optimizer = *slot_->optimizer;
  if (!set_to_none) return zero_grads_in_place(optimizer);
  // Why nothing else: a prepared model's gradient sync copies a new gradient into its bucket and
  // makes .grad a view of it again after the all-reduce.
  for (auto& group : optimizer.param_groups())
    for (auto& p : group.params()) p.mutable_grad() = torch::Tensor();
}

void PreparedScheduler::step() {
  if (!step_with_optimizer_) {
    slot_->scheduler->step();
    ++slot_->steps;
    return;
  }
  if (!state_->sync_gradients() || state_->optimizer_step_overflowed()) return;
  for (int i = 0; i < steps_per_call_; ++i) {
    slot_->scheduler->step();
    ++slot_->steps;
  }
}

torch::optim::Optimizer& PreparedOptimizer::inner() const { return *slot_->optimizer; }
const std::shared_ptr<torch::optim::Optimizer>& PreparedOptimizer::shared() const {
  return slot_->optimizer;
}
bool PreparedOptimizer::step_was_skipped() const { return slot_->skipped; }
torch::optim::LRScheduler& PreparedScheduler::inner() const { return *slot_->scheduler; }

// --- scopes ------------------------------------------------------------------------------------

SyncScope::SyncScope(std::vector<std::shared_ptr<GradSync>> syncs, bool require_sync)
    : syncs_(std::move(syncs)) {
  for (auto& s : syncs_) {
    previous_.push_back(s ? s->require_sync() : true);
    if (s) s->set_require_sync(require_sync);
  }
}

SyncScope::~SyncScope() {
  for (std::size_t i = 0; i < syncs_.size(); ++i) {
    if (syncs_[i]) syncs_[i]->set_require_sync(previous_[i]);
  }
}

ProcessOrder::ProcessOrder(Accelerator& acc, bool first)
    : acc_(acc), first_(first), uncaught_(std::uncaught_exceptions()) {
  if (!first_) acc_.wait_for_everyone();
}

ProcessOrder::~ProcessOrder() noexcept(false) {
  // Why: a barrier while unwinding would turn one error into a hang or a terminate; the other
  // ranks get a collective timeout that names the barrier instead.
  if (first_ && std::uncaught_exceptions() == uncaught_) acc_.wait_for_everyone();
}

// --- Accelerator ---------------------------------------------------------------------------------

namespace {

// RAII: autocast off on every device for the scope, restored after.
struct AutocastPause {
  bool cpu = autocast_compat::is_enabled(c10::DeviceType::CPU);
  bool cuda = autocast_compat::is_enabled(c10::DeviceType::CUDA);
  AutocastPause() {
    autocast_compat::set_enabled(c10::DeviceType::CPU, false);
    autocast_compat::set_enabled(c10::DeviceType::CUDA, false);
  }
  ~AutocastPause() {
    autocast_compat::set_enabled(c10::DeviceType::CPU, cpu);
    autocast_compat::set_enabled(c10::DeviceType::CUDA, cuda);
  }
  AutocastPause(const AutocastPause&) = delete;
  AutocastPause& operator=(const AutocastPause&) = delete;
};

}  // namespace

Accelerator::Accelerator(AcceleratorOptions options)
    : options_(std::move(options)), impl_(std::make_unique<Impl>()) {
  impl_->self_ = std::make_shared<Accelerator*>(this);
  // Why first, before the process group: its threads allocate and free too, and a free racing
  // the change could set glibc's moving thresholds back over it.
  const auto& heap = heap_tuning::keep_freed_memory();
  const auto& blocks = large_blocks::keep_large_blocks();
  state_ = State::shared({options_.cpu, options_.collective_timeout});
  const env::WorkerEnv& e = env::worker_env();
  std::string which = "option mixed_precision";
  if (options_.mixed_precision) {
    impl_->mixed_precision_ = *options_.mixed_precision;
  } else if (e.mixed_precision) {
    impl_->mixed_precision_ = *e.mixed_precision;
    which = e.mixed_precision_variable;
  }
  setup_mixed_precision(which);
  {
    // Why debug: nothing is left for the user to do; said once, by the main process.
    static std::once_flag said_heap;
    if (is_main_process()) {
      std::call_once(said_heap, [&] {
        log::debug(heap_tuning::describe(heap));
        log::debug(large_blocks::describe(blocks));
      });
    }
  }
  if (device().is_cpu()) {
    // Why first, before any training: the switch must not race a BLAS call, and the user's
    // model then runs on the kernels it switched to. Why debug: nothing is left for the user to do
    // (accel env shows the kernels too); said once, by the main process.
    const auto& kernels = blas_kernels::upgrade_if_behind();
    static std::once_flag said_kernels;
    if (is_main_process() && !kernels.tried.empty()) {
      std::call_once(said_kernels, [&] {
        log::debug(blas_kernels::describe(kernels, cpu_precision::cpu_model()));
      });
    }
  }
  if (impl_->mixed_precision_ == "bf16" && device().is_cpu() && is_main_process()) {
    // Why once per process, by the main process: the ranks of a job share one machine model,
    // and the user needs one line, not one per rank or per Accelerator.
    static const std::string line =
        cpu_precision::slow_bf16_line(cpu_precision::measure_step(), cpu_precision::cpu_model(),
                                      cpu_precision::bf16_instructions());
    static std::once_flag said;
    if (!line.empty()) std::call_once(said, [] { log::warning(line); });
  }
  impl_->forward_precision_->device_type = device().type();
  impl_->forward_precision_->dtype =
      impl_->mixed_precision_ == "fp16" ? torch::kHalf : torch::kBFloat16;
  impl_->forward_precision_->autocast =
      options_.autocast_forward && impl_->mixed_precision_ != "no";
  impl_->autocast_regions_at_start_ = autocast_compat::regions_entered();
  impl_->zero_stage_ = options_.zero_stage.value_or(e.zero_stage);
  if (impl_->zero_stage_ != 0 && impl_->zero_stage_ != 1) {
    throw ConfigError("accel: option zero_stage must be 0 or 1, got " +
                      std::to_string(impl_->zero_stage_));
  }
  setup_project();
  impl_->tracking_ = std::make_unique<detail::Tracking>();
  if (!options_.log_with.empty()) {
    impl_->tracking_->kinds = tracking::parse_log_with(options_.log_with, "option log_with");
  } else if (e.log_with) {
    impl_->tracking_->kinds = tracking::parse_log_with({*e.log_with}, contract::kLogWith);
  }
  if (options_.progress_bar.value_or(e.progress.value_or(true)) && is_main_process()) {
    impl_->tracking_->bar = std::make_unique<ProgressBar>(
        STDERR_FILENO, ::isatty(STDERR_FILENO) == 1, std::chrono::seconds(30));
  }
  if (!tracking::tensorboard_available() &&
      std::find(impl_->tracking_->kinds.begin(), impl_->tracking_->kinds.end(), "tensorboard") !=
          impl_->tracking_->kinds.end()) {
    throw ConfigError(
        "accel: log_with=tensorboard: this libaccel was built without protobuf, so it cannot "
        "write TensorBoard files; use jsonl or csv, or rebuild with protobuf installed");
  }
  int steps =
      options_.gradient_accumulation_steps.value_or(e.gradient_accumulation_steps.value_or(1));
  set_gradient_accumulation_steps(steps);
  gradient_state_->set_sync_with_dataloader(options_.sync_with_dataloader);
}

Accelerator::~Accelerator() {
  try {
    end_training();
  } catch (const CheckpointError& e) {
    // Why not silent: a destructor cannot throw; a program that wants the failure as an error
    // calls end_training() or wait_for_checkpoint() itself.
    log::write(env::LogLevel::kError, e.what());
  } catch (const std::exception& e) {
    log::warning(std::string("at the end of training: ") + e.what());
  }
  // Why: a resumed run whose loop starts past its end (the checkpoint's run had finished, or ran
  // with more epochs) exits 0 having trained nothing; say so rather than let it look like work.
  if (!impl_->resumed_from_.empty() && completed_steps() == impl_->resumed_at_step_ &&
      std::uncaught_exceptions() == 0 && is_main_process()) {
    log::warning("resumed from " + impl_->resumed_from_ + " at step " +
                 std::to_string(impl_->resumed_at_step_) +
                 " but took no optimizer step after it: that run had already got this far (it "
                 "had finished, or had a larger dataset or more epochs). To train from scratch, "
                 "use another checkpoint folder (accel-launch --checkpoint-dir DIR)");
  }
}

void Accelerator::setup_mixed_precision(const std::string& which) {
  if (impl_->mixed_precision_ != "no" && impl_->mixed_precision_ != "fp16" &&
      impl_->mixed_precision_ != "bf16") {
    throw ConfigError("accel: " + which + "=\"" + impl_->mixed_precision_ +
                      "\": expected no, fp16 or bf16");
  }
  if (impl_->mixed_precision_ == "fp16" && !device().is_cuda()) {
    throw ConfigError("accel: " + which + "=fp16 needs a CUDA device (this process runs on " +
                      device().str() + "); on CPU use bf16");
  }
  if (impl_->mixed_precision_ == "fp16") {
    impl_->scaler_ =
        std::make_shared<GradScaler>(options_.grad_scaler.value_or(GradScalerOptions{}));
  } else if (options_.grad_scaler && options_.grad_scaler->enabled) {
    impl_->scaler_ = std::make_shared<GradScaler>(*options_.grad_scaler);
  }
}

const std::string& Accelerator::mixed_precision() const { return impl_->mixed_precision_; }
GradScaler* Accelerator::scaler() const { return impl_->scaler_.get(); }
const ProjectConfiguration& Accelerator::project_configuration() const { return impl_->project_; }
void Accelerator::set_trigger() { impl_->trigger_ = true; }

void Accelerator::add_custom_state(std::function<std::string()> save,
                                   std::function<void(const std::string&)> load) {
  check_not_started("register_for_checkpointing()");
  impl_->custom_.push_back({std::move(save), std::move(load)});
}

AutocastGuard Accelerator::autocast() const {
  auto dtype = impl_->mixed_precision_ == "fp16" ? torch::kHalf : torch::kBFloat16;
  return AutocastGuard(device().type(), dtype, impl_->mixed_precision_ != "no");
}

void Accelerator::unscale_gradients() {
  if (!impl_->scaler_ || !sync_gradients()) return;
  // Once per step: HF calls this from every clip.
  for (auto& slot : impl_->optimizers_) {
    if (!impl_->scaler_->was_unscaled(*slot->optimizer)) impl_->scaler_->unscale_(*slot->optimizer);
  }
}

bool Accelerator::optimizer_step_was_skipped() const {
  for (auto& slot : impl_->optimizers_) {
    if (slot->overflow) return true;
  }
  return false;
}

int64_t Accelerator::completed_steps() const {
  return impl_->optimizers_.empty() ? 0 : impl_->optimizers_.front()->steps;
}

void Accelerator::set_gradient_accumulation_steps(int steps) {
  if (steps < 1) {
    throw ConfigError("accel: gradient_accumulation_steps must be at least 1, got " +
                      std::to_string(steps));
  }
  gradient_state_->set_num_steps(steps);
}

namespace {

// The model's parameters, each tensor once: libtorch's parameters() lists a tensor once per name
// (a module registered under two names, tied weights); PyTorch's lists it once.
std::vector<torch::Tensor> unique_parameters(const torch::nn::Module& model) {
  std::vector<torch::Tensor> out;
  std::unordered_set<const void*> seen;
  for (auto& p : model.parameters())
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  return out;
}

// Removes the second and later listings of a tensor from the optimizer's groups; their names,
// as "group g, parameter i" of the original lists.
std::vector<std::string> dedupe_parameters(torch::optim::Optimizer& optimizer) {
  std::vector<std::string> removed;
  std::unordered_set<const void*> seen;
  auto& groups = optimizer.param_groups();
  for (std::size_t g = 0; g < groups.size(); ++g) {
    auto& params = groups[g].params();
    std::vector<torch::Tensor> kept;
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (seen.insert(params[i].unsafeGetTensorImpl()).second)
        kept.push_back(params[i]);
      else
        removed.push_back("group " + std::to_string(g) + " parameter " + std::to_string(i));
    }
    if (kept.size() != params.size()) params = std::move(kept);
  }
  return removed;
}

}  // namespace

void Accelerator::register_model(torch::nn::Module& model) {
  if (options_.device_placement) model.to(device());
  if (!impl_->prepared_.count(&model)) {
    // Why a late model is left out of the checkpoints: automatic resume restored the objects
    // prepared before training started, and a restarted run resumes before it reaches this
    // prepare() again; a checkpoint holding it would not match that run. HF allows preparing
    // an evaluation model mid-training.
    if (impl_->training_started_ && automatic_resume_on()) {
      log::info("accel: a model prepared after training started (" +
                std::to_string(unique_parameters(model).size()) +
                " parameter tensors) is not in the automatic checkpoints: they restore the "
                "objects prepared before training, when a restarted run resumes");
    } else {
      impl_->models_.push_back(&model);
    }
  }
  impl_->prepared_[&model] = true;
  if (!use_distributed()) return;
  const std::vector<torch::Tensor> params = unique_parameters(model);
  std::vector<torch::Tensor> trainable;
  for (const auto& p : params) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  GradSyncOptions opts;
  opts.bucket_cap_bytes = options_.bucket_cap_bytes;
  opts.first_bucket_cap_bytes = std::min(opts.first_bucket_cap_bytes, options_.bucket_cap_bytes);
  auto sync = GradSync::create(state_->comm(), std::move(trainable), opts);
  sync->broadcast_parameters();
  torch::NoGradGuard no_grad;
  // The rest of rank 0's model: buffers, and (as DDP) the frozen parameters, which would otherwise
  // stay as each rank initialised them (set_seed(n, device_specific)).
  std::vector<torch::Tensor> rest = model.buffers();
  for (const auto& p : params) {
    if (!p.requires_grad()) rest.push_back(p);
  }
  for (auto& t : rest) state_->comm().broadcast(t, 0);
  impl_->syncs_[&model] = std::move(sync);
}

std::shared_ptr<GradSync> Accelerator::sync_of(const torch::nn::Module* model) const {
  if (!impl_->prepared_.count(model)) {
    throw UsageError("accel: no_sync/accumulate got a model that was not passed to prepare()");
  }
  auto it = impl_->syncs_.find(model);
  return it == impl_->syncs_.end() ? nullptr : it->second;
}

PreparedOptimizer Accelerator::prepare_optimizer(
    std::shared_ptr<torch::optim::Optimizer> optimizer) {
  if (!optimizer) throw UsageError("accel: prepare() got a null optimizer");
  check_not_started("prepare() of an optimizer");
  auto slot = std::make_shared<detail::OptimizerSlot>();
  slot->optimizer = std::move(optimizer);
  slot->snapshot = impl_->snapshot_;
  // Why: libtorch's optimizers step a tensor listed twice twice (tied weights come out of
  // parameters() twice), and ZeRO would give each listing its own slice and state; HF's
  // parameters() lists it once, so it steps once.
  auto duplicates = dedupe_parameters(*slot->optimizer);
  if (!duplicates.empty() && is_main_process()) {
    std::string names;
    for (std::size_t i = 0; i < duplicates.size() && i < 8; ++i)
      names += (i ? ", " : "") + duplicates[i];
    if (duplicates.size() > 8) names += ", ...";
    log::warning("optimizer " + std::to_string(impl_->optimizers_.size()) + " lists " +
                 std::to_string(duplicates.size()) +
                 " tensor(s) more than once (tied weights, or a module registered under two "
                 "names): " +
                 names + "; each tensor is stepped once");
  }
  slot->own_steps = detail::own_step_count(*slot->optimizer);
  slot->fused = options_.fused_optimizer;
  if (num_processes() > 1) {
    // Why agreed: a rank that shards and one that does not would call different collectives at
    // every step and hang there; each machine's launcher passes its own setting.
    auto stages = torch::tensor({impl_->zero_stage_, -impl_->zero_stage_}, torch::kInt);
    state_->comm().allreduce(stages, c10d::ReduceOp::MAX);
    if (stages[0].item<int>() != -stages[1].item<int>()) {
      throw ConfigError("accel: the processes disagree on zero_stage (ACCEL_ZERO_STAGE): some " +
                        std::string("have 0, some 1; give every machine the same setting"));
    }
  }
  if (impl_->zero_stage_ == 1 && num_processes() > 1) {
    slot->zero = std::make_unique<detail::ZeroOptimizer>(*slot->optimizer, state_);
    slot->own_steps = -1;  // Why: its state lives in the shards; the original handle goes unseen
    // Why refused: only the prepared models' gradients are averaged; a slice of any other
    // parameter would step with its owner's own gradient, and every rank would get that.
    auto* impl = impl_.get();
    auto* opt = slot->optimizer.get();
    slot->check_membership = [impl, opt] {
      const auto known = averaged_parameters(impl->models_);
      std::size_t index = 0;
      for (auto& group : opt->param_groups()) {
        for (auto& p : group.params()) {
          if (!known.count(p.unsafeGetTensorImpl())) {
            throw UsageError(
                "accel: ZeRO stage 1: parameter " + std::to_string(index) + " of the optimizer " +
                "(" + std::string(c10::toString(p.scalar_type())) + ", " +
                std::to_string(p.numel()) +
                " elements) belongs to no prepared model, so its gradient is not averaged "
                "across processes; prepare() the model that holds it, or use zero_stage = 0");
          }
          ++index;
        }
      }
    };
    log::debug("ZeRO stage 1: optimizer " + std::to_string(impl_->optimizers_.size()) + " (" +
               c10::demangle(typeid(*slot->optimizer).name()) + ") sharded; rank " +
               std::to_string(process_index()) + " holds " + slot->zero->describe_shard());
  }
  const auto& split = env::worker_env().split_optimizer_step;
  if (!slot->zero && slot->fused && num_processes() > 1 && split != "0") {
    // Why a cache: the step asks for every parameter, every step; the set changes only when
    // another model is prepared. Why `alive`: a prepared optimizer may outlive its Accelerator
    // (every rank's then alike: no parameter counts as averaged, and the step runs whole).
    auto* impl = impl_.get();
    std::weak_ptr<Accelerator*> alive = impl_->self_;
    auto known = std::make_shared<std::pair<std::size_t, std::unordered_set<const void*>>>(
        std::size_t(-1), std::unordered_set<const void*>{});
    slot->split = detail::SplitStep::create(
        *slot->optimizer, state_,
        [impl, alive, known](const torch::Tensor& p) {
          if (alive.expired()) return false;
          if (known->first != impl->models_.size()) {
            known->second = averaged_parameters(impl->models_);
            known->first = impl->models_.size();
          }
          return known->second.count(p.unsafeGetTensorImpl()) > 0;
        },
        /*any_size=*/split == "1");
  }
  impl_->optimizers_.push_back(slot);
  return PreparedOptimizer(std::move(slot), gradient_state_, impl_->scaler_);
}

DataLoader Accelerator::prepare_data_loader(const DataLoader& loader) {
  check_not_started("prepare() of a DataLoader");
  ShardOptions shard;
  shard.num_processes = static_cast<std::size_t>(num_processes());
  shard.process_index = static_cast<std::size_t>(process_index());
  shard.split_batches = options_.split_batches;
  shard.even_batches = options_.even_batches;
  shard.device = options_.device_placement ? device() : torch::Device(torch::kCPU);
  std::weak_ptr<Accelerator*> self = impl_->self_;
  LoaderHooks hooks;
  hooks.on_first_use = [self] {
    if (auto acc = self.lock()) (*acc)->maybe_resume();
  };
  hooks.on_step_boundary = [self] {
    if (auto acc = self.lock()) (*acc)->on_step_boundary();
  };
  hooks.on_progress = [self, index = impl_->loaders_.size()](const PassProgress& p) {
    if (auto acc = self.lock()) (*acc)->on_loader_progress(index, p);
  };
  auto prepared = loader.shard(shard, gradient_state_, std::move(hooks));
  impl_->loaders_.push_back(prepared);
  return prepared;
}

PreparedScheduler Accelerator::prepare_scheduler(
    std::shared_ptr<torch::optim::LRScheduler> scheduler) {
  if (!scheduler) throw UsageError("accel: prepare() got a null scheduler");
  check_not_started("prepare() of a scheduler");
  int steps = options_.split_batches ? 1 : num_processes();
  auto slot = std::make_shared<detail::SchedulerSlot>();
  slot->scheduler = std::move(scheduler);
  impl_->schedulers_.push_back(slot);
  return PreparedScheduler(std::move(slot), gradient_state_, steps,
                           options_.step_scheduler_with_optimizer);
}

bool Accelerator::begin_accumulation_step() {
  auto& gs = *gradient_state_;
  if (gs.sync_with_dataloader() && gs.end_of_dataloader()) {
    gs.set_step(0);
    gs.set_sync_gradients(true);
  } else {
    gs.set_step(gs.step() + 1);
    gs.set_sync_gradients(gs.step() % gs.num_steps() == 0);
  }
  return gs.sync_gradients() || (use_distributed() && options_.sync_each_batch);
}

void Accelerator::backward(const torch::Tensor& loss) {
  if (!loss.defined()) throw UsageError("accel: backward() got an undefined loss tensor");
  maybe_resume(/*forward_done=*/true);
  check_optimizers_not_stepped_elsewhere();
  {
    // Why: backward inside an autocast scope would recast the backward matmuls; PyTorch runs
    // backward outside autocast, with the dtypes the forward chose.
    AutocastPause pause;
    try {
      auto scaled = gradient_state_->num_steps() > 1 ? loss / gradient_state_->num_steps() : loss;
      if (impl_->scaler_) scaled = impl_->scaler_->scale(scaled);
      scaled.backward();
    } catch (...) {
      for (auto& [model, sync] : impl_->syncs_) sync->abort_round();
      throw;
    }
  }
  warn_if_forward_ran_without_autocast();
}

std::shared_ptr<const ForwardPrecision> Accelerator::forward_precision() const {
  return impl_->forward_precision_;
}

void Accelerator::warn_if_forward_ran_without_autocast() {
  // Why: m->forward(x) is the model itself and runs in float32; a program written as libtorch's
  // examples are (or for the batch-wide autocast of earlier releases) would lose mixed precision
  // without a word.
  if (impl_->warned_no_autocast_ || !impl_->forward_precision_->autocast || !is_main_process() ||
      autocast_compat::regions_entered() != impl_->autocast_regions_at_start_)
    return;
  impl_->warned_no_autocast_ = true;
  log::warning("mixed_precision is " + impl_->mixed_precision_ +
               ", but no forward pass has run under autocast: call the prepared model as m(x) "
               "(HF's model(x): forward under autocast, float32 outputs) or open auto cast = "
               "acc.autocast(); m->forward(x) is the model itself and runs in float32");
}

void Accelerator::check_optimizers_not_stepped_elsewhere() const {
  for (std::size_t i = 0; i < impl_->optimizers_.size(); ++i)
    check_own_steps(*impl_->optimizers_[i], "prepared optimizer " + std::to_string(i));
}

double Accelerator::clip_grad_norm_(const std::vector<torch::Tensor>& parameters, double max_norm,
                                    double norm_type) {
  unscale_gradients();
  return torch::nn::utils::clip_grad_norm_(parameters, max_norm, norm_type);
}

void Accelerator::clip_grad_value_(const std::vector<torch::Tensor>& parameters,
                                   double clip_value) {
  unscale_gradients();
  torch::nn::utils::clip_grad_value_(parameters, clip_value);
}

void Accelerator::free_memory() {
  // ZeRO: each optimizer gets its whole state back (a collective), so preparing it again, or
  // using it alone, continues from it. The split step needs no barrier: each of its steps
  // ends with one, after which no rank writes the shared state until every rank steps again.
  for (auto& slot : impl_->optimizers_) {
    if (slot->zero) {
      slot->zero->gather_state(/*install=*/true);
      slot->zero.reset();
    }
    // The split step: each optimizer's state gets its own memory back, so that it steps alone.
    if (slot->split) {
      slot->split->unshare();
      slot->split.reset();
    }
  }
  impl_->snapshot_->release();  // the memory a background save keeps between saves
  impl_->syncs_.clear();
  impl_->prepared_.clear();
  impl_->models_.clear();
  impl_->optimizers_.clear();
  impl_->schedulers_.clear();
  impl_->loaders_.clear();
  impl_->custom_.clear();
  impl_->training_started_ = false;
  gradient_state_->set_step(0);
  gradient_state_->set_sync_gradients(true);
}

}  // namespace accel

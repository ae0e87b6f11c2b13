// Accelerator: prepare, backward, gradient sync scopes, optimizer and scheduler gating.
#include "accel/accelerator.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <exception>

#include "contract/worker_contract.h"
#include "runtime/autocast_compat.h"
#include "runtime/comm.h"
#include "runtime/env.h"
#include "runtime/grad_sync.h"
#include "runtime/log.h"

namespace accel {

// --- PreparedOptimizer / PreparedScheduler ---------------------------------------------------

void PreparedOptimizer::step() {
  auto& slot = *slot_;
  slot.overflow = false;
  slot.skipped = !state_->sync_gradients();
  if (slot.skipped) return;
  ++slot.steps;
  if (scaler_ && scaler_->is_enabled()) {
    slot.overflow = !scaler_->step(*slot.optimizer);
    scaler_->update();
    slot.skipped = slot.overflow;
  } else {
    slot.optimizer->step();
  }
  state_->set_optimizer_step_overflowed(slot.overflow);
}

void PreparedOptimizer::zero_grad() {
  if (state_->sync_gradients()) slot_->optimizer->zero_grad();
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

Accelerator::Accelerator(AcceleratorOptions options) : options_(std::move(options)) {
  state_ = State::shared({options_.cpu, options_.collective_timeout});
  const env::WorkerEnv& e = env::worker_env();
  std::string which = "option mixed_precision";
  if (options_.mixed_precision) {
    mixed_precision_ = *options_.mixed_precision;
  } else if (e.mixed_precision) {
    mixed_precision_ = *e.mixed_precision;
    which = e.mixed_precision_variable;
  }
  setup_mixed_precision(which);
  setup_project();
  int steps =
      options_.gradient_accumulation_steps.value_or(e.gradient_accumulation_steps.value_or(1));
  set_gradient_accumulation_steps(steps);
  gradient_state_->set_sync_with_dataloader(options_.sync_with_dataloader);
}

Accelerator::~Accelerator() {
  // Why: a resumed run whose loop starts past its end (the checkpoint's run had finished, or ran
  // with more epochs) exits 0 having trained nothing; say so rather than let it look like work.
  if (!resumed_from_.empty() && completed_steps() == resumed_at_step_ &&
      std::uncaught_exceptions() == 0 && is_main_process()) {
    log::warning("resumed from " + resumed_from_ + " at step " + std::to_string(resumed_at_step_) +
                 " but took no optimizer step after it: that run had already got this far (it "
                 "had finished, or had a larger dataset or more epochs). To train from scratch, "
                 "use another checkpoint folder (accel-launch --checkpoint-dir DIR)");
  }
}

void Accelerator::setup_mixed_precision(const std::string& which) {
  if (mixed_precision_ != "no" && mixed_precision_ != "fp16" && mixed_precision_ != "bf16") {
    throw ConfigError("accel: " + which + "=\"" + mixed_precision_ +
                      "\": expected no, fp16 or bf16");
  }
  if (mixed_precision_ == "fp16" && !device().is_cuda()) {
    throw ConfigError("accel: " + which + "=fp16 needs a CUDA device (this process runs on " +
                      device().str() + "); on CPU use bf16");
  }
  if (mixed_precision_ == "fp16") {
    scaler_ = std::make_shared<GradScaler>(options_.grad_scaler.value_or(GradScalerOptions{}));
  } else if (options_.grad_scaler && options_.grad_scaler->enabled) {
    scaler_ = std::make_shared<GradScaler>(*options_.grad_scaler);
  }
}

AutocastGuard Accelerator::autocast() const {
  auto dtype = mixed_precision_ == "fp16" ? torch::kHalf : torch::kBFloat16;
  return AutocastGuard(device().type(), dtype, mixed_precision_ != "no");
}

void Accelerator::unscale_gradients() {
  if (!scaler_ || !sync_gradients()) return;
  // Once per step: HF calls this from every clip.
  for (auto& slot : optimizers_) {
    if (!scaler_->was_unscaled(*slot->optimizer)) scaler_->unscale_(*slot->optimizer);
  }
}

bool Accelerator::optimizer_step_was_skipped() const {
  for (auto& slot : optimizers_) {
    if (slot->overflow) return true;
  }
  return false;
}

int64_t Accelerator::completed_steps() const {
  return optimizers_.empty() ? 0 : optimizers_.front()->steps;
}

void Accelerator::set_gradient_accumulation_steps(int steps) {
  if (steps < 1) {
    throw ConfigError("accel: gradient_accumulation_steps must be at least 1, got " +
                      std::to_string(steps));
  }
  gradient_state_->set_num_steps(steps);
}

void Accelerator::register_model(torch::nn::Module& model) {
  if (options_.device_placement) model.to(device());
  if (!prepared_.count(&model)) models_.push_back(&model);
  prepared_[&model] = true;
  if (!use_distributed()) return;
  std::vector<torch::Tensor> trainable;
  for (auto& p : model.parameters()) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  GradSyncOptions opts;
  opts.bucket_cap_bytes = options_.bucket_cap_bytes;
  opts.first_bucket_cap_bytes = std::min(opts.first_bucket_cap_bytes, options_.bucket_cap_bytes);
  auto sync = GradSync::create(state_->comm(), std::move(trainable), opts);
  sync->broadcast_parameters();
  torch::NoGradGuard no_grad;
  for (auto& b : model.buffers()) {
    auto buffer = b;
    state_->comm().broadcast(buffer, 0);
  }
  syncs_[&model] = std::move(sync);
}

std::shared_ptr<GradSync> Accelerator::sync_of(const torch::nn::Module* model) const {
  if (!prepared_.count(model)) {
    throw UsageError("accel: no_sync/accumulate got a model that was not passed to prepare()");
  }
  auto it = syncs_.find(model);
  return it == syncs_.end() ? nullptr : it->second;
}

PreparedOptimizer Accelerator::prepare_optimizer(
    std::shared_ptr<torch::optim::Optimizer> optimizer) {
  if (!optimizer) throw UsageError("accel: prepare() got a null optimizer");
  auto slot = std::make_shared<detail::OptimizerSlot>();
  slot->optimizer = std::move(optimizer);
  optimizers_.push_back(slot);
  return PreparedOptimizer(std::move(slot), gradient_state_, scaler_);
}

DataLoader Accelerator::prepare_data_loader(const DataLoader& loader) {
  ShardOptions shard;
  shard.num_processes = static_cast<std::size_t>(num_processes());
  shard.process_index = static_cast<std::size_t>(process_index());
  shard.split_batches = options_.split_batches;
  shard.even_batches = options_.even_batches;
  shard.device = options_.device_placement ? device() : torch::Device(torch::kCPU);
  std::weak_ptr<Accelerator*> self = self_;
  auto prepared = loader.shard(shard, gradient_state_, [self] {
    if (auto acc = self.lock()) (*acc)->on_step_boundary();
  });
  loaders_.push_back(prepared);
  return prepared;
}

PreparedScheduler Accelerator::prepare_scheduler(
    std::shared_ptr<torch::optim::LRScheduler> scheduler) {
  if (!scheduler) throw UsageError("accel: prepare() got a null scheduler");
  int steps = options_.split_batches ? 1 : num_processes();
  auto slot = std::make_shared<detail::SchedulerSlot>();
  slot->scheduler = std::move(scheduler);
  schedulers_.push_back(slot);
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
  // Why: backward inside an autocast scope would recast the backward matmuls; PyTorch runs
  // backward outside autocast, with the dtypes the forward chose.
  AutocastPause pause;
  try {
    auto scaled = gradient_state_->num_steps() > 1 ? loss / gradient_state_->num_steps() : loss;
    if (scaler_) scaled = scaler_->scale(scaled);
    scaled.backward();
  } catch (...) {
    for (auto& [model, sync] : syncs_) sync->abort_round();
    throw;
  }
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
  syncs_.clear();
  prepared_.clear();
  models_.clear();
  optimizers_.clear();
  schedulers_.clear();
  loaders_.clear();
  custom_.clear();
  gradient_state_->set_step(0);
  gradient_state_->set_sync_gradients(true);
}

}  // namespace accel

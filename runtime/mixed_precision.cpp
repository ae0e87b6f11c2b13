// AutocastGuard and GradScaler (see accel/mixed_precision.h).
#include "accel/mixed_precision.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "accel/error.h"
#include "contract/json_depth.h"
#include "runtime/autocast_compat.h"

namespace accel {

// --- AutocastGuard --------------------------------------------------------------------------

namespace {
thread_local int64_t g_regions_entered = 0;
}  // namespace

int64_t autocast_compat::regions_entered() { return g_regions_entered; }

AutocastGuard::AutocastGuard(torch::DeviceType device_type, torch::ScalarType dtype, bool enabled)
    : device_type_(device_type), active_(enabled) {
  if (!active_) return;
  if (device_type_ == torch::kCPU && dtype != torch::kBFloat16) {
    throw UsageError(std::string("accel: autocast on CPU runs in BFloat16 only, not ") +
                     c10::toString(dtype) + "; float16 needs a CUDA device");
  }
  if (device_type_ == torch::kCUDA || device_type_ == torch::kCPU) {
    previous_enabled_ = autocast_compat::is_enabled(device_type_);
    previous_dtype_ = autocast_compat::dtype(device_type_);
    autocast_compat::set_dtype(device_type_, dtype);
    autocast_compat::set_enabled(device_type_, true);
  } else {
    throw UsageError("accel: autocast supports CPU and CUDA devices, not " +
                     c10::DeviceTypeName(device_type_));
  }
  at::autocast::increment_nesting();
  ++g_regions_entered;
}

AutocastGuard::AutocastGuard(AutocastGuard&& other) noexcept
    : device_type_(other.device_type_),
      active_(other.active_),
      previous_enabled_(other.previous_enabled_),
      previous_dtype_(other.previous_dtype_) {
  other.active_ = false;
}

AutocastGuard::~AutocastGuard() {
  if (!active_) return;
  // Why: autocast caches the low-precision copies of weights; they must not outlive the
  // outermost scope, or an optimizer step would leave stale copies behind.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  autocast_compat::set_enabled(device_type_, previous_enabled_);
  autocast_compat::set_dtype(device_type_, previous_dtype_);
}

// --- GradScaler -----------------------------------------------------------------------------

namespace {

// Gradients of `optimizer`, grouped by device (the fused kernel wants one device per call).
std::unordered_map<torch::Device, std::vector<torch::Tensor>> grads_by_device(
    torch::optim::Optimizer& optimizer) {
  std::unordered_map<torch::Device, std::vector<torch::Tensor>> out;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      const auto& g = p.grad();
      if (g.defined() && g.numel() > 0) out[g.device()].push_back(g);
    }
  }
  return out;
}

// found_inf = 1 if any gradient is inf/NaN; every gradient *= inv_scale (CPU: no ATen kernel).
void check_and_unscale_cpu(std::vector<torch::Tensor>& grads, torch::Tensor& found_inf,
                           const torch::Tensor& inv_scale) {
  for (auto& g : grads) {
    if (!torch::isfinite(g).all().item<bool>()) found_inf.fill_(1.0);
    g.mul_(inv_scale);
  }
}

// _amp_update_scale_'s arithmetic, on CPU tensors.
void update_scale_cpu(torch::Tensor& scale, torch::Tensor& tracker, const torch::Tensor& found_inf,
                      const GradScalerOptions& o) {
  if (found_inf.item<float>() > 0) {
    scale.mul_(o.backoff_factor);
    tracker.fill_(0);
    return;
  }
  int64_t successful = tracker.item<int32_t>() + 1;
  if (successful == o.growth_interval) {
    auto grown = scale * o.growth_factor;
    if (torch::isfinite(grown).all().item<bool>()) scale.copy_(grown);
    tracker.fill_(0);
  } else {
    tracker.fill_(successful);
  }
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options) : options_(options) {
  if (!(options_.init_scale > 0) || !(options_.growth_factor > 1) ||
      !(options_.backoff_factor > 0) || !(options_.backoff_factor < 1) ||
      options_.growth_interval < 1) {
    throw ConfigError(
        "accel: GradScalerOptions needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 "
        "and growth_interval >= 1; got init_scale " +
        std::to_string(options_.init_scale) + ", growth_factor " +
        std::to_string(options_.growth_factor) + ", backoff_factor " +
        std::to_string(options_.backoff_factor) + ", growth_interval " +
        std::to_string(options_.growth_interval));
  }
}

void GradScaler::lazy_init(const torch::Device& device) {
  if (!scale_.defined()) {
    scale_ = torch::full({1}, options_.init_scale, torch::dtype(torch::kFloat).device(device));
    growth_tracker_ = torch::zeros({1}, torch::dtype(torch::kInt).device(device));
  } else if (scale_.device() != device) {
    // Why: a scale restored from a checkpoint starts on the CPU; it moves once, so the CUDA
    // update kernel runs and no step pays a copy.
    scale_ = scale_.to(device);
    growth_tracker_ = growth_tracker_.to(device);
  }
}

torch::Tensor GradScaler::scale(const torch::Tensor& loss) {
  if (!options_.enabled) return loss;
  lazy_init(loss.device());
  return loss * scale_;
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled) return;
  if (found_inf_.count(&optimizer)) {
    throw UsageError(
        "accel: unscale_() was already called for this optimizer since the last update(); "
        "the gradients are unscaled once per step");
  }
  if (!scale_.defined()) lazy_init(torch::kCPU);
  auto inv_scale = scale_.to(torch::kDouble).reciprocal().to(torch::kFloat);
  auto found = torch::zeros({1}, scale_.options());
  for (auto& [device, grads] : grads_by_device(optimizer)) {
    const torch::Device& dev = device;
    auto found_here = torch::zeros({1}, torch::dtype(torch::kFloat).device(dev));
    auto inv_here = inv_scale.to(dev);
    if (dev.is_cuda()) {
      at::_amp_foreach_non_finite_check_and_unscale_(grads, found_here, inv_here);
    } else {
      check_and_unscale_cpu(grads, found_here, inv_here);
    }
    found.add_(found_here.to(found.device()));
  }
  found_inf_[&optimizer] = found;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  return step(optimizer, [&optimizer] { optimizer.step(); });
}

bool GradScaler::step(torch::optim::Optimizer& optimizer, const std::function<void()>& run_step) {
  if (!options_.enabled) {
    run_step();
    return true;
  }
  if (!found_inf_.count(&optimizer)) unscale_(optimizer);
  if (found_inf_.at(&optimizer).item<float>() > 0) return false;
  run_step();
  return true;
}

void GradScaler::update() {
  if (!options_.enabled || !scale_.defined()) return;
  auto found = torch::zeros({1}, scale_.options());
  for (auto& [optimizer, f] : found_inf_) found.add_(f.to(found.device()));
  found_inf_.clear();
  if (scale_.is_cuda()) {
    at::_amp_update_scale_(scale_, growth_tracker_, found, options_.growth_factor,
                           options_.backoff_factor, options_.growth_interval);
  } else {
    update_scale_cpu(scale_, growth_tracker_, found, options_);
  }
}

double GradScaler::get_scale() const {
  if (!options_.enabled) return 1.0;
  return scale_.defined() ? scale_.item<double>() : options_.init_scale;
}

int64_t GradScaler::growth_tracker() const {
  return growth_tracker_.defined() ? growth_tracker_.item<int32_t>() : 0;
}

std::string GradScaler::state_dict() const {
  nlohmann::json j = {{"scale", get_scale()},
                      {"growth_tracker", growth_tracker()},
                      {"growth_factor", options_.growth_factor},
                      {"backoff_factor", options_.backoff_factor},
                      {"growth_interval", options_.growth_interval}};
  return j.dump();
}

void GradScaler::load_state_dict(const std::string& json, const std::string& where) {
  if (auto deep = contract::json_nesting_problem(json); !deep.empty())
    throw CheckpointError("accel: " + where + ": " + deep);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json);
  } catch (const std::exception& e) {
    throw CheckpointError("accel: " + where + ": not valid JSON: " + e.what());
  }
  if (!j.is_object() || !j.contains("scale") || !j["scale"].is_number() ||
      !j.contains("growth_tracker") || !j["growth_tracker"].is_number_integer()) {
    throw CheckpointError("accel: " + where +
                          ": expected {\"scale\": number, \"growth_tracker\": integer}");
  }
  double scale = j["scale"].get<double>();
  if (!(scale > 0) || scale > std::numeric_limits<float>::max()) {
    throw CheckpointError("accel: " + where + ": scale must be a positive float32, got " +
                          j["scale"].dump());
  }
  auto tracker = j["growth_tracker"].get<int64_t>();
  if (tracker < 0 || tracker > std::numeric_limits<int32_t>::max()) {
    throw CheckpointError("accel: " + where +
                          ": growth_tracker must be a count of clean steps (0 to 2^31-1), got " +
                          std::to_string(tracker));
  }
  // Why: the growth interval may be shorter now than when this was saved; the count would then
  // never equal it, and the scale would never grow.
  tracker = std::min<int64_t>(tracker, options_.growth_interval - 1);
  if (!options_.enabled) return;
  if (!scale_.defined()) lazy_init(torch::kCPU);
  scale_.fill_(scale);
  growth_tracker_.fill_(tracker);
  found_inf_.clear();
}

}  // namespace accel

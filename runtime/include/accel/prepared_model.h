// PreparedModel: what Accelerator::prepare() returns for a model. It is the model itself (shared
// ownership, `->` and `*` reach it), plus HF Accelerate's call semantics: `m(x)` runs the
// model's forward under the Accelerator's mixed precision autocast and returns its floating
// outputs as float32, as HF's prepared `model(x)` does. Nothing else runs under autocast on its
// own: `m->forward(x)`, the loss, an unprepared model (a teacher), the optimizer step run in full
// precision unless the program opens acc.autocast().
// Thread: the training thread (autocast state is thread-local, as in PyTorch).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "accel/mixed_precision.h"

namespace accel {

// How a prepared model's calls run; shared by every model one Accelerator prepared.
struct ForwardPrecision {
  torch::DeviceType device_type = torch::kCPU;
  torch::ScalarType dtype = torch::kBFloat16;
  bool autocast = false;  // mixed precision on, and AcceleratorOptions::autocast_forward
};

namespace detail {

// HF's convert_outputs_to_fp32: bf16/fp16 tensors become float32, in tensors, vectors, tuples,
// pairs and string-keyed maps of them, to any depth; anything else is returned as it is.
inline torch::Tensor outputs_to_float32(torch::Tensor t);
template <class T>
std::vector<T> outputs_to_float32(std::vector<T> values);
template <class T>
std::map<std::string, T> outputs_to_float32(std::map<std::string, T> values);
template <class A, class B>
std::pair<A, B> outputs_to_float32(std::pair<A, B> p);
template <class... Ts>
std::tuple<Ts...> outputs_to_float32(std::tuple<Ts...> t);
template <class T>
T outputs_to_float32(T value) {
  return value;
}

inline torch::Tensor outputs_to_float32(torch::Tensor t) {
  if (t.defined() && (t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kHalf))
    return t.to(torch::kFloat);
  return t;
}
template <class T>
std::vector<T> outputs_to_float32(std::vector<T> values) {
  for (auto& v : values) v = outputs_to_float32(std::move(v));
  return values;
}
template <class T>
std::map<std::string, T> outputs_to_float32(std::map<std::string, T> values) {
  for (auto& [key, v] : values) v = outputs_to_float32(std::move(v));
  return values;
}
template <class A, class B>
std::pair<A, B> outputs_to_float32(std::pair<A, B> p) {
  return {outputs_to_float32(std::move(p.first)), outputs_to_float32(std::move(p.second))};
}
template <class... Ts>
std::tuple<Ts...> outputs_to_float32(std::tuple<Ts...> t) {
  return std::apply(
      [](auto&&... v) { return std::tuple<Ts...>{outputs_to_float32(std::move(v))...}; },
      std::move(t));
}

}  // namespace detail

template <class M>
class PreparedModel {
 public:
  using element_type = M;

  PreparedModel() = default;
  PreparedModel(std::shared_ptr<M> model, std::shared_ptr<const ForwardPrecision> precision)
      : model_(std::move(model)), precision_(std::move(precision)) {}

  // HF's prepared model(x): M::forward(args...) under autocast (mixed precision "bf16"/"fp16"),
  // floating outputs returned as float32. With mixed precision "no": forward(args...) as it is.
  template <class... Args>
  auto operator()(Args&&... args) const {
    using Out = decltype(model_->forward(std::forward<Args>(args)...));
    if constexpr (std::is_void_v<Out>) {
      AutocastGuard guard = begin();
      model_->forward(std::forward<Args>(args)...);
    } else {
      std::decay_t<Out> out = [&] {
        AutocastGuard guard = begin();
        return model_->forward(std::forward<Args>(args)...);
      }();
      if (!precision_ || !precision_->autocast) return out;
      return detail::outputs_to_float32(std::move(out));
    }
  }

  // The model itself: m->forward(x), m->parameters(), m->fc1 (no autocast).
  M* operator->() const { return model_.get(); }
  M& operator*() const { return *model_; }
  M* get() const { return model_.get(); }
  const std::shared_ptr<M>& ptr() const { return model_; }
  // Passes where a std::shared_ptr of the model (or of a base) is taken; calls through that
  // pointer run without autocast (HF's unwrap_model).
  template <class B>
  requires std::is_base_of_v<B, M>
  operator std::shared_ptr<B>() const { return model_; }
  // And where a module holder of it is taken (torch::nn::Sequential for a SequentialImpl).
  template <class H>
  requires std::is_base_of_v<torch::nn::ModuleHolder<M>, H>
  operator H() const { return H(model_); }
  explicit operator bool() const { return static_cast<bool>(model_); }

 private:
  AutocastGuard begin() const {
    const bool on = precision_ && precision_->autocast;
    return AutocastGuard(precision_ ? precision_->device_type : torch::kCPU,
                         precision_ ? precision_->dtype : torch::kFloat, on);
  }

  std::shared_ptr<M> model_;
  std::shared_ptr<const ForwardPrecision> precision_;
};

namespace detail {
template <class T>
inline constexpr bool is_prepared_model_v = false;
template <class M>
inline constexpr bool is_prepared_model_v<PreparedModel<M>> = true;
}  // namespace detail

}  // namespace accel

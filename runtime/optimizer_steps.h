// An optimizer's own step count, to notice steps taken around the prepared optimizer.
#pragma once

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

namespace accel::detail {

// The first parameter's step count for the optimizers that keep one (Adam, AdamW, Adagrad,
// RMSprop; 0 before their first step); -1 for those that keep none (SGD, LBFGS).
int64_t own_step_count(torch::optim::Optimizer& optimizer);

// The key of `param`'s entry in optimizer.state(): libtorch 1.13 (Debian's) keys it by a string
// of the parameter's TensorImpl address, later releases by the address itself.
// (A template so that only the branch for this libtorch is compiled.)
template <class Tensor = torch::Tensor>
auto state_key(const Tensor& param) {
  using Key = typename std::remove_reference_t<
      decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    // What 1.13's c10::guts::to_string wrote (later releases removed it): the pointer streamed.
    std::ostringstream key;
    key << param.unsafeGetTensorImpl();
    return key.str();
  } else {
    return static_cast<Key>(param.unsafeGetTensorImpl());
  }
}

}  // namespace accel::detail

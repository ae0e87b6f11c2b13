// libtorch's autocast state per device type, on libtorch 1.13 (Debian's: one call per device
// type) and 2.4+ (one call taking the device type; the old ones print a deprecation warning on
// every call, thousands per epoch).
#pragma once

#include <ATen/autocast_mode.h>
#include <torch/version.h>

#include <cstdint>

#define ACCEL_TORCH_DEVICE_AUTOCAST_API \
  (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4))

namespace accel::autocast_compat {

// AutocastGuard scopes that autocast (mixed precision on) entered on this thread so far.
int64_t regions_entered();

inline bool is_enabled(c10::DeviceType type) {
#if ACCEL_TORCH_DEVICE_AUTOCAST_API
  return at::autocast::is_autocast_enabled(type);
#else
  return type == c10::DeviceType::CUDA ? at::autocast::is_enabled()
                                       : at::autocast::is_cpu_enabled();
#endif
}

inline void set_enabled(c10::DeviceType type, bool enabled) {
#if ACCEL_TORCH_DEVICE_AUTOCAST_API
  at::autocast::set_autocast_enabled(type, enabled);
#else
  if (type == c10::DeviceType::CUDA) {
    at::autocast::set_enabled(enabled);
  } else {
    at::autocast::set_cpu_enabled(enabled);
  }
#endif
}

inline at::ScalarType dtype(c10::DeviceType type) {
#if ACCEL_TORCH_DEVICE_AUTOCAST_API
  return at::autocast::get_autocast_dtype(type);
#else
  return type == c10::DeviceType::CUDA ? at::autocast::get_autocast_gpu_dtype()
                                       : at::autocast::get_autocast_cpu_dtype();
#endif
}

inline void set_dtype(c10::DeviceType type, at::ScalarType dtype) {
#if ACCEL_TORCH_DEVICE_AUTOCAST_API
  at::autocast::set_autocast_dtype(type, dtype);
#else
  if (type == c10::DeviceType::CUDA) {
    at::autocast::set_autocast_gpu_dtype(dtype);
  } else {
    at::autocast::set_autocast_cpu_dtype(dtype);
  }
#endif
}

}  // namespace accel::autocast_compat

// Defaults that several components start from, written once. At run time they come from the
// configuration (ClusterConfig), whose defaults are these.
#pragma once

#include <chrono>

namespace accel::defaults {

inline constexpr std::chrono::milliseconds kStopTimeout{10'000};  // SIGTERM -> SIGKILL grace
inline constexpr std::chrono::milliseconds kLease{10'000};        // a node silent this long is lost

}  // namespace accel::defaults

// glibc's malloc thresholds fixed for training (see heap_tuning.h).
#include "runtime/heap_tuning.h"

#include <limits>
#include <optional>
#include <string_view>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace accel::heap_tuning {

std::string users_setting(const env::Lookup& lookup) {
  // Why: the launcher gives every worker libaccel's own thresholds through GLIBC_TUNABLES (for
  // Python workers, which do not load libaccel); fixing the same ones again changes nothing.
  const auto tunables = lookup(contract::kGlibcTunables);
  const bool launchers = tunables && contract::is_accels_malloc_setting(*tunables);
  return contract::malloc_setting_in([&](const char* name) -> std::optional<std::string> {
    if (launchers && std::string_view(name) == contract::kGlibcTunables) return std::nullopt;
    return lookup(name);
  });
}

namespace {

Outcome apply() {
  Outcome out;
  if (!env::worker_env().keep_freed_memory) {
    out.why_not = "ACCEL_KEEP_FREED_MEMORY is off";
    return out;
  }
  const std::string user = users_setting(env::process_variable);
  if (!user.empty()) {
    out.why_not = user + " is set";
    return out;
  }
#if defined(__GLIBC__)
  static_assert(kTrimThreshold <= static_cast<std::size_t>(std::numeric_limits<int>::max()));
  // Why both: setting either one stops glibc moving them, and a trim threshold alone would leave
  // the mmap threshold at its 128 KiB start, mapping every large tensor afresh.
  out.applied = ::mallopt(M_MMAP_THRESHOLD, static_cast<int>(kMmapThreshold)) == 1 &&
                ::mallopt(M_TRIM_THRESHOLD, static_cast<int>(kTrimThreshold)) == 1;
  if (!out.applied) out.why_not = "glibc refused the thresholds";
#else
  out.why_not = "this C library is not glibc";
#endif
  return out;
}

}  // namespace

const Outcome& keep_freed_memory() {
  static const Outcome outcome = apply();
  return outcome;
}

std::string describe(const Outcome& outcome) {
  if (outcome.applied) {
    return "malloc keeps freed memory for the next step: allocations below about 32 MiB come "
           "from its heap, and up to 1 GiB free at the heap's top stays mapped "
           "(ACCEL_KEEP_FREED_MEMORY=0 leaves glibc's moving thresholds)";
  }
  return "malloc's thresholds left as they are: " + outcome.why_not;
}

}  // namespace accel::heap_tuning

// glibc's malloc thresholds fixed for training (see heap_tuning.h).
#include "runtime/heap_tuning.h"

#include <limits>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace accel::heap_tuning {

std::string users_setting(const env::Lookup& lookup) {
  if (auto tunables = lookup("GLIBC_TUNABLES");
      tunables && tunables->find("glibc.malloc.") != std::string::npos) {
    return "GLIBC_TUNABLES";
  }
  // glibc's older names for the same tunables, still read.
  for (const char* name : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                           "MALLOC_MMAP_MAX_"}) {
    if (auto v = lookup(name); v && !v->empty()) return name;
  }
  return "";
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

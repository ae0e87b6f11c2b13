// Keeping the memory a training step frees for the next step, instead of handing it back to the
// kernel and faulting it in again. A step allocates and frees the same large tensors every time
// (a Linear layer's weight gradient, activations); glibc's malloc serves those above its mmap
// threshold with a fresh mapping, and gives the top of its heap back to the kernel once more
// than its trim threshold is free there. Both thresholds move with what the process freed
// before (glibc's "dynamic threshold"), so whether a step pays a page fault for every 4 KiB of
// them depends on the allocation history: measured on model M (784->2048->2048->10), one of two
// ranks of the same job faulted about 1,200 times a step and the other never. libaccel fixes the
// thresholds when an Accelerator is made: allocations below about 32 MiB (the ceiling of glibc's
// moving mmap threshold) come from the heap, and up to 1 GiB free at its top stays mapped.
// Larger ones are mapped afresh when the heap has no free room for them, as before; one cut from
// memory the heap keeps free stays with the heap after it is freed.
#pragma once

#include <cstddef>
#include <string>

#include "contract/malloc_tuning.h"
#include "runtime/env.h"

namespace accel::heap_tuning {

inline constexpr std::size_t kMmapThreshold = contract::kMallocMmapThreshold;
inline constexpr std::size_t kTrimThreshold = contract::kMallocTrimThreshold;

// The variable through which the user set glibc's allocator already (GLIBC_TUNABLES naming a
// glibc.malloc tunable, or one of glibc's MALLOC_*_ variables), or "" when none: then libaccel
// leaves the allocator as the user set it. GLIBC_TUNABLES with exactly libaccel's two thresholds
// (contract::kMallocTunables, what accel-launch gives every worker) is not the user's. Unlike
// read_worker_env(), an empty value counts as set (glibc reads an empty MALLOC_*_ as 0), so
// `lookup` must return it as it is, as env::process_variable does.
std::string users_setting(const env::Lookup& lookup);

struct Outcome {
  bool applied = false;
  // When not applied: "MALLOC_TOP_PAD_ is set", "ACCEL_KEEP_FREED_MEMORY is off".
  std::string why_not;
};

// Fixes glibc's thresholds in this process, once (later calls return the first outcome), unless
// the worker environment turns it off or the user set the allocator through the environment (a
// program's own mallopt() calls before it are overridden). Thread-safe; throws the worker
// environment's ConfigError.
const Outcome& keep_freed_memory();

// The debug line libaccel logs about an outcome (log::debug adds "accel: ").
std::string describe(const Outcome& outcome);

}  // namespace accel::heap_tuning

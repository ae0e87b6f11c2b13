// glibc's malloc thresholds for training, shared by libaccel (which fixes them in its own process
// with mallopt when an Accelerator is made) and the launcher (which gives them to every worker it
// starts through GLIBC_TUNABLES, so that Python and plain libtorch workers get them from their
// first allocation). Why fixed: a training step allocates and frees the same large tensors every
// time, and glibc's moving thresholds hand that memory back to the kernel and fault it in again,
// page by page, depending on what the process freed before.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace accel::contract {

// Allocations below this come from the heap: the ceiling of glibc's moving mmap threshold on
// 64-bit (half its largest heap), the highest glibc accepts.
inline constexpr std::size_t kMallocMmapThreshold = std::size_t{32} << 20;
// Up to this much free at the heap's top stays mapped.
inline constexpr std::size_t kMallocTrimThreshold = std::size_t{1} << 30;
// libaccel's workers keep the blocks of freed CPU tensors of kMallocMmapThreshold bytes or more
// (runtime/large_blocks.h); one kept this long without being reused goes back to the kernel.
inline constexpr int kKeptBlockIdleSeconds = 60;

inline constexpr char kGlibcTunables[] = "GLIBC_TUNABLES";
// The same two thresholds as glibc tunables (GLIBC_TUNABLES's syntax: name=value, ':' between).
inline constexpr char kMallocTunables[] =
    "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824";

// Where an environment already sets glibc's malloc (GLIBC_TUNABLES naming a glibc.malloc.
// tunable, or one of glibc's older MALLOC_*_ names for them, even empty), the variable's name;
// else "". `lookup(name)` gives a variable's value, or something false when it is unset
// (std::optional<std::string>, or a const std::string* ).
template <typename Lookup>
std::string malloc_setting_in(const Lookup& lookup) {
  if (auto tunables = lookup(kGlibcTunables);
      tunables && std::string_view(*tunables).find("glibc.malloc.") != std::string_view::npos) {
    return kGlibcTunables;
  }
  for (const char* name : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                           "MALLOC_MMAP_MAX_"}) {
    // Why even empty: glibc reads an empty value as 0 (MALLOC_MMAP_MAX_= turns its mmap off).
    if (lookup(name)) return name;
  }
  return "";
}

// Whether GLIBC_TUNABLES's value `tunables` sets glibc's malloc exactly as kMallocTunables does
// (its glibc.malloc. entries, in any order, are those two and no others): what the launcher gave
// a worker, not a setting of the user's.
inline bool is_accels_malloc_setting(std::string_view tunables) {
  const std::string_view ours(kMallocTunables);
  const std::string_view mine[] = {ours.substr(0, ours.find(':')), ours.substr(ours.find(':') + 1)};
  unsigned seen = 0;  // bit i: mine[i] was there
  while (!tunables.empty()) {
    const std::size_t colon = tunables.find(':');
    const std::string_view entry = tunables.substr(0, colon);
    tunables = colon == std::string_view::npos ? std::string_view() : tunables.substr(colon + 1);
    if (entry.substr(0, 13) != "glibc.malloc.") continue;
    if (entry == mine[0] && !(seen & 1u)) {
      seen |= 1u;
    } else if (entry == mine[1] && !(seen & 2u)) {
      seen |= 2u;
    } else {
      return false;  // another malloc tunable, another value, or one of ours twice
    }
  }
  return seen == 3u;
}

}  // namespace accel::contract

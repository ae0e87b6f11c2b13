// Keeping the large blocks of CPU tensors for the next step. glibc's malloc serves an allocation
// of 32 MiB or more with a mapping of its own (unless its heap happens to have that much free) and
// unmaps it when it is freed; no threshold glibc accepts changes that (heap_tuning.h fixes them
// below that size). A training step allocates and frees the same large tensors every time: a
// vocabulary's logits and their gradients, a large layer's weight gradient when zero_grad sets it
// to none, wide activations. Each new mapping is zeroed and faulted in again, a page at a time;
// where a hypervisor shadows the guest's page tables, an unmap can also drop the mappings of the
// whole process. bench/train/bench_vocab.py's model V (a 32,000-word head over 512 tokens, four
// tensors of 65.5 MB a step) on a 2-vCPU VM whose hypervisor shadows the guest's page tables:
// 0.75 steps/s with libtorch's allocator, 2.87 with the blocks kept.
//
// libaccel installs a CPU allocator for libtorch when an Accelerator is made that serves blocks
// of 32 MiB and more from those freed before, and passes every smaller one to the allocator it
// found (libtorch's). What it keeps is bounded: the blocks it keeps and the live ones together
// never pass the most that was live at once, so a process holds no more large-block memory than
// at its own peak; and a block kept for 60 s without being reused goes back to the kernel.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "contract/malloc_tuning.h"

namespace accel::large_blocks {

// Tensors of this many bytes and more get kept blocks: the size from which glibc maps each one
// that its heap's free memory cannot hold.
inline constexpr std::size_t kLargeBlock = contract::kMallocMmapThreshold;
// Blocks are made in multiples of this, so that tensors of nearly one size share blocks.
inline constexpr std::size_t kGranule = std::size_t{2} << 20;
// A block kept this long without being reused goes back to the kernel (checked every quarter of
// it, on a thread of its own).
inline constexpr std::chrono::seconds kIdleLimit{contract::kKeptBlockIdleSeconds};

using Clock = std::chrono::steady_clock;

// Where blocks come from and go back to: anonymous mappings, or a test's.
class Pages {
 public:
  virtual ~Pages() = default;
  // `bytes` of new zeroed memory; nullptr when the system has none.
  virtual void* map(std::size_t bytes) = 0;
  virtual void unmap(void* data, std::size_t bytes) = 0;
  virtual Clock::time_point now() const { return Clock::now(); }
};

// Pages from mmap and back to munmap.
Pages& system_pages();

struct Stats {
  std::size_t live_bytes = 0;       // blocks in use
  std::size_t kept_bytes = 0;       // blocks freed and kept
  std::size_t peak_live_bytes = 0;  // the most in use at once
  std::uint64_t reused = 0;         // allocations served from a kept block
  std::uint64_t made = 0;           // allocations that made a new block
  std::uint64_t handed_back = 0;    // blocks given back to the kernel
};

// The blocks, thread-safe. Which kept block serves an allocation of n bytes (n rounded up to
// kGranule): the smallest of at least n and at most n + n/4 (the most a reuse may waste), the
// most recently freed of those. When none fits, the oldest kept blocks go back to the kernel
// until the kept and live blocks with the new one are no more than the larger of the peak and
// the live blocks with the new one.
class Cache {
 public:
  explicit Cache(Pages& pages) : pages_(pages) {}
  Cache(const Cache&) = delete;
  Cache& operator=(const Cache&) = delete;

  // A block of at least `bytes`, and its size in *size; nullptr when the system has no memory
  // for a new one (even after every kept block was handed back). Throws std::bad_alloc only when
  // its own bookkeeping cannot grow.
  void* take(std::size_t bytes, std::size_t* size);
  // A block take() gave (its address), freed: kept for later. False, doing nothing, when `data`
  // is not a live block of this cache. Never throws (a tensor's deleter calls it).
  bool give_back(void* data) noexcept;
  // Hands back the blocks kept for kIdleLimit or more. Never throws.
  void release_idle() noexcept;
  Stats stats() const;

  // Around fork(): the child gets the lock free, whatever another thread was doing when the
  // process forked (pthread_atfork's prepare, then parent or child).
  void lock_for_fork() { m_.lock(); }
  void unlock_after_fork() { m_.unlock(); }

 private:
  struct Kept {
    void* data;
    std::size_t size;
    Clock::time_point freed;
  };
  void unmap_all(const std::vector<Kept>& blocks);

  Pages& pages_;
  mutable std::mutex m_;
  std::vector<Kept> kept_;                       // oldest freed first
  std::unordered_map<void*, std::size_t> live_;  // blocks in use, by address
  Stats stats_;
};

// Installing the cache as libtorch's CPU allocator.
struct Outcome {
  bool applied = false;
  // When not applied: "ACCEL_KEEP_FREED_MEMORY is off", "a CPU allocator other than libtorch's
  // is set", "libtorch's CPU allocator has no raw deleter", "libtorch kept its CPU allocator".
  std::string why_not;
};

// Installs it in this process, once (later calls return the first outcome), unless the worker
// environment turns it off (ACCEL_KEEP_FREED_MEMORY=0) or libtorch's CPU allocator was replaced
// already. Thread-safe; throws the worker environment's ConfigError.
const Outcome& keep_large_blocks();

// The installed cache's figures; all zero when it is not installed.
Stats installed_stats();

// The debug line libaccel logs about an outcome.
std::string describe(const Outcome& outcome);

}  // namespace accel::large_blocks

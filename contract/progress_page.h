// The progress page: a 4 KiB file per worker (path in ACCEL_PROGRESS_FILE) that libaccel keeps
// current with plain stores into shared memory, no syscalls and no extra thread, and the agent
// reads to detect hangs (docs/operations.md). This header is the format; it includes nothing
// but the standard library so the agent (which never includes libtorch) reads the same layout.
//
// Layout, native endianness, every integer naturally aligned:
//   Page.magic "ACCELPG1", version 1, ring_size 64, rank, pid,
//   heartbeat_ns: CLOCK_MONOTONIC ns of the last sign of life (a collective or a batch), 0: none
//   yet, started: collectives started so far (the next one's sequence number), ring[seq % 64]: the
//   last 64 collectives: seq + 1 (0: empty or being written), start and end times (end 0: still in
//   flight), bytes, op name; then `stats` (after the ring, so pages of older libaccel read as
//   zeros): steps taken (the prepared optimizer's synchronizing steps) and when the last ended,
//   the time spent blocked in collectives (CLOCK_MONOTONIC ns, cumulative), and the last
//   checkpoint's end time, size and duration (0: none yet).
// Writers publish an entry by storing seq + 1 last (release); readers load it first and again
// after the fields (acquire) and drop the entry when the two differ.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <ctime>

namespace accel::progress {

inline constexpr char kMagic[8] = {'A', 'C', 'C', 'E', 'L', 'P', 'G', '1'};
inline constexpr std::uint32_t kVersion = 1;
inline constexpr std::uint32_t kRingSize = 64;
inline constexpr std::size_t kFileBytes = 4096;

struct Entry {
  std::uint64_t seq_plus_one;
  std::uint64_t start_ns;
  std::uint64_t end_ns;
  std::uint64_t bytes;
  char op[16];
};

struct Stats {
  std::uint64_t steps;
  std::uint64_t last_step_ns;
  std::uint64_t collective_wait_ns;
  std::uint64_t checkpoint_ns;
  std::uint64_t checkpoint_bytes;
  std::uint64_t checkpoint_duration_ns;
  std::uint64_t reserved[2];
};

struct Page {
  char magic[8];
  std::uint32_t version;
  std::uint32_t ring_size;
  std::int32_t rank;
  std::int32_t pid;
  std::uint64_t heartbeat_ns;
  std::uint64_t started;
  std::uint64_t reserved[4];
  Entry ring[kRingSize];
  Stats stats;
};
static_assert(sizeof(Entry) == 48);
static_assert(sizeof(Page) <= kFileBytes);

inline std::uint64_t monotonic_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000'000ull +
         static_cast<std::uint64_t>(ts.tv_nsec);
}

template <class T>
inline void store(T* at, T v) {
  __atomic_store_n(at, v, __ATOMIC_RELEASE);
}
template <class T>
inline T load(const T* at) {
  return __atomic_load_n(at, __ATOMIC_ACQUIRE);
}

// A consistent copy of one ring entry, or false when it is empty or was being rewritten.
inline bool read_entry(const Entry& e, Entry& out) {
  std::uint64_t first = load(&e.seq_plus_one);
  if (first == 0) return false;
  out.start_ns = load(&e.start_ns);
  out.end_ns = load(&e.end_ns);
  out.bytes = load(&e.bytes);
  std::memcpy(out.op, e.op, sizeof out.op);
  out.op[sizeof out.op - 1] = '\0';
  out.seq_plus_one = first;
  __atomic_thread_fence(__ATOMIC_ACQUIRE);  // Why: the copy above must not move below the check
  return load(&e.seq_plus_one) == first;
}

}  // namespace accel::progress

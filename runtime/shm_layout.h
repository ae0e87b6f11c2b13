// The shared-memory segment of a ShmGroup (shm_group.h), as its two source files see it: the
// header, each rank's control record, the posted all-reduces' records and work counters, then
// the slots. Internal to shm_group.cpp and shm_posted.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <sched.h>
#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "runtime/shm_group.h"

namespace accel {

struct ShmGroup::Block {
  uint64_t id = 0;  // share() calls so far, counted alike on every rank
  void* base = nullptr;
  std::size_t size = 0;      // world * per_rank
  std::size_t per_rank = 0;  // each rank's part, a whole number of pages
  ~Block() {
    if (base != nullptr) ::munmap(base, size);
  }
};

namespace shm {

constexpr uint64_t kMagic = 0x616363656c73686dULL;  // "accelshm"
// Why: /dev/shm is often small in containers (64 MiB by default in Docker); 8 MiB of slots per
// set over all ranks keeps the segment at ~16 MiB whatever the process count.
constexpr std::size_t kSlotBudgetBytes = 8u << 20;
constexpr std::size_t kMinSlotBytes = 256u << 10;

// Why two call records: a rank may publish generation g+1's call while a slower rank still checks
// generation g's; records alternate by parity like the slots.
struct alignas(64) RankControl {
  std::atomic<uint64_t> arrived;
  std::atomic<uint64_t> call_seq[2];
  std::atomic<uint64_t> call_word[2];    // op code << 56 | payload bytes
  std::atomic<uint64_t> call_detail[2];  // dtype, root, reduce op
  std::atomic<uint64_t> call_where[2];   // offset in a shared block, or kPrivate
  std::atomic<uint64_t> mapped;          // share(): (generation << 1) | mapped it
  std::atomic<uint64_t> posted;          // all-reduces this rank has posted (ShmGroup::post)
};

// Posted all-reduces in flight at once, per rank; a rank finishes its oldest before it posts
// more. Each has a record per rank (what the rank posted, for the mismatch check) and one pair
// of work counters, at index (number % kPostRing).
constexpr uint64_t kPostRing = 64;
// A record is read while its writer may be reusing it for a later post: `tag` (the post's
// number + 1; 0 while being rewritten) is read before and after the fields, as in a seqlock.
struct PostRecord {
  std::atomic<uint64_t> tag;
  std::atomic<uint64_t> seq, word, detail, where;
};
// Counters hold (post number + 1) << kCountBits | count: a counter still holding an older post's
// number reads as 0 for this one, so nobody has to reset them.
constexpr int kCountBits = 24;
constexpr uint64_t kCountMask = (uint64_t{1} << kCountBits) - 1;
struct alignas(64) PostWork {
  std::atomic<uint64_t> claimed;  // chunks handed out
  char pad[56];
  std::atomic<uint64_t> done;  // chunks reduced and written to every part
};

struct Header {
  uint64_t magic;
  uint64_t world;
  uint64_t slot_bytes;
  char block_name[96];  // share(): the new segment's name, written by rank 0
};

inline std::size_t controls_offset() { return 128; }
static_assert(sizeof(Header) <= 128);
inline std::size_t records_offset(int world) {
  return controls_offset() + sizeof(RankControl) * static_cast<std::size_t>(world);
}
inline std::size_t work_offset(int world) {
  return (records_offset(world) + sizeof(PostRecord) * kPostRing * static_cast<std::size_t>(world) +
          63) /
         64 * 64;
}
inline std::size_t data_offset(int world) {
  return (work_offset(world) + sizeof(PostWork) * kPostRing + 4095) / 4096 * 4096;
}

inline RankControl* controls(void* base) {
  return reinterpret_cast<RankControl*>(static_cast<char*>(base) + controls_offset());
}
// Rank r's record of post `number`.
inline PostRecord& record(void* base, int world, int r, uint64_t number) {
  auto* all = reinterpret_cast<PostRecord*>(static_cast<char*>(base) + records_offset(world));
  return all[static_cast<std::size_t>(r) * kPostRing + number % kPostRing];
}
inline PostWork& work(void* base, int world, uint64_t number) {
  auto* all = reinterpret_cast<PostWork*>(static_cast<char*>(base) + work_offset(world));
  return all[number % kPostRing];
}

constexpr int kNumOps = 6;
inline const char* const kOps[kNumOps] = {"?",         "allreduce", "broadcast",
                                          "allgather", "barrier",   "share"};

inline uint64_t op_code(const char* op) {
  for (uint64_t i = 1; i < kNumOps; ++i)
    if (std::strcmp(op, kOps[i]) == 0) return i;
  return 0;
}

// A call's op and payload size in one word, as records hold them.
inline uint64_t word_of(const char* op, uint64_t bytes) {
  return op_code(op) << 56 | (bytes & ((1ULL << 56) - 1));
}

// What a rank's record of a post says, read as a seqlock: nothing when the record does not (or
// no longer) hold post `tag` - 1.
struct RecordCopy {
  uint64_t seq, word, detail, where;
};
inline std::optional<RecordCopy> read_record(const PostRecord& rec, uint64_t tag) {
  const uint64_t before = rec.tag.load(std::memory_order_acquire);
  RecordCopy copy{rec.seq.load(std::memory_order_relaxed), rec.word.load(std::memory_order_relaxed),
                  rec.detail.load(std::memory_order_relaxed),
                  rec.where.load(std::memory_order_relaxed)};
  std::atomic_thread_fence(std::memory_order_acquire);
  if (before != tag || rec.tag.load(std::memory_order_relaxed) != tag) return std::nullopt;
  return copy;
}

inline std::string describe(uint64_t word, uint64_t seq) {
  uint64_t code = word >> 56;
  return std::string(kOps[code < kNumOps ? code : 0]) + " #" + std::to_string(seq) + " (" +
         std::to_string(word & ((1ULL << 56) - 1)) + " bytes)";
}

// How a rank waits for its peers: spin (a peer a few microseconds behind), yield (more ranks
// than cores), then sleep, so a rank waiting for a peer in a long computation does not burn a
// core. pause() returns false once the timeout has passed.
class Pacer {
 public:
  explicit Pacer(std::chrono::milliseconds timeout)
      : start_(std::chrono::steady_clock::now()), deadline_(start_ + timeout) {}
  // True when the wait has left its first, spinning phase (the time to look at rarer things).
  bool slow() const { return spins_ >= kSpinsBeforeYield; }
  bool pause() {
    if (++spins_ < kSpinsBeforeYield) {
      __builtin_ia32_pause();
      return true;
    }
    auto now = std::chrono::steady_clock::now();
    if (now > deadline_) return false;
    if (now - start_ < kYieldPhase) {
      ::sched_yield();
    } else {
      std::this_thread::sleep_for(kSleepQuantum);
    }
    return true;
  }

 private:
  static constexpr int kSpinsBeforeYield = 2000;
  static constexpr std::chrono::milliseconds kYieldPhase{2};
  static constexpr std::chrono::microseconds kSleepQuantum{100};
  std::chrono::steady_clock::time_point start_, deadline_;
  int spins_ = 0;
};

// out = in[0] op in[1] op ... in rank order (the same bits on every rank), times `scale` for a
// sum (float types; scale 1 otherwise). shm_group.cpp.
void reduce(at::ScalarType type, void* out, const void* const* in, int n, std::size_t count,
            c10d::ReduceOp op, double scale);

}  // namespace shm
}  // namespace accel

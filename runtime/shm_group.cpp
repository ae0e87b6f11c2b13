// Shared-memory collectives between local ranks (see shm_group.h).
#include "runtime/shm_group.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "contract/worker_contract.h"
#include "runtime/shm_layout.h"

namespace accel {
using shm::controls;
using shm::data_offset;
using shm::describe;
using shm::Header;
using shm::op_code;
using shm::RankControl;
using shm::reduce;

namespace {

// Why: a large result tensor is often fresh memory (reduce()'s output, gather()'s): glibc maps
// anew for every allocation above 32 MiB, and so does libaccel for a CPU tensor that size when it
// has kept no block that fits (large_blocks.h); writing it then takes one page fault per
// 4 KiB page, which cost more than the collective itself (64 MiB: ~16k faults, half of the
// call's time here). Transparent huge pages cut that to one fault per 2 MiB; the kernel honours
// the advice only where it is set to "madvise" or "always", and ignores it otherwise.
constexpr std::size_t kHugePage = 2u << 20;
constexpr std::size_t kAdviseFromBytes = 8u << 20;
constexpr std::size_t kReduceChunkBytes = 256u << 10;
// Below this a private tensor is all-reduced the copy way (one wait per chunk instead of two).
constexpr std::size_t kSplitFromBytes = 256u << 10;
// The in-place all-reduce of a shared block reduces this much at a time into a buffer that stays
// in L1 (16 KiB measured fastest here: 64 MiB in ~6 ms against ~7 ms at 64 KiB and up), then
// writes it to every rank's block.
constexpr std::size_t kScratchBytes = 16u << 10;

void advise_huge_pages(void* data, std::size_t bytes) {
  if (bytes < kAdviseFromBytes) return;
  auto begin = (reinterpret_cast<std::uintptr_t>(data) + kHugePage - 1) & ~(kHugePage - 1);
  auto end = (reinterpret_cast<std::uintptr_t>(data) + bytes) & ~(kHugePage - 1);
  if (end > begin) {
    ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);  // advice only
  }
}

std::size_t nbytes(const at::Tensor& t) {
  return static_cast<std::size_t>(t.numel()) * t.element_size();
}

// out = in[0] op in[1] op ... in rank order on every rank: identical results everywhere. One pass
// for two ranks; `restrict` and -O3 (CMakeLists) let the compiler vectorize it.
template <class T, class F>
void combine(T* __restrict__ out, const T* const* in, int n, std::size_t count, F f) {
  const T* __restrict__ a = in[0];
  if (n == 1) {  // a group of one rank: the result is its data
    if (out != a) std::memcpy(out, a, count * sizeof(T));
    return;
  }
  const T* __restrict__ b = in[1];
  for (std::size_t i = 0; i < count; ++i) out[i] = f(a[i], b[i]);
  for (int r = 2; r < n; ++r) {
    const T* __restrict__ c = in[r];
    for (std::size_t i = 0; i < count; ++i) out[i] = f(out[i], c[i]);
  }
}

// Sum then scale, in the same pass as the last addition (gradient averaging). The sum is rounded
// before the multiply, exactly as a separate mul_ would do.
template <class T>
void sum_scaled(T* __restrict__ out, const T* const* in, int n, std::size_t count, T scale) {
  if (n == 2) {
    const T* __restrict__ a = in[0];
    const T* __restrict__ b = in[1];
    for (std::size_t i = 0; i < count; ++i) {
      T s = a[i] + b[i];
      out[i] = s * scale;
    }
    return;
  }
  combine(out, in, n, count, [](T x, T y) { return x + y; });
  for (std::size_t i = 0; i < count; ++i) out[i] *= scale;
}

template <class T>
void reduce_into(void* out, const void* const* slots, int n, std::size_t count, c10d::ReduceOp op,
                 double scale) {
  auto* o = static_cast<T*>(out);
  auto in = reinterpret_cast<const T* const*>(slots);
  if (op == c10d::ReduceOp::SUM && scale != 1.0) {
    sum_scaled(o, in, n, count, static_cast<T>(scale));
    return;
  }
  switch (op) {
    case c10d::ReduceOp::SUM:
      combine(o, in, n, count, [](T x, T y) { return x + y; });
      break;
    case c10d::ReduceOp::MAX:
      combine(o, in, n, count, [](T x, T y) { return x < y ? y : x; });
      break;
    case c10d::ReduceOp::MIN:
      combine(o, in, n, count, [](T x, T y) { return y < x ? y : x; });
      break;
    default:
      throw std::runtime_error("shared-memory allreduce supports sum, max and min");
  }
}

// bf16 and fp16: each element is summed (and scaled) in fp32, in rank order, and rounded once,
// so n ranks' gradients do not lose n-1 roundings to the narrow type.
template <class T>
void reduce_narrow(void* out, const void* const* slots, int n, std::size_t count, c10d::ReduceOp op,
                   double scale) {
  auto* o = static_cast<T*>(out);
  auto in = reinterpret_cast<const T* const*>(slots);
  const float s = static_cast<float>(scale);
  const bool scaled = op == c10d::ReduceOp::SUM && scale != 1.0;
  for (std::size_t i = 0; i < count; ++i) {
    float acc = static_cast<float>(in[0][i]);
    for (int r = 1; r < n; ++r) {
      float x = static_cast<float>(in[r][i]);
      if (op == c10d::ReduceOp::SUM)
        acc += x;
      else if (op == c10d::ReduceOp::MAX)
        acc = acc < x ? x : acc;
      else
        acc = x < acc ? x : acc;
    }
    o[i] = static_cast<T>(scaled ? acc * s : acc);
  }
}

}  // namespace

void shm::reduce(at::ScalarType type, void* out, const void* const* in, int n, std::size_t count,
                 c10d::ReduceOp op, double scale) {
  if (op != c10d::ReduceOp::SUM && op != c10d::ReduceOp::MAX && op != c10d::ReduceOp::MIN)
    throw std::runtime_error("shared-memory allreduce supports sum, max and min");
  switch (type) {
    case at::kFloat:
      return reduce_into<float>(out, in, n, count, op, scale);
    case at::kDouble:
      return reduce_into<double>(out, in, n, count, op, scale);
    case at::kInt:
      return reduce_into<int32_t>(out, in, n, count, op, scale);
    case at::kLong:
      return reduce_into<int64_t>(out, in, n, count, op, scale);
    case at::kBFloat16:
      return reduce_narrow<c10::BFloat16>(out, in, n, count, op, scale);
    case at::kHalf:
      return reduce_narrow<c10::Half>(out, in, n, count, op, scale);
    default:
      throw std::runtime_error("shared-memory allreduce got an unsupported dtype");
  }
}

namespace {

// Rank r's slice [lo, hi) of `count` elements: equal parts, each a whole number of cache lines
// long, so that no two ranks write the same line of a tensor that starts on one (the buckets do).
std::pair<std::size_t, std::size_t> slice_of(int r, int n, std::size_t count, std::size_t elem) {
  const std::size_t line = std::max<std::size_t>(1, 64 / elem);
  std::size_t per = (count + static_cast<std::size_t>(n) - 1) / static_cast<std::size_t>(n);
  per = (per + line - 1) / line * line;
  std::size_t lo = std::min(count, per * static_cast<std::size_t>(r));
  return {lo, std::min(count, lo + per)};
}

}  // namespace

bool ShmGroup::can_move(const at::Tensor& t) { return t.device().is_cpu() && t.is_contiguous(); }

bool ShmGroup::can_reduce(const at::Tensor& t) {
  auto s = t.scalar_type();
  return can_move(t) && (s == at::kFloat || s == at::kDouble || s == at::kInt || s == at::kLong ||
                         s == at::kBFloat16 || s == at::kHalf);
}

std::unique_ptr<ShmGroup> ShmGroup::create(c10d::Store& store, CollectiveGroup& group, int rank,
                                           int world, std::chrono::milliseconds timeout,
                                           std::string* why) {
  const std::size_t slot = std::max(
      shm::kMinSlotBytes, shm::kSlotBudgetBytes / static_cast<std::size_t>(world) / 4096 * 4096);
  const std::size_t size = data_offset(world) + 2 * static_cast<std::size_t>(world) * slot;
  std::string name;
  int fd = -1;
  if (rank == 0) {
    std::random_device rd;
    name = "/" + std::string(contract::kShmSegmentPrefix) + std::to_string(::getpid()) + "-" +
           std::to_string(rd());
    fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    // posix_fallocate, not ftruncate alone: a full /dev/shm must fail here, not SIGBUS later.
    int err = fd < 0 ? errno : ::posix_fallocate(fd, 0, static_cast<off_t>(size));
    if (err != 0) {
      *why = "cannot create " + std::to_string(size >> 20) + " MiB in /dev/shm (" +
             std::strerror(err) + ")";
      if (fd >= 0) {
        ::close(fd);
        ::shm_unlink(name.c_str());
        fd = -1;
      }
      name = "";  // tells the others to fall back too
    }
    store.set("accel/shm/name", std::vector<uint8_t>(name.begin(), name.end()));
  } else {
    auto v = store.get("accel/shm/name");
    name.assign(v.begin(), v.end());
    if (name.empty()) {
      *why = "rank 0 could not create the shared-memory segment";
    } else {
      fd = ::shm_open(name.c_str(), O_RDWR, 0600);
      if (fd < 0) *why = "cannot open " + name + " (" + std::strerror(errno) + ")";
    }
  }
  void* base = MAP_FAILED;
  if (fd >= 0) {
    base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (base == MAP_FAILED) *why = std::string("mmap failed (") + std::strerror(errno) + ")";
  }
  // Everyone agrees on the outcome before anyone uses the segment (or unlinks it).
  auto ok = at::full({1}, base != MAP_FAILED ? 1 : 0, at::kInt);
  std::vector<at::Tensor> tensors{ok};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::MIN;
  group.allreduce(tensors, opts)->wait();
  if (rank == 0 && !name.empty()) ::shm_unlink(name.c_str());
  if (ok.item<int>() == 0) {
    if (base != MAP_FAILED) ::munmap(base, size);
    if (why->empty()) *why = "another rank could not map the shared-memory segment";
    return nullptr;
  }
  if (rank == 0) {
    auto* h = static_cast<Header*>(base);
    h->magic = shm::kMagic;
    h->world = static_cast<uint64_t>(world);
    h->slot_bytes = slot;
  }
  return std::unique_ptr<ShmGroup>(new ShmGroup(rank, world, base, size, slot, timeout));
}

ShmGroup::ShmGroup(int rank, int world, void* base, std::size_t size, std::size_t slot_bytes,
                   std::chrono::milliseconds timeout)
    : rank_(rank),
      world_(world),
      base_(base),
      size_(size),
      slot_bytes_(slot_bytes),
      timeout_(timeout) {}

ShmGroup::~ShmGroup() { ::munmap(base_, size_); }

char* ShmGroup::slot(uint64_t generation, int rank) const {
  std::size_t set = generation % 2;
  return static_cast<char*>(base_) + data_offset(world_) +
         (set * static_cast<std::size_t>(world_) + static_cast<std::size_t>(rank)) * slot_bytes_;
}

uint64_t ShmGroup::arrive_and_wait(const Call& call) {
  uint64_t g = ++generation_;
  RankControl* ctl = controls(base_);
  const std::size_t parity = g % 2;
  const uint64_t word = shm::word_of(call.op, call.bytes);
  ctl[rank_].call_seq[parity].store(call.seq, std::memory_order_relaxed);
  ctl[rank_].call_word[parity].store(word, std::memory_order_relaxed);
  ctl[rank_].call_detail[parity].store(call.detail, std::memory_order_relaxed);
  ctl[rank_].call_where[parity].store(call.where, std::memory_order_relaxed);
  ctl[rank_].arrived.store(g, std::memory_order_release);
  shm::Pacer pacer(timeout_);
  for (int r = 0; r < world_; ++r) {
    while (ctl[r].arrived.load(std::memory_order_acquire) < g) {
      // A rank that posted an all-reduce this rank did not will never come here. Why `arrived`
      // is read again: the rank may have come, gone on, and posted the next one since it was
      // read above.
      if (pacer.slow() && ctl[r].posted.load(std::memory_order_acquire) > posts_ &&
          ctl[r].arrived.load(std::memory_order_acquire) < g)
        throw std::runtime_error(posted_mismatch(r, posts_, describe(word, call.seq)));
      if (!pacer.pause()) {
        throw std::runtime_error("local rank " + std::to_string(r) +
                                 " did not reach this collective in shared memory");
      }
    }
  }
  for (int r = 0; r < world_; ++r) {
    uint64_t their_word = ctl[r].call_word[parity].load(std::memory_order_relaxed);
    uint64_t their_seq = ctl[r].call_seq[parity].load(std::memory_order_relaxed);
    if (their_word != word || their_seq != call.seq) {
      throw std::runtime_error("mismatched collectives: rank " + std::to_string(r) + " called " +
                               describe(their_word, their_seq) + " while this rank called " +
                               describe(word, call.seq));
    }
    if (ctl[r].call_detail[parity].load(std::memory_order_relaxed) != call.detail) {
      throw std::runtime_error("mismatched collectives: rank " + std::to_string(r) + " called " +
                               describe(word, call.seq) +
                               " with another dtype, root or reduce op than this rank");
    }
    if (ctl[r].call_where[parity].load(std::memory_order_relaxed) != call.where) {
      throw std::runtime_error("mismatched collectives: rank " + std::to_string(r) + " called " +
                               describe(word, call.seq) +
                               " on a tensor at another place (shared block or private memory) "
                               "than this rank");
    }
  }
  return g;
}

void* ShmGroup::data(const Block& block, int rank) {
  return static_cast<char*>(block.base) + static_cast<std::size_t>(rank) * block.per_rank;
}

std::shared_ptr<ShmGroup::Block> ShmGroup::share(std::size_t bytes, const Call& call,
                                                 std::string* why) {
  drain();
  auto block = std::make_shared<Block>();
  block->id = ++blocks_made_;  // collective: the same count on every rank
  block->per_rank = std::max<std::size_t>(4096, (bytes + 4095) / 4096 * 4096);
  block->size = block->per_rank * static_cast<std::size_t>(world_);
  auto* header = static_cast<Header*>(base_);
  // Why a wait first: rank 0 creates the segment only once every rank is here to map it, so a
  // rank that never comes (dead, or in another collective) fails this wait before anything
  // exists in /dev/shm that could be left behind.
  arrive_and_wait(call);
  std::string name;
  struct Unlink {  // rank 0's segment goes from /dev/shm on every way out, error or not
    std::string name;
    ~Unlink() {
      if (!name.empty()) ::shm_unlink(name.c_str());
    }
  } unlink;
  if (rank_ == 0) {
    std::random_device rd;
    name = "/" + std::string(contract::kShmSegmentPrefix) + std::to_string(::getpid()) + "-b" +
           std::to_string(block->id) + "-" + std::to_string(rd());
    int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    int err = fd < 0 ? errno : ::ftruncate(fd, static_cast<off_t>(block->size)) != 0 ? errno : 0;
    if (fd >= 0) {
      ::close(fd);
      unlink.name = name;
    }
    if (err != 0) {
      *why = "cannot create " + std::to_string(block->size >> 20) + " MiB in /dev/shm (" +
             std::strerror(err) + ")";
      name.clear();
    }
    std::memset(header->block_name, 0, sizeof(header->block_name));
    std::memcpy(header->block_name, name.data(),
                std::min(name.size(), sizeof(header->block_name) - 1));
  }
  uint64_t g = arrive_and_wait(call);  // the name is published
  if (rank_ != 0) name = header->block_name;
  bool mapped = false;
  if (!name.empty()) {
    int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
    if (fd < 0) {
      *why = "cannot open " + name + " (" + std::strerror(errno) + ")";
    } else {
      // Why each rank reserves its own part: a full /dev/shm must fail here, not with SIGBUS at
      // the first gradient; and the pages land on the memory node of the rank that fills them.
      int err = ::posix_fallocate(fd, static_cast<off_t>(block->per_rank * rank_),
                                  static_cast<off_t>(block->per_rank));
      void* p = err != 0 ? MAP_FAILED
                         : ::mmap(nullptr, block->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (err == 0 && p == MAP_FAILED) err = errno;
      ::close(fd);
      if (p != MAP_FAILED) {
        block->base = p;
        mapped = true;
      } else {
        *why = "cannot reserve " + std::to_string(block->per_rank >> 20) + " MiB in /dev/shm (" +
               std::strerror(err) + ")";
      }
    }
  } else if (why->empty()) {
    *why = "rank 0 could not create the shared block";
  }
  RankControl* ctl = controls(base_);
  ctl[rank_].mapped.store(g << 1 | (mapped ? 1 : 0), std::memory_order_relaxed);
  arrive_and_wait(call);  // every rank has mapped it, or failed to
  for (int r = 0; r < world_; ++r) {
    if (ctl[r].mapped.load(std::memory_order_relaxed) != (g << 1 | 1)) {
      if (why->empty()) *why = "local rank " + std::to_string(r) + " could not map the block";
      return nullptr;  // the Block unmaps what this rank mapped
    }
  }
  blocks_.erase(std::remove_if(blocks_.begin(), blocks_.end(),
                               [](const std::weak_ptr<Block>& b) { return b.expired(); }),
                blocks_.end());
  blocks_.push_back(block);
  return block;
}

std::shared_ptr<ShmGroup::Block> ShmGroup::find_block(const at::Tensor& tensor, uint64_t* offset) {
  const auto* p = static_cast<const char*>(tensor.data_ptr());
  const std::size_t bytes = nbytes(tensor);
  for (auto& weak : blocks_) {
    auto block = weak.lock();
    if (!block) continue;
    const auto* mine = static_cast<const char*>(data(*block, rank_));
    if (p >= mine && p + bytes <= mine + block->per_rank) {
      *offset = static_cast<uint64_t>(p - mine);
      return block;
    }
  }
  return nullptr;
}

void* ShmGroup::peer_data(const at::Tensor& tensor, int r) {
  uint64_t offset = 0;
  auto block = find_block(tensor, &offset);
  if (!block || r < 0 || r >= world_) return nullptr;
  return static_cast<char*>(data(*block, r)) + offset;
}

void ShmGroup::allreduce(at::Tensor& tensor, c10d::ReduceOp op, const Call& call,
                         const at::Tensor* source, double scale) {
  drain();
  const std::size_t total = nbytes(tensor);
  if (total == 0) return;  // same shape on every rank: all of them skip
  char* data = static_cast<char*>(tensor.data_ptr());
  const char* from = source != nullptr ? static_cast<const char*>(source->data_ptr()) : data;
  if (source == nullptr && algorithm_ == Algorithm::kSplit) {
    uint64_t offset = 0;
    if (auto block = find_block(tensor, &offset)) {
      // Which block and where in it: two models' buckets may lie at the same offset of theirs.
      Call placed = call;
      placed.where = block->id << 40 | offset;
      return allreduce_in_place(tensor, op, placed, *block, offset, scale);
    }
  }
  if (source != nullptr) advise_huge_pages(data, total);
  if (algorithm_ == Algorithm::kSplit && total >= kSplitFromBytes)
    return allreduce_slots(tensor, op, call, from, scale, /*split=*/true);
  // Why a different `where`: ranks that disagree on the algorithm would otherwise pair one's
  // second wait of a chunk with the other's next chunk.
  Call copied = call;
  if (algorithm_ == Algorithm::kCopy) copied.where = kPrivate - 1;
  allreduce_slots(tensor, op, copied, from, scale, /*split=*/false);
}

// Elements [lo, hi) of every part, reduced kScratchBytes at a time into a buffer that stays in
// L1, then written to every part.
void ShmGroup::reduce_range(at::ScalarType type, char* const* part, std::size_t lo, std::size_t hi,
                            c10d::ReduceOp op, double scale) {
  const std::size_t elem = c10::elementSize(type);
  scratch_.resize(kScratchBytes);
  const std::size_t per_chunk = kScratchBytes / elem;
  std::vector<const void*> in(static_cast<std::size_t>(world_));
  for (std::size_t begin = lo; begin < hi; begin += per_chunk) {
    const std::size_t n = std::min(per_chunk, hi - begin);
    for (int r = 0; r < world_; ++r)
      in[static_cast<std::size_t>(r)] = part[static_cast<std::size_t>(r)] + begin * elem;
    reduce(type, scratch_.data(), in.data(), world_, n, op, scale);
    for (int r = 0; r < world_; ++r)
      std::memcpy(part[static_cast<std::size_t>(r)] + begin * elem, scratch_.data(), n * elem);
  }
}

// Every rank's data already lies in its part of the block: after one wait, rank r reduces the
// r-th slice from all parts and writes the result into all of them; after a second, every part
// holds the whole result. Each rank reads and writes the tensor's size once.
void ShmGroup::allreduce_in_place(at::Tensor& tensor, c10d::ReduceOp op, const Call& call,
                                  const Block& block, uint64_t offset, double scale) {
  const std::size_t elem = tensor.element_size();
  const auto count = static_cast<std::size_t>(tensor.numel());
  const auto [lo, hi] = slice_of(rank_, world_, count, elem);
  std::vector<char*> part(static_cast<std::size_t>(world_));
  for (int r = 0; r < world_; ++r)
    part[static_cast<std::size_t>(r)] = static_cast<char*>(data(block, r)) + offset;
  arrive_and_wait(call);  // every rank's data is in place
  reduce_range(tensor.scalar_type(), part.data(), lo, hi, op, scale);
  arrive_and_wait(call);  // every slice is in every part
}

// A private tensor, through the slots: per chunk, every rank copies its data into its slot.
// Copy way (one wait per chunk): every rank then reduces the whole chunk from every slot.
// Split way: rank r reduces the r-th slice from every slot into its result and into its slot of
// the other set, and every rank then copies the other slices from their owners' slots. Data read
// after generation g's wait lies in set g, as the protocol requires.
void ShmGroup::allreduce_slots(at::Tensor& tensor, c10d::ReduceOp op, const Call& call,
                               const char* from, double scale, bool split) {
  const std::size_t elem = tensor.element_size();
  const std::size_t per_chunk = std::min(slot_bytes_, kReduceChunkBytes) / elem;
  const auto total = static_cast<std::size_t>(tensor.numel());
  char* data = static_cast<char*>(tensor.data_ptr());
  std::vector<const void*> in(static_cast<std::size_t>(world_));
  for (std::size_t begin = 0; begin < total; begin += per_chunk) {
    const std::size_t count = std::min(per_chunk, total - begin);
    const uint64_t gathered = generation_ + 1, reduced = generation_ + 2;
    std::memcpy(slot(gathered, rank_), from + begin * elem, count * elem);
    arrive_and_wait(call);
    if (!split) {
      for (int r = 0; r < world_; ++r) in[static_cast<std::size_t>(r)] = slot(gathered, r);
      reduce(tensor.scalar_type(), data + begin * elem, in.data(), world_, count, op, scale);
      continue;
    }
    const auto [lo, hi] = slice_of(rank_, world_, count, elem);
    if (hi > lo) {
      for (int r = 0; r < world_; ++r)
        in[static_cast<std::size_t>(r)] = slot(gathered, r) + lo * elem;
      char* out = data + (begin + lo) * elem;
      reduce(tensor.scalar_type(), out, in.data(), world_, hi - lo, op, scale);
      std::memcpy(slot(reduced, rank_) + lo * elem, out, (hi - lo) * elem);
    }
    arrive_and_wait(call);
    for (int r = 0; r < world_; ++r) {
      if (r == rank_) continue;
      const auto [rlo, rhi] = slice_of(r, world_, count, elem);
      if (rhi > rlo)
        std::memcpy(data + (begin + rlo) * elem, slot(reduced, r) + rlo * elem, (rhi - rlo) * elem);
    }
  }
}

void ShmGroup::broadcast(at::Tensor& tensor, int root, const Call& call) {
  drain();
  const std::size_t total = nbytes(tensor);
  if (total == 0) return;
  char* data = static_cast<char*>(tensor.data_ptr());
  std::size_t begin = 0;
  do {
    std::size_t count = std::min(slot_bytes_, total - begin);
    uint64_t next = generation_ + 1;
    if (rank_ == root) std::memcpy(slot(next, root), data + begin, count);
    arrive_and_wait(call);
    if (rank_ != root) std::memcpy(data + begin, slot(next, root), count);
    begin += count;
  } while (begin < total);
}

void ShmGroup::allgather(at::Tensor& output, const at::Tensor& input, const Call& call) {
  drain();
  const std::size_t total = nbytes(input);
  if (total == 0) return;
  const char* src = static_cast<const char*>(input.data_ptr());
  char* dst = static_cast<char*>(output.data_ptr());
  advise_huge_pages(dst, total * static_cast<std::size_t>(world_));
  std::size_t begin = 0;
  do {
    std::size_t count = std::min(slot_bytes_, total - begin);
    uint64_t next = generation_ + 1;
    std::memcpy(slot(next, rank_), src + begin, count);
    arrive_and_wait(call);
    for (int r = 0; r < world_; ++r)
      std::memcpy(dst + static_cast<std::size_t>(r) * total + begin, slot(next, r), count);
    begin += count;
  } while (begin < total);
}

void ShmGroup::barrier(const Call& call) {
  drain();
  arrive_and_wait(call);
}

}  // namespace accel

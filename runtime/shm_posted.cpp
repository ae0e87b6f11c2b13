// The posted all-reduce of a tensor in a shared block (ShmGroup::post and finish, shm_group.h).
//
// Why: with the in-place all-reduce every rank waits at each bucket until the slowest has
// finished the backward that fills it. On a machine whose cores do not run at one speed (a VM's
// vCPUs, hybrid cores, a busy neighbour) that wait is lost time. Posting lets a rank go on with
// its backward; the reduction itself is cut into chunks that the ranks take from a shared
// counter, so the rank that arrives first does the work while the late one catches up.
//
// Protocol, for post number k (the same numbering on every rank, posts being issued in the same
// order): rank r writes its record of k (what it posted, for the mismatch check), then publishes
// posted = k + 1 with release order, after its part holds its data. finish(k) waits until every
// rank has published k + 1, checks the records, then takes chunks from work(k).claimed until
// none is left, reducing each in rank order and writing the result into every part, and counts
// each in work(k).done; it returns once done counts them all. A rank posts k only after it has
// finished k - kPostRing, and finishes k only after every rank posted k, so a record or counter
// slot is reused only once every rank is done with its last use.
#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/shm_group.h"
#include "runtime/shm_layout.h"

namespace accel {
namespace {

using shm::kCountBits;
using shm::kCountMask;

// Each chunk is this much of the tensor: about 30 us of work, many times a counter's cost.
constexpr std::size_t kClaimBytes = 256u << 10;

// `counter`'s count for the post tagged `tag` (0 while it still holds an older post's).
uint64_t count_for(const std::atomic<uint64_t>& counter, uint64_t tag) {
  const uint64_t v = counter.load(std::memory_order_acquire);
  return v >> kCountBits == tag ? v & kCountMask : 0;
}

// Adds one to `counter`'s count for `tag` if it is below `limit`; returns the count before, or
// `limit` when none was left.
uint64_t take_one(std::atomic<uint64_t>& counter, uint64_t tag, uint64_t limit) {
  uint64_t v = counter.load(std::memory_order_acquire);
  for (;;) {
    const uint64_t n = v >> kCountBits == tag ? v & kCountMask : 0;
    if (n >= limit) return limit;
    if (counter.compare_exchange_weak(v, tag << kCountBits | (n + 1), std::memory_order_acq_rel))
      return n;
  }
}

// The error for rank r in collective `theirs` (posted, or waiting in shared memory's slots) while
// this rank is in `mine`: the same call (op, number and size) means they differ in where the
// tensor lies, since only a tensor in a shared block is posted.
std::string mismatch(int r, const std::string& theirs, const std::string& mine) {
  if (theirs == mine) {
    return "mismatched collectives: rank " + std::to_string(r) + " called " + mine +
           " on a tensor at another place (shared block or private memory) than this rank";
  }
  return "mismatched collectives: rank " + std::to_string(r) + " called " + theirs +
         " while this rank called " + mine;
}

}  // namespace

std::optional<uint64_t> ShmGroup::post(at::Tensor& tensor, c10d::ReduceOp op, const Call& call,
                                       double scale) {
  throw_if_failed();
  if (algorithm_ != Algorithm::kSplit || tensor.numel() == 0 || !can_reduce(tensor) ||
      (op != c10d::ReduceOp::SUM && op != c10d::ReduceOp::MAX && op != c10d::ReduceOp::MIN))
    return std::nullopt;
  uint64_t offset = 0;
  auto block = find_block(tensor, &offset);
  if (!block) return std::nullopt;
  const std::size_t count = static_cast<std::size_t>(tensor.numel());
  const std::size_t per = kClaimBytes / tensor.element_size();
  if ((count + per - 1) / per > kCountMask)
    throw std::runtime_error("a posted all-reduce of " + std::to_string(count) +
                             " elements is too large for shared memory's chunk counter");
  // The slot this post takes was last used by post (number - kPostRing): finish it first.
  while (posts_ - (outstanding_.empty() ? posts_ : outstanding_.front().number) >= shm::kPostRing)
    finish_oldest();  // the error names the post it was
  Posted p{posts_,
           std::move(block),
           offset,
           tensor.scalar_type(),
           count,
           op,
           scale,
           call,
           shm::word_of(call.op, call.bytes)};
  // Which block and where in it, as allreduce() checks it.
  p.call.where = p.block->id << 40 | offset;
  const uint64_t number = posts_++;
  auto& rec = shm::record(base_, world_, rank_, number);
  rec.tag.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  rec.seq.store(call.seq, std::memory_order_relaxed);
  rec.word.store(p.word, std::memory_order_relaxed);
  rec.detail.store(call.detail, std::memory_order_relaxed);
  rec.where.store(p.call.where, std::memory_order_relaxed);
  rec.tag.store(number + 1, std::memory_order_release);
  // Release: every write to this rank's part (the gradients) is seen by whoever reads it.
  shm::controls(base_)[rank_].posted.store(number + 1, std::memory_order_release);
  outstanding_.push_back(std::move(p));
  return number;
}

void ShmGroup::finish(uint64_t ticket) {
  throw_if_failed();
  while (!outstanding_.empty() && outstanding_.front().number <= ticket) finish_oldest();
}

void ShmGroup::drain() {
  throw_if_failed();
  while (!outstanding_.empty()) finish_oldest();
}

void ShmGroup::throw_if_failed() const {
  if (!failed_.empty())
    throw std::runtime_error("an earlier all-reduce in shared memory failed: " + failed_);
}

std::string ShmGroup::posted_mismatch(int r, uint64_t number, const std::string& mine) const {
  const auto theirs = shm::read_record(shm::record(base_, world_, r, number), number + 1);
  return mismatch(r, theirs ? shm::describe(theirs->word, theirs->seq) : "an all-reduce", mine);
}

void ShmGroup::finish_oldest() {
  throw_if_failed();
  Posted p = std::move(outstanding_.front());
  outstanding_.pop_front();
  try {
    finish_posted(p);
  } catch (const std::exception& e) {
    failed_ = shm::describe(p.word, p.call.seq) + ": " + e.what();
    throw std::runtime_error(failed_);
  }
}

void ShmGroup::finish_posted(const Posted& p) {
  shm::RankControl* ctl = shm::controls(base_);
  const uint64_t tag = p.number + 1;
  auto mine = [&] { return shm::describe(p.word, p.call.seq); };  // for errors only
  shm::Pacer pacer(timeout_);
  for (int r = 0; r < world_; ++r) {
    while (ctl[r].posted.load(std::memory_order_acquire) < tag) {
      // A rank waiting in another collective will not post this one.
      // Why `posted` is read again: the rank may have posted this one, finished it and gone on
      // to the next collective since it was read above.
      const uint64_t g = ctl[r].arrived.load(std::memory_order_acquire);
      if (pacer.slow() && g > generation_ && ctl[r].posted.load(std::memory_order_acquire) < tag) {
        const std::size_t parity = g % 2;
        throw std::runtime_error(
            mismatch(r,
                     shm::describe(ctl[r].call_word[parity].load(std::memory_order_relaxed),
                                   ctl[r].call_seq[parity].load(std::memory_order_relaxed)),
                     mine()));
      }
      if (!pacer.pause()) {
        throw std::runtime_error("local rank " + std::to_string(r) +
                                 " did not reach this collective in shared memory");
      }
    }
  }
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    // Nothing: that rank finished this post and rewrote its record, after every rank posted.
    const auto theirs = shm::read_record(shm::record(base_, world_, r, p.number), tag);
    if (!theirs) continue;
    if (theirs->word != p.word || theirs->seq != p.call.seq)
      throw std::runtime_error(mismatch(r, shm::describe(theirs->word, theirs->seq), mine()));
    if (theirs->detail != p.call.detail || theirs->where != p.call.where) {
      throw std::runtime_error("mismatched collectives: rank " + std::to_string(r) + " called " +
                               mine() +
                               " with another dtype, reduce op or shared block than this rank");
    }
  }
  std::vector<char*> part(static_cast<std::size_t>(world_));
  for (int r = 0; r < world_; ++r)
    part[static_cast<std::size_t>(r)] = static_cast<char*>(data(*p.block, r)) + p.offset;
  const std::size_t per = kClaimBytes / c10::elementSize(p.type);
  const uint64_t chunks = (p.count + per - 1) / per;
  auto& work = shm::work(base_, world_, p.number);
  for (;;) {
    const uint64_t c = take_one(work.claimed, tag, chunks);
    if (c == chunks) break;
    const std::size_t lo = static_cast<std::size_t>(c) * per;
    reduce_range(p.type, part.data(), lo, std::min(p.count, lo + per), p.op, p.scale);
    take_one(work.done, tag, chunks);  // release: the written chunk is seen with the count
  }
  shm::Pacer done(timeout_);
  while (count_for(work.done, tag) < chunks) {
    if (!done.pause()) {
      throw std::runtime_error(
          "another local rank took a part of this all-reduce in shared memory and did not "
          "finish it within the collective timeout (it stopped or hangs)");
    }
  }
}

}  // namespace accel

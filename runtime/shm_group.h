// ShmGroup: collectives between the processes of one machine through a shared-memory segment,
// for small and medium CPU tensors where gloo's per-call cost (~1 ms,
// reference/anchors-measured.md) dominates a training step. Hand-written because no packaged
// library offers it for c10d on CPU (NCCL's SHM transport, oneCCL and DeepSpeed's shm allreduce are
// the prior art).
//
// Contract: the same collectives, in the same order, with the same results on every rank as
// gloo's (sums are taken in rank order 0..n-1 on every rank, so all ranks get bitwise-equal
// results; they may differ from gloo's ring order by float rounding). Blocking, one at a time
// (but for the posted all-reduce), called from one thread per process (Comm serializes).
//
// Protocol: two sets of per-rank slots alternate by generation; each rank publishes its
// generation counter after writing its slot and waits until every rank has published it, then
// reads. A rank only arrives at generation g after it finished reading generation g-1, so the
// slot set of generation g+1 (== g-1's) is free when any rank starts writing it.
//
// All-reduce: below a few hundred KiB every rank copies its data into its slot and reduces the
// whole buffer from every slot (one wait). Above that the reduction is split: rank r reduces
// only the r-th slice of each chunk and publishes it, and every rank copies the slices back
// (reduce-scatter + all-gather, two waits per chunk; each rank does 1/n of the arithmetic).
// A tensor that lives in a shared block (share(): the gradient buckets) is not copied in at all:
// rank r reads the r-th slice from every rank's block and writes the sum into all of them. Or,
// posted (post() and finish(), shm_posted.cpp): no rank waits for the others at the start, and
// the ranks take chunks of the sum from a shared counter, the earliest doing the most.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <type_traits>
#include <vector>

namespace accel {

// What libaccel runs its collectives through: Debian's libtorch (1.13) makes ProcessGroupGloo and
// ProcessGroupNCCL subclasses of c10d::ProcessGroup, later libtorch releases of c10d::Backend;
// both have the allreduce/broadcast/allgather/barrier used here.
using CollectiveGroup = std::conditional_t<std::is_base_of_v<c10d::Backend, c10d::ProcessGroupGloo>,
                                           c10d::Backend, c10d::ProcessGroup>;

class ShmGroup {
 public:
  // Maps one segment shared by `world` local ranks (rank 0 creates it, publishes its name in
  // `store`, and unlinks it once everyone has it mapped, so a crash leaks nothing). Returns null,
  // with `why` set, when shared memory is unavailable (the caller falls back to gloo).
  static std::unique_ptr<ShmGroup> create(c10d::Store& store, CollectiveGroup& group, int rank,
                                          int world, std::chrono::milliseconds timeout,
                                          std::string* why);
  ~ShmGroup();

  // CPU, contiguous, and a dtype the reduction loops handle (float, double, bf16, fp16, int32,
  // int64).
  // bf16 and fp16 are summed in fp32 and rounded once.
  static bool can_reduce(const at::Tensor& t);
  // CPU and contiguous (bytes are moved as they are).
  static bool can_move(const at::Tensor& t);

  // Identifies a collective so that ranks calling different ones fail instead of exchanging
  // garbage: the op, its payload, and Comm's sequence number.
  struct Call {
    const char* op;
    uint64_t seq;
    uint64_t bytes;
    uint64_t detail = 0;  // dtype, root and reduce op: must match too (see Comm::call_of)
    // Where the tensor lies in a shared block (its offset in the rank's part), or kPrivate:
    // must match too, since the in-place all-reduce reads peers' blocks at this offset.
    uint64_t where = kPrivate;
  };
  static constexpr uint64_t kPrivate = ~uint64_t{0};

  // Memory every local rank maps: each rank gets `bytes` of its own, and the others can read and
  // write it. Unmapped when the last reference goes (tensors made on it hold one).
  struct Block;
  // Collective (all local ranks, same bytes, in the same order as the other collectives): a new
  // zeroed block, or null on every rank when /dev/shm cannot hold world * bytes.
  std::shared_ptr<Block> share(std::size_t bytes, const Call& call, std::string* why);
  // Where `tensor`, which lies in this rank's part of a shared block, lies in rank r's part;
  // null when it does not lie in one.
  void* peer_data(const at::Tensor& tensor, int r);
  // This rank's part of `block`.
  void* my_part(const Block& block) const { return data(block, rank_); }
  // Rank r's part of `block`; the parts lie back to back, rank 0's first.
  void* part(const Block& block, int r) const { return data(block, r); }

  // How an all-reduce is done: split (the default) reduces a shared block's tensor in place and
  // a private one above a threshold through the slots, each rank 1/n of it; copy copies every
  // tensor into the slots and every rank reduces everything. Comm::choose_allreduce times both
  // at prepare (ACCEL_SHM_ALLREDUCE forces one). Every rank of the group must use the same.
  enum class Algorithm { kSplit, kCopy };
  void set_algorithm(Algorithm a) { algorithm_ = a; }

  // Throw std::runtime_error when a peer does not arrive within the timeout, or arrives in a
  // different collective (the message names both).
  // Reduces into `tensor`; with `source`, the local contribution is read from there instead
  // (out of place: `tensor` may be uninitialized memory of the same shape and dtype).
  // A sum is multiplied by `scale` in the same pass (float types; gradient averaging).
  void allreduce(at::Tensor& tensor, c10d::ReduceOp op, const Call& call,
                 const at::Tensor* source = nullptr, double scale = 1.0);
  static bool can_scale(const at::Tensor& t) { return t.is_floating_point(); }

  // The posted all-reduce (a sum, max or min of a tensor in a shared block, split algorithm): the
  // gradient buckets' way. post() publishes that this rank's part is ready and returns at once;
  // finish() then does a share of the work and returns once every rank's part holds the result.
  // The work is handed out in 256 KiB chunks to whichever rank asks first, so a rank that
  // finished its backward early reduces more of it while a slower one still computes, instead of
  // waiting for it. The same bits as allreduce(): each chunk is reduced in rank order by whoever
  // takes it. Posts are finished in the order posted; any other collective of this group
  // finishes the outstanding ones first. The caller must not touch `tensor` until finish().
  // Returns the ticket to finish, or nothing (and does nothing) when `tensor` is empty, lies in
  // no shared block, or the copy algorithm is in use: the caller then runs allreduce().
  std::optional<uint64_t> post(at::Tensor& tensor, c10d::ReduceOp op, const Call& call,
                               double scale = 1.0);
  // Finishes the posts up to and including `ticket` (nothing if they are finished already).
  void finish(uint64_t ticket);
  void broadcast(at::Tensor& tensor, int root, const Call& call);
  void allgather(at::Tensor& output, const at::Tensor& input, const Call& call);
  void barrier(const Call& call);

  std::size_t slot_bytes() const { return slot_bytes_; }

 private:
  ShmGroup(int rank, int world, void* base, std::size_t size, std::size_t slot_bytes,
           std::chrono::milliseconds timeout);
  char* slot(uint64_t generation, int rank) const;
  // Publishes this rank's arrival (and `call`) at the next generation, waits for every rank's,
  // and checks that they all are in the same collective.
  uint64_t arrive_and_wait(const Call& call);
  static void* data(const Block& block, int rank);
  // The block and offset `tensor` lies at, or null (Call::where = kPrivate).
  std::shared_ptr<Block> find_block(const at::Tensor& tensor, uint64_t* offset);
  // Elements [lo, hi) of every rank's `part`, reduced and written back to every part.
  void reduce_range(at::ScalarType type, char* const* part, std::size_t lo, std::size_t hi,
                    c10d::ReduceOp op, double scale);
  struct Posted {
    uint64_t number = 0;  // posts before it on this rank (and on every rank)
    std::shared_ptr<Block> block;
    uint64_t offset = 0;  // in every rank's part
    at::ScalarType type;
    std::size_t count = 0;  // elements
    c10d::ReduceOp op;
    double scale = 1.0;
    Call call;
    uint64_t word = 0;  // shm::word_of(call)
  };
  // Finishes the oldest outstanding post. After it failed, this and every later post, finish
  // and collective fail at once, naming the first failure: a peer still missing must not cost
  // each remaining bucket the whole timeout again, and a post removed by the failure must not
  // read as finished.
  void finish_oldest();
  // Finishes every outstanding post: the start of every other collective.
  void drain();
  void throw_if_failed() const;
  void finish_posted(const Posted& p);
  // The error for rank r, which posted all-reduce `number` while this rank called `mine`.
  std::string posted_mismatch(int r, uint64_t number, const std::string& mine) const;
  void allreduce_in_place(at::Tensor& tensor, c10d::ReduceOp op, const Call& call,
                          const Block& block, uint64_t offset, double scale);
  // A private tensor through the slots, split (reduce-scatter + all-gather) or not.
  void allreduce_slots(at::Tensor& tensor, c10d::ReduceOp op, const Call& call, const char* from,
                       double scale, bool split);

  int rank_, world_;
  void* base_;
  std::size_t size_, slot_bytes_;
  std::chrono::milliseconds timeout_;
  uint64_t generation_ = 0;
  Algorithm algorithm_ = Algorithm::kSplit;
  std::vector<std::weak_ptr<Block>> blocks_;
  uint64_t blocks_made_ = 0;
  std::vector<char> scratch_;  // one reduced chunk, before it is written to every block
  std::deque<Posted> outstanding_;
  uint64_t posts_ = 0;  // posted so far
  std::string failed_;  // the first posted all-reduce that failed, and why
};

}  // namespace accel

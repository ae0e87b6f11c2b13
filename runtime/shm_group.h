// ShmGroup: collectives between the processes of one machine through a shared-memory segment,
// for small and medium CPU tensors where gloo's per-call cost (~1 ms,
// reference/anchors-measured.md) dominates a training step. Hand-written because no packaged
// library offers it for c10d on CPU (NCCL's SHM transport, oneCCL and DeepSpeed's shm allreduce are
// the prior art).
//
// Contract: the same collectives, in the same order, with the same results on every rank as
// gloo's (sums are taken in rank order 0..n-1 on every rank, so all ranks get bitwise-equal
// results; they may differ from gloo's ring order by float rounding). Blocking, one at a time,
// called from one thread per process (Comm serializes).
//
// Protocol: two sets of per-rank slots alternate by generation; each rank publishes its
// generation counter after writing its slot and waits until every rank has published it, then
// reads. A rank only arrives at generation g after it finished reading generation g-1, so the
// slot set of generation g+1 (== g-1's) is free when any rank starts writing it.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <type_traits>

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

  // CPU, contiguous, and a dtype the reduction loops handle (float, double, int32, int64).
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
  };

  // Throw std::runtime_error when a peer does not arrive within the timeout, or arrives in a
  // different collective (the message names both).
  // Reduces into `tensor`; with `source`, the local contribution is read from there instead
  // (out of place: `tensor` may be uninitialized memory of the same shape and dtype).
  // A sum is multiplied by `scale` in the same pass (float types; gradient averaging).
  void allreduce(at::Tensor& tensor, c10d::ReduceOp op, const Call& call,
                 const at::Tensor* source = nullptr, double scale = 1.0);
  static bool can_scale(const at::Tensor& t) { return t.is_floating_point(); }
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

  int rank_, world_;
  void* base_;
  std::size_t size_, slot_bytes_;
  std::chrono::milliseconds timeout_;
  uint64_t generation_ = 0;
};

}  // namespace accel

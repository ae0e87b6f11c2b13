// Comm: every collective libaccel issues goes through here, so each one carries the job's single
// timeout, a sequence number and a name that appear in the error when it fails or hangs.
// Thread: any thread may issue collectives, but all ranks must issue them in the same order
// (c10d's rule); sequence numbers are per process and count in that order.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <utility>
#include <vector>

#include "contract/progress_page.h"
#include "contract/worker_contract.h"
#include "runtime/progress.h"
#include "runtime/shm_group.h"

namespace accel {

// A job over several machines with the same number of ranks on each, numbered node by node:
// collectives go through shared memory between the ranks of a machine and through gloo between
// one leader per machine (its local rank 0), instead of gloo between all ranks.
struct Hierarchy {
  int node = 0, nodes = 1;                      // this machine's index and the machine count
  int local_rank = 0, local_world = 1;          // this rank on its machine, and ranks per machine
  std::unique_ptr<ShmGroup> shm;                // this machine's ranks
  c10::intrusive_ptr<CollectiveGroup> leaders;  // the leaders' group; null on other ranks
};

class Comm {
 public:
  // A collective in flight. Pass it to wait() exactly once.
  struct Pending {
    c10::intrusive_ptr<c10d::Work> work;
    const char* op = "";
    std::uint64_t seq = 0;
    std::size_t bytes = 0;
    std::chrono::steady_clock::time_point started;
    at::Tensor divide;  // divided by world_size after the wait (gloo path of an average)
    // Hierarchical all-reduce: the machine's leader broadcasts the result to its ranks in wait().
    at::Tensor node_broadcast;
    std::uint64_t detail = 0;
    // Shared memory's posted all-reduce: its ticket + 1, finished in wait() (0: none).
    std::uint64_t posted = 0;
  };

  // A single process: every collective is the identity and nothing is created.
  Comm() = default;
  // `store` holds the desync keys; `group` runs the collectives.
  // `shm` (may be null) carries the collectives it can between local ranks; gloo the rest.
  Comm(int rank, int world_size, std::chrono::milliseconds timeout,
       c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<CollectiveGroup> group,
       std::unique_ptr<ShmGroup> shm = nullptr, std::unique_ptr<Hierarchy> hierarchy = nullptr);
  ~Comm();
  // False for the single process's Comm: every collective is then the identity.
  bool has_group() const { return group_ != nullptr; }
  bool uses_shared_memory() const { return shm_ != nullptr; }
  bool hierarchical() const { return hier_ != nullptr; }

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // With `average`, the sum is divided by world_size() by the time wait() returns.
  Pending allreduce_async(at::Tensor& tensor, c10d::ReduceOp op, bool average = false);
  void wait(Pending& pending);

  void allreduce(at::Tensor& tensor, c10d::ReduceOp op);
  // The reduction of every rank's `input` as a new tensor; `input` is left as it is.
  at::Tensor allreduce_copy(const at::Tensor& input, c10d::ReduceOp op);
  void broadcast(at::Tensor& tensor, int root);
  // `output` is [world_size * n, ...] for an `input` of [n, ...]; rank r's part lands at r*n.
  void allgather(at::Tensor& output, const at::Tensor& input);
  void barrier();

  // Zeroed CPU buffers of these sizes and options, placed where the machine's ranks can read each
  // other's (a shared-memory block): an all-reduce of one of them, or of a part of one, reads the
  // peers' data where it lies instead of copying it in. Collective: every rank asks for the same
  // sizes in the same order. Private memory where there is no shared memory (one process, gloo,
  // a CUDA buffer, /dev/shm too small), so the caller need not care which it got.
  // `what` names the buffers in rank 0's line when they stay private ("gradient buckets"), and
  // `instead` says what happens then.
  std::vector<at::Tensor> shared_zeros(
      const std::vector<std::pair<int64_t, at::TensorOptions>>& buffers, const std::string& what,
      const std::string& instead = "they go through shared memory's slots instead");

  // One zeroed CPU buffer for the whole machine, at its own address in every rank: the same
  // memory, each rank's writes seen by all (order them with collectives). Each rank reserves
  // 1/world of its pages. Collective. Undefined where there is no shared memory between all the
  // ranks (one process, several machines, /dev/shm too small: rank 0 then says so, naming `what`
  // and what happens `instead`).
  at::Tensor machine_zeros(int64_t numel, const at::TensorOptions& options, const std::string& what,
                           const std::string& instead);

  // Rank r's copy of `t`, a tensor in a shared_zeros() buffer, on a job whose ranks all share
  // this machine's memory: a view of that rank's memory at the same place, valid while `t` is.
  // Reading it is only safe between collectives that order the writer and the reader (a barrier
  // after the peer wrote, and another before it writes again). Undefined where `t` is private.
  at::Tensor peer_part(const at::Tensor& t, int rank);

  // Picks the faster of shared memory's two all-reduce algorithms (ShmGroup::Algorithm) for
  // tensors like `sample` (a gradient bucket) on this machine: times the all-reduce of `sample`
  // each way (best of 3, after one untimed), takes each way's slowest rank, and keeps the faster
  // way on every rank; the results are the same bits either way. `sample` ends as it was.
  // Collective. Returns "split 1.20 ms, copy 2.31 ms: split" for the log, or "" when nothing was
  // timed: one process, no shared memory (or over several machines), a choice already made, a
  // sample under 1 MiB (split is kept), or ACCEL_SHM_ALLREDUCE set (it forces one).
  std::string choose_allreduce(at::Tensor& sample);

  // Counts collectives issued so far (the next one gets this number).
  std::uint64_t next_sequence() const { return seq_.load(); }

 private:
  Pending start(const char* op, std::size_t bytes);
  [[noreturn]] void fail(const Pending& pending, const std::string& cause);
  // Runs `call`; an exception from it becomes fail(): a CollectiveError naming the collective.
  // Its time counts as time blocked in collectives (the progress page's).
  template <class F>
  void guarded(const Pending& pending, F&& call) {
    auto t0 = progress::monotonic_ns();
    try {
      std::forward<F>(call)();
    } catch (const std::exception& e) {
      progress::collective_waited(progress::monotonic_ns() - t0);
      fail(pending, e.what());
    }
    progress::collective_waited(progress::monotonic_ns() - t0);
  }
  std::string desync_report(const Pending& pending);
  // The hierarchical forms (hier_ set; shared memory can carry the tensor).
  void hier_broadcast(at::Tensor& tensor, int root, const Pending& p);
  void hier_allgather(at::Tensor& output, const at::Tensor& input, const Pending& p);
  void hier_barrier(const Pending& p);

  int rank_ = 0;
  int world_size_ = 1;
  std::chrono::milliseconds timeout_{contract::kDefaultCollectiveTimeout};
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<CollectiveGroup> group_;
  std::unique_ptr<ShmGroup> shm_;
  std::unique_ptr<Hierarchy> hier_;
  std::atomic<std::uint64_t> seq_{0};
  bool trace_ = false;  // ACCEL_TRACE_COLLECTIVES=1: one stderr line per collective
  bool allreduce_chosen_ = false;
};

// "2.5 s", "30 min": for messages.
std::string format_duration(std::chrono::milliseconds d);

}  // namespace accel

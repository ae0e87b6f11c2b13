// Which backend a job's process group uses, decided by every rank alike: each rank reports its
// device (CPU, or which GPU of which host) and its ACCEL_BACKEND through the job's store, and
// every rank reads the same totals and so makes the same choice (or throws the same ConfigError),
// where a choice made from one machine's view could mix NCCL and gloo ranks and hang.
// Thread: the State's constructor; no shared state.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace accel::detail {

// What one rank brings to the choice.
struct BackendVote {
  bool cuda = false;  // trains on a GPU
  // The GPU's identity on its machine ("host/<CUDA_VISIBLE_DEVICES entry>"): two ranks with the
  // same one share a GPU. Unused without cuda.
  std::string gpu;
  std::string asked = "auto";  // ACCEL_BACKEND: auto | nccl | gloo
};

// Every rank's votes added up.
struct BackendTally {
  int64_t world = 0;
  int64_t cpu = 0;         // ranks that train on the CPU
  int64_t shared_gpu = 0;  // ranks whose GPU an earlier-counted rank also uses
  int64_t asked_nccl = 0;  // ranks with ACCEL_BACKEND=nccl
  int64_t asked_gloo = 0;  // ranks with ACCEL_BACKEND=gloo
};

// Adds `mine` to the job's tally under `store` and waits (up to `timeout`) until all `world`
// ranks did; every rank gets the same totals. O(1) store calls per rank. Throws what the store
// throws (a rank that never votes: a timeout).
BackendTally tally_backend_votes(c10d::Store& store, int world, const BackendVote& mine,
                                 std::chrono::milliseconds timeout);

// NCCL or gloo for the whole job, from the totals alone. Throws ConfigError, with what to change,
// for what cannot work: ranks on the CPU beside ranks on a GPU, ranks asking for different
// backends, NCCL without a GPU or with ranks that share one. `why_cpu` says why this rank is on
// the CPU (for the NCCL-without-GPU message).
struct BackendChoice {
  bool nccl = false;
  std::string note;  // for rank 0 to log (ranks share a GPU, so gloo), or empty
};
BackendChoice choose_backend(const BackendTally& tally, const std::string& why_cpu);

// "host/<id>": the GPU that device `index` of this process is, as CUDA_VISIBLE_DEVICES names it
// (its index when unset), on this host.
std::string gpu_identity(int index);

}  // namespace accel::detail

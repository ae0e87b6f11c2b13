// accel::State: who this process is in the job (from the worker environment,
// docs/worker-environment.md) and the c10d process group it talks through. One per process, shared
// by every Accelerator.
#pragma once

#include <torch/types.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace accel {

class Comm;

enum class DistributedType { kNo, kMultiCpu, kMultiGpu };
std::string to_string(DistributedType type);

// Overrides of what the environment says; unset fields come from the environment.
struct StateOptions {
  std::optional<bool> cpu{};  // ACCEL_USE_CPU / ACCELERATE_USE_CPU
  std::optional<std::chrono::milliseconds> collective_timeout{};  // ACCEL_COLLECTIVE_TIMEOUT
};

// Invariant: immutable after construction, except the process group it owns (thread-safe c10d).
class State {
 public:
  // Returns the process's State, creating it (and the process group) on first use. Options given
  // after the first call must agree with the first, or ConfigError is thrown.
  static std::shared_ptr<State> shared(const StateOptions& options = {});

  explicit State(const StateOptions& options);
  ~State();
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  int process_index() const { return rank_; }
  int local_process_index() const { return local_rank_; }
  int num_processes() const { return world_size_; }
  int local_num_processes() const { return local_world_size_; }
  int node_rank() const { return node_rank_; }
  bool is_main_process() const { return rank_ == 0; }
  bool is_local_main_process() const { return local_rank_ == 0; }
  bool is_last_process() const { return rank_ == world_size_ - 1; }
  // True when collectives go through a process group: more than one process, or one process
  // with ACCEL_GROUP_OF_ONE=1 (accel test's way to exercise the backend on a single rank).
  bool use_distributed() const { return distributed_; }
  // What the collectives run through: "nccl", "gloo", "shared memory" (the machine's ranks),
  // "shared memory + gloo" (several machines), or "none" (a single process).
  const std::string& backend() const { return backend_; }
  DistributedType distributed_type() const { return type_; }
  torch::Device device() const { return device_; }
  std::chrono::milliseconds collective_timeout() const { return timeout_; }
  bool debug() const { return debug_; }

  // The communicator of all processes; a single process gets one that does no I/O.
  Comm& comm() { return *comm_; }

 private:
  int rank_ = 0;
  int local_rank_ = 0;
  int world_size_ = 1;
  int local_world_size_ = 1;
  int node_rank_ = 0;
  bool debug_ = false;
  bool cpu_ = false;
  bool distributed_ = false;
  std::string backend_ = "none";
  DistributedType type_ = DistributedType::kNo;
  torch::Device device_{torch::kCPU};
  // set by the constructor (ACCEL_COLLECTIVE_TIMEOUT or its default)
  std::chrono::milliseconds timeout_{};
  std::unique_ptr<Comm> comm_;
  std::function<void()> shutdown_;  // the NCCL group's shutdown, where libtorch has one
};

}  // namespace accel

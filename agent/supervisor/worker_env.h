// The worker environment contract (docs/worker-environment.md): torchrun's variables,
// so `init_process_group("env://")` works unchanged, HF Accelerate's, and accel's own.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "contract/worker_contract.h"

namespace accel::supervisor {

using EnvMap = std::map<std::string, std::string, std::less<>>;

// Which worker this is within the job.
struct WorkerIdentity {
  int rank = 0;              // global rank
  int local_rank = 0;        // rank on this node
  int local_world_size = 1;  // workers on this node
  int world_size = 1;        // workers in the job
  int group_rank = 0;        // this node's rank
  int group_world_size = 1;  // nodes in the job
};

// What every worker of one attempt shares.
struct JobEnv {
  std::string job_id;
  std::string master_addr;
  int master_port = 0;
  // True: the launcher / node agent serves the TCPStore at MASTER_ADDR:MASTER_PORT and every
  // rank is a client (as under torchrun). False: rank 0 hosts it (c10d's env:// default).
  bool agent_store = true;
  int restart_count = 0;
  int max_restarts = 0;
  // From the configuration (JobSpec::worker_settings): variable -> value; "" unsets it.
  std::map<std::string, std::string> settings;
  int omp_num_threads = 0;  // 0: 1 when local_world_size > 1 and unset in `base`, else inherit
};

// Why `--env KEY=...` cannot set `key` because accel sets it for each worker (RANK, MASTER_PORT,
// ...) or it is the control plane's token; nullopt otherwise. (Variables that come from
// configuration keys: config::set_by_key.)
std::optional<std::string> reserved_worker_variable(std::string_view key);

// ACCEL_KEEP_FREED_MEMORY's value `value` (null: unset) as libaccel reads it: true when unset or
// empty; nullopt when it is neither true nor false.
std::optional<bool> keeps_freed_memory(const std::string* value);

// Why the value `value` of the worker variable `key` would be refused where it is read, or nullopt:
// ACCEL_KEEP_FREED_MEMORY must be true or false (accel-launch reads it for Python workers too,
// which would not refuse it themselves).
std::optional<std::string> worker_value_problem(std::string_view key, const std::string& value);

// Adds libaccel's malloc thresholds (contract/malloc_tuning.h) to GLIBC_TUNABLES in a worker's
// environment `env`, unless its ACCEL_KEEP_FREED_MEMORY is off or invalid, or `env` already sets
// glibc's malloc (GLIBC_TUNABLES's glibc.malloc.*, or a MALLOC_*_ variable, even empty).
void give_malloc_thresholds(EnvMap& env);

// `base` (the launcher's own environment) plus the job's settings (each with its HF Accelerate
// alias) plus the contract's per-worker variables, which always win. Only
// TORCH_NCCL_ASYNC_ERROR_HANDLING and OMP_NUM_THREADS may come from `base` (torchrun's rules).
// GLIBC_TUNABLES gets libaccel's malloc thresholds (contract/malloc_tuning.h) unless
// ACCEL_KEEP_FREED_MEMORY is off or the environment already sets glibc's malloc.
// `error_file` is where the worker reports a fatal error (ACCEL_ERROR_FILE and
// TORCHELASTIC_ERROR_FILE); empty leaves both unset. A setting whose value is empty removes the
// variable inherited from `base`, so a flag that turned it off is not undone.
EnvMap build_worker_env(const EnvMap& base, const WorkerIdentity& id, const JobEnv& job,
                        const std::string& error_file);

}  // namespace accel::supervisor

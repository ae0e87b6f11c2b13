// The worker environment contract (DESIGN §4, docs/worker-environment.md): torchrun's variables,
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
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // True: the launcher / node agent serves the TCPStore at MASTER_ADDR:MASTER_PORT and every
  // rank is a client (as under torchrun). False: rank 0 hosts it (c10d's env:// default).
  bool agent_store = true;
  int restart_count = 0;
  int max_restarts = 0;
  std::string mixed_precision = "no";  // no | fp16 | bf16
  int gradient_accumulation_steps = 1;
  bool use_cpu = false;
  bool debug = false;
  // ACCEL_COLLECTIVE_TIMEOUT, as libaccel parses it (the launchers set it from the config).
  std::string collective_timeout =
      std::to_string(contract::kDefaultCollectiveTimeout.count()) + "ms";
  std::string checkpoint_dir{};  // ACCEL_CHECKPOINT_DIR, an absolute path; empty: unset
  int checkpoint_interval = 0;   // ACCEL_CHECKPOINT_INTERVAL when > 0; otherwise unset
  int omp_num_threads = 0;       // 0: 1 when local_world_size > 1 and unset in `base`, else inherit
};

// Why `--env KEY=...` cannot set `key`, or nullopt when it can: a variable the launcher sets for
// each worker (RANK, MASTER_PORT, ...) or from a configuration key (then the flag to use), or the
// control plane's token.
std::optional<std::string> reserved_worker_variable(std::string_view key);

// `base` (the launcher's own environment) plus the contract's variables. Variables of the
// contract always override `base`, except TORCH_NCCL_ASYNC_ERROR_HANDLING and OMP_NUM_THREADS,
// which the user may set (torchrun's rules). `error_file` is where the worker reports a fatal
// error (ACCEL_ERROR_FILE and TORCHELASTIC_ERROR_FILE); empty leaves both unset. Likewise an
// empty checkpoint_dir or a zero checkpoint_interval removes its variable inherited from `base`.
EnvMap build_worker_env(const EnvMap& base, const WorkerIdentity& id, const JobEnv& job,
                        const std::string& error_file);

}  // namespace accel::supervisor

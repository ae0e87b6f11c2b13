// The worker environment (docs/worker-environment.md), parsed once into one struct: what the
// launcher or node agent told this worker. Errors are ConfigErrors that name the variable and
// its value. The one exception is the crash path (error_file.cpp), which reads ACCEL_ERROR_FILE
// by itself: it must report even an environment that does not parse.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>

namespace accel::env {

enum class LogLevel { kDebug, kInfo, kWarning, kError };

struct WorkerEnv {
  // torchrun's; a lone process without them is rank 0 of 1.
  int world_size = 1;
  int rank = 0;
  int local_world_size = 1;
  int local_rank = 0;
  int group_rank = 0;
  std::optional<std::string> master_addr;
  std::optional<int> master_port;
  // Started by srun without a launcher: the values above came from SLURM_PROCID, SLURM_STEP_*.
  bool from_slurm = false;
  bool agent_store = false;         // TORCHELASTIC_USE_AGENT_STORE=True
  std::string restart_count = "0";  // TORCHELASTIC_RESTART_COUNT, as text (a store prefix)
  // The launch configuration's (accel's name, else HF Accelerate's); unset: the API's default.
  std::optional<std::string> mixed_precision;
  std::string mixed_precision_variable;  // which variable set it, for messages
  std::optional<int> gradient_accumulation_steps;
  bool use_cpu = false;
  bool debug = false;
  std::chrono::milliseconds collective_timeout;
  std::optional<std::string> checkpoint_dir;
  std::optional<long> checkpoint_total_limit;
  long checkpoint_interval = 0;
  bool async_checkpoints = false;           // ACCEL_ASYNC_CHECKPOINTS
  long snapshot_interval = 0;               // ACCEL_SNAPSHOT_INTERVAL
  std::optional<std::string> snapshot_dir;  // ACCEL_SNAPSHOT_DIR
  int zero_stage = 0;                       // ACCEL_ZERO_STAGE
  std::optional<std::string> project_dir;   // ACCEL_PROJECT_DIR
  std::optional<std::string> log_with;      // ACCEL_LOG_WITH, as given
  std::optional<bool> progress;             // ACCEL_PROGRESS: on/off
  bool resume_force = false;  // ACCEL_RESUME=force: resume from another run's checkpoint too
  LogLevel log_level = LogLevel::kInfo;
  // Supervision and debugging.
  std::string progress_file;  // empty: no progress page
  bool shm_collectives = true;
  std::string backend = "auto";  // ACCEL_BACKEND: auto | nccl | gloo
  bool group_of_one = false;     // ACCEL_GROUP_OF_ONE: a process group at WORLD_SIZE=1 too
  bool trace_collectives = false;
  // ACCEL_SHM_ALLREDUCE: "split" or "copy" forces that algorithm; "" (unset): timed at prepare
  // (Comm::choose_allreduce).
  std::string shm_allreduce;
  // ACCEL_SPLIT_OPTIMIZER_STEP: "auto", "1" or "0": whether a machine's ranks split the fused
  // optimizer step (split_step.h).
  std::string split_optimizer_step = "auto";
  // ACCEL_KEEP_FREED_MEMORY: fix glibc's malloc thresholds (heap_tuning.h) and keep CPU
  // tensors' large blocks (large_blocks.h) at the first Accelerator.
  bool keep_freed_memory = true;
  // ACCEL_CHECKPOINT_WRITER_CPUS as given ("" when unset: auto); checked to be auto, any or a
  // CPU list (writer_placement::valid_setting).
  std::string checkpoint_writer_cpus;
  std::optional<std::string> gloo_socket_ifname;
};

// The value of a variable, or nullopt when unset (empty counts as unset).
using Lookup = std::function<std::optional<std::string>(const char* name)>;

// Parses every variable of the contract through `lookup` (tests pass a map).
WorkerEnv read_worker_env(const Lookup& lookup);

// This process's, read on the first call (a ConfigError is thrown again on the next call).
const WorkerEnv& worker_env();

// This process's environment as a Lookup (std::getenv; an empty value is returned as it is).
std::optional<std::string> process_variable(const char* name);

// "30m", "90s", "500ms", "2h", or a plain number of seconds, positive; ConfigError otherwise.
// `what` names the source in the error.
std::chrono::milliseconds parse_duration(const std::string& text, const std::string& what);

}  // namespace accel::env

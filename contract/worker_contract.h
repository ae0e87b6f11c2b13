// The worker contract: what the launcher / node agent (agent/) and libaccel (runtime/) agree on,
// spelled once. Header-only, standard library only: the control plane never includes libtorch
// or the user API, and the runtime does not include the control plane. docs/worker-environment.md
// documents every variable for users.
//
// The progress page's layout is the other half of the contract: contract/progress_page.h.
#pragma once

#include <chrono>
#include <cstddef>
#include <string_view>

namespace accel::contract {

// torchrun's variables (torch/distributed/elastic/agent/server/local_elastic_agent.py).
inline constexpr char kRank[] = "RANK";
inline constexpr char kLocalRank[] = "LOCAL_RANK";
inline constexpr char kGroupRank[] = "GROUP_RANK";
inline constexpr char kRoleRank[] = "ROLE_RANK";
inline constexpr char kRoleName[] = "ROLE_NAME";
inline constexpr char kLocalWorldSize[] = "LOCAL_WORLD_SIZE";
inline constexpr char kWorldSize[] = "WORLD_SIZE";
inline constexpr char kGroupWorldSize[] = "GROUP_WORLD_SIZE";
inline constexpr char kRoleWorldSize[] = "ROLE_WORLD_SIZE";
inline constexpr char kMasterAddr[] = "MASTER_ADDR";
inline constexpr char kMasterPort[] = "MASTER_PORT";
inline constexpr char kRestartCount[] = "TORCHELASTIC_RESTART_COUNT";
inline constexpr char kMaxRestarts[] = "TORCHELASTIC_MAX_RESTARTS";
inline constexpr char kRunId[] = "TORCHELASTIC_RUN_ID";
inline constexpr char kTorchelasticErrorFile[] = "TORCHELASTIC_ERROR_FILE";
// "True" (exactly, as c10d compares it): the launcher serves the store and every rank is a client.
inline constexpr char kUseAgentStore[] = "TORCHELASTIC_USE_AGENT_STORE";
inline constexpr char kAgentStoreOn[] = "True";
inline constexpr char kAgentStoreOff[] = "False";
inline constexpr char kNcclAsyncErrorHandling[] = "TORCH_NCCL_ASYNC_ERROR_HANDLING";
// PyTorch < 2.2's name: never set by the launcher; libaccel on such a libtorch copies the new one
inline constexpr char kNcclAsyncErrorHandlingOld[] = "NCCL_ASYNC_ERROR_HANDLING";
inline constexpr char kOmpNumThreads[] = "OMP_NUM_THREADS";
// Set to 1 unless the environment has it: a Python worker's output unbuffered, as torchrun's
// `python -u` makes it, whether the program is `script.py` or `python3 script.py`.
inline constexpr char kPythonUnbuffered[] = "PYTHONUNBUFFERED";

// HF Accelerate's.
inline constexpr char kHfMixedPrecision[] = "ACCELERATE_MIXED_PRECISION";
inline constexpr char kHfUseCpu[] = "ACCELERATE_USE_CPU";
inline constexpr char kHfGradientAccumulationSteps[] = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS";
inline constexpr char kHfDebugMode[] = "ACCELERATE_DEBUG_MODE";

// accel's own.
inline constexpr char kJobId[] = "ACCEL_JOB_ID";
inline constexpr char kAccelRestartCount[] = "ACCEL_RESTART_COUNT";
inline constexpr char kMixedPrecision[] = "ACCEL_MIXED_PRECISION";
inline constexpr char kGradientAccumulationSteps[] = "ACCEL_GRADIENT_ACCUMULATION_STEPS";
inline constexpr char kUseCpu[] = "ACCEL_USE_CPU";
inline constexpr char kDebug[] = "ACCEL_DEBUG";
inline constexpr char kCollectiveTimeout[] = "ACCEL_COLLECTIVE_TIMEOUT";
inline constexpr char kCheckpointDir[] = "ACCEL_CHECKPOINT_DIR";
inline constexpr char kCheckpointInterval[] = "ACCEL_CHECKPOINT_INTERVAL";
inline constexpr char kCheckpointTotalLimit[] = "ACCEL_CHECKPOINT_TOTAL_LIMIT";
// true | false: the automatic saves write in the background
inline constexpr char kAsyncCheckpoints[] = "ACCEL_ASYNC_CHECKPOINTS";
// N >= 1: every N optimizer steps, a snapshot of the state in memory (ACCEL_SNAPSHOT_DIR)
inline constexpr char kSnapshotInterval[] = "ACCEL_SNAPSHOT_INTERVAL";
// Set by the agent (or launcher) when snapshots are on: a private folder in /dev/shm, one per
// job and node, that outlives the workers and goes when the job ends on that node.
inline constexpr char kSnapshotDir[] = "ACCEL_SNAPSHOT_DIR";
inline constexpr char kZeroStage[] = "ACCEL_ZERO_STAGE";    // 0 | 1: ZeRO stage of the optimizers
inline constexpr char kResume[] = "ACCEL_RESUME";           // auto | force (resume another run's)
inline constexpr char kProjectDir[] = "ACCEL_PROJECT_DIR";  // trackers' (and checkpoints') folder
inline constexpr char kLogWith[] = "ACCEL_LOG_WITH";        // tensorboard,jsonl,csv | all
inline constexpr char kProgress[] = "ACCEL_PROGRESS";       // on | off: the progress display
inline constexpr char kErrorFile[] = "ACCEL_ERROR_FILE";
inline constexpr char kProgressFile[] = "ACCEL_PROGRESS_FILE";
inline constexpr char kShmCollectives[] = "ACCEL_SHM_COLLECTIVES";
// libaccel names the shared-memory segments a worker creates /dev/shm/accel-<its pid>-...; once
// the agent has reaped a worker it removes that worker's names (a rank killed between creating a
// segment and unlinking it would leave one behind), and each group's start removes those of
// this user whose process is gone and which are a minute old (the launcher SIGKILLed too).
inline constexpr char kShmSegmentPrefix[] = "accel-";
// auto | nccl | gloo: the process group's backend on a GPU (auto: NCCL unless ranks share a GPU)
inline constexpr char kBackend[] = "ACCEL_BACKEND";
// 1: a process group even for WORLD_SIZE=1 (accel test sets it to check the backend on one rank)
inline constexpr char kGroupOfOne[] = "ACCEL_GROUP_OF_ONE";
inline constexpr char kTraceCollectives[] = "ACCEL_TRACE_COLLECTIVES";  // runtime debugging only
// split | copy: how shared memory all-reduces a large private tensor (copy: for benchmarks)
inline constexpr char kShmAllreduce[] = "ACCEL_SHM_ALLREDUCE";
// auto (default) | 1 | 0: the ranks of one machine split the fused optimizer step between them
// (auto: for optimizers of 256 Ki elements and more; 1: whatever the size; 0: never)
inline constexpr char kSplitOptimizerStep[] = "ACCEL_SPLIT_OPTIMIZER_STEP";
// true (default) | false: libaccel fixes glibc's malloc thresholds so that memory a training step
// frees stays in the process for the next step (false: glibc's moving thresholds)
inline constexpr char kKeepFreedMemory[] = "ACCEL_KEEP_FREED_MEMORY";
// auto | any | a CPU list ("1", "2-3"): where a background checkpoint's writer thread runs
// (auto: on the CPUs that take the checkpoint disk's interrupts, where that disk has one queue
// and training leaves a CPU to spare)
inline constexpr char kCheckpointWriterCpus[] = "ACCEL_CHECKPOINT_WRITER_CPUS";
inline constexpr char kLogLevel[] = "ACCEL_LOG_LEVEL";  // debug | info | warning | error
inline constexpr char kToken[] = "ACCEL_TOKEN";  // the control plane's secret: never a worker's

// HF Accelerate's name for one of accel's worker settings, or nullptr: the launcher sets both,
// so a script written for `accelerate launch` reads what accel-launch was told.
constexpr const char* hf_alias(std::string_view accel_variable) {
  if (accel_variable == kMixedPrecision) return kHfMixedPrecision;
  if (accel_variable == kUseCpu) return kHfUseCpu;
  if (accel_variable == kGradientAccumulationSteps) return kHfGradientAccumulationSteps;
  if (accel_variable == kDebug) return kHfDebugMode;
  return nullptr;
}

// The default of every collective's timeout (config key collective_timeout, the runtime's
// fallback when ACCEL_COLLECTIVE_TIMEOUT is unset): PyTorch's own default.
inline constexpr std::chrono::milliseconds kDefaultCollectiveTimeout{30 * 60 * 1000};

// Where libaccel keeps its process group's keys in a store the launcher serves: one prefix per
// attempt ("/accel/attempt_<TORCHELASTIC_RESTART_COUNT>"; Python's env:// uses /worker/attempt_).
inline constexpr char kRuntimeStorePrefix[] = "/accel/attempt_";

// The error file (ACCEL_ERROR_FILE): one JSON object. libaccel writes these keys; torchelastic's
// @record writes {"message": {"message": ..., "extraInfo": {"py_callstack": ...}}}, which the
// agent reads too. The agent reads at most kErrorFileMaxBytes of it.
namespace error_file {
inline constexpr char kMessage[] = "message";
inline constexpr char kType[] = "type";
inline constexpr char kStack[] = "stack";
inline constexpr char kTime[] = "time";
inline constexpr char kRank[] = "rank";
inline constexpr char kExtraInfo[] = "extraInfo";
inline constexpr char kPyCallstack[] = "py_callstack";
inline constexpr std::size_t kMaxBytes = 1024 * 1024;
}  // namespace error_file

}  // namespace accel::contract

// Builds one worker's environment.
#include "agent/supervisor/worker_env.h"

#include <set>

#include "contract/malloc_tuning.h"
#include "contract/switch_value.h"
#include "contract/worker_contract.h"

namespace accel::supervisor {

namespace c = contract;

std::optional<bool> keeps_freed_memory(const std::string* value) {
  if (value == nullptr || value->empty()) return true;
  return c::switch_value(*value);
}

// Gives the worker libaccel's malloc thresholds through GLIBC_TUNABLES, unless its
// ACCEL_KEEP_FREED_MEMORY is off (or invalid: accel-launch refuses that at its start, and
// libaccel in a C++ worker) or its environment already sets glibc's malloc (the user's setting
// wins). Other tunables in GLIBC_TUNABLES are kept.
void give_malloc_thresholds(EnvMap& env) {
  auto lookup = [&env](const char* name) -> const std::string* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : &it->second;
  };
  if (keeps_freed_memory(lookup(c::kKeepFreedMemory)) != true) return;
  if (!c::malloc_setting_in(lookup).empty()) return;
  std::string& tunables = env[c::kGlibcTunables];
  tunables =
      tunables.empty() ? std::string(c::kMallocTunables) : tunables + ":" + c::kMallocTunables;
}

std::optional<std::string> worker_value_problem(std::string_view key, const std::string& value) {
  if (key == c::kKeepFreedMemory && !keeps_freed_memory(&value)) {
    return "expected true or false (1, true, yes or on; 0, false, no or off)";
  }
  return std::nullopt;
}

std::optional<std::string> reserved_worker_variable(std::string_view key) {
  static const std::set<std::string_view> kPerWorker = {
      c::kRank,          c::kLocalRank,
      c::kGroupRank,     c::kRoleRank,
      c::kRoleName,      c::kLocalWorldSize,
      c::kWorldSize,     c::kGroupWorldSize,
      c::kRoleWorldSize, c::kMasterAddr,
      c::kMasterPort,    c::kRestartCount,
      c::kMaxRestarts,   c::kRunId,
      c::kUseAgentStore, c::kTorchelasticErrorFile,
      c::kJobId,         c::kAccelRestartCount,
      c::kErrorFile,     c::kProgressFile};
  if (kPerWorker.contains(key)) {
    return std::string(key) +
           " is set by accel for each worker (rank, world, rendezvous); --env cannot change it";
  }
  if (key == c::kToken)
    return std::string("ACCEL_TOKEN is the control plane's secret and is never given to workers");
  return std::nullopt;
}

EnvMap build_worker_env(const EnvMap& base, const WorkerIdentity& id, const JobEnv& job,
                        const std::string& error_file) {
  EnvMap env = base;
  // Why: the control plane's secret is never a worker's (a worker runs the user's code, and in
  // local mode the launcher's own environment is the base).
  env.erase(c::kToken);
  auto set = [&env](const char* k, const std::string& v) { env[k] = v; };
  auto num = [](int v) { return std::to_string(v); };

  // The configuration's settings first: the contract's own variables below always win.
  for (const auto& [name, value] : job.settings) {
    const char* hf = c::hf_alias(name);
    if (value.empty()) {
      env.erase(name);
      if (hf != nullptr) env.erase(hf);
    } else {
      env[name] = value;
      if (hf != nullptr) env[hf] = value;
    }
  }

  // torchrun's set (torch/distributed/elastic/agent/server/local_elastic_agent.py)
  set(c::kRank, num(id.rank));
  set(c::kLocalRank, num(id.local_rank));
  set(c::kGroupRank, num(id.group_rank));
  set(c::kRoleRank, num(id.rank));
  set(c::kRoleName, "default");
  set(c::kLocalWorldSize, num(id.local_world_size));
  set(c::kWorldSize, num(id.world_size));
  set(c::kGroupWorldSize, num(id.group_world_size));
  set(c::kRoleWorldSize, num(id.world_size));
  set(c::kMasterAddr, job.master_addr);
  set(c::kMasterPort, num(job.master_port));
  set(c::kRestartCount, num(job.restart_count));
  set(c::kMaxRestarts, num(job.max_restarts));
  set(c::kRunId, job.job_id);
  // True: the launcher (or node rank 0's agent) serves the TCPStore at MASTER_ADDR:MASTER_PORT
  // before any worker starts; init_process_group("env://") connects every rank as a client
  // under the prefix /worker/attempt_<TORCHELASTIC_RESTART_COUNT>.
  set(c::kUseAgentStore, job.agent_store ? c::kAgentStoreOn : c::kAgentStoreOff);
  if (!env.contains(c::kNcclAsyncErrorHandling)) set(c::kNcclAsyncErrorHandling, "1");
  // Why not the old name (NCCL_ASYNC_ERROR_HANDLING) as well: PyTorch >= 2.2 prints a deprecation
  // warning for it in every NCCL process (seen on a GPU), as torchrun >= 2.2 does not set it.
  // libaccel built against an older libtorch carries the new name over itself; an inherited
  // value still passes through.
  if (job.omp_num_threads > 0) {
    set(c::kOmpNumThreads, num(job.omp_num_threads));
  } else if (id.local_world_size > 1 && !env.contains(c::kOmpNumThreads)) {
    set(c::kOmpNumThreads, "1");
  }

  // Why: torchrun runs Python workers with `python -u`; a worker started as `python3 train.py`
  // would otherwise hold its prints in an 8 KiB buffer until exit (or lose them to a SIGKILL).
  if (!env.contains(c::kPythonUnbuffered)) set(c::kPythonUnbuffered, "1");

  // Why: a training step frees and allocates the same large tensors again, and glibc's moving
  // thresholds make it fault their memory in afresh (a plain PyTorch loop of a 784-2048-2048-10
  // MLP ran at 8.4 steps/s with them, 32.3 without, under accel-launch on a 2-vCPU VM). libaccel
  // fixes the thresholds in its own process; Python workers do not load it, and this way every
  // worker has them from its start.
  give_malloc_thresholds(env);

  // accel's
  set(c::kJobId, job.job_id);
  set(c::kAccelRestartCount, num(job.restart_count));
  if (!error_file.empty()) {
    set(c::kErrorFile, error_file);
    set(c::kTorchelasticErrorFile, error_file);
  } else {
    env.erase(c::kErrorFile);
    env.erase(c::kTorchelasticErrorFile);
  }
  return env;
}

}  // namespace accel::supervisor

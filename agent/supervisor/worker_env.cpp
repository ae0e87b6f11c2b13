// Builds one worker's environment.
#include "agent/supervisor/worker_env.h"

#include <set>

#include "contract/worker_contract.h"

namespace accel::supervisor {

namespace c = contract;

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
  static const std::map<std::string_view, std::string_view> kFromConfig = {
      {c::kMixedPrecision, "--mixed-precision"},
      {c::kHfMixedPrecision, "--mixed-precision"},
      {c::kGradientAccumulationSteps, "--gradient-accumulation-steps"},
      {c::kHfGradientAccumulationSteps, "--gradient-accumulation-steps"},
      {c::kUseCpu, "--cpu"},
      {c::kHfUseCpu, "--cpu"},
      {c::kHfDebugMode, "--debug"},
      {c::kCollectiveTimeout, "--collective-timeout"},
      {c::kCheckpointDir, "--checkpoint-dir"},
      {c::kCheckpointInterval, "--checkpoint-interval"}};
  if (kPerWorker.contains(key)) {
    return std::string(key) +
           " is set by accel for each worker (rank, world, rendezvous); --env cannot change it";
  }
  if (auto it = kFromConfig.find(key); it != kFromConfig.end()) {
    return std::string(key) + " comes from the launch configuration; use " +
           std::string(it->second) + " (or its config key) instead";
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
  // PyTorch < 2.2 (Debian's 1.13 included) reads the old name; torchrun 1.13 sets it too.
  if (!env.contains(c::kNcclAsyncErrorHandlingOld)) set(c::kNcclAsyncErrorHandlingOld, "1");
  if (job.omp_num_threads > 0) {
    set(c::kOmpNumThreads, num(job.omp_num_threads));
  } else if (id.local_world_size > 1 && !env.contains(c::kOmpNumThreads)) {
    set(c::kOmpNumThreads, "1");
  }

  // HF Accelerate's
  set(c::kHfMixedPrecision, job.mixed_precision);
  set(c::kHfUseCpu, job.use_cpu ? "true" : "false");
  set(c::kHfGradientAccumulationSteps, num(job.gradient_accumulation_steps));
  set(c::kHfDebugMode, job.debug ? "true" : "false");

  // accel's
  set(c::kJobId, job.job_id);
  set(c::kAccelRestartCount, num(job.restart_count));
  set(c::kMixedPrecision, job.mixed_precision);
  set(c::kGradientAccumulationSteps, num(job.gradient_accumulation_steps));
  set(c::kUseCpu, job.use_cpu ? "true" : "false");
  set(c::kCollectiveTimeout, job.collective_timeout);
  // Why erase: the config already read these from the launcher's environment; a flag or file
  // that turned checkpointing off must not be undone by the inherited variable.
  auto set_or_erase = [&](const char* k, bool on, const std::string& v) {
    if (on) {
      set(k, v);
    } else {
      env.erase(k);
    }
  };
  set_or_erase(c::kCheckpointDir, !job.checkpoint_dir.empty(), job.checkpoint_dir);
  set_or_erase(c::kCheckpointInterval, job.checkpoint_interval > 0, num(job.checkpoint_interval));
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

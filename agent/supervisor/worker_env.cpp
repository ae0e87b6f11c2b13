// Builds one worker's environment.
#include "agent/supervisor/worker_env.h"

#include <set>

namespace accel::supervisor {

std::optional<std::string> reserved_worker_variable(std::string_view key) {
  static const std::set<std::string_view> kPerWorker = {
      "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
      "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
      "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
      "TORCHELASTIC_ERROR_FILE", "ACCEL_JOB_ID", "ACCEL_RESTART_COUNT", "ACCEL_ERROR_FILE", "ACCEL_PROGRESS_FILE"};
  static const std::map<std::string_view, std::string_view> kFromConfig = {
      {"ACCEL_MIXED_PRECISION", "--mixed-precision"},
      {"ACCELERATE_MIXED_PRECISION", "--mixed-precision"},
      {"ACCEL_GRADIENT_ACCUMULATION_STEPS", "--gradient-accumulation-steps"},
      {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "--gradient-accumulation-steps"},
      {"ACCEL_USE_CPU", "--cpu"},
      {"ACCELERATE_USE_CPU", "--cpu"},
      {"ACCELERATE_DEBUG_MODE", "--debug"},
      {"ACCEL_COLLECTIVE_TIMEOUT", "--collective-timeout"},
      {"ACCEL_CHECKPOINT_DIR", "--checkpoint-dir"},
      {"ACCEL_CHECKPOINT_INTERVAL", "--checkpoint-interval"}};
  if (kPerWorker.contains(key)) {
    return std::string(key) + " is set by accel for each worker (rank, world, rendezvous); --env cannot change it";
  }
  if (auto it = kFromConfig.find(key); it != kFromConfig.end()) {
    return std::string(key) + " comes from the launch configuration; use " + std::string(it->second) +
           " (or its config key) instead";
  }
  if (key == "ACCEL_TOKEN") return std::string("ACCEL_TOKEN is the control plane's secret and is never given to workers");
  return std::nullopt;
}

EnvMap build_worker_env(const EnvMap& base, const WorkerIdentity& id, const JobEnv& job,
                        const std::string& error_file) {
  EnvMap env = base;
  // Why: the control plane's secret is never a worker's (a worker runs the user's code, and in
  // local mode the launcher's own environment is the base).
  env.erase("ACCEL_TOKEN");
  auto set = [&env](const char* k, const std::string& v) { env[k] = v; };
  auto num = [](int v) { return std::to_string(v); };

  // torchrun's set (torch/distributed/elastic/agent/server/local_elastic_agent.py)
  set("RANK", num(id.rank));
  set("LOCAL_RANK", num(id.local_rank));
  set("GROUP_RANK", num(id.group_rank));
  set("ROLE_RANK", num(id.rank));
  set("ROLE_NAME", "default");
  set("LOCAL_WORLD_SIZE", num(id.local_world_size));
  set("WORLD_SIZE", num(id.world_size));
  set("GROUP_WORLD_SIZE", num(id.group_world_size));
  set("ROLE_WORLD_SIZE", num(id.world_size));
  set("MASTER_ADDR", job.master_addr);
  set("MASTER_PORT", num(job.master_port));
  set("TORCHELASTIC_RESTART_COUNT", num(job.restart_count));
  set("TORCHELASTIC_MAX_RESTARTS", num(job.max_restarts));
  set("TORCHELASTIC_RUN_ID", job.job_id);
  // True: the launcher (or node rank 0's agent) serves the TCPStore at MASTER_ADDR:MASTER_PORT
  // before any worker starts; init_process_group("env://") connects every rank as a client
  // under the prefix /worker/attempt_<TORCHELASTIC_RESTART_COUNT>.
  set("TORCHELASTIC_USE_AGENT_STORE", job.agent_store ? "True" : "False");
  if (!env.contains("TORCH_NCCL_ASYNC_ERROR_HANDLING")) set("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1");
  // PyTorch < 2.2 (Debian's 1.13 included) reads the old name; torchrun 1.13 sets it too.
  if (!env.contains("NCCL_ASYNC_ERROR_HANDLING")) set("NCCL_ASYNC_ERROR_HANDLING", "1");
  if (job.omp_num_threads > 0) {
    set("OMP_NUM_THREADS", num(job.omp_num_threads));
  } else if (id.local_world_size > 1 && !env.contains("OMP_NUM_THREADS")) {
    set("OMP_NUM_THREADS", "1");
  }

  // HF Accelerate's
  set("ACCELERATE_MIXED_PRECISION", job.mixed_precision);
  set("ACCELERATE_USE_CPU", job.use_cpu ? "true" : "false");
  set("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", num(job.gradient_accumulation_steps));
  set("ACCELERATE_DEBUG_MODE", job.debug ? "true" : "false");

  // accel's
  set("ACCEL_JOB_ID", job.job_id);
  set("ACCEL_RESTART_COUNT", num(job.restart_count));
  set("ACCEL_MIXED_PRECISION", job.mixed_precision);
  set("ACCEL_GRADIENT_ACCUMULATION_STEPS", num(job.gradient_accumulation_steps));
  set("ACCEL_USE_CPU", job.use_cpu ? "true" : "false");
  set("ACCEL_COLLECTIVE_TIMEOUT", job.collective_timeout);
  // Why erase: the config already read these from the launcher's environment; a flag or file
  // that turned checkpointing off must not be undone by the inherited variable.
  auto set_or_erase = [&](const char* k, bool on, const std::string& v) {
    if (on) {
      set(k, v);
    } else {
      env.erase(k);
    }
  };
  set_or_erase("ACCEL_CHECKPOINT_DIR", !job.checkpoint_dir.empty(), job.checkpoint_dir);
  set_or_erase("ACCEL_CHECKPOINT_INTERVAL", job.checkpoint_interval > 0, num(job.checkpoint_interval));
  if (!error_file.empty()) {
    set("ACCEL_ERROR_FILE", error_file);
    set("TORCHELASTIC_ERROR_FILE", error_file);
  } else {
    env.erase("ACCEL_ERROR_FILE");
    env.erase("TORCHELASTIC_ERROR_FILE");
  }
  return env;
}

}  // namespace accel::supervisor

// The worker environment contract (docs/worker-environment.md).
#include "agent/supervisor/worker_env.h"

#include <gtest/gtest.h>

namespace accel::supervisor {
namespace {

TEST(WorkerEnv, TorchrunHfAndAccelVariables) {
  EnvMap base = {{"PATH", "/usr/bin"}, {"RANK", "99"}, {"HOME", "/root"}};
  WorkerIdentity id{.rank = 5,
                    .local_rank = 1,
                    .local_world_size = 4,
                    .world_size = 8,
                    .group_rank = 1,
                    .group_world_size = 2};
  JobEnv job{.job_id = "job1",
             .master_addr = "10.0.0.1",
             .master_port = 29501,
             .restart_count = 2,
             .max_restarts = 3,
             .settings = {{"ACCEL_MIXED_PRECISION", "bf16"},
                          {"ACCEL_GRADIENT_ACCUMULATION_STEPS", "4"},
                          {"ACCEL_USE_CPU", "true"},
                          {"ACCEL_DEBUG", "false"},
                          {"ACCEL_COLLECTIVE_TIMEOUT", "30m"}}};
  EnvMap env = build_worker_env(base, id, job, "/tmp/e.json");
  EnvMap expected = {{"RANK", "5"},
                     {"LOCAL_RANK", "1"},
                     {"GROUP_RANK", "1"},
                     {"ROLE_RANK", "5"},
                     {"ROLE_NAME", "default"},
                     {"LOCAL_WORLD_SIZE", "4"},
                     {"WORLD_SIZE", "8"},
                     {"GROUP_WORLD_SIZE", "2"},
                     {"ROLE_WORLD_SIZE", "8"},
                     {"MASTER_ADDR", "10.0.0.1"},
                     {"MASTER_PORT", "29501"},
                     {"TORCHELASTIC_RESTART_COUNT", "2"},
                     {"TORCHELASTIC_MAX_RESTARTS", "3"},
                     {"TORCHELASTIC_RUN_ID", "job1"},
                     {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                     {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"},
                     {"OMP_NUM_THREADS", "1"},
                     {"PYTHONUNBUFFERED", "1"},
                     {"GLIBC_TUNABLES",
                      "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold="
                      "1073741824"},
                     {"ACCELERATE_MIXED_PRECISION", "bf16"},
                     {"ACCELERATE_USE_CPU", "true"},
                     {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4"},
                     {"ACCELERATE_DEBUG_MODE", "false"},
                     {"ACCEL_JOB_ID", "job1"},
                     {"ACCEL_RESTART_COUNT", "2"},
                     {"ACCEL_MIXED_PRECISION", "bf16"},
                     {"ACCEL_GRADIENT_ACCUMULATION_STEPS", "4"},
                     {"ACCEL_USE_CPU", "true"},
                     {"ACCEL_DEBUG", "false"},
                     {"ACCEL_COLLECTIVE_TIMEOUT", "30m"},
                     {"ACCEL_ERROR_FILE", "/tmp/e.json"},
                     {"TORCHELASTIC_ERROR_FILE", "/tmp/e.json"},
                     {"PATH", "/usr/bin"},
                     {"HOME", "/root"}};
  EXPECT_EQ(env, expected);
}

TEST(WorkerEnv, UserSettingsThatAreKept) {
  EnvMap base = {{"OMP_NUM_THREADS", "4"},
                 {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"},
                 {"PYTHONUNBUFFERED", ""},
                 {"ACCEL_ERROR_FILE", "/stale"}};
  WorkerIdentity id{.local_world_size = 2, .world_size = 2};
  EnvMap env = build_worker_env(base, id, JobEnv{}, "");
  EXPECT_EQ(env["OMP_NUM_THREADS"], "4");
  EXPECT_EQ(env.at("PYTHONUNBUFFERED"), "");  // set by the user (empty: buffered) is kept
  EXPECT_EQ(env["TORCH_NCCL_ASYNC_ERROR_HANDLING"], "3");
  // PyTorch >= 2.2 warns in every NCCL process about the old name: never set, but passed through.
  EXPECT_FALSE(build_worker_env({}, id, JobEnv{}, "").contains("NCCL_ASYNC_ERROR_HANDLING"));
  EXPECT_EQ(build_worker_env({{"NCCL_ASYNC_ERROR_HANDLING", "0"}}, id, JobEnv{}, "")
                .at("NCCL_ASYNC_ERROR_HANDLING"),
            "0");
  EXPECT_FALSE(env.contains("ACCEL_ERROR_FILE"));
  EXPECT_FALSE(env.contains("TORCHELASTIC_ERROR_FILE"));
}

TEST(WorkerEnv, OmpThreads) {
  WorkerIdentity single{.local_world_size = 1};
  EXPECT_FALSE(build_worker_env({}, single, JobEnv{}, "").contains("OMP_NUM_THREADS"));
  JobEnv job;
  job.omp_num_threads = 3;
  EXPECT_EQ(build_worker_env({{"OMP_NUM_THREADS", "8"}}, single, job, "")["OMP_NUM_THREADS"], "3");
}

TEST(WorkerEnv, AnEmptySettingUnsetsTheInheritedVariableAndItsHfAlias) {
  WorkerIdentity id;
  JobEnv job;
  job.settings = {{"ACCEL_CHECKPOINT_DIR", ""}, {"ACCEL_MIXED_PRECISION", ""}};
  // Off in the config: absent, even when the launcher's own environment had them.
  EnvMap stale = {{"ACCEL_CHECKPOINT_DIR", "rel"},
                  {"ACCEL_MIXED_PRECISION", "fp16"},
                  {"ACCELERATE_MIXED_PRECISION", "fp16"}};
  EnvMap env = build_worker_env(stale, id, job, "");
  EXPECT_FALSE(env.contains("ACCEL_CHECKPOINT_DIR"));
  EXPECT_FALSE(env.contains("ACCEL_MIXED_PRECISION"));
  EXPECT_FALSE(env.contains("ACCELERATE_MIXED_PRECISION"));
}

TEST(WorkerEnv, ASettingCannotReplaceAPerWorkerVariable) {
  WorkerIdentity id{.rank = 1, .world_size = 2};
  JobEnv job;
  job.settings = {{"RANK", "7"}, {"MASTER_PORT", "1"}};
  job.master_port = 29500;
  EnvMap env = build_worker_env({}, id, job, "");
  EXPECT_EQ(env["RANK"], "1");
  EXPECT_EQ(env["MASTER_PORT"], "29500");
}

// libaccel's malloc thresholds for every worker (Python ones do not load libaccel), unless the
// worker's ACCEL_KEEP_FREED_MEMORY says no or the user set glibc's malloc already.
TEST(WorkerEnv, MallocThresholdsUnlessTheUserSetThemOrSaidNo) {
  const std::string ours =
      "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824";
  WorkerIdentity id;
  auto tunables = [&](const EnvMap& base) -> std::string {
    auto env = build_worker_env(base, id, JobEnv{}, "");
    return env.contains("GLIBC_TUNABLES") ? env.at("GLIBC_TUNABLES") : "(unset)";
  };
  EXPECT_EQ(tunables({}), ours);
  EXPECT_EQ(tunables({{"ACCEL_KEEP_FREED_MEMORY", "True"}}), ours);
  EXPECT_EQ(tunables({{"ACCEL_KEEP_FREED_MEMORY", ""}}), ours);  // empty: the default
  // Other tunables are kept, ours after them.
  EXPECT_EQ(tunables({{"GLIBC_TUNABLES", "glibc.cpu.hwcaps=-AVX512F"}}),
            "glibc.cpu.hwcaps=-AVX512F:" + ours);
  EXPECT_EQ(tunables({{"GLIBC_TUNABLES", ""}}), ours);
  // Off, in any of libaccel's spellings (the launcher's environment and --env both arrive in
  // `base`); or a value libaccel rejects (accel-launch refuses it at its start, as does libaccel).
  for (const char* off : {"0", "false", "NO", "Off", "sometimes"})
    EXPECT_EQ(tunables({{"ACCEL_KEEP_FREED_MEMORY", off}}), "(unset)") << off;
  EXPECT_EQ(tunables({{"GLIBC_TUNABLES", "glibc.cpu.x=1"}, {"ACCEL_KEEP_FREED_MEMORY", "0"}}),
            "glibc.cpu.x=1");
  EXPECT_EQ(worker_value_problem("ACCEL_KEEP_FREED_MEMORY", "sometimes"),
            "expected true or false (1, true, yes or on; 0, false, no or off)");
  EXPECT_EQ(worker_value_problem("ACCEL_KEEP_FREED_MEMORY", "YES"), std::nullopt);
  EXPECT_EQ(worker_value_problem("ACCEL_KEEP_FREED_MEMORY", ""), std::nullopt);
  EXPECT_EQ(worker_value_problem("OTHER", "sometimes"), std::nullopt);
  // The user's own malloc setting wins, whole.
  EXPECT_EQ(tunables({{"GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0"}}),
            "glibc.malloc.trim_threshold=0");
  EXPECT_EQ(tunables({{"MALLOC_ARENA_MAX", "2"}}), ours);  // not a threshold
  for (const char* name : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                           "MALLOC_MMAP_MAX_"}) {
    EXPECT_EQ(tunables({{name, "65536"}}), "(unset)") << name;
    EXPECT_EQ(tunables({{name, ""}}), "(unset)") << name;  // glibc reads empty as 0
  }
  // A launch inside a worker (its environment has ours already): not given twice.
  EXPECT_EQ(tunables({{"GLIBC_TUNABLES", ours}}), ours);
}

}  // namespace
}  // namespace accel::supervisor

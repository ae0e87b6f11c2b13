// HF Accelerate config files read as accel configuration: the shapes `accelerate config` writes,
// mapped, ignored with a warning, or refused with the exact message.
#include "agent/config/hf_config.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "agent/config/config_loader.h"

namespace accel::config {
namespace {

// `accelerate config` on one machine, 4 CPU processes (accelerate 0.32).
constexpr char kMultiCpu[] = R"(compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_CPU
downcast_bf16: 'no'
enable_cpu_affinity: false
ipex_config:
  ipex: false
machine_rank: 0
main_process_ip: 127.0.0.1
main_process_port: 29500
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 4
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
)";

// Two machines, 8 GPUs each, this is the second one.
constexpr char kMultiNodeGpu[] = R"(compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_GPU
downcast_bf16: 'no'
gpu_ids: all
machine_rank: 1
main_process_ip: 10.0.0.1
main_process_port: 29500
main_training_function: main
mixed_precision: bf16
num_machines: 2
num_processes: 16
rdzv_backend: c10d
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
)";

struct Loaded {
  ClusterConfig cfg;
  std::vector<std::string> warnings;
  Status status;
};

Loaded load(const std::string& yaml) {
  Loaded l;
  l.status = load_yaml_text(l.cfg, yaml, "default_config.yaml", &l.warnings);
  return l;
}

TEST(HfConfig, AMultiCpuFileMapsOntoAccelsKeys) {
  Loaded l = load(kMultiCpu);
  ASSERT_TRUE(l.status) << l.status.message();
  EXPECT_EQ(l.cfg.num_processes, 4);
  EXPECT_EQ(l.cfg.nodes.max, 1);
  EXPECT_TRUE(l.cfg.use_cpu);  // MULTI_CPU without a use_cpu key
  EXPECT_EQ(l.cfg.main_process_port, 29500);
  EXPECT_EQ(l.cfg.origin("num_processes").where,
            "default_config.yaml:14:16 (HF num_processes 4 over 1 machine)");
  EXPECT_EQ(l.cfg.origin("use_cpu").where, "default_config.yaml (distributed_type MULTI_CPU)");
  // Every ignored key is at the value HF writes when its feature is off: nothing to say.
  EXPECT_EQ(l.warnings, std::vector<std::string>{});
}

// What HF writes for an unused feature is silent; a value that asks for something accel does not
// do is said, with why.
TEST(HfConfig, OnlyIgnoredKeysAwayFromHfsDefaultsWarn) {
  Loaded l = load(R"(distributed_type: MULTI_CPU
downcast_bf16: 'yes'
enable_cpu_affinity: true
ipex_config:
  ipex: true
dynamo_config:
  dynamo_backend: 'NO'
mpirun_config: {}
main_training_function: train
rdzv_backend: c10d
same_network: false
tpu_name: null
tpu_env: [A=1]
gpu_ids: all
)");
  ASSERT_TRUE(l.status) << l.status.message();
  std::vector<std::string> expected = {
      "default_config.yaml:2:16: downcast_bf16 is ignored: TPU only",
      "default_config.yaml:3:22: enable_cpu_affinity is ignored: accel does not pin workers to "
      "cores",
      "default_config.yaml:5:3: ipex_config is ignored: Intel Extension for PyTorch is not used "
      "by accel",
      "default_config.yaml:9:25: main_training_function is ignored: it names the function "
      "notebook_launcher calls",
      "default_config.yaml:10:15: rdzv_backend is ignored: accel's own coordinator is the "
      "rendezvous",
      "default_config.yaml:11:15: same_network is ignored: accel's nodes always meet at "
      "main_process_ip",
      "default_config.yaml:13:10: tpu_env is ignored: TPU only",
  };
  EXPECT_EQ(l.warnings, expected);
}

TEST(HfConfig, AMultiNodeFileCountsProcessesPerMachine) {
  Loaded l = load(kMultiNodeGpu);
  ASSERT_TRUE(l.status) << l.status.message();
  EXPECT_EQ(l.cfg.num_processes, 8);  // HF: 16 in the job; accel: per machine
  EXPECT_EQ(l.cfg.nodes.min, 2);
  EXPECT_EQ(l.cfg.nodes.max, 2);
  EXPECT_EQ(l.cfg.machine_rank, 1);
  EXPECT_EQ(l.cfg.main_process_ip, "10.0.0.1");
  EXPECT_EQ(l.cfg.mixed_precision, MixedPrecision::kBf16);
  EXPECT_FALSE(l.cfg.use_cpu);
  EXPECT_TRUE(validate(l.cfg));
  ASSERT_EQ(l.warnings.size(), 1u);  // rdzv_backend c10d; gpu_ids all is HF's default
  EXPECT_EQ(l.warnings[0],
            "default_config.yaml:13:15: rdzv_backend is ignored: accel's own coordinator is the "
            "rendezvous");
  Loaded some_gpus = load("distributed_type: MULTI_GPU\ngpu_ids: 0,1\n");
  ASSERT_EQ(some_gpus.warnings.size(), 1u);
  EXPECT_EQ(some_gpus.warnings[0],
            "default_config.yaml:2:10: gpu_ids is ignored: accel gives the workers every GPU "
            "CUDA_VISIBLE_DEVICES shows; set that variable instead");
}

TEST(HfConfig, WhatAccelDoesNotDoIsRefusedByName) {
  Loaded ds = load(R"(compute_environment: LOCAL_MACHINE
deepspeed_config:
  zero_stage: 2
distributed_type: DEEPSPEED
num_processes: 2
)");
  EXPECT_EQ(ds.status.message(),
            "default_config.yaml:2:1: deepspeed_config: DeepSpeed is not supported by accel (an HF "
            "Accelerate config file; accel runs data-parallel jobs on CPUs and CUDA GPUs, see "
            "docs/configuration.md)");
  Loaded fsdp = load("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\n");
  EXPECT_EQ(fsdp.status.message(),
            "default_config.yaml:2:19: distributed_type FSDP is not supported by accel: NO, "
            "MULTI_CPU and MULTI_GPU are (an HF Accelerate config file; accel runs data-parallel "
            "jobs on CPUs and CUDA GPUs, see docs/configuration.md)");
  Loaded sage = load("compute_environment: AMAZON_SAGEMAKER\n");
  EXPECT_NE(sage.status.message().find("compute_environment AMAZON_SAGEMAKER is not supported"),
            std::string::npos)
      << sage.status.message();
  // An empty section (what older accelerate versions write) is not a use of the feature.
  Loaded empty = load("compute_environment: LOCAL_MACHINE\nfsdp_config: {}\nnum_processes: 2\n");
  EXPECT_TRUE(empty.status) << empty.status.message();
}

TEST(HfConfig, BadValuesNameTheHfKey) {
  EXPECT_EQ(
      load("distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 7\n").status.message(),
      "default_config.yaml:3:16: num_processes 7 is not a multiple of num_machines 2: HF "
      "counts processes in the whole job, accel per machine");
  EXPECT_EQ(load("distributed_type: NO\nnum_machines: zero\n").status.message(),
            "default_config.yaml:2:15: num_machines: expected an integer from 1 to 100000, got "
            "'zero'");
  EXPECT_EQ(load("distributed_type: NO\nmixed_precision: fp8\n").status.message(),
            "default_config.yaml:2:18: mixed_precision: expected one of no, fp16, bf16, got 'fp8'");
  Loaded unknown = load("distributed_type: NO\nsome_future_key: 1\n");
  EXPECT_TRUE(unknown.status);
  ASSERT_EQ(unknown.warnings.size(), 1u);
  EXPECT_EQ(unknown.warnings[0],
            "default_config.yaml:2:1: some_future_key is ignored: not a key accel knows in HF "
            "Accelerate config files");
}

TEST(HfConfig, HfsDefaultFileIsReadWhenAccelHasNone) {
  auto dir = std::filesystem::temp_directory_path() /
             ("accel_hf_config_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir / "home/.cache/huggingface/accelerate");
  std::ofstream(dir / "home/.cache/huggingface/accelerate/default_config.yaml")
      << kMultiCpu << "enable_cpu_affinity: true\n";
  ConfigSources src;
  src.env = {{"HOME", (dir / "home").string()}};
  auto r = resolve_config(src);
  ASSERT_TRUE(r) << r.message();
  EXPECT_EQ(r->file_reason, "HF Accelerate's default location");
  EXPECT_EQ(r->config.num_processes, 4);
  ASSERT_EQ(r->warnings.size(), 1u);  // the one key away from HF's defaults
  EXPECT_NE(render_config(*r).find("# warning: " + r->warnings[0]), std::string::npos);
  // accel's own default file wins.
  std::filesystem::create_directories(dir / "home/.config/accel");
  std::ofstream(dir / "home/.config/accel/config.yaml") << "num_processes: 3\n";
  r = resolve_config(src);
  ASSERT_TRUE(r) << r.message();
  EXPECT_EQ(r->file_reason, "default location");
  EXPECT_EQ(r->config.num_processes, 3);
  EXPECT_EQ(hf_default_config_path({{"HF_HOME", "/hf"}, {"HOME", "/h"}}),
            "/hf/accelerate/default_config.yaml");
  EXPECT_EQ(hf_default_config_path({{"XDG_CACHE_HOME", "/c"}, {"HOME", "/h"}}),
            "/c/huggingface/accelerate/default_config.yaml");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace accel::config

// accel-launch's command line: flags to config keys, underscores, program forms.
#include "launcher/launch_cli.h"

#include <gtest/gtest.h>

namespace accel::launcher {
namespace {

LaunchCommand parse_ok(const std::vector<std::string>& args) {
  ParseOutcome out = parse_launch_command(args);
  EXPECT_TRUE(out.command.has_value()) << out.text;
  return out.command.value_or(LaunchCommand{});
}

std::string flag_value(const LaunchCommand& cmd, const std::string& key) {
  for (const auto& f : cmd.flags) {
    if (f.key == key) return f.value;
  }
  return "<absent>";
}

TEST(LaunchCli, OnlyTypedFlagsBecomeValues) {
  LaunchCommand cmd = parse_ok({"-n", "2", "./train", "--epochs", "3"});
  ASSERT_EQ(cmd.flags.size(), 1u);
  EXPECT_EQ(cmd.flags[0].key, "num_processes");
  EXPECT_EQ(cmd.flags[0].value, "2");
  EXPECT_EQ(cmd.flags[0].flag, "--num-processes");
  EXPECT_EQ(cmd.program.program, "./train");
  EXPECT_EQ(cmd.program.args, (std::vector<std::string>{"--epochs", "3"}));
}

TEST(LaunchCli, UnderscoresAndDashesAreTheSame) {
  LaunchCommand a = parse_ok({"--num_processes", "3", "--max_restarts=2", "--mixed_precision",
                              "bf16", "--log_dir", "/tmp/l", "--cpu", "prog"});
  EXPECT_EQ(flag_value(a, "num_processes"), "3");
  EXPECT_EQ(flag_value(a, "max_restarts"), "2");
  EXPECT_EQ(flag_value(a, "mixed_precision"), "bf16");
  EXPECT_EQ(flag_value(a, "log_dir"), "/tmp/l");
  EXPECT_EQ(flag_value(a, "use_cpu"), "true");
  EXPECT_EQ(a.program.program, "prog");
  LaunchCommand b = parse_ok({"--gradient-accumulation-steps=4", "--main-process-port", "0", "p"});
  EXPECT_EQ(flag_value(b, "gradient_accumulation_steps"), "4");
  EXPECT_EQ(flag_value(b, "main_process_port"), "0");
}

TEST(LaunchCli, CheckpointFlags) {
  LaunchCommand a = parse_ok({"--checkpoint-dir", "ck", "--checkpoint-interval", "5", "p"});
  EXPECT_EQ(flag_value(a, "checkpoint_dir"), "ck");
  EXPECT_EQ(flag_value(a, "checkpoint_interval"), "5");
  EXPECT_EQ(a.program.program, "p");
  LaunchCommand b = parse_ok({"--checkpoint_dir=/ck", "--checkpoint_interval", "0", "p"});
  EXPECT_EQ(flag_value(b, "checkpoint_dir"), "/ck");
  EXPECT_EQ(flag_value(b, "checkpoint_interval"), "0");
  ASSERT_EQ(b.flags.size(), 2u);
  EXPECT_EQ(b.flags[0].flag, "--checkpoint-dir");  // messages name the dashed spelling
  EXPECT_EQ(b.flags[1].flag, "--checkpoint-interval");
  EXPECT_EQ(flag_value(parse_ok({"p"}), "checkpoint_dir"), "<absent>");
}

TEST(LaunchCli, ControlPlaneFlagsAndWorkerEnv) {
  ::setenv("ACCEL_TEST_FORWARDED", "from-here", 1);
  LaunchCommand cmd =
      parse_ok({"--coordinator", "10.0.0.1:29400", "--nodes", "2:4", "--lease-timeout", "5s",
                "--hang-timeout", "0", "--env", "A=1", "--env", "ACCEL_TEST_FORWARDED", "--env",
                "A=2", "--env", "UNSET_HERE_XYZ", "./train"});
  EXPECT_EQ(flag_value(cmd, "coordinator"), "10.0.0.1:29400");
  EXPECT_EQ(flag_value(cmd, "nodes"), "2:4");
  EXPECT_EQ(flag_value(cmd, "lease_timeout"), "5s");
  EXPECT_EQ(flag_value(cmd, "hang_timeout"), "0");
  // In the order typed (the last A wins where they are applied); a KEY not set here is skipped.
  using KV = std::pair<std::string, std::string>;
  EXPECT_EQ(cmd.worker_env,
            (std::vector<KV>{{"A", "1"}, {"ACCEL_TEST_FORWARDED", "from-here"}, {"A", "2"}}));
  ParseOutcome bad = parse_launch_command({"--env", "1BAD=x", "./train"});
  EXPECT_FALSE(bad.command);
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.text.find("--env 1BAD=x: expected KEY=VALUE or KEY"), std::string::npos)
      << bad.text;
}

// --env cannot set what accel sets for each worker or derives from the configuration: it used
// to be overridden in silence (--env RANK=99 gave rank 0).
TEST(LaunchCli, EnvOfAVariableAccelSetsIsAnErrorThatSaysWhatToUse) {
  ParseOutcome rank = parse_launch_command({"--env", "RANK=99", "./train"});
  EXPECT_EQ(rank.exit_code, 2);
  EXPECT_NE(rank.text.find("--env RANK: RANK is set by accel for each worker"), std::string::npos)
      << rank.text;
  ParseOutcome mp = parse_launch_command({"--env", "ACCELERATE_MIXED_PRECISION=bf16", "./train"});
  EXPECT_EQ(mp.exit_code, 2);
  EXPECT_NE(mp.text.find("use --mixed-precision"), std::string::npos) << mp.text;
  ParseOutcome token = parse_launch_command({"--env", "ACCEL_TOKEN", "./train"});
  EXPECT_EQ(token.exit_code, 2);
  EXPECT_NE(token.text.find("never given to workers"), std::string::npos) << token.text;
  EXPECT_EQ(parse_launch_command({"--env", "RANKING=1", "./train"}).exit_code, 0);
}

// accel-launch reads ACCEL_KEEP_FREED_MEMORY for every worker's malloc (a Python worker never
// reads it), so a value libaccel would refuse is refused here, before anything starts.
TEST(LaunchCli, EnvKeepFreedMemoryMustBeTrueOrFalse) {
  ParseOutcome bad = parse_launch_command({"--env", "ACCEL_KEEP_FREED_MEMORY=ture", "./train"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.text.find("--env ACCEL_KEEP_FREED_MEMORY=ture: expected true or false (1, true, "
                          "yes or on; 0, false, no or off)"),
            std::string::npos)
      << bad.text;
  for (const char* ok :
       {"ACCEL_KEEP_FREED_MEMORY=Off", "ACCEL_KEEP_FREED_MEMORY=1", "ACCEL_KEEP_FREED_MEMORY="})
    EXPECT_EQ(parse_launch_command({"--env", ok, "./train"}).exit_code, 0) << ok;
  // The last one for a key wins, and is the one checked.
  EXPECT_EQ(parse_launch_command({"--env", "ACCEL_KEEP_FREED_MEMORY=ture", "--env",
                                  "ACCEL_KEEP_FREED_MEMORY=0", "./train"})
                .exit_code,
            0);
  EXPECT_EQ(parse_launch_command({"--env", "ACCEL_KEEP_FREED_MEMORY=0", "--env",
                                  "ACCEL_KEEP_FREED_MEMORY=ture", "./train"})
                .exit_code,
            2);
}

TEST(LaunchCli, BooleanFlagsTakeAValue) {
  LaunchCommand off = parse_ok({"--cpu=false", "--debug", "p"});
  EXPECT_EQ(flag_value(off, "use_cpu"), "false");
  EXPECT_EQ(flag_value(off, "debug"), "true");
}

TEST(LaunchCli, TorchrunSpellingsAreAliases) {
  LaunchCommand cmd = parse_ok(
      {"--nproc_per_node", "2", "--master_port", "29501", "--nnodes", "1", "--run_id", "abc", "p"});
  EXPECT_EQ(flag_value(cmd, "num_processes"), "2");
  EXPECT_EQ(flag_value(cmd, "main_process_port"), "29501");
  EXPECT_EQ(flag_value(cmd, "nodes"), "1");
  EXPECT_EQ(flag_value(cmd, "job_id"), "abc");
}

TEST(LaunchCli, ProgramArgumentsAreNotOurs) {
  // Flags after PROGRAM belong to it, even ones accel-launch also has.
  LaunchCommand cmd = parse_ok({"-n", "2", "train.py", "-n", "7", "--cpu", "--num_processes=9"});
  EXPECT_EQ(flag_value(cmd, "num_processes"), "2");
  EXPECT_EQ(flag_value(cmd, "use_cpu"), "<absent>");
  EXPECT_EQ(cmd.program.program, "train.py");
  EXPECT_EQ(cmd.program.args, (std::vector<std::string>{"-n", "7", "--cpu", "--num_processes=9"}));
}

TEST(LaunchCli, ModuleAndDoubleDash) {
  LaunchCommand m = parse_ok({"-n", "2", "-m", "pkg.train", "--lr", "3e-4"});
  ASSERT_TRUE(m.program.module.has_value());
  EXPECT_EQ(*m.program.module, "pkg.train");
  EXPECT_EQ(m.program.args, (std::vector<std::string>{"--lr", "3e-4"}));
  LaunchCommand m2 = parse_ok({"--module=pkg.x", "a"});
  EXPECT_EQ(*m2.program.module, "pkg.x");
  LaunchCommand d = parse_ok({"--no-python", "--", "-weird-name", "x"});
  EXPECT_TRUE(d.program.no_python);
  EXPECT_EQ(d.program.program, "-weird-name");
  EXPECT_EQ(d.program.args, (std::vector<std::string>{"x"}));
}

TEST(LaunchCli, ConfigAndPrintConfig) {
  LaunchCommand cmd = parse_ok({"--config_file", "c.yaml", "--print-config"});
  ASSERT_TRUE(cmd.config_file.has_value());
  EXPECT_EQ(*cmd.config_file, "c.yaml");
  EXPECT_TRUE(cmd.print_config);
  EXPECT_TRUE(cmd.program.program.empty());
}

TEST(LaunchCli, HelpVersionAndErrors) {
  ParseOutcome help = parse_launch_command({"--help"});
  EXPECT_FALSE(help.command);
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.text.find("Examples:"), std::string::npos);
  EXPECT_NE(help.text.find("--num-processes"), std::string::npos);
  ParseOutcome version = parse_launch_command({"--version"});
  EXPECT_EQ(version.exit_code, 0);
  EXPECT_EQ(version.text.rfind("accel-launch ", 0), 0u);
  ParseOutcome bad = parse_launch_command({"--num-procs", "2", "prog"});
  EXPECT_FALSE(bad.command);
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_TRUE(bad.text_is_error);
  EXPECT_NE(bad.text.find("--num-procs"), std::string::npos) << bad.text;
}

ParseOutcome parse_error(const std::vector<std::string>& args) {
  ParseOutcome out = parse_launch_command(args);
  EXPECT_FALSE(out.command.has_value());
  EXPECT_EQ(out.exit_code, 2);
  EXPECT_TRUE(out.text_is_error);
  return out;
}

// HF Accelerate's --num_processes counts every machine's processes: with its --num_machines the
// launcher divides; torchrun's --nproc-per-node is per machine already.
TEST(LaunchCli, HfNumMachinesMakesNumProcessesATotal) {
  LaunchCommand hf = parse_ok({"--num_machines", "2", "--num_processes", "8", "--machine_rank", "1",
                               "--main_process_ip", "10.0.0.1", "train.py"});
  EXPECT_EQ(flag_value(hf, "nodes"), "2");
  EXPECT_EQ(flag_value(hf, "num_processes"), "4");
  EXPECT_EQ(flag_value(hf, "machine_rank"), "1");
  for (const auto& f : hf.flags) {
    if (f.key == "num_processes") {
      EXPECT_EQ(f.flag, "--num-processes 8 / --num-machines 2");
    }
  }
  LaunchCommand torchrun = parse_ok({"--num_machines", "2", "--nproc-per-node", "8", "train.py"});
  EXPECT_EQ(flag_value(torchrun, "num_processes"), "8");
  auto uneven = parse_error({"--num_machines", "2", "--num_processes", "7", "train.py"});
  EXPECT_NE(uneven.text.find("--num-processes 7 is not a multiple of --num-machines 2"),
            std::string::npos)
      << uneven.text;
}

TEST(LaunchCli, TorchrunRendezvousFlagsMapToTheCoordinator) {
  LaunchCommand cmd =
      parse_ok({"--nnodes", "2", "--rdzv-endpoint", "node0:29500", "--rdzv-backend", "c10d",
                "--rdzv-id", "run7", "--local-addr", "10.1.1.2", "train.py"});
  EXPECT_EQ(flag_value(cmd, "main_process_ip"), "node0");
  EXPECT_EQ(flag_value(cmd, "coordinator_port"), "29500");
  EXPECT_EQ(flag_value(cmd, "job_id"), "run7");
  EXPECT_EQ(flag_value(cmd, "node_address"), "10.1.1.2");
  ASSERT_EQ(cmd.warnings.size(), 1u);
  EXPECT_EQ(cmd.warnings[0],
            "--rdzv-backend c10d is ignored: accel's own coordinator is the "
            "rendezvous");
  LaunchCommand v6 = parse_ok({"--rdzv_endpoint=[fe80::1]:1234", "train.py"});
  EXPECT_EQ(flag_value(v6, "main_process_ip"), "fe80::1");
  EXPECT_EQ(flag_value(v6, "coordinator_port"), "1234");
  auto etcd = parse_error({"--rdzv-backend", "etcd", "train.py"});
  EXPECT_NE(etcd.text.find("--rdzv-backend etcd: not supported"), std::string::npos) << etcd.text;

  LaunchCommand standalone = parse_ok({"--standalone", "--nproc-per-node", "2", "train.py"});
  EXPECT_EQ(flag_value(standalone, "nodes"), "1");
  auto both = parse_error({"--nnodes", "2", "--standalone", "train.py"});
  EXPECT_NE(
      both.text.find("--standalone runs on this machine alone; it does not go with --nodes 2"),
      std::string::npos)
      << both.text;
}

TEST(LaunchCli, TuningFlagsAreIgnoredWithAWarning) {
  LaunchCommand cmd = parse_ok({"--monitor_interval", "0.1", "--redirects", "3", "--same_network",
                                "--dynamo_backend", "no", "-n", "2", "train.py", "--redirects"});
  ASSERT_EQ(cmd.warnings.size(), 3u);
  EXPECT_EQ(cmd.warnings[0],
            "--monitor-interval is ignored: accel-launch learns of a worker's "
            "exit at once, without polling");
  EXPECT_NE(cmd.warnings[1].find("--redirects is ignored: give --log-dir DIR"), std::string::npos);
  EXPECT_NE(cmd.warnings[2].find("--same-network is ignored"), std::string::npos);
  EXPECT_EQ(cmd.program.args, (std::vector<std::string>{"--redirects"}));  // the program's
}

TEST(LaunchCli, FeaturesAccelLacksAreRefusedByName) {
  for (const auto& args :
       std::vector<std::vector<std::string>>{{"--use_deepspeed", "train.py"},
                                             {"--deepspeed_config_file", "ds.json", "train.py"},
                                             {"--use_fsdp", "train.py"},
                                             {"--fsdp_sharding_strategy", "FULL_SHARD", "train.py"},
                                             {"--tpu", "train.py"}}) {
    auto out = parse_error(args);
    EXPECT_NE(out.text.find(": not supported: accel does not do "), std::string::npos) << out.text;
  }
  auto dynamo = parse_error({"--dynamo_backend", "inductor", "train.py"});
  EXPECT_NE(dynamo.text.find("does not wrap models in torch.compile"), std::string::npos);
  auto unknown = parse_error({"--frobnicate", "train.py"});
  EXPECT_NE(unknown.text.find("docs/launch.md"), std::string::npos) << unknown.text;
}

TEST(LaunchCli, AnEmptyValueAfterEqualsClearsAKey) {
  LaunchCommand cmd = parse_ok({"--checkpoint-dir=", "-n", "1", "train.py"});
  EXPECT_EQ(flag_value(cmd, "checkpoint_dir"), "");
  EXPECT_EQ(flag_value(cmd, "num_processes"), "1");
}

TEST(LaunchCli, GpuIdsAndMultiGpu) {
  LaunchCommand ids = parse_ok({"--gpu_ids", "0,2", "--multi_gpu", "train.py"});
  ASSERT_EQ(ids.worker_env.size(), 1u);
  EXPECT_EQ(ids.worker_env[0],
            (std::pair<std::string, std::string>{"CUDA_VISIBLE_DEVICES", "0,2"}));
  EXPECT_EQ(flag_value(ids, "num_processes"), "2");  // one worker per listed GPU
  LaunchCommand all = parse_ok({"--gpu_ids", "all", "-n", "2", "train.py"});
  EXPECT_TRUE(all.worker_env.empty());
  auto cpu = parse_error({"--multi_gpu", "--cpu", "train.py"});
  EXPECT_NE(cpu.text.find("--multi-gpu does not go with --cpu"), std::string::npos) << cpu.text;
  LaunchCommand counted = parse_ok({"--multi_gpu", "-n", "3", "train.py"});
  EXPECT_EQ(flag_value(counted, "num_processes"), "3");
}

}  // namespace
}  // namespace accel::launcher

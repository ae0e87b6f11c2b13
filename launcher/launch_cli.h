// Command-line parsing for accel-launch (CLI11). Every long flag is also accepted with
// underscores (--num_processes), as HF Accelerate and torchrun users type them, and their other
// launch flags are mapped where they mean something here (--num_machines, --gpu_ids,
// --multi_gpu, --standalone, --rdzv-endpoint, ...), ignored with a warning where they are only
// tuning that accel does not need (--monitor_interval), and refused with a reason where they ask
// for a feature accel does not have (--use_deepspeed, --use_fsdp, ...). Only flags the
// user typed become FlagValues: that is what makes "flag > env > file > default" hold per key.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "agent/config/config_loader.h"
#include "launcher/program.h"

namespace accel::launcher {

struct LaunchCommand {
  std::vector<config::FlagValue> flags;
  std::optional<std::string> config_file;
  bool print_config = false;
  // --slurm / --no-slurm; by default Slurm's variables are read when SLURM_JOB_ID is set.
  config::SlurmUse slurm = config::SlurmUse::kAuto;
  // --slurm-submit (write a batch script and sbatch it) / --slurm-script PATH (write it only),
  // with --sbatch-arg options for sbatch. The script runs `srun accel-launch` with `resubmit`.
  bool slurm_submit = false;
  std::string slurm_script;
  std::vector<std::string> sbatch_args;
  std::vector<std::string> resubmit;  // this command's own options, minus the submit ones
  [[nodiscard]] bool writes_slurm_script() const { return slurm_submit || !slurm_script.empty(); }
  // --env KEY=VALUE / --env KEY (its value here): set for every worker on every node, after
  // the contract's variables. Standing agents (mode 3) give workers their own environment, so
  // this is how a submitter passes variables along.
  std::vector<std::pair<std::string, std::string>> worker_env;
  ProgramSpec program;
  // HF Accelerate's and torchrun's flags that mean nothing here, each with why (printed as
  // warnings before the launch).
  std::vector<std::string> warnings;
};

struct ParseOutcome {
  std::optional<LaunchCommand> command;  // set: go on and launch
  int exit_code = 0;                     // otherwise: exit with this...
  std::string text;                      // ...after printing this (help, version, or an error)
  bool text_is_error = false;
};

// `args` excludes argv[0].
ParseOutcome parse_launch_command(const std::vector<std::string>& args);

}  // namespace accel::launcher

// accel-launch's flags and their mapping onto config keys.
#include "launcher/launch_cli.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <map>
#include <set>

#include "accel_version.h"
#include "agent/config/key_flags.h"
#include "agent/supervisor/worker_env.h"
#include "launcher/foreign_flags.h"

namespace accel::launcher {
namespace {

constexpr const char* kExamples = R"(
Examples:
  accel-launch -n 2 ./build/bin/train_mlp --epochs 2      # 2 local workers
  accel-launch -n 2 train.py --lr 3e-4                     # a Python script, under python3
  accel-launch -n 4 -m my_pkg.train                        # a Python module
  accel-launch --config cluster.yaml --max-restarts 3 ./train
  accel-launch -n 2 --print-config                         # show the resolved config and exit
  # Slurm: one accel-launch per node inside an allocation (nodes, rank, first node: from Slurm)
  srun --ntasks-per-node=1 accel-launch -n 2 ./train
  accel-launch --slurm-submit --nodes 2 -n 2 --sbatch-arg=--time=1:00:00 ./train
  accel-launch -n 2 -- sh -c 'echo "rank $RANK of $WORLD_SIZE"'
  # two machines, the same command on each (machine rank 0 hosts the coordinator)
  ACCEL_TOKEN=$(cat ~/.accel-token) accel-launch --nodes 2 --machine-rank 0 --main-process-ip 10.0.0.1 -n 8 ./train
  # standing agents (accel-agent): submit from anywhere, stream the output, exit with the code
  ACCEL_TOKEN=$(cat ~/.accel-token) accel-launch --coordinator 10.0.0.1:29400 --nodes 2:4 -n 8 ./train

Every long flag also takes underscores (--num_processes). A flag you type beats an ACCEL_*
environment variable, which beats Slurm's variables, which beat the config file, which beats the
default.
Docs: docs/launch.md, docs/clusters.md, docs/operations.md, docs/configuration.md,
docs/worker-environment.md.
)";

// Splits args into [launcher options] and [PROGRAM args...], normalizing --long_names.
struct Split {
  std::vector<std::string> options;
  ProgramSpec program;
};

Split split_args(const CLI::App& app, const std::vector<std::string>& args) {
  Split out;
  auto takes_value = [&](const std::string& name) {
    const CLI::Option* opt = app.get_option_no_throw(name);
    return opt != nullptr && opt->get_expected_min() > 0;
  };
  for (size_t i = 0; i < args.size(); ++i) {
    std::string a = args[i];
    auto rest = [&](size_t from) {
      return std::vector<std::string>(args.begin() + static_cast<long>(std::min(from, args.size())),
                                      args.end());
    };
    if (a == "--") {
      if (i + 1 < args.size()) {
        out.program.program = args[i + 1];
        out.program.args = rest(i + 2);
      }
      return out;
    }
    if (a.rfind("--", 0) == 0) {
      auto eq = a.find('=');
      std::string name = a.substr(0, eq);
      std::replace(name.begin() + 2, name.end(), '_', '-');
      std::string value = eq == std::string::npos ? "" : a.substr(eq + 1);
      if (name == "--module") {
        out.program.module =
            eq != std::string::npos ? value : (i + 1 < args.size() ? args[++i] : "");
        out.program.args = rest(i + 1);
        return out;
      }
      if (eq != std::string::npos && value.empty() && takes_value(name)) {
        // `--checkpoint-dir=` sets the empty value; CLI11 would read "--x=" as a flag with
        // its value still to come.
        out.options.push_back(name);
        out.options.push_back("");
        continue;
      }
      out.options.push_back(eq == std::string::npos ? name : name + "=" + value);
      if (eq == std::string::npos && takes_value(name) && i + 1 < args.size()) {
        out.options.push_back(args[++i]);
      }
      continue;
    }
    if (a.size() >= 2 && a[0] == '-') {
      if (a == "-m") {
        out.program.module = i + 1 < args.size() ? args[++i] : "";
        out.program.args = rest(i + 1);
        return out;
      }
      if (a.rfind("-m", 0) == 0 && a.size() > 2 && a[2] != '=') {  // -mpkg.train
        out.program.module = a.substr(2);
        out.program.args = rest(i + 1);
        return out;
      }
      out.options.push_back(a);
      if (a.size() == 2 && takes_value(a) && i + 1 < args.size()) out.options.push_back(args[++i]);
      continue;
    }
    out.program.program = a;
    out.program.args = rest(i + 1);
    return out;
  }
  return out;
}

}  // namespace

ParseOutcome parse_launch_command(const std::vector<std::string>& args) {
  CLI::App app(
      "accel-launch: start a training job on local worker processes and keep it alive.\n"
      "  accel-launch [OPTIONS] PROGRAM [ARGS...]\n"
      "  accel-launch [OPTIONS] -m MODULE [ARGS...]",
      "accel-launch");
  app.footer(kExamples);
  app.set_version_flag("--version", std::string("accel-launch ") + ACCEL_VERSION);

  config::KeyFlags keys(app, config::kLaunchFlag);

  std::string config_file;
  CLI::Option* config_opt =
      app.add_option("--config,--config-file", config_file,
                     "YAML config file, accel's or HF Accelerate's (default: $ACCEL_CONFIG_FILE, "
                     "else accel's default location, else HF Accelerate's)")
          ->type_name("FILE");
  bool print_config = false;
  app.add_flag("--print-config", print_config,
               "Print the resolved configuration, with where each value came from, and exit");
  std::string module_placeholder;
  app.add_option("-m,--module", module_placeholder,
                 "Run a Python module (python3 -u -m MODULE); what follows goes to the module")
      ->type_name("MODULE");
  bool no_python = false;
  app.add_flag("--no-python", no_python, "Run PROGRAM as given even if it ends in .py");
  std::vector<std::string> worker_env;
  app.add_option("--env", worker_env,
                 "Set KEY=VALUE (or KEY as it is here) for every worker on every node; repeatable")
      ->type_name("KEY[=VALUE]");

  bool slurm_on = false;
  bool slurm_off = false;
  auto* slurm_opt = app.add_flag("--slurm", slurm_on,
                                 "Read Slurm's variables (nodes, machine rank, first node, job id) "
                                 "and fail outside an allocation; by default they are read when "
                                 "SLURM_JOB_ID is set");
  app.add_flag("--no-slurm", slurm_off, "Ignore Slurm's variables")->excludes(slurm_opt);
  bool slurm_submit = false;
  app.add_flag("--slurm-submit", slurm_submit,
               "Write a batch script that runs this command on --nodes nodes (srun, one "
               "accel-launch per node) and submit it with sbatch");
  std::string slurm_script;
  app.add_option("--slurm-script", slurm_script,
                 "Like --slurm-submit, but only write the batch script to FILE")
      ->type_name("FILE");
  std::vector<std::string> sbatch_args;
  app.add_option("--sbatch-arg", sbatch_args,
                 "With --slurm-submit: one more #SBATCH option (--sbatch-arg=--time=2:00:00); "
                 "repeatable")
      ->type_name("OPTION")
      ->allow_extra_args(false);

  ForeignFlags foreign(app);

  Split split = split_args(app, args);
  ParseOutcome outcome;
  auto error = [&](const std::string& message) {
    outcome.exit_code = 2;
    outcome.text_is_error = true;
    outcome.text = "accel-launch: " + message + "\n";
    return outcome;
  };
  if (std::string refused = ForeignFlags::refused(split.options); !refused.empty()) {
    return error(refused);
  }
  std::vector<std::string> reversed(split.options.rbegin(), split.options.rend());
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    outcome.text = app.help();
    return outcome;
  } catch (const CLI::CallForVersion& e) {
    outcome.text = std::string(e.what()) + "\n";
    return outcome;
  } catch (const CLI::ExtrasError& e) {
    return error(std::string(e.what()) +
                 "\nRun 'accel-launch --help' for accel's options; docs/launch.md says what "
                 "accel does with each HF Accelerate and torchrun flag.");
  } catch (const CLI::ParseError& e) {
    return error(std::string(e.what()) + "\nRun 'accel-launch --help' for usage.");
  }

  LaunchCommand cmd;
  cmd.flags = keys.typed();
  if (config_opt->count() > 0) cmd.config_file = config_file;
  cmd.print_config = print_config;
  if (slurm_on) cmd.slurm = config::SlurmUse::kOn;
  if (slurm_off) cmd.slurm = config::SlurmUse::kOff;
  cmd.slurm_submit = slurm_submit;
  cmd.slurm_script = slurm_script;
  cmd.sbatch_args = sbatch_args;
  if (cmd.writes_slurm_script()) {
    // The options the batch script's accel-launch gets: everything typed but the submit ones
    // (nodes come from the allocation).
    static const std::vector<std::string> kDropped = {
        "--slurm-submit", "--slurm-script", "--sbatch-arg", "--nodes",
        "--nnodes",       "--num-machines", "--slurm",      "--no-slurm"};
    for (size_t i = 0; i < split.options.size(); ++i) {
      const std::string& o = split.options[i];
      std::string name = o.substr(0, o.find('='));
      bool dropped = std::find(kDropped.begin(), kDropped.end(), name) != kDropped.end();
      bool separate_value = o.find('=') == std::string::npos && i + 1 < split.options.size() &&
                            app.get_option_no_throw(name) != nullptr &&
                            app.get_option_no_throw(name)->get_expected_min() > 0;
      if (!dropped) {
        cmd.resubmit.push_back(o);
        if (separate_value) cmd.resubmit.push_back(split.options[i + 1]);
      }
      if (separate_value) ++i;
    }
  }
  cmd.program = std::move(split.program);
  cmd.program.no_python = no_python;
  if (std::string problem = foreign.apply(split.options, cmd.flags, cmd.worker_env, cmd.warnings);
      !problem.empty()) {
    return error(problem);
  }
  for (const auto& kv : worker_env) {
    auto eq = kv.find('=');
    std::string key = kv.substr(0, eq);
    bool valid = !key.empty() && !std::isdigit(static_cast<unsigned char>(key[0])) &&
                 std::all_of(key.begin(), key.end(),
                             [](unsigned char c) { return std::isalnum(c) || c == '_'; });
    if (!valid) {
      outcome.exit_code = 2;
      outcome.text_is_error = true;
      outcome.text =
          "accel-launch: --env " + kv + ": expected KEY=VALUE or KEY, KEY of [A-Za-z0-9_]\n";
      return outcome;
    }
    auto why = supervisor::reserved_worker_variable(key);
    if (!why) why = config::set_by_key(key);
    if (why) {
      outcome.exit_code = 2;
      outcome.text_is_error = true;
      outcome.text = "accel-launch: --env " + key + ": " + *why + "\n";
      return outcome;
    }
    std::optional<std::string> value;  // KEY alone: its value here, if any
    if (eq != std::string::npos) {
      value = kv.substr(eq + 1);
    } else if (const char* v = std::getenv(key.c_str())) {
      value = v;
    }
    if (value) cmd.worker_env.emplace_back(key, *value);
  }
  // The value each key ends with (the last --env for a key wins) is what a worker reads.
  std::set<std::string> checked;
  for (auto it = cmd.worker_env.rbegin(); it != cmd.worker_env.rend(); ++it) {
    if (!checked.insert(it->first).second) continue;
    if (auto problem = supervisor::worker_value_problem(it->first, it->second)) {
      outcome.exit_code = 2;
      outcome.text_is_error = true;
      outcome.text = "accel-launch: --env " + it->first + "=" + it->second + ": " + *problem + "\n";
      return outcome;
    }
  }
  outcome.command = std::move(cmd);
  return outcome;
}

}  // namespace accel::launcher

// accel-launch's flags and their mapping onto config keys.
#include "launcher/launch_cli.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <map>

#include "accel_version.h"
#include "agent/supervisor/worker_env.h"

namespace accel::launcher {
namespace {

constexpr const char* kExamples = R"(
Examples:
  accel-launch -n 2 ./build/bin/train_mlp --epochs 2      # 2 local workers
  accel-launch -n 2 train.py --lr 3e-4                     # a Python script, under python3
  accel-launch -n 4 -m my_pkg.train                        # a Python module
  accel-launch --config cluster.yaml --max-restarts 3 ./train
  accel-launch -n 2 --print-config                         # show the resolved config and exit
  accel-launch -n 2 -- sh -c 'echo "rank $RANK of $WORLD_SIZE"'
  # two machines, the same command on each (machine rank 0 hosts the coordinator)
  ACCEL_TOKEN=$(cat ~/.accel-token) accel-launch --nodes 2 --machine-rank 0 --main-process-ip 10.0.0.1 -n 8 ./train
  # standing agents (accel-agent): submit from anywhere, stream the output, exit with the code
  ACCEL_TOKEN=$(cat ~/.accel-token) accel-launch --coordinator 10.0.0.1:29400 --nodes 2:4 -n 8 ./train

Every long flag also takes underscores (--num_processes). A flag you type beats an ACCEL_*
environment variable, which beats the config file, which beats the default.
Docs: docs/launch.md, docs/operations.md, docs/configuration.md, docs/worker-environment.md.
)";

struct KeyedOption {
  std::string key;
  CLI::Option* option;
  std::string* value;  // for options with a value
  bool* flag;          // for boolean flags (--cpu, --cpu=false)
};

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

  std::map<std::string, std::string> values;
  std::vector<KeyedOption> keyed;
  auto opt = [&](const std::string& names, const std::string& key, const std::string& help) {
    std::string* slot = &values[key];
    CLI::Option* o =
        app.add_option(names, *slot, help)->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    keyed.push_back({key, o, slot, nullptr});
    return o;
  };
  std::map<std::string, bool> flags;
  auto flag = [&](const std::string& names, const std::string& key, const std::string& help) {
    bool* slot = &flags[key];
    CLI::Option* o = app.add_flag(names, *slot, help);
    keyed.push_back({key, o, nullptr, slot});
    return o;
  };

  opt("-n,--num-processes,--nproc-per-node", "num_processes",
      "Worker processes to start (default 1)")
      ->type_name("N");
  opt("--nodes,--nnodes", "nodes", "Nodes in the job: N or MIN:MAX (default 1)")
      ->type_name("N|MIN:MAX");
  opt("--machine-rank,--node-rank", "machine_rank", "This node's rank (default 0)")->type_name("K");
  opt("--main-process-ip,--master-addr", "main_process_ip", "MASTER_ADDR (default 127.0.0.1)")
      ->type_name("HOST");
  opt("--main-process-port,--master-port", "main_process_port",
      "MASTER_PORT; 0 picks a free one per attempt (default 0)")
      ->type_name("PORT");
  opt("--max-restarts", "max_restarts",
      "Restart the whole group up to N times after a failure (default 0)")
      ->type_name("N");
  opt("--log-dir", "log_dir", "Also write <DIR>/<job>/attempt_<k>/rank_<r>.log (default: none)")
      ->type_name("DIR");
  opt("--tee", "tee",
      "With --log-dir, streams still shown on the console: 0 none, 1 stdout, 2 stderr, 3 both "
      "(default 3)")
      ->type_name("0-3");
  opt("--mixed-precision", "mixed_precision", "no, fp16 or bf16 (default no)")->type_name("MODE");
  opt("--gradient-accumulation-steps", "gradient_accumulation_steps",
      "Micro-batches per optimizer step (default 1)")
      ->type_name("N");
  flag("--cpu,--use-cpu", "use_cpu", "Train on CPU even where a GPU is present");
  flag("--debug", "debug", "Set ACCELERATE_DEBUG_MODE=true for the workers");
  opt("--stop-timeout", "stop_timeout",
      "Grace between SIGTERM and SIGKILL when stopping workers (default 10s)")
      ->type_name("DURATION");
  opt("--collective-timeout", "collective_timeout",
      "Bound on every collective in the workers (default 30m)")
      ->type_name("DURATION");
  opt("--checkpoint-dir", "checkpoint_dir",
      "Save checkpoints in DIR and resume from them after a restart (default: none)")
      ->type_name("DIR");
  opt("--checkpoint-interval", "checkpoint_interval",
      "Save a checkpoint every N optimizer steps; 0: only on save_state() (default 0)")
      ->type_name("N");
  opt("--num-cpu-threads-per-process", "num_cpu_threads_per_process",
      "OMP_NUM_THREADS per worker (default: 1 when several workers)")
      ->type_name("N");
  opt("--job-id,--run-id", "job_id", "Name of the job (default: generated)")->type_name("ID");
  flag("-q,--quiet", "quiet", "Only warnings, errors and the failure summary from the launcher");
  opt("--coordinator", "coordinator",
      "Submit to the standing coordinator at HOST:PORT and stream the job's output (mode 3)")
      ->type_name("HOST:PORT");
  opt("--coordinator-port,--rdzv-port", "coordinator_port",
      "Multi-node: port of the coordinator machine rank 0 serves (default 29400)")
      ->type_name("PORT");
  opt("--token-file", "token_file", "File with the control plane's token (default: $ACCEL_TOKEN)")
      ->type_name("FILE");
  opt("--tls-cert", "tls_cert", "PEM certificate for gRPC TLS")->type_name("FILE");
  opt("--tls-key", "tls_key", "PEM key of --tls-cert")->type_name("FILE");
  opt("--tls-ca", "tls_ca", "PEM CA: use TLS and verify the peer with it")->type_name("FILE");
  opt("--node-id", "node_id", "This node's id at the coordinator (default: host-pid-random)")
      ->type_name("ID");
  opt("--node-address", "node_address",
      "Where other nodes reach this one (default: found from the route to the coordinator)")
      ->type_name("HOST");
  opt("--lease-timeout", "lease_timeout",
      "A node silent this long is lost and the job goes on without it (default 10s)")
      ->type_name("DURATION");
  opt("--join-timeout", "join_timeout",
      "Fail when fewer than the minimum nodes joined a round by then (default 5m)")
      ->type_name("DURATION");
  opt("--hang-timeout", "hang_timeout",
      "Stop the group when a collective has been in flight this long; 0 off (default 10m)")
      ->type_name("DURATION");
  opt("--heartbeat-timeout", "heartbeat_timeout",
      "Stop the group when a worker shows no progress outside collectives this long; 0 off "
      "(default 30m)")
      ->type_name("DURATION");
  opt("--last-call", "last_call",
      "Elastic: with the minimum nodes joined, wait this long for more (default 30s)")
      ->type_name("DURATION");

  std::string config_file;
  CLI::Option* config_opt =
      app.add_option("--config,--config-file", config_file,
                     "YAML config file (default: $ACCEL_CONFIG_FILE, else the default location)")
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

  Split split = split_args(app, args);
  std::vector<std::string> reversed(split.options.rbegin(), split.options.rend());
  ParseOutcome outcome;
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    outcome.text = app.help();
    return outcome;
  } catch (const CLI::CallForVersion& e) {
    outcome.text = std::string(e.what()) + "\n";
    return outcome;
  } catch (const CLI::ParseError& e) {
    outcome.exit_code = 2;
    outcome.text_is_error = true;
    outcome.text =
        std::string("accel-launch: ") + e.what() + "\nRun 'accel-launch --help' for usage.\n";
    return outcome;
  }

  LaunchCommand cmd;
  for (const auto& k : keyed) {
    if (k.option->count() == 0) continue;
    std::string spelling = "--" + k.option->get_lnames().front();
    cmd.flags.push_back({k.key, k.flag ? (*k.flag ? "true" : "false") : *k.value, spelling});
  }
  if (config_opt->count() > 0) cmd.config_file = config_file;
  cmd.print_config = print_config;
  cmd.program = std::move(split.program);
  cmd.program.no_python = no_python;
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
    if (auto why = supervisor::reserved_worker_variable(key)) {
      outcome.exit_code = 2;
      outcome.text_is_error = true;
      outcome.text = "accel-launch: --env " + key + ": " + *why + "\n";
      return outcome;
    }
    if (eq != std::string::npos) {
      cmd.worker_env.emplace_back(key, kv.substr(eq + 1));
    } else if (const char* v = std::getenv(key.c_str())) {
      cmd.worker_env.emplace_back(key, v);
    }
  }
  outcome.command = std::move(cmd);
  return outcome;
}

}  // namespace accel::launcher

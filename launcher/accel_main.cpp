// accel: the user-facing tool beside accel-launch. `accel status` shows a coordinator's
// nodes, jobs, ranks, restarts and last failures; `accel config` asks questions and writes the
// configuration, and its subcommands show, check, import and write it without questions.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>

#include "accel_version.h"
#include "agent/config/config_loader.h"
#include "agent/config/key_flags.h"
#include "agent/coordinator/coordinator_core.h"
#include "agent/coordinator/request_limits.h"
#include "agent/node/control_plane_config.h"
#include "agent/rpc/rpc_security.h"
#include "agent/supervisor/line_sink.h"
#include "launcher/config_cmd.h"
#include "launcher/config_wizard.h"
#include "launcher/env_cmd.h"
#include "launcher/test_cmd.h"
#include "launcher/weights_cmd.h"

namespace {

int fail(const std::string& message, int code = 2) {
  accel::supervisor::write_all(STDERR_FILENO, "accel: error: " + message + "\n");
  return code;
}

std::string ago(int64_t ms) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1fs ago", static_cast<double>(ms) / 1000.0);
  return buf;
}

int status(const accel::config::ClusterConfig& cfg, const accel::supervisor::EnvMap& env) {
  namespace pb = accel::v1;
  if (cfg.coordinator.empty()) {
    return fail(
        "accel status needs the coordinator: --coordinator HOST:PORT or coordinator: in the "
        "config");
  }
  auto client = accel::node::connect(cfg, env, cfg.coordinator);
  if (!client) return fail(client.message());
  pb::GetStatusResponse resp;
  grpc::Status st = (*client)->get_status(&resp, std::chrono::seconds(5));
  if (!st.ok())
    return fail("coordinator at " + cfg.coordinator + ": " + accel::rpc::describe(st), 1);
  std::printf("coordinator %s (%s)\n\n", cfg.coordinator.c_str(),
              accel::coordinator::limits::printable(resp.coordinator_id()).c_str());
  std::printf("NODES (%d)\n  %-32s %-16s %-10s %-22s %s\n", resp.nodes_size(), "node", "address",
              "state", "job (node rank)", "last heartbeat");
  // Why printable(): every string here came from a peer; control characters must not reach the
  // terminal (a fake line, an escape sequence).
  using accel::coordinator::limits::printable;
  for (const auto& n : resp.nodes()) {
    std::string job =
        n.job_id().empty()
            ? "-"
            : printable(n.job_id()) +
                  (n.node_rank() >= 0 ? " (" + std::to_string(n.node_rank()) + ")" : " (joining)");
    std::printf("  %-32s %-16s %-10s %-22s %s\n", printable(n.node_id()).c_str(),
                printable(n.address()).c_str(),
                n.lost() ? "LOST" : (n.job_id().empty() ? "idle" : "busy"), job.c_str(),
                ago(n.last_seen_ms_ago()).c_str());
  }
  std::printf("\nJOBS (%d)\n  %-24s %-11s %-6s %-9s %-6s %-6s %s\n", resp.jobs_size(), "job",
              "state", "round", "restarts", "nodes", "world", "command");
  for (const auto& j : resp.jobs()) {
    std::string restarts =
        std::to_string(j.restart_count()) + "/" + std::to_string(j.max_restarts());
    std::string cmd = j.spec().argv_size() > 0 ? printable(j.spec().argv(0)) : "";
    std::printf("  %-24s %-11s %-6lld %-9s %-6d %-6d %s\n", printable(j.job_id()).c_str(),
                accel::coordinator::job_state_name(j.state()).c_str(),
                static_cast<long long>(j.round()), restarts.c_str(), j.num_nodes(), j.world_size(),
                cmd.c_str());
    if (j.has_last_failure()) {
      std::printf("      last failure: %s\n",
                  printable(accel::coordinator::describe_failure(j.last_failure())).c_str());
    }
  }
  return 0;
}

// `accel logs JOB [--follow]`: the job's events from its coordinator, from the first it keeps
// (its output when the job forwards it, as accel-launch --coordinator's jobs do; the
// coordinator's messages and failures). Without --follow it stops at the last one; with
// --follow it waits for the job's end and exits with the job's code.
int logs(const accel::config::ClusterConfig& cfg, const accel::supervisor::EnvMap& env,
         const std::string& job_id, bool follow) {
  namespace pb = accel::v1;
  using accel::coordinator::limits::printable;
  if (cfg.coordinator.empty()) {
    return fail(
        "accel logs needs the coordinator: --coordinator HOST:PORT or coordinator: in the config");
  }
  auto client = accel::node::connect(cfg, env, cfg.coordinator);
  if (!client) return fail(client.message());
  uint64_t after = 0;
  for (;;) {
    pb::WatchJobRequest req;
    req.set_job_id(job_id);
    req.set_after_seq(after);
    req.set_wait_ms(follow ? 1000 : 0);
    pb::WatchJobResponse resp;
    grpc::Status st = (*client)->watch_job(req, &resp, std::chrono::seconds(10));
    if (!st.ok()) {
      return fail("job " + job_id + " at " + cfg.coordinator + ": " + accel::rpc::describe(st), 1);
    }
    if (resp.dropped() > 0) {
      std::fprintf(stderr, "accel: %llu earlier events of job %s are no longer kept\n",
                   static_cast<unsigned long long>(resp.dropped()), job_id.c_str());
    }
    for (const auto& ev : resp.events()) {
      after = ev.seq();
      switch (ev.what_case()) {
        case pb::JobEvent::kLog: {
          const auto& l = ev.log();
          std::fprintf(l.stderr() ? stderr : stdout, "[%s:%d] %s\n",
                       printable(l.hostname()).c_str(), l.rank(), printable(l.text()).c_str());
          break;
        }
        case pb::JobEvent::kMessage:
          std::fprintf(stderr, "accel: %s\n", printable(ev.message()).c_str());
          break;
        case pb::JobEvent::kFailure:
          std::fprintf(stderr, "accel: %s\n",
                       printable(accel::coordinator::describe_failure(ev.failure())).c_str());
          break;
        default:
          break;
      }
    }
    std::fflush(stdout);
    if (resp.done()) {
      if (!resp.outcome().summary().empty()) std::fputs(resp.outcome().summary().c_str(), stderr);
      return follow ? resp.outcome().exit_code() : 0;
    }
    if (!follow && resp.events().empty()) return 0;
  }
}

}  // namespace

int main(int argc, char** argv) {
  accel::rpc::prepare_grpc_process();
  CLI::App app("accel: tools around accel-launch.", "accel");
  app.set_version_flag("--version", std::string("accel ") + ACCEL_VERSION);
  app.require_subcommand(1);
  auto* st = app.add_subcommand("status",
                                "Nodes, jobs, ranks, restarts and last failures of a coordinator");
  accel::config::KeyFlags keys(*st, accel::config::kStatusFlag);
  std::string config_file;
  st->add_option("--config", config_file, "YAML config file")->type_name("FILE");

  auto* logs_cmd = app.add_subcommand(
      "logs", "A job's output, messages and failures, as its coordinator keeps them");
  accel::config::KeyFlags logs_keys(*logs_cmd, accel::config::kStatusFlag);
  std::string logs_job;
  bool logs_follow = false;
  logs_cmd->add_option("JOB", logs_job, "The job id (accel status lists them)")->required();
  logs_cmd->add_flag("-f,--follow", logs_follow,
                     "Wait for more until the job ends, then exit with its exit code");
  std::string logs_config;
  logs_cmd->add_option("--config", logs_config, "YAML config file")->type_name("FILE");

  auto* cfg_cmd = app.add_subcommand(
      "config",
      "Write accel's configuration by answering questions (no subcommand), or show, check, "
      "import it");
  cfg_cmd->require_subcommand(0, 1);
  std::string wizard_file;
  cfg_cmd
      ->add_option("--config-file", wizard_file,
                   "Where the wizard writes (default: the default location)")
      ->type_name("PATH");
  auto* show = cfg_cmd->add_subcommand(
      "show", "The resolved configuration and where each value came from (as --print-config)");
  accel::config::KeyFlags show_keys(*show, accel::config::kLaunchFlag);
  std::string show_file;
  show->add_option("--config,--config-file", show_file, "YAML config file (accel's or HF's)")
      ->type_name("FILE");
  auto* check = cfg_cmd->add_subcommand("validate", "Check a config file (accel's or HF's)");
  std::string check_file;
  check->add_option("FILE", check_file, "The file")->required();
  auto* def = cfg_cmd->add_subcommand(
      "default", "Write a minimal config file: the keys given as flags, the rest default");
  accel::config::KeyFlags def_keys(*def, accel::config::kLaunchFlag);
  std::string out_file;
  bool force = false;
  def->add_option("--config-file", out_file, "Where to write (default: the default location)")
      ->type_name("PATH");
  def->add_flag("--force", force, "Replace an existing file");
  auto* imp = cfg_cmd->add_subcommand(
      "import", "Convert an HF Accelerate config file (default_config.yaml) to accel's keys");
  std::string hf_file;
  imp->add_option("FILE", hf_file, "The HF Accelerate config file")->required();
  imp->add_option("--config-file", out_file, "Where to write (default: the default location)")
      ->type_name("PATH");
  imp->add_flag("--force", force, "Replace an existing file");
  auto* env_cmd = app.add_subcommand(
      "env", "What a bug report needs (versions, CPU, GPUs, libtorch, config), as Markdown");
  std::string env_file;
  env_cmd->add_option("--config,--config-file", env_file, "YAML config file (accel's or HF's)")
      ->type_name("FILE");
  auto* test_cmd = app.add_subcommand(
      "test",
      "Check this installation: runs a built-in job through accel-launch with the options given "
      "(-n 2, --nodes ..., --config ...) and prints a PASS/FAIL table");
  test_cmd->allow_extras();
  accel::launcher::TestOptions test_options;
  test_cmd->add_flag("--verbose", test_options.verbose,
                     "Show the launcher's and the workers' output as it comes");
  test_cmd
      ->add_flag("--inject-collective-fault", test_options.inject_collective_fault,
                 "Make one rank send a wrong value, to see a FAIL (tests accel test itself)")
      ->group("");
  auto* mem_cmd = app.add_subcommand(
      "estimate-memory",
      "Parameters and training memory per rank of a save_model folder or a .safetensors file");
  accel::launcher::EstimateMemoryOptions mem;
  mem_cmd->add_option("PATH", mem.path, "A save_model folder, a .safetensors file or its index")
      ->required();
  mem_cmd
      ->add_option("--world-size,--num-processes", mem.world_size,
                   "Ranks for the ZeRO-1 rows (they appear above 1)")
      ->capture_default_str();
  mem_cmd->add_option("--optimizers", mem.optimizers, "adamw, sgd")
      ->delimiter(',')
      ->capture_default_str();
  mem_cmd->add_option("--dtypes", mem.dtypes, "fp32, bf16, fp16")
      ->delimiter(',')
      ->capture_default_str();
  auto* merge_cmd = app.add_subcommand(
      "merge-weights",
      "Merge a sharded save_model folder into one .safetensors file, or split one with "
      "--max-shard-size");
  accel::launcher::MergeWeightsOptions merge;
  std::string max_shard;
  merge_cmd->add_option("INPUT", merge.input, "A save_model folder, a .safetensors file or index")
      ->required();
  merge_cmd->add_option("OUTPUT", merge.output, "The merged file; with --max-shard-size, a folder")
      ->required();
  merge_cmd
      ->add_option("--max-shard-size", max_shard,
                   "Split into shards of at most this size (500MB, 5GB, 2GiB)")
      ->type_name("SIZE");
  merge_cmd->add_flag("--force", merge.force, "Replace an existing output");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  auto env_now = accel::config::environment_snapshot();
  std::optional<std::string> out_path;
  if (!out_file.empty()) out_path = out_file;
  if (show->parsed()) {
    accel::config::ConfigSources src{std::nullopt, env_now, show_keys.typed()};
    src.slurm = accel::config::SlurmUse::kAuto;  // what accel-launch would resolve here
    if (!show_file.empty()) src.config_file = show_file;
    return accel::launcher::config_show(src);
  }
  if (check->parsed()) return accel::launcher::config_validate(check_file);
  if (def->parsed())
    return accel::launcher::config_default(def_keys.typed(), env_now, out_path, force);
  if (imp->parsed()) return accel::launcher::config_import(hf_file, env_now, out_path, force);
  if (mem_cmd->parsed()) return accel::launcher::estimate_memory(mem, std::cout, std::cerr);
  if (merge_cmd->parsed()) {
    if (!max_shard.empty()) {
      merge.max_shard_size = accel::launcher::parse_size(max_shard);
      if (!merge.max_shard_size) {
        return fail("--max-shard-size " + max_shard +
                    ": expected a size such as 500MB, 5GB or 2GiB (above 0)");
      }
    }
    return accel::launcher::merge_weights(merge, std::cout, std::cerr);
  }
  if (env_cmd->parsed()) {
    accel::config::ConfigSources src{std::nullopt, env_now, {}};
    src.slurm = accel::config::SlurmUse::kAuto;
    if (!env_file.empty()) src.config_file = env_file;
    return accel::launcher::print_env(src);
  }
  if (test_cmd->parsed()) {
    test_options.launch_args = test_cmd->remaining();
    return accel::launcher::run_test(test_options);
  }
  if (cfg_cmd->parsed()) {
    accel::launcher::WizardOptions wizard;
    if (!wizard_file.empty()) wizard.path = wizard_file;
    wizard.interactive = ::isatty(STDIN_FILENO) == 1;
    return accel::launcher::config_wizard(env_now, wizard, std::cin, std::cout);
  }

  accel::config::ConfigSources sources;
  if (!config_file.empty()) sources.config_file = config_file;
  if (logs_cmd->parsed() && !logs_config.empty()) sources.config_file = logs_config;
  sources.env = accel::config::environment_snapshot();
  sources.flags = logs_cmd->parsed() ? logs_keys.typed() : keys.typed();
  auto resolved = accel::config::resolve_config(sources);
  if (!resolved) return fail(resolved.message());
  accel::supervisor::EnvMap env(sources.env.begin(), sources.env.end());
  if (st->parsed()) return status(resolved->config, env);
  if (logs_cmd->parsed()) return logs(resolved->config, env, logs_job, logs_follow);
  return 0;
}

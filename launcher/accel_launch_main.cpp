// accel-launch: parse flags, resolve the config, run the job's workers locally, exit with the
// job's code.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/io_context.hpp>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <random>

#include "agent/common/stop_signals.h"
#include "agent/common/temp_dir.h"
#include "agent/config/config_loader.h"
#include "agent/config/job_spec_builder.h"
#include "agent/supervisor/line_sink.h"
#include "agent/supervisor/worker_env.h"
#ifndef ACCEL_LAUNCH_CLUSTER
#define ACCEL_LAUNCH_CLUSTER 0
#endif
#if ACCEL_LAUNCH_CLUSTER
#include "agent/rpc/rpc_security.h"
#include "launcher/cluster_launch.h"
#endif
#include "launcher/exit_codes.h"
#include "launcher/launch_cli.h"
#include "launcher/local_launch.h"
#include "launcher/slurm_submit.h"

namespace {

namespace fs = std::filesystem;

std::string generate_job_id() {
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::localtime_r(&now, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", &tm);
  std::random_device rd;
  char suffix[8];
  std::snprintf(suffix, sizeof suffix, "%04x", rd() & 0xffffu);
  return std::string(stamp) + "-" + suffix;
}

int fail(const std::string& message, int code = accel::launcher::kExitUsage) {
  std::string text = "accel-launch: error: " + message + "\n";
  accel::supervisor::write_all(STDERR_FILENO, text);
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  std::signal(SIGPIPE, SIG_IGN);  // a closed console must not kill the supervisor
  std::vector<std::string> args(argv + 1, argv + argc);
  auto parsed = accel::launcher::parse_launch_command(args);
  if (!parsed.command) {
    accel::supervisor::write_all(parsed.text_is_error ? STDERR_FILENO : STDOUT_FILENO, parsed.text);
    return parsed.exit_code;
  }
  auto& cmd = *parsed.command;

  accel::config::ConfigSources sources{cmd.config_file, accel::config::environment_snapshot(),
                                       cmd.flags};
  // Why not when writing a batch script: it runs where the job is submitted, not in it.
  sources.slurm = cmd.writes_slurm_script() ? accel::config::SlurmUse::kOff : cmd.slurm;
  auto resolved = accel::config::resolve_config(sources);
  if (!resolved) return fail(resolved.message());
  // Why at the start: a Python worker does not read ACCEL_KEEP_FREED_MEMORY itself (accel-launch
  // reads it for the worker's malloc), so a mistyped value would otherwise pass unnoticed. Not
  // with a standing coordinator: the workers get its agents' environment, which they check.
  for (const auto& [name, value] : sources.env) {
    auto problem = accel::supervisor::worker_value_problem(name, value);
    if (!problem || !resolved->config.coordinator.empty()) continue;
    const bool replaced = std::any_of(cmd.worker_env.begin(), cmd.worker_env.end(),
                                      [&](const auto& kv) { return kv.first == name; });
    if (!replaced) return fail("environment variable " + name + "=\"" + value + "\": " + *problem);
  }
  resolved->warnings.insert(resolved->warnings.begin(), cmd.warnings.begin(), cmd.warnings.end());
  if (cmd.print_config) {
    std::cout << accel::config::render_config(*resolved) << std::flush;
    return 0;
  }
  accel::config::ClusterConfig& cfg = resolved->config;
  if (!cfg.coordinator.empty()) {
    // Why: these keys belong to `--nodes N` launches, where every node runs accel-launch (mode 2);
    // a standing coordinator assigns machine ranks itself and has its own port. Ignoring them made
    // a job wait for nodes that would never come.
    for (const char* key : {"machine_rank", "coordinator_port"}) {
      const auto& origin = cfg.origin(key);
      if (origin.source != accel::config::Source::kDefault) {
        return fail(
            origin.where + ": " + key + " does not go with coordinator (" +
            cfg.origin("coordinator").where +
            "): a standing coordinator places the nodes itself. For every node running "
            "accel-launch, drop coordinator and give nodes, machine_rank and main_process_ip");
      }
    }
  }
  if (cmd.program.program.empty() && !cmd.program.module) {
    return fail("no PROGRAM given: accel-launch [OPTIONS] PROGRAM [ARGS...] (see --help)");
  }
  if (cmd.program.module && cmd.program.no_python) {
    return fail("--module and --no-python cannot be used together: -m runs a Python module");
  }
  if (cmd.program.module && cmd.program.module->empty()) {
    return fail("-m/--module needs a module name");
  }
  auto argv_resolved = accel::launcher::resolve_command(cmd.program, sources.env);
  if (!argv_resolved) return fail(argv_resolved.message(), accel::launcher::kExitNotFound);
  if (cmd.writes_slurm_script()) {
    if (!cfg.coordinator.empty()) {
      return fail("--slurm-submit does not go with coordinator (" +
                  cfg.origin("coordinator").where +
                  "): inside the allocation the first node hosts the coordinator");
    }
    return accel::launcher::slurm_submit(cmd, cfg, *argv_resolved);
  }
  auto spec = accel::config::make_job_spec(cfg, *argv_resolved, cmd.worker_env);
  if (!spec) return fail(spec.message());

  auto logger = spdlog::stderr_color_mt("accel-launch");
  logger->set_pattern("%^[accel-launch]%$ %v");
  logger->set_level(cfg.quiet ? spdlog::level::warn : spdlog::level::info);
  const bool cluster = !cfg.coordinator.empty() || cfg.nodes.max > 1;
  // Why not before an exec of accel-launch-cluster: it parses the same flags and warns itself.
  if (ACCEL_LAUNCH_CLUSTER || !cluster) {
    for (const auto& w : resolved->warnings) logger->warn("{}", w);
  }

  if (cluster) {
#if ACCEL_LAUNCH_CLUSTER
    // Why before gRPC starts: a thread it starts with SIGTERM unblocked would take the signal
    // and die of it, job left running, instead of the launcher cancelling it.
    if (!cfg.coordinator.empty()) accel::launcher::block_submit_signals();
    accel::rpc::prepare_grpc_process();
    accel::launcher::ClusterLaunch launch{
        .cfg = cfg, .spec = std::move(*spec), .env = {}, .job_id = cfg.job_id};
    for (const auto& [k, v] : sources.env) launch.env.emplace(k, v);
    int code = 0;
    if (!cfg.coordinator.empty()) {
      code = accel::launcher::run_submit(launch);  // mode 3
    } else {
      if (launch.job_id.empty()) launch.job_id = generate_job_id();
      code = accel::launcher::run_multi_node(launch);  // mode 2
    }
    // Why _Exit: gRPC completions may still be running on its threads; static destructors
    // racing them abort the process ("ref_counted.h: assertion failed") after the job is done.
    std::fflush(nullptr);
    std::_Exit(code);
#else
    // Why a second binary: gRPC's 50-odd shared libraries cost ~20 ms at every start; the local
    // mode (the common one) must not pay for the control plane it does not use.
    std::error_code ec;
    fs::path self = fs::read_symlink("/proc/self/exe", ec);
    std::string cluster_bin = (self.parent_path() / "accel-launch-cluster").string();
    ::execv(cluster_bin.c_str(), argv);
    return fail("multi-node and --coordinator jobs need " + cluster_bin +
                    " (installed beside accel-launch): " + std::strerror(errno),
                1);
#endif
  }

  accel::launcher::LocalLaunch local{.cfg = cfg,
                                     .spec = std::move(*spec),
                                     .env = {sources.env.begin(), sources.env.end()},
                                     .job_id = cfg.job_id.empty() ? generate_job_id() : cfg.job_id};
  int exit_code = accel::launcher::run_local(local);
  return exit_code;
}

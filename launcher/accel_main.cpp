// accel: the user-facing tool beside accel-launch. `accel status` shows a coordinator's
// nodes, jobs, ranks, restarts and last failures.
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
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  accel::config::ConfigSources sources;
  if (!config_file.empty()) sources.config_file = config_file;
  sources.env = accel::config::environment_snapshot();
  sources.flags = keys.typed();
  auto resolved = accel::config::resolve_config(sources);
  if (!resolved) return fail(resolved.message());
  accel::supervisor::EnvMap env(sources.env.begin(), sources.env.end());
  if (st->parsed()) return status(resolved->config, env);
  return 0;
}

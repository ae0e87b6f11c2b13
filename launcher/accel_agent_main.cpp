// accel-agent: the per-node daemon (systemd, Slurm). Registers with a coordinator, runs the
// workers of the jobs it is given, and keeps them alive; optionally hosts the coordinator.
#include <grp.h>
#include <linux/capability.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>

#include "accel_version.h"
#include "agent/common/clock.h"
#include "agent/common/file_limit.h"
#include "agent/common/safe_file.h"
#include "agent/common/stop_signals.h"
#include "agent/common/systemd_notify.h"
#include "agent/common/temp_dir.h"
#include "agent/config/config_loader.h"
#include "agent/config/key_flags.h"
#include "agent/coordinator/coordinator_server.h"
#include "agent/node/control_plane_config.h"
#include "agent/node/metrics_endpoint.h"
#include "agent/rpc/rpc_security.h"
#include "agent/supervisor/line_sink.h"
#include "agent/supervisor/worker_env.h"

namespace {

namespace fs = std::filesystem;
using accel::supervisor::LogLevel;

int fail(const std::string& message, int code = 2) {
  accel::supervisor::write_all(STDERR_FILENO, "accel-agent: error: " + message + "\n");
  return code;
}

constexpr const char* kFooter = R"(
Examples:
  ACCEL_TOKEN=$(cat ~/.accel-token) accel-agent --serve-coordinator 29400          # node 0: coordinator + agent
  ACCEL_TOKEN=$(cat ~/.accel-token) accel-agent --coordinator 10.0.0.1:29400       # every other node
  ACCEL_TOKEN=$(cat ~/.accel-token) accel-agent --serve-coordinator 29400 --coordinator-only
  accel-agent --config /etc/accel/agent.yaml                        # keys as in cluster.yaml

Then submit from anywhere: accel-launch --coordinator 10.0.0.1:29400 -n 4 --nodes 2 ./train
SIGTERM or Ctrl-C stop the workers and the agent; SIGHUP is ignored. Docs: docs/operations.md.
)";

}  // namespace

namespace {

// Once the token (and TLS keys) are read, the workers, which inherit this process's groups and
// capabilities, must not be able to read them again. The systemd unit lets only the supplementary
// group accel-token read /etc/accel/token and gives the agent CAP_SETGID for this one call: the
// supplementary groups go, then every capability. Run as root (a test, a node without the unit),
// nothing is dropped: root's workers could read the file anyway. Returns why it failed, or "".
std::string drop_token_access() {
  if (::geteuid() == 0) return "";
  // Why getgroups(0): it counts them however many there are (a buffer could be too small).
  if (::getgroups(0, nullptr) > 0 && ::setgroups(0, nullptr) != 0) {
    if (errno != EPERM)
      return std::string("cannot drop the supplementary groups: ") + std::strerror(errno);
    // Without CAP_SETGID (not started by the unit): the groups stay, as before.
  }
  ::prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3] = {};
  if (::syscall(SYS_capset, &header, data) != 0)
    return std::string("cannot drop the capabilities: ") + std::strerror(errno);
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  accel::rpc::prepare_grpc_process();
  std::signal(SIGPIPE, SIG_IGN);
  CLI::App app("accel-agent: per-node daemon of accel's control plane.", "accel-agent");
  app.footer(kFooter);
  app.set_version_flag("--version", std::string("accel-agent ") + ACCEL_VERSION);
  accel::config::KeyFlags keys(app, accel::config::kAgentFlag);
  std::string config_file;
  auto* config_opt =
      app.add_option("--config", config_file, "YAML file with the keys above")->type_name("FILE");
  std::string serve;
  app.add_option("--serve-coordinator", serve, "Also host the coordinator on [HOST:]PORT")
      ->type_name("[HOST:]PORT");
  bool coordinator_only = false;
  app.add_flag("--coordinator-only", coordinator_only,
               "With --serve-coordinator: run no workers here");
  std::string state_dir;
  app.add_option("--state-dir", state_dir,
                 "Folder for the workers' error files and progress pages, private to this user "
                 "(default: $TMPDIR/accel-agent-<uid>-<node id>)")
      ->type_name("DIR");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  accel::config::ConfigSources sources;
  if (config_opt->count() > 0) sources.config_file = config_file;
  sources.env = accel::config::environment_snapshot();
  sources.flags = keys.typed();
  auto resolved = accel::config::resolve_config(sources);
  if (!resolved) return fail(resolved.message());
  accel::config::ClusterConfig cfg = resolved->config;
  accel::supervisor::EnvMap env(sources.env.begin(), sources.env.end());
  // Why at the start: the workers get this agent's environment, and a Python worker does not read
  // ACCEL_KEEP_FREED_MEMORY itself (the agent reads it for the worker's malloc).
  for (const auto& [name, value] : env) {
    if (auto problem = accel::supervisor::worker_value_problem(name, value))
      return fail("environment variable " + name + "=\"" + value + "\": " + *problem);
  }

  auto logger = spdlog::stderr_color_mt("accel-agent");
  logger->set_pattern("%^[accel-agent]%$ %v");
  logger->set_level(cfg.quiet ? spdlog::level::warn : spdlog::level::info);
  for (const auto& w : resolved->warnings) logger->warn("{}", w);

  if (serve.empty() && cfg.coordinator.empty()) {
    return fail(
        "give --coordinator HOST:PORT (join one) or --serve-coordinator PORT (host one); see "
        "--help");
  }
  if (coordinator_only && serve.empty())
    return fail("--coordinator-only needs --serve-coordinator");
  auto auth = accel::node::control_plane_auth(cfg, env);
  if (!auth) return fail(auth.message());
  accel::rpc::forget_token_in_environment();
  // Why before the groups are dropped: the unit may give the file to a group, as the token's.
  auto metrics_token = accel::node::metrics_token(cfg);
  if (!metrics_token) return fail(metrics_token.message());
  if (auto why = drop_token_access(); !why.empty()) return fail(why, 1);
  env.erase("ACCEL_TOKEN");
  accel::SystemdNotifier systemd;  // reads NOTIFY_SOCKET before the workers' environment drops it
  for (const char* var : accel::SystemdNotifier::kVariables) env.erase(var);

  accel::SystemClock clock;
  std::unique_ptr<accel::coordinator::CoordinatorServer> server;
  std::string target = cfg.coordinator;
  // Why here: a served coordinator and the workers' pipes both hold descriptors; a flood of
  // connections must meet gRPC's connection limits before EMFILE.
  auto files = accel::raise_file_limit();
  if (files.now < 4096) {
    logger->warn(
        "open-file limit is {} (hard limit); a busy coordinator or many workers may run out: "
        "raise it (LimitNOFILE= in the systemd unit, ulimit -Hn)",
        files.now);
  }
  if (!serve.empty()) {
    std::string listen = serve.find(':') == std::string::npos ? "0.0.0.0:" + serve : serve;
    auto options = accel::node::server_options(cfg, listen, *auth);
    for (const auto& w : accel::coordinator::exposure_warnings(options)) logger->warn("{}", w);
    options.on_warning = [logger](const std::string& w) { logger->warn("{}", w); };
    auto started = accel::coordinator::CoordinatorServer::start(std::move(options), clock);
    if (!started) return fail("--serve-coordinator " + serve + ": " + started.message(), 1);
    server = std::move(*started);
    logger->info("coordinator listening on {} (port {})", listen, server->port());
    if (target.empty()) {
      std::string host = listen.substr(0, listen.rfind(':'));
      if (host == "0.0.0.0" || host.empty()) host = "127.0.0.1";
      target = host + ":" + std::to_string(server->port());
    }
  }

  boost::asio::io_context io;
  std::unique_ptr<accel::node::NodeAgent> agent;
  int exit_code = 0;
  if (!coordinator_only) {
    auto client = accel::rpc::CoordinatorClient::create(target, auth->token, auth->tls);
    if (!client) return fail(client.message());
    auto opts = accel::node::make_agent_options(cfg, env, target);
    // Why per user and private: the folder holds the workers' error files and progress pages;
    // one another user made first (in /tmp, at a name anyone can predict) would let them plant
    // links there that the agent then writes through, or removes through at start-up.
    opts.state_dir = !state_dir.empty() ? state_dir
                                        : accel::temp_root() + "/accel-agent-" +
                                              std::to_string(::geteuid()) + "-" + opts.node_id;
    if (auto why = accel::make_private_dir(opts.state_dir, /*follow_link=*/!state_dir.empty());
        !why.empty()) {
      return fail((state_dir.empty() ? "the state folder " : "--state-dir ") + opts.state_dir +
                      ": " + why + (state_dir.empty() ? " (or give --state-dir)" : ""),
                  1);
    }
    accel::node::NodeAgentHooks hooks;
    hooks.on_job_end = [&](const accel::v1::JobOutcome& o) {
      logger->info("job {} ended: {} (exit code {})", o.job_id(),
                   accel::coordinator::job_state_name(o.state()), o.exit_code());
    };
    hooks.on_fatal = [&](const std::string&) {
      exit_code = 1;
      io.stop();
    };
    agent = std::make_unique<accel::node::NodeAgent>(
        io, *client, opts,
        [logger](LogLevel level, const std::string& msg) {
          if (level == LogLevel::kInfo)
            logger->info(msg);
          else if (level == LogLevel::kWarn)
            logger->warn(msg);
          else
            logger->error(msg);
        },
        hooks);
    agent->start();
  }

  accel::node::MetricsSources metrics_sources;
  metrics_sources.write = [&](accel::metrics::Exposition& out) {
    if (server) server->write_metrics(out);
    if (agent) agent->write_metrics(out);
  };
  metrics_sources.page = [&](int refresh_s) {
    return server ? server->status_page(refresh_s) : agent->status_page(refresh_s);
  };
  auto metrics_server =
      accel::node::serve_metrics(io, cfg, std::move(metrics_sources), *metrics_token);
  if (!metrics_server) return fail(metrics_server.message(), 1);
  if (*metrics_server) {
    logger->info("metrics and status page on http://{}:{}/",
                 accel::metrics::parse_listen_address(cfg.metrics_address)->host,
                 (*metrics_server)->port());
  }

  // systemd (Type=notify): READY=1 once registered (or, coordinator only, once listening),
  // STATUS= on every change, WATCHDOG=1 from this loop: a wedged loop stops the pings and
  // WatchdogSec= restarts the agent.
  boost::asio::steady_timer notify_timer(io);
  std::function<void()> notify_tick = [&] {
    std::string state = agent ? agent->state_text()
                              : "coordinator only, listening on port " +
                                    std::to_string(server ? server->port() : 0);
    if (!agent || agent->registered()) systemd.ready(state);
    systemd.status(state);
    systemd.watchdog();
    auto every = std::min<std::chrono::milliseconds>(
        systemd.watchdog_interval().value_or(std::chrono::milliseconds(1000)),
        std::chrono::milliseconds(1000));
    notify_timer.expires_after(every);
    notify_timer.async_wait([&](const boost::system::error_code& ec) {
      if (!ec) notify_tick();
    });
  };
  if (systemd.enabled()) notify_tick();

  accel::StopSignals signals(
      io, "SIGTERM stops the agent", [&](const std::string& text) { logger->warn(text); },
      [&](int sig, int nth) {
        if (nth == 1) {
          logger->info("received {}: stopping the workers and the agent",
                       accel::supervisor::signal_name(sig));
          systemd.stopping(std::string("stopping (") + accel::supervisor::signal_name(sig) + ")");
          if (agent) {
            agent->shutdown(SIGTERM, [&] { io.stop(); });
          } else {
            io.stop();
          }
        } else if (agent) {
          agent->shutdown(SIGKILL, [&] { io.stop(); });
        }
      });
  auto guard = boost::asio::make_work_guard(io);
  io.run();
  if (*metrics_server) (*metrics_server)->stop();
  agent.reset();
  if (server) server->shutdown();
  logger->info("stopped");
  // Why _Exit: the workers are gone and the server is shut down; gRPC completions may still be
  // running on its threads, and static destructors racing them abort the process.
  std::fflush(nullptr);
  std::_Exit(exit_code);
}

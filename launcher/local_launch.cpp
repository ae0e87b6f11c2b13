// Mode 1 through the in-process coordinator.
#include "launcher/local_launch.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>

#include "agent/common/clock.h"
#include "agent/common/file_limit.h"
#include "agent/common/stop_signals.h"
#include "agent/common/temp_dir.h"
#include "agent/coordinator/stragglers.h"
#include "agent/metrics/exposition.h"
#include "agent/node/local_coordinator.h"
#include "agent/node/metrics_endpoint.h"
#include "agent/node/node_agent.h"
#include "agent/rpc/job_spec_proto.h"
#include "agent/supervisor/line_sink.h"
#include "contract/worker_contract.h"

namespace accel::launcher {

namespace fs = std::filesystem;
namespace pb = ::accel::v1;
using supervisor::LogLevel;

namespace {

std::shared_ptr<spdlog::logger> logger() {
  auto l = spdlog::get("accel-launch");
  return l ? l : spdlog::default_logger();
}

void log_line(LogLevel level, const std::string& msg) {
  switch (level) {
    case LogLevel::kInfo:
      logger()->info(msg);
      break;
    case LogLevel::kWarn:
      logger()->warn(msg);
      break;
    case LogLevel::kError:
      logger()->error(msg);
      break;
  }
}

constexpr std::chrono::milliseconds kForever = std::chrono::hours(24 * 365 * 10);

// The coordinator's lines a local user needs: why the job restarts, and a rank that is slow or
// stalled. Round openings and closings of a one-node job say nothing new, and the end comes with
// the summary.
bool worth_showing(const std::string& message) {
  return message.rfind("restarting", 0) == 0 || coordinator::is_speed_report(message);
}

}  // namespace

int run_local(const LocalLaunch& launch) {
  // Why: the rendezvous store takes a descriptor per worker connection (two per rank), and the
  // workers' pipes more; the default soft limit (1024) is reached by a few hundred connections.
  raise_file_limit();
  const auto& cfg = launch.cfg;
  boost::asio::io_context io;
  SystemClock clock;
  coordinator::CoordinatorOptions co;
  co.coordinator_id = "local";
  // Why no lease and no join deadline: the only node lives in this process. It cannot be lost,
  // and it joins each round as soon as its last workers are gone, however long their grace; a
  // console that blocks the launcher for a while (a full pipe, a paused terminal) must not pass
  // for a lost node.
  co.lease = kForever;
  node::LocalCoordinator coord(io, clock, co);

  JobSpec spec = launch.spec;
  spec.join_timeout = kForever;
  pb::SubmitJobRequest submit;
  submit.set_job_id(launch.job_id);
  *submit.mutable_spec() = rpc::to_proto(spec);
  coordinator::RpcStatus submitted;
  coord.with_core([&](coordinator::CoordinatorCore& core) {
    pb::SubmitJobResponse resp;
    submitted = core.submit_job(submit, &resp);
  });
  if (!submitted.is_ok()) {
    supervisor::write_all(STDERR_FILENO, "accel-launch: error: " + submitted.message + "\n");
    return 1;
  }

  node::NodeAgentOptions opts;
  opts.hostname = node::local_hostname();
  opts.node_id = opts.hostname;
  opts.address = cfg.main_process_ip;  // MASTER_ADDR: where this node serves the store
  opts.machine_rank = 0;
  opts.only_job_id = launch.job_id;
  opts.local = true;
  opts.lease_fallback = kForever;
  opts.group.stop_timeout = cfg.stop_timeout;
  opts.base_env = launch.env;
  opts.base_env.erase(contract::kToken);
  // Error files and progress pages go beside the rank logs, else to a private temporary folder.
  bool temp_state = launch.spec.log_dir.empty();
  OwnedTempDir temp;  // removed when this returns; if we are SIGKILLed, by the next launcher
  if (temp_state) temp = OwnedTempDir("accel-" + launch.job_id + "-");
  opts.state_dir = temp_state ? temp.path() : launch.spec.log_dir;
  opts.keep_round_folders = !temp_state;
  if (opts.state_dir.empty()) {
    logger()->warn(
        "cannot create a folder for the workers' error files in {} ({}); failures will be "
        "reported without their error messages",
        temp_root(), std::strerror(errno));
  }

  int exit_code = 1;
  bool ended = false;
  int cancel_signal = 0;  // the first SIGINT/SIGTERM: the job's exit code is 128 + it
  std::unique_ptr<node::NodeAgent> agent;
  std::string last_words;  // the summary, said once every worker is gone
  auto finish = [&](int code, int stop_signal) {
    if (ended) return;
    ended = true;
    exit_code = code;
    agent->shutdown(stop_signal, [&] {
      supervisor::write_all(STDERR_FILENO, last_words);
      coord.stop();
      io.stop();
    });
  };
  node::NodeAgentHooks hooks;
  hooks.on_job_end = [&](const pb::JobOutcome& outcome) {
    if (outcome.exit_code() != 0) {
      last_words = outcome.summary();
      for (const auto& problem : agent->log_problems()) last_words += "  log: " + problem + "\n";
    } else {
      logger()->info("job {} succeeded", outcome.job_id());
      for (const auto& problem : agent->log_problems()) {
        logger()->warn("but its log is incomplete: {}", problem);
      }
    }
    // A cancelled job's workers get the user's signal first (SIGINT for Ctrl-C), as they
    // would from a shell.
    bool cancelled = outcome.state() == pb::JOB_STATE_CANCELLED && outcome.exit_code() > 128;
    finish(cancel_signal != 0 ? 128 + cancel_signal : outcome.exit_code(),
           cancelled ? outcome.exit_code() - 128 : SIGTERM);
  };
  hooks.on_fatal = [&](const std::string& why) {
    logger()->error("{}", why);
    finish(1, SIGTERM);
  };
  agent = std::make_unique<node::NodeAgent>(
      io, std::shared_ptr<rpc::CoordinatorApi>(&coord, [](rpc::CoordinatorApi*) {}), opts, log_line,
      hooks);

  // The coordinator's lines worth a local user's eye, as they happen.
  uint64_t seen = 0;
  coord.on_change([&](coordinator::CoordinatorCore& core) {
    if (core.last_event_seq(launch.job_id) == seen) return;
    pb::WatchJobRequest req;
    req.set_job_id(launch.job_id);
    req.set_after_seq(seen);
    pb::WatchJobResponse resp;
    if (!core.watch_job(req, &resp).is_ok()) return;
    for (const auto& ev : resp.events()) {
      seen = ev.seq();
      if (ev.has_message() && worth_showing(ev.message())) logger()->warn("{}", ev.message());
    }
  });

  StopSignals signals(
      io, "the job keeps running (SIGTERM or Ctrl-C stop it)",
      [](const std::string& text) { logger()->warn(text); },
      [&](int sig, int nth) {
        if (cancel_signal == 0) cancel_signal = sig;
        if (nth == 1 && !ended) {
          logger()->warn("received {}: stopping the workers (again to SIGKILL them now)",
                         supervisor::signal_name(sig));
          pb::CancelJobRequest cancel;
          cancel.set_job_id(launch.job_id);
          cancel.set_signal(sig);
          coordinator::RpcStatus st;
          coord.with_core(
              [&](coordinator::CoordinatorCore& core) { st = core.cancel_job(cancel); });
          if (st.is_ok()) return;  // the agent hears of the end and stops the workers with `sig`
        }
        // A second signal, or the job has ended already and its workers are being stopped.
        logger()->warn("stopping now: SIGKILL to every worker");
        if (ended) exit_code = 128 + cancel_signal;
        agent->shutdown(SIGKILL, nullptr);
        finish(128 + cancel_signal, SIGKILL);
      },
      /*usr1_stops=*/true);
  node::MetricsSources sources;
  sources.write = [&](metrics::Exposition& out) {
    coord.with_core([&](coordinator::CoordinatorCore& core) { core.write_metrics(out); });
    if (agent) agent->write_metrics(out);
  };
  sources.page = [&](int refresh_s) {
    std::string page;
    coord.with_core(
        [&](coordinator::CoordinatorCore& core) { page = core.status_page(refresh_s); });
    return page;
  };
  auto metrics_server = node::serve_metrics(io, cfg, std::move(sources));
  if (!metrics_server) {
    supervisor::write_all(STDERR_FILENO, "accel-launch: error: " + metrics_server.message() + "\n");
    return 1;
  }
  if (*metrics_server) {
    logger()->info("metrics and status page on http://{}:{}/",
                   metrics::parse_listen_address(cfg.metrics_address)->host,
                   (*metrics_server)->port());
  }
  logger()->info("job {}: {} x {}", launch.job_id, cfg.num_processes, launch.spec.argv.front());
  coord.start();
  agent->start();
  io.run();
  signals.cancel();
  if (*metrics_server) (*metrics_server)->stop();
  agent.reset();
  return exit_code;
}

}  // namespace accel::launcher

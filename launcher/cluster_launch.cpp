// Modes 2 and 3 of accel-launch: host or reach a coordinator, run this node's agent, watch
// the job, exit with its code.
#include "launcher/cluster_launch.h"

#include <pthread.h>
#include <pwd.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <atomic>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <thread>

#include "agent/common/clock.h"
#include "agent/common/file_limit.h"
#include "agent/common/stop_signals.h"
#include "agent/common/temp_dir.h"
#include "agent/config/cluster_config.h"
#include "agent/coordinator/coordinator_core.h"
#include "agent/coordinator/coordinator_server.h"
#include "agent/metrics/exposition.h"
#include "agent/node/control_plane_config.h"
#include "agent/node/metrics_endpoint.h"
#include "agent/rpc/job_spec_proto.h"
#include "agent/supervisor/line_sink.h"
#include "launcher/exit_codes.h"

namespace accel::launcher {

namespace fs = std::filesystem;
namespace pb = ::accel::v1;
using namespace std::chrono_literals;
using node::connect;
using node::control_plane_auth;
using node::make_agent_options;
using node::server_options;
using supervisor::LogLevel;

namespace {

constexpr std::chrono::milliseconds kSubmitPatience{15'000};  // submit retries while UNAVAILABLE

std::shared_ptr<spdlog::logger> logger() {
  auto l = spdlog::get("accel-launch");
  return l ? l : spdlog::default_logger();
}

supervisor::JobLogger job_logger(const std::string& who) {
  return [who](LogLevel level, const std::string& msg) {
    auto l = logger();
    switch (level) {
      case LogLevel::kInfo:
        l->info("{}{}", who, msg);
        break;
      case LogLevel::kWarn:
        l->warn("{}{}", who, msg);
        break;
      case LogLevel::kError:
        l->error("{}{}", who, msg);
        break;
    }
  };
}

// "1.5 s", "30 s", "2 min".
std::string seconds(std::chrono::milliseconds d) {
  if (d >= 120s) return std::to_string(d.count() / 60000) + " min";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g s", static_cast<double>(d.count()) / 1000.0);
  return buf;
}

int fail(const std::string& message, int code = kExitStartFailed) {
  supervisor::write_all(STDERR_FILENO, "accel-launch: error: " + message + "\n");
  return code;
}

// Follows a job's events until it ends. Prints coordinator messages and failures (and worker
// output when the job forwards it). Rides out a coordinator restart. Returns the job's exit
// code, or 1 when the job cannot be followed.
class JobWatcher {
 public:
  JobWatcher(std::shared_ptr<rpc::CoordinatorClient> client, std::string job_id,
             std::chrono::milliseconds patience)
      : client_(std::move(client)), job_id_(std::move(job_id)), patience_(patience) {}

  int run() {
    uint64_t after = 0;
    std::string coordinator;
    bool in_trouble = false;
    std::chrono::steady_clock::time_point trouble_since{};
    std::chrono::steady_clock::time_point last_said{};
    std::string last_error;
    while (!stop_) {
      pb::WatchJobRequest req;
      req.set_job_id(job_id_);
      req.set_after_seq(after);
      req.set_wait_ms(1000);
      pb::WatchJobResponse resp;
      grpc::Status st = client_->watch_job(req, &resp, 6s);
      if (!st.ok()) {
        if (st.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
          return fail("coordinator at " + client_->target() + " refused us: " + rpc::describe(st),
                      kExitControlPlane);
        }
        auto now = std::chrono::steady_clock::now();
        if (!in_trouble) {
          in_trouble = true;
          trouble_since = now;
          last_said = now;
          logger()->warn(
              "lost the coordinator at {} ({}); {}", client_->target(), rpc::describe(st),
              follow_mode_ ? "job " + job_id_ +
                                 " keeps running on its nodes meanwhile; following it "
                                 "again when the coordinator answers" +
                                 (patience_.count() > 0 ? " (for up to " + seconds(patience_) + ")"
                                                        : std::string())
                           : "waiting up to " + seconds(patience_) + " for it");
        } else if (follow_mode_ && now - last_said >= 30s) {
          // Why every 30 s: a user watching a silent terminal must know the job is not lost.
          last_said = now;
          logger()->warn(
              "still no answer from the coordinator at {} after {} ({}); job {} may "
              "still be running",
              client_->target(),
              seconds(std::chrono::duration_cast<std::chrono::milliseconds>(now - trouble_since)),
              rpc::describe(st), job_id_);
        }
        if (st.error_code() == grpc::StatusCode::NOT_FOUND && resubmit_ &&
            now - trouble_since > resubmit_after_) {
          auto again = std::move(resubmit_);
          resubmit_ = nullptr;
          logger()->warn("the coordinator does not know job {} any more ({}); submitting it again",
                         job_id_, st.error_message());
          if (again()) {
            in_trouble = false;
            after = 0;
            continue;
          }
        }
        if (follow_mode_ && patience_.count() > 0 && now - trouble_since > patience_) {
          return fail("stopped following job " + job_id_ + ": no answer from the coordinator at " +
                          client_->target() + " for " + seconds(patience_) +
                          " (follow_timeout; last: " + rpc::describe(st) +
                          "). The job may still be running: `accel logs " + job_id_ +
                          " --follow --coordinator " + client_->target() +
                          "` prints its output and waits for its end, `accel status "
                          "--coordinator " +
                          client_->target() + "` shows it",
                      kExitStillRunning);
        }
        if (!follow_mode_ && now - trouble_since > patience_) {
          return fail("gave up following job " + job_id_ + ": the coordinator at " +
                          client_->target() + " says " + rpc::describe(st),
                      kExitControlPlane);
        }
        std::this_thread::sleep_for(200ms);
        continue;
      }
      if (in_trouble) logger()->info("coordinator at {} is back", client_->target());
      in_trouble = false;
      if (!coordinator.empty() && resp.coordinator_id() != coordinator) {
        logger()->warn("the coordinator restarted (now {}); following job {} there",
                       resp.coordinator_id(), job_id_);
        coordinator = resp.coordinator_id();
        after = 0;
        continue;
      }
      coordinator = resp.coordinator_id();
      if (resp.dropped() > 0) {
        logger()->warn("{} events of job {} were dropped (this launcher fell behind)",
                       resp.dropped(), job_id_);
      }
      for (const auto& ev : resp.events()) {
        print(ev);
        after = ev.seq();
      }
      if (resp.done()) {
        outcome_ = resp.outcome();
        return outcome_.exit_code();
      }
    }
    return 1;
  }

  void stop() { stop_ = true; }
  // A job this launcher submitted (mode 3): follow it for `timeout` without an answer (0:
  // forever), saying so every 30 s; then exit kExitStillRunning, saying how to follow it again.
  void follow_for(std::chrono::milliseconds timeout) {
    follow_mode_ = true;
    patience_ = timeout;
  }
  // Called once when the job stays unknown for `after` (a restarted coordinator that no agent
  // could tell about it: it was still waiting for nodes); returns whether it was submitted again.
  void on_lost_job(std::chrono::milliseconds after, std::function<bool()> resubmit) {
    resubmit_after_ = after;
    resubmit_ = std::move(resubmit);
  }
  [[nodiscard]] const pb::JobOutcome& outcome() const { return outcome_; }

 private:
  static void print(const pb::JobEvent& ev) {
    switch (ev.what_case()) {
      case pb::JobEvent::kMessage:
        logger()->info("{}", ev.message());
        break;
      case pb::JobEvent::kFailure:
        logger()->error("{}", coordinator::describe_failure(ev.failure()));
        if (!ev.failure().report().empty())
          supervisor::write_all(STDERR_FILENO, ev.failure().report());
        break;
      case pb::JobEvent::kLog: {
        const auto& l = ev.log();
        supervisor::write_all(
            l.stderr() ? STDERR_FILENO : STDOUT_FILENO,
            "[" + l.hostname() + ":" + std::to_string(l.rank()) + "] " + l.text() + "\n");
        break;
      }
      default:
        break;
    }
  }

  std::shared_ptr<rpc::CoordinatorClient> client_;
  std::string job_id_;
  std::chrono::milliseconds patience_;
  bool follow_mode_ = false;
  std::atomic<bool> stop_{false};
  pb::JobOutcome outcome_;
  std::chrono::milliseconds resubmit_after_{0};
  std::function<bool()> resubmit_;
};

}  // namespace

pb::JobSpec job_spec_proto(const ClusterLaunch& launch, bool forward_logs) {
  JobSpec spec = launch.spec;
  spec.forward_logs = forward_logs;
  return rpc::to_proto(spec);
}

// --------------------------------------------------------------------------------- mode 3

namespace {
sigset_t submit_signals() {
  sigset_t set;
  sigemptyset(&set);
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2}) sigaddset(&set, s);  // SIGUSR2: ours
  return set;
}
}  // namespace

void block_submit_signals() {
  sigset_t set = submit_signals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int run_submit(const ClusterLaunch& launch) {
  block_submit_signals();
  const sigset_t set = submit_signals();

  auto client = connect(launch.cfg, launch.env, launch.cfg.coordinator);
  if (!client) return fail(client.message(), kExitUsage);
  pb::SubmitJobRequest req;
  req.set_job_id(launch.job_id);
  *req.mutable_spec() = job_spec_proto(launch, /*forward_logs=*/true);
  pb::SubmitJobResponse resp;
  // Why retry: agents and coordinator are often started moments before the first submit.
  grpc::Status st;
  auto give_up = std::chrono::steady_clock::now() + kSubmitPatience;
  for (bool told = false;; told = true) {
    st = (*client)->submit_job(req, &resp, 10s);
    if (st.error_code() != grpc::StatusCode::UNAVAILABLE ||
        std::chrono::steady_clock::now() > give_up)
      break;
    if (!told) {
      logger()->warn("coordinator at {} not reachable yet ({}); retrying for {} s",
                     launch.cfg.coordinator, rpc::describe(st), kSubmitPatience.count() / 1000);
    }
    std::this_thread::sleep_for(200ms);
  }
  if (!st.ok()) {
    return fail("cannot submit the job to the coordinator at " + launch.cfg.coordinator + ": " +
                    rpc::describe(st),
                kExitControlPlane);
  }
  const std::string job_id = resp.job_id();
  logger()->info(
      "job {} submitted to coordinator {}: {} x {} per node on {} node(s)", job_id,
      launch.cfg.coordinator, launch.cfg.num_processes, launch.spec.argv.front(),
      launch.cfg.nodes.min == launch.cfg.nodes.max
          ? std::to_string(launch.cfg.nodes.min)
          : std::to_string(launch.cfg.nodes.min) + "-" + std::to_string(launch.cfg.nodes.max));

  JobWatcher watcher(*client, job_id, launch.cfg.follow_timeout);
  watcher.follow_for(launch.cfg.follow_timeout);
  req.set_job_id(job_id);
  watcher.on_lost_job(2 * launch.cfg.lease_timeout, [&, c = *client] {
    pb::SubmitJobResponse again;
    grpc::Status rs = c->submit_job(req, &again, 10s);
    if (rs.error_code() == grpc::StatusCode::ALREADY_EXISTS)
      return true;  // an agent brought it back meanwhile
    if (!rs.ok()) logger()->error("submitting job {} again failed: {}", job_id, rpc::describe(rs));
    return rs.ok();
  });
  std::thread signals([&, c = *client] {
    int cancels = 0;
    for (;;) {
      int sig = 0;
      if (sigwait(&set, &sig) != 0) continue;
      if (sig == SIGUSR2) return;
      if (sig == SIGHUP) {
        logger()->warn(
            "received SIGHUP: ignored, the job keeps running (SIGTERM or Ctrl-C cancel it)");
        continue;
      }
      pb::CancelJobRequest cancel;
      cancel.set_job_id(job_id);
      cancel.set_signal(++cancels == 1 ? sig : SIGKILL);
      logger()->warn("received {}: cancelling job {}{}", supervisor::signal_name(sig), job_id,
                     cancels == 1 ? " (again to exit at once)" : "");
      if (cancels > 1) _exit(128 + sig);
      grpc::Status cs = c->cancel_job(cancel, 5s);
      // Why say what follows: the coordinator did not take the cancel (unreachable, say), so
      // the job runs on, and this launcher keeps following it until the user leaves.
      if (!cs.ok()) {
        logger()->error(
            "could not cancel job {}: {}; it may still be running, and this launcher keeps "
            "following it ({} again leaves at once)",
            job_id, rpc::describe(cs), supervisor::signal_name(sig));
      }
    }
  });
  int code = watcher.run();
  if (code != 0 && !watcher.outcome().summary().empty()) {
    supervisor::write_all(STDERR_FILENO, watcher.outcome().summary());
  } else if (code == 0) {
    logger()->info("job {} succeeded", job_id);
  }
  pthread_kill(signals.native_handle(), SIGUSR2);
  signals.join();
  return code;
}

// --------------------------------------------------------------------------------- mode 2

int run_multi_node(const ClusterLaunch& launch) {
  const auto& cfg = launch.cfg;
  const std::string target = cfg.main_process_ip + ":" + std::to_string(cfg.coordinator_port);
  // Why at once: a name that resolves to loopback left the other nodes retrying "connection
  // refused" for the whole join_timeout, with no word about loopback.
  if (cfg.nodes.max > 1) {
    for (const auto& [key, value] :
         {std::pair<std::string, std::string>{"main_process_ip", cfg.main_process_ip},
          {"node_address", cfg.node_address}}) {
      std::string problem = node::loopback_name_problem(value, key);
      if (problem.empty()) continue;
      const auto& where = cfg.origin(key).where;
      return fail(where.empty() ? problem : where + ": " + problem, kExitUsage);
    }
  }
  auto auth = control_plane_auth(cfg, launch.env);
  if (!auth) return fail(auth.message(), kExitUsage);
  rpc::forget_token_in_environment();
  SystemClock clock;
  std::unique_ptr<coordinator::CoordinatorServer> server;
  if (cfg.machine_rank == 0) {
    raise_file_limit();  // Why: a flood of connections must meet gRPC's limits before EMFILE
    auto options = server_options(cfg, target, *auth);
    for (const auto& w : coordinator::exposure_warnings(options)) logger()->warn("{}", w);
    options.on_warning = [](const std::string& w) { logger()->warn("{}", w); };
    auto started = coordinator::CoordinatorServer::start(std::move(options), clock);
    if (!started) {
      return fail(cfg.origin("coordinator_port").where.empty()
                      ? "machine rank 0 cannot serve the coordinator: " + started.message()
                      : cfg.origin("coordinator_port").where + ": " + started.message());
    }
    server = std::move(*started);
    logger()->info("coordinator listening on {}", target);
  }
  auto client = rpc::CoordinatorClient::create(target, auth->token, auth->tls);
  if (!client) return fail(client.message(), kExitUsage);

  std::string job_id = launch.job_id;
  if (server) {
    pb::SubmitJobRequest req;
    req.set_job_id(job_id);
    *req.mutable_spec() = job_spec_proto(launch, /*forward_logs=*/false);
    pb::SubmitJobResponse resp;
    grpc::Status st = (*client)->submit_job(req, &resp, 10s);
    if (!st.ok()) {
      return fail("cannot submit the job to our own coordinator: " + rpc::describe(st),
                  kExitControlPlane);
    }
    job_id = resp.job_id();
  }

  boost::asio::io_context io;
  auto opts = make_agent_options(cfg, launch.env, target);
  opts.machine_rank = cfg.machine_rank;
  opts.give_up_after = cfg.join_timeout;
  // Removed when this returns; if we are SIGKILLed, by the next launcher.
  OwnedTempDir temp("accel-node-");
  opts.state_dir = temp.path();  // empty: failures go without error files
  if (server) opts.address = cfg.node_address.empty() ? cfg.main_process_ip : cfg.node_address;

  int exit_code = 1;
  bool ended = false;
  std::string current_job = job_id;
  std::unique_ptr<node::NodeAgent> agent;
  // Why the stop signal matters: a job cancelled with SIGUSR1 (Slurm before a time limit) must
  // reach its workers as SIGUSR1, so libaccel saves a checkpoint; SIGTERM would lose the save.
  auto finish = [&](int code, int stop_signal = SIGTERM) {
    if (ended) return;
    ended = true;
    exit_code = code;
    agent->shutdown(stop_signal, [&] { io.stop(); });
  };
  node::NodeAgentHooks hooks;
  hooks.on_job_end = [&](const pb::JobOutcome& outcome) {
    if (outcome.exit_code() != 0 && !outcome.summary().empty()) {
      supervisor::write_all(STDERR_FILENO, outcome.summary());
    } else if (outcome.exit_code() == 0) {
      logger()->info("job {} succeeded", outcome.job_id());
    }
    bool cancelled = outcome.state() == pb::JOB_STATE_CANCELLED && outcome.exit_code() > 128;
    finish(outcome.exit_code(), cancelled ? outcome.exit_code() - 128 : SIGTERM);
  };
  hooks.on_fatal = [&](const std::string&) {  // the agent has logged why
    finish(kExitControlPlane);
  };
  agent = std::make_unique<node::NodeAgent>(io, *client, opts, job_logger(""), hooks);

  node::MetricsSources sources;
  sources.write = [&](metrics::Exposition& out) {
    if (server) server->write_metrics(out);
    agent->write_metrics(out);
  };
  sources.page = [&](int refresh_s) {
    return server ? server->status_page(refresh_s) : agent->status_page(refresh_s);
  };
  auto metrics_server = node::serve_metrics(io, cfg, std::move(sources));
  if (!metrics_server) return fail(metrics_server.message(), kExitUsage);
  if (*metrics_server) {
    logger()->info("metrics and status page on http://{}:{}/",
                   metrics::parse_listen_address(cfg.metrics_address)->host,
                   (*metrics_server)->port());
  }

  std::unique_ptr<JobWatcher> watcher;
  std::thread watch_thread;
  if (server) {
    watcher = std::make_unique<JobWatcher>(*client, job_id, 10s);
    // Why finish from here too: this node may have left the job's last round (elastic), and
    // then its agent never hears of the end; the watcher does.
    watch_thread = std::thread([&, w = watcher.get()] {
      int code = w->run();
      bool cancelled = w->outcome().state() == pb::JOB_STATE_CANCELLED && code > 128;
      boost::asio::post(io, [&, code, cancelled, summary = w->outcome().summary()] {
        if (ended) return;
        if (code != 0 && !summary.empty()) supervisor::write_all(STDERR_FILENO, summary);
        finish(code, cancelled ? code - 128 : SIGTERM);
      });
    });
  }

  StopSignals signals(
      io, "the job keeps running (SIGTERM or Ctrl-C stop it)",
      [](const std::string& text) { logger()->warn(text); },
      [&](int sig, int nth) {
        if (nth == 1) {
          logger()->warn("received {}: cancelling the job on every node (again to stop at once)",
                         supervisor::signal_name(sig));
          pb::CancelJobRequest cancel;
          // Why the agent's: without --job-id every node names the job differently; the one the
          // coordinator (machine rank 0) gave is the one this node's agent runs.
          std::string running = agent->current_job_id();
          cancel.set_job_id(running.empty() ? job_id : running);
          cancel.set_signal(sig);
          // Why a thread: the call blocks up to 2 s and the io thread runs the workers.
          std::thread([c = *client, cancel] { c->cancel_job(cancel, 2s); }).detach();
          // Not cancelled at the coordinator (unreachable, or job id unknown here): stop anyway.
          auto timer = std::make_shared<boost::asio::steady_timer>(io, 3s);
          timer->async_wait([&, timer, sig](const boost::system::error_code& e2) {
            if (!e2) finish(128 + sig, sig);
          });
        } else {
          finish(128 + sig);
          agent->shutdown(SIGKILL, nullptr);
        }
      },
      /*usr1_stops=*/true);
  logger()->info("machine rank {} of {} nodes: {} x {} (coordinator {})", cfg.machine_rank,
                 cfg.nodes.max, cfg.num_processes, launch.spec.argv.front(), target);
  agent->start();
  io.run();
  if (*metrics_server) (*metrics_server)->stop();

  if (server) {
    // Why linger: the other nodes learn the job's end from this coordinator; give their long
    // polls a moment to return it before it goes away.
    auto deadline = std::chrono::steady_clock::now() + 3s;
    bool told = false;
    while (!told && std::chrono::steady_clock::now() < deadline) {
      server->with_core(
          [&](coordinator::CoordinatorCore& core) { told = core.everyone_told(job_id); });
      if (!told) std::this_thread::sleep_for(20ms);
    }
    std::this_thread::sleep_for(100ms);  // the answers are in flight
    watcher->stop();
    if (watch_thread.joinable()) watch_thread.join();
    server->shutdown();
  }
  agent.reset();
  return exit_code;
}

}  // namespace accel::launcher

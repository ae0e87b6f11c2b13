// The node agent's loop: register, sync, reconcile local workers with the instruction, report.
#include "agent/node/node_agent.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/asio/post.hpp>
#include <csignal>
#include <filesystem>
#include <random>
#include <thread>

#include "agent/common/clock.h"
#include "agent/coordinator/request_limits.h"
#include "agent/node/node_agent_active.h"
#include "agent/node/round_folders.h"
#include "agent/node/snapshot_folder.h"
#include "agent/rpc/job_spec_proto.h"
#include "agent/supervisor/hang_monitor.h"
#include "contract/duration.h"
#include "contract/worker_contract.h"

namespace accel::node {

namespace asio = boost::asio;
namespace fs = std::filesystem;
using supervisor::LogLevel;
using namespace std::chrono_literals;

std::string default_node_id(const std::string& hostname) {
  std::random_device rd;
  char suffix[8];
  std::snprintf(suffix, sizeof suffix, "%04x", rd() & 0xffffu);
  return hostname + "-" + std::to_string(::getpid()) + "-" + suffix;
}

namespace {

int64_t now_unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

NodeAgent::NodeAgent(asio::io_context& io, std::shared_ptr<rpc::CoordinatorApi> client,
                     NodeAgentOptions options, supervisor::JobLogger log, NodeAgentHooks hooks)
    : io_(io),
      client_(std::move(client)),
      options_(std::move(options)),
      log_(std::move(log)),
      hooks_(std::move(hooks)),
      alive_(std::make_shared<Gate>()),
      lease_(options_.lease_fallback),
      log_timer_(io) {}

NodeAgent::~NodeAgent() {
  std::lock_guard lock(alive_->mu);
  alive_->open = false;
}

// Why a gate: gRPC completions run on gRPC's threads and may arrive after this agent is gone;
// they post onto `io` (which outlives the agent) only while the gate is open.
void NodeAgent::post_completion(const std::shared_ptr<Gate>& gate, asio::io_context* io,
                                std::function<void()> f) {
  std::lock_guard lock(gate->mu);
  if (!gate->open) return;
  asio::post(*io, [gate, f = std::move(f)] {
    if (gate->open) f();
  });
}

void NodeAgent::start() {
  remove_leftover_rounds();
  if (!options_.local) {
    std::string why;
    probe_listener_ = ProbeListener::open(io_, options_.address, why);
    if (!probe_listener_) {
      log(LogLevel::kWarn, why + "; the other nodes cannot check that they reach this one");
    }
  }
  do_register();
}

// Why: an agent killed with SIGKILL (or a crashed one) cannot remove its round folders; its
// workers died with it (PR_SET_PDEATHSIG), so what an earlier agent left in the state folder is
// garbage. Only folders shaped like ours go, <job>/attempt_<n>/, and only those no running agent
// holds (create_and_lock_job_folder).
void NodeAgent::remove_leftover_rounds() {
  // The snapshot folders of agents and launchers that are gone (each holds a lock on its own).
  if (int removed = SnapshotFolder::remove_unheld(); removed > 0) {
    log(LogLevel::kInfo, "removed " + std::to_string(removed) +
                             " in-memory snapshot folder(s) that agents now gone left in /dev/shm");
  }
  if (options_.state_dir.empty() || options_.keep_round_folders) return;
  const int removed = remove_unused_job_folders(options_.state_dir);
  if (removed > 0) {
    log(LogLevel::kInfo, "removed " + std::to_string(removed) +
                             " job folder(s) an earlier agent left in " + options_.state_dir);
  }
}

std::string NodeAgent::current_job_id() const {
  if (active_) return active_->job_id;
  return desired_.job_id();
}

std::string NodeAgent::state_text() const {
  if (shutting_down_) return "stopping";
  if (!registered_) return "registering with the coordinator at " + client_->target();
  if (active_ && active_->running()) {
    const auto& a = active_->assignment;
    int first = a.rank_offset();
    int last = first + active_->spec.processes_per_node() - 1;
    return "running job " + active_->job_id + " round " + std::to_string(active_->round) +
           " (node rank " + std::to_string(a.node_rank()) + ", ranks " + std::to_string(first) +
           "-" + std::to_string(last) + " of " + std::to_string(a.world_size()) + ")";
  }
  if (!desired_.job_id().empty()) return "joining job " + desired_.job_id();
  return "idle, registered with the coordinator at " + client_->target();
}

std::vector<pid_t> NodeAgent::worker_pids() const {
  if (!active_ || !active_->attempt) return {};
  return active_->attempt->pids();
}

void NodeAgent::retry_later(std::chrono::milliseconds delay, std::function<void()> f) {
  auto timer = std::make_shared<asio::steady_timer>(io_, delay);
  timer->async_wait([timer, f = std::move(f), alive = alive_](const boost::system::error_code& ec) {
    if (!ec && alive->open) f();
  });
}

namespace {

// A random duration from 0 to `most`: the jitter that keeps thousands of agents, answered or
// failed together, from coming back together.
std::chrono::milliseconds up_to(std::chrono::milliseconds most) {
  static thread_local std::mt19937 rng{std::random_device{}()};
  return std::chrono::milliseconds(rng() %
                                   (static_cast<uint64_t>(std::max<int64_t>(most.count(), 0)) + 1));
}

}  // namespace

std::chrono::milliseconds NodeAgent::backoff() {
  // 100 ms, 200 ms, ... capped at 2 s, with jitter so restarted coordinators are not stampeded.
  int n = std::min(failures_in_a_row_, 5);
  auto base = 100ms * (1 << n);
  if (base > 2000ms) base = 2000ms;
  return base / 2 + up_to(base / 2);
}

void NodeAgent::fatal(const std::string& why) {
  log(LogLevel::kError, why);
  shutting_down_ = true;
  auto after = [this, why] {
    if (hooks_.on_fatal) hooks_.on_fatal(why);
  };
  if (active_ && active_->running()) {
    stopped_waiters_.push_back(after);
    stop_active(SIGTERM);
  } else {
    asio::post(io_, after);
  }
}

// ------------------------------------------------------------------------- registration

void NodeAgent::do_register() {
  if (shutting_down_) return;
  pb::RegisterNodeRequest req;
  req.set_node_id(options_.node_id);
  req.set_hostname(options_.hostname);
  req.set_address(options_.address);
  req.set_machine_rank(options_.machine_rank);
  req.set_only_job_id(options_.only_job_id);
  if (probe_listener_) req.set_probe_port(probe_listener_->port());
  req.set_store_port(offer_store_port());
  if (active_) {
    auto* cur = req.mutable_current();
    cur->set_job_id(active_->job_id);
    cur->set_round(active_->round);
    *cur->mutable_spec() = active_->spec;
    *cur->mutable_assignment() = active_->assignment;
    cur->set_group_succeeded(active_->all_succeeded);
  }
  client_->register_node(
      req, options_.rpc_timeout,
      [this, gate = alive_, io = &io_](const rpc::CallStatus& st, pb::RegisterNodeResponse& resp) {
        post_completion(gate, io, [this, st, resp] {
          if (shutting_down_) return;
          if (!st.ok()) {
            if (st.code == rpc::CallCode::kUnauthenticated ||
                st.code == rpc::CallCode::kInvalidArgument ||
                st.code == rpc::CallCode::kAlreadyExists) {
              fatal("the coordinator at " + client_->target() +
                    " refused this node: " + rpc::describe(st));
              return;
            }
            coordinator_unreachable(st);
            retry_later(backoff(), [this] { do_register(); });
            return;
          }
          bool restarted = !coordinator_id_.empty() && coordinator_id_ != resp.coordinator_id();
          coordinator_id_ = resp.coordinator_id();
          lease_ = std::chrono::milliseconds(resp.lease_ms());
          sync_wait_ = std::chrono::milliseconds(resp.sync_wait_ms());
          idle_wait_ = std::chrono::milliseconds(resp.idle_wait_ms());
          progress_wait_ = sync_wait_;
          registered_ = true;
          joined_job_.clear();  // Why: a new registration has joined nothing yet
          joined_round_ = -1;
          failures_in_a_row_ = 0;
          unreachable_since_.reset();
          known_version_ = 0;
          if (!options_.local) {
            log(LogLevel::kInfo,
                std::string(restarted ? "registered again with restarted coordinator "
                                      : "registered with coordinator ") +
                    coordinator_id_ + " at " + client_->target() + " as node " + options_.node_id +
                    " (" + options_.address + ")");
          }
          do_sync();
        });
      });
}

void NodeAgent::coordinator_unreachable(const rpc::CallStatus& status) {
  ++failures_in_a_row_;
  auto now = std::chrono::steady_clock::now();
  if (!unreachable_since_) unreachable_since_ = now;
  bool running = active_ && active_->running();
  if (now - last_unreachable_log_ > 10s) {
    last_unreachable_log_ = now;
    // Why say how long: a node waiting for its coordinator looks hung unless it says until when.
    std::string until = !running && options_.give_up_after.count() > 0
                            ? "; retrying for up to " +
                                  contract::format_duration(options_.give_up_after) +
                                  " (join_timeout), then giving up"
                            : "; retrying";
    log(LogLevel::kWarn, "coordinator at " + client_->target() + " unreachable (" +
                             rpc::describe(status) + ")" + until);
  }
  if (!running && options_.give_up_after.count() > 0 &&
      now - *unreachable_since_ > options_.give_up_after) {
    fatal("cannot reach the coordinator at " + client_->target() + " for " +
          contract::format_duration(options_.give_up_after) + " (join_timeout; " +
          rpc::describe(status) + ")");
    return;
  }
  if (running && !stopping_ && now - *unreachable_since_ > lease_) {
    ++coordinator_lost_;
    log(LogLevel::kError, "no contact with the coordinator for longer than the lease (" +
                              std::to_string(lease_.count()) +
                              " ms): stopping the workers, peers may be gone");
    pb::Failure f;
    f.set_kind(pb::Failure::KIND_NODE_LOST);
    f.set_rank(-1);
    f.set_local_rank(-1);
    f.set_message("node " + options_.node_id +
                  " lost the coordinator for longer than the lease and stopped its workers");
    fail_round(std::move(f));
  }
}

// ------------------------------------------------------------------------------ syncing

void NodeAgent::do_sync() {
  if (shutting_down_ || !registered_) return;
  pb::SyncRequest req;
  req.set_node_id(options_.node_id);
  req.set_known_version(known_version_);
  req.set_omit_unchanged(have_desired_);
  req.set_store_port(offer_store_port());
  fill_progress(req);
  // Why two waits: while workers run, their progress must reach the coordinator every
  // progress wait; without workers there is nothing to report, and the parked call itself keeps
  // this node alive (the coordinator's keepalive pings watch its connection).
  const bool idle = !active_ && idle_wait_.count() > 0;
  auto wait = idle ? idle_wait_ : progress_wait_;
  if (idle_wait_.count() > 0) {
    // Why jitter: nodes answered together (a round's RUN, a restarted coordinator) would
    // otherwise come back together every wait, all of them in one tick. Only against a
    // coordinator that offers the idle wait (its parked polls keep nodes alive).
    wait -= up_to(wait / 4);
  }
  req.set_wait_ms(wait.count());
  client_->sync(
      req, wait + options_.rpc_timeout,
      [this, gate = alive_, io = &io_](const rpc::CallStatus& st, pb::SyncResponse& resp) {
        post_completion(gate, io, [this, st, resp] { on_sync(st, resp); });
      });
}

void NodeAgent::on_sync(const rpc::CallStatus& status, const pb::SyncResponse& resp) {
  if (shutting_down_) return;
  if (!status.ok()) {
    if (status.code == rpc::CallCode::kNotFound) {
      log(LogLevel::kWarn,
          "coordinator does not know this node (" + status.message + "); registering again");
      registered_ = false;
      do_register();
      return;
    }
    if (status.code == rpc::CallCode::kUnauthenticated) {
      fatal("the coordinator at " + client_->target() +
            " refused this node: " + rpc::describe(status));
      return;
    }
    coordinator_unreachable(status);
    retry_later(backoff(), [this] { do_sync(); });
    return;
  }
  failures_in_a_row_ = 0;
  unreachable_since_.reset();
  if (resp.progress_wait_ms() > 0)
    progress_wait_ = std::chrono::milliseconds(resp.progress_wait_ms());
  if (resp.unchanged()) {
    if (have_desired_ && resp.version() == known_version_) {
      reconcile();  // what this node holds is still current
      do_sync();
      return;
    }
    // Left out although this node holds another version: ask for the whole instruction.
    log(LogLevel::kWarn, "the coordinator at " + client_->target() +
                             " left out instruction version " + std::to_string(resp.version()) +
                             ", which node " + options_.node_id + " does not hold (it holds " +
                             std::to_string(known_version_) +
                             "); asking for the whole instruction");
    known_version_ = 0;
    have_desired_ = false;
    retry_later(backoff(), [this] { do_sync(); });
    return;
  }
  known_version_ = resp.version();
  desired_ = resp.instruction();
  have_desired_ = true;
  const auto& outcome = desired_.last_job();
  if (!outcome.job_id().empty() && outcome.job_id() != reported_outcome_) {
    reported_outcome_ = outcome.job_id();
    if (outcome.state() == pb::JOB_STATE_CANCELLED && active_ &&
        active_->job_id == outcome.job_id() && outcome.exit_code() > 128) {
      stop_signal_ = outcome.exit_code() - 128;  // the launcher's signal goes to the workers first
    }
    if (hooks_.on_job_end) hooks_.on_job_end(outcome);
  }
  reconcile();
  if (resp.next_sync_within_ms() > 0) {
    // Why later: in a large round every node was told RUN at once; their next polls coming
    // back together would slow the answers still going out. The lease runs meanwhile.
    const auto within = std::min<int64_t>(resp.next_sync_within_ms(), 5'000);
    retry_later(up_to(std::chrono::milliseconds(within)), [this] { do_sync(); });
    return;
  }
  do_sync();
}

// ---------------------------------------------------------------------------- reconcile

void NodeAgent::reconcile() {
  if (!have_desired_ || shutting_down_ || stopping_) return;
  const pb::Instruction& ins = desired_;
  if (job_store_ && ins.job_id() != job_store_job_) job_store_.reset();  // that job is over here
  if (snapshots_ && ins.job_id() != snapshots_->job_id()) snapshots_.reset();  // its memory too
  if (ins.job_id() != snapshots_job_) {
    snapshots_job_ = ins.job_id();
    snapshots_refused_ = false;
  }
  bool run = ins.action() == pb::Instruction::ACTION_RUN;
  bool same = active_ && run && active_->job_id == ins.job_id() && active_->round == ins.round();
  if (same) return;
  if (active_) {
    if (active_->running()) {
      log(LogLevel::kInfo, "stopping the workers of job " + active_->job_id + " round " +
                               std::to_string(active_->round));
      int sig = stop_signal_;
      stop_signal_ = SIGTERM;
      stop_active(sig);
      return;
    }
    if (active_->store) {  // kept for the job's next round (see join)
      job_store_ = std::move(active_->store);
      job_store_job_ = active_->job_id;
    }
    // Why not at once: removing the round's folder is file-system work between a failure and
    // the replacement's start; it waits until the next round runs, or the node is idle.
    retired_ = std::move(active_);
  }
  switch (ins.action()) {
    case pb::Instruction::ACTION_RUN:
      start_group(ins);
      retired_.reset();
      break;
    case pb::Instruction::ACTION_JOIN:
      join(ins);
      break;
    default:
      retired_.reset();
      break;
  }
}

void NodeAgent::stop_active(int signal) {
  if (!active_ || !active_->attempt) return;
  if (stopping_) {
    if (signal == SIGKILL) active_->attempt->stop(SIGKILL);
    return;
  }
  stopping_ = true;
  active_->attempt->stop(signal);
}

void NodeAgent::on_stopped(uint64_t generation, const supervisor::StopReport& report) {
  if (!report.unkillable.empty()) {
    log(LogLevel::kWarn, std::to_string(report.unkillable.size()) +
                             " worker(s) survived SIGKILL (D state?); not waiting for them");
  }
  stopping_ = false;
  if (active_ && active_->generation == generation) active_->attempt.reset();
  auto waiters = std::move(stopped_waiters_);
  stopped_waiters_.clear();
  for (auto& w : waiters) w();
  reconcile();
}

void NodeAgent::join(const pb::Instruction& ins) {
  if (join_in_flight_ || (joined_job_ == ins.job_id() && joined_round_ == ins.round())) return;
  pb::JoinRoundRequest req;
  req.set_node_id(options_.node_id);
  req.set_job_id(ins.job_id());
  req.set_round(ins.round());
  if (ins.spec().master_port() == 0) {
    // Why every node binds one: any node may become node rank 0, whose agent then serves the
    // round's rendezvous store on it. Bound now and held, so nothing can take the port before
    // the workers connect.
    // The store of this job's last round, when this node served it: the job keeps its
    // MASTER_PORT across restarts whenever this node stays node rank 0 (as under torchrun).
    if (job_store_ && job_store_job_ == ins.job_id()) {
      reserved_store_ = std::move(job_store_);
    } else {
      job_store_.reset();
      std::string why;
      if (!reserved_store_) reserved_store_ = open_store(0, why);  // the one held while idle
      if (!reserved_store_) log(LogLevel::kWarn, why);
    }
    if (reserved_store_) {
      req.set_master_port(reserved_store_->port());
    }
  }
  join_in_flight_ = true;
  client_->join_round(
      req, options_.rpc_timeout,
      [this, req, gate = alive_, io = &io_](const rpc::CallStatus& st, pb::JoinRoundResponse&) {
        post_completion(gate, io, [this, req, st] {
          join_in_flight_ = false;
          if (st.ok()) {
            joined_job_ = req.job_id();
            joined_round_ = req.round();
            if (!options_.local) {
              log(LogLevel::kInfo,
                  "joined job " + req.job_id() + " round " + std::to_string(req.round()));
            }
          } else if (st.code == rpc::CallCode::kUnavailable ||
                     st.code == rpc::CallCode::kDeadlineExceeded) {
            retry_later(backoff(), [this] { reconcile(); });
          } else {
            log(LogLevel::kInfo, "could not join job " + req.job_id() + " round " +
                                     std::to_string(req.round()) + ": " + rpc::describe(st));
          }
        });
      });
}

int NodeAgent::offer_store_port() {
  if (active_ || stopping_) return 0;
  // Why held while idle: the coordinator then joins this node to a new job itself, and its next
  // answer is RUN (no JOIN, no JoinRound). Whatever connects to it meanwhile is dropped when a
  // round starts on it (StoreServer::reset).
  if (!reserved_store_ && !store_offer_failed_) {
    std::string why;
    reserved_store_ = open_store(0, why);
    if (!reserved_store_) {
      store_offer_failed_ = true;
      log(LogLevel::kWarn, "cannot hold a port for the rendezvous store (" + why +
                               "); this node reserves one when it joins a round");
    }
  }
  return reserved_store_ ? reserved_store_->port() : 0;
}

std::unique_ptr<store::StoreServer> NodeAgent::open_store(int port, std::string& why) {
  store::StoreServerOptions so;
  so.port = port;
  so.warn = [this](const std::string& w) { log(LogLevel::kWarn, w); };
  // Why only the address in local mode: a one-machine job's store must not listen on every
  // interface; a cluster node falls back to any address when its own cannot be bound.
  std::vector<std::string> hosts = {options_.address};
  if (!options_.local) hosts.emplace_back("0.0.0.0");
  for (const std::string& host : hosts) {
    so.host = host;
    auto server = store::StoreServer::listen(io_, so);
    if (server) {
      // Why said: the store has no token; every interface is more than the node's address.
      if (host != hosts.front()) {
        log(LogLevel::kWarn, "the rendezvous store could not listen on " + hosts.front() + " (" +
                                 why + "); it listens on every interface (" + host +
                                 ") instead: give the node an address of its own (--node-address)");
      }
      return std::move(*server);
    }
    why = server.message();
  }
  return nullptr;
}

void NodeAgent::start_group(const pb::Instruction& ins) {
  const pb::Assignment& a = ins.assignment();
  active_ = std::make_unique<Active>();
  Active& act = *active_;
  act.generation = ++generation_;
  act.job_id = ins.job_id();
  act.round = ins.round();
  act.spec = ins.spec();
  act.assignment = a;
  // Node rank 0 serves the round's store before its workers start; the other nodes' workers
  // retry connecting until it listens (c10d's client does).
  auto reserved = std::move(reserved_store_);
  if (a.node_rank() == 0) {
    if (reserved && reserved->port() == a.master_port()) {
      act.store = std::move(reserved);
      // Why: nothing the last round's workers stored, or still send, may reach this one.
      act.store->reset();
    } else {
      std::string why;
      act.store = open_store(a.master_port(), why);
      if (!act.store) {
        log(LogLevel::kError, "cannot serve the rendezvous store: " + why);
        pb::Failure f;
        f.set_kind(pb::Failure::KIND_SPAWN);
        f.set_rank(a.rank_offset());
        f.set_message("cannot serve the rendezvous store: " + why);
        fail_round(std::move(f));
        return;
      }
    }
  }

  const auto network_timeout = std::chrono::milliseconds(ins.spec().network_timeout_ms());
  if (!options_.local && network_timeout.count() > 0 && a.peers_size() > 0) {
    std::vector<PeerTarget> targets;
    for (const auto& p : a.peers()) {
      targets.push_back({p.node_rank(), p.node_id(), p.hostname(), p.address(), p.probe_port()});
    }
    const uint64_t gen = act.generation;
    act.peers =
        std::make_unique<PeerWatch>(io_, std::move(targets), probe_interval(network_timeout),
                                    [this, gen] { on_probe_round(gen); });
    // Why wait: workers started while a peer cannot be reached would only fail at the store or
    // in their first collective, and burn a restart on the network.
    act.pending = ins;
    act.waiting_since = act.last_wait_line = std::chrono::steady_clock::now();
    act.peers->start();
    return;
  }
  spawn_workers(ins);
}

void NodeAgent::on_probe_round(uint64_t generation) {
  if (!active_ || active_->generation != generation || !active_->peers) return;
  Active& act = *active_;
  const auto now = std::chrono::steady_clock::now();
  const auto network_timeout = std::chrono::milliseconds(act.spec.network_timeout_ms());
  const std::string round = "job " + act.job_id + " round " + std::to_string(act.round);
  if (act.pending) {
    if (act.peers->all_answered()) {
      if (now - act.waiting_since > std::chrono::seconds(1)) {
        log(LogLevel::kInfo, round + ": every node answers again; starting the workers");
      }
      pb::Instruction ins = std::move(*act.pending);
      act.pending.reset();
      spawn_workers(ins);
      return;
    }
    const auto silences = act.peers->silent_for(std::chrono::milliseconds(0));
    const std::string what = describe_silences(options_.hostname, silences);
    if (now - act.waiting_since >= std::chrono::milliseconds(act.spec.join_timeout_ms())) {
      // Why the watch stays: this runs inside its callback. Without `pending` and without
      // workers, its later rounds change nothing (see below) until the round is retired.
      act.pending.reset();
      log(LogLevel::kError,
          round + ": network: " + what + "; giving up after join_timeout, telling the coordinator");
      pb::Failure f;
      f.set_kind(pb::Failure::KIND_NETWORK);
      f.set_rank(-1);
      f.set_local_rank(-1);
      f.set_before_start(true);
      f.set_message(what);
      fail_round(std::move(f));
      return;
    }
    if (now - act.last_wait_line >= std::chrono::seconds(10)) {
      act.last_wait_line = now;
      log(LogLevel::kWarn,
          round + ": waiting to reach every node before starting the workers: " + what);
    }
    return;
  }
  if (act.network_reported || act.all_succeeded || !act.running()) return;
  const auto silences = act.peers->silent_for(network_timeout);
  if (silences.empty()) return;
  act.network_reported = true;
  pb::Failure f;
  f.set_kind(pb::Failure::KIND_NETWORK);
  f.set_rank(-1);
  f.set_local_rank(-1);
  f.set_message(describe_silences(options_.hostname, silences));
  int64_t since = silences.front().since_unix_ms;
  for (const auto& s : silences) since = std::min(since, s.since_unix_ms);
  // Why the time of the last answer: it is when the partition began, before anything it caused.
  f.set_time_unix_ms(since);
  log(LogLevel::kError, "network: " + f.message() + " (network_timeout " +
                            seconds_text(static_cast<double>(network_timeout.count()) / 1000.0) +
                            "); " + stopping_others());
  fail_round(std::move(f));
}

void NodeAgent::spawn_workers(const pb::Instruction& ins) {
  const pb::Assignment& a = ins.assignment();
  Active& act = *active_;
  supervisor::AttemptOptions ao;
  ao.placement = {.job_id = ins.job_id(),
                  .attempt = static_cast<int>(ins.round()),
                  // Rounds that only change membership do not count as restarts.
                  .restart_count = a.restart_count(),
                  .rank_offset = a.rank_offset(),
                  .world_size = a.world_size(),
                  .node_rank = a.node_rank(),
                  .num_nodes = a.num_nodes(),
                  .master_addr = a.master_addr(),
                  .master_port = a.master_port()};
  ao.base_env = options_.base_env;
  if (!options_.local) {
    // Why: gloo (and NCCL's sockets) pick their interface from the host name, which Debian maps
    // to 127.0.1.1: ranks on other hosts then cannot connect. The interface of the address this
    // node registered with is the one the others reach. The user's own setting wins.
    const std::string ifname = interface_of_address(options_.address);
    for (const char* var : {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"}) {
      if (!ifname.empty() && !ao.base_env.count(var)) ao.base_env[var] = ifname;
    }
  }
  if (!options_.state_dir.empty()) {
    act.error_dir = supervisor::Attempt::folder(options_.state_dir, ins.job_id(), ins.round());
    act.keep_folder = options_.keep_round_folders;
    act.job_folder_lock = create_and_lock_job_folder(act.error_dir);
    std::error_code ec;
    if (!fs::is_directory(act.error_dir, ec)) act.error_dir.clear();
  }
  ao.error_dir = act.error_dir;
  if (!options_.local) ao.host = options_.hostname;
  ao.group = options_.group;
  JobSpec spec = rpc::from_proto(act.spec);
  if (wants_snapshots(spec.worker_settings) && !snapshots_ && !snapshots_refused_) {
    std::string why;
    snapshots_ = SnapshotFolder::create(ins.job_id(), why);
    if (!snapshots_) {
      snapshots_refused_ = true;  // said once per job; the workers then run without snapshots
      log(LogLevel::kWarn, "job " + ins.job_id() + ": no in-memory snapshots on this node: " + why);
    }
  }
  if (snapshots_) ao.base_env[contract::kSnapshotDir] = snapshots_->path();

  uint64_t gen = act.generation;
  supervisor::AttemptHooks hooks;
  hooks.on_failure = [this, gen](const supervisor::AttemptFailure& f) { on_failure(gen, f); };
  hooks.on_success = [this, gen] { on_success(gen); };
  hooks.on_stopped = [this, gen](const supervisor::StopReport& r) { on_stopped(gen, r); };
  hooks.log = log_;
  hooks.on_log_problem = [this](const std::string& problem) { log_problems_.push_back(problem); };
  if (spec.forward_logs) {
    log_job_ = ins.job_id();
    hooks.on_line = [this](int rank, bool is_stderr, std::string_view line) {
      pb::LogLine l;
      l.set_rank(rank);
      l.set_hostname(options_.hostname);
      l.set_stderr(is_stderr);
      // Why cut here: one line must fit in a push (the coordinator keeps 64 KiB of it anyway;
      // the rank's log file on this node keeps it whole).
      l.set_text(
          coordinator::limits::cut_text(std::string(line), coordinator::limits::kMaxLineBytes));
      log_buffer_bytes_ += l.ByteSizeLong();
      log_buffer_.push_back(std::move(l));
      ++lines_forwarded_;
      if (log_buffer_.size() >= 500 || log_buffer_bytes_ >= kMaxPushBytes) {
        flush_logs();
      } else if (!log_timer_armed_) {
        log_timer_armed_ = true;
        log_timer_.expires_after(100ms);
        log_timer_.async_wait([this, alive = alive_](const boost::system::error_code& ec2) {
          if (!alive->open || ec2) return;
          log_timer_armed_ = false;
          flush_logs();
        });
      }
    };
  }

  if (options_.local) {
    const int n = spec.processes_per_node;
    log(LogLevel::kInfo, "attempt " + std::to_string(a.restart_count()) + ": starting " +
                             std::to_string(n) + " worker" + (n == 1 ? "" : "s") +
                             " (MASTER_ADDR=" + a.master_addr() +
                             " MASTER_PORT=" + std::to_string(a.master_port()) + ")");
  } else {
    log(LogLevel::kInfo, "job " + ins.job_id() + " round " + std::to_string(ins.round()) +
                             ": starting ranks " + std::to_string(a.rank_offset()) + ".." +
                             std::to_string(a.rank_offset() + spec.processes_per_node - 1) +
                             " of " + std::to_string(a.world_size()) + " (node rank " +
                             std::to_string(a.node_rank()) + ", MASTER_ADDR=" + a.master_addr() +
                             " MASTER_PORT=" + std::to_string(a.master_port()) + ", restart " +
                             std::to_string(a.restart_count()) + ")");
  }
  act.attempt = std::make_unique<supervisor::Attempt>(io_, spec, std::move(ao), std::move(hooks));
  if (Status st = act.attempt->start(); !st) {
    act.attempt.reset();
    log(LogLevel::kError, "cannot start the workers: " + st.message());
    pb::Failure f;
    f.set_kind(pb::Failure::KIND_SPAWN);
    f.set_rank(a.rank_offset());
    f.set_message(st.message());
    fail_round(std::move(f));
    return;
  }
  ++groups_started_;
  report_event(pb::ReportGroupRequest::EVENT_STARTED);
}

std::string NodeAgent::stopping_others() const {
  return options_.local ? "stopping the other workers"
                        : "stopping this node's workers and telling the coordinator";
}

void NodeAgent::on_success(uint64_t generation) {
  if (!active_ || active_->generation != generation) return;
  active_->all_succeeded = true;
  if (!options_.local) {
    log(LogLevel::kInfo, "job " + active_->job_id + " round " + std::to_string(active_->round) +
                             ": every local worker exited 0");
  }
  flush_logs();
  report_event(pb::ReportGroupRequest::EVENT_SUCCEEDED);
}

void NodeAgent::on_failure(uint64_t generation, const supervisor::AttemptFailure& failure) {
  if (!active_ || active_->generation != generation) return;
  pb::Failure f;
  if (failure.hang) {
    ++hangs_seen_;
    const supervisor::Hang& hang = *failure.hang;
    f.set_kind(pb::Failure::KIND_HANG);
    f.set_rank(hang.rank);
    f.set_local_rank(hang.rank - active_->assignment.rank_offset());
    f.set_message(hang.reason);
    f.set_report(hang.report);
    log(LogLevel::kError, hang.report + stopping_others());
  } else {
    const supervisor::WorkerExit& exit = *failure.exit;
    f.set_kind(pb::Failure::KIND_EXIT);
    f.set_rank(exit.rank);
    f.set_local_rank(exit.local_rank);
    f.set_pid(exit.pid);
    if (exit.signaled) {
      f.set_signal(exit.signal);
    } else {
      f.set_exit_code(exit.exit_code);
    }
    f.set_time_unix_ms(
        std::chrono::duration_cast<std::chrono::milliseconds>(exit.time.time_since_epoch())
            .count());
    for (const auto& line : exit.stderr_tail) f.add_stderr_tail(line);
    if (failure.error) {
      f.set_message(failure.error->message);
      f.set_stack(failure.error->stack);
    }
    log(LogLevel::kError, "rank " + std::to_string(exit.rank) + " (pid " +
                              std::to_string(exit.pid) + ") failed: " + exit.describe() +
                              (f.message().empty() ? "" : ": " + f.message()) + "; " +
                              stopping_others());
  }
  // The attempt stops its workers itself once this returns.
  stopping_ = true;
  fail_round(std::move(f));
}

void NodeAgent::report_event(pb::ReportGroupRequest::Event event,
                             std::optional<pb::Failure> failure) {
  pb::ReportGroupRequest rep;
  rep.set_node_id(options_.node_id);
  rep.set_job_id(active_->job_id);
  rep.set_round(active_->round);
  rep.set_event(event);
  if (failure) *rep.add_failures() = std::move(*failure);
  report(std::move(rep));
}

void NodeAgent::fail_round(pb::Failure failure) {
  if (failure.hostname().empty()) failure.set_hostname(options_.hostname);
  if (failure.time_unix_ms() == 0) failure.set_time_unix_ms(now_unix_ms());
  flush_logs();
  // retried while the coordinator is away
  report_event(pb::ReportGroupRequest::EVENT_FAILED, std::move(failure));
  stop_active(SIGTERM);
}

void NodeAgent::shutdown(int signal, std::function<void()> done) {
  bool again = shutting_down_;
  shutting_down_ = true;
  flush_logs();
  if (active_ && active_->running()) {
    if (done) stopped_waiters_.push_back(std::move(done));
    if (again) {
      active_->attempt->stop(SIGKILL);
    } else if (!stopping_) {
      stop_active(signal);
    }  // else: a stop is under way; its grace is kept and the waiter runs when it ends
    return;
  }
  if (done) asio::post(io_, std::move(done));
}

}  // namespace accel::node

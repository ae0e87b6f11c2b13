// NodeAgent: one node's member of the control plane. It registers with the coordinator, keeps
// its lease alive with Sync long polls, and does what the instruction says: join a round, run
// the job's local workers (the supervisor library), stop them, stay idle. It reports its
// group's start, success and failures (with the workers' error files) and forwards output when
// the job asks. Log pushes and reports go out through one ordered outbox, one call at a time,
// each retried until the coordinator takes it: a round's output is at the coordinator before
// the node's report of that round, so a launcher prints every line before the job's end. It
// survives a coordinator restart: it reconnects with backoff, re-registers with the work it runs,
// and its workers keep running while the coordinator is away for less than the lease (after that it
// stops them: it cannot know whether its peers are alive).
//
// Thread: everything runs on the io_context passed in (one long-lived thread, see
// WorkerGroup); gRPC completions are posted onto it.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "agent/common/defaults.h"
#include "agent/node/node_address.h"
#include "agent/node/peer_probe.h"
#include "agent/node/snapshot_folder.h"
#include "agent/rpc/coordinator_api.h"
#include "agent/store/store_server.h"
#include "agent/supervisor/attempt.h"
#include "agent/supervisor/worker_group.h"

namespace accel::metrics {
class Exposition;
}

namespace accel::node {

namespace pb = ::accel::v1;

struct NodeAgentOptions {
  std::string node_id;  // unique among the coordinator's nodes
  std::string hostname;
  std::string address;      // MASTER_ADDR when this node is node rank 0
  int machine_rank = -1;    // mode 2: the node rank asked for
  std::string only_job_id;  // take part only in this job
  // A local launch: the only node, with the coordinator in this process. It says nothing about
  // registering and joining rounds, speaks of attempts and "the other workers", and prefixes the
  // workers' console lines "[rank r]" (not "[host:rank]").
  bool local = false;
  std::string state_dir;  // where workers' error files go: <state_dir>/<job>/attempt_<round>/
  // Keep those folders after the round, and leave what is in state_dir at start: they are the
  // user's log folders (a local launch with log_dir puts error files beside the logs).
  bool keep_round_folders = false;
  supervisor::EnvMap base_env;  // the workers' inherited environment
  supervisor::WorkerGroupOptions group;
  std::chrono::milliseconds rpc_timeout{5'000};
  std::chrono::milliseconds lease_fallback{
      defaults::kLease};  // until the coordinator says its lease
  // Mode 2: give up (on_fatal) when the coordinator cannot be reached for this long and no
  // worker runs; 0: never (standing agents wait for it).
  std::chrono::milliseconds give_up_after{0};
};

struct NodeAgentHooks {
  // A job this node took part in has ended (mode-2 launchers exit with its code).
  std::function<void(const pb::JobOutcome&)> on_job_end;
  // The agent cannot go on (wrong token, node id taken): it has stopped its workers.
  std::function<void(const std::string&)> on_fatal;
};

class NodeAgent {
 public:
  NodeAgent(boost::asio::io_context& io, std::shared_ptr<rpc::CoordinatorApi> client,
            NodeAgentOptions options, supervisor::JobLogger log, NodeAgentHooks hooks);
  ~NodeAgent();
  NodeAgent(const NodeAgent&) = delete;
  NodeAgent& operator=(const NodeAgent&) = delete;

  void start();
  // Stops the workers (signal, then SIGKILL after the grace) and stops talking to the
  // coordinator; `done` runs on the io thread once no worker is left. Again: SIGKILL now.
  void shutdown(int signal, std::function<void()> done);

  [[nodiscard]] std::vector<pid_t> worker_pids() const;
  // Rank log files that could not be written so far, one line each (said when they happen; a
  // launcher repeats them at the end).
  [[nodiscard]] const std::vector<std::string>& log_problems() const { return log_problems_; }
  // The job this node runs or was told to join; empty when idle.
  [[nodiscard]] std::string current_job_id() const;
  [[nodiscard]] bool registered() const { return registered_; }
  // One line for people (systemd's STATUS=): "idle", "running job J round R (ranks a-b)", ...
  [[nodiscard]] std::string state_text() const;
  // This node's metrics: its workers, their ranks' progress, memory and CPU, its forwarding and
  // its store (node_agent_metrics.cpp; the names are in docs/operations.md).
  void write_metrics(metrics::Exposition& out) const;
  // A page of this node's workers (an agent without a coordinator serves it at /).
  [[nodiscard]] std::string status_page(int refresh_s) const;

 private:
  // One PushLogs call carries at most this much: far under gRPC's 4 MiB message limit.
  static constexpr size_t kMaxPushBytes = 1u << 20;
  struct Active;

  void remove_leftover_rounds();
  void do_register();
  void do_sync();
  // The workers' progress as the coordinator wants it in a sync (node_agent_metrics.cpp).
  void fill_progress(pb::SyncRequest& req) const;
  void on_sync(const rpc::CallStatus& status, const pb::SyncResponse& resp);
  void coordinator_unreachable(const rpc::CallStatus& status);
  void reconcile();
  void stop_active(int signal);
  void start_group(const pb::Instruction& ins);
  // Spawns the active round's workers (start_group, once the peers answered).
  void spawn_workers(const pb::Instruction& ins);
  // After each round of peer probes: start the workers once every peer answered (or fail the
  // round after join_timeout); while they run, report a peer silent for network_timeout.
  void on_probe_round(uint64_t generation);
  void join(const pb::Instruction& ins);
  // A rendezvous store on this node's address (or any address when that fails) and `port`
  // (0: any); null when neither can be bound (`why` says so).
  std::unique_ptr<store::StoreServer> open_store(int port, std::string& why);
  // The port of the store this free node holds for its next round (reserved on first use); 0
  // while it runs workers, or when none could be bound.
  int offer_store_port();
  void on_failure(uint64_t generation, const supervisor::AttemptFailure& failure);
  void on_success(uint64_t generation);
  [[nodiscard]] std::string stopping_others() const;
  void on_stopped(uint64_t generation, const supervisor::StopReport& report);
  void report(pb::ReportGroupRequest req);
  // Reports `event` for the active round.
  void report_event(pb::ReportGroupRequest::Event event,
                    std::optional<pb::Failure> failure = std::nullopt);
  // The active round failed here: report it (retried) and stop the local workers.
  void fail_round(pb::Failure failure);
  // Moves the buffered lines into the outbox, in pushes under the message limit.
  void flush_logs();
  // Sends the outbox's first call unless one is in flight; on success the next, on a transient
  // error the same one again after a backoff.
  void send_next();
  void retry_later(std::chrono::milliseconds delay, std::function<void()> f);
  std::chrono::milliseconds backoff();
  void fatal(const std::string& why);
  void log(supervisor::LogLevel level, const std::string& text) { log_(level, text); }

  struct Gate {
    std::mutex mu;  // guards open against the gRPC threads
    bool open = true;
  };
  static void post_completion(const std::shared_ptr<Gate>& gate, boost::asio::io_context* io,
                              std::function<void()> f);

  boost::asio::io_context& io_;
  std::shared_ptr<rpc::CoordinatorApi> client_;
  NodeAgentOptions options_;
  supervisor::JobLogger log_;
  NodeAgentHooks hooks_;
  std::shared_ptr<Gate> alive_;  // closed by the destructor

  bool registered_ = false;
  bool shutting_down_ = false;
  std::string coordinator_id_;
  std::chrono::milliseconds lease_;
  std::chrono::milliseconds sync_wait_{2'000};
  std::chrono::milliseconds idle_wait_{0};          // without workers; 0: sync_wait_
  std::chrono::milliseconds progress_wait_{2'000};  // with workers (SyncResponse)
  uint64_t known_version_ = 0;
  pb::Instruction desired_;
  bool have_desired_ = false;
  std::optional<std::chrono::steady_clock::time_point> unreachable_since_;
  int failures_in_a_row_ = 0;
  std::chrono::steady_clock::time_point last_unreachable_log_{};

  std::unique_ptr<ProbeListener> probe_listener_;  // other nodes' probes of this one
  std::unique_ptr<Active> active_;
  std::unique_ptr<Active> retired_;  // the last round, its workers gone, until the next one runs
  // The store bound when joining a round (any node may become node rank 0); see join().
  std::unique_ptr<store::StoreServer> reserved_store_;
  bool store_offer_failed_ = false;  // the idle node could not bind one (said once)
  // The store this node served in the last round of job_store_job_, kept for its next round.
  std::unique_ptr<store::StoreServer> job_store_;
  std::string job_store_job_;
  // The current job's in-memory snapshots on this node (--snapshot-interval), kept from round to
  // round; removed when the node's job changes or the agent goes.
  std::unique_ptr<SnapshotFolder> snapshots_;
  std::string snapshots_job_;       // the job snapshots_refused_ is about
  bool snapshots_refused_ = false;  // the folder could not be made: said once per job
  uint64_t generation_ = 0;
  bool stopping_ = false;
  int stop_signal_ = 15;  // SIGTERM, or a cancelling launcher's signal
  std::vector<std::function<void()>> stopped_waiters_;
  std::string joined_job_;
  int64_t joined_round_ = -1;
  bool join_in_flight_ = false;
  std::string reported_outcome_;  // the job whose end was handed to on_job_end
  std::vector<std::string> log_problems_;

  std::vector<pb::LogLine> log_buffer_;
  size_t log_buffer_bytes_ = 0;
  std::string log_job_;
  struct Outgoing {
    std::variant<pb::PushLogsRequest, pb::ReportGroupRequest> call;
    int attempt = 0;
  };
  std::deque<Outgoing> outbox_;
  bool sending_ = false;
  uint64_t lines_not_forwarded_ = 0;  // pushes the coordinator refused for good
  // Counted for the metrics (node_agent_metrics.cpp).
  uint64_t lines_forwarded_ = 0;   // handed to the outbox
  uint64_t groups_started_ = 0;    // worker groups spawned
  uint64_t coordinator_lost_ = 0;  // times the coordinator was silent past the lease
  uint64_t hangs_seen_ = 0;
  boost::asio::steady_timer log_timer_;
  bool log_timer_armed_ = false;
};

// "<hostname>-<pid>-<4 hex>": unique per agent process.
std::string default_node_id(const std::string& hostname);

}  // namespace accel::node

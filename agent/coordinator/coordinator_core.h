// CoordinatorCore: the rendezvous coordinator's state and rules, apart from gRPC (STYLE.md:
// Ray's handler/adapter split), so tests drive it with a FakeClock and plain messages.
//
// It owns node membership (leases renewed by Sync), jobs (the state machine of docs/operations.md:
// PENDING -> RENDEZVOUS(r) -> RUNNING -> (RESTARTING -> RENDEZVOUS(r+1))* -> SUCCEEDED | FAILED
// | CANCELLED), rounds (min/max nodes, join_timeout, last_call), node ranks, MASTER_ADDR/PORT,
// the job-wide restart budget, failure records (root cause = the globally earliest) and each
// job's event log for watching launchers.
//
// Every request is validated before anything changes: a call that returns an error leaves the
// state as it was.
//
// Thread: not thread-safe. CoordinatorServer calls it under one mutex.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "accel/v1/coordinator.pb.h"
#include "agent/common/clock.h"
#include "agent/common/defaults.h"
#include "agent/coordinator/failure_summary.h"
#include "agent/coordinator/request_limits.h"
#include "agent/coordinator/stragglers.h"

namespace accel::metrics {
class Exposition;
}

namespace accel::coordinator {

namespace pb = ::accel::v1;

// gRPC's codes, without gRPC (the adapter maps them one to one).
enum class Code {
  kOk,
  kInvalidArgument,
  kNotFound,
  kFailedPrecondition,
  kAlreadyExists,
  kResourceExhausted,
  kUnavailable  // not from the core: a transport's (a parked call when the server stops)
};

struct RpcStatus {
  Code code = Code::kOk;
  std::string message;
  static RpcStatus ok() { return {}; }
  static RpcStatus error(Code c, std::string m) { return {c, std::move(m)}; }
  [[nodiscard]] bool is_ok() const { return code == Code::kOk; }
};

struct CoordinatorOptions {
  std::chrono::milliseconds lease{defaults::kLease};  // a node silent this long is lost
  // Long-poll wait of nodes running workers (their progress rides on each Sync); longer when
  // the nodes are many (progress_wait()).
  std::chrono::milliseconds sync_wait{2'000};
  // Long-poll wait of nodes running nothing (RegisterNodeResponse.idle_wait_ms); 0: not
  // offered. Only a transport that sees dead connections may offer it (dead_connection_within).
  std::chrono::milliseconds idle_wait{0};
  // A node with a parked Sync is alive: the transport notices a dead connection within this
  // (keepalive pings), so a poll that ends vouches for its node up to this long before its end.
  std::chrono::milliseconds dead_connection_within{0};
  size_t max_events_per_job = 250'000;         // older events are dropped (watchers are told)
  size_t max_event_bytes_per_job = 16u << 20;  // the same, by their serialized size
  // A launcher watching a job holds back pushes of its output that would drop lines it has not
  // read (the node retries them), until it has not polled for its poll's wait plus this long.
  std::chrono::milliseconds watcher_grace{5'000};
  // Ended jobs and lost nodes are forgotten this long after they ended or were lost.
  std::chrono::milliseconds retention{3'600'000};
  int max_port_retries = 3;  // MASTER_PORT taken: new round, not counted
  // Nodes (live and lost) and jobs (running and ended) kept; beyond them the oldest lost node or
  // ended job is forgotten, and when there is none a registration or submission is refused.
  std::size_t max_nodes = limits::kMaxRegisteredNodes;
  std::size_t max_jobs = limits::kMaxJobs;
  std::string coordinator_id;  // empty: generated
  // Tests and fuzzers: every instruction a sync reuses is rebuilt and compared, and a mismatch
  // (a change that did not mark the nodes it concerns) aborts the process.
  bool verify_reused_instructions = false;
};

class CoordinatorCore {
 public:
  CoordinatorCore(const Clock& clock, CoordinatorOptions options);

  RpcStatus register_node(const pb::RegisterNodeRequest& req, pb::RegisterNodeResponse* resp);
  // Renews the node's lease and fills its current instruction.
  RpcStatus sync(const pb::SyncRequest& req, pb::SyncResponse* resp);
  // The node's current instruction, without renewing its lease (for parked long polls); left
  // out (resp->unchanged()) when it is still version `omit_if_version` (0: never left out).
  RpcStatus instruction(const std::string& node_id, pb::SyncResponse* resp,
                        uint64_t omit_if_version = 0);
  // A Sync of the node is parked / ended (answered or cancelled): while one is parked, the node's
  // lease does not lapse (see CoordinatorOptions::dead_connection_within).
  void poll_started(const std::string& node_id);
  void poll_ended(const std::string& node_id);
  RpcStatus join_round(const pb::JoinRoundRequest& req);
  RpcStatus report_group(const pb::ReportGroupRequest& req);
  RpcStatus push_logs(const pb::PushLogsRequest& req);
  RpcStatus submit_job(const pb::SubmitJobRequest& req, pb::SubmitJobResponse* resp);
  // Fills the job's events after req.after_seq (never waits; the adapter parks the call).
  RpcStatus watch_job(const pb::WatchJobRequest& req, pb::WatchJobResponse* resp);
  RpcStatus cancel_job(const pb::CancelJobRequest& req);
  void get_status(pb::GetStatusResponse* resp) const;

  // Applies time: lapsed leases, round deadlines (last_call, join_timeout), waiting nodes that
  // make a running elastic job grow. The server calls it every ~100 ms, and when a lease may
  // lapse (next_lease_check()).
  void tick();
  // The earliest time a node's lease may lapse (max when none can): the ticker wakes then, so a
  // node is lost when its lease ends, not up to a tick later.
  [[nodiscard]] Clock::time_point next_lease_check() const { return next_lease_check_; }

  // What changed since the last call, so the adapter wakes only the parked calls it must.
  struct Changes {
    bool all_nodes = false;
    std::set<std::string> nodes;
    std::set<std::string> jobs;  // jobs with new events
  };
  Changes take_changes();

  // The wait nodes running workers are told (SyncResponse.progress_wait_ms): sync_wait, or long
  // enough that all nodes together send at most kProgressSyncsPerSecond, up to the idle wait.
  static constexpr int kProgressSyncsPerSecond = 600;
  // A round's nodes told RUN come back within num_nodes / this seconds
  // (SyncResponse.next_sync_within_ms): 0.8 s for 16,384 nodes, at once for small jobs.
  static constexpr int kRunAnswersPerSecond = 20'000;
  [[nodiscard]] std::chrono::milliseconds progress_wait() const;
  [[nodiscard]] uint64_t node_version(const std::string& node_id) const;
  [[nodiscard]] uint64_t last_event_seq(const std::string& job_id) const;
  [[nodiscard]] const std::string& coordinator_id() const { return options_.coordinator_id; }
  [[nodiscard]] const CoordinatorOptions& options() const { return options_; }
  [[nodiscard]] std::optional<pb::JobState> job_state(const std::string& job_id) const;
  // True once every live node that took part in the ended job has been sent its outcome (the
  // hosting launcher of mode 2 waits for this before it exits).
  [[nodiscard]] bool everyone_told(const std::string& job_id) const;
  // The bytes of what the core keeps for its nodes and jobs (serialized sizes): what the limits
  // of request_limits.h bound, for tests and docs/operations.md.
  [[nodiscard]] size_t stored_bytes() const;
  [[nodiscard]] size_t node_count() const { return nodes_.size(); }
  [[nodiscard]] size_t job_count() const { return jobs_.size(); }

  // The core's metrics (coordinator_metrics.cpp; the names are in docs/operations.md).
  void write_metrics(metrics::Exposition& out) const;
  // The status page: jobs, nodes, each running job's ranks with their recent steps per second,
  // stragglers marked, the last events and the failure summary (status_page.cpp). `refresh_s`:
  // how often the page reloads itself.
  [[nodiscard]] std::string status_page(int refresh_s) const;

 private:
  struct Node {
    pb::RegisterNodeRequest info;
    Clock::time_point last_seen;
    int polls = 0;  // its parked Syncs
    bool lost = false;
    // Since it was last heard of; a node with a parked Sync is heard of now (its connection is
    // alive), whenever that Sync came.
    [[nodiscard]] Clock::time_point::duration silent(Clock::time_point now) const {
      return polls > 0 ? Clock::time_point::duration::zero() : now - last_seen;
    }
    uint64_t version = 0;
    std::string sent;         // the serialized instruction of `version`
    uint64_t sent_epoch = 0;  // the core's change_epoch_ when `sent` was built
    std::string job_id;       // the job this node joined or runs (empty: free)
    int64_t joined_round = -1;
    int32_t joined_port = 0;
    int32_t store_port = 0;    // the port it holds for a store (RegisterNodeRequest.store_port)
    bool auto_joined = false;  // joined to its round by the coordinator, not by JoinRound
    std::string last_job_id;   // the last job it took part in
    std::string told_job_id;   // the last job whose outcome was sent to it
    std::vector<pb::RankProgress> progress;  // its workers, as of its last Sync
    Clock::time_point progress_at;           // when that Sync arrived
    Clock::time_point lost_at;               // when `lost` was set
  };

  struct Job {
    std::string id;
    pb::JobSpec spec;
    pb::JobState state = pb::JOB_STATE_PENDING;
    int64_t round = -1;
    int32_t restart_count = 0;
    int32_t port_retries = 0;
    Clock::time_point round_opened;
    std::optional<Clock::time_point> min_reached;
    std::vector<std::string> joined;   // open round, in join order
    std::vector<std::string> members;  // closed round, in node-rank order ("" = not back yet)
    // Why indexes: every sync asks where its node is; a scan of 16k ids per sync is the
    // coordinator's whole CPU at that size. Kept equal to `joined` and `members`.
    std::unordered_set<std::string> joined_ids;
    std::unordered_map<std::string, int> member_rank;
    [[nodiscard]] int rank_of(const std::string& node_id) const {
      auto it = member_rank.find(node_id);
      return it == member_rank.end() ? -1 : it->second;
    }
    void set_members(std::vector<std::string> order) {
      members = std::move(order);
      member_rank.clear();
      member_rank.reserve(members.size());
      for (size_t i = 0; i < members.size(); ++i) {
        if (!members[i].empty()) member_rank[members[i]] = static_cast<int>(i);
      }
    }
    std::map<int64_t, std::vector<std::string>> round_members;  // every closed round
    std::optional<Clock::time_point> adopt_deadline;  // adopted after a coordinator restart
    std::string master_addr;
    int32_t master_port = 0;
    std::set<std::string> started;
    std::set<std::string> succeeded;
    std::vector<pb::Failure> failures;  // every failure of every round
    int64_t last_failed_round = -1;
    int32_t exit_code = 0;
    std::string summary;
    std::string end_why;  // why it ended, the summary's first line
    std::deque<pb::JobEvent> events;
    size_t event_bytes = 0;  // serialized size of `events`
    uint64_t next_seq = 1;
    // The watching launcher has read every event up to this seq, and counts as watching until
    // watcher_until (its poll's deadline plus the grace).
    uint64_t watched_through = 0;
    std::optional<Clock::time_point> watcher_until;
    uint64_t submitted_order = 0;
    std::optional<Clock::time_point> ended_at;
    std::map<std::pair<int64_t, std::string>, size_t> failures_kept;  // per (round, node)
    uint64_t failures_dropped = 0;  // beyond limits::max_failures_per_node_round
    // Watching the ranks' speed (coordinator_metrics.cpp), and what it and the rounds counted.
    StragglerWatch stragglers;
    std::map<std::string, uint64_t> restarts_by_cause;  // "exit", "node_lost", ...
    uint64_t straggler_reports = 0;
    uint64_t stall_reports = 0;
    uint64_t hang_reports = 0;
    // Each rank's steps per second, one value per kHistoryStep, the newest last (the page's
    // plots); only for the first kHistoryRanks ranks.
    std::map<int, std::deque<float>> rate_history;
    Clock::time_point history_at{};
  };
  static constexpr std::chrono::seconds kHistoryStep{5};
  static constexpr size_t kHistoryLength = 72;  // 6 minutes
  static constexpr int kHistoryRanks = 64;

  [[nodiscard]] bool terminal(const Job& job) const;
  [[nodiscard]] bool busy_elsewhere(const Node& node, const Job& job) const;
  [[nodiscard]] bool eligible(const Node& node, const Job& job) const;
  [[nodiscard]] pb::Instruction instruction_for(const std::string& node_id, const Node& node) const;
  void fill_sync(const std::string& node_id, Node& node, pb::SyncResponse* resp,
                 uint64_t omit_if_version);
  // Records that instructions may have changed: the node's, or every node's. Both bump
  // change_epoch_, which is what lets a sync with nothing changed skip building one.
  void node_changed(const std::string& node_id) {
    changes_.nodes.insert(node_id);
    ++change_epoch_;
  }
  void all_nodes_changed() {
    changes_.all_nodes = true;
    ++change_epoch_;
  }

  // True when `count` more events of `bytes` would push out events a live watcher has not read.
  [[nodiscard]] bool would_drop_unread(const Job& job, size_t count, size_t bytes) const;
  void open_round(Job& job, const std::string& why);
  // Joins a free node that holds a store port to the oldest open round it may join, as its
  // JoinRound would (it is told RUN when the round closes, never JOIN). False when it was not.
  bool auto_join(const std::string& node_id, Node& node);
  // The oldest job with an open round, not full, that `node` may join; null when none.
  [[nodiscard]] const Job* round_to_join(const Node& node) const;
  // Adds the node to the job's open round (JoinRound and auto_join), closing it when full.
  void add_to_round(Job& job, const std::string& node_id, Node& node, int32_t master_port);
  void close_round(Job& job);
  // `cause` labels the restart in metrics: exit, signal, hang, spawn, network, node_lost, port,
  // agent_restart, coordinator_restart, elastic.
  void restart(Job& job, const std::string& why, bool counted, const std::string& cause);
  // Once a second from tick(): the ranks' progress into stragglers, stalls and the rate history.
  void observe_progress(Job& job, Clock::time_point now);
  [[nodiscard]] std::vector<RankReport> rank_reports(const Job& job, Clock::time_point now) const;
  void end_job(Job& job, pb::JobState state, int32_t exit_code, const std::string& why);
  void summarize(Job& job);
  void node_lost(const std::string& node_id, Node& node, const std::string& why);
  void adopt(const std::string& node_id, Node& node, const pb::CurrentWork& work);
  [[nodiscard]] std::optional<size_t> root_cause(const Job& job, int64_t round) const;
  // A node saw a hang: joins every member's last progress into a job-wide desync report and
  // names the lagging rank (the one with the fewest collectives started).
  void desync_report(const Job& job, int64_t round, pb::Failure& hang) const;

  void event(Job& job, pb::JobEvent ev);
  // Whether `node_id` takes or took part in `job` (joined its open round or is in any closed one).
  [[nodiscard]] bool took_part(const Job& job, const std::string& node_id) const;
  // At the cap of kept jobs / nodes: forgets the oldest ended job / lost node. False when every
  // kept one is live (the new one is refused).
  bool make_room_for_job();
  bool make_room_for_node();
  // Forgets ended jobs and lost nodes past `retention` (tick).
  void forget_expired();
  void message(Job& job, const std::string& text);
  void mark_job_nodes(const Job& job);

  const Clock& clock_;
  // The peers node rank `rank` of `job` probes (Assignment.peers).
  void add_peers(const Job& job, int rank, pb::Assignment* a) const;

  CoordinatorOptions options_;
  std::map<std::string, Node> nodes_;
  std::map<std::string, Job> jobs_;
  uint64_t jobs_submitted_ = 0;
  uint64_t lease_misses_ = 0;  // nodes lost because their lease lapsed
  // No node's lease lapses before this (tick skips looking until then): the earliest
  // last_seen + lease of the nodes without a parked poll at the last look, lowered when a poll
  // ends. Why: at 16k nodes a look at every node on every tick was CPU for nothing.
  Clock::time_point next_lease_check_{};
  void lease_may_lapse_at(Clock::time_point t) {
    next_lease_check_ = std::min(next_lease_check_, t);
  }
  Clock::time_point observed_at_{};
  Changes changes_;
  uint64_t change_epoch_ = 1;
};

std::string job_state_name(pb::JobState s);
// The same in lower case ("running"): metric labels and the status page.
std::string job_state_label(pb::JobState s);

}  // namespace accel::coordinator

// The coordinator's rules: membership, rounds, restarts, failures, events.
#include "agent/coordinator/coordinator_core.h"

#include <algorithm>
#include <cctype>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <random>
#include <sstream>

#include "agent/common/exit_hints.h"
#include "agent/coordinator/request_limits.h"
#include "contract/duration.h"

namespace accel::coordinator {

namespace {

using std::chrono::duration_cast;
using std::chrono::milliseconds;

std::string random_hex(int digits) {
  std::random_device rd;
  std::string out;
  for (int i = 0; i < digits; ++i) out += "0123456789abcdef"[rd() % 16];
  return out;
}

RpcStatus invalid(std::string m) { return RpcStatus::error(Code::kInvalidArgument, std::move(m)); }
RpcStatus not_found(std::string m) { return RpcStatus::error(Code::kNotFound, std::move(m)); }
RpcStatus precondition(std::string m) {
  return RpcStatus::error(Code::kFailedPrecondition, std::move(m));
}

// A peer's string for an error message: printable and at most 64 bytes of it.
std::string quoted(const std::string& s) {
  return "'" + limits::printable(s.substr(0, 64)) +
         (s.size() > 64 ? "...' (" + std::to_string(s.size()) + " bytes)" : "'");
}

bool valid_id(const std::string& id) {
  if (id.empty() || id.size() > 128) return false;
  return std::all_of(id.begin(), id.end(), [](unsigned char c) {
    return std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == ':';
  });
}

// Why: a port taken between the agent's check and rank 0's bind is retried, not fatal.
bool is_port_conflict(const pb::Failure& f) {
  auto has = [](const std::string& s) {
    return s.find("Address already in use") != std::string::npos ||
           s.find("EADDRINUSE") != std::string::npos;
  };
  if (has(f.message())) return true;
  return std::any_of(f.stderr_tail().begin(), f.stderr_tail().end(), has);
}

std::string round_name(int64_t r) { return "round " + std::to_string(r); }

}  // namespace

std::string job_state_name(pb::JobState s) {
  switch (s) {
    case pb::JOB_STATE_PENDING:
      return "PENDING";
    case pb::JOB_STATE_RENDEZVOUS:
      return "RENDEZVOUS";
    case pb::JOB_STATE_RUNNING:
      return "RUNNING";
    case pb::JOB_STATE_RESTARTING:
      return "RESTARTING";
    case pb::JOB_STATE_SUCCEEDED:
      return "SUCCEEDED";
    case pb::JOB_STATE_FAILED:
      return "FAILED";
    case pb::JOB_STATE_CANCELLED:
      return "CANCELLED";
    default:
      return "UNKNOWN";
  }
}

CoordinatorCore::CoordinatorCore(const Clock& clock, CoordinatorOptions options)
    : clock_(clock), options_(std::move(options)) {
  if (options_.coordinator_id.empty()) options_.coordinator_id = random_hex(12);
}

// ------------------------------------------------------------------------------ helpers

bool CoordinatorCore::terminal(const Job& job) const {
  return job.state == pb::JOB_STATE_SUCCEEDED || job.state == pb::JOB_STATE_FAILED ||
         job.state == pb::JOB_STATE_CANCELLED;
}

bool CoordinatorCore::busy_elsewhere(const Node& node, const Job& job) const {
  if (node.job_id.empty() || node.job_id == job.id) return false;
  auto it = jobs_.find(node.job_id);
  return it != jobs_.end() && !terminal(it->second);
}

bool CoordinatorCore::eligible(const Node& node, const Job& job) const {
  if (node.lost || busy_elsewhere(node, job)) return false;
  return node.info.only_job_id().empty() || node.info.only_job_id() == job.id;
}

void CoordinatorCore::mark_job_nodes(const Job& job) {
  for (const auto& [id, node] : nodes_) {
    if (node.job_id == job.id || node.last_job_id == job.id) node_changed(id);
  }
}

bool CoordinatorCore::everyone_told(const std::string& job_id) const {
  auto jt = jobs_.find(job_id);
  if (jt == jobs_.end() || !terminal(jt->second)) return false;
  return std::all_of(nodes_.begin(), nodes_.end(), [&](const auto& kv) {
    const Node& n = kv.second;
    return n.lost || n.last_job_id != job_id || n.told_job_id == job_id;
  });
}

// ---------------------------------------------------------------------------------- nodes

RpcStatus CoordinatorCore::register_node(const pb::RegisterNodeRequest& req,
                                         pb::RegisterNodeResponse* resp) {
  if (!valid_id(req.node_id())) {
    return invalid("node_id " + quoted(req.node_id()) +
                   " must be 1-128 characters of [A-Za-z0-9._:-]");
  }
  if (auto why = limits::check(req); !why.empty())
    return invalid("node " + req.node_id() + ": " + why);
  if (req.has_current() && !req.current().job_id().empty() && !valid_id(req.current().job_id())) {
    return invalid("node " + req.node_id() + ": current job id " + quoted(req.current().job_id()) +
                   " must be 1-128 characters of [A-Za-z0-9._:-]");
  }
  auto it = nodes_.find(req.node_id());
  if (it == nodes_.end() && !make_room_for_node()) {
    return RpcStatus::error(Code::kResourceExhausted,
                            "the coordinator keeps " + std::to_string(nodes_.size()) +
                                " nodes, its most (coordinator_max_nodes), and none of them is "
                                "lost; node " +
                                req.node_id() + " is refused");
  }
  if (it != nodes_.end() && !it->second.lost &&
      (it->second.info.hostname() != req.hostname() ||
       it->second.info.address() != req.address())) {
    return RpcStatus::error(Code::kAlreadyExists,
                            "node id " + req.node_id() + " is already registered by " +
                                it->second.info.hostname() + " (" + it->second.info.address() +
                                "); give each agent its own --node-id");
  }
  bool fresh = it == nodes_.end();
  Node& node = nodes_[req.node_id()];
  std::string previous_job = node.job_id;
  node.info = req;
  node.info.clear_current();
  node.store_port = req.store_port();
  node.last_seen = clock_.now();
  lease_may_lapse_at(node.last_seen + options_.lease);
  bool was_lost = node.lost;
  node.lost = false;
  // Why only this node when it is new: another node's instruction does not depend on it until it
  // joins a round (an elastic job grows at the next tick, which wakes every node). A known node
  // registering again may have a new address or probe port, which its peers are told.
  if (fresh || was_lost) {
    node_changed(req.node_id());
  } else {
    all_nodes_changed();
  }

  const std::string running = req.has_current() ? req.current().job_id() : "";
  if (!fresh && !was_lost && !previous_job.empty() && previous_job != running) {
    // The agent restarted and lost the workers we think it runs.
    auto jt = jobs_.find(previous_job);
    if (jt != jobs_.end() && !terminal(jt->second)) {
      Job& job = jt->second;
      bool member = job.rank_of(req.node_id()) >= 0;
      node.job_id.clear();
      if (job.state == pb::JOB_STATE_RUNNING && member) {
        restart(job,
                "node " + req.node_id() + " re-registered without its workers (agent restarted)",
                /*counted=*/false, "agent_restart");
      } else if (job.state == pb::JOB_STATE_RENDEZVOUS) {
        job.joined.erase(std::remove(job.joined.begin(), job.joined.end(), req.node_id()),
                         job.joined.end());
        job.joined_ids.erase(req.node_id());
      }
    }
  }
  if (!running.empty()) {
    adopt(req.node_id(), node, req.current());
  } else {
    auto_join(req.node_id(), node);
  }

  resp->set_coordinator_id(options_.coordinator_id);
  resp->set_lease_ms(options_.lease.count());
  resp->set_sync_wait_ms(options_.sync_wait.count());
  resp->set_idle_wait_ms(options_.idle_wait.count());
  return RpcStatus::ok();
}

// A node that runs workers told us what (the coordinator restarted and lost its state).
void CoordinatorCore::adopt(const std::string& node_id, Node& node, const pb::CurrentWork& work) {
  const auto& a = work.assignment();
  auto it = jobs_.find(work.job_id());
  if (it == jobs_.end()) {
    Job job;
    job.id = work.job_id();
    job.spec = work.spec();
    job.state = pb::JOB_STATE_RUNNING;
    job.round = work.round();
    job.restart_count = a.restart_count();
    job.set_members(std::vector<std::string>(static_cast<size_t>(a.num_nodes())));
    job.master_addr = a.master_addr();
    job.master_port = a.master_port();
    job.submitted_order = jobs_submitted_++;
    job.adopt_deadline = clock_.now() + options_.lease;
    job.round_opened = clock_.now();
    it = jobs_.emplace(job.id, std::move(job)).first;
    message(it->second, "coordinator " + options_.coordinator_id + " adopted job " + work.job_id() +
                            " at " + round_name(work.round()) + " from node " + node_id +
                            " (the coordinator restarted)");
  }
  Job& job = it->second;
  if (job.state != pb::JOB_STATE_RUNNING || job.round != work.round() ||
      job.members.size() != static_cast<size_t>(a.num_nodes())) {
    return;  // the job moved on: the node's instruction will say what to do
  }
  auto& slot = job.members[static_cast<size_t>(a.node_rank())];
  if (!slot.empty() && slot != node_id) return;
  slot = node_id;
  job.member_rank[node_id] = a.node_rank();
  job.round_members[job.round] = job.members;
  node.job_id = job.id;
  node.joined_round = job.round;
  if (work.group_succeeded()) job.succeeded.insert(node_id);
  job.started.insert(node_id);
  if (std::none_of(job.members.begin(), job.members.end(),
                   [](const std::string& m) { return m.empty(); })) {
    job.adopt_deadline.reset();
    message(job, "all " + std::to_string(job.members.size()) + " nodes of " +
                     round_name(job.round) + " are back");
    if (job.succeeded.size() == job.members.size()) end_job(job, pb::JOB_STATE_SUCCEEDED, 0, "");
  }
}

RpcStatus CoordinatorCore::sync(const pb::SyncRequest& req, pb::SyncResponse* resp) {
  auto it = nodes_.find(req.node_id());
  if (it == nodes_.end()) {
    return not_found("node " + req.node_id() + " is not registered with coordinator " +
                     options_.coordinator_id + "; register first");
  }
  if (it->second.lost) {
    return not_found("node " + req.node_id() + " was declared lost (no heartbeat for " +
                     std::to_string(options_.lease.count()) + " ms); register again");
  }
  if (req.progress_size() > limits::kMaxProcessesPerNode) {
    return invalid("node " + req.node_id() + " reports the progress of " +
                   std::to_string(req.progress_size()) + " ranks; a node runs at most " +
                   std::to_string(limits::kMaxProcessesPerNode));
  }
  if (req.store_port() < 0 || req.store_port() > 65535) {
    return invalid("node " + req.node_id() + " reports store_port " +
                   std::to_string(req.store_port()) + ", which is not a port");
  }
  it->second.store_port = req.store_port();
  it->second.last_seen = clock_.now();
  it->second.progress.assign(req.progress().begin(), req.progress().end());
  for (auto& p : it->second.progress) limits::cut(p);
  it->second.progress_at = clock_.now();
  fill_sync(it->first, it->second, resp, req.omit_unchanged() ? req.known_version() : 0);
  return RpcStatus::ok();
}

RpcStatus CoordinatorCore::instruction(const std::string& node_id, pb::SyncResponse* resp,
                                       uint64_t omit_if_version) {
  auto it = nodes_.find(node_id);
  if (it == nodes_.end() || it->second.lost)
    return not_found("node " + node_id + " is not registered");
  fill_sync(it->first, it->second, resp, omit_if_version);
  return RpcStatus::ok();
}

std::chrono::milliseconds CoordinatorCore::progress_wait() const {
  // Why: at 16k nodes reporting every 3 s the coordinator spent half a core on progress alone;
  // a report of a large job's speed every 27 s is still fresh for its rates and stragglers.
  const auto spread =
      milliseconds(static_cast<int64_t>(nodes_.size()) * 1000 / kProgressSyncsPerSecond);
  const auto longest = std::max(options_.sync_wait, options_.idle_wait);
  return std::clamp(spread, options_.sync_wait, longest);
}

void CoordinatorCore::poll_started(const std::string& node_id) {
  if (auto it = nodes_.find(node_id); it != nodes_.end()) ++it->second.polls;
}

void CoordinatorCore::poll_ended(const std::string& node_id) {
  auto it = nodes_.find(node_id);
  if (it == nodes_.end()) return;
  Node& node = it->second;
  if (node.polls > 0) --node.polls;
  // Its connection was alive up to dead_connection_within ago at least; a live agent syncs again
  // at once, a dead one is lost a lease after that.
  node.last_seen = std::max(node.last_seen, clock_.now() - options_.dead_connection_within);
  lease_may_lapse_at(node.last_seen + options_.lease);
}

uint64_t CoordinatorCore::node_version(const std::string& node_id) const {
  auto it = nodes_.find(node_id);
  return it == nodes_.end() ? 0 : it->second.version;
}

void CoordinatorCore::node_lost(const std::string& node_id, Node& node, const std::string& why) {
  node.lost = true;
  node.lost_at = clock_.now();
  node_changed(node_id);
  if (node.job_id.empty()) return;
  auto jt = jobs_.find(node.job_id);
  node.job_id.clear();
  if (jt == jobs_.end() || terminal(jt->second)) return;
  Job& job = jt->second;
  if (job.state == pb::JOB_STATE_RENDEZVOUS) {
    auto pos = std::find(job.joined.begin(), job.joined.end(), node_id);
    if (pos != job.joined.end()) {
      job.joined.erase(pos);
      job.joined_ids.erase(node_id);
      if (static_cast<int>(job.joined.size()) < job.spec.min_nodes()) job.min_reached.reset();
      message(job,
              "node " + node_id + " left " + round_name(job.round) + " before it closed: " + why);
    }
    return;
  }
  if (job.state != pb::JOB_STATE_RUNNING) return;
  if (job.rank_of(node_id) < 0) return;
  pb::Failure f;
  f.set_kind(pb::Failure::KIND_NODE_LOST);
  f.set_node_id(node_id);
  f.set_hostname(node.info.hostname());
  f.set_rank(-1);
  f.set_local_rank(-1);
  f.set_message(why);
  auto silent = duration_cast<milliseconds>(clock_.now() - node.last_seen);
  f.set_time_unix_ms(clock_.unix_ms() - silent.count());
  f.set_round(job.round);
  job.failures.push_back(f);
  job.last_failed_round = job.round;
  pb::JobEvent ev;
  *ev.mutable_failure() = f;
  event(job, std::move(ev));
  // Why not counted: a lost node is a membership change (elastic shrink), as in torchelastic.
  restart(job, "node " + node_id + " lost", /*counted=*/false, "node_lost");
}

// ----------------------------------------------------------------------------------- jobs

void CoordinatorCore::open_round(Job& job, const std::string& why) {
  ++job.round;
  job.state = pb::JOB_STATE_RENDEZVOUS;
  job.joined.clear();
  job.joined_ids.clear();
  job.set_members({});
  job.started.clear();
  job.succeeded.clear();
  job.min_reached.reset();
  job.adopt_deadline.reset();
  job.round_opened = clock_.now();
  job.stragglers.reset();
  job.rate_history.clear();
  pb::JobEvent ev;
  ev.set_state(pb::JOB_STATE_RENDEZVOUS);
  event(job, std::move(ev));
  message(job, round_name(job.round) + " open (" + why + "): waiting for " +
                   (job.spec.min_nodes() == job.spec.max_nodes()
                        ? std::to_string(job.spec.min_nodes())
                        : std::to_string(job.spec.min_nodes()) + " to " +
                              std::to_string(job.spec.max_nodes())) +
                   " nodes");
  all_nodes_changed();
}

void CoordinatorCore::close_round(Job& job) {
  std::vector<std::string> order = job.joined;
  // Node rank: a node asking for a machine rank (mode 2) is placed by it; the rest in join order.
  std::stable_sort(order.begin(), order.end(), [this](const std::string& a, const std::string& b) {
    int ra = nodes_.at(a).info.machine_rank();
    int rb = nodes_.at(b).info.machine_rank();
    if (ra < 0) ra = INT32_MAX;
    if (rb < 0) rb = INT32_MAX;
    return ra < rb;
  });
  job.round_members[job.round] = order;
  job.set_members(order);
  const Node& first = nodes_.at(order.front());
  job.master_addr = first.info.address();
  job.master_port = job.spec.master_port() != 0 ? job.spec.master_port() : first.joined_port;
  job.state = pb::JOB_STATE_RUNNING;
  for (auto& [id, node] : nodes_) {
    if (node.job_id == job.id && job.rank_of(id) < 0) {
      node.job_id.clear();  // joined too late or not at all: free again
    }
  }
  pb::JobEvent ev;
  ev.set_state(pb::JOB_STATE_RUNNING);
  event(job, std::move(ev));
  // Why cut: one line of 16k node names would be an event of hundreds of KiB; accel status
  // lists the rest.
  constexpr size_t kNamed = 32;
  std::string names;
  for (size_t i = 0; i < order.size(); ++i) {
    if (i == kNamed - 2 && order.size() > kNamed) {
      names += ", ... (" + std::to_string(order.size() - kNamed + 1) + " more)";
      i = order.size() - 1;
    }
    names += (i ? ", " : "") + std::to_string(i) + "=" + order[i];
  }
  message(job, round_name(job.round) + " closed: " + std::to_string(order.size()) + " node" +
                   (order.size() == 1 ? "" : "s") + " (" + names + "), world size " +
                   std::to_string(static_cast<int>(order.size()) * job.spec.processes_per_node()) +
                   ", MASTER_ADDR=" + job.master_addr +
                   " MASTER_PORT=" + std::to_string(job.master_port) + ", restart " +
                   std::to_string(job.restart_count) + " of " +
                   std::to_string(job.spec.max_restarts()));
  all_nodes_changed();
}

void CoordinatorCore::restart(Job& job, const std::string& why, bool counted,
                              const std::string& cause) {
  if (counted) ++job.restart_count;
  ++job.restarts_by_cause[cause];
  pb::JobEvent ev;
  ev.set_state(pb::JOB_STATE_RESTARTING);
  event(job, std::move(ev));
  std::string budget = counted ? "restart " + std::to_string(job.restart_count) + " of " +
                                     std::to_string(job.spec.max_restarts())
                               : "not counted against max_restarts";
  message(job, "restarting: " + why + " (" + budget + ")");
  open_round(job, why);
}

void CoordinatorCore::end_job(Job& job, pb::JobState state, int32_t exit_code,
                              const std::string& why) {
  job.state = state;
  job.exit_code = exit_code;
  job.end_why = why;
  job.ended_at = clock_.now();
  summarize(job);
  for (auto& [id, node] : nodes_) {
    if (node.job_id == job.id) {
      node.job_id.clear();
      node.last_job_id = job.id;
      node_changed(id);
    } else if (took_part(job, id)) {
      node.last_job_id = job.id;  // it took part in an earlier round (mode 2: it waits to hear)
      node_changed(id);
    }
  }
  if (!why.empty()) message(job, why);
  pb::JobEvent ev;
  ev.set_state(state);
  event(job, std::move(ev));
  all_nodes_changed();  // nodes it held are free for other jobs
}

RpcStatus CoordinatorCore::submit_job(const pb::SubmitJobRequest& req,
                                      pb::SubmitJobResponse* resp) {
  const pb::JobSpec& s = req.spec();
  if (s.argv().empty() || s.argv(0).empty()) return invalid("job spec: argv is empty (no program)");
  if (auto why = limits::check(s); !why.empty()) return invalid("job spec: " + why);
  if (s.max_restarts() < 0) return invalid("job spec: max_restarts must be >= 0");
  if (s.join_timeout_ms() <= 0 || s.last_call_ms() < 0 || s.stop_timeout_ms() <= 0) {
    return invalid(
        "job spec: join_timeout_ms and stop_timeout_ms must be > 0 and last_call_ms >= 0");
  }
  if (!(s.straggler_threshold() == 0 ||
        (s.straggler_threshold() >= 1 && s.straggler_threshold() <= 1e6)) ||
      s.straggler_window_ms() < 0 || s.stall_timeout_ms() < 0) {
    return invalid(
        "job spec: straggler_threshold must be 0 (off) or from 1 to 1e6, and straggler_window_ms "
        "and stall_timeout_ms >= 0");
  }
  if (s.master_port() < 0 || s.master_port() > 65535) {
    return invalid("job spec: master_port " + std::to_string(s.master_port()) + " is not a port");
  }
  std::string id = req.job_id();
  if (id.empty()) {
    do id = "job-" + random_hex(8);
    while (jobs_.contains(id));
  } else if (!valid_id(id)) {
    return invalid("job id " + quoted(id) + " must be 1-128 characters of [A-Za-z0-9._:-]");
  } else if (jobs_.contains(id)) {
    return RpcStatus::error(Code::kAlreadyExists, "job " + id + " exists already (" +
                                                      job_state_name(jobs_.at(id).state) +
                                                      "); choose another --job-id");
  }
  if (!make_room_for_job()) {
    return RpcStatus::error(Code::kResourceExhausted,
                            "the coordinator keeps " + std::to_string(jobs_.size()) +
                                " jobs, its most (coordinator_max_jobs), and none of them has "
                                "ended; try later");
  }
  Job& job = jobs_[id];
  job.id = id;
  job.spec = s;
  job.submitted_order = jobs_submitted_++;
  pb::JobEvent ev;
  ev.set_state(pb::JOB_STATE_PENDING);
  event(job, std::move(ev));
  open_round(job, "submitted" + (s.submitted_by().empty() ? "" : " by " + s.submitted_by()));
  // Why: a free node holding a store port needs no JOIN and no JoinRound; at 16k nodes those
  // were two of the three calls per node of a rendezvous.
  for (auto& [node_id, node] : nodes_) {
    if (job.state != pb::JOB_STATE_RENDEZVOUS) break;  // full: the round closed
    auto_join(node_id, node);
  }
  resp->set_job_id(id);
  return RpcStatus::ok();
}

RpcStatus CoordinatorCore::join_round(const pb::JoinRoundRequest& req) {
  auto nt = nodes_.find(req.node_id());
  if (nt == nodes_.end() || nt->second.lost) {
    return not_found("node " + req.node_id() + " is not registered; register first");
  }
  auto jt = jobs_.find(req.job_id());
  if (jt == jobs_.end()) return not_found("job " + req.job_id() + " does not exist");
  Job& job = jt->second;
  Node& node = nt->second;
  if (req.master_port() < 0 || req.master_port() > 65535) {
    return invalid("master_port " + std::to_string(req.master_port()) + " is not a port");
  }
  if (job.state != pb::JOB_STATE_RENDEZVOUS || req.round() != job.round) {
    return precondition("job " + job.id + " has no open " + round_name(req.round()) +
                        " (it is at " + round_name(job.round) + ", " + job_state_name(job.state) +
                        ")");
  }
  if (!eligible(node, job)) {
    return precondition("node " + req.node_id() + " cannot join job " + job.id +
                        (busy_elsewhere(node, job)
                             ? ": it runs job " + node.job_id
                             : ": it only takes part in job " + node.info.only_job_id()));
  }
  if (node.info.machine_rank() >= job.spec.max_nodes()) {
    return invalid("node " + req.node_id() + " asks for machine_rank " +
                   std::to_string(node.info.machine_rank()) + " but job " + job.id +
                   " has at most " + std::to_string(job.spec.max_nodes()) +
                   " nodes (machine ranks 0.." + std::to_string(job.spec.max_nodes() - 1) + ")");
  }
  if (job.joined_ids.contains(req.node_id())) {
    node.joined_port = req.master_port();
    if (node.auto_joined) {
      node.auto_joined = false;  // it now waits as a node that joined (told JOIN)
      node_changed(req.node_id());
    }
    return RpcStatus::ok();  // a retried join
  }
  if (static_cast<int>(job.joined.size()) >= job.spec.max_nodes()) {
    return precondition(round_name(job.round) + " of job " + job.id + " is full (" +
                        std::to_string(job.spec.max_nodes()) + " nodes)");
  }
  node.auto_joined = false;
  add_to_round(job, req.node_id(), node, req.master_port());
  return RpcStatus::ok();
}

const CoordinatorCore::Job* CoordinatorCore::round_to_join(const Node& node) const {
  const Job* best = nullptr;
  for (const auto& [id, job] : jobs_) {
    if (job.state != pb::JOB_STATE_RENDEZVOUS || !eligible(node, job)) continue;
    if (static_cast<int>(job.joined.size()) >= job.spec.max_nodes()) continue;
    if (best == nullptr || job.submitted_order < best->submitted_order) best = &job;
  }
  return best;
}

bool CoordinatorCore::auto_join(const std::string& node_id, Node& node) {
  if (node.store_port == 0 || node.lost || !node.job_id.empty()) return false;
  const Job* best = round_to_join(node);
  // A machine rank beyond the job's nodes: its JoinRound gets the error that says so.
  if (best == nullptr || node.info.machine_rank() >= best->spec.max_nodes()) return false;
  node.auto_joined = true;
  add_to_round(jobs_.at(best->id), node_id, node, node.store_port);
  return true;
}

void CoordinatorCore::add_to_round(Job& job, const std::string& node_id, Node& node,
                                   int32_t master_port) {
  job.joined.push_back(node_id);
  job.joined_ids.insert(node_id);
  node.job_id = job.id;
  node.joined_round = job.round;
  node.joined_port = master_port;
  node_changed(node_id);
  int n = static_cast<int>(job.joined.size());
  if (n == job.spec.min_nodes()) job.min_reached = clock_.now();
  if (n == job.spec.max_nodes()) {
    close_round(job);  // wakes every node
  } else if (n == job.spec.min_nodes() && job.spec.last_call_ms() > 0) {
    // Why say it: an elastic job then waits last_call with nothing else to show for it.
    message(job, round_name(job.round) + ": " + std::to_string(n) + " of up to " +
                     std::to_string(job.spec.max_nodes()) +
                     " nodes joined, enough to start; waiting up to " +
                     contract::format_duration(milliseconds(job.spec.last_call_ms())) +
                     " (last_call) for more");
  }
}

RpcStatus CoordinatorCore::report_group(const pb::ReportGroupRequest& req) {
  auto nt = nodes_.find(req.node_id());
  if (nt == nodes_.end()) return not_found("node " + req.node_id() + " is not registered");
  auto jt = jobs_.find(req.job_id());
  if (jt == jobs_.end()) return not_found("job " + req.job_id() + " does not exist");
  Job& job = jt->second;
  const Node& node = nt->second;
  if (req.event() == pb::ReportGroupRequest::EVENT_UNSPECIFIED)
    return invalid("report without an event");
  if (req.event() == pb::ReportGroupRequest::EVENT_FAILED && req.failures().empty()) {
    return invalid("a FAILED report must carry at least one failure");
  }
  const size_t per_round = limits::max_failures_per_node_round(job.spec);
  if (static_cast<size_t>(req.failures_size()) > per_round) {
    return invalid("a report of node " + req.node_id() + " carries " +
                   std::to_string(req.failures_size()) + " failures; a node of job " + job.id +
                   " has at most " + std::to_string(per_round));
  }
  // The current round through its index (every node reports it); earlier ones by a scan.
  auto members = job.round_members.find(req.round());
  bool member = req.round() == job.round && !job.members.empty()
                    ? job.rank_of(req.node_id()) >= 0
                    : members != job.round_members.end() &&
                          std::find(members->second.begin(), members->second.end(),
                                    req.node_id()) != members->second.end();
  if (!member) {
    return precondition("node " + req.node_id() + " is not a member of " + round_name(req.round()) +
                        " of job " + job.id);
  }
  bool current = req.round() == job.round && job.state == pb::JOB_STATE_RUNNING &&
                 !(req.event() == pb::ReportGroupRequest::EVENT_FAILED &&
                   job.succeeded.contains(req.node_id()));
  auto record = [&](const pb::Failure& in) {
    // Why a cap: a node that repeats a late report must not grow the job's failures for ever.
    auto& kept = job.failures_kept[{req.round(), req.node_id()}];
    // (A late report past the job's cap is dropped too; the current round's first is always kept,
    // so a failed round has a root cause.)
    if (kept >= per_round || (!current && job.failures.size() >= limits::kMaxFailuresPerJob)) {
      ++job.failures_dropped;
      return;
    }
    ++kept;
    pb::Failure f = in;
    f.set_round(req.round());
    f.set_node_id(req.node_id());
    if (f.hostname().empty()) f.set_hostname(node.info.hostname());
    if (f.kind() == pb::Failure::KIND_UNSPECIFIED) f.set_kind(pb::Failure::KIND_EXIT);
    if (f.kind() == pb::Failure::KIND_HANG) {
      desync_report(job, req.round(), f);
      ++job.hang_reports;
    }
    limits::cut(f);
    job.failures.push_back(f);
    pb::JobEvent ev;
    ev.set_round(req.round());
    *ev.mutable_failure() = std::move(f);
    event(job, std::move(ev));
  };
  if (!current) {
    // A late report of an earlier round: kept (it may be the root cause), nothing else changes.
    if (req.event() != pb::ReportGroupRequest::EVENT_FAILED || req.round() > job.round) {
      return precondition(round_name(req.round()) + " of job " + job.id +
                          " is over (the job is at " + round_name(job.round) + ", " +
                          job_state_name(job.state) + ")");
    }
    for (const auto& f : req.failures()) record(f);
    if (job.state == pb::JOB_STATE_FAILED && req.round() == job.last_failed_round) {
      // An earlier failure arrived late: it is the root cause now, and its code the job's.
      auto root = root_cause(job, job.last_failed_round);
      if (root) job.exit_code = failure_status_code(job.failures[*root]);
      summarize(job);
      mark_job_nodes(job);
    }
    return RpcStatus::ok();
  }
  switch (req.event()) {
    case pb::ReportGroupRequest::EVENT_STARTED:
      job.started.insert(req.node_id());
      if (job.started.size() == job.members.size()) {
        message(job, "all " + std::to_string(job.members.size() * job.spec.processes_per_node()) +
                         " workers of " + round_name(job.round) + " started");
      }
      break;
    case pb::ReportGroupRequest::EVENT_SUCCEEDED:
      job.succeeded.insert(req.node_id());
      if (job.succeeded.size() == job.members.size()) {
        end_job(job, pb::JOB_STATE_SUCCEEDED, 0, "every worker exited 0");
      }
      break;
    case pb::ReportGroupRequest::EVENT_FAILED: {
      for (const auto& f : req.failures()) record(f);
      job.last_failed_round = job.round;
      auto root = root_cause(job, job.round);
      const pb::Failure& cause = job.failures[*root];
      bool port_taken = job.spec.master_port() == 0 &&
                        std::any_of(req.failures().begin(), req.failures().end(), is_port_conflict);
      if (port_taken && job.port_retries < options_.max_port_retries) {
        ++job.port_retries;
        restart(job,
                "MASTER_PORT " + std::to_string(job.master_port) +
                    " was taken before rank 0 could bind it; new round with a new port",
                /*counted=*/false, "port");
      } else if (cause.kind() == pb::Failure::KIND_NETWORK && !cause.before_start()) {
        // Why not counted: the program did nothing wrong, and the next round starts only once
        // its nodes reach each other (a partition that outlasts join_timeout then counts).
        restart(job, describe_failure(cause), /*counted=*/false, "network");
      } else if (job.restart_count < job.spec.max_restarts()) {
        restart(job, describe_failure(cause), /*counted=*/true, failure_cause(cause));
      } else {
        end_job(job, pb::JOB_STATE_FAILED, failure_status_code(cause),
                describe_failure(cause) + "; no restarts left (max_restarts " +
                    std::to_string(job.spec.max_restarts()) + ")");
      }
      break;
    }
    default:
      return invalid("unknown report event " + std::to_string(req.event()));
  }
  return RpcStatus::ok();
}

std::optional<pb::JobState> CoordinatorCore::job_state(const std::string& job_id) const {
  auto jt = jobs_.find(job_id);
  if (jt == jobs_.end()) return std::nullopt;
  return jt->second.state;
}

RpcStatus CoordinatorCore::cancel_job(const pb::CancelJobRequest& req) {
  auto jt = jobs_.find(req.job_id());
  if (jt == jobs_.end()) return not_found("job " + req.job_id() + " does not exist");
  Job& job = jt->second;
  if (req.signal() < 0 || req.signal() > 64) {
    return invalid("signal " + std::to_string(req.signal()) + " is not a signal number");
  }
  if (terminal(job)) {
    return precondition("job " + job.id + " has ended already (" + job_state_name(job.state) + ")");
  }
  int sig = req.signal() == 0 ? 15 : req.signal();
  const char* abbrev = ::sigabbrev_np(sig);
  std::string name = abbrev ? "SIG" + std::string(abbrev) : "signal " + std::to_string(sig);
  end_job(job, pb::JOB_STATE_CANCELLED, 128 + sig,
          "stopped by " + name + " (exit code " + std::to_string(128 + sig) + ")");
  return RpcStatus::ok();
}

// ----------------------------------------------------------------------------------- time

void CoordinatorCore::tick() {
  auto now = clock_.now();
  forget_expired();
  if (now > next_lease_check_) {
    next_lease_check_ = Clock::time_point::max();
    for (auto& [id, node] : nodes_) {
      if (node.lost || node.polls > 0) continue;
      if (now - node.last_seen > options_.lease) {
        ++lease_misses_;
        node_lost(id, node,
                  "no heartbeat for " +
                      std::to_string(duration_cast<milliseconds>(now - node.last_seen).count()) +
                      " ms (lease " + std::to_string(options_.lease.count()) + " ms)");
      } else {
        lease_may_lapse_at(node.last_seen + options_.lease);
      }
    }
  }
  for (auto& [id, job] : jobs_) {
    if (job.state == pb::JOB_STATE_RENDEZVOUS) {
      int n = static_cast<int>(job.joined.size());
      if (n >= job.spec.min_nodes() && job.min_reached &&
          now - *job.min_reached >= milliseconds(job.spec.last_call_ms())) {
        close_round(job);
      } else if (n < job.spec.min_nodes() &&
                 now - job.round_opened >= milliseconds(job.spec.join_timeout_ms())) {
        end_job(job, pb::JOB_STATE_FAILED, 1,
                "only " + std::to_string(n) + " of the " + std::to_string(job.spec.min_nodes()) +
                    " nodes it needs joined " + round_name(job.round) + " within join_timeout (" +
                    std::to_string(job.spec.join_timeout_ms()) + " ms)");
      }
    } else if (job.state == pb::JOB_STATE_RUNNING) {
      if (job.adopt_deadline && now >= *job.adopt_deadline) {
        job.adopt_deadline.reset();
        for (size_t r = 0; r < job.members.size(); ++r) {
          if (!job.members[r].empty()) continue;
          pb::Failure f;
          f.set_kind(pb::Failure::KIND_NODE_LOST);
          f.set_rank(-1);
          f.set_local_rank(-1);
          f.set_message("node rank " + std::to_string(r) +
                        " did not come back after the coordinator restarted");
          f.set_time_unix_ms(clock_.unix_ms());
          f.set_round(job.round);
          job.failures.push_back(f);
          job.last_failed_round = job.round;
        }
        restart(job, "not every node came back after the coordinator restarted", /*counted=*/false,
                "coordinator_restart");
        continue;
      }
      if (static_cast<int>(job.members.size()) >= job.spec.max_nodes() || job.adopt_deadline)
        continue;
      for (const auto& [nid, node] : nodes_) {
        if (node.job_id.empty() && eligible(node, job)) {
          restart(job, "node " + nid + " is waiting to join (elastic grow)", /*counted=*/false,
                  "elastic");
          break;
        }
      }
    }
  }
  if (now - observed_at_ >= std::chrono::seconds(1)) {
    observed_at_ = now;
    for (auto& [id, job] : jobs_) {
      if (job.state == pb::JOB_STATE_RUNNING) observe_progress(job, now);
    }
  }
}

CoordinatorCore::Changes CoordinatorCore::take_changes() {
  Changes out = std::move(changes_);
  changes_ = Changes{};
  return out;
}

}  // namespace accel::coordinator

// CoordinatorCore, what it keeps and shows: a job's events and forwarded output, its failure
// summary and desync reports, status for `accel status`, and the bounds on all of it (retention,
// the node and job caps, stored bytes). The rules that move jobs and nodes are in
// coordinator_core.cpp.
#include <algorithm>
#include <map>
#include <sstream>

#include "agent/coordinator/coordinator_core.h"
#include "agent/coordinator/request_limits.h"

namespace accel::coordinator {

namespace {

using std::chrono::duration_cast;
using std::chrono::milliseconds;

RpcStatus invalid(std::string m) { return RpcStatus::error(Code::kInvalidArgument, std::move(m)); }
RpcStatus not_found(std::string m) { return RpcStatus::error(Code::kNotFound, std::move(m)); }
RpcStatus precondition(std::string m) {
  return RpcStatus::error(Code::kFailedPrecondition, std::move(m));
}

}  // namespace

void CoordinatorCore::event(Job& job, pb::JobEvent ev) {
  ev.set_seq(job.next_seq++);
  ev.set_time_unix_ms(clock_.unix_ms());
  if (ev.round() == 0) ev.set_round(ev.has_failure() ? ev.failure().round() : job.round);
  job.event_bytes += ev.ByteSizeLong();
  job.events.push_back(std::move(ev));
  while (job.events.size() > options_.max_events_per_job ||
         (job.event_bytes > options_.max_event_bytes_per_job && job.events.size() > 1)) {
    job.event_bytes -= job.events.front().ByteSizeLong();
    job.events.pop_front();
  }
  changes_.jobs.insert(job.id);
}

void CoordinatorCore::message(Job& job, const std::string& text) {
  pb::JobEvent ev;
  ev.set_message(text);
  event(job, std::move(ev));
}

void CoordinatorCore::desync_report(const Job& job, int64_t round, pb::Failure& hang) const {
  auto members = job.round_members.find(round);
  if (members == job.round_members.end()) return;
  struct Seen {
    pb::RankProgress p;
    std::string host;
  };
  std::vector<Seen> all;
  bool other_nodes = false;
  for (const auto& id : members->second) {
    auto it = nodes_.find(id);
    if (it == nodes_.end()) continue;
    // Why aged: the ages were measured when the node last synced, up to a sync wait ago.
    auto since = duration_cast<milliseconds>(clock_.now() - it->second.progress_at).count();
    for (const auto& p : it->second.progress) {
      pb::RankProgress aged = p;
      if (!aged.in_flight().empty()) aged.set_in_flight_ms(aged.in_flight_ms() + since);
      if (aged.heartbeat_age_ms() >= 0) aged.set_heartbeat_age_ms(aged.heartbeat_age_ms() + since);
      all.push_back({std::move(aged), it->second.info.hostname() + " (" + id + ")"});
    }
    if (id != hang.node_id() && !it->second.progress.empty()) other_nodes = true;
  }
  if (!other_nodes) return;  // the reporting node's own report already says all there is
  std::sort(all.begin(), all.end(),
            [](const Seen& a, const Seen& b) { return a.p.rank() < b.p.rank(); });
  const Seen* lag = nullptr;
  for (const auto& s : all) {
    bool behind = !lag || s.p.started() < lag->p.started() ||
                  (s.p.started() == lag->p.started() && s.p.in_flight().empty() &&
                   !lag->p.in_flight().empty());
    if (behind) lag = &s;
  }
  auto secs = [](int64_t ms) { return seconds_text(static_cast<double>(ms) / 1000.0); };
  std::string why = "rank " + std::to_string(lag->p.rank()) + " on " + lag->host;
  if (!lag->p.in_flight().empty()) {
    why += " is still in " + lag->p.in_flight() + " since " + secs(lag->p.in_flight_ms());
  } else if (!lag->p.last_finished().empty()) {
    why += " is outside any collective; its last was " + lag->p.last_finished();
  } else {
    why += " has not started any collective";
  }
  std::map<std::string, std::vector<int>> waiting;
  for (const auto& s : all) {
    if (&s != lag && !s.p.in_flight().empty()) waiting[s.p.in_flight()].push_back(s.p.rank());
  }
  for (const auto& [op, ranks] : waiting) {
    std::string list;
    for (int r : ranks) list += (list.empty() ? "" : ",") + std::to_string(r);
    why += "; rank" + std::string(ranks.size() > 1 ? "s " : " ") + list +
           (ranks.size() > 1 ? " wait in " : " waits in ") + op;
  }
  std::string report = hang.report() + "job-wide, from every agent's last sync:\n";
  for (const auto& s : all) {
    std::string line = "  rank " + std::to_string(s.p.rank()) + " on " + s.host + ": ";
    if (!s.p.in_flight().empty()) {
      line += "in " + s.p.in_flight() + " for " + secs(s.p.in_flight_ms());
    } else if (!s.p.last_finished().empty()) {
      line += "outside any collective; last " + s.p.last_finished();
    } else {
      line += "no collective yet";
    }
    if (s.p.heartbeat_age_ms() >= 0)
      line += "; last heartbeat " + secs(s.p.heartbeat_age_ms()) + " ago";
    if (&s == lag) line += "   <- lagging";
    report += line + "\n";
  }
  hang.set_rank(lag->p.rank());
  hang.set_message(why);
  hang.set_report(report);
}

void CoordinatorCore::summarize(Job& job) {
  const std::string& why = job.end_why;
  if (job.state == pb::JOB_STATE_FAILED) {
    job.summary = format_failure_summary(
        job.id, job.failures, job.last_failed_round, root_cause(job, job.last_failed_round),
        job.spec.argv().empty() ? std::string() : job.spec.argv(0));
    job.summary = "accel: job " + job.id + " FAILED with exit code " +
                  std::to_string(job.exit_code) + (why.empty() ? "" : ": " + why) + "\n" +
                  job.summary;
  } else if (job.state == pb::JOB_STATE_CANCELLED) {
    job.summary =
        "accel: job " + job.id + " was cancelled" + (why.empty() ? "" : ": " + why) + "\n";
  }
}

std::optional<size_t> CoordinatorCore::root_cause(const Job& job, int64_t round) const {
  std::optional<size_t> best;
  for (size_t i = 0; i < job.failures.size(); ++i) {
    const auto& f = job.failures[i];
    if (f.round() != round) continue;
    if (!best || f.time_unix_ms() < job.failures[*best].time_unix_ms()) best = i;
  }
  return best;
}

RpcStatus CoordinatorCore::push_logs(const pb::PushLogsRequest& req) {
  auto jt = jobs_.find(req.job_id());
  if (jt == jobs_.end()) return not_found("job " + req.job_id() + " does not exist");
  if (!nodes_.contains(req.node_id()))
    return not_found("node " + req.node_id() + " is not registered");
  Job& job = jt->second;
  if (!job.spec.forward_logs()) return precondition("job " + job.id + " does not forward logs");
  if (!took_part(job, req.node_id())) {
    return precondition("node " + req.node_id() + " takes no part in job " + job.id +
                        "; it cannot push its logs");
  }
  if (static_cast<size_t>(req.lines_size()) > limits::kMaxLinesPerPush) {
    return invalid("a push of " + std::to_string(req.lines_size()) + " lines; the most is " +
                   std::to_string(limits::kMaxLinesPerPush));
  }
  std::vector<pb::JobEvent> incoming;
  size_t incoming_bytes = 0;
  for (const auto& line : req.lines()) {
    pb::JobEvent& ev = incoming.emplace_back();
    *ev.mutable_log() = line;
    limits::cut(*ev.mutable_log());
    incoming_bytes += ev.ByteSizeLong() + 16;  // + seq, time and round, set by event()
  }
  if (would_drop_unread(job, incoming.size(), incoming_bytes)) {
    // Why refuse rather than drop: the watching launcher is alive and reading, only slower than
    // the workers write; the node keeps the lines and retries, so none is lost and this
    // coordinator's memory stays bounded.
    return RpcStatus::error(
        Code::kResourceExhausted,
        "job " + job.id + ": the launcher watching it has not read its output yet; retry");
  }
  for (auto& ev : incoming) event(job, std::move(ev));
  return RpcStatus::ok();
}

bool CoordinatorCore::would_drop_unread(const Job& job, size_t count, size_t bytes) const {
  if (!job.watcher_until || clock_.now() >= *job.watcher_until) return false;
  size_t events = job.events.size() + count;
  size_t total = job.event_bytes + bytes;
  // Pop the events the watcher has read, oldest first, as event() would; an unread one to pop
  // means a line lost.
  for (const auto& ev : job.events) {
    if (events <= options_.max_events_per_job && total <= options_.max_event_bytes_per_job) {
      return false;
    }
    if (ev.seq() > job.watched_through) return true;
    --events;
    total -= ev.ByteSizeLong();
  }
  return false;  // a push larger than the whole bound: nothing unread is left to lose
}

RpcStatus CoordinatorCore::watch_job(const pb::WatchJobRequest& req, pb::WatchJobResponse* resp) {
  auto jt = jobs_.find(req.job_id());
  if (jt == jobs_.end()) {
    return not_found("job " + req.job_id() + " does not exist on coordinator " +
                     options_.coordinator_id);
  }
  Job& job = jt->second;
  job.watched_through = std::max(job.watched_through, req.after_seq());
  auto until = clock_.now() +
               std::clamp(milliseconds(req.wait_ms()), milliseconds(0), milliseconds(60'000)) +
               options_.watcher_grace;
  if (!job.watcher_until || until > *job.watcher_until) job.watcher_until = until;
  resp->set_coordinator_id(options_.coordinator_id);
  resp->set_state(job.state);
  // Why both bounds: a reply must stay far under the 4 MiB message limit (64 KiB log lines).
  constexpr size_t kMaxBatch = 2000;
  constexpr size_t kMaxBatchBytes = 2u << 20;
  uint64_t first = job.events.empty() ? job.next_seq : job.events.front().seq();
  if (req.after_seq() + 1 < first) resp->set_dropped(first - req.after_seq() - 1);
  size_t start = req.after_seq() < first ? 0 : static_cast<size_t>(req.after_seq() + 1 - first);
  size_t bytes = 0;
  for (size_t i = start; i < job.events.size() && resp->events_size() < static_cast<int>(kMaxBatch);
       ++i) {
    bytes += job.events[i].ByteSizeLong();
    if (bytes > kMaxBatchBytes && resp->events_size() > 0) break;
    *resp->add_events() = job.events[i];
  }
  uint64_t last = resp->events().empty() ? req.after_seq() : resp->events().rbegin()->seq();
  if (terminal(job) && last + 1 >= job.next_seq) {
    resp->set_done(true);
    auto* out = resp->mutable_outcome();
    out->set_job_id(job.id);
    out->set_state(job.state);
    out->set_exit_code(job.exit_code);
    out->set_summary(job.summary);
  }
  return RpcStatus::ok();
}

uint64_t CoordinatorCore::last_event_seq(const std::string& job_id) const {
  auto jt = jobs_.find(job_id);
  return jt == jobs_.end() ? 0 : jt->second.next_seq - 1;
}

void CoordinatorCore::get_status(pb::GetStatusResponse* resp) const {
  resp->set_coordinator_id(options_.coordinator_id);
  auto now = clock_.now();
  for (const auto& [id, node] : nodes_) {
    auto* n = resp->add_nodes();
    n->set_node_id(id);
    n->set_hostname(node.info.hostname());
    n->set_address(node.info.address());
    n->set_job_id(node.job_id);
    n->set_node_rank(-1);
    n->set_lost(node.lost);
    n->set_last_seen_ms_ago(duration_cast<milliseconds>(node.silent(now)).count());
    auto jt = jobs_.find(node.job_id);
    if (jt != jobs_.end()) {
      if (const int rank = jt->second.rank_of(id); rank >= 0) n->set_node_rank(rank);
    }
  }
  // The most recent jobs only, each with its command line cut: a reply stays far below the
  // message limit whatever was submitted.
  std::vector<const Job*> recent;
  for (const auto& [id, job] : jobs_) recent.push_back(&job);
  std::sort(recent.begin(), recent.end(),
            [](const Job* a, const Job* b) { return a->submitted_order > b->submitted_order; });
  if (recent.size() > limits::kStatusJobs) recent.resize(limits::kStatusJobs);
  std::sort(recent.begin(), recent.end(),
            [](const Job* a, const Job* b) { return a->submitted_order < b->submitted_order; });
  for (const Job* jp : recent) {
    const Job& job = *jp;
    const std::string& id = job.id;
    auto* j = resp->add_jobs();
    j->set_job_id(id);
    j->set_state(job.state);
    j->set_round(job.round);
    j->set_restart_count(job.restart_count);
    j->set_max_restarts(job.spec.max_restarts());
    j->set_num_nodes(static_cast<int>(job.members.size()));
    j->set_world_size(static_cast<int>(job.members.size()) * job.spec.processes_per_node());
    j->set_exit_code(job.exit_code);
    *j->mutable_spec() = job.spec;
    j->mutable_spec()->clear_extra_env();
    size_t argv_bytes = 0;
    auto* argv = j->mutable_spec()->mutable_argv();
    for (int k = 0; k < argv->size(); ++k) {
      argv_bytes += argv->Get(k).size();
      if (argv_bytes > limits::kStatusArgvBytes) {
        argv->DeleteSubrange(k, argv->size() - k);
        break;
      }
    }
    for (const auto& m : job.members) j->add_node_ids(m);
    if (auto root = root_cause(job, job.last_failed_round))
      *j->mutable_last_failure() = job.failures[*root];
  }
}

bool CoordinatorCore::took_part(const Job& job, const std::string& node_id) const {
  if (job.joined_ids.contains(node_id)) return true;
  return std::any_of(job.round_members.begin(), job.round_members.end(), [&](const auto& rm) {
    return std::find(rm.second.begin(), rm.second.end(), node_id) != rm.second.end();
  });
}

bool CoordinatorCore::make_room_for_job() {
  if (jobs_.size() < options_.max_jobs) return true;
  auto oldest = jobs_.end();
  for (auto it = jobs_.begin(); it != jobs_.end(); ++it) {
    if (terminal(it->second) &&
        (oldest == jobs_.end() || *it->second.ended_at < *oldest->second.ended_at))
      oldest = it;
  }
  if (oldest == jobs_.end()) return false;
  jobs_.erase(oldest);
  return true;
}

bool CoordinatorCore::make_room_for_node() {
  if (nodes_.size() < options_.max_nodes) return true;
  auto oldest = nodes_.end();
  for (auto it = nodes_.begin(); it != nodes_.end(); ++it) {
    if (it->second.lost && (oldest == nodes_.end() || it->second.lost_at < oldest->second.lost_at))
      oldest = it;
  }
  if (oldest == nodes_.end()) return false;
  nodes_.erase(oldest);
  return true;
}

void CoordinatorCore::forget_expired() {
  auto now = clock_.now();
  std::erase_if(jobs_, [&](const auto& kv) {
    return terminal(kv.second) && kv.second.ended_at &&
           now - *kv.second.ended_at > options_.retention;
  });
  std::erase_if(nodes_, [&](const auto& kv) {
    return kv.second.lost && now - kv.second.lost_at > options_.retention;
  });
}

size_t CoordinatorCore::stored_bytes() const {
  size_t total = 0;
  for (const auto& [id, node] : nodes_) {
    total += id.size() + node.info.ByteSizeLong() + node.sent.size() + node.job_id.size() +
             node.last_job_id.size() + node.told_job_id.size();
    for (const auto& p : node.progress) total += p.ByteSizeLong();
  }
  for (const auto& [id, job] : jobs_) {
    total += id.size() + job.spec.ByteSizeLong() + job.event_bytes + job.summary.size() +
             job.end_why.size();
    for (const auto& f : job.failures) total += f.ByteSizeLong();
    for (const auto& [round, members] : job.round_members) {
      for (const auto& m : members) total += m.size();
    }
  }
  return total;
}

}  // namespace accel::coordinator

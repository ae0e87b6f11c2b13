// What the coordinator measures: the ranks' speed (stragglers, stalls, the page's rate history)
// and its metrics. Everything here reads state the core keeps anyway; only observe_progress,
// once a second, adds to it.
#include <algorithm>
#include <cctype>

#include "agent/coordinator/coordinator_core.h"
#include "agent/metrics/exposition.h"

namespace accel::coordinator {

using metrics::Type;
using std::chrono::duration_cast;
using std::chrono::milliseconds;

std::string job_state_label(pb::JobState s) {
  std::string name = job_state_name(s);
  std::transform(name.begin(), name.end(), name.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return name;
}

std::vector<RankReport> CoordinatorCore::rank_reports(const Job& job, Clock::time_point now) const {
  std::vector<RankReport> out;
  for (const auto& id : job.members) {
    if (id.empty()) continue;
    auto it = nodes_.find(id);
    if (it == nodes_.end() || it->second.lost) continue;
    auto age = duration_cast<milliseconds>(now - it->second.progress_at);
    for (const auto& p : it->second.progress) out.push_back({&p, id, age});
  }
  return out;
}

void CoordinatorCore::observe_progress(Job& job, Clock::time_point now) {
  auto reports = rank_reports(job, now);
  if (reports.empty()) return;
  StragglerOptions o;
  o.threshold = job.spec.straggler_threshold();
  o.window = milliseconds(job.spec.straggler_window_ms());
  o.stall_timeout = milliseconds(job.spec.stall_timeout_ms());
  for (auto& r : job.stragglers.update(reports, now, o)) {
    ++(r.stall ? job.stall_reports : job.straggler_reports);
    message(job, r.line);
  }
  if (now - job.history_at < kHistoryStep) return;
  job.history_at = now;
  for (const auto& r : reports) {
    int rank = r.progress->rank();
    if (rank < 0 || rank >= kHistoryRanks) continue;
    auto& h = job.rate_history[rank];
    h.push_back(static_cast<float>(r.progress->has_rate() ? r.progress->steps_per_second() : 0));
    while (h.size() > kHistoryLength) h.pop_front();
  }
}

void CoordinatorCore::write_metrics(metrics::Exposition& out) const {
  const pb::JobState states[] = {pb::JOB_STATE_PENDING,   pb::JOB_STATE_RENDEZVOUS,
                                 pb::JOB_STATE_RUNNING,   pb::JOB_STATE_RESTARTING,
                                 pb::JOB_STATE_SUCCEEDED, pb::JOB_STATE_FAILED,
                                 pb::JOB_STATE_CANCELLED};
  out.family("accel_coordinator_jobs", Type::kGauge, "Jobs the coordinator keeps, by state.");
  for (auto s : states) {
    auto n = std::count_if(jobs_.begin(), jobs_.end(),
                           [s](const auto& j) { return j.second.state == s; });
    out.sample("accel_coordinator_jobs", {{"state", job_state_label(s)}}, static_cast<double>(n));
  }
  double idle = 0, busy = 0, lost = 0;
  for (const auto& [id, node] : nodes_) {
    if (node.lost) {
      ++lost;
    } else if (node.job_id.empty()) {
      ++idle;
    } else {
      ++busy;
    }
  }
  out.family("accel_coordinator_nodes", Type::kGauge,
             "Registered nodes: idle (in no job), busy (in a job), lost (lease lapsed, kept for "
             "the retention).");
  out.sample("accel_coordinator_nodes", {{"state", "idle"}}, idle);
  out.sample("accel_coordinator_nodes", {{"state", "busy"}}, busy);
  out.sample("accel_coordinator_nodes", {{"state", "lost"}}, lost);
  out.single("accel_coordinator_lease_misses_total", Type::kCounter,
             "Nodes lost because they did not sync within the lease.",
             static_cast<double>(lease_misses_));

  out.family("accel_job_rounds_total", Type::kCounter, "Rendezvous rounds opened per job.");
  for (const auto& [id, job] : jobs_)
    out.sample("accel_job_rounds_total", {{"job_id", id}}, static_cast<double>(job.round + 1));

  // Why the usual causes always: a series that appears only at its first restart hides that
  // restart from increase() and rate().
  static const char* kUsualCauses[] = {"exit", "signal", "hang", "node_lost", "network"};
  out.family("accel_job_restarts_total", Type::kCounter,
             "Whole-group restarts per job by cause (exit, signal, hang, spawn, network, "
             "node_lost, port, agent_restart, coordinator_restart, elastic); counted or not "
             "against max_restarts.");
  for (const auto& [id, job] : jobs_) {
    std::map<std::string, uint64_t> causes = job.restarts_by_cause;
    for (const char* c : kUsualCauses) causes.try_emplace(c, 0);
    for (const auto& [cause, n] : causes)
      out.sample("accel_job_restarts_total", {{"job_id", id}, {"cause", cause}},
                 static_cast<double>(n));
  }
  out.family("accel_job_restarts_counted", Type::kGauge,
             "Restarts counted against the job's max_restarts so far.");
  for (const auto& [id, job] : jobs_)
    out.sample("accel_job_restarts_counted", {{"job_id", id}}, job.restart_count);
  out.family("accel_job_max_restarts", Type::kGauge, "The job's max_restarts.");
  for (const auto& [id, job] : jobs_)
    out.sample("accel_job_max_restarts", {{"job_id", id}}, job.spec.max_restarts());

  auto per_job_counter = [&](const char* name, const char* help, auto field) {
    out.family(name, Type::kCounter, help);
    for (const auto& [id, job] : jobs_)
      out.sample(name, {{"job_id", id}}, static_cast<double>(job.*field));
  };
  per_job_counter("accel_job_hang_reports_total",
                  "Hangs reported by the job's nodes (each with a desync report).",
                  &Job::hang_reports);
  per_job_counter("accel_job_straggler_reports_total",
                  "Ranks reported as stragglers (compute per step over straggler_threshold times "
                  "the median for straggler_window).",
                  &Job::straggler_reports);
  per_job_counter("accel_job_stall_reports_total",
                  "Stalls reported: a rank without a step for stall_timeout.", &Job::stall_reports);

  auto now = clock_.now();
  out.family("accel_job_world_size", Type::kGauge, "Ranks of the job's current round.");
  out.family("accel_job_steps_per_second", Type::kGauge,
             "Steps per second of the running job's ranks over the agents' last ~20 s: the "
             "slowest, median and fastest rank.");
  out.family("accel_job_stragglers", Type::kGauge, "Ranks of the job flagged as stragglers now.");
  out.family("accel_rank_straggler", Type::kGauge,
             "1 for each rank flagged as a straggler now (at most 64 per job).");
  out.family("accel_rank_straggler_ratio", Type::kGauge,
             "A flagged rank's compute time per step over the median of the other ranks'.");
  for (const auto& [id, job] : jobs_) {
    if (terminal(job)) continue;
    out.sample("accel_job_world_size", {{"job_id", id}},
               static_cast<double>(job.members.size()) * job.spec.processes_per_node());
    if (job.state != pb::JOB_STATE_RUNNING) continue;
    std::vector<double> rates;
    std::map<int, std::string> node_of;
    for (const auto& r : rank_reports(job, now)) {
      if (r.progress->has_rate()) rates.push_back(r.progress->steps_per_second());
      node_of[r.progress->rank()] = r.node;
    }
    if (!rates.empty()) {
      auto [lo, hi] = std::minmax_element(rates.begin(), rates.end());
      out.sample("accel_job_steps_per_second", {{"job_id", id}, {"stat", "min"}}, *lo);
      out.sample("accel_job_steps_per_second", {{"job_id", id}, {"stat", "median"}}, median(rates));
      out.sample("accel_job_steps_per_second", {{"job_id", id}, {"stat", "max"}}, *hi);
    }
    const auto& flagged = job.stragglers.flagged();
    out.sample("accel_job_stragglers", {{"job_id", id}}, static_cast<double>(flagged.size()));
    int shown = 0;
    for (const auto& [rank, ratio] : flagged) {
      if (++shown > 64) break;  // Why: bounded cardinality, however many ranks are slow
      metrics::Labels l = {{"job_id", id}, {"rank", std::to_string(rank)}, {"node", node_of[rank]}};
      out.sample("accel_rank_straggler", l, 1);
      out.sample("accel_rank_straggler_ratio", l, ratio);
    }
  }
  out.single("accel_coordinator_stored_bytes", Type::kGauge,
             "Serialized bytes of what the coordinator keeps for its nodes and jobs.",
             static_cast<double>(stored_bytes()));
}

}  // namespace accel::coordinator

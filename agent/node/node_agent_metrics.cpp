// What a node agent says about its workers: the progress it sends with each sync, its metrics
// and its page. Read from the progress pages (as of the watch's last read, once a second) and
// from /proc at the moment of the scrape.
#include <unistd.h>

#include <array>
#include <cstdio>
#include <map>
#include <optional>

#include "agent/metrics/exposition.h"
#include "agent/metrics/html.h"
#include "agent/metrics/proc_stat.h"
#include "agent/node/node_agent_active.h"
#include "agent/supervisor/hang_monitor.h"

namespace accel::node {

using metrics::Type;

namespace {

double seconds_between(std::uint64_t later_ns, std::uint64_t earlier_ns) {
  return later_ns > earlier_ns ? static_cast<double>(later_ns - earlier_ns) / 1e9 : 0;
}

}  // namespace

void NodeAgent::fill_progress(pb::SyncRequest& req) const {
  const supervisor::HangWatch* watch =
      active_ && active_->attempt ? active_->attempt->hang_watch() : nullptr;
  if (watch == nullptr) return;
  auto now = watch->latest_ns();
  auto ms = [now](std::uint64_t t) {
    return static_cast<int64_t>(now > t ? (now - t) / 1'000'000 : 0);
  };
  for (const auto& v : watch->latest()) {
    if (!v.valid) continue;
    auto* p = req.add_progress();
    p->set_rank(v.rank);
    p->set_started(v.started);
    if (v.in_flight) {
      p->set_in_flight(v.in_flight->op + " #" + std::to_string(v.in_flight->seq));
      p->set_in_flight_ms(ms(v.in_flight->start_ns));
    }
    if (v.last_finished)
      p->set_last_finished(v.last_finished->op + " #" + std::to_string(v.last_finished->seq));
    p->set_heartbeat_age_ms(v.heartbeat_ns == 0 ? -1 : ms(v.heartbeat_ns));
    p->set_steps(v.steps);
    p->set_step_age_ms(v.last_step_ns == 0 ? -1 : ms(v.last_step_ns));
    if (auto r = watch->rates().rate(v.rank)) {
      p->set_has_rate(true);
      p->set_steps_per_second(r->steps_per_second);
      p->set_compute_seconds_per_step(r->compute_seconds_per_step);
      p->set_wait_seconds_per_step(r->wait_seconds_per_step);
    }
  }
}

void NodeAgent::write_metrics(metrics::Exposition& out) const {
  const std::string& node = options_.node_id;
  out.family("accel_agent_registered", Type::kGauge,
             "1 while the agent is registered with its coordinator.");
  out.sample("accel_agent_registered", {{"node", node}}, registered_ ? 1 : 0);
  out.family("accel_agent_worker_groups_started_total", Type::kCounter,
             "Worker groups this agent spawned (one per round it ran).");
  out.sample("accel_agent_worker_groups_started_total", {{"node", node}},
             static_cast<double>(groups_started_));
  out.family("accel_agent_coordinator_lost_total", Type::kCounter,
             "Times the coordinator was silent past the lease while workers ran (they were "
             "stopped).");
  out.sample("accel_agent_coordinator_lost_total", {{"node", node}},
             static_cast<double>(coordinator_lost_));
  out.family("accel_agent_hang_reports_total", Type::kCounter,
             "Hangs this agent detected in its workers' progress pages.");
  out.sample("accel_agent_hang_reports_total", {{"node", node}}, static_cast<double>(hangs_seen_));
  out.family("accel_agent_log_lines_forwarded_total", Type::kCounter,
             "Worker output lines handed to the coordinator for watching launchers.");
  out.sample("accel_agent_log_lines_forwarded_total", {{"node", node}},
             static_cast<double>(lines_forwarded_));
  out.family("accel_agent_log_lines_dropped_total", Type::kCounter,
             "Forwarded lines the coordinator refused for good (they are in the rank logs).");
  out.sample("accel_agent_log_lines_dropped_total", {{"node", node}},
             static_cast<double>(lines_not_forwarded_));

  const supervisor::Attempt* attempt = active_ ? active_->attempt.get() : nullptr;
  auto workers = attempt ? attempt->running_workers() : std::vector<std::pair<int, pid_t>>{};
  out.family("accel_agent_workers", Type::kGauge,
             "This node's worker processes: running, or stopping (being stopped by the agent).");
  bool stopping = attempt && attempt->stopping();
  out.sample("accel_agent_workers", {{"node", node}, {"state", "running"}},
             stopping ? 0 : static_cast<double>(workers.size()));
  out.sample("accel_agent_workers", {{"node", node}, {"state", "stopping"}},
             stopping ? static_cast<double>(workers.size()) : 0);

  // The store this node serves, when it is a job's node rank 0.
  store::StoreServer::Traffic traffic;
  double connections = 0;
  for (const auto* s :
       {active_ ? active_->store.get() : nullptr, job_store_.get(), reserved_store_.get()}) {
    if (s == nullptr) continue;
    connections += static_cast<double>(s->connections());
    traffic.connections += s->traffic().connections;
    traffic.received_bytes += s->traffic().received_bytes;
    traffic.sent_bytes += s->traffic().sent_bytes;
  }
  out.single("accel_store_connections", Type::kGauge,
             "Open connections to the rendezvous store this node serves.", connections);
  out.single("accel_store_connections_total", Type::kCounter,
             "Connections the store accepted (the current stores' lifetime).",
             static_cast<double>(traffic.connections));
  out.single("accel_store_received_bytes_total", Type::kCounter,
             "Bytes the store received from workers.", static_cast<double>(traffic.received_bytes));
  out.single("accel_store_sent_bytes_total", Type::kCounter, "Bytes the store sent to workers.",
             static_cast<double>(traffic.sent_bytes));

  // Per rank: the progress pages, then /proc. A series is written only once it has a value.
  enum Series : size_t {
    kStep,
    kRate,
    kSinceStep,
    kCompute,
    kWait,
    kCollectives,
    kHeartbeat,
    kCheckpointAge,
    kCheckpointBytes,
    kCheckpointDuration,
    kMemory,
    kCpu,
    kSeriesCount
  };
  struct Family {
    const char* name;
    Type type;
    const char* help;
  };
  static constexpr Family kFamilies[kSeriesCount] = {
      {"accel_rank_step", Type::kGauge,
       "The rank's step count (libaccel's synchronizing optimizer steps; a resumed run continues "
       "its count)."},
      {"accel_rank_steps_per_second", Type::kGauge, "Steps per second over the last ~20 s."},
      {"accel_rank_seconds_since_step", Type::kGauge, "Seconds since the rank's last step."},
      {"accel_rank_compute_seconds_per_step", Type::kGauge,
       "Wall time per step outside collectives over the last ~20 s."},
      {"accel_rank_collective_wait_seconds_total", Type::kCounter,
       "Time the rank spent blocked in collectives."},
      {"accel_rank_collectives_total", Type::kCounter, "Collectives the rank started."},
      {"accel_rank_heartbeat_age_seconds", Type::kGauge,
       "Seconds since the rank's last sign of life (a batch, a collective, a step)."},
      {"accel_rank_checkpoint_age_seconds", Type::kGauge,
       "Seconds since the rank's last complete checkpoint (rank 0 writes them)."},
      {"accel_rank_checkpoint_bytes", Type::kGauge, "Size of the last complete checkpoint."},
      {"accel_rank_checkpoint_duration_seconds", Type::kGauge,
       "How long the last checkpoint took, from save_state() to its files in place."},
      {"accel_worker_resident_memory_bytes", Type::kGauge, "The worker process's resident memory."},
      {"accel_worker_cpu_seconds_total", Type::kCounter, "The worker process's CPU time."},
  };
  std::map<int, std::array<std::optional<double>, kSeriesCount>> ranks;
  if (const supervisor::HangWatch* watch = attempt ? attempt->hang_watch() : nullptr) {
    auto now = watch->latest_ns();
    for (const auto& v : watch->latest()) {
      if (!v.valid) continue;
      auto& r = ranks[v.rank];
      r[kStep] = static_cast<double>(v.steps);
      if (auto rate = watch->rates().rate(v.rank)) {
        r[kRate] = rate->steps_per_second;
        r[kCompute] = rate->compute_seconds_per_step;
      }
      if (v.last_step_ns != 0) r[kSinceStep] = seconds_between(now, v.last_step_ns);
      r[kWait] = static_cast<double>(v.collective_wait_ns) / 1e9;
      r[kCollectives] = static_cast<double>(v.started);
      if (v.heartbeat_ns != 0) r[kHeartbeat] = seconds_between(now, v.heartbeat_ns);
      if (v.checkpoint_ns != 0) {
        r[kCheckpointAge] = seconds_between(now, v.checkpoint_ns);
        r[kCheckpointBytes] = static_cast<double>(v.checkpoint_bytes);
        r[kCheckpointDuration] = static_cast<double>(v.checkpoint_duration_ns) / 1e9;
      }
    }
  }
  // Every running worker's memory and CPU, libaccel or not.
  for (const auto& [rank, pid] : workers) {
    if (auto usage = metrics::read_proc_stat(pid)) {
      ranks[rank][kMemory] = usage->resident_bytes;
      ranks[rank][kCpu] = usage->cpu_seconds;
    }
  }
  const std::string job = active_ ? active_->job_id : "";
  for (size_t i = 0; i < kSeriesCount; ++i) {
    out.family(kFamilies[i].name, kFamilies[i].type, kFamilies[i].help);
    for (const auto& [rank, values] : ranks) {
      if (values[i])
        out.sample(kFamilies[i].name,
                   {{"job_id", job}, {"rank", std::to_string(rank)}, {"node", node}}, *values[i]);
    }
  }
}

std::string NodeAgent::status_page(int refresh_s) const {
  metrics::Exposition m;
  write_metrics(m);
  std::string h = metrics::page_head("accel: node " + options_.node_id, refresh_s);
  h += "<h1>accel node <code>" + metrics::html_escape(options_.node_id) + "</code></h1>\n<p>" +
       metrics::html_escape(state_text()) +
       "; <a href=\"/metrics\">metrics</a> (the coordinator's page shows the whole job)</p>\n";
  h += "<pre class=\"metrics\">" + metrics::html_escape(m.text()) + "</pre>\n</body></html>\n";
  return h;
}

}  // namespace accel::node

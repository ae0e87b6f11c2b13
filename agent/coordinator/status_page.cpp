// The coordinator's status page (CoordinatorCore::status_page): one HTML document, rebuilt on
// each request from what the core keeps; bounded whatever the cluster's size.
#include <algorithm>
#include <cstdio>

#include "agent/coordinator/coordinator_core.h"
#include "agent/metrics/html.h"

namespace accel::coordinator {

using metrics::html_escape;
using std::chrono::duration_cast;
using std::chrono::milliseconds;

namespace {

constexpr size_t kPageNodes = 500;  // node rows; the rest are counted
constexpr int kPageRanks = 256;     // rank rows per job; stragglers always shown
constexpr size_t kPageJobs = 20;    // job sections: running ones first, then the latest
constexpr size_t kPageEvents = 20;  // the last messages per job

std::string num(double v, int digits) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string ago(milliseconds d) {
  if (d.count() < 0) return "";
  if (d.count() < 10'000) return num(static_cast<double>(d.count()) / 1000, 1) + " s";
  return std::to_string(d.count() / 1000) + " s";
}

}  // namespace

std::string CoordinatorCore::status_page(int refresh_s) const {
  auto now = clock_.now();
  std::string id = options_.coordinator_id;
  std::string h = metrics::page_head("accel: coordinator " + id, refresh_s);
  h += "<h1>accel coordinator <code>" + html_escape(id) + "</code></h1>\n<p><small>" +
       metrics::utc_time(clock_.unix_ms()) +
       (refresh_s > 0 ? "; this page reloads every " + std::to_string(refresh_s) + " s" : "") +
       "; <a href=\"/metrics\">metrics</a></small></p>\n";

  // Jobs: every one kept, newest first.
  std::vector<const Job*> jobs;
  for (const auto& [jid, job] : jobs_) jobs.push_back(&job);
  std::sort(jobs.begin(), jobs.end(),
            [](const Job* a, const Job* b) { return a->submitted_order > b->submitted_order; });
  h += "<h2>Jobs</h2>\n<table id=\"jobs\"><tr><th>job</th><th>state</th><th>round</th>"
       "<th>restarts</th><th>nodes</th><th>ranks</th><th>steps/s (median)</th>"
       "<th>stragglers</th><th>submitted by</th></tr>\n";
  for (const Job* j : jobs) {
    std::string state = job_state_label(j->state);
    std::vector<double> rates;
    if (j->state == pb::JOB_STATE_RUNNING) {
      for (const auto& r : rank_reports(*j, now))
        if (r.progress->has_rate()) rates.push_back(r.progress->steps_per_second());
    }
    h += "<tr class=\"job\" data-job=\"" + html_escape(j->id) + "\" data-state=\"" + state +
         "\"><td><a href=\"#job-" + html_escape(j->id) + "\">" + html_escape(j->id) +
         "</a></td><td class=\"state-" + state + "\">" + state + "</td><td class=\"num\">" +
         std::to_string(std::max<int64_t>(j->round, 0)) + "</td><td class=\"num\">" +
         std::to_string(j->restart_count) + " of " + std::to_string(j->spec.max_restarts()) +
         "</td><td class=\"num\">" + std::to_string(j->members.size()) + "</td><td class=\"num\">" +
         std::to_string(j->members.size() * static_cast<size_t>(j->spec.processes_per_node())) +
         "</td><td class=\"num\">" + (rates.empty() ? "" : num(median(rates), 2)) +
         "</td><td class=\"num\">" + std::to_string(j->stragglers.flagged().size()) + "</td><td>" +
         html_escape(j->spec.submitted_by()) + "</td></tr>\n";
  }
  h += "</table>\n";

  // Nodes: busy first, then idle, then lost; at most kPageNodes rows.
  std::vector<std::pair<int, const std::string*>> order;
  for (const auto& [nid, node] : nodes_)
    order.emplace_back(node.lost ? 2 : node.job_id.empty() ? 1 : 0, &nid);
  std::stable_sort(order.begin(), order.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  h += "<h2>Nodes</h2>\n<table id=\"nodes\"><tr><th>node</th><th>state</th><th>host</th>"
       "<th>address</th><th>job</th><th>node rank</th><th>last seen</th></tr>\n";
  for (size_t i = 0; i < order.size() && i < kPageNodes; ++i) {
    const std::string& nid = *order[i].second;
    const Node& node = nodes_.at(nid);
    std::string state = node.lost ? "lost" : node.job_id.empty() ? "idle" : "busy";
    int rank = -1;
    if (auto jt = jobs_.find(node.job_id); jt != jobs_.end()) rank = jt->second.rank_of(nid);
    h += "<tr class=\"node\" data-node=\"" + html_escape(nid) + "\" data-state=\"" + state +
         "\"><td>" + html_escape(nid) + "</td><td class=\"state-" + state + "\">" + state +
         "</td><td>" + html_escape(node.info.hostname()) + "</td><td>" +
         html_escape(node.info.address()) + "</td><td>" + html_escape(node.job_id) +
         "</td><td class=\"num\">" + (rank >= 0 ? std::to_string(rank) : "") +
         "</td><td class=\"num\">" + ago(duration_cast<milliseconds>(node.silent(now))) +
         " ago</td></tr>\n";
  }
  h += "</table>\n";
  if (order.size() > kPageNodes)
    h += "<p>and " + std::to_string(order.size() - kPageNodes) + " more nodes</p>\n";

  // Job sections: the running ones, then the most recent others.
  std::vector<const Job*> detail;
  for (const Job* j : jobs)
    if (!terminal(*j)) detail.push_back(j);
  for (const Job* j : jobs)
    if (terminal(*j) && detail.size() < kPageJobs) detail.push_back(j);
  for (const Job* j : detail) {
    const std::string jid = html_escape(j->id);
    h += "<section class=\"job-detail\" id=\"job-" + jid + "\" data-job=\"" + jid + "\"><h2>Job " +
         jid + " <small>" + job_state_label(j->state) + ", round " +
         std::to_string(std::max<int64_t>(j->round, 0)) + "</small></h2>\n";
    if (j->state == pb::JOB_STATE_RUNNING) {
      auto reports = rank_reports(*j, now);
      std::sort(reports.begin(), reports.end(), [](const RankReport& a, const RankReport& b) {
        return a.progress->rank() < b.progress->rank();
      });
      const auto& flagged = j->stragglers.flagged();
      h += "<table class=\"ranks\"><tr><th>rank</th><th>node</th><th>step</th>"
           "<th>steps/s</th><th>compute s/step</th><th>wait s/step</th><th>since last step</th>"
           "<th>collective</th><th>steps/s, last " +
           std::to_string(kHistoryLength * kHistoryStep.count() / 60) + " min</th><th></th></tr>\n";
      int rows = 0;
      for (const auto& r : reports) {
        const auto& p = *r.progress;
        auto slow = flagged.find(p.rank());
        bool straggler = slow != flagged.end();
        if (!straggler && rows >= kPageRanks) continue;
        ++rows;
        milliseconds step_age =
            p.step_age_ms() < 0 ? milliseconds(-1) : milliseconds(p.step_age_ms()) + r.report_age;
        bool stalled = j->spec.stall_timeout_ms() > 0 && p.steps() > 0 &&
                       step_age.count() >= j->spec.stall_timeout_ms();
        std::string cls =
            std::string("rank") + (straggler ? " straggler" : "") + (stalled ? " stalled" : "");
        auto hist = j->rate_history.find(p.rank());
        h += "<tr class=\"" + cls + "\" data-rank=\"" + std::to_string(p.rank()) +
             "\" data-node=\"" + html_escape(r.node) + "\"><td class=\"num\">" +
             std::to_string(p.rank()) + "</td><td>" + html_escape(r.node) +
             "</td><td class=\"num\">" + std::to_string(p.steps()) + "</td><td class=\"num\">" +
             (p.has_rate() ? num(p.steps_per_second(), 2) : "") + "</td><td class=\"num\">" +
             (p.has_rate() ? num(p.compute_seconds_per_step(), 3) : "") +
             "</td><td class=\"num\">" + (p.has_rate() ? num(p.wait_seconds_per_step(), 3) : "") +
             "</td><td class=\"num\">" + ago(step_age) + "</td><td>" +
             html_escape(p.in_flight().empty() ? "" : p.in_flight()) + "</td><td>" +
             metrics::sparkline(hist == j->rate_history.end() ? std::deque<float>{} : hist->second,
                                160, 24) +
             "</td><td class=\"mark\">" +
             (straggler ? "straggler " + num(slow->second, 1) + "x"
              : stalled ? "stalled"
                        : "") +
             "</td></tr>\n";
      }
      h += "</table>\n";
    }
    std::vector<const pb::JobEvent*> messages;
    for (auto it = j->events.rbegin(); it != j->events.rend() && messages.size() < kPageEvents;
         ++it) {
      if (it->has_message()) messages.push_back(&*it);
    }
    h += "<h3>Last events</h3>\n<ul class=\"events\">";
    for (auto it = messages.rbegin(); it != messages.rend(); ++it) {
      h += "<li>" + metrics::utc_time((*it)->time_unix_ms()).substr(11, 8) + " " +
           html_escape((*it)->message()) + "</li>";
    }
    h += "</ul>\n";
    if (!j->summary.empty()) h += "<pre class=\"summary\">" + html_escape(j->summary) + "</pre>\n";
    h += "</section>\n";
  }
  h += "</body></html>\n";
  return h;
}

}  // namespace accel::coordinator

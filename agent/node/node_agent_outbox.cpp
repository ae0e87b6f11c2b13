// NodeAgent's outbox: the workers' output lines and the group's reports, sent to the
// coordinator one call at a time and in order, each retried while the failure is transient.
#include <variant>

#include "agent/coordinator/request_limits.h"
#include "agent/node/node_agent.h"

namespace accel::node {

using supervisor::LogLevel;

namespace {

// Tries of one push the coordinator holds back for a slow launcher (about 100 ms apart).
constexpr int kMaxHeldBackTries = 6000;

}  // namespace

void NodeAgent::report(pb::ReportGroupRequest req) {
  // Why behind the logs: the coordinator must hold every line of the round before its outcome.
  flush_logs();
  outbox_.push_back({std::move(req), 0});
  send_next();
}

void NodeAgent::flush_logs() {
  if (log_buffer_.empty()) return;
  pb::PushLogsRequest req;
  size_t bytes = 0;
  auto close = [&] {
    if (req.lines().empty()) return;
    outbox_.push_back({std::move(req), 0});
    req = pb::PushLogsRequest();
    bytes = 0;
  };
  for (auto& l : log_buffer_) {
    size_t size = l.ByteSizeLong() + 8;
    if (bytes + size > kMaxPushBytes ||
        static_cast<size_t>(req.lines_size()) >= coordinator::limits::kMaxLinesPerPush) {
      close();
    }
    if (req.lines().empty()) {
      req.set_node_id(options_.node_id);
      req.set_job_id(log_job_);
    }
    *req.add_lines() = std::move(l);
    bytes += size;
  }
  close();
  log_buffer_.clear();
  log_buffer_bytes_ = 0;
  send_next();
}

void NodeAgent::send_next() {
  if (sending_ || outbox_.empty() || !alive_->open) return;
  sending_ = true;
  auto on_done = [this, gate = alive_, io = &io_](const rpc::CallStatus& st) {
    post_completion(gate, io, [this, st] {
      sending_ = false;
      if (outbox_.empty()) return;
      Outgoing& front = outbox_.front();
      bool transient =
          st.code == rpc::CallCode::kUnavailable || st.code == rpc::CallCode::kDeadlineExceeded ||
          st.code == rpc::CallCode::kNotFound || st.code == rpc::CallCode::kResourceExhausted;
      // Why NOT_FOUND is retried: after a coordinator restart the job is known again once this
      // node has re-registered with its work.
      // Why a push refused as RESOURCE_EXHAUSTED gets many more tries: the coordinator holds
      // output back while a live launcher has not read it yet (lossless forwarding); it stops
      // once that launcher is gone, so this waits only as long as someone reads.
      bool held_back = st.code == rpc::CallCode::kResourceExhausted &&
                       std::holds_alternative<pb::PushLogsRequest>(front.call);
      if (!st.ok() && transient && front.attempt < (held_back ? kMaxHeldBackTries : 40)) {
        ++front.attempt;
        sending_ = true;  // Why: nothing may overtake the call that waits for its retry
        retry_later(backoff(), [this] {
          sending_ = false;
          send_next();
        });
        return;
      }
      if (!st.ok()) {
        if (const auto* push = std::get_if<pb::PushLogsRequest>(&front.call)) {
          lines_not_forwarded_ += static_cast<uint64_t>(push->lines_size());
          log(LogLevel::kWarn, std::to_string(push->lines_size()) + " output lines of job " +
                                   push->job_id() + " were not forwarded (" + rpc::describe(st) +
                                   "); they are in this node's log_dir");
        } else {
          const auto& rep = std::get<pb::ReportGroupRequest>(front.call);
          log(LogLevel::kInfo, "report for job " + rep.job_id() + " round " +
                                   std::to_string(rep.round()) +
                                   " not taken: " + rpc::describe(st));
        }
      }
      outbox_.pop_front();
      send_next();
    });
  };
  Outgoing& front = outbox_.front();
  if (const auto* push = std::get_if<pb::PushLogsRequest>(&front.call)) {
    client_->push_logs(
        *push, options_.rpc_timeout,
        [on_done](const rpc::CallStatus& st, pb::PushLogsResponse&) { on_done(st); });
  } else {
    client_->report_group(
        std::get<pb::ReportGroupRequest>(front.call), options_.rpc_timeout,
        [on_done](const rpc::CallStatus& st, pb::ReportGroupResponse&) { on_done(st); });
  }
}

}  // namespace accel::node

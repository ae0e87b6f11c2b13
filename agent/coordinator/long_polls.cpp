// Which parked calls a change answers.
#include "agent/coordinator/long_polls.h"

#include <algorithm>

namespace accel::coordinator {
namespace {

// Answers the parked calls of one key (`answer` returns true when it settled one), and drops
// the key when none is left.
template <class Map, class Settle>
void settle_key(Map& parked, typename Map::iterator it, Settle settle) {
  auto& list = it->second;
  list.erase(std::remove_if(list.begin(), list.end(), settle), list.end());
  if (list.empty()) parked.erase(it);
}

template <class Resp>
std::function<void()> bind(LongPolls::Answer<Resp> answer, RpcStatus status, Resp resp) {
  return [answer = std::move(answer), status = std::move(status),
          resp = std::move(resp)]() mutable { answer(status, resp); };
}

}  // namespace

uint64_t LongPolls::park_sync(CoordinatorCore& core, const std::string& node_id,
                              uint64_t known_version, bool omit, Time deadline,
                              Answer<pb::SyncResponse> answer) {
  const uint64_t id = next_id_++;
  syncs_[node_id].push_back({id, known_version, omit, deadline, std::move(answer)});
  sync_deadlines_.emplace(deadline, id, node_id);
  core.poll_started(node_id);
  return id;
}

std::function<void()> LongPolls::cancel_sync(CoordinatorCore& core, const std::string& node_id,
                                             uint64_t id) {
  auto it = syncs_.find(node_id);
  if (it == syncs_.end()) return {};
  std::function<void()> out;
  settle_key(syncs_, it, [&](ParkedSync& p) {
    if (p.id != id) return false;
    out = bind(std::move(p.answer), RpcStatus::error(Code::kUnavailable, "call cancelled"),
               pb::SyncResponse());
    return true;
  });
  if (out) core.poll_ended(node_id);
  return out;
}

void LongPolls::park_watch(const pb::WatchJobRequest& req, Time deadline,
                           Answer<pb::WatchJobResponse> answer) {
  watches_[req.job_id()].push_back({req, deadline, std::move(answer)});
}

LongPolls::Finish LongPolls::collect(CoordinatorCore& core, const CoordinatorCore::Changes& changes,
                                     Time now, bool expire) {
  Finish finish;
  auto sync_settle = [&](const std::string& node, bool changed) {
    return [&, changed](ParkedSync& p) {
      bool late = now >= p.deadline;
      if (!changed && !late) return false;
      pb::SyncResponse fresh;
      RpcStatus st = core.instruction(node, &fresh, p.omit ? p.known : 0);
      if (st.is_ok() && fresh.version() == p.known && !late) return false;
      finish.push_back(bind(std::move(p.answer), st, std::move(fresh)));
      core.poll_ended(node);
      return true;
    };
  };
  auto watch_settle = [&](bool changed) {
    return [&, changed](ParkedWatch& p) {
      bool late = now >= p.deadline;
      if (!changed && !late) return false;
      pb::WatchJobResponse fresh;
      RpcStatus st = core.watch_job(p.req, &fresh);
      if (st.is_ok() && fresh.events().empty() && !fresh.done() && !late) return false;
      finish.push_back(bind(std::move(p.answer), st, std::move(fresh)));
      return true;
    };
  };
  if (changes.all_nodes) {
    for (auto it = syncs_.begin(); it != syncs_.end();) {
      auto next = std::next(it);
      settle_key(syncs_, it, sync_settle(it->first, true));
      it = next;
    }
  } else {
    for (const auto& node : changes.nodes) {
      if (auto it = syncs_.find(node); it != syncs_.end())
        settle_key(syncs_, it, sync_settle(node, true));
    }
  }
  // Why not a scan: at 16k parked syncs, looking at each on every tick was a tenth of the
  // coordinator's CPU in steady state.
  while (expire && !sync_deadlines_.empty() && std::get<0>(sync_deadlines_.top()) <= now) {
    const Due due = sync_deadlines_.top();
    sync_deadlines_.pop();
    const uint64_t id = std::get<1>(due);
    const std::string& node = std::get<2>(due);
    auto it = syncs_.find(node);
    if (it == syncs_.end()) continue;  // answered before its deadline
    auto late = sync_settle(node, false);
    settle_key(syncs_, it, [&](ParkedSync& p) { return p.id == id && late(p); });
  }
  if (expire) {
    for (auto it = watches_.begin(); it != watches_.end();) {
      auto next = std::next(it);
      settle_key(watches_, it, watch_settle(changes.jobs.contains(it->first)));
      it = next;
    }
  } else {
    for (const auto& job : changes.jobs) {
      if (auto it = watches_.find(job); it != watches_.end())
        settle_key(watches_, it, watch_settle(true));
    }
  }
  return finish;
}

LongPolls::Finish LongPolls::take_all(CoordinatorCore& core, const RpcStatus& status) {
  Finish finish;
  for (auto& [node, list] : syncs_) {
    for (auto& p : list) {
      finish.push_back(bind(std::move(p.answer), status, pb::SyncResponse()));
      core.poll_ended(node);
    }
  }
  for (auto& [job, list] : watches_) {
    for (auto& p : list) {
      finish.push_back(bind(std::move(p.answer), status, pb::WatchJobResponse()));
    }
  }
  syncs_.clear();
  sync_deadlines_ = {};
  watches_.clear();
  return finish;
}

size_t LongPolls::syncs() const {
  size_t n = 0;
  for (const auto& [node, list] : syncs_) n += list.size();
  return n;
}

size_t LongPolls::watches() const {
  size_t n = 0;
  for (const auto& [job, list] : watches_) n += list.size();
  return n;
}

}  // namespace accel::coordinator

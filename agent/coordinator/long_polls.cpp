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

void LongPolls::park_sync(const std::string& node_id, uint64_t known_version, bool omit,
                          Time deadline, Answer<pb::SyncResponse> answer) {
  syncs_[node_id].push_back({known_version, omit, deadline, std::move(answer)});
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
  if (expire || changes.all_nodes) {
    for (auto it = syncs_.begin(); it != syncs_.end();) {
      auto next = std::next(it);
      settle_key(syncs_, it,
                 sync_settle(it->first, changes.all_nodes || changes.nodes.contains(it->first)));
      it = next;
    }
  } else {
    for (const auto& node : changes.nodes) {
      if (auto it = syncs_.find(node); it != syncs_.end())
        settle_key(syncs_, it, sync_settle(node, true));
    }
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

LongPolls::Finish LongPolls::take_all(const RpcStatus& status) {
  Finish finish;
  for (auto& [node, list] : syncs_) {
    for (auto& p : list) finish.push_back(bind(std::move(p.answer), status, pb::SyncResponse()));
  }
  for (auto& [job, list] : watches_) {
    for (auto& p : list) {
      finish.push_back(bind(std::move(p.answer), status, pb::WatchJobResponse()));
    }
  }
  syncs_.clear();
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

// LongPolls: the coordinator's calls that wait for its state to change: a node's Sync (until its
// instruction is newer than the version it holds) and a launcher's WatchJob (until the job has
// events after those it saw, or has ended), each with a deadline. It decides which of them a
// change of the core, or the end of their wait, answers. Transport-neutral: an answer is a
// callback, which the gRPC server uses to finish a reactor.
//
// Thread: not thread-safe; callers hold the lock they hold around the core.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <queue>
#include <string>
#include <tuple>
#include <vector>

#include "agent/coordinator/coordinator_core.h"

namespace accel::coordinator {

class LongPolls {
 public:
  using Time = std::chrono::steady_clock::time_point;
  template <class Resp>
  using Answer = std::function<void(const RpcStatus&, Resp&)>;
  using Finish = std::vector<std::function<void()>>;

  // `omit`: the node asked for omit_unchanged (an answer at the deadline leaves out the
  // instruction it holds). The core counts the node's poll (CoordinatorCore::poll_started) until
  // it is answered or cancelled. Returns the parked call's id (for cancel_sync).
  uint64_t park_sync(CoordinatorCore& core, const std::string& node_id, uint64_t known_version,
                     bool omit, Time deadline, Answer<pb::SyncResponse> answer);
  // The parked sync `id` of `node_id` was cancelled (its connection closed): forgets it and
  // returns its answer, bound to an UNAVAILABLE status; empty when it was answered already.
  std::function<void()> cancel_sync(CoordinatorCore& core, const std::string& node_id, uint64_t id);
  void park_watch(const pb::WatchJobRequest& req, Time deadline,
                  Answer<pb::WatchJobResponse> answer);

  // The answers of the parked calls that `changes` settle (the core's take_changes()), and with
  // `expire` also those whose deadline is past at `now`; run them after releasing the lock.
  // Why two paths: after an RPC only what it changed needs a look (a heartbeat of one node must
  // not scan thousands of parked polls); the periodic tick also answers expired waits.
  Finish collect(CoordinatorCore& core, const CoordinatorCore::Changes& changes, Time now,
                 bool expire);
  // Every parked call, answered with `status` (the server is shutting down or rebuilding).
  Finish take_all(CoordinatorCore& core, const RpcStatus& status);

  [[nodiscard]] size_t syncs() const;
  [[nodiscard]] size_t watches() const;

 private:
  struct ParkedSync {
    uint64_t id;
    uint64_t known;
    bool omit;
    Time deadline;
    Answer<pb::SyncResponse> answer;
  };
  struct ParkedWatch {
    pb::WatchJobRequest req;
    Time deadline;
    Answer<pb::WatchJobResponse> answer;
  };
  std::map<std::string, std::vector<ParkedSync>> syncs_;  // by node id
  // The parked syncs' deadlines, the earliest on top, so the tick looks only at expired ones.
  // Why lazy: an answered sync's entry stays until its deadline and is then skipped.
  using Due = std::tuple<Time, uint64_t, std::string>;  // deadline, id, node
  std::priority_queue<Due, std::vector<Due>, std::greater<>> sync_deadlines_;
  uint64_t next_id_ = 1;
  std::map<std::string, std::vector<ParkedWatch>> watches_;  // by job id
};

}  // namespace accel::coordinator

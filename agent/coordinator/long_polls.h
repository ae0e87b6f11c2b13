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
#include <string>
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
  // instruction it holds).
  void park_sync(const std::string& node_id, uint64_t known_version, bool omit, Time deadline,
                 Answer<pb::SyncResponse> answer);
  void park_watch(const pb::WatchJobRequest& req, Time deadline,
                  Answer<pb::WatchJobResponse> answer);

  // The answers of the parked calls that `changes` settle (the core's take_changes()), and with
  // `expire` also those whose deadline is past at `now`; run them after releasing the lock.
  // Why two paths: after an RPC only what it changed needs a look (a heartbeat of one node must
  // not scan thousands of parked polls); the periodic tick also answers expired waits.
  Finish collect(CoordinatorCore& core, const CoordinatorCore::Changes& changes, Time now,
                 bool expire);
  // Every parked call, answered with `status` (the server is shutting down or rebuilding).
  Finish take_all(const RpcStatus& status);

  [[nodiscard]] size_t syncs() const;
  [[nodiscard]] size_t watches() const;

 private:
  struct ParkedSync {
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
  std::map<std::string, std::vector<ParkedSync>> syncs_;     // by node id
  std::map<std::string, std::vector<ParkedWatch>> watches_;  // by job id
};

}  // namespace accel::coordinator

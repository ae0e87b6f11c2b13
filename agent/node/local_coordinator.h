// LocalCoordinator: a CoordinatorCore in this process that answers the node agent's calls
// directly (no gRPC, no socket). accel-launch's local mode runs its one node through it, so a
// local job has the same rounds, restart budget, failure records and summary as a cluster job.
// A Sync that finds nothing new is parked (LongPolls) until the core changes or its wait ends,
// as the gRPC server does.
//
// Thread: everything runs on the io_context passed in; answers are posted to it, never called
// inside the call that asked.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "agent/common/clock.h"
#include "agent/coordinator/coordinator_core.h"
#include "agent/coordinator/long_polls.h"
#include "agent/rpc/coordinator_api.h"

namespace accel::node {

namespace pb = ::accel::v1;

class LocalCoordinator final : public rpc::CoordinatorApi {
 public:
  LocalCoordinator(boost::asio::io_context& io, const Clock& clock,
                   coordinator::CoordinatorOptions options,
                   std::chrono::milliseconds tick = std::chrono::milliseconds(100));
  ~LocalCoordinator() override;
  LocalCoordinator(const LocalCoordinator&) = delete;
  LocalCoordinator& operator=(const LocalCoordinator&) = delete;

  void register_node(const pb::RegisterNodeRequest& req, std::chrono::milliseconds timeout,
                     Done<pb::RegisterNodeResponse> done) override;
  void sync(const pb::SyncRequest& req, std::chrono::milliseconds timeout,
            Done<pb::SyncResponse> done) override;
  void join_round(const pb::JoinRoundRequest& req, std::chrono::milliseconds timeout,
                  Done<pb::JoinRoundResponse> done) override;
  void report_group(const pb::ReportGroupRequest& req, std::chrono::milliseconds timeout,
                    Done<pb::ReportGroupResponse> done) override;
  void push_logs(const pb::PushLogsRequest& req, std::chrono::milliseconds timeout,
                 Done<pb::PushLogsResponse> done) override;
  [[nodiscard]] const std::string& target() const override { return target_; }

  // Runs `f` on the core, then answers the parked calls its changes settle: how the launcher
  // submits, follows and cancels its job.
  void with_core(const std::function<void(coordinator::CoordinatorCore&)>& f);
  // Called with the core after every change (the launcher prints the job's events from it); it
  // must not call into this coordinator.
  void on_change(std::function<void(coordinator::CoordinatorCore&)> f) {
    on_change_ = std::move(f);
  }
  // Starts applying time (leases, round deadlines) every `tick`.
  void start();
  // Answers every parked call UNAVAILABLE and stops the tick.
  void stop();

 private:
  template <class Resp>
  void answer(Done<Resp> done, const coordinator::RpcStatus& status, Resp resp);
  void settle(bool expire);
  void arm();

  boost::asio::io_context& io_;
  coordinator::CoordinatorCore core_;
  coordinator::LongPolls polls_;
  std::chrono::milliseconds tick_;
  boost::asio::steady_timer timer_;
  std::string target_ = "this process";
  std::function<void(coordinator::CoordinatorCore&)> on_change_;
  bool stopped_ = false;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
};

// The transport's view of a core status.
rpc::CallStatus to_call_status(const coordinator::RpcStatus& status);

}  // namespace accel::node

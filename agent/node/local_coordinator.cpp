// The in-process coordinator.
#include "agent/node/local_coordinator.h"

#include <boost/asio/post.hpp>

namespace accel::node {

namespace asio = boost::asio;
using coordinator::Code;
using coordinator::RpcStatus;

namespace {
// The longest a Sync may wait, as the gRPC server's max_wait.
constexpr std::chrono::milliseconds kMaxWait{30'000};
}  // namespace

rpc::CallStatus to_call_status(const RpcStatus& status) {
  rpc::CallCode code = rpc::CallCode::kUnknown;
  switch (status.code) {
    case Code::kOk:
      code = rpc::CallCode::kOk;
      break;
    case Code::kInvalidArgument:
      code = rpc::CallCode::kInvalidArgument;
      break;
    case Code::kNotFound:
      code = rpc::CallCode::kNotFound;
      break;
    case Code::kFailedPrecondition:
      code = rpc::CallCode::kFailedPrecondition;
      break;
    case Code::kAlreadyExists:
      code = rpc::CallCode::kAlreadyExists;
      break;
    case Code::kResourceExhausted:
      code = rpc::CallCode::kResourceExhausted;
      break;
    case Code::kUnavailable:
      code = rpc::CallCode::kUnavailable;
      break;
  }
  return {code, status.message};
}

LocalCoordinator::LocalCoordinator(asio::io_context& io, const Clock& clock,
                                   coordinator::CoordinatorOptions options,
                                   std::chrono::milliseconds tick)
    : io_(io), core_(clock, std::move(options)), tick_(tick), timer_(io) {}

LocalCoordinator::~LocalCoordinator() {
  *alive_ = false;
  timer_.cancel();
}

template <class Resp>
void LocalCoordinator::answer(Done<Resp> done, const RpcStatus& status, Resp resp) {
  asio::post(io_, [done = std::move(done), st = to_call_status(status),
                   resp = std::move(resp)]() mutable { done(st, resp); });
}

void LocalCoordinator::settle(bool expire) {
  auto finish =
      polls_.collect(core_, core_.take_changes(), std::chrono::steady_clock::now(), expire);
  for (auto& f : finish) f();  // each posts its answer
  if (on_change_) on_change_(core_);
}

void LocalCoordinator::register_node(const pb::RegisterNodeRequest& req, std::chrono::milliseconds,
                                     Done<pb::RegisterNodeResponse> done) {
  pb::RegisterNodeResponse resp;
  RpcStatus st = stopped_ ? RpcStatus::error(Code::kUnavailable, "coordinator stopped")
                          : core_.register_node(req, &resp);
  answer(std::move(done), st, std::move(resp));
  settle(false);
}

void LocalCoordinator::sync(const pb::SyncRequest& req, std::chrono::milliseconds,
                            Done<pb::SyncResponse> done) {
  if (stopped_) {
    answer(std::move(done), RpcStatus::error(Code::kUnavailable, "coordinator stopped"),
           pb::SyncResponse());
    return;
  }
  pb::SyncResponse resp;
  RpcStatus st = core_.sync(req, &resp);
  bool unchanged = st.is_ok() && resp.version() == req.known_version();
  if (unchanged && req.wait_ms() > 0) {
    auto wait = std::min(std::chrono::milliseconds(req.wait_ms()), kMaxWait);
    polls_.park_sync(core_, req.node_id(), req.known_version(), req.omit_unchanged(),
                     std::chrono::steady_clock::now() + wait,
                     [this, done = std::move(done)](const RpcStatus& s, pb::SyncResponse& r) {
                       answer(done, s, std::move(r));
                     });
  } else {
    answer(std::move(done), st, std::move(resp));
  }
  settle(false);
}

void LocalCoordinator::join_round(const pb::JoinRoundRequest& req, std::chrono::milliseconds,
                                  Done<pb::JoinRoundResponse> done) {
  RpcStatus st = core_.join_round(req);
  answer(std::move(done), st, pb::JoinRoundResponse());
  settle(false);
}

void LocalCoordinator::report_group(const pb::ReportGroupRequest& req, std::chrono::milliseconds,
                                    Done<pb::ReportGroupResponse> done) {
  RpcStatus st = core_.report_group(req);
  answer(std::move(done), st, pb::ReportGroupResponse());
  settle(false);
}

void LocalCoordinator::push_logs(const pb::PushLogsRequest& req, std::chrono::milliseconds,
                                 Done<pb::PushLogsResponse> done) {
  RpcStatus st = core_.push_logs(req);
  answer(std::move(done), st, pb::PushLogsResponse());
  settle(false);
}

void LocalCoordinator::with_core(const std::function<void(coordinator::CoordinatorCore&)>& f) {
  f(core_);
  settle(false);
}

void LocalCoordinator::start() { arm(); }

void LocalCoordinator::arm() {
  if (stopped_) return;
  timer_.expires_after(tick_);
  timer_.async_wait([this, alive = alive_](const boost::system::error_code& ec) {
    if (ec || !*alive || stopped_) return;
    core_.tick();
    settle(true);
    arm();
  });
}

void LocalCoordinator::stop() {
  if (stopped_) return;
  stopped_ = true;
  timer_.cancel();
  for (auto& f :
       polls_.take_all(core_, RpcStatus::error(Code::kUnavailable, "coordinator stopped")))
    f();
}

}  // namespace accel::node

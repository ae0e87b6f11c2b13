// CoordinatorApi: the calls a node agent makes to its coordinator, without gRPC in the
// interface. rpc::CoordinatorClient implements it over gRPC; tests drive NodeAgent with a fake
// that answers each call when the test says so.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "accel/v1/coordinator.pb.h"

namespace accel::rpc {

namespace pb = ::accel::v1;

// gRPC's status codes, same numbers (grpc::StatusCode), without gRPC.
enum class CallCode {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};

struct CallStatus {
  CallCode code = CallCode::kOk;
  std::string message;
  [[nodiscard]] bool ok() const { return code == CallCode::kOk; }
  // The coordinator may answer if asked again later (it is away, or busy).
  [[nodiscard]] bool unreachable() const {
    return code == CallCode::kUnavailable || code == CallCode::kDeadlineExceeded;
  }
};

// "UNAVAILABLE: failed to connect to all addresses"
std::string describe(const CallStatus& status);

class CoordinatorApi {
 public:
  virtual ~CoordinatorApi() = default;

  // `done` runs once, on any thread (gRPC's, or the caller's for a fake): post it onward.
  template <class Resp>
  using Done = std::function<void(const CallStatus&, Resp&)>;

  virtual void register_node(const pb::RegisterNodeRequest& req, std::chrono::milliseconds timeout,
                             Done<pb::RegisterNodeResponse> done) = 0;
  virtual void sync(const pb::SyncRequest& req, std::chrono::milliseconds timeout,
                    Done<pb::SyncResponse> done) = 0;
  virtual void join_round(const pb::JoinRoundRequest& req, std::chrono::milliseconds timeout,
                          Done<pb::JoinRoundResponse> done) = 0;
  virtual void report_group(const pb::ReportGroupRequest& req, std::chrono::milliseconds timeout,
                            Done<pb::ReportGroupResponse> done) = 0;
  virtual void push_logs(const pb::PushLogsRequest& req, std::chrono::milliseconds timeout,
                         Done<pb::PushLogsResponse> done) = 0;
  // "host:port", for messages.
  [[nodiscard]] virtual const std::string& target() const = 0;
};

}  // namespace accel::rpc

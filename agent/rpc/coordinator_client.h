// CoordinatorClient: the one client of the Coordinator service, used by node agents
// (asynchronous calls, completions on gRPC's threads) and by launchers and `accel status`
// (blocking calls). Every call carries the token and a deadline.
// Thread-safe: gRPC stubs and channels may be used from any thread.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "accel/v1/coordinator.grpc.pb.h"
#include "agent/common/status.h"
#include "agent/rpc/coordinator_api.h"
#include "agent/rpc/rpc_security.h"

namespace accel::rpc {

namespace pb = ::accel::v1;

class CoordinatorClient final : public CoordinatorApi {
 public:
  // `target`: "host:port". Fails only on bad TLS files; connecting happens on the first call.
  static Result<std::shared_ptr<CoordinatorClient>> create(const std::string& target,
                                                           std::string token, const TlsFiles& tls);

  // Asynchronous (CoordinatorApi): `done` runs once on a gRPC thread (post it to your
  // io_context).
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

  // Blocking, bounded by `timeout`.
  grpc::Status submit_job(const pb::SubmitJobRequest& req, pb::SubmitJobResponse* resp,
                          std::chrono::milliseconds timeout);
  grpc::Status watch_job(const pb::WatchJobRequest& req, pb::WatchJobResponse* resp,
                         std::chrono::milliseconds timeout);
  grpc::Status cancel_job(const pb::CancelJobRequest& req, std::chrono::milliseconds timeout);
  grpc::Status get_status(pb::GetStatusResponse* resp, std::chrono::milliseconds timeout);

  [[nodiscard]] const std::string& target() const override { return target_; }

 private:
  CoordinatorClient(std::string target, std::string token, std::shared_ptr<grpc::Channel> channel);

  template <class Req, class Resp, class Invoke>
  void call(Invoke invoke, const Req& req, std::chrono::milliseconds timeout, Done<Resp> done);
  // UNAVAILABLE after this process refused a server's certificate -> UNAUTHENTICATED, saying so.
  grpc::Status translate(const grpc::Status& status) const;
  static grpc::Status translate_status(const grpc::Status& status, const std::string& target,
                                       bool token_tls, std::atomic<uint64_t>& refused_seen);

  std::string target_;
  std::string token_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::Coordinator::Stub> stub_;
  bool token_tls_ = true;  // the server is trusted by the token's certificate
  // server_certificates_refused() at this client's creation or last successful call (shared
  // with its calls in flight, which may outlive it)
  std::shared_ptr<std::atomic<uint64_t>> refused_seen_ = std::make_shared<std::atomic<uint64_t>>(0);
};

}  // namespace accel::rpc

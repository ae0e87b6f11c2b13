// Coordinator client calls: the async ones keep request, response and context alive until
// gRPC completes them.
#include "agent/rpc/coordinator_client.h"

namespace accel::rpc {

CoordinatorClient::CoordinatorClient(std::string target, std::string token,
                                     std::shared_ptr<grpc::Channel> channel)
    : target_(std::move(target)),
      token_(std::move(token)),
      channel_(std::move(channel)),
      stub_(pb::Coordinator::NewStub(channel_)) {}

Result<std::shared_ptr<CoordinatorClient>> CoordinatorClient::create(const std::string& target,
                                                                     std::string token,
                                                                     const TlsFiles& tls) {
  if (target.empty() || target.find(':') == std::string::npos) {
    return Status::error("coordinator address '" + target + "' must be HOST:PORT");
  }
  auto channel = make_channel(target, tls);
  if (!channel) return channel.status();
  return std::shared_ptr<CoordinatorClient>(
      new CoordinatorClient(target, std::move(token), *channel));
}

template <class Req, class Resp, class Invoke>
void CoordinatorClient::call(Invoke invoke, const Req& req, std::chrono::milliseconds timeout,
                             Done<Resp> done) {
  struct Call {
    grpc::ClientContext ctx;
    Req req;
    Resp resp;
    Done<Resp> done;
  };
  auto c = std::make_shared<Call>();
  c->req = req;
  c->done = std::move(done);
  prepare_context(c->ctx, token_, timeout);
  invoke(stub_->async(), &c->ctx, &c->req, &c->resp, [c](grpc::Status status) {
    CallStatus st{static_cast<CallCode>(status.error_code()), status.error_message()};
    c->done(st, c->resp);
  });
}

void CoordinatorClient::register_node(const pb::RegisterNodeRequest& req,
                                      std::chrono::milliseconds timeout,
                                      Done<pb::RegisterNodeResponse> done) {
  call<>([](auto* a, auto* ctx, auto* rq, auto* rs,
            auto cb) { a->RegisterNode(ctx, rq, rs, std::move(cb)); },
         req, timeout, std::move(done));
}
void CoordinatorClient::sync(const pb::SyncRequest& req, std::chrono::milliseconds timeout,
                             Done<pb::SyncResponse> done) {
  call<>(
      [](auto* a, auto* ctx, auto* rq, auto* rs, auto cb) { a->Sync(ctx, rq, rs, std::move(cb)); },
      req, timeout, std::move(done));
}
void CoordinatorClient::join_round(const pb::JoinRoundRequest& req,
                                   std::chrono::milliseconds timeout,
                                   Done<pb::JoinRoundResponse> done) {
  call<>([](auto* a, auto* ctx, auto* rq, auto* rs,
            auto cb) { a->JoinRound(ctx, rq, rs, std::move(cb)); },
         req, timeout, std::move(done));
}
void CoordinatorClient::report_group(const pb::ReportGroupRequest& req,
                                     std::chrono::milliseconds timeout,
                                     Done<pb::ReportGroupResponse> done) {
  call<>([](auto* a, auto* ctx, auto* rq, auto* rs,
            auto cb) { a->ReportGroup(ctx, rq, rs, std::move(cb)); },
         req, timeout, std::move(done));
}
void CoordinatorClient::push_logs(const pb::PushLogsRequest& req, std::chrono::milliseconds timeout,
                                  Done<pb::PushLogsResponse> done) {
  call<>([](auto* a, auto* ctx, auto* rq, auto* rs,
            auto cb) { a->PushLogs(ctx, rq, rs, std::move(cb)); },
         req, timeout, std::move(done));
}

grpc::Status CoordinatorClient::submit_job(const pb::SubmitJobRequest& req,
                                           pb::SubmitJobResponse* resp,
                                           std::chrono::milliseconds timeout) {
  grpc::ClientContext ctx;
  prepare_context(ctx, token_, timeout);
  return stub_->SubmitJob(&ctx, req, resp);
}
grpc::Status CoordinatorClient::watch_job(const pb::WatchJobRequest& req,
                                          pb::WatchJobResponse* resp,
                                          std::chrono::milliseconds timeout) {
  grpc::ClientContext ctx;
  prepare_context(ctx, token_, timeout);
  return stub_->WatchJob(&ctx, req, resp);
}
grpc::Status CoordinatorClient::cancel_job(const pb::CancelJobRequest& req,
                                           std::chrono::milliseconds timeout) {
  grpc::ClientContext ctx;
  prepare_context(ctx, token_, timeout);
  pb::CancelJobResponse resp;
  return stub_->CancelJob(&ctx, req, &resp);
}
grpc::Status CoordinatorClient::get_status(pb::GetStatusResponse* resp,
                                           std::chrono::milliseconds timeout) {
  grpc::ClientContext ctx;
  prepare_context(ctx, token_, timeout);
  return stub_->GetStatus(&ctx, pb::GetStatusRequest{}, resp);
}

}  // namespace accel::rpc

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
  auto channel = make_channel(target, tls, token);
  if (!channel) return channel.status();
  auto client =
      std::shared_ptr<CoordinatorClient>(new CoordinatorClient(target, std::move(token), *channel));
  client->token_tls_ = uses_token_tls(tls);
  client->refused_seen_->store(server_certificates_refused());
  return client;
}

grpc::Status CoordinatorClient::translate(const grpc::Status& status) const {
  return translate_status(status, target_, token_tls_, *refused_seen_);
}

grpc::Status CoordinatorClient::translate_status(const grpc::Status& status,
                                                 const std::string& target, bool token_tls,
                                                 std::atomic<uint64_t>& refused_seen) {
  // Why: with the token's certificate, a server that does not hold the token fails the TLS
  // handshake, and gRPC reports only "failed to connect" (UNAVAILABLE), which callers retry
  // for minutes. It is a wrong server, not an absent one; nothing was sent to it. Why reset on
  // success: a refusal before the last call that got through is history, not this failure.
  const uint64_t refused = server_certificates_refused();
  if (status.ok()) refused_seen.store(refused);
  if (status.error_code() != grpc::StatusCode::UNAVAILABLE || refused == refused_seen.load()) {
    return status;
  }
  return {grpc::StatusCode::UNAUTHENTICATED,
          "the server at " + target + " failed the TLS handshake " +
              (token_tls ? "that proves it holds this job's token"
                         : "(its certificate is not signed by tls_ca)") +
              ", so it was sent nothing: another program holds that port, or the coordinator "
              "runs with another token or TLS setting"};
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
  invoke(stub_->async(), &c->ctx, &c->req, &c->resp,
         [c, target = target_, token_tls = token_tls_,
          refused_seen = refused_seen_](grpc::Status status) {
           status = translate_status(status, target, token_tls, *refused_seen);
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
  return translate(stub_->SubmitJob(&ctx, req, resp));
}
grpc::Status CoordinatorClient::watch_job(const pb::WatchJobRequest& req,
                                          pb::WatchJobResponse* resp,
                                          std::chrono::milliseconds timeout) {
  grpc::ClientContext ctx;
  prepare_context(ctx, token_, timeout);
  return translate(stub_->WatchJob(&ctx, req, resp));
}
grpc::Status CoordinatorClient::cancel_job(const pb::CancelJobRequest& req,
                                           std::chrono::milliseconds timeout) {
  grpc::ClientContext ctx;
  prepare_context(ctx, token_, timeout);
  pb::CancelJobResponse resp;
  return translate(stub_->CancelJob(&ctx, req, &resp));
}
grpc::Status CoordinatorClient::get_status(pb::GetStatusResponse* resp,
                                           std::chrono::milliseconds timeout) {
  grpc::ClientContext ctx;
  prepare_context(ctx, token_, timeout);
  return translate(stub_->GetStatus(&ctx, pb::GetStatusRequest{}, resp));
}

}  // namespace accel::rpc

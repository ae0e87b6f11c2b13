// The gRPC adapter of the coordinator: token check, status mapping, long-poll parking.
#include "agent/coordinator/coordinator_server.h"

#include <grpc/support/log.h>
#include <grpcpp/resource_quota.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <optional>

#include "accel/v1/coordinator.grpc.pb.h"
#include "agent/metrics/exposition.h"

namespace accel::coordinator {

namespace {

grpc::Status to_grpc(const RpcStatus& s) {
  switch (s.code) {
    case Code::kOk:
      return grpc::Status::OK;
    case Code::kInvalidArgument:
      return {grpc::StatusCode::INVALID_ARGUMENT, s.message};
    case Code::kNotFound:
      return {grpc::StatusCode::NOT_FOUND, s.message};
    case Code::kFailedPrecondition:
      return {grpc::StatusCode::FAILED_PRECONDITION, s.message};
    case Code::kAlreadyExists:
      return {grpc::StatusCode::ALREADY_EXISTS, s.message};
    case Code::kUnavailable:
      return {grpc::StatusCode::UNAVAILABLE, s.message};
    case Code::kResourceExhausted:
      return {grpc::StatusCode::RESOURCE_EXHAUSTED, s.message};
  }
  return {grpc::StatusCode::INTERNAL, s.message};
}

// The methods and outcomes of CoordinatorServer::calls_, as the metrics name them.
enum Method : size_t {
  kRegisterNode,
  kJoinRound,
  kReportGroup,
  kPushLogs,
  kSubmitJob,
  kCancelJob,
  kGetStatus,
  kSync,
  kWatchJob
};
constexpr const char* kMethodNames[] = {"RegisterNode", "JoinRound", "ReportGroup",
                                        "PushLogs",     "SubmitJob", "CancelJob",
                                        "GetStatus",    "Sync",      "WatchJob"};
constexpr const char* kOutcomeNames[] = {"OK",
                                         "INVALID_ARGUMENT",
                                         "NOT_FOUND",
                                         "FAILED_PRECONDITION",
                                         "ALREADY_EXISTS",
                                         "RESOURCE_EXHAUSTED",
                                         "UNAVAILABLE",
                                         "PARKED",
                                         "UNAUTHENTICATED"};
constexpr size_t kParked = 7;
constexpr size_t kUnauthenticated = 8;

// The index of `c` in kOutcomeNames.
size_t outcome(Code c) {
  switch (c) {
    case Code::kOk:
      return 0;
    case Code::kInvalidArgument:
      return 1;
    case Code::kNotFound:
      return 2;
    case Code::kFailedPrecondition:
      return 3;
    case Code::kAlreadyExists:
      return 4;
    case Code::kResourceExhausted:
      return 5;
    case Code::kUnavailable:
      return 6;
  }
  return 6;
}

}  // namespace

// A Sync's reactor. Unlike gRPC's default one it hears when its call is cancelled: the agent's
// connection closed, or the server's keepalive pings went unanswered (a dead machine, a
// partition). A parked Sync keeps its node alive (CoordinatorCore::poll_started); its
// cancellation is what lets the lease run again.
class CoordinatorServer::SyncReactor final : public grpc::ServerUnaryReactor {
 public:
  explicit SyncReactor(CoordinatorServer& server) : s_(server) {}
  // Under the server's lock: the call is parked as `id` of `node_id`.
  void parked(std::string node_id, uint64_t id) {
    node_id_ = std::move(node_id);
    id_ = id;
  }
  void OnCancel() override { s_.cancel_parked(*this); }
  void OnDone() override { delete this; }

 private:
  friend class CoordinatorServer;
  CoordinatorServer& s_;
  std::string node_id_;  // guarded by the server's lock
  uint64_t id_ = 0;      // 0: never parked
};

class CoordinatorServer::Service final : public v1::Coordinator::CallbackService {
 public:
  explicit Service(CoordinatorServer& server) : s_(server) {}

  grpc::ServerUnaryReactor* RegisterNode(grpc::CallbackServerContext* ctx,
                                         const v1::RegisterNodeRequest* req,
                                         v1::RegisterNodeResponse* resp) override {
    return simple(ctx, kRegisterNode,
                  [&](CoordinatorCore& core) { return core.register_node(*req, resp); });
  }
  grpc::ServerUnaryReactor* JoinRound(grpc::CallbackServerContext* ctx,
                                      const v1::JoinRoundRequest* req,
                                      v1::JoinRoundResponse*) override {
    return simple(ctx, kJoinRound, [&](CoordinatorCore& core) { return core.join_round(*req); });
  }
  grpc::ServerUnaryReactor* ReportGroup(grpc::CallbackServerContext* ctx,
                                        const v1::ReportGroupRequest* req,
                                        v1::ReportGroupResponse*) override {
    return simple(ctx, kReportGroup,
                  [&](CoordinatorCore& core) { return core.report_group(*req); });
  }
  grpc::ServerUnaryReactor* PushLogs(grpc::CallbackServerContext* ctx,
                                     const v1::PushLogsRequest* req,
                                     v1::PushLogsResponse*) override {
    return simple(ctx, kPushLogs, [&](CoordinatorCore& core) { return core.push_logs(*req); });
  }
  grpc::ServerUnaryReactor* SubmitJob(grpc::CallbackServerContext* ctx,
                                      const v1::SubmitJobRequest* req,
                                      v1::SubmitJobResponse* resp) override {
    return simple(ctx, kSubmitJob,
                  [&](CoordinatorCore& core) { return core.submit_job(*req, resp); });
  }
  grpc::ServerUnaryReactor* CancelJob(grpc::CallbackServerContext* ctx,
                                      const v1::CancelJobRequest* req,
                                      v1::CancelJobResponse*) override {
    return simple(ctx, kCancelJob, [&](CoordinatorCore& core) { return core.cancel_job(*req); });
  }
  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* ctx, const v1::GetStatusRequest*,
                                      v1::GetStatusResponse* resp) override {
    return simple(ctx, kGetStatus, [&](CoordinatorCore& core) {
      core.get_status(resp);
      return RpcStatus::ok();
    });
  }

  grpc::ServerUnaryReactor* Sync(grpc::CallbackServerContext* ctx, const v1::SyncRequest* req,
                                 v1::SyncResponse* resp) override {
    auto* reactor = new SyncReactor(s_);
    return answer_or_park(
        ctx, kSync, reactor, [&](CoordinatorCore& core, grpc::ServerUnaryReactor*) {
          RpcStatus st = core.sync(*req, resp);
          bool unchanged = st.is_ok() && resp->version() == req->known_version();
          if (unchanged && req->wait_ms() > 0 && !s_.stopping_) {
            uint64_t id = s_.polls_.park_sync(
                core, req->node_id(), req->known_version(), req->omit_unchanged(),
                deadline(req->wait_ms()),
                [reactor, resp](const RpcStatus& answer, v1::SyncResponse& fresh) {
                  if (answer.is_ok()) *resp = std::move(fresh);
                  reactor->Finish(to_grpc(answer));
                });
            reactor->parked(req->node_id(), id);
            return std::optional<RpcStatus>();
          }
          return std::optional<RpcStatus>(st);
        });
  }

  grpc::ServerUnaryReactor* WatchJob(grpc::CallbackServerContext* ctx,
                                     const v1::WatchJobRequest* req,
                                     v1::WatchJobResponse* resp) override {
    return answer_or_park(ctx, kWatchJob, ctx->DefaultReactor(),
                          [&](CoordinatorCore& core, grpc::ServerUnaryReactor* reactor) {
                            RpcStatus st = core.watch_job(*req, resp);
                            bool nothing = st.is_ok() && resp->events().empty() && !resp->done();
                            if (nothing && req->wait_ms() > 0 && !s_.stopping_) {
                              s_.polls_.park_watch(*req, deadline(req->wait_ms()),
                                                   [reactor, resp](const RpcStatus& answer,
                                                                   v1::WatchJobResponse& fresh) {
                                                     *resp = std::move(fresh);
                                                     reactor->Finish(to_grpc(answer));
                                                   });
                              return std::optional<RpcStatus>();
                            }
                            return std::optional<RpcStatus>(st);
                          });
  }

 private:
  static grpc::Status unauthenticated() {
    return {grpc::StatusCode::UNAUTHENTICATED,
            "wrong or missing token: every node and launcher must use the coordinator's token "
            "(ACCEL_TOKEN or token_file)"};
  }

  std::chrono::steady_clock::time_point deadline(int64_t wait_ms) const {
    return std::chrono::steady_clock::now() +
           std::min(std::chrono::milliseconds(wait_ms), s_.options_.max_wait);
  }

  // Checks the token, runs `f` on the core under the lock and answers with its status; when
  // `f` returns none it has parked the reactor, which collect_ready answers later.
  // `method` names the call in the metrics, which count it with its outcome (a parked call as
  // "PARKED") and time it up to its answer or its parking: the coordinator's work, not the wait.
  template <class F>
  grpc::ServerUnaryReactor* answer_or_park(grpc::CallbackServerContext* ctx, Method method,
                                           grpc::ServerUnaryReactor* reactor, F f) {
    auto began = std::chrono::steady_clock::now();
    if (!rpc::token_matches(*ctx, s_.options_.token)) {
      s_.note_refused(ctx->peer());
      s_.note_call(method, kUnauthenticated, began);
      reactor->Finish(unauthenticated());
      return reactor;
    }
    std::optional<RpcStatus> st;
    {
      std::lock_guard lock(s_.mu_);
      st = f(s_.core_, reactor);
    }
    if (!st) {
      s_.note_call(method, kParked, began);
      return reactor;
    }
    s_.note_call(method, outcome(st->code), began);
    s_.wake();
    reactor->Finish(to_grpc(*st));
    return reactor;
  }

  template <class F>
  grpc::ServerUnaryReactor* simple(grpc::CallbackServerContext* ctx, Method method, F f) {
    return answer_or_park(ctx, method, ctx->DefaultReactor(),
                          [&](CoordinatorCore& core, grpc::ServerUnaryReactor*) {
                            return std::optional<RpcStatus>(f(core));
                          });
  }

  CoordinatorServer& s_;
};

std::chrono::milliseconds keepalive_interval(std::chrono::milliseconds lease) {
  return std::max(std::chrono::milliseconds(50), lease / 5);
}

namespace {

// What the core may assume of this transport: a dead connection is closed within two keepalive
// intervals (a ping, then its timeout: a fifth of the lease each), half the lease with room to
// spare; and agents with nothing to report may park their Sync for idle_wait (at most max_wait).
// Why never more than half the lease: a poll that ends must leave its node time to poll again.
ServerOptions with_transport(ServerOptions o) {
  o.core.dead_connection_within = o.core.lease / 2;
  o.core.idle_wait = std::min(o.idle_wait, o.max_wait);
  return o;
}

}  // namespace

CoordinatorServer::CoordinatorServer(ServerOptions options, const Clock& clock)
    : options_(with_transport(std::move(options))), clock_(clock), core_(clock, options_.core) {}

std::vector<std::string> exposure_warnings(const ServerOptions& options) {
  std::vector<std::string> out;
  // Why the length matters more without tls_cert: the TLS certificate is derived from the token
  // and shown to anyone who connects, so a short token can be guessed offline from it.
  if (options.token.size() < kMinTokenBytes) {
    out.push_back("the token is " + std::to_string(options.token.size()) +
                  " bytes long; use at least " + std::to_string(kMinTokenBytes) +
                  " random bytes (openssl rand -hex 32)" +
                  (options.tls.server_tls()
                       ? std::string()
                       : ": the TLS certificate derived from it lets anyone who reaches the "
                         "port try guesses offline"));
  }
  return out;
}

Result<std::unique_ptr<CoordinatorServer>> CoordinatorServer::start(ServerOptions options,
                                                                    const Clock& clock) {
  if (options.token.empty()) return Status::error("the coordinator needs a token");
  if (auto creds = rpc::server_credentials(options.tls, options.token); !creds)
    return creds.status();
  rpc::install_grpc_log_hook();
  std::unique_ptr<CoordinatorServer> self(new CoordinatorServer(std::move(options), clock));
  self->accept_failures_seen_ = rpc::grpc_accept_failures();
  if (!self->listen(self->options_.listen_address)) {
    return Status::error("cannot listen on " + self->options_.listen_address +
                         " (the port is in use, or the address is not one of this host's)");
  }
  self->ticker_ = std::thread([p = self.get()] { p->ticker(); });
  return self;
}

bool CoordinatorServer::listen(const std::string& address) {
  auto creds = rpc::server_credentials(options_.tls, options_.token);
  if (!creds) return false;
  const auto& lim = options_.limits;
  auto service = std::make_unique<Service>(*this);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(address, *creds, &port);
  builder.RegisterService(service.get());
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  // Why pings of our own: a parked Sync keeps its node alive, so a dead machine or a partition
  // must close its connection (and cancel the Sync) well within the lease; without data on the
  // connection gRPC would otherwise stop after two pings.
  const int keepalive = static_cast<int>(keepalive_interval(options_.core.lease).count());
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, keepalive);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, keepalive);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_SENT_PING_INTERVAL_WITHOUT_DATA_MS, keepalive);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  // Why: SO_REUSEPORT would let two coordinators bind one port and split the agents.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                             static_cast<int>(lim.handshake_timeout.count()));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, lim.max_streams_per_connection);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                             static_cast<int>(lim.max_connection_idle.count()));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS,
                             static_cast<int>(lim.max_connection_age.count()));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS,
                             static_cast<int>(lim.max_connection_age_grace.count()));
  builder.SetMaxReceiveMessageSize(lim.max_message_bytes);
  builder.SetMaxSendMessageSize(lim.max_message_bytes);
  grpc::ResourceQuota quota("accel-coordinator");
  quota.Resize(lim.memory_quota_bytes);
  builder.SetResourceQuota(quota);
  auto server = builder.BuildAndStart();
  if (!server || port == 0) return false;
  std::lock_guard lock(server_mu_);
  service_ = std::move(service);
  server_ = std::move(server);
  port_ = port;
  return true;
}

std::vector<std::function<void()>> CoordinatorServer::take_parked(const std::string& why) {
  return polls_.take_all(core_, RpcStatus::error(Code::kUnavailable, why));
}

void CoordinatorServer::cancel_parked(SyncReactor& reactor) {
  std::function<void()> finish;
  {
    std::lock_guard lock(mu_);
    // Empty when the call was answered first (its answer finishes it) or never parked.
    if (reactor.id_ != 0) finish = polls_.cancel_sync(core_, reactor.node_id_, reactor.id_);
  }
  if (finish) finish();
}

void CoordinatorServer::rebuild_listener() {
  std::vector<std::function<void()>> finish;
  {
    std::lock_guard lock(mu_);
    if (stopping_) return;
    // Why: the parked calls belong to the old server; their clients retry on the new one.
    finish = take_parked("coordinator listener restarting");
  }
  for (auto& f : finish) f();
  std::unique_ptr<grpc::Server> old_server;
  std::unique_ptr<Service> old_service;
  {
    std::lock_guard lock(server_mu_);
    old_server = std::move(server_);
    old_service = std::move(service_);
  }
  if (old_server) old_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  old_server.reset();
  old_service.reset();
  // The same port, so agents and launchers find it where they left it.
  const auto address = options_.listen_address.substr(0, options_.listen_address.rfind(':')) + ":" +
                       std::to_string(port_);
  listener_down_ = !listen(address);
  if (!listener_down_) rebuilds_.fetch_add(1);
  std::fprintf(
      stderr,
      "accel: coordinator: gRPC stopped accepting connections (out of file descriptors); %s\n",
      listener_down_ ? "listening again failed, retrying every second"
                     : ("listening again on " + address).c_str());
}

CoordinatorServer::~CoordinatorServer() { shutdown(); }

void CoordinatorServer::shutdown() {
  std::vector<std::function<void()>> finish;
  {
    std::lock_guard lock(mu_);
    if (stopping_) return;
    stopping_ = true;
    finish = take_parked("coordinator shutting down");
  }
  tick_cv_.notify_all();
  for (auto& f : finish) f();
  if (ticker_.joinable()) ticker_.join();
  std::lock_guard lock(server_mu_);
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
}

void CoordinatorServer::with_core(const std::function<void(CoordinatorCore&)>& f) {
  {
    std::lock_guard lock(mu_);
    f(core_);
  }
  wake();
}

void CoordinatorServer::collect_ready(std::vector<std::function<void()>>& finish, bool expire) {
  auto ready =
      polls_.collect(core_, core_.take_changes(), std::chrono::steady_clock::now(), expire);
  for (auto& f : ready) finish.push_back(std::move(f));
}

void CoordinatorServer::note_call(size_t method, size_t outcome,
                                  std::chrono::steady_clock::time_point began) {
  static_assert(std::size(kMethodNames) == kMethods && std::size(kOutcomeNames) == kOutcomes);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  std::lock_guard lock(stats_mu_);
  ++calls_[method][outcome];
  latency_[method].observe(seconds);
}

void CoordinatorServer::write_metrics(metrics::Exposition& out) {
  using metrics::Type;
  size_t parked_syncs = 0, parked_watches = 0;
  {
    std::lock_guard lock(mu_);
    core_.write_metrics(out);
    parked_syncs = polls_.syncs();
    parked_watches = polls_.watches();
  }
  out.family("accel_coordinator_parked_calls", Type::kGauge,
             "Long polls waiting for a change: agents' syncs and launchers' job watches.");
  out.sample("accel_coordinator_parked_calls", {{"method", "Sync"}},
             static_cast<double>(parked_syncs));
  out.sample("accel_coordinator_parked_calls", {{"method", "WatchJob"}},
             static_cast<double>(parked_watches));
  out.single("accel_coordinator_listener_rebuilds_total", Type::kCounter,
             "Times the gRPC listener was rebuilt after it stopped accepting.",
             static_cast<double>(rebuilds_.load()));
  std::lock_guard lock(stats_mu_);
  out.family("accel_coordinator_rpcs_total", Type::kCounter,
             "Calls handled by method and outcome (PARKED: a long poll that waits for a change; "
             "UNAUTHENTICATED: a wrong or missing token).");
  for (size_t m = 0; m < kMethods; ++m) {
    for (size_t o = 0; o < kOutcomes; ++o) {
      if (calls_[m][o] == 0) continue;
      out.sample("accel_coordinator_rpcs_total",
                 {{"method", kMethodNames[m]}, {"code", kOutcomeNames[o]}},
                 static_cast<double>(calls_[m][o]));
    }
  }
  out.family("accel_coordinator_rpc_duration_seconds", Type::kHistogram,
             "Time to handle a call, up to its answer or its parking (not the long poll's wait).");
  for (size_t m = 0; m < kMethods; ++m) {
    if (latency_[m].count() > 0)
      latency_[m].write(out, "accel_coordinator_rpc_duration_seconds",
                        {{"method", kMethodNames[m]}});
  }
}

std::string CoordinatorServer::status_page(int refresh_s) {
  std::lock_guard lock(mu_);
  return core_.status_page(refresh_s);
}

void CoordinatorServer::note_refused(const std::string& peer) {
  if (!options_.on_warning) return;
  std::string text;
  {
    std::lock_guard lock(refused_mu_);
    ++refused_;
    auto now = std::chrono::steady_clock::now();
    // Why at most every 10 s: a client retrying with a wrong token must not flood the log.
    if (refused_told_ != std::chrono::steady_clock::time_point{} &&
        now - refused_told_ < std::chrono::seconds(10))
      return;
    text = "refused " + std::to_string(refused_) +
           " call(s) with a wrong or missing token; the last from " + peer.substr(0, 100) +
           " (a node or launcher with another token, or someone probing the port)";
    refused_ = 0;
    refused_told_ = now;
  }
  options_.on_warning(text);
}

void CoordinatorServer::wake() {
  std::vector<std::function<void()>> finish;
  {
    std::lock_guard lock(mu_);
    collect_ready(finish, /*expire=*/false);
  }
  for (auto& f : finish) f();
}

void CoordinatorServer::ticker() {
  std::unique_lock lock(mu_);
  auto last_try = std::chrono::steady_clock::now();
  while (!stopping_) {
    // Why not only every tick: a lease lapses at a known time, and its node is lost then (the
    // tick adds up to 100 ms to lost-node detection otherwise).
    auto wait = options_.tick;
    const auto due = core_.next_lease_check();
    const auto now = clock_.now();
    if (due > now && due - now < wait) {
      wait = std::chrono::duration_cast<std::chrono::milliseconds>(due - now) +
             std::chrono::milliseconds(1);
    }
    tick_cv_.wait_for(lock, wait);
    if (stopping_) break;
    // Why: gRPC 1.51's listener gives up for good when accept4 fails (EMFILE/ENFILE: a
    // connection flood ran the process out of descriptors); it only logs "Failed accept4",
    // which rpc::install_grpc_log_hook counts.
    uint64_t failures = rpc::grpc_accept_failures();
    bool retry =
        listener_down_ && std::chrono::steady_clock::now() - last_try >= std::chrono::seconds(1);
    if (failures != accept_failures_seen_ || retry) {
      accept_failures_seen_ = failures;
      last_try = std::chrono::steady_clock::now();
      lock.unlock();
      rebuild_listener();
      lock.lock();
      continue;
    }
    core_.tick();
    std::vector<std::function<void()>> finish;
    collect_ready(finish, /*expire=*/true);
    lock.unlock();
    for (auto& f : finish) f();
    lock.lock();
  }
}

}  // namespace accel::coordinator

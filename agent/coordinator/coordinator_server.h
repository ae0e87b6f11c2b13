// CoordinatorServer: hosts a CoordinatorCore behind gRPC (callback API), checks the token on
// every call, parks long polls (Sync, WatchJob) until the core says something changed, and
// ticks the core's clock. Hosted by accel-launch (mode 2, machine rank 0) and by
// `accel-agent --serve-coordinator` (mode 3).
//
// Threads: gRPC's callback threads run the handlers; one ticker thread applies time. Both take
// `mu_` around every use of the core; parked calls are finished outside it.
#pragma once

#include <grpcpp/grpcpp.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "agent/common/clock.h"
#include "agent/common/status.h"
#include "agent/coordinator/coordinator_core.h"
#include "agent/coordinator/long_polls.h"
#include "agent/metrics/exposition.h"
#include "agent/rpc/rpc_security.h"

namespace accel::coordinator {

// What one peer, with or without the token, can hold of the server's connections and memory.
// The defaults serve thousands of agents (each holds one connection with one parked call).
struct ConnectionLimits {
  // A connection must finish TLS and send its HTTP/2 settings within this, or it is closed: a
  // peer that opens connections and sends nothing holds each only this long.
  std::chrono::milliseconds handshake_timeout{10'000};
  int max_streams_per_connection = 1024;                       // concurrent calls on one connection
  std::chrono::milliseconds max_connection_idle{600'000};      // closed after 10 min without a call
  std::chrono::milliseconds max_connection_age{7'200'000};     // clients reconnect every 2 h
  std::chrono::milliseconds max_connection_age_grace{40'000};  // > max_wait: parked polls finish
  std::size_t memory_quota_bytes =
      1u << 30;                     // gRPC's buffers for all connections together (4096 agents fit)
  int max_message_bytes = 4 << 20;  // one request or reply
};

struct ServerOptions {
  // Port 0: any free port (see port()). "0.0.0.0:P" serves every interface.
  std::string listen_address = "0.0.0.0:29400";
  std::string token;  // required: every call must carry it
  rpc::TlsFiles tls;
  CoordinatorOptions core;
  ConnectionLimits limits;
  std::chrono::milliseconds tick{100};
  std::chrono::milliseconds max_wait{30'000};  // bound on a long poll's wait_ms
  // The wait agents with nothing to report are told (CoordinatorOptions::idle_wait; at most
  // max_wait; 0: every agent syncs every core.sync_wait). core.idle_wait and
  // core.dead_connection_within are set from this, the lease and the keepalive pings.
  std::chrono::milliseconds idle_wait{30'000};
  // Told of calls refused for a wrong or missing token (who sent the last, how many), at most
  // once per 10 s; from gRPC's threads. Unset: not told.
  std::function<void(const std::string&)> on_warning;
};

// How often the server pings each connection, and how long it waits for the answer, before it
// closes the connection (and cancels its parked calls): a fifth of the lease.
std::chrono::milliseconds keepalive_interval(std::chrono::milliseconds lease);

// The token length below which exposure_warnings() warns.
inline constexpr std::size_t kMinTokenBytes = 16;

// What is risky about serving with `options`, one sentence each: a token shorter than
// kMinTokenBytes (guessable; offline, from the token's TLS certificate, when no tls_cert is set).
std::vector<std::string> exposure_warnings(const ServerOptions& options);

class CoordinatorServer {
 public:
  // Binds and starts serving. The error names the address (a port in use, a bad certificate).
  static Result<std::unique_ptr<CoordinatorServer>> start(ServerOptions options,
                                                          const Clock& clock);
  ~CoordinatorServer();
  CoordinatorServer(const CoordinatorServer&) = delete;
  CoordinatorServer& operator=(const CoordinatorServer&) = delete;

  [[nodiscard]] int port() const { return port_; }
  // How often the listener was rebuilt after gRPC stopped accepting (see coordinator_server.cpp).
  [[nodiscard]] uint64_t listener_rebuilds() const { return rebuilds_.load(); }
  // Answers every parked call and stops serving (bounded: 2 s).
  void shutdown();

  // Runs `f` on the core under the server's lock, then wakes what it changed: how the launcher
  // that hosts the coordinator submits and watches without a network hop.
  void with_core(const std::function<void(CoordinatorCore&)>& f);

  // The core's metrics with the server's own: calls by method and outcome, their handling time,
  // parked long polls (any thread).
  void write_metrics(metrics::Exposition& out);
  // The core's status page (any thread).
  std::string status_page(int refresh_s);

  class Service;      // the gRPC adapter (coordinator_server.cpp)
  class SyncReactor;  // a Sync call that hears its cancellation

 private:
  CoordinatorServer(ServerOptions options, const Clock& clock);
  // Builds service_ and server_ on `address`; false when gRPC cannot listen there.
  bool listen(const std::string& address);
  // gRPC stopped accepting: answers the parked calls, shuts the old listener down and builds a
  // new one on the same port over the same core. Called by the ticker, without mu_.
  void rebuild_listener();
  // Under mu_: empties the parked calls; the returned functions answer them UNAVAILABLE (`why`),
  // to be run outside mu_.
  std::vector<std::function<void()>> take_parked(const std::string& why);
  // A Sync's call was cancelled: forgets it if parked and answers it (without mu_).
  void cancel_parked(SyncReactor& reactor);
  void ticker();
  // Under mu_: collects the parked calls the core's changes answer, and with `expire` (the
  // ticker) those whose wait is over.
  void collect_ready(std::vector<std::function<void()>>& finish, bool expire);
  void wake();

  friend class Service;
  friend class SyncReactor;

  ServerOptions options_;
  const Clock& clock_;
  // Calls refused for their token since the last warning, and when that was (guarded by
  // refused_mu_).
  void note_refused(const std::string& peer);
  // The calls the metrics count: by method (the service's, in the order of kMethodNames in
  // coordinator_server.cpp) and outcome (the core's Code, then parked, then unauthenticated).
  // Why fixed arrays: a sync is the coordinator's hottest path; counting it allocates nothing.
  static constexpr size_t kMethods = 9;
  static constexpr size_t kOutcomes = 9;
  // A handled call (any thread; takes stats_mu_).
  void note_call(size_t method, size_t outcome, std::chrono::steady_clock::time_point began);
  std::mutex stats_mu_;  // guards calls_ and latency_
  std::array<std::array<uint64_t, kOutcomes>, kMethods> calls_{};
  std::vector<metrics::Histogram> latency_ =
      std::vector<metrics::Histogram>(kMethods, metrics::Histogram::latency());
  std::mutex refused_mu_;
  uint64_t refused_ = 0;
  std::chrono::steady_clock::time_point refused_told_{};
  std::mutex mu_;  // guards core_, polls_, stopping_
  CoordinatorCore core_;
  LongPolls polls_;
  bool stopping_ = false;
  std::condition_variable tick_cv_;
  std::mutex server_mu_;  // guards service_ and server_ (rebuild_listener swaps them)
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  std::thread ticker_;
  int port_ = 0;
  uint64_t accept_failures_seen_ = 0;  // ticker thread only
  bool listener_down_ = false;         // ticker thread only: a rebuild has not succeeded yet
  std::atomic<uint64_t> rebuilds_{0};
};

}  // namespace accel::coordinator

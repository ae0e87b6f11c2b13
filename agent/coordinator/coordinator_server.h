// CoordinatorServer: hosts a CoordinatorCore behind gRPC (callback API), checks the token on
// every call, parks long polls (Sync, WatchJob) until the core says something changed, and
// ticks the core's clock. Hosted by accel-launch (mode 2, machine rank 0) and by
// `accel-agent --serve-coordinator` (mode 3).
//
// Threads: gRPC's callback threads run the handlers; one ticker thread applies time. Both take
// `mu_` around every use of the core; parked calls are finished outside it.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
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
#include "agent/rpc/rpc_security.h"

namespace accel::coordinator {

struct ServerOptions {
  std::string listen_address = "0.0.0.0:29400";  // port 0: any free port (see port())
  std::string token;                              // required: every call must carry it
  rpc::TlsFiles tls;
  CoordinatorOptions core;
  std::chrono::milliseconds tick{100};
  std::chrono::milliseconds max_wait{30'000};     // bound on a long poll's wait_ms
};

class CoordinatorServer {
 public:
  // Binds and starts serving. The error names the address (a port in use, a bad certificate).
  static Result<std::unique_ptr<CoordinatorServer>> start(ServerOptions options, const Clock& clock);
  ~CoordinatorServer();
  CoordinatorServer(const CoordinatorServer&) = delete;
  CoordinatorServer& operator=(const CoordinatorServer&) = delete;

  [[nodiscard]] int port() const { return port_; }
  // Answers every parked call and stops serving (bounded: 2 s).
  void shutdown();

  // Runs `f` on the core under the server's lock, then wakes what it changed: how the launcher
  // that hosts the coordinator submits and watches without a network hop.
  void with_core(const std::function<void(CoordinatorCore&)>& f);

  class Service;  // the gRPC adapter (coordinator_server.cpp)

 private:
  CoordinatorServer(ServerOptions options, const Clock& clock);
  void ticker();
  // Under mu_: collects the parked calls the core's changes answer, and with `expire` (the
  // ticker) those whose wait is over.
  void collect_ready(std::vector<std::function<void()>>& finish, bool expire);
  void wake();

  friend class Service;
  struct ParkedSync {
    grpc::ServerUnaryReactor* reactor;
    v1::SyncResponse* resp;
    uint64_t known;
    std::chrono::steady_clock::time_point deadline;
  };
  struct ParkedWatch {
    grpc::ServerUnaryReactor* reactor;
    v1::WatchJobRequest req;
    v1::WatchJobResponse* resp;
    std::chrono::steady_clock::time_point deadline;
  };

  ServerOptions options_;
  const Clock& clock_;
  std::mutex mu_;  // guards core_, parked_syncs_, parked_watches_, stopping_
  CoordinatorCore core_;
  std::map<std::string, std::vector<ParkedSync>> parked_syncs_;
  std::map<std::string, std::vector<ParkedWatch>> parked_watches_;
  bool stopping_ = false;
  std::condition_variable tick_cv_;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  std::thread ticker_;
  int port_ = 0;
};

}  // namespace accel::coordinator

// StoreServer: serves StoreCore (c10d's TCPStore protocol) on a TCP port, on the caller's
// io_context. The launcher binds it before it starts any worker and holds it for the whole job;
// workers connect as clients (TORCHELASTIC_USE_AGENT_STORE=True).
//
// Bounds: at most max_connections clients (more are accepted and closed at once); a client
// that sends a malformed or over-limit request, or leaves more than 64 MiB of replies unread,
// is disconnected with a warning (the first 20, then one in 1000).
//
// Thread: everything on the io_context passed in.
#pragma once

#include <boost/asio/io_context.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "agent/common/status.h"
#include "agent/store/store_core.h"

namespace accel::store {

struct StoreServerOptions {
  std::string host = "127.0.0.1";  // an address of this machine, or a name resolving to one
  int port = 0;                    // 0: the kernel picks a free port
  StoreLimits limits{};
  size_t max_connections = 16384;  // torch 1.13 opens two per rank
  std::function<void(const std::string&)> warn{};
};

class StoreServer {
 public:
  // Binds and listens (before returning: a client may connect at once). Errors say the address
  // and why ("MASTER_PORT 29500 on 127.0.0.1 is in use by another process").
  static Result<std::unique_ptr<StoreServer>> listen(boost::asio::io_context& io,
                                                     StoreServerOptions options);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  [[nodiscard]] int port() const;
  // Drops every client and every key: the next attempt starts on an empty store, and nothing a
  // process of the last one still sends can reach it.
  void reset();
  [[nodiscard]] size_t connections() const;
  // What the store has carried since it was bound (reset() keeps the counts).
  struct Traffic {
    uint64_t connections = 0;  // accepted, refused ones included
    uint64_t received_bytes = 0;
    uint64_t sent_bytes = 0;
  };
  [[nodiscard]] const Traffic& traffic() const;
  [[nodiscard]] const StoreCore& core() const;

  struct Impl;

 private:
  explicit StoreServer(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

}  // namespace accel::store

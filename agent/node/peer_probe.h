// Peer probes: whether this node reaches the other nodes of its round, over the network the
// workers use. Every agent of a multi-node job listens on a probe port (ProbeListener: it accepts
// a TCP connection and closes it, nothing more) and registers it with the coordinator, which
// gives each node the probe ports of its neighbours in node-rank order and of node rank 0 (the
// store's host). PeerWatch connects to each of them every interval: an answer (or a refusal,
// which also comes from the peer's host) means the peer is reachable; a connection that times out
// or finds no route does not. A peer without an answer for network_timeout is a partition: the
// agent reports it naming both hosts, long before a collective or hang timeout would fire; and a
// round's workers start only once every peer answered (see NodeAgent::start_group).
//
// Thread: the io_context's, for both classes.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace accel::node {

// Accepts and closes connections on `address` (any address when it is not a literal this machine
// holds), port 0 (any).
class ProbeListener {
 public:
  // Null when nothing can be bound (`why` says so).
  static std::unique_ptr<ProbeListener> open(boost::asio::io_context& io,
                                             const std::string& address, std::string& why);
  ~ProbeListener();
  ProbeListener(const ProbeListener&) = delete;
  ProbeListener& operator=(const ProbeListener&) = delete;
  [[nodiscard]] int port() const { return port_; }

 private:
  explicit ProbeListener(boost::asio::io_context& io);
  void accept();

  boost::asio::ip::tcp::acceptor acceptor_;
  boost::asio::steady_timer retry_;
  int port_ = 0;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
};

struct PeerTarget {
  int node_rank = 0;
  std::string node_id;
  std::string hostname;
  std::string address;  // a name or a numeric address
  int port = 0;         // its probe port
};

// A peer that has not answered for a while.
struct Silence {
  PeerTarget peer;
  std::chrono::milliseconds for_{0};
  int64_t since_unix_ms = 0;  // its last answer, or when probing started when it never answered
};

// "h2 cannot reach h3 (10.0.0.3) since 13:50:13.007 (for 10.4 s)"; several peers joined by "; ".
std::string describe_silences(const std::string& self_host, const std::vector<Silence>& silences);

// How often each peer is probed for a given timeout: a fifth of it, within [200 ms, 2 s].
std::chrono::milliseconds probe_interval(std::chrono::milliseconds timeout);

class PeerWatch {
 public:
  // `on_round` runs after each round of probes (every probe answered, failed or timed out).
  PeerWatch(boost::asio::io_context& io, std::vector<PeerTarget> peers,
            std::chrono::milliseconds interval, std::function<void()> on_round);
  ~PeerWatch();
  PeerWatch(const PeerWatch&) = delete;
  PeerWatch& operator=(const PeerWatch&) = delete;

  void start();
  // Every peer answered in the last complete round.
  [[nodiscard]] bool all_answered() const;
  // The peers whose last answer (or the start, for one that never answered) is older than
  // `at_least`, as of now.
  [[nodiscard]] std::vector<Silence> silent_for(std::chrono::milliseconds at_least) const;
  [[nodiscard]] const std::vector<PeerTarget>& peers() const { return peers_; }

 private:
  struct Probe;
  void run_round();
  void probe_done(std::size_t i, bool answered);

  boost::asio::io_context& io_;
  std::vector<PeerTarget> peers_;
  std::chrono::milliseconds interval_;
  std::function<void()> on_round_;
  std::chrono::steady_clock::time_point started_;
  int64_t started_unix_ms_ = 0;
  struct State {
    bool ever = false;
    bool answered_last = false;
    std::chrono::steady_clock::time_point last;
    int64_t last_unix_ms = 0;
  };
  std::vector<State> state_;
  std::vector<std::shared_ptr<Probe>> probes_;  // the round in flight
  std::size_t pending_ = 0;
  boost::asio::steady_timer next_;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
};

}  // namespace accel::node

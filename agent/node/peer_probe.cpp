// Peer probes: a listener that only accepts, and a prober that connects to each peer in rounds.
#include "agent/node/peer_probe.h"

#include <fcntl.h>

#include <algorithm>
#include <boost/asio/connect.hpp>
#include <boost/asio/ip/address.hpp>

#include "agent/common/clock.h"

namespace accel::node {

namespace asio = boost::asio;
using asio::ip::tcp;
using std::chrono::milliseconds;
using std::chrono::steady_clock;

namespace {

int64_t now_unix_ms() { return SystemClock().unix_ms(); }

}  // namespace

// ------------------------------------------------------------------------------ listener

ProbeListener::ProbeListener(asio::io_context& io) : acceptor_(io), retry_(io) {}

ProbeListener::~ProbeListener() {
  *alive_ = false;
  retry_.cancel();
  boost::system::error_code ec;
  acceptor_.close(ec);
}

std::unique_ptr<ProbeListener> ProbeListener::open(asio::io_context& io, const std::string& address,
                                                   std::string& why) {
  std::unique_ptr<ProbeListener> l(new ProbeListener(io));
  // Why the node's own address first: the probe must cross the network the workers use; any
  // address when that is a name or not bindable (the probe answers on every interface then).
  std::vector<asio::ip::address> tries;
  boost::system::error_code ec;
  auto literal = asio::ip::make_address(address, ec);
  if (!ec) tries.push_back(literal);
  tries.push_back(asio::ip::address_v4::any());
  for (const auto& a : tries) {
    boost::system::error_code e;
    tcp::endpoint ep(a, 0);
    l->acceptor_.open(ep.protocol(), e);
    // Why CLOEXEC: workers are forked from this thread; none may hold the probe port.
    if (!e) ::fcntl(l->acceptor_.native_handle(), F_SETFD, FD_CLOEXEC);
    if (!e) l->acceptor_.bind(ep, e);
    if (!e) l->acceptor_.listen(asio::socket_base::max_listen_connections, e);
    if (!e) {
      l->port_ = l->acceptor_.local_endpoint(e).port();
      if (!e) {
        l->accept();
        return l;
      }
    }
    why = "cannot listen for peer probes on " + a.to_string() + ": " + e.message();
    boost::system::error_code ignored;
    l->acceptor_.close(ignored);
  }
  return nullptr;
}

void ProbeListener::accept() {
  acceptor_.async_accept([this, alive = alive_](boost::system::error_code ec, tcp::socket s) {
    if (!*alive || ec == asio::error::operation_aborted) return;
    if (ec) {
      // Why a pause: an accept that fails at once (no descriptors left) must not spin.
      retry_.expires_after(std::chrono::milliseconds(100));
      retry_.async_wait([this, alive](const boost::system::error_code& e) {
        if (!e && *alive) accept();
      });
      return;
    }
    // The connection itself is the answer: closed at once (s goes out of scope).
    boost::system::error_code ignored;
    s.close(ignored);
    accept();
  });
}

// ------------------------------------------------------------------------------- prober

std::chrono::milliseconds probe_interval(milliseconds timeout) {
  return std::clamp(timeout / 5, milliseconds(200), milliseconds(2000));
}

std::string describe_silences(const std::string& self_host, const std::vector<Silence>& silences) {
  std::string out;
  for (const auto& s : silences) {
    std::string peer = s.peer.hostname.empty() ? s.peer.node_id : s.peer.hostname;
    out += (out.empty() ? "" : "; ") + self_host + " cannot reach " + peer + " (" + s.peer.address +
           ") since " + clock_time(s.since_unix_ms) + " (for " +
           seconds_text(static_cast<double>(s.for_.count()) / 1000.0) + ")";
  }
  return out;
}

struct PeerWatch::Probe {
  explicit Probe(asio::io_context& io) : resolver(io), socket(io), deadline(io) {}
  tcp::resolver resolver;
  tcp::socket socket;
  asio::steady_timer deadline;
  bool done = false;
  // Ends the probe: its handlers still to run see `done` and do nothing.
  void stop() {
    done = true;
    resolver.cancel();
    boost::system::error_code ignored;
    socket.close(ignored);
    deadline.cancel();
  }
};

PeerWatch::PeerWatch(asio::io_context& io, std::vector<PeerTarget> peers, milliseconds interval,
                     std::function<void()> on_round)
    : io_(io),
      peers_(std::move(peers)),
      interval_(interval),
      on_round_(std::move(on_round)),
      state_(peers_.size()),
      next_(io) {}

PeerWatch::~PeerWatch() {
  *alive_ = false;
  next_.cancel();
  for (auto& p : probes_) p->stop();
}

void PeerWatch::start() {
  started_ = steady_clock::now();
  started_unix_ms_ = now_unix_ms();
  run_round();
}

void PeerWatch::run_round() {
  const auto round_start = steady_clock::now();
  // A probe of the last round still out (its deadline not yet run) is over: its handlers see it.
  for (auto& p : probes_) p->stop();
  probes_.clear();
  pending_ = peers_.size();
  auto schedule_next = [this, round_start] {
    next_.expires_at(round_start + interval_);
    next_.async_wait([this, alive = alive_](const boost::system::error_code& ec) {
      if (!ec && *alive) run_round();
    });
  };
  if (peers_.empty()) {
    if (on_round_) on_round_();
    return;
  }
  for (std::size_t i = 0; i < peers_.size(); ++i) {
    auto probe = std::make_shared<Probe>(io_);
    probes_.push_back(probe);
    const PeerTarget& peer = peers_[i];
    // Why the deadline is the interval: a probe still unanswered then is a round without an
    // answer, and the next round starts on time.
    probe->deadline.expires_after(interval_ - milliseconds(50));
    probe->deadline.async_wait(
        [this, i, probe, alive = alive_](const boost::system::error_code& ec) {
          if (ec || !*alive || probe->done) return;
          probe_done(i, false);
        });
    probe->resolver.async_resolve(
        peer.address, std::to_string(peer.port), tcp::resolver::numeric_service,
        [this, i, probe, alive = alive_](const boost::system::error_code& ec,
                                         const tcp::resolver::results_type& results) {
          if (!*alive || probe->done) return;
          if (ec || results.empty()) return probe_done(i, false);
          // The first address only: asio's range connect would reopen the socket without
          // CLOEXEC (see the listener).
          const tcp::endpoint to = results.begin()->endpoint();
          boost::system::error_code oec;
          probe->socket.open(to.protocol(), oec);
          if (oec) return probe_done(i, false);
          ::fcntl(probe->socket.native_handle(), F_SETFD, FD_CLOEXEC);
          probe->socket.async_connect(
              to, [this, i, probe, alive](const boost::system::error_code& cec) {
                if (!*alive || probe->done) return;
                // Why a refusal counts as an answer: it comes from the peer's host, so the path
                // works (the peer's agent being gone is the coordinator's lease to find).
                probe_done(i, !cec || cec == asio::error::connection_refused);
              });
        });
  }
  schedule_next();
}

void PeerWatch::probe_done(std::size_t i, bool answered) {
  probes_.at(i)->stop();
  State& s = state_[i];
  s.answered_last = answered;
  if (answered) {
    s.ever = true;
    s.last = steady_clock::now();
    s.last_unix_ms = now_unix_ms();
  }
  if (--pending_ == 0 && on_round_) on_round_();
}

bool PeerWatch::all_answered() const {
  return std::all_of(state_.begin(), state_.end(), [](const State& s) { return s.answered_last; });
}

std::vector<Silence> PeerWatch::silent_for(milliseconds at_least) const {
  std::vector<Silence> out;
  const auto now = steady_clock::now();
  for (std::size_t i = 0; i < peers_.size(); ++i) {
    const State& s = state_[i];
    auto since = s.ever ? s.last : started_;
    auto silent = std::chrono::duration_cast<milliseconds>(now - since);
    if (silent < at_least || s.answered_last) continue;
    out.push_back({peers_[i], silent, s.ever ? s.last_unix_ms : started_unix_ms_});
  }
  return out;
}

}  // namespace accel::node

// Peer probes over real sockets on this machine: a listener answers, a refused port still
// counts as reached (the host replied), and an address nothing answers for is silent.
#include "agent/node/peer_probe.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <chrono>
#include <string>
#include <vector>

namespace accel::node {
namespace {

using std::chrono::milliseconds;

// Runs `io` until `rounds` probe rounds completed (bounded by 10 s).
int run_rounds(boost::asio::io_context& io, int& done, int rounds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (done < rounds && std::chrono::steady_clock::now() < deadline) {
    io.run_for(milliseconds(20));
    if (io.stopped()) io.restart();
  }
  return done;
}

// A port on 127.0.0.1 whose SYNs go unanswered, as across a partition: a listener that never
// accepts, its accept queue filled (Linux drops a SYN when the queue is full).
struct SilentPort {
  boost::asio::io_context io;
  boost::asio::ip::tcp::acceptor acceptor{io};
  std::vector<int> fillers;
  int port = 0;
  SilentPort() {
    boost::asio::ip::tcp::endpoint ep(boost::asio::ip::make_address("127.0.0.1"), 0);
    acceptor.open(ep.protocol());
    acceptor.bind(ep);
    acceptor.listen(0);
    port = acceptor.local_endpoint().port();
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(static_cast<uint16_t>(port));
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    for (int i = 0; i < 4; ++i) {  // non-blocking: the later ones stay in SYN_SENT
      int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      (void)::connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof to);
      fillers.push_back(fd);
    }
  }
  ~SilentPort() {
    for (int fd : fillers) ::close(fd);
  }
};

// A port on 127.0.0.1 that nothing listens on (bound, then closed).
int closed_port() {
  boost::asio::io_context io;
  boost::asio::ip::tcp::acceptor a(io, {boost::asio::ip::make_address("127.0.0.1"), 0});
  return a.local_endpoint().port();
}

TEST(PeerProbe, AListeningPeerAndARefusingHostAreReachedASilentAddressIsNot) {
  boost::asio::io_context io;
  std::string why;
  auto listener = ProbeListener::open(io, "127.0.0.1", why);
  ASSERT_NE(listener, nullptr) << why;
  ASSERT_GT(listener->port(), 0);
  int done = 0;
  SilentPort silent_port;
  std::vector<PeerTarget> peers = {
      {0, "n0", "h0", "127.0.0.1", listener->port()},
      {1, "n1", "h1", "127.0.0.1", closed_port()},
      {2, "n2", "h2", "127.0.0.1", silent_port.port},
  };
  PeerWatch watch(io, peers, milliseconds(300), [&] { ++done; });
  watch.start();
  ASSERT_EQ(run_rounds(io, done, 3), 3);
  EXPECT_FALSE(watch.all_answered());
  auto silent = watch.silent_for(milliseconds(0));
  ASSERT_EQ(silent.size(), 1u);
  EXPECT_EQ(silent[0].peer.hostname, "h2");
  EXPECT_GE(silent[0].for_, milliseconds(500));
  EXPECT_TRUE(watch.silent_for(milliseconds(60'000)).empty());
  const std::string text = describe_silences("h9", silent);
  EXPECT_EQ(text.rfind("h9 cannot reach h2 (127.0.0.1) since ", 0), 0u) << text;
  EXPECT_NE(text.find("(for "), std::string::npos) << text;

  // Only the reachable ones: every peer answered.
  done = 0;
  PeerWatch good(io, {peers[0], peers[1]}, milliseconds(300), [&] { ++done; });
  good.start();
  ASSERT_EQ(run_rounds(io, done, 1), 1);
  EXPECT_TRUE(good.all_answered());
  EXPECT_TRUE(good.silent_for(milliseconds(0)).empty());
}

TEST(PeerProbe, NoPeersIsOneImmediateRoundAndTheIntervalFollowsTheTimeout) {
  boost::asio::io_context io;
  int done = 0;
  PeerWatch none(io, {}, milliseconds(300), [&] { ++done; });
  none.start();
  EXPECT_EQ(done, 1);
  EXPECT_TRUE(none.all_answered());
  EXPECT_EQ(probe_interval(milliseconds(10'000)), milliseconds(2'000));
  EXPECT_EQ(probe_interval(milliseconds(60'000)), milliseconds(2'000));
  EXPECT_EQ(probe_interval(milliseconds(500)), milliseconds(200));
}

TEST(PeerProbe, TheListenerFallsBackToAnyAddressForANameOrAForeignAddress) {
  boost::asio::io_context io;
  std::string why;
  auto by_name = ProbeListener::open(io, "localhost", why);
  ASSERT_NE(by_name, nullptr) << why;
  auto foreign = ProbeListener::open(io, "198.51.100.7", why);  // TEST-NET-2: not ours
  ASSERT_NE(foreign, nullptr) << why;
  EXPECT_NE(by_name->port(), foreign->port());
}

}  // namespace
}  // namespace accel::node

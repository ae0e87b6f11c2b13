// The launcher's rendezvous store against real clients: Debian's torch (Python) and the libtorch
// C++ client, every operation; a store that goes away; a taken port; rank 0 leaving first; a
// restart that must not see the failed attempt's keys.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <atomic>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <cstring>
#include <thread>

#include "agent/store/store_server.h"
#include "harness.h"

namespace accel::testing {
namespace {

constexpr const char* kPython = "/usr/bin/python3";

// A StoreServer on its own io thread, as the launcher runs it.
class ServedStore {
 public:
  explicit ServedStore(store::StoreServerOptions options = {}) {
    auto server = store::StoreServer::listen(io_, std::move(options));
    EXPECT_TRUE(server) << server.message();
    if (server) server_ = std::move(*server);
    port_ = server_ ? server_->port() : 0;
    thread_ = std::thread([this] { io_.run(); });
  }
  ~ServedStore() { stop(); }
  int port() const { return port_; }
  // Closes the listener and every connection (as a killed launcher's kernel would).
  void stop() {
    if (!thread_.joinable()) return;
    boost::asio::post(io_, [this] { server_.reset(); });
    work_.reset();
    thread_.join();
  }

 private:
  boost::asio::io_context io_;
  std::optional<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> work_{
      io_.get_executor()};
  std::unique_ptr<store::StoreServer> server_;
  int port_ = 0;
  std::thread thread_;
};

// Runs a client program against a fresh store: it must print OK and exit 0.
void expect_client_passes(const std::string& binary, std::vector<std::string> args_before_port,
                          std::vector<std::string> args_after_port) {
  TempDir dir;
  ServedStore served;
  std::vector<std::string> args = std::move(args_before_port);
  args.push_back(std::to_string(served.port()));
  args.insert(args.end(), args_after_port.begin(), args_after_port.end());
  Launched client(dir, binary, args, {}, "client");
  auto r = client.wait(60s);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("OK"), std::string::npos) << r.out << r.err;
}

TEST(Store, TorchPythonClientEveryOperation) {
  expect_client_passes(kPython, {std::string(ACCEL_TEST_WORKERS_DIR) + "/store_client.py"},
                       {"ops"});
}

TEST(Store, LibtorchCppClientEveryOperation) { expect_client_passes(STORE_CLIENT_BIN, {}, {}); }

TEST(Store, AStoreThatGoesAwayFailsAWaitingClientFast) {
  TempDir dir;
  ServedStore served;
  Launched client(dir, kPython,
                  {std::string(ACCEL_TEST_WORKERS_DIR) + "/store_client.py",
                   std::to_string(served.port()), "wait"},
                  {}, "client");
  ASSERT_TRUE(
      wait_until([&] { return client.out_so_far().find("waiting") != std::string::npos; }, 60s))
      << client.err_so_far();
  std::this_thread::sleep_for(200ms);  // the WAIT is on the wire
  auto stopped = std::chrono::steady_clock::now();
  served.stop();
  auto r = client.wait(30s);
  EXPECT_FALSE(r.timed_out);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_LT(std::chrono::steady_clock::now() - stopped, 10s)
      << "the client hung on a store that is gone";
}

TEST(Store, APortTakenByAnotherProcessIsAClearErrorAndStartsNothing) {
  TempDir dir;
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(fd, 4), 0);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  auto r = run_launcher(
      dir, {"-n", "2", "--main-process-port", std::to_string(port), CONTROL_WORKER_BIN}, 60s);
  ::close(fd);
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("cannot listen on 127.0.0.1:" + std::to_string(port)), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("Address already in use"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("[rank"), std::string::npos) << "workers were started: " << r.out;
}

TEST(Store, Rank0ExitingFirstLeavesTheStoreToTheOthers) {
  TempDir dir;
  const std::string script = dir / "rank0_first.py";
  write_file(script, R"(import os, time
import torch.distributed as dist
dist.init_process_group("gloo")
store = dist.distributed_c10d._get_default_store()
if dist.get_rank() == 0:
    store.set("from0", "hello")
    os._exit(0)                       # gone, with its process group
time.sleep(1.0)
assert store.get("from0") == b"hello"
store.set("late", "1")
assert store.add("count", 2) == 2
print("rank 1 used the store after rank 0 left", flush=True)
os._exit(0)
)");
  auto r = run_launcher(dir, {"-n", "2", kPython, script}, 120s);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("rank 1 used the store after rank 0 left"), std::string::npos)
      << r.out << r.err;
}

TEST(Store, ARestartStartsOnAnEmptyStore) {
  TempDir dir;
  const std::string script = dir / "restart.py";
  write_file(script, R"(import os, sys
from datetime import timedelta
import torch.distributed as dist
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
raw = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False, timedelta(seconds=30))
dist.init_process_group("gloo")
dist.barrier()
if attempt == 0:
    raw.set("stale", "from attempt 0")
    dist.barrier()
    sys.exit(3 if dist.get_rank() == 1 else 0)
# compare_set creates a missing key only: an old value here would come back instead.
got = raw.compare_set("stale/" + os.environ["RANK"], "", "fresh")
assert got == b"fresh", got
assert raw.compare_set("stale", "", "new") == b"new", "attempt 0's key survived the restart"
print(f"attempt {attempt} rank {dist.get_rank()}: empty store", flush=True)
)");
  auto r = run_launcher(dir, {"-n", "2", "--max-restarts", "1", kPython, script}, 180s);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("attempt 1 rank 0: empty store"), std::string::npos) << r.out << r.err;
  EXPECT_NE(r.out.find("attempt 1 rank 1: empty store"), std::string::npos) << r.out << r.err;
}

}  // namespace
// --- a store under abuse, with a well-behaved job beside it --------------------------------------

// c10d's legacy wire format, as torch 1.13's clients send it (tests/unit/store_test.cpp has the
// captured frames).
std::string u8(std::uint8_t v) { return std::string(1, static_cast<char>(v)); }
std::string u64(std::uint64_t v) {
  std::string s(8, '\0');
  std::memcpy(s.data(), &v, 8);
  return s;
}
std::string str(const std::string& s) { return u64(s.size()) + s; }
constexpr std::uint8_t kSet = 0, kGet = 2, kAdd = 3, kWait = 5, kMultiGet = 10, kMultiSet = 11;

// A blocking client connection (reads bounded by 10 s).
class Raw {
 public:
  explicit Raw(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    ok_ = fd_ >= 0 && ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    int one = 1;  // as torch's client: no Nagle delay between a request's pieces
    if (ok_) ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }
  ~Raw() {
    if (fd_ >= 0) ::close(fd_);
  }
  Raw(const Raw&) = delete;
  Raw& operator=(const Raw&) = delete;
  bool ok() const { return ok_; }
  // False once the server closed the connection (or it never opened).
  bool send(const std::string& bytes) {
    size_t done = 0;
    while (ok_ && done < bytes.size()) {
      ssize_t n = ::send(fd_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0)
        ok_ = false;
      else
        done += static_cast<size_t>(n);
    }
    return ok_;
  }
  std::string recv(size_t n) {
    std::string out;
    while (out.size() < n) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 10'000) <= 0) break;
      char buf[4096];
      ssize_t got = ::read(fd_, buf, std::min(sizeof buf, n - out.size()));
      if (got <= 0) break;
      out.append(buf, static_cast<size_t>(got));
    }
    return out;
  }

 private:
  int fd_ = -1;
  bool ok_ = false;
};

// A 2-rank rendezvous as torch's TCPStore clients run one: ADD a counter, SET each rank's
// address, WAIT for both, GET both. Its wall time; a very long one when the store misbehaves.
std::chrono::milliseconds rendezvous(int port, int round) {
  auto start = std::chrono::steady_clock::now();
  Raw c(port);
  const std::string tag = "/rdzv" + std::to_string(round) + "/";
  bool ok = c.send(u8(kAdd) + str(tag + "init") + u64(1)) && c.recv(8).size() == 8;
  ok = ok && c.send(u8(kSet) + str(tag + "rank_0") + str("10.0.0.1:29500")) &&
       c.send(u8(kSet) + str(tag + "rank_1") + str("10.0.0.2:29500"));
  ok = ok && c.send(u8(kWait) + u64(2) + str(tag + "rank_0") + str(tag + "rank_1")) &&
       c.recv(1) == u8(0);
  ok = ok && c.send(u8(kGet) + str(tag + "rank_1")) && c.recv(8 + 14) == str("10.0.0.2:29500");
  auto took = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - start);
  return ok ? took : std::chrono::milliseconds(999'999);
}

// The slowest of 5 rendezvous.
std::chrono::milliseconds worst_rendezvous(int port, int& round) {
  std::chrono::milliseconds worst{0};
  for (int i = 0; i < 5; ++i) worst = std::max(worst, rendezvous(port, round++));
  return worst;
}

long rss_mb() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6)) / 1024;
  }
  return -1;
}

// Each attack of a local user on MASTER_PORT (no token, as torchrun's), while a job beside it
// rendezvous: it must stay fast (it took tens of seconds before the store bounded and indexed
// its work), and the store's memory must stay within its bound.
TEST(Store, AWellBehavedRendezvousStaysFastUnderEachAttack) {
  rlimit lim{};
  ::getrlimit(RLIMIT_NOFILE, &lim);
  if (lim.rlim_max < 1400) GTEST_SKIP() << "the test needs 1400 descriptors";
  rlimit raised{lim.rlim_max, lim.rlim_max};
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &raised), 0);
  store::StoreServerOptions options;
  options.limits.max_total_bytes = 256UL << 20;  // the 1 GiB bound, scaled to the test
  options.warn = [](const std::string&) {};      // the disconnections are expected
  ServedStore served(options);
  const int port = served.port();
  int round = 0;
  const auto quiet = worst_rendezvous(port, round);
  constexpr auto kBound = 500ms;  // the issue's target is ~100 ms; CI runs other tests beside
  std::map<std::string, std::chrono::milliseconds> during;

  // (a) Unfinished MULTI_SETs that declare 60 MiB values and stop part-way: 8 of them would
  // hold 480 MiB; the store counts what they declare against its bound before buffering.
  {
    const long before = rss_mb();
    std::vector<std::unique_ptr<Raw>> conns;
    const std::string chunk(1 << 20, 'x');
    for (int i = 0; i < 8; ++i) {
      auto c = std::make_unique<Raw>(port);
      c->send(u8(kMultiSet) + u64(1) + str("/big" + std::to_string(i)) + u64(60UL << 20));
      for (int mb = 0; mb < 40 && c->send(chunk); ++mb) {
      }
      conns.push_back(std::move(c));
    }
    during["unfinished 60 MiB MULTI_SETs"] = worst_rendezvous(port, round);
    const long grown = rss_mb() - before;
    EXPECT_LT(grown, 300) << "the store buffered " << grown << " MB of unfinished requests";
  }
  // (b) A MULTI_GET of 16,384 keys of 1,000 bytes (16 MB), sent in 64 KiB pieces while the job
  // rendezvous: each piece must cost its own bytes, not a re-read from the request's start.
  {
    std::string request = u8(kMultiGet) + u64(16384);
    for (int k = 0; k < 16384; ++k)
      request += str(std::string(992, 'k') + std::to_string(10000000 + k));
    Raw c(port);
    std::atomic<bool> done{false};
    std::thread sender([&] {
      for (size_t at = 0; at < request.size() && c.send(request.substr(at, 64 << 10));
           at += 64 << 10) {
      }
      done = true;
    });
    std::chrono::milliseconds worst{0};
    while (!done) worst = std::max(worst, rendezvous(port, round++));
    sender.join();
    during["a 16 MB MULTI_GET in pieces"] = std::max(worst, worst_rendezvous(port, round));
  }
  // (c) WAITs for a million keys that never come, from 62 connections; then all of them close
  // (each close forgets its waits: indexed, not a scan of every wait).
  {
    std::vector<std::unique_ptr<Raw>> conns;
    for (int i = 0; i < 62; ++i) {
      std::string wait = u8(kWait) + u64(16384);
      for (int k = 0; k < 16384; ++k)
        wait += str("/never/" + std::to_string(i) + "/" + std::to_string(k));
      auto c = std::make_unique<Raw>(port);
      c->send(wait);
      conns.push_back(std::move(c));
    }
    during["WAITs on a million keys"] = worst_rendezvous(port, round);
    conns.clear();
    during["those million waits' connections closing"] = worst_rendezvous(port, round);
  }
  // (d) 1,100 idle connections (past a default soft limit of 1,024 descriptors).
  {
    std::vector<std::unique_ptr<Raw>> conns;
    for (int i = 0; i < 1100; ++i) conns.push_back(std::make_unique<Raw>(port));
    during["1,100 idle connections"] = worst_rendezvous(port, round);
  }
  std::cerr << "rendezvous, slowest of 5: quiet " << quiet.count() << " ms";
  for (const auto& [attack, took] : during)
    std::cerr << "; " << attack << " " << took.count() << " ms";
  std::cerr << "\n";
  for (const auto& [attack, took] : during) {
    // Why more for a million waits: registering and forgetting them is about a million hash
    // insertions and erasures in the store's one loop (0.2-0.4 s on a 2-vCPU VM in a flat table,
    // 0.9 s, 1.6 s under CI's load, in std::unordered_map; 1.5 s in a fresh-clone CI on
    // 2026-11-30, 1 ms past a bound of 1.5 s; 67 s before waits were indexed per connection); the
    // job waits for that work once. 10x kBound is 3x the slowest seen, 13x under the unindexed.
    const bool million = attack.find("million") != std::string::npos;
    EXPECT_LT(took, million ? 10 * kBound : kBound) << "during " << attack;
  }
}

}  // namespace accel::testing

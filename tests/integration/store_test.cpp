// The launcher's rendezvous store against real clients: Debian's torch (Python) and the libtorch
// C++ client, every operation; a store that goes away; a taken port; rank 0 leaving first; a
// restart that must not see the failed attempt's keys.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <thread>

#include "agent/store/store_server.h"
#include "harness.h"

namespace accel::testing {
namespace {

constexpr const char* kPython = "/usr/bin/python3";

// A StoreServer on its own io thread, as the launcher runs it.
class ServedStore {
 public:
  ServedStore() {
    auto server = store::StoreServer::listen(io_, {});
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
  expect_client_passes(kPython, {ACCEL_TEST_WORKERS_DIR "/store_client.py"}, {"ops"});
}

TEST(Store, LibtorchCppClientEveryOperation) { expect_client_passes(STORE_CLIENT_BIN, {}, {}); }

TEST(Store, AStoreThatGoesAwayFailsAWaitingClientFast) {
  TempDir dir;
  ServedStore served;
  Launched client(
      dir, kPython,
      {ACCEL_TEST_WORKERS_DIR "/store_client.py", std::to_string(served.port()), "wait"}, {},
      "client");
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
}  // namespace accel::testing

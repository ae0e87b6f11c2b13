// accel-agent under systemd: the notify protocol through a datagram socket the test owns (the
// NOTIFY_SOCKET systemd would give it), and the unit file through systemd-analyze verify.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <fstream>
#include <regex>

#include "tests/integration/harness.h"

namespace accel::testing {
namespace {

using namespace std::chrono_literals;

// The receiving end of sd_notify: what systemd reads.
class NotifySocket {
 public:
  explicit NotifySocket(const std::string& path) : path_(path) {
    fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::snprintf(a.sun_path, sizeof a.sun_path, "%s", path.c_str());
    bound_ = ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  }
  ~NotifySocket() { ::close(fd_); }
  bool bound() const { return bound_; }

  // Reads messages until one contains `text`; every message read is kept in seen().
  bool wait_for(const std::string& text, std::chrono::milliseconds timeout = 15s) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      for (size_t i = checked_; i < seen_.size(); ++i) {
        if (seen_[i].find(text) != std::string::npos) {
          checked_ = i + 1;
          return true;
        }
      }
      checked_ = seen_.size();
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left <= 0ms) return false;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) return false;
      char buf[4096];
      ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n > 0) seen_.emplace_back(buf, static_cast<size_t>(n));
    }
  }
  std::string seen() const {
    std::string all;
    for (const auto& m : seen_) all += "[" + m + "]\n";
    return all;
  }

 private:
  std::string path_;
  int fd_ = -1;
  bool bound_ = false;
  std::vector<std::string> seen_;
  size_t checked_ = 0;
};

TEST(Systemd, TheAgentSaysReadyWhenRegisteredThenStatusWatchdogAndStopping) {
  TempDir dir;
  NotifySocket notify(dir / "notify.sock");
  ASSERT_TRUE(notify.bound());
  const int port = free_port();
  const std::string target = "127.0.0.1:" + std::to_string(port);
  Launched agent(
      dir, ACCEL_AGENT_BIN, {"--serve-coordinator", target, "--node-id", "n0"},
      {{"ACCEL_TOKEN", "t0k"}, {"NOTIFY_SOCKET", dir / "notify.sock"}, {"WATCHDOG_USEC", "400000"}},
      "agent");
  ASSERT_TRUE(notify.wait_for("READY=1\nSTATUS=idle, registered with the coordinator at " + target))
      << notify.seen() << agent.err_so_far();
  ASSERT_TRUE(notify.wait_for("WATCHDOG=1")) << notify.seen();
  ASSERT_TRUE(notify.wait_for("WATCHDOG=1", 1s)) << "every 200 ms for a 400 ms watchdog\n"
                                                 << notify.seen();

  Launched job(dir, ACCEL_LAUNCH_BIN,
               {"--coordinator", target, "-n", "2", "--", "sh", "-c",
                "echo notify=[$NOTIFY_SOCKET$WATCHDOG_USEC]; sleep 2"},
               {{"ACCEL_TOKEN", "t0k"}}, "job");
  EXPECT_TRUE(notify.wait_for("STATUS=running job ")) << notify.seen();
  auto r = job.wait(30s);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("notify=[]"), std::string::npos) << "workers must not inherit it:\n"
                                                        << r.out;
  EXPECT_TRUE(notify.wait_for("STATUS=idle")) << notify.seen();

  agent.signal(SIGTERM);
  EXPECT_TRUE(notify.wait_for("STOPPING=1\nSTATUS=stopping (SIGTERM)")) << notify.seen();
  auto end = agent.wait(30s);
  EXPECT_EQ(end.exit_code, 0) << end.err;
}

// Without NOTIFY_SOCKET (a terminal, Slurm) the agent sends nothing and runs as before: covered
// by every other control-plane test. Here: the unit file systemd would load.
TEST(Systemd, TheUnitFileVerifies) {
  if (!fs::exists("/usr/bin/systemd-analyze")) GTEST_SKIP() << "no systemd-analyze here";
  TempDir dir;
  std::string unit =
      read_file(std::string(ACCEL_SOURCE_DIR) + "/configs/systemd/accel-agent.service");
  ASSERT_NE(unit.find("Type=notify"), std::string::npos);
  ASSERT_NE(unit.find("WatchdogSec="), std::string::npos);
  // systemd-analyze checks that ExecStart's program exists: point it at this build's.
  unit = std::regex_replace(unit, std::regex("ExecStart=/usr/local/bin/accel-agent"),
                            "ExecStart=" + std::string(ACCEL_AGENT_BIN));
  std::ofstream(dir / "accel-agent.service") << unit;
  Launched verify(dir, "/usr/bin/systemd-analyze", {"verify", dir / "accel-agent.service"},
                  {{"SYSTEMD_LOG_LEVEL", "warning"}}, "verify");
  auto r = verify.wait(60s);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(r.err.find("accel-agent.service:"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace accel::testing

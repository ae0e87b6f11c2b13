// A cluster of standing agents on loopback for multi-node tests: a coordinator-only agent and
// two agents (node-a, node-b, each with its own --state-dir), each of which a test can SIGKILL
// and restart, as systemd would.
#pragma once

#include <signal.h>

#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tests/integration/harness.h"

namespace accel::testing {

// A coordinator-only agent and two agents on loopback, each restartable.
class AgentCluster {
 public:
  AgentCluster(const TempDir& dir, std::string token)
      : dir_(dir), token_(std::move(token)), port_(free_port()) {
    start_coordinator();
    for (int i = 0; i < 2; ++i) start_agent(i);
  }
  ~AgentCluster() {
    // Graceful first, so the agents stop their workers; ~Launched SIGKILLs what is left.
    for (auto& a : agents_) a->signal(SIGTERM);
    coordinator_->signal(SIGTERM);
    for (auto& a : agents_) a->wait(20s);
    coordinator_->wait(10s);
  }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  fs::path state_dir(int i) const { return dir_.path() / ("state" + std::to_string(i)); }
  Launched& agent(int i) { return *agents_[static_cast<size_t>(i)]; }

  void start_coordinator() {
    coordinator_ = std::make_unique<Launched>(
        dir_, ACCEL_AGENT_BIN,
        std::vector<std::string>{"--serve-coordinator", target(), "--coordinator-only",
                                 "--lease-timeout", "2s"},
        std::map<std::string, std::string>{{"ACCEL_TOKEN", token_}},
        "coordinator_" + std::to_string(++starts_));
  }
  void start_agent(int i) {
    auto node = std::string(i == 0 ? "node-a" : "node-b");
    auto l = std::make_unique<Launched>(
        dir_, ACCEL_AGENT_BIN,
        std::vector<std::string>{"--coordinator", target(), "--node-id", node, "--stop-timeout",
                                 "2s", "--state-dir", state_dir(i).string()},
        std::map<std::string, std::string>{{"ACCEL_TOKEN", token_}, {"OMP_NUM_THREADS", "1"}},
        "agent_" + node + "_" + std::to_string(++starts_));
    if (agents_.size() <= static_cast<size_t>(i)) agents_.resize(static_cast<size_t>(i) + 1);
    agents_[static_cast<size_t>(i)] = std::move(l);
  }
  void restart_coordinator() {
    coordinator_->signal(SIGKILL);
    coordinator_->wait(5s);
    std::this_thread::sleep_for(300ms);
    start_coordinator();
  }
  void restart_agent(int i) {
    agent(i).signal(SIGKILL);
    agent(i).wait(5s);
    std::this_thread::sleep_for(300ms);
    start_agent(i);
  }

 private:
  const TempDir& dir_;
  std::string token_;
  int port_;
  int starts_ = 0;
  std::unique_ptr<Launched> coordinator_;
  std::vector<std::unique_ptr<Launched>> agents_;
};

}  // namespace accel::testing

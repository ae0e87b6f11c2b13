// Soak: a 2-node x 2-process training job (train_classifier with checkpoints; with in-memory
// snapshots at every step too for even seeds) under standing agents, while a seeded driver kills
// random workers, an agent (restarted, as systemd would) and the coordinator (restarted) at random
// moments, about 20 faults. The job must finish with the weights of an uninterrupted run, bit for
// bit, and leave nothing of ours behind: no process, no descriptor growth in the agents, no state
// or shared-memory leftovers. Label "soak" (ctest -L soak); bounded: each run has a deadline and
// the driver stops after 20 faults.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "tests/integration/agent_cluster.h"
#include "tests/integration/harness.h"

namespace accel::testing {
namespace {

constexpr const char* kToken = "soak-test-token-0123456789";
constexpr int kMaxFaults = 20;

size_t fd_count(pid_t pid) {
  std::error_code ec;
  size_t n = 0;
  for (auto it = fs::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec);
       !ec && it != fs::directory_iterator(); it.increment(ec))
    ++n;
  return n;
}

// Live processes running `binary` (their /proc/<pid>/exe).
std::vector<pid_t> processes_of(const std::string& binary) {
  std::vector<pid_t> out;
  for (const auto& e : fs::directory_iterator("/proc")) {
    auto name = e.path().filename().string();
    if (name.empty() || !std::isdigit(static_cast<unsigned char>(name[0]))) continue;
    std::error_code ec;
    auto exe = fs::read_symlink(e.path() / "exe", ec);
    if (!ec && exe == fs::path(binary)) out.push_back(std::stoi(name));
  }
  return out;
}

std::set<std::string> shm_entries() {
  std::set<std::string> out;
  std::error_code ec;
  for (auto it = fs::directory_iterator("/dev/shm", ec); !ec && it != fs::directory_iterator();
       it.increment(ec)) {
    out.insert(it->path().filename().string());
  }
  return out;
}

// Whether /dev/shm/<name>, new since the job started, is ours and left behind, rather than in use
// by a test running beside this one: a segment accel-<pid>-... of a process that is gone, a
// snapshot folder that no agent or launcher holds (its lock is free), or anything else.
bool left_behind(const std::string& name) {
  if (name.rfind("accel-snapshots-", 0) == 0) {
    int fd = ::open(("/dev/shm/" + name).c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
    if (fd < 0) return false;  // gone meanwhile
    const bool unheld = ::flock(fd, LOCK_EX | LOCK_NB) == 0;
    ::close(fd);
    return unheld;
  }
  if (name.rfind("accel-", 0) == 0) {
    const pid_t pid = static_cast<pid_t>(std::atol(name.c_str() + 6));
    return pid <= 0 || ::kill(pid, 0) != 0;
  }
  return true;
}

std::string file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

struct RunOutcome {
  RunResult launch;
  std::string model;
  int faults = 0;
  std::string log;
  std::vector<size_t> agent_fds;  // each agent's open descriptors once idle after the job
};

// One run of the job on a fresh cluster; with `seed`, the driver injects faults.
// `snapshots`: in-memory snapshots at every step too (a killed worker's group resumes from
// them; a node whose agent restarted has none, and gets the other node's first).
RunOutcome run_job(const TempDir& dir, std::optional<unsigned> seed, bool snapshots = false) {
  RunOutcome out;
  AgentCluster cluster(dir, kToken);
  std::vector<std::string> args = {"--snapshot-interval",
                                   snapshots ? "1" : "0",
                                   "--coordinator",
                                   cluster.target(),
                                   "--nodes",
                                   "2",
                                   "-n",
                                   "2",
                                   "--checkpoint-dir",
                                   (dir.path() / "ck").string(),
                                   "--checkpoint-interval",
                                   "10",
                                   "--max-restarts",
                                   "100",
                                   "--",
                                   TRAIN_CLASSIFIER_BIN,
                                   "--epochs",
                                   "200",
                                   "--train-samples",
                                   "4000",
                                   "--save-model",
                                   (dir.path() / "model").string()};
  Launched launch(dir, ACCEL_LAUNCH_BIN, args, {{"ACCEL_TOKEN", kToken}, {"OMP_NUM_THREADS", "1"}},
                  "launch");
  std::atomic<bool> done{false};
  std::thread driver;
  if (seed) {
    driver = std::thread([&, s = *seed] {
      std::mt19937 rng(s);
      std::this_thread::sleep_for(3s);  // the first checkpoints exist by then
      while (!done && out.faults < kMaxFaults) {
        std::this_thread::sleep_for(std::chrono::milliseconds(800 + rng() % 1200));
        if (done) break;
        unsigned kind = rng() % 10;
        int node = static_cast<int>(rng() % 2);
        if (kind < 6) {
          auto workers = children_of(cluster.agent(node).pid());
          if (workers.empty()) continue;
          pid_t victim = workers[rng() % workers.size()];
          ::kill(victim, SIGKILL);
          out.log += "kill -9 worker " + std::to_string(victim) + " of node " +
                     std::to_string(node) + "\n";
        } else if (kind < 8) {
          cluster.restart_agent(node);
          out.log += "kill -9 agent of node " + std::to_string(node) + ", restarted\n";
        } else {
          cluster.restart_coordinator();
          out.log += "kill -9 coordinator, restarted\n";
        }
        ++out.faults;
      }
    });
  }
  out.launch = launch.wait(600s);
  done = true;
  if (driver.joinable()) driver.join();
  out.model = file_bytes(dir.path() / "model" / "model.safetensors");
  // Idle agents after the job: their descriptor count must be back where an idle agent's is.
  for (int i = 0; i < 2; ++i) {
    auto settled = [&] { return children_of(cluster.agent(i).pid()).empty(); };
    EXPECT_TRUE(wait_until(settled, 10s)) << "node " << i << " still has workers after the job";
    std::this_thread::sleep_for(500ms);
    out.agent_fds.push_back(fd_count(cluster.agent(i).pid()));
  }
  return out;
}

class Soak : public ::testing::TestWithParam<unsigned> {};

TEST_P(Soak, ATwoNodeJobSurvivesRandomKillsWithTheWeightsOfAnUninterruptedRun) {
  static std::string baseline;  // the same for every seed: computed once
  static size_t idle_fds = 0;   // an agent's descriptors, idle after a job without faults
  if (baseline.empty()) {
    TempDir dir;
    auto base = run_job(dir, std::nullopt);
    ASSERT_EQ(base.launch.exit_code, 0) << base.launch.err.substr(0, 4000);
    ASSERT_GT(base.model.size(), 1000u);
    baseline = base.model;
    idle_fds = *std::max_element(base.agent_fds.begin(), base.agent_fds.end());
  }
  const auto shm_before = shm_entries();
  TempDir dir;
  const bool snapshots = GetParam() % 2 == 0;
  auto run = run_job(dir, GetParam(), snapshots);
  EXPECT_EQ(run.launch.exit_code, 0)
      << run.log
      << run.launch.err.substr(run.launch.err.size() > 6000 ? run.launch.err.size() - 6000 : 0);
  EXPECT_GE(run.faults, 10) << "the job ended before the driver got far:\n" << run.log;
  EXPECT_TRUE(run.model == baseline) << "final weights differ from the uninterrupted run after:\n"
                                     << run.log;
  auto count = [&](const std::string& what) {
    std::size_t n = 0;
    for (auto at = run.launch.out.find(what); at != std::string::npos;
         at = run.launch.out.find(what, at + 1)) {
      ++n;
    }
    return n;
  };
  const std::size_t from_memory = count("accel: resumed from the in-memory snapshot");
  std::cerr << "seed " << GetParam() << ": " << run.faults << " faults, job took "
            << std::chrono::duration_cast<std::chrono::milliseconds>(run.launch.elapsed).count()
            << " ms; resumed " << count("accel: resumed from") << " times, " << from_memory
            << " from memory, " << count("accel: the in-memory snapshot of step")
            << " of them sent from the other node\n";
  if (snapshots) {
    EXPECT_GE(from_memory, 1u) << "no restart resumed from the in-memory snapshots:\n" << run.log;
  } else {
    EXPECT_EQ(from_memory, 0u);
  }
  // Nothing of ours left: workers, round folders, shared-memory segments.
  EXPECT_TRUE(wait_until([] { return processes_of(TRAIN_CLASSIFIER_BIN).empty(); }, 10s))
      << "train_classifier processes outlived the job";
  for (int i = 0; i < 2; ++i) {
    std::error_code ec;
    EXPECT_TRUE(!fs::exists(dir.path() / ("state" + std::to_string(i)), ec) ||
                fs::is_empty(dir.path() / ("state" + std::to_string(i)), ec))
        << "round folders left in state" << i;
  }
  for (size_t fds : run.agent_fds)
    EXPECT_LE(fds, idle_fds + 4) << "an agent holds more descriptors than an idle one";
  auto shm_after = shm_entries();
  for (const auto& e : shm_after)
    EXPECT_TRUE(shm_before.contains(e) || !left_behind(e)) << "/dev/shm/" << e << " left behind";
}

// Why two seeds: each drives at least 10 random faults (about 100 s); two keep the soak within
// CI's 40 minutes on 2 cores. More: --gtest_repeat with other seeds, or add them here.
INSTANTIATE_TEST_SUITE_P(Seeds, Soak, ::testing::Values(1u, 2u));

}  // namespace
}  // namespace accel::testing

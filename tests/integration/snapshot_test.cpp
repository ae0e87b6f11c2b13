// In-memory snapshots end to end (accel-launch --snapshot-interval): a worker SIGKILLed at a
// random moment restarts its group from the newest snapshot in /dev/shm, at most a step back,
// and the job ends with the weights of a run that was never killed, with and without disk
// checkpoints beside; the folder goes with the job. A node whose agent was SIGKILLed (its
// workers and its snapshots gone with it) gets the snapshot from the other node's memory. (Under
// standing agents with random kills of workers, agents and the coordinator: the soak's even
// seeds.)
#include <gtest/gtest.h>
#include <sys/file.h>

#include <random>
#include <regex>
#include <set>

#include "tests/integration/agent_cluster.h"
#include "tests/integration/harness.h"

namespace accel::testing {
namespace {

// train_classifier on 2 processes: 4 epochs x 47 steps.
std::vector<std::string> classifier_args(const std::string& model_dir) {
  return {TRAIN_CLASSIFIER_BIN, "--epochs", "4", "--train-samples", "3000",
          "--save-model",       model_dir};
}

// The snapshot folder the agent gave the workers of the launcher `launcher` (their
// ACCEL_SNAPSHOT_DIR); empty until a worker runs. Why not a look at /dev/shm: tests running
// beside this one have folders there too.
fs::path snapshot_folder_of(pid_t launcher) {
  for (pid_t worker : children_of(launcher)) {
    const std::string env = read_file("/proc/" + std::to_string(worker) + "/environ");
    const std::string key = std::string("ACCEL_SNAPSHOT_DIR=");
    for (std::size_t at = 0; at < env.size(); at = env.find('\0', at) + 1) {
      if (env.compare(at, key.size(), key) == 0)
        return env.substr(at + key.size(), env.find('\0', at) - at - key.size());
      if (env.find('\0', at) == std::string::npos) break;
    }
  }
  return {};
}

// The newest complete snapshot's step in `folder`; -1: none yet.
int64_t newest_snapshot(const fs::path& folder) {
  int64_t newest = -1;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(folder, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("checkpoint_", 0) != 0 || !fs::exists(e.path() / "manifest.json", ec)) continue;
    newest = std::max<int64_t>(newest, std::stoll(name.substr(11)));
  }
  return newest;
}

// For each seed: the 2-process job with snapshots at every step (and `extra` flags) is SIGKILLed
// in a random rank once the snapshots have reached a random step; it must resume from memory no
// further back than the newest snapshot seen before the kill, and end with `expected`.
void expect_resumes_from_memory(const std::string& expected, const std::vector<std::string>& extra,
                                std::initializer_list<unsigned> seeds,
                                std::map<std::string, std::string> env = {},
                                const std::string& expect_in_err = "") {
  env["OMP_NUM_THREADS"] = "1";
  for (unsigned seed : seeds) {
    std::mt19937 rng(seed);
    const int victim = static_cast<int>(rng() % 2);
    const int64_t at_step = 10 + static_cast<int64_t>(rng() % 150);  // of 188
    TempDir run;
    std::vector<std::string> launch = {
        "--max-restarts", "2", "--snapshot-interval", "1", "-n", "2"};
    for (const auto& x : extra) launch.push_back(x == "CK" ? run / "ck" : x);
    launch.push_back("--");
    auto a = classifier_args(run / "model");
    launch.insert(launch.end(), a.begin(), a.end());
    Launched job(run, launch, env);
    fs::path folder;
    ASSERT_TRUE(wait_until([&] { return !(folder = snapshot_folder_of(job.pid())).empty(); }, 60s))
        << "seed " << seed << ": no worker with ACCEL_SNAPSHOT_DIR\n"
        << job.err_so_far();
    int64_t seen = -1;
    ASSERT_TRUE(wait_until([&] { return (seen = newest_snapshot(folder)) >= at_step; }, 120s))
        << "seed " << seed << ": no snapshot of step " << at_step << " (newest " << seen << ")\n"
        << job.err_so_far();
    auto workers = children_of(job.pid());
    ASSERT_EQ(workers.size(), 2u);
    ::kill(workers[static_cast<std::size_t>(victim)], SIGKILL);
    auto r = job.wait(180s);
    ASSERT_EQ(r.exit_code, 0) << "seed " << seed << "\n" << r.out << r.err;
    if (!expect_in_err.empty()) EXPECT_NE(r.err.find(expect_in_err), std::string::npos) << r.err;
    std::smatch m;
    const std::regex resumed(R"(accel: resumed from the in-memory snapshot (\S+) at step (\d+))");
    ASSERT_TRUE(std::regex_search(r.out, m, resumed)) << "seed " << seed << "\n" << r.out << r.err;
    EXPECT_GE(std::stoll(m[2]), seen) << "seed " << seed << ": resumed further back than the "
                                      << "newest snapshot seen before the kill\n"
                                      << r.out;
    EXPECT_EQ(read_file(run.path() / "model" / "model.safetensors"), expected)
        << "seed " << seed << ": killed rank " << victim << " after the snapshot of step " << seen
        << "; the final weights differ from the uninterrupted run\n"
        << r.out << r.err;
    EXPECT_EQ(fs::path(m[1].str()).parent_path(), folder);
    EXPECT_FALSE(fs::exists(folder)) << folder << ": the snapshot folder outlived the job";
  }
}

struct Baseline {
  std::string model;
};

Baseline uninterrupted(const TempDir& dir) {
  std::vector<std::string> args = {"-n", "2", "--"};
  auto a = classifier_args(dir / "base");
  args.insert(args.end(), a.begin(), a.end());
  auto r = run_launcher(dir, args, 120s, {{"OMP_NUM_THREADS", "1"}});
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  return {read_file(dir.path() / "base" / "model.safetensors")};
}

TEST(Snapshots, AKilledWorkerResumesFromMemoryToTheWeightsOfAnUninterruptedRun) {
  TempDir dir;
  auto base = uninterrupted(dir);
  ASSERT_GT(base.model.size(), 1000u);
  expect_resumes_from_memory(base.model, {}, {1u, 2u});
}

// With checkpoints every 25 steps beside: the snapshot is newer, so it is the one loaded; the
// checkpoints go on at their own steps after the resume (the newest 3 kept).
TEST(Snapshots, NewerThanTheNewestCheckpointTheSnapshotIsLoadedAndCheckpointsGoOn) {
  TempDir dir;
  auto base = uninterrupted(dir);
  ASSERT_GT(base.model.size(), 1000u);
  expect_resumes_from_memory(base.model, {"--checkpoint-dir", "CK", "--checkpoint-interval", "25"},
                             {3u});
}

// ZeRO stage 1: each node's local main gathers the optimizer state's shards for the snapshot;
// the resumed run slices them again and ends with the unsharded run's weights, bitwise.
TEST(Snapshots, UnderZeroStageOneTheResumedRunEndsWithTheUnshardedRunsWeights) {
  TempDir dir;
  auto base = uninterrupted(dir);
  ASSERT_GT(base.model.size(), 1000u);
  expect_resumes_from_memory(base.model, {"--zero-stage", "1"}, {4u});
}

// The optimizer step split between the ranks (forced: this model is below the default's floor):
// the snapshot holds the machine's one copy of the optimizer state, whole; the resumed run moves
// it back into shared memory and ends with the whole step's weights, bitwise.
TEST(Snapshots, WithTheSplitOptimizerStepTheResumedRunEndsWithTheWholeStepsWeights) {
  TempDir dir;
  auto base = uninterrupted(dir);
  ASSERT_GT(base.model.size(), 1000u);
  expect_resumes_from_memory(base.model, {}, {5u},
                             {{"ACCEL_SPLIT_OPTIMIZER_STEP", "1"}, {"ACCEL_LOG_LEVEL", "debug"}},
                             "optimizer step split between this machine's 2 ranks");
}

// A lost node: 2 nodes x 2 processes under standing agents, snapshots at every step and no disk
// checkpoints. Node b's agent is SIGKILLed (its workers die with it, and its snapshot folder is
// swept by the agent started after it) and restarted, as systemd would. The group must resume
// from node a's memory, no further back than node b's newest snapshot before the kill, with
// node a's snapshot sent to node b first, and end with the weights of a run never killed.
TEST(Snapshots, ANodeThatLostItsSnapshotsResumesFromItsPeersMemory) {
  TempDir dir;
  AgentCluster cluster(dir, "snapshot-test-token-0123456789");
  auto job = [&](const std::string& model, int restarts) {
    std::vector<std::string> args = {"--coordinator",
                                     cluster.target(),
                                     "--nodes",
                                     "2",
                                     "-n",
                                     "2",
                                     "--snapshot-interval",
                                     "1",
                                     "--max-restarts",
                                     std::to_string(restarts),
                                     "--"};
    auto a = classifier_args(dir / model);
    args.insert(args.end(), a.begin(), a.end());
    return args;
  };
  const std::map<std::string, std::string> env = {{"ACCEL_TOKEN", "snapshot-test-token-0123456789"},
                                                  {"OMP_NUM_THREADS", "1"}};
  {
    Launched base(dir, ACCEL_LAUNCH_BIN, job("base", 0), env, "base");
    auto r = base.wait(60s);  // about 4 s here; all the waits stay under ctest's 240 s
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  }
  const std::string expected = read_file(dir.path() / "base" / "model.safetensors");
  ASSERT_GT(expected.size(), 1000u);

  Launched faulted(dir, ACCEL_LAUNCH_BIN, job("model", 2), env, "faulted");
  fs::path b_folder;
  ASSERT_TRUE(wait_until(
      [&] { return !(b_folder = snapshot_folder_of(cluster.agent(1).pid())).empty(); }, 30s))
      << "no worker of node b with ACCEL_SNAPSHOT_DIR\n"
      << faulted.err_so_far();
  int64_t seen = -1;
  ASSERT_TRUE(wait_until([&] { return (seen = newest_snapshot(b_folder)) >= 40; }, 40s))
      << "node b has no snapshot of step 40 (newest " << seen << ")\n"
      << faulted.err_so_far();
  cluster.restart_agent(1);
  auto r = faulted.wait(60s);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::smatch m;
  const std::regex sent(
      R"(accel: the in-memory snapshot of step (\d+) came from the memory of rank (\d+)'s node )"
      R"(to 1 node that lacked it)");
  ASSERT_TRUE(std::regex_search(r.out, m, sent)) << r.out << r.err;
  const std::regex resumed(R"(accel: resumed from the in-memory snapshot \S+ at step (\d+))");
  ASSERT_TRUE(std::regex_search(r.out, m, resumed)) << r.out << r.err;
  EXPECT_GE(std::stoll(m[1]), seen)
      << "resumed further back than node b's newest snapshot before the kill\n"
      << r.out;
  EXPECT_EQ(read_file(dir.path() / "model" / "model.safetensors"), expected)
      << "the final weights differ from the uninterrupted run\n"
      << r.out << r.err;
  EXPECT_FALSE(fs::exists(b_folder)) << b_folder << ": the killed agent's folder was left";
}

// A snapshot that cannot be written (here: ACCEL_SNAPSHOT_DIR under a file, for a program run
// without a launcher) is a warning that names the step and the reason; snapshots then stop and
// training ends as it would have, exit 0, with the weights of a run without snapshots.
TEST(Snapshots, ASnapshotThatCannotBeWrittenIsAWarningAndTrainingGoesOn) {
  TempDir dir;
  write_file(dir.path() / "a_file", "x");
  auto run = [&](const std::string& name, std::map<std::string, std::string> env) {
    env["OMP_NUM_THREADS"] = "1";
    Launched p(dir, TRAIN_CLASSIFIER_BIN,
               {"--epochs", "1", "--train-samples", "640", "--save-model", dir / name}, env, name);
    return p.wait(60s);
  };
  auto plain = run("plain", {});
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  auto r = run("failing", {{"ACCEL_SNAPSHOT_INTERVAL", "1"},
                           {"ACCEL_SNAPSHOT_DIR", (dir.path() / "a_file" / "snaps").string()}});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("accel: warning: the in-memory snapshot at step 1 failed on rank 0: "),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("no more snapshots in this run"), std::string::npos) << r.err;
  auto count = [](const std::string& text, const std::string& what) {
    std::size_t n = 0;
    for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count(r.err, "in-memory snapshot at step"), 1u) << "warned more than once:\n" << r.err;
  EXPECT_EQ(read_file(dir.path() / "failing" / "model.safetensors"),
            read_file(dir.path() / "plain" / "model.safetensors"))
      << "a failed snapshot changed the training";
}

// A snapshot folder nobody holds (its agent was SIGKILLed) is removed by the next launcher of
// the same user; another user's, a link, and one held by a live process are left alone.
TEST(Snapshots, ALeftoverSnapshotFolderIsRemovedByTheNextLauncher) {
  TempDir dir;
  const fs::path left = "/dev/shm/accel-snapshots-testleft" + std::to_string(::getpid());
  const fs::path held = "/dev/shm/accel-snapshots-testheld" + std::to_string(::getpid());
  const fs::path link = "/dev/shm/accel-snapshots-testlink" + std::to_string(::getpid());
  fs::create_directories(left / "checkpoint_3");
  fs::create_directories(held / "checkpoint_3");
  fs::create_directory_symlink(dir.path(), link);
  write_file(dir.path() / "precious", "x");
  // Another user's (nobody's, when root can make it so), unheld: not ours to remove.
  const fs::path theirs = "/dev/shm/accel-snapshots-testtheirs" + std::to_string(::getpid());
  fs::create_directories(theirs);
  const bool chowned = ::geteuid() == 0 && ::chown(theirs.c_str(), 65534, 65534) == 0;
  int lock = ::open(held.c_str(), O_RDONLY | O_DIRECTORY);
  ASSERT_GE(lock, 0);
  ASSERT_EQ(::flock(lock, LOCK_EX), 0);
  auto r = run_launcher(dir, {"-n", "1", "--", "/bin/true"}, 30s);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_FALSE(fs::exists(left)) << "an unheld snapshot folder was left";
  EXPECT_TRUE(fs::exists(held / "checkpoint_3")) << "a held snapshot folder was removed";
  EXPECT_TRUE(fs::exists(dir.path() / "precious")) << "the sweep went through a link";
  EXPECT_TRUE(fs::exists(link)) << "the sweep removed a link";
  if (chowned) {
    EXPECT_TRUE(fs::exists(theirs)) << "another user's snapshot folder was removed";
  }
  ::close(lock);
  std::error_code ec;
  fs::remove_all(theirs, ec);
  fs::remove_all(held, ec);
  fs::remove(link, ec);
  fs::remove_all(left, ec);
}

}  // namespace
}  // namespace accel::testing

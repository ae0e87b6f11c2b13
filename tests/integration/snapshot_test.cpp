// In-memory snapshots end to end (accel-launch --snapshot-interval): a worker SIGKILLed at a
// random moment restarts its group from the newest snapshot in /dev/shm, at most a step back,
// and the job ends with the weights of a run that was never killed, with and without disk
// checkpoints beside; the folder goes with the job. (Snapshots under standing agents, with
// agents killed too: the soak's even seeds.)
#include <gtest/gtest.h>
#include <sys/file.h>

#include <random>
#include <regex>
#include <set>

#include "tests/integration/harness.h"

namespace accel::testing {
namespace {

// train_classifier on 2 processes: 4 epochs x 47 steps.
std::vector<std::string> classifier_args(const std::string& model_dir) {
  return {TRAIN_CLASSIFIER_BIN, "--epochs", "4", "--train-samples", "3000",
          "--save-model",       model_dir};
}

// This user's snapshot folders in /dev/shm.
std::set<std::string> snapshot_folders() {
  std::set<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/dev/shm", ec)) {
    if (e.path().filename().string().rfind("accel-snapshots-", 0) == 0) out.insert(e.path());
  }
  return out;
}

// The newest complete snapshot's step in the folders that are not in `before`; -1: none yet.
int64_t newest_snapshot(const std::set<std::string>& before) {
  int64_t newest = -1;
  std::error_code ec;
  for (const auto& folder : snapshot_folders()) {
    if (before.contains(folder)) continue;
    for (const auto& e : fs::directory_iterator(folder, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("checkpoint_", 0) != 0 || !fs::exists(e.path() / "manifest.json", ec))
        continue;
      newest = std::max<int64_t>(newest, std::stoll(name.substr(11)));
    }
  }
  return newest;
}

// For each seed: the 2-process job with snapshots at every step (and `extra` flags) is SIGKILLed
// in a random rank once the snapshots have reached a random step; it must resume from memory no
// further back than the newest snapshot seen before the kill, and end with `expected`.
void expect_resumes_from_memory(const std::string& expected, const std::vector<std::string>& extra,
                                std::initializer_list<unsigned> seeds) {
  for (unsigned seed : seeds) {
    std::mt19937 rng(seed);
    const int victim = static_cast<int>(rng() % 2);
    const int64_t at_step = 10 + static_cast<int64_t>(rng() % 150);  // of 188
    TempDir run;
    const auto before = snapshot_folders();
    std::vector<std::string> launch = {
        "--max-restarts", "2", "--snapshot-interval", "1", "-n", "2"};
    for (const auto& x : extra) launch.push_back(x == "CK" ? run / "ck" : x);
    launch.push_back("--");
    auto a = classifier_args(run / "model");
    launch.insert(launch.end(), a.begin(), a.end());
    Launched job(run, launch, {{"OMP_NUM_THREADS", "1"}});
    int64_t seen = -1;
    ASSERT_TRUE(wait_until([&] { return (seen = newest_snapshot(before)) >= at_step; }, 120s))
        << "seed " << seed << ": no snapshot of step " << at_step << " (newest " << seen << ")\n"
        << job.err_so_far();
    auto workers = children_of(job.pid());
    ASSERT_EQ(workers.size(), 2u);
    ::kill(workers[static_cast<std::size_t>(victim)], SIGKILL);
    auto r = job.wait(180s);
    ASSERT_EQ(r.exit_code, 0) << "seed " << seed << "\n" << r.out << r.err;
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
    EXPECT_FALSE(fs::exists(m[1].str())) << "the snapshot folder outlived the job";
    EXPECT_EQ(snapshot_folders(), before) << "a snapshot folder outlived the job";
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

// Fault tolerance end to end: workers SIGKILLed at random moments under the real accel-launch
// resume from their checkpoints and finish with the weights of a run that was never killed; a
// process killed at every I/O step of a save leaves the previous checkpoint loadable.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sched.h>

#include <random>
#include <regex>

#include "tests/integration/harness.h"

namespace accel::testing {
namespace {

// A complete automatic checkpoint exists under the checkpoint dir (older ones are rotated away).
bool has_checkpoint(const fs::path& dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir / "checkpoints", ec)) {
    if (e.path().filename().string().rfind("checkpoint_", 0) == 0 &&
        fs::exists(e.path() / "manifest.json", ec)) {
      return true;
    }
  }
  return false;
}

// Waits (bounded) until the running job has written its first complete checkpoint.
bool wait_for_first_checkpoint(const fs::path& dir) {
  auto deadline = std::chrono::steady_clock::now() + 60s;
  while (!has_checkpoint(dir) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(2ms);
  }
  return has_checkpoint(dir);
}

std::string file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// train_classifier on 2 processes, small enough to run several times, long enough to be killed
// in the middle: 4 epochs x 47 steps.
std::vector<std::string> classifier_args(const std::string& model_dir) {
  return {TRAIN_CLASSIFIER_BIN, "--epochs", "4", "--train-samples", "3000",
          "--save-model",       model_dir};
}

// The model an uninterrupted 2-process run of classifier_args() saves, and how long it took.
struct Baseline {
  std::string model;
  std::chrono::milliseconds duration{};
};
Baseline uninterrupted_run(const TempDir& dir, const std::map<std::string, std::string>& env) {
  std::vector<std::string> base_args = {"-n", "2", "--"};
  auto args = classifier_args(dir / "base");
  base_args.insert(base_args.end(), args.begin(), args.end());
  auto base = run_launcher(dir, base_args, 120s, env);
  EXPECT_EQ(base.exit_code, 0) << base.out << base.err;
  return {file_bytes(dir.path() / "base" / "model.safetensors"),
          std::chrono::duration_cast<std::chrono::milliseconds>(base.elapsed)};
}

// A restart that finds no intact checkpoint stops with the runtime's clear error and exit 1 on
// every rank (it used to end in std::terminate: SIGABRT, the message in a crash report).
TEST(Checkpoint, NoIntactCheckpointIsAClearErrorAndExit1) {
  TempDir dir;
  std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}};
  auto ck = dir.path() / "ck";
  std::vector<std::string> first = {"-n",
                                    "1",
                                    "--checkpoint-dir",
                                    ck.string(),
                                    "--checkpoint-interval",
                                    "5",
                                    "--",
                                    TRAIN_CLASSIFIER_BIN,
                                    "--epochs",
                                    "1",
                                    "--train-samples",
                                    "400"};
  auto r = run_launcher(dir, first, 120s, env);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ASSERT_TRUE(has_checkpoint(ck));
  for (const auto& e : fs::directory_iterator(ck / "checkpoints")) {
    fs::resize_file(e.path() / "model.safetensors", 10);  // every checkpoint damaged
  }
  auto again = run_launcher(dir, first, 120s, env);
  EXPECT_EQ(again.exit_code, 1) << again.err;
  std::string all = again.out + again.err;
  EXPECT_NE(all.find("is intact"), std::string::npos) << all;
  EXPECT_EQ(all.find("SIGABRT"), std::string::npos) << all;
}

// accel-launch -n 2 of a 10-step train_classifier that checkpoints into `ck` every 10 steps, with
// `extra` launcher flags before the program and `args` after its own.
std::vector<std::string> small_checkpointed_run(const std::string& ck,
                                                const std::vector<std::string>& extra,
                                                const std::vector<std::string>& args) {
  std::vector<std::string> out = {"-n", "2", "--checkpoint-dir", ck, "--checkpoint-interval", "10"};
  out.insert(out.end(), extra.begin(), extra.end());
  for (const char* a : {"--", TRAIN_CLASSIFIER_BIN, "--epochs", "1", "--train-samples", "640"})
    out.emplace_back(a);
  out.insert(out.end(), args.begin(), args.end());
  return out;
}

// A checkpoint folder left by another run (another dataset, another model) is refused by
// automatic resume with what differs; --resume force resumes anyway; a resume that trains nothing
// says so.
TEST(Checkpoint, AnotherRunsCheckpointIsRefusedWithTheDifferenceNamed) {
  TempDir dir;
  const std::string ck = dir / "ck";
  auto run = [&](const std::vector<std::string>& args, const std::vector<std::string>& extra = {}) {
    return run_launcher(dir, small_checkpointed_run(ck, extra, args), 60s);
  };
  auto first = run({});
  ASSERT_EQ(first.exit_code, 0) << first.err;  // 10 steps: the last save is at its end

  auto other_data = run({"--train-samples", "1280"});
  EXPECT_EQ(other_data.exit_code, 1) << other_data.err;
  EXPECT_NE(other_data.err.find("was saved by another run:"), std::string::npos) << other_data.err;
  EXPECT_NE(other_data.err.find("data loader 0's dataset has 1280 samples here, 640 in the "
                                "checkpoint"),
            std::string::npos)
      << other_data.err;
  EXPECT_NE(other_data.err.find("--checkpoint-dir DIR"), std::string::npos) << other_data.err;
  EXPECT_NE(other_data.err.find("--resume force"), std::string::npos) << other_data.err;

  auto other_model = run({"--features", "8"});
  EXPECT_EQ(other_model.exit_code, 1) << other_model.err;
  EXPECT_NE(other_model.err.find("model 0: fc1.weight is [64, 8] here, [64, 16] in the checkpoint"),
            std::string::npos)
      << other_model.err;

  EXPECT_EQ(run({"--train-samples", "1280", "--epochs", "2"}).exit_code, 1);  // without the flag
  auto anyway = run({"--train-samples", "1280", "--epochs", "2"}, {"--resume", "force"});
  EXPECT_EQ(anyway.exit_code, 0) << anyway.err;
  EXPECT_NE(anyway.out.find("resuming (resume=force)"), std::string::npos) << anyway.out;

  // The same run again: it resumes at its end and trains nothing, and says so.
  TempDir second;
  auto same = small_checkpointed_run(second / "ck", {}, {});
  ASSERT_EQ(run_launcher(second, same, 60s).exit_code, 0);
  auto again = run_launcher(second, same, 60s);
  EXPECT_EQ(again.exit_code, 0) << again.err;
  EXPECT_NE(again.err.find("took no optimizer step after it"), std::string::npos)
      << again.out << again.err;
}

// The loader prepared before the model and optimizer, an object registered after prepare():
// rank 1 is killed after step 6 (a checkpoint every 4 steps), the group restarts and resumes at
// step 4, and the end is bitwise the run that was never killed, the registered counter included.
// The main process alone saves the model at the end.
TEST(Checkpoint, PrepareOrderAndLateRegistrationDoNotChangeWhatResumes) {
  auto launch = [](const TempDir& dir, const std::string& kill_rank) {
    return run_launcher(
        dir,
        {"-n", "2", "--max-restarts", "1", "--checkpoint-dir", dir / "ck", "--checkpoint-interval",
         "4", "--", RUNTIME_WORKER_BIN, "late_order", "10", kill_rank, "6", dir / "model"},
        60s, {{"OMP_NUM_THREADS", "1"}});
  };
  TempDir plain, killed;
  auto uninterrupted = launch(plain, "-1");
  ASSERT_EQ(uninterrupted.exit_code, 0) << uninterrupted.out << uninterrupted.err;
  auto resumed = launch(killed, "1");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.out << resumed.err;
  EXPECT_NE(resumed.out.find("accel: resumed from"), std::string::npos) << resumed.out;
  EXPECT_NE(resumed.out.find("checkpoint_0 at step 4"), std::string::npos) << resumed.out;
  std::smatch want, got;
  const std::regex final_line("FINAL ([0-9a-f]+) counter ([0-9]+)");
  ASSERT_TRUE(std::regex_search(uninterrupted.out, want, final_line)) << uninterrupted.out;
  ASSERT_TRUE(std::regex_search(resumed.out, got, final_line)) << resumed.out;
  EXPECT_EQ(want[2].str(), "10");
  EXPECT_EQ(got[2].str(), "10") << "the object registered after prepare() was not restored";
  EXPECT_EQ(got[1].str(), want[1].str()) << "the resumed weights differ from the uninterrupted run";
  EXPECT_TRUE(fs::exists(killed.path() / "model" / "model.safetensors"));
}

// train_classifier saves with HF's `if (is_main_process()) save_model(...)` on 2 processes (no
// hang: save_model is not a collective); --load-model with --epochs 0 evaluates the loaded
// weights to the trained run's last accuracy, on another number of processes too.
TEST(Checkpoint, SaveModelFromTheMainProcessAloneAndLoadModelEvaluatesTheSameWeights) {
  TempDir dir;
  const std::string model = dir / "model";
  auto trained = run_launcher(dir,
                              {"-n", "2", "--", TRAIN_CLASSIFIER_BIN, "--epochs", "2",
                               "--train-samples", "1000", "--save-model", model},
                              60s);
  ASSERT_EQ(trained.exit_code, 0) << trained.err;
  std::string out = trained.out;
  std::string accuracy;
  const std::regex accuracy_re(R"(eval_accuracy (\S+))");
  for (std::sregex_iterator it(out.begin(), out.end(), accuracy_re), end; it != end; ++it) {
    accuracy = (*it)[1];
  }
  ASSERT_FALSE(accuracy.empty()) << out;
  for (const char* n : {"1", "2"}) {
    auto loaded = run_launcher(
        dir,
        {"-n", n, "--", TRAIN_CLASSIFIER_BIN, "--load-model", model, "--epochs", "0",
         "--train-samples", "1000"},  // the same data: the evaluation set is drawn after it
        60s);
    EXPECT_EQ(loaded.exit_code, 0) << loaded.err;
    EXPECT_NE(loaded.out.find("no training (--epochs 0): eval_accuracy " + accuracy +
                              " eval_samples 1001"),
              std::string::npos)
        << n << " processes:\n"
        << loaded.out;
  }
  auto other = run_launcher(
      dir, {"-n", "1", "--", TRAIN_CLASSIFIER_BIN, "--load-model", model, "--features", "8"}, 60s);
  EXPECT_EQ(other.exit_code, 1);
  EXPECT_NE(other.err.find("fc1.weight is [64, 16] in the files, [64, 8] in the model"),
            std::string::npos)
      << other.err;
}

// For each seed: a 2-process run of classifier_args() (with `extra` launch flags) whose random
// rank is SIGKILLed at a random moment after the first checkpoint resumes and ends with the
// model bytes `expected`.
void expect_killed_runs_resume_to(const std::string& expected, std::chrono::milliseconds duration,
                                  const std::map<std::string, std::string>& env,
                                  std::initializer_list<unsigned> seeds,
                                  const std::vector<std::string>& extra = {},
                                  const std::string& expect_in_err = "") {
  for (unsigned seed : seeds) {
    std::mt19937 rng(seed);
    int victim = static_cast<int>(rng() % 2);
    // Once the first checkpoint exists, a random point of whatever the job is doing then
    // (training, all-reducing, saving); halved and retried if the job finished first.
    auto delay = std::chrono::milliseconds(static_cast<int64_t>(
        static_cast<double>(duration.count()) * 0.5 * (rng() % 1000) / 1000.0));
    bool interrupted = false;
    for (int attempt = 0; attempt < 4 && !interrupted; ++attempt, delay /= 2) {
      TempDir run;
      std::vector<std::string> launch = extra;
      std::vector<std::string> rest = {"--max-restarts",
                                       "2",
                                       "--checkpoint-dir",
                                       run / "ck",
                                       "--checkpoint-interval",
                                       "10",
                                       "-n",
                                       "2",
                                       "--"};
      launch.insert(launch.end(), rest.begin(), rest.end());
      auto a = classifier_args(run / "model");
      launch.insert(launch.end(), a.begin(), a.end());
      Launched job(run, launch, env);
      ASSERT_TRUE(wait_for_first_checkpoint(run.path() / "ck"))
          << "seed " << seed << ": no first checkpoint";
      std::this_thread::sleep_for(delay);
      auto workers = children_of(job.pid());
      if (workers.size() == 2) ::kill(workers[static_cast<std::size_t>(victim)], SIGKILL);
      auto r = job.wait(180s);
      ASSERT_EQ(r.exit_code, 0) << "seed " << seed << "\n" << r.out << r.err;
      if (!expect_in_err.empty()) EXPECT_NE(r.err.find(expect_in_err), std::string::npos) << r.err;
      interrupted = r.out.find("accel: resumed from") != std::string::npos;
      if (!interrupted) continue;  // the victim had already finished: nothing was tested
      int kept = 0;
      for (const auto& e : fs::directory_iterator(run.path() / "ck" / "checkpoints")) {
        kept += e.path().filename().string().rfind("checkpoint_", 0) == 0 ? 1 : 0;
      }
      EXPECT_EQ(kept, 3) << "accel-launch's periodic saves keep the newest 3 checkpoints";
      EXPECT_EQ(file_bytes(run.path() / "model" / "model.safetensors"), expected)
          << "seed " << seed << ": killed rank " << victim << " " << delay.count()
          << " ms after the first checkpoint; the final weights differ from the uninterrupted run\n"
          << r.out << r.err;
    }
    EXPECT_TRUE(interrupted) << "seed " << seed << ": no kill interrupted the job";
  }
}

TEST(Checkpoint, KilledWorkersResumeToTheWeightsOfAnUninterruptedRun) {
  TempDir dir;
  std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}};
  auto [expected, duration] = uninterrupted_run(dir, env);
  ASSERT_GT(expected.size(), 1000u);
  expect_killed_runs_resume_to(expected, duration, env, {1u, 2u, 3u});
}

// ZeRO stage 1 on 2 processes trains to the unsharded run's weights, bitwise; a worker killed
// after the first checkpoint resumes to them too (the optimizer state's shards gathered into the
// checkpoint, sliced again when it loads).
TEST(Checkpoint, ZeroStageOneTrainsAndResumesToTheUnshardedRunsWeights) {
  TempDir dir;
  std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}};
  auto [expected, duration] = uninterrupted_run(dir, env);
  ASSERT_GT(expected.size(), 1000u);
  std::vector<std::string> zero = {"--zero-stage", "1", "-n", "2", "--"};
  auto a = classifier_args(dir / "zero");
  zero.insert(zero.end(), a.begin(), a.end());
  auto debug = env;
  debug["ACCEL_LOG_LEVEL"] = "debug";
  auto r = run_launcher(dir, zero, 120s, debug);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.err.find("ZeRO stage 1: optimizer 0"), std::string::npos) << r.err;
  EXPECT_EQ(file_bytes(dir.path() / "zero" / "model.safetensors"), expected)
      << "ZeRO-1 ended with other weights than the unsharded run";
  expect_killed_runs_resume_to(expected, duration, debug, {1u}, {"--zero-stage", "1"},
                               "ZeRO stage 1: optimizer 0");
}

// The optimizer step split between the ranks (forced: this model is below the default's floor)
// trains to the whole step's weights, bitwise; a worker killed after the first checkpoint resumes
// to them too (each rank moves its elements of the loaded optimizer state into the machine's one
// copy at the first step).
TEST(Checkpoint, TheSplitOptimizerStepTrainsAndResumesToTheWholeStepsWeights) {
  TempDir dir;
  std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}};
  auto [expected, duration] = uninterrupted_run(dir, env);
  ASSERT_GT(expected.size(), 1000u);
  auto split = env;
  split["ACCEL_SPLIT_OPTIMIZER_STEP"] = "1";
  split["ACCEL_LOG_LEVEL"] = "debug";
  std::vector<std::string> args = {"-n", "2", "--"};
  auto a = classifier_args(dir / "split");
  args.insert(args.end(), a.begin(), a.end());
  auto r = run_launcher(dir, args, 120s, split);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.err.find("optimizer step split between this machine's 2 ranks"), std::string::npos)
      << r.err;
  EXPECT_EQ(file_bytes(dir.path() / "split" / "model.safetensors"), expected)
      << "the split step ended with other weights than the whole one";
  expect_killed_runs_resume_to(expected, duration, split, {2u}, {},
                               "optimizer step split between this machine's 2 ranks");
}

// One process saves checkpoint_0, trains, and saves checkpoint_1 (in the background when `async`,
// training 3 more steps meanwhile) with a SIGKILL at its I/O operation k, for every k: the newest
// checkpoint must load, and be checkpoint_0 or checkpoint_1 with their weights.
void kill_at_every_step_of_a_save(bool async) {
  std::regex saved_re(R"(SAVED checkpoint_0 ([0-9a-f]{16}))"),
      saving_re(R"(SAVING checkpoint_1 ([0-9a-f]{16}))"),
      loaded_re(R"(LOADED (checkpoint_\d+) ([0-9a-f]{16}))");
  std::map<std::string, int> loaded_names;
  bool completed = false;
  for (int k = 0; k < 60 && !completed; ++k) {
    TempDir dir;
    auto r = run_launcher(dir,
                          {"-n", "1", "--", RUNTIME_WORKER_BIN, "save_killed", dir / "project",
                           std::to_string(k), async ? "async" : "sync"},
                          60s, {{"OMP_NUM_THREADS", "1"}});
    std::smatch m0, m1;
    ASSERT_TRUE(std::regex_search(r.out, m0, saved_re)) << r.out << r.err;
    ASSERT_TRUE(std::regex_search(r.out, m1, saving_re)) << r.out << r.err;
    completed = r.exit_code == 0;
    if (!completed) {
      ASSERT_NE(r.out.find("KILLED at op " + std::to_string(k)), std::string::npos)
          << r.out << r.err;
    }
    auto load =
        run_launcher(dir, {"-n", "1", "--", RUNTIME_WORKER_BIN, "load_newest", dir / "project"},
                     60s, {{"OMP_NUM_THREADS", "1"}});
    ASSERT_EQ(load.exit_code, 0) << "kill at op " << k << ": the newest checkpoint does not load\n"
                                 << load.out << load.err;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(load.out, m, loaded_re)) << load.out;
    const std::string name = m[1], hash = m[2];
    ++loaded_names[name];
    if (name == "checkpoint_0") {
      EXPECT_EQ(hash, m0[1].str()) << "kill at op " << k;
    } else {
      ASSERT_EQ(name, "checkpoint_1") << "kill at op " << k;
      EXPECT_EQ(hash, m1[1].str()) << "kill at op " << k;
    }
    if (completed) {
      EXPECT_EQ(name, "checkpoint_1");
    }
    // Nothing but the two checkpoints and (after a kill) hidden temp folders.
    for (const auto& e : fs::directory_iterator(dir.path() / "project" / "checkpoints")) {
      auto f = e.path().filename().string();
      EXPECT_TRUE(f == "checkpoint_0" || f == "checkpoint_1" || f.rfind(".checkpoint_1.", 0) == 0)
          << "kill at op " << k << ": unexpected " << f;
    }
  }
  EXPECT_TRUE(completed) << "the save never completed within 60 I/O operations";
  EXPECT_GT(loaded_names["checkpoint_0"], 5) << "too few kill points fell inside the save";
}

TEST(Checkpoint, KillAtEveryStepOfASaveLeavesALoadableCheckpoint) {
  kill_at_every_step_of_a_save(false);
}

TEST(Checkpoint, KillAtEveryStepOfABackgroundSaveLeavesALoadableCheckpoint) {
  kill_at_every_step_of_a_save(true);
}

// A ZeRO checkpoint saved by 2 processes loads at 3 with ZeRO (each process keeps other slices
// of it than the savers had) and without, and at 1: the weights are the saved ones, and 4 more
// steps on 3 processes end bitwise where the same steps from an unsharded run's checkpoint end
// (the two runs train alike bitwise, so their checkpoints must hold the same optimizer state).
TEST(Checkpoint, AZeroCheckpointLoadsAtAnotherWorldSizeWithOrWithoutZero) {
  TempDir dir;
  std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}};
  auto zero_env = env;
  zero_env["ACCEL_ZERO_STAGE"] = "1";
  const std::regex saved_re(R"(SAVED checkpoint_1 ([0-9a-f]{16}))"),
      loaded_re(R"(LOADED (checkpoint_\d+) ([0-9a-f]{16}))"),
      trained_re(R"(TRAINED ([0-9a-f]{16}))");
  std::map<std::string, std::string> saved;
  for (const std::string& run : {"zero", "unsharded"}) {
    auto save =
        run_launcher(dir, {"-n", "2", "--", RUNTIME_WORKER_BIN, "save_killed", dir / run, "100000"},
                     120s, run == "zero" ? zero_env : env);
    ASSERT_EQ(save.exit_code, 0) << save.out << save.err;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(save.out, m, saved_re)) << save.out;
    saved[run] = m[1];
  }
  EXPECT_EQ(saved["zero"], saved["unsharded"]) << "ZeRO trained to other weights";
  std::map<std::string, std::string> trained;
  struct Load {
    std::string from, processes;
    bool zero;
  };
  for (const Load& load :
       {Load{"zero", "3", true}, Load{"zero", "3", false}, Load{"unsharded", "3", true},
        Load{"unsharded", "3", false}, Load{"zero", "1", false}}) {
    std::string what = load.from + " checkpoint on " + load.processes +
                       (load.zero ? " processes with ZeRO" : " processes");
    auto r = run_launcher(
        dir, {"-n", load.processes, "--", RUNTIME_WORKER_BIN, "load_newest", dir / load.from, "4"},
        120s, load.zero ? zero_env : env);
    ASSERT_EQ(r.exit_code, 0) << what << "\n" << r.out << r.err;
    std::smatch loaded, steps;
    ASSERT_TRUE(std::regex_search(r.out, loaded, loaded_re)) << r.out;
    EXPECT_EQ(loaded[1].str(), "checkpoint_1") << what;
    EXPECT_EQ(loaded[2].str(), saved[load.from]) << what << ": not the saved weights";
    ASSERT_TRUE(std::regex_search(r.out, steps, trained_re)) << r.out;
    trained[what] = steps[1];
  }
  const std::string reference = trained["unsharded checkpoint on 3 processes"];
  for (const char* what :
       {"zero checkpoint on 3 processes with ZeRO", "zero checkpoint on 3 processes",
        "unsharded checkpoint on 3 processes with ZeRO"}) {
    EXPECT_EQ(trained[what], reference) << what << " trained on to other weights";
  }
}

TEST(Checkpoint, ACheckpointFromTwoProcessesLoadsOnOneAndThreeWithAWarning) {
  TempDir dir;
  std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}};
  // kill_at far past the end: both saves complete.
  auto save = run_launcher(
      dir, {"-n", "2", "--", RUNTIME_WORKER_BIN, "save_killed", dir / "project", "100000"}, 120s,
      env);
  ASSERT_EQ(save.exit_code, 0) << save.out << save.err;
  std::smatch saved;
  ASSERT_TRUE(
      std::regex_search(save.out, saved, std::regex(R"(SAVED checkpoint_1 ([0-9a-f]{16}))")))
      << save.out;
  for (const char* n : {"1", "3"}) {
    auto load = run_launcher(
        dir, {"-n", n, "--", RUNTIME_WORKER_BIN, "load_newest", dir / "project"}, 120s, env);
    ASSERT_EQ(load.exit_code, 0) << load.out << load.err;
    std::smatch loaded;
    ASSERT_TRUE(std::regex_search(load.out, loaded,
                                  std::regex(R"(LOADED (checkpoint_\d+) ([0-9a-f]{16}))")))
        << load.out;
    EXPECT_EQ(loaded[1].str(), "checkpoint_1");
    EXPECT_EQ(loaded[2].str(), saved[1].str())
        << "on " << n << " processes the weights differ from the saved ones";
    EXPECT_NE(load.err.find("was saved by 2 processes, this job has " + std::string(n)),
              std::string::npos)
        << load.err;
    EXPECT_NE(load.err.find("the RNG states are not (each was saved for one of the old ranks)"),
              std::string::npos)
        << load.err;
  }
}

}  // namespace
}  // namespace accel::testing

namespace accel::testing {
namespace {

// SIGUSR1 to accel-launch (what Slurm's --signal=USR1@T sends before a time limit): the workers
// agree on a step, save a checkpoint there and stop with 138; the next run resumes at exactly
// that step and ends with the weights of a run that was never stopped.
TEST(Checkpoint, Usr1SavesAtAStepStopsWith138AndTheNextRunResumesThere) {
  TempDir dir;
  std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}};
  auto expected = uninterrupted_run(dir, env).model;
  ASSERT_GT(expected.size(), 1000u);

  TempDir run;
  std::vector<std::string> launch = {
      "--checkpoint-dir", run / "ck", "--checkpoint-interval", "10", "-n", "2", "--"};
  auto a = classifier_args(run / "model");
  launch.insert(launch.end(), a.begin(), a.end());
  Launched job(run, launch, env);
  ASSERT_TRUE(wait_for_first_checkpoint(run.path() / "ck")) << "no first checkpoint";
  ::kill(job.pid(), SIGUSR1);
  auto stopped = job.wait(120s);
  std::string all = stopped.out + stopped.err;
  std::smatch saved;
  std::regex saved_re("\\(save and stop\\): saved (\\S+) at step (\\d+)");
  if (stopped.exit_code == 0) GTEST_SKIP() << "the job ended before SIGUSR1 reached it";
  ASSERT_EQ(stopped.exit_code, 138) << all;
  ASSERT_TRUE(std::regex_search(all, saved, saved_re)) << all;
  EXPECT_NE(all.find("received SIGUSR1"), std::string::npos) << all;
  EXPECT_FALSE(fs::exists(run.path() / "model" / "model.safetensors"));

  auto resumed = run_launcher(run, launch, 120s, env);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.out << resumed.err;
  std::string at_step = "at step " + saved[2].str() + " ";
  EXPECT_NE(resumed.out.find("accel: resumed from " + saved[1].str() + " " + at_step),
            std::string::npos)
      << "saved " << saved[0] << "\n"
      << resumed.out;
  EXPECT_EQ(file_bytes(run.path() / "model" / "model.safetensors"), expected)
      << "the final weights differ from the uninterrupted run\n"
      << resumed.out;
}

}  // namespace
}  // namespace accel::testing

namespace accel::testing {
namespace {

// The "step" a checkpoint's manifest records, or -1.
long manifest_step(const fs::path& checkpoint) {
  std::smatch m;
  std::string text = file_bytes(checkpoint / "manifest.json");
  return std::regex_search(text, m, std::regex(R"("step"\s*:\s*(\d+))")) ? std::stol(m[1]) : -1;
}

// A save to the program's own folder (save_state(dir/"best")) is not an automatic checkpoint:
// SIGUSR1 at that step still writes one and stops there, and the periodic save of that step still
// happens. Each case: the stopped run exits 138 naming a checkpoint folder at the signal's step;
// the next run resumes there and ends with the weights of a run that was never stopped.
TEST(Checkpoint, Usr1AfterASaveToTheProgramsOwnFolderStillLeavesAnAutomaticCheckpoint) {
  struct Case {
    std::vector<std::string> flags;
    int save_at, signal_at;
    std::vector<long> periodic;  // steps that must have an automatic checkpoint besides the stop's
  };
  const std::vector<Case> cases = {
      {{}, 3, 3, {}},
      {{"--checkpoint-interval", "3"}, 3, 4, {3}},
      {{"--checkpoint-interval", "3", "--async-checkpoints"}, 3, 3, {}},
  };
  const std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}};
  auto launch = [&](const TempDir& dir, const Case& c, int signal_at) {
    std::vector<std::string> args = {"-n", "2", "--checkpoint-dir", dir / "ck"};
    args.insert(args.end(), c.flags.begin(), c.flags.end());
    for (std::string a :
         {std::string("--"), std::string(RUNTIME_WORKER_BIN), std::string("usr1_at"),
          std::string("8"), std::to_string(c.save_at), std::to_string(signal_at)})
      args.push_back(a);
    return run_launcher(dir, args, 60s, env);
  };
  const std::regex final_line("FINAL ([0-9a-f]+)");
  for (const auto& c : cases) {
    SCOPED_TRACE(::testing::PrintToString(c.flags) + " save at " + std::to_string(c.save_at) +
                 ", SIGUSR1 at " + std::to_string(c.signal_at));
    TempDir plain, stopped;
    auto uninterrupted = launch(plain, c, -1);
    ASSERT_EQ(uninterrupted.exit_code, 0) << uninterrupted.out << uninterrupted.err;
    std::smatch want;
    ASSERT_TRUE(std::regex_search(uninterrupted.out, want, final_line)) << uninterrupted.out;

    auto first = launch(stopped, c, c.signal_at);
    std::string all = first.out + first.err;
    ASSERT_EQ(first.exit_code, 138) << all;
    std::smatch saved;
    ASSERT_TRUE(std::regex_search(all, saved,
                                  std::regex(R"(\(save and stop\): saved (\S+) at step (\d+))")))
        << all;
    EXPECT_EQ(saved[2].str(), std::to_string(c.signal_at)) << all;
    const fs::path where = saved[1].str();
    EXPECT_EQ(where.parent_path(), stopped.path() / "ck" / "checkpoints") << all;
    EXPECT_EQ(manifest_step(where), c.signal_at) << all;
    EXPECT_EQ(manifest_step(stopped.path() / "ck" / "best"), c.save_at);
    for (long step : c.periodic) {
      bool found = false;
      for (const auto& e : fs::directory_iterator(stopped.path() / "ck" / "checkpoints"))
        found = found || manifest_step(e.path()) == step;
      EXPECT_TRUE(found) << "no automatic checkpoint of step " << step;
    }

    auto resumed = launch(stopped, c, c.signal_at);
    ASSERT_EQ(resumed.exit_code, 0) << resumed.out << resumed.err;
    EXPECT_NE(resumed.out.find("accel: resumed from " + where.string() + " at step " +
                               std::to_string(c.signal_at)),
              std::string::npos)
        << resumed.out;
    std::smatch got;
    ASSERT_TRUE(std::regex_search(resumed.out, got, final_line)) << resumed.out;
    EXPECT_EQ(got[1].str(), want[1].str())
        << "the resumed weights differ from the uninterrupted run";
  }
}

}  // namespace
}  // namespace accel::testing

namespace accel::testing {
namespace {

// A job with background checkpoints says, with ACCEL_LOG_LEVEL=debug, where its writer thread
// runs: on the CPU ACCEL_CHECKPOINT_WRITER_CPUS names, where the scheduler puts it with "any",
// and by default where the checkpoint disk's interrupts land or why nowhere in particular. A
// setting that is not a CPU list stops the job with an error naming the variable.
TEST(Checkpoint, TheBackgroundWriterRunsWhereItIsToldAndSaysSo) {
  cpu_set_t mine;
  CPU_ZERO(&mine);
  ASSERT_EQ(::sched_getaffinity(0, sizeof mine, &mine), 0);
  int last = -1;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &mine)) last = c;
  ASSERT_GE(last, 0);
  auto run = [](const std::string& setting) {
    TempDir dir;
    // Why OMP_PROC_BIND: a CI that sets it has libgomp pin the main thread, and the writer
    // would inherit that pin instead of the test's CPUs.
    std::map<std::string, std::string> env{
        {"OMP_NUM_THREADS", "1"}, {"ACCEL_LOG_LEVEL", "debug"}, {"OMP_PROC_BIND", "false"}};
    if (!setting.empty()) env["ACCEL_CHECKPOINT_WRITER_CPUS"] = setting;
    auto r =
        run_launcher(dir,
                     {"-n", "1", "--checkpoint-dir", dir / "ck", "--checkpoint-interval", "3",
                      "--async-checkpoints", "--", RUNTIME_WORKER_BIN, "usr1_at", "8", "-1", "-1"},
                     60s, env);
    const bool saved = fs::exists(dir.path() / "ck" / "checkpoints");
    return std::make_pair(r, saved);
  };
  {
    const std::string cpu = std::to_string(last);
    auto [r, saved] = run(cpu);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_TRUE(saved);
    const std::string want = CPU_COUNT(&mine) > 1
                                 ? "accel: background checkpoint writer runs on CPU " + cpu +
                                       ": ACCEL_CHECKPOINT_WRITER_CPUS=" + cpu + "\n"
                                 : "accel: background checkpoint writer left where the scheduler "
                                   "puts it: ACCEL_CHECKPOINT_WRITER_CPUS=" +
                                       cpu;
    EXPECT_NE(r.err.find(want), std::string::npos) << r.err;
  }
  {
    auto [r, saved] = run("any");
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_TRUE(saved);
    EXPECT_NE(r.err.find("accel: background checkpoint writer left where the scheduler puts it: "
                         "ACCEL_CHECKPOINT_WRITER_CPUS=any\n"),
              std::string::npos)
        << r.err;
  }
  {
    auto [r, saved] = run("");
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_TRUE(saved);
    EXPECT_EQ(r.err.find("cannot stat"), std::string::npos) << r.err;
    std::smatch m;
    EXPECT_TRUE(std::regex_search(
        r.err, m,
        std::regex("accel: background checkpoint writer (runs on CPU [0-9,-]+: /dev/\\S+'s "
                   "interrupts \\(IRQ [0-9]+\\) land on CPU [0-9,-]+|left where the scheduler "
                   "puts it: .+)\n")))
        << r.err;
  }
  {
    auto [r, saved] = run("fast");
    EXPECT_NE(r.exit_code, 0) << r.out << r.err;
    EXPECT_FALSE(saved);
    EXPECT_NE(r.err.find("ACCEL_CHECKPOINT_WRITER_CPUS=\"fast\": expected auto, any or a list of "
                         "CPUs such as 1 or 2-3,6"),
              std::string::npos)
        << r.err;
  }
}

// A job whose one process runs its products on every CPU (OpenBLAS's threads, as a program run
// alone gets them, while ATen's count is 1) leaves its background writer where the scheduler
// puts it, and says why: on the interrupts' CPU it would share that CPU with one of them.
TEST(Checkpoint, TrainingOnEveryCpuThroughOpenBlasLeavesTheWriterUnplaced) {
  cpu_set_t mine;
  CPU_ZERO(&mine);
  ASSERT_EQ(::sched_getaffinity(0, sizeof mine, &mine), 0);
  const int cpus = CPU_COUNT(&mine);
  void* libblas = ::dlopen("libblas.so.3", RTLD_NOW | RTLD_LOCAL);
  const bool openblas = libblas && ::dlsym(libblas, "openblas_get_num_threads");
  if (libblas) ::dlclose(libblas);
  if (!openblas || cpus < 2) GTEST_SKIP() << "needs OpenBLAS as libblas.so.3 and 2 CPUs";
  TempDir dir;
  std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"},
                                         {"OPENBLAS_NUM_THREADS", std::to_string(cpus)},
                                         {"ACCEL_LOG_LEVEL", "debug"},
                                         {"ACCEL_CHECKPOINT_WRITER_CPUS", "auto"},
                                         {"OMP_PROC_BIND", "false"}};
  auto r =
      run_launcher(dir,
                   {"-n", "1", "--checkpoint-dir", dir / "ck", "--checkpoint-interval", "3",
                    "--async-checkpoints", "--", RUNTIME_WORKER_BIN, "usr1_at", "8", "-1", "-1"},
                   60s, env);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(fs::exists(dir.path() / "ck" / "checkpoints")) << r.err;
  // Unless the disk has no single interrupt to follow, in which case nothing moves anyway.
  if (r.err.find("accel: background checkpoint writer runs on CPU") != std::string::npos ||
      r.err.find("training keeps every CPU") != std::string::npos) {
    // Why not the count: OpenBLAS takes no more threads than it was built for.
    EXPECT_NE(r.err.find("but training keeps every CPU this process may use busy ("),
              std::string::npos)
        << r.err;
  }
}

}  // namespace
}  // namespace accel::testing

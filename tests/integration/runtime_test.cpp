// libaccel across real processes: runtime_worker under the real accel-launch, on 1, 2 and 3
// processes (collectives, sharding, gather_for_metrics counts, training equivalence, hangs).
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "tests/integration/harness.h"

namespace accel::testing {
namespace {

std::vector<std::string> worker(int n, std::vector<std::string> args) {
  std::vector<std::string> argv{"-n", std::to_string(n), "--", RUNTIME_WORKER_BIN};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

RunResult run_worker(const TempDir& dir, int n, std::vector<std::string> args,
                     std::map<std::string, std::string> env = {}) {
  env["ACCEL_TEST_DIR"] = dir.path().string();
  env["OMP_NUM_THREADS"] = "1";
  return run_launcher(dir, worker(n, std::move(args)), 120s, env);
}

#define EXPECT_JOB_OK(r) \
  EXPECT_EQ((r).exit_code, 0) << "stdout:\n" << (r).out << "\nstderr:\n" << (r).err

// prepare() makes every rank's parameters rank 0's, the frozen ones (requires_grad false)
// included, as DDP does: a frozen part initialised per rank would otherwise stay different on
// each rank for the whole run, and keep diverging once unfrozen.
TEST(Runtime, FrozenParametersAreRankZerosAfterPrepare) {
  TempDir dir;
  for (int n : {2, 3}) {
    auto r = run_worker(dir, n, {"frozen"});
    EXPECT_JOB_OK(r);
    EXPECT_NE(r.out.find("OK equal frozen and trainable parameters on " + std::to_string(n) +
                         " processes"),
              std::string::npos)
        << r.out << r.err;
  }
}

// "[rank 0] SHARD rank 1: [2,3] [6,7]" -> {"[2,3] [6,7]" for rank 1}
std::vector<std::string> shard_lines(const std::string& out, int n) {
  std::vector<std::string> rows(static_cast<std::size_t>(n));
  std::regex re(R"(SHARD rank (\d+):\s*(.*)$)");
  for (const auto& line : lines_of(out)) {
    std::smatch m;
    if (std::regex_search(line, m, re)) rows[std::stoul(m[1])] = m[2];
  }
  return rows;
}

// Both transports: shared memory between local ranks (the default) and gloo alone.
TEST(Runtime, EveryCollectiveOnTwoAndThreeProcesses) {
  for (std::string shm : {"1", "0"}) {
    for (int n : {1, 2, 3}) {
      TempDir dir;
      auto r = run_worker(dir, n, {"collectives"}, {{"ACCEL_SHM_COLLECTIVES", shm}});
      EXPECT_JOB_OK(r) << " ACCEL_SHM_COLLECTIVES=" << shm;
      EXPECT_NE(r.out.find("OK collectives on " + std::to_string(n) + " processes"),
                std::string::npos)
          << r.out;
      // A peer 2 x 300 ms late is wait time on rank 0's progress page (the straggler rule's
      // input), through shared memory as through gloo.
      if (n > 1) {
        EXPECT_NE(r.out.find("OK rank 0's progress page counts"), std::string::npos)
            << " ACCEL_SHM_COLLECTIVES=" << shm << "\n"
            << r.out;
      }
    }
  }
}

// reference/accelerate.md §5: 2 processes over range(9), row by row.
TEST(Runtime, ShardingTableOfHfAccelerate) {
  struct Row {
    std::string batch, mode, rank0, rank1;
  };
  const std::vector<Row> table{
      {"2", "even", "[0,1] [4,5] [8,0]", "[2,3] [6,7] [1,2]"},
      {"2", "uneven", "[0,1] [4,5] [8]", "[2,3] [6,7]"},
      {"2", "drop_last", "[0,1] [4,5]", "[2,3] [6,7]"},
      {"5", "even", "[0,1,2,3,4]", "[5,6,7,8,0]"},
      {"5", "uneven", "[0,1,2,3,4]", "[5,6,7,8]"},
      {"4", "split", "[0,1] [4,5] [8,0]", "[2,3] [6,7] [1,2]"},
  };
  for (const auto& row : table) {
    TempDir dir;
    auto r = run_worker(dir, 2, {"shard", "9", row.batch, row.mode});
    EXPECT_JOB_OK(r);
    auto rows = shard_lines(r.out, 2);
    EXPECT_EQ(rows[0], row.rank0) << "bs=" << row.batch << " " << row.mode;
    EXPECT_EQ(rows[1], row.rank1) << "bs=" << row.batch << " " << row.mode;
  }
  TempDir dir;
  auto bad = run_worker(dir, 2, {"shard", "9", "5", "split"});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE((bad.out + bad.err).find("split_batches needs a batch size that divides evenly"),
            std::string::npos)
      << bad.out << bad.err;
}

TEST(Runtime, ShardingOnThreeProcesses) {
  TempDir dir;
  auto r = run_worker(dir, 3, {"shard", "10", "2", "even"});
  EXPECT_JOB_OK(r);
  auto rows = shard_lines(r.out, 3);
  // Rounds of 6: [0..5], then [6,7] [8,9] and a third batch cycled from the start.
  EXPECT_EQ(rows[0], "[0,1] [6,7]");
  EXPECT_EQ(rows[1], "[2,3] [8,9]");
  EXPECT_EQ(rows[2], "[4,5] [0,1]");
}

TEST(Runtime, GatherForMetricsCountsEverySampleOnce) {
  struct Case {
    int n;
    std::string size, batch, mode, kind;
  };
  const std::vector<Case> cases{
      {2, "9", "2", "even", "map"},    {3, "9", "2", "even", "map"},
      {3, "10", "4", "even", "map"},   {2, "9", "5", "uneven", "map"},
      {3, "11", "2", "uneven", "map"}, {2, "4", "3", "even", "map"},
      {2, "9", "2", "even", "stream"}, {3, "10", "3", "even", "stream"},
      {3, "2", "2", "even", "stream"},
  };
  for (const auto& c : cases) {
    TempDir dir;
    auto r = run_worker(dir, c.n, {"metrics", c.size, c.batch, c.mode, c.kind});
    EXPECT_JOB_OK(r) << " n=" << c.n << " size=" << c.size << " bs=" << c.batch << " " << c.mode
                     << " " << c.kind;
    EXPECT_NE(r.out.find("METRICS count " + c.size), std::string::npos) << r.out;
  }
}

std::vector<double> read_weights(const std::string& path) {
  std::vector<double> w;
  for (const auto& line : lines_of(read_file(path))) w.push_back(std::stod(line));
  return w;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    d = std::max(d, std::abs(a[i] - b[i]));
  return d;
}

// N processes on a global batch G train to the weights of 1 process on batch G. The only
// difference is the float32 summation order of the gradient mean (one mean over G versus a mean
// of N means): ~1e-7 relative per step. 20 AdamW steps with lr 1e-2 move each weight by at most
// 20 * lr = 0.2, and AdamW's update is at most lr per step whatever the gradient's error, so a
// 1e-5 bound is 50x the worst step-count * lr * eps estimate and still catches a wrong average
// (a missing 1/N, a dropped bucket or a skipped sync moves weights by >1e-3).
constexpr double kTolerance = 1e-5;

TEST(Runtime, TwoAndThreeProcessesTrainLikeOneProcessOnTheGlobalBatch) {
  TempDir dir;
  auto one = run_worker(dir, 1, {"train", dir / "w1", "12", "20", "plain"});
  EXPECT_JOB_OK(one);
  auto reference = read_weights(dir / "w1");
  ASSERT_GT(reference.size(), 100u);
  for (std::string shm : {"1", "0"}) {
    for (int n : {2, 3}) {
      std::string file = dir / ("w" + std::to_string(n) + "_" + shm);
      auto r = run_worker(dir, n, {"train", file, "12", "20", "plain"},
                          {{"ACCEL_SHM_COLLECTIVES", shm}});
      EXPECT_JOB_OK(r);
      EXPECT_LT(max_abs_diff(reference, read_weights(file)), kTolerance)
          << n << " processes, shm " << shm;
    }
  }
}

// At prepare() the ranks of a machine time the gradient buckets' all-reduce both ways (split in
// place, copy through the slots) and all keep the same one: with ACCEL_LOG_LEVEL=debug every rank
// prints the slowest rank's times and the choice, the same line on each ("wide": 1.7 M
// parameters, buckets of MBs; a model whose buckets are under 1 MiB is not timed). Whichever is
// chosen, the weights are the same bits: forced split and forced copy (ACCEL_SHM_ALLREDUCE, which
// skips the timing) end with equal weights, on 3 processes where the split cuts tensors in three.
TEST(Runtime, TheAllReduceIsTimedBothWaysAtPrepareAndEveryRankKeepsTheSame) {
  TempDir dir;
  const std::regex timed(
      R"(rank (\d+): shared-memory all-reduce of the largest gradient bucket \([0-9.]+ MB\), )"
      R"(the slowest rank's best of 3: (split [0-9.]+ ms, copy [0-9.]+ ms: (split|copy)))");
  for (int n : {2, 3}) {
    auto r = run_worker(dir, n, {"train", dir / ("auto" + std::to_string(n)), "12", "10", "wide"},
                        {{"ACCEL_LOG_LEVEL", "debug"}});
    EXPECT_JOB_OK(r);
    std::set<std::string> ranks, lines;
    for (const auto& line : lines_of(r.err)) {
      std::smatch m;
      if (!std::regex_search(line, m, timed)) continue;
      ranks.insert(m[1]);
      lines.insert(m[2]);
    }
    EXPECT_EQ(ranks.size(), static_cast<std::size_t>(n)) << r.err;
    EXPECT_EQ(lines.size(), 1u) << "the ranks disagree on the times or the choice:\n" << r.err;
  }
  auto small = run_worker(dir, 2, {"train", dir / "small", "12", "10", "plain"},
                          {{"ACCEL_LOG_LEVEL", "debug"}});
  EXPECT_JOB_OK(small);
  EXPECT_EQ(small.err.find("the slowest rank's best of 3"), std::string::npos)
      << "buckets under 1 MiB were timed:\n"
      << small.err;
  std::map<std::string, std::string> forced;
  for (std::string algorithm : {"split", "copy"}) {
    const std::string file = dir / ("forced_" + algorithm);
    auto r = run_worker(dir, 3, {"train", file, "12", "10", "wide"},
                        {{"ACCEL_SHM_ALLREDUCE", algorithm}, {"ACCEL_LOG_LEVEL", "debug"}});
    EXPECT_JOB_OK(r);
    EXPECT_EQ(r.err.find("the slowest rank's best of 3"), std::string::npos)
        << "ACCEL_SHM_ALLREDUCE=" << algorithm << " did not skip the timing:\n"
        << r.err;
    forced[algorithm] = read_file(file);
  }
  ASSERT_GT(forced["split"].size(), 6'000'000u);  // 1.7 M float32 weights
  EXPECT_TRUE(forced["split"] == forced["copy"])
      << "split and copy all-reduces trained to different weights";
  EXPECT_TRUE(read_file(dir / "auto3") == forced["split"])
      << "the timed run's weights differ from the forced ones";
}

// ZeRO stage 1: each rank keeps the optimizer state of a slice of the parameters and updates
// that slice; every element's update is the unsharded arithmetic, so the weights are the unsharded
// run's bitwise (the files hold every weight to float precision), on 2 and 3 processes (on 3 the
// slices cut parameters apart), with gradient accumulation too.
TEST(Runtime, ZeroStageOneTrainsBitwiseLikeTheUnshardedRun) {
  TempDir dir;
  // "wide": 1.7 M parameters, so each rank's updated slice is exchanged in several pieces (the
  // two halves of the shared exchange alternate), and its checkpoint's optimizer state is
  // gathered in several pieces.
  for (std::string mode : {"plain", "accumulate", "wide"}) {
    for (int n : {2, 3}) {
      std::string unsharded = dir / ("u" + std::to_string(n) + mode);
      std::string sharded = dir / ("z" + std::to_string(n) + mode);
      auto u = run_worker(dir, n, {"train", unsharded, "12", "10", mode});
      EXPECT_JOB_OK(u);
      auto z = run_worker(dir, n, {"train", sharded, "12", "10", mode},
                          {{"ACCEL_ZERO_STAGE", "1"}, {"ACCEL_LOG_LEVEL", "debug"}});
      EXPECT_JOB_OK(z);
      EXPECT_NE(z.err.find("ZeRO stage 1: optimizer 0 (torch::optim::AdamW) sharded; rank " +
                           std::to_string(n - 1) + " holds elements ["),
                std::string::npos)
          << z.err;
      EXPECT_NE(z.err.find("exchanged through shared memory"), std::string::npos) << z.err;
      EXPECT_EQ(read_file(sharded), read_file(unsharded)) << n << " processes, " << mode;
      EXPECT_GT(read_file(sharded).size(), 100u);
      if (mode == "wide") {  // the state gathered from the shards is the unsharded run's state
        EXPECT_GT(read_file(unsharded + ".state").size(), 13'000'000u);
        EXPECT_TRUE(read_file(sharded + ".state") == read_file(unsharded + ".state"))
            << n << " processes: the ZeRO checkpoint's optimizer state differs";
      }
    }
  }
}

// The optimizer step split between a machine's ranks (the default on shared memory): each rank
// updates its slice of the parameters and writes it into the others', with the optimizer state
// one copy per machine. Every element's update is the whole step's arithmetic, so the weights
// are bitwise those of every rank running the whole step (ACCEL_SPLIT_OPTIMIZER_STEP=0): with
// AdamW, Adam's L2 decay and Nesterov SGD, gradient accumulation, tied weights, frozen
// parameters each rank holds its own values of, gradients dropped after each step, a tensor of
// no prepared model added to the optimizer after 3 steps (from then on every rank steps whole,
// on its own copy of the state), and on 3 processes (the slices then cut parameters apart). "wide"
// also compares the optimizer state its checkpoint holds, which every rank's optimizer.state() must
// show whole.
TEST(Runtime, TheSplitOptimizerStepTrainsBitwiseLikeEveryRanksWholeStep) {
  TempDir dir;
  struct Case {
    std::string mode, optimizer;
    int n;
  };
  const std::vector<Case> cases = {
      {"plain", "adamw", 2},      {"plain", "adam", 3},   {"plain", "sgd", 2},
      {"accumulate", "adamw", 2}, {"wide", "adamw", 2},   {"wide", "adamw", 3},
      {"tied", "adamw", 2},       {"frozen", "sgd", 3},   {"set_to_none", "adamw", 2},
      {"add_group", "adamw", 2},  {"add_group", "sgd", 3}};
  for (const auto& c : cases) {
    const std::string name = c.mode + "-" + c.optimizer + "-" + std::to_string(c.n);
    const std::string whole = dir / ("whole-" + name), split = dir / ("split-" + name);
    auto w = run_worker(dir, c.n, {"train", whole, "12", "10", c.mode, c.optimizer},
                        {{"ACCEL_SPLIT_OPTIMIZER_STEP", "0"}, {"ACCEL_LOG_LEVEL", "debug"}});
    EXPECT_JOB_OK(w);
    EXPECT_EQ(w.err.find("optimizer step split"), std::string::npos) << name << "\n" << w.err;
    // Why 1 but for "wide": the others have fewer elements than the default's floor.
    auto s = run_worker(dir, c.n, {"train", split, "12", "10", c.mode, c.optimizer},
                        {{"ACCEL_LOG_LEVEL", "debug"},
                         {"ACCEL_SPLIT_OPTIMIZER_STEP", c.mode == "wide" ? "auto" : "1"}});
    EXPECT_JOB_OK(s);
    EXPECT_NE(s.err.find("optimizer step split between this machine's " + std::to_string(c.n) +
                         " ranks: this rank updates elements ["),
              std::string::npos)
        << name << "\n"
        << s.err;
    EXPECT_GT(read_file(split).size(), 100u) << name;
    EXPECT_TRUE(read_file(split) == read_file(whole)) << name << ": other weights";
    if (c.mode == "wide") {
      EXPECT_GT(read_file(whole + ".state").size(), 13'000'000u);
      EXPECT_TRUE(read_file(split + ".state") == read_file(whole + ".state"))
          << name << ": the checkpoint's optimizer state differs";
    }
  }
  // By default a small model's step stays whole (the split would cost more than it saves).
  auto small = run_worker(dir, 2, {"train", dir / "small", "12", "10", "plain"},
                          {{"ACCEL_LOG_LEVEL", "debug"}});
  EXPECT_JOB_OK(small);
  EXPECT_EQ(small.err.find("optimizer step split"), std::string::npos) << small.err;
}

std::vector<double> numbers_of(const std::string& text) {
  std::vector<double> out;
  std::istringstream in(text);
  for (double v; in >> v;) out.push_back(v);
  return out;
}

// ZeRO stage 1 where a model's parameters() are not a plain list: tied weights (a module
// registered under two names, so libtorch lists its tensors twice) step once, as PyTorch's
// parameters() lists them once: bitwise the unsharded run, which equals 1 process to float
// rounding; a frozen parameter the ranks hold different values of is never written by the
// exchange; an optimizer holding a tensor of no prepared model is refused at its first step.
TEST(Runtime, ZeroStageOneStepsTiedWeightsOnceNeverWritesFrozenOnesAndRefusesForeignOnes) {
  TempDir dir;
  const std::string one = dir / "tied1";
  EXPECT_JOB_OK(run_worker(dir, 1, {"train", one, "12", "8", "tied"}));
  for (std::string mode : {"tied", "frozen"}) {
    for (int n : {2, 3}) {
      std::string unsharded = dir / ("u" + std::to_string(n) + mode);
      std::string sharded = dir / ("z" + std::to_string(n) + mode);
      auto u = run_worker(dir, n, {"train", unsharded, "12", "8", mode});
      EXPECT_JOB_OK(u);
      auto z = run_worker(dir, n, {"train", sharded, "12", "8", mode}, {{"ACCEL_ZERO_STAGE", "1"}});
      EXPECT_JOB_OK(z);
      EXPECT_GT(read_file(sharded).size(), 100u);
      EXPECT_EQ(read_file(sharded), read_file(unsharded)) << n << " processes, " << mode;
      if (mode != "tied") continue;
      EXPECT_NE(z.err.find("optimizer 0 lists 2 tensor(s) more than once (tied weights, or a "
                           "module registered under two names): group 0 parameter 6, group 0 "
                           "parameter 7; each tensor is stepped once"),
                std::string::npos)
          << z.err;
      auto a = numbers_of(read_file(sharded)), b = numbers_of(read_file(one));
      ASSERT_EQ(a.size(), b.size());
      for (std::size_t i = 0; i < a.size(); ++i)
        EXPECT_NEAR(a[i], b[i], 1e-5) << "weight " << i << " on " << n << " processes";
    }
  }
  auto refused = run_worker(dir, 2, {"foreign"}, {{"ACCEL_ZERO_STAGE", "1"}});
  EXPECT_JOB_OK(refused);
  EXPECT_NE(refused.out.find("REFUSED accel: ZeRO stage 1: parameter 6 of the optimizer (Float, 5 "
                             "elements) belongs to no prepared model"),
            std::string::npos)
      << refused.out << refused.err;
}

// Two "machines" of two ranks each on this one (accel-launch --nodes 2, one launcher per
// machine): collectives go through shared memory within each machine and gloo between the two
// leaders. Every collective gives the exact answers, and training ends where one process does
// (the same tolerance: only the order of the float sums differs).
RunResult run_two_machines(const TempDir& dir, const std::vector<std::string>& args,
                           const std::map<std::string, std::string>& extra = {}) {
  int port = free_port();
  std::map<std::string, std::string> env = {{"ACCEL_TOKEN", "runtime-test-token"},
                                            {"ACCEL_TEST_DIR", dir.path().string()},
                                            {"OMP_NUM_THREADS", "1"},
                                            {"ACCEL_LOG_LEVEL", "debug"}};
  env.insert(extra.begin(), extra.end());
  std::vector<std::unique_ptr<Launched>> machines;
  for (int m = 0; m < 2; ++m) {
    std::vector<std::string> argv{"--nodes",
                                  "2",
                                  "--machine-rank",
                                  std::to_string(m),
                                  "-n",
                                  "2",
                                  "--coordinator-port",
                                  std::to_string(port),
                                  "--",
                                  RUNTIME_WORKER_BIN};
    argv.insert(argv.end(), args.begin(), args.end());
    machines.push_back(std::make_unique<Launched>(dir, ACCEL_LAUNCH_BIN, argv, env,
                                                  "machine" + std::to_string(m)));
  }
  RunResult r0 = machines[0]->wait(120s);
  RunResult r1 = machines[1]->wait(30s);
  EXPECT_EQ(r1.exit_code, 0) << "machine 1:\n" << r1.out << r1.err;
  r0.out += r1.out;
  r0.err += r1.err;
  return r0;
}

TEST(Runtime, TwoMachinesOfTwoRanksUseHierarchicalCollectives) {
  TempDir dir;
  auto r = run_two_machines(dir, {"collectives"});
  EXPECT_JOB_OK(r);
  EXPECT_NE(r.out.find("OK collectives on 4 processes"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("hierarchical collectives: shared memory within each of 2 machines"),
            std::string::npos)
      << r.err;
  auto flat = run_two_machines(dir, {"collectives"}, {{"ACCEL_SHM_COLLECTIVES", "0"}});
  EXPECT_JOB_OK(flat);
  EXPECT_EQ(flat.err.find("hierarchical"), std::string::npos) << "ACCEL_SHM_COLLECTIVES=0";

  auto one = run_worker(dir, 1, {"train", dir / "w1", "12", "20", "plain"});
  EXPECT_JOB_OK(one);
  auto trained = run_two_machines(dir, {"train", dir / "w4", "12", "20", "plain"});
  EXPECT_JOB_OK(trained);
  EXPECT_LT(max_abs_diff(read_weights(dir / "w1"), read_weights(dir / "w4")), kTolerance);
}

// set_to_none: gradients replaced between steps instead of zeroed in place (they alias the
// all-reduce buckets, so the sync must notice and re-attach them).
TEST(Runtime, AccumulationAndNoSyncTrainLikeTheGlobalBatch) {
  TempDir dir;
  auto one = run_worker(dir, 1, {"train", dir / "w1", "12", "10", "plain"});
  EXPECT_JOB_OK(one);
  auto reference = read_weights(dir / "w1");
  for (std::string mode : {"accumulate", "no_sync", "set_to_none"}) {
    for (int n : {1, 2, 3}) {
      std::string file = dir / (mode + std::to_string(n));
      auto r = run_worker(dir, n, {"train", file, "12", "10", mode});
      EXPECT_JOB_OK(r) << mode << " n=" << n;
      EXPECT_LT(max_abs_diff(reference, read_weights(file)), kTolerance)
          << mode << " on " << n << " processes";
    }
  }
}

// A backward that throws after some buckets were launched, caught, through acc.backward and a
// plain loss.backward(), over both transports: nothing of it lands in .grad after zero_grad,
// nothing stays open on the progress page, and gradients sync again.
TEST(Runtime, GradientsStillSyncAfterABackwardThatThrew) {
  for (std::string how : {"acc", "plain"}) {
    for (std::string shm : {"1", "0"}) {
      TempDir dir;
      auto r = run_worker(dir, 2, {"backward_throws", how}, {{"ACCEL_SHM_COLLECTIVES", shm}});
      EXPECT_JOB_OK(r) << how << " ACCEL_SHM_COLLECTIVES=" << shm;
      EXPECT_NE(r.out.find("OK backward_throws"), std::string::npos) << r.out;
    }
  }
}

// A backward run inside a backward (reentrant activation checkpointing) that adds a second
// gradient into a parameter whose bucket is already being all-reduced: before, that gradient
// missed the average (the gradients differed from the ranks' own averaged by 0.26 over both
// transports); now backward (acc.backward or a bare loss.backward()) refuses it on every rank,
// naming the parameter, before it is added, and the next step syncs as usual. One that arrives
// before its bucket is launched is averaged.
TEST(Runtime, ASecondGradientIntoALaunchedBucketIsRefusedOnEveryRankAndTheRunGoesOn) {
  TempDir dir;
  for (std::string shm : {"1", "0"}) {
    // Through acc.backward, and through a bare loss.backward() as an HF-style program writes it.
    for (std::string how : {"acc", "plain"}) {
      auto r = run_worker(dir, 2, {"reentrant", "launched", how}, {{"ACCEL_SHM_COLLECTIVES", shm}});
      EXPECT_JOB_OK(r) << "ACCEL_SHM_COLLECTIVES=" << shm << " " << how;
      for (std::string rank : {"0", "1"}) {
        EXPECT_NE(r.out.find("rank " + rank +
                             " refused: accel: backward accumulated a second gradient into "
                             "trainable parameter #4 (shape [2, 16]"),
                  std::string::npos)
            << "ACCEL_SHM_COLLECTIVES=" << shm << " " << how << "\n"
            << r.out;
      }
      EXPECT_NE(r.out.find("OK reentrant refused on every rank, and the next step synced"),
                std::string::npos)
          << how << "\n"
          << r.out;
    }
    // One bucket, held until backward ends by a parameter no rank uses: the second gradient
    // arrives before the launch and is averaged with the rest.
    auto held = run_worker(dir, 2, {"reentrant", "held"}, {{"ACCEL_SHM_COLLECTIVES", shm}});
    EXPECT_JOB_OK(held) << "ACCEL_SHM_COLLECTIVES=" << shm;
    EXPECT_NE(held.out.find("OK reentrant accepted before the launch, gradients averaged"),
              std::string::npos)
        << held.out;
  }
}

// The same run with a caught throwing backward trains to the weights of 1 process (where the
// exception costs nothing but the lost batch's partial gradients, which zero_grad drops).
TEST(Runtime, ACaughtThrowingBackwardTrainsLikeOneProcess) {
  TempDir dir;
  auto one = run_worker(dir, 1, {"train", dir / "w1", "12", "10", "plain"});
  EXPECT_JOB_OK(one);
  auto reference = read_weights(dir / "w1");
  for (std::string mode : {"throw_acc", "throw_plain"}) {
    for (std::string shm : {"1", "0"}) {
      std::string file = dir / (mode + shm);
      auto r =
          run_worker(dir, 2, {"train", file, "12", "10", mode}, {{"ACCEL_SHM_COLLECTIVES", shm}});
      EXPECT_JOB_OK(r) << mode << " shm " << shm;
      EXPECT_LT(max_abs_diff(reference, read_weights(file)), kTolerance) << mode << " shm " << shm;
    }
  }
}

// A caught throwing backward is no hang: its collectives are closed on the progress page, so
// slow steps afterwards (each shorter than the hang timeout) run to the end.
TEST(Runtime, ACaughtThrowingBackwardIsNotTakenForAHang) {
  TempDir dir;
  std::vector<std::string> argv{
      "-n",    "2",  "--hang-timeout", "1s", "--", RUNTIME_WORKER_BIN, "backward_throws",
      "plain", "500"};
  auto r = run_launcher(dir, argv, 120s,
                        {{"ACCEL_TEST_DIR", dir.path().string()}, {"ACCEL_SHM_COLLECTIVES", "0"}});
  EXPECT_JOB_OK(r);
  EXPECT_EQ(r.err.find("hang detected"), std::string::npos) << r.err;
}

TEST(Runtime, RankThatSkipsABarrierFailsWithinTheTimeoutNamingIt) {
  TempDir dir;
  auto r = run_worker(dir, 2, {"mismatch", "sleep"}, {{"ACCEL_COLLECTIVE_TIMEOUT", "4s"}});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_LT(r.elapsed, 20s)
      << "the healthy rank must fail at the 4 s timeout, not wait for the sleeper";
  // The summary names the collective, its number and the timeout, and where the peer was.
  EXPECT_NE(r.err.find("barrier #"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("timed out after 4 s"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("rank 1 did not report"), std::string::npos) << r.err;
}

// Same op and byte count, another dtype: shared memory still refuses to mix them.
TEST(Runtime, SameSizeCollectiveWithAnotherDtypeFailsOverSharedMemory) {
  TempDir dir;
  auto r = run_worker(dir, 2, {"mismatch", "dtype"}, {{"ACCEL_COLLECTIVE_TIMEOUT", "60s"}});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_LT(r.elapsed, 20s);
  EXPECT_NE(
      (r.out + r.err)
          .find("allreduce #1 (8 bytes) with another dtype, root or reduce op than this rank"),
      std::string::npos)
      << r.out << r.err;
}

// Same op, size and dtype, but one rank's tensor lies in a shared block (as the gradient buckets
// do) and the other's in private memory: refused at once, not reduced from the wrong place.
TEST(Runtime, AllReduceOfASharedBufferAgainstAPrivateOneFailsOverSharedMemory) {
  TempDir dir;
  auto r = run_worker(dir, 2, {"mismatch", "place"}, {{"ACCEL_COLLECTIVE_TIMEOUT", "60s"}});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_LT(r.elapsed, 20s);
  EXPECT_NE((r.out + r.err)
                .find("allreduce #2 (4000 bytes) on a tensor at another place (shared block or "
                      "private memory) than this rank"),
            std::string::npos)
      << r.out << r.err;
}

// Gloo cannot tell two collectives apart: both ranks wait for the timeout, then each names its own
// collective and the other rank's (the desync report).
TEST(Runtime, RankThatCallsAnotherCollectiveOverGlooTimesOutNamingBoth) {
  TempDir dir;
  auto r = run_worker(dir, 2, {"mismatch", "other_collective"},
                      {{"ACCEL_COLLECTIVE_TIMEOUT", "4s"}, {"ACCEL_SHM_COLLECTIVES", "0"}});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_LT(r.elapsed, 20s);
  std::string all = r.out + r.err;
  EXPECT_TRUE(
      all.find("barrier #1 (0 bytes) on rank 0 of 2 timed out after 4 s") != std::string::npos ||
      all.find("allreduce #1 (4000 bytes) on rank 1 of 2 timed out after 4 s") != std::string::npos)
      << all;
  EXPECT_TRUE(all.find("rank 1 failed in allreduce #1") != std::string::npos ||
              all.find("rank 0 failed in barrier #1") != std::string::npos)
      << all;
}

// Shared memory records each rank's call: the mismatch fails at once, long before the timeout.
TEST(Runtime, RankThatCallsAnotherCollectiveOverSharedMemoryFailsAtOnce) {
  TempDir dir;
  auto r =
      run_worker(dir, 2, {"mismatch", "other_collective"}, {{"ACCEL_COLLECTIVE_TIMEOUT", "60s"}});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_LT(r.elapsed, 20s) << "must not wait for the 60 s timeout";
  std::string all = r.out + r.err;
  EXPECT_TRUE(
      all.find(
          "mismatched collectives: rank 1 called allreduce #1 (4000 bytes) while this rank called "
          "barrier #1 (0 bytes)") != std::string::npos ||
      all.find("mismatched collectives: rank 0 called barrier #1 (0 bytes) while this rank called "
               "allreduce #1 (4000 bytes)") != std::string::npos)
      << all;
}

}  // namespace
}  // namespace accel::testing

// libaccel in one process: sharding arithmetic, the DataLoader, accumulation semantics, the
// environment and error-file contracts. No process groups, no sleeps.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <set>

#include "accel/accel.h"
#include "contract/duration.h"
#include "contract/worker_contract.h"
#include "runtime/batch_shard.h"
#include "runtime/cpu_precision.h"
#include "runtime/env.h"
#include "runtime/error_file.h"

namespace accel {
namespace {

std::vector<int64_t> range(int64_t n) {
  std::vector<int64_t> v(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = i;
  return v;
}

std::string show(const IndexBatches& batches) {
  std::string out;
  for (const auto& b : batches) {
    out += out.empty() ? "[" : " [";
    for (std::size_t i = 0; i < b.size(); ++i) out += (i ? "," : "") + std::to_string(b[i]);
    out += "]";
  }
  return out;
}

std::string shard(int64_t n, ShardSpec spec, std::size_t rank) {
  spec.process_index = rank;
  return show(shard_batches(range(n), spec));
}

// reference/accelerate.md §5, 2 processes over range(9).
TEST(BatchShard, HfTableRowByRow) {
  ShardSpec even{.batch_size = 2, .num_processes = 2};
  EXPECT_EQ(shard(9, even, 0), "[0,1] [4,5] [8,0]");
  EXPECT_EQ(shard(9, even, 1), "[2,3] [6,7] [1,2]");
  ShardSpec uneven{.batch_size = 2, .num_processes = 2, .even_batches = false};
  EXPECT_EQ(shard(9, uneven, 0), "[0,1] [4,5] [8]");
  EXPECT_EQ(shard(9, uneven, 1), "[2,3] [6,7]");
  ShardSpec drop{.batch_size = 2, .drop_last = true, .num_processes = 2};
  EXPECT_EQ(shard(9, drop, 0), "[0,1] [4,5]");
  EXPECT_EQ(shard(9, drop, 1), "[2,3] [6,7]");
  ShardSpec five{.batch_size = 5, .num_processes = 2};
  EXPECT_EQ(shard(9, five, 0), "[0,1,2,3,4]");
  EXPECT_EQ(shard(9, five, 1), "[5,6,7,8,0]");
  ShardSpec five_uneven{.batch_size = 5, .num_processes = 2, .even_batches = false};
  EXPECT_EQ(shard(9, five_uneven, 0), "[0,1,2,3,4]");
  EXPECT_EQ(shard(9, five_uneven, 1), "[5,6,7,8]");
  ShardSpec split{.batch_size = 4, .num_processes = 2, .split_batches = true};
  EXPECT_EQ(shard(9, split, 0), "[0,1] [4,5] [8,0]");
  EXPECT_EQ(shard(9, split, 1), "[2,3] [6,7] [1,2]");
  ShardSpec bad_split{.batch_size = 5, .num_processes = 2, .split_batches = true};
  EXPECT_THROW(shard_batches(range(9), bad_split), DataError);
}

TEST(BatchShard, EvenBatchesGiveEveryRankTheSameCountAndCoverEverySample) {
  for (std::size_t n : {2u, 3u, 4u}) {
    for (std::size_t bs : {1u, 2u, 3u, 5u}) {
      for (int64_t size : {1, 2, 7, 9, 10, 24, 31}) {
        std::set<int64_t> covered;
        std::size_t count = SIZE_MAX;
        for (std::size_t r = 0; r < n; ++r) {
          auto batches = shard_batches(range(size),
                                       {.batch_size = bs, .num_processes = n, .process_index = r});
          if (count == SIZE_MAX) count = batches.size();
          EXPECT_EQ(batches.size(), count) << "n=" << n << " bs=" << bs << " size=" << size;
          for (const auto& b : batches) {
            EXPECT_EQ(b.size(), bs);
            covered.insert(b.begin(), b.end());
          }
        }
        EXPECT_EQ(covered.size(), static_cast<std::size_t>(size))
            << "n=" << n << " bs=" << bs << " size=" << size;
        // The duplicated tail is exactly what the remainder says to drop.
        auto rem =
            shard_remainder(static_cast<std::size_t>(size), {.batch_size = bs, .num_processes = n});
        std::size_t total = count * n * bs;
        std::size_t expected_dupes = rem > 0 ? n * bs - static_cast<std::size_t>(rem) : 0;
        EXPECT_EQ(total - static_cast<std::size_t>(size), expected_dupes)
            << "n=" << n << " bs=" << bs << " size=" << size;
      }
    }
  }
}

TEST(BatchShard, RemainderFollowsHf) {
  EXPECT_EQ(shard_remainder(9, {.batch_size = 2, .num_processes = 2}), 1);  // [8,0,1,2] -> [8]
  EXPECT_EQ(shard_remainder(9, {.batch_size = 4, .num_processes = 2, .split_batches = true}), 1);
  EXPECT_EQ(shard_remainder(8, {.batch_size = 2, .num_processes = 2}), 0);
  EXPECT_EQ(shard_remainder(9, {.batch_size = 2, .drop_last = true, .num_processes = 2}), -1);
  EXPECT_EQ(shard_remainder(9, {.batch_size = 2, .num_processes = 2, .even_batches = false}), -1);
}

TEST(DataLoader, BatchesShuffleWithSeedPlusEpochAndCountsEpochs) {
  auto ds = std::make_shared<TensorDataset>(torch::arange(10), torch::arange(10) * 2);
  DataLoader dl(ds, {.batch_size = 4, .shuffle = true, .seed = 5});
  auto pass = [&] {
    std::vector<int64_t> seen;
    std::vector<bool> ends;
    for (auto& b : dl) {
      EXPECT_TRUE(torch::equal(b.target, b.input * 2));
      for (int64_t i = 0; i < b.size(); ++i) seen.push_back(b.input[i].item<int64_t>());
      ends.push_back(dl.end_of_dataloader());
    }
    EXPECT_EQ(ends, (std::vector<bool>{false, false, true}));
    return seen;
  };
  auto first = pass();
  EXPECT_EQ(dl.epoch(), 1);
  auto second = pass();
  EXPECT_EQ(std::set<int64_t>(first.begin(), first.end()).size(), 10u);
  EXPECT_NE(first, second) << "epoch 1 must reshuffle";
  dl.set_epoch(0);
  EXPECT_EQ(pass(), first) << "seed + epoch reproduces the order";
  DataLoader other(ds, {.batch_size = 4, .shuffle = true, .seed = 5});
  EXPECT_EQ(
      [&] {
        std::vector<int64_t> seen;
        for (auto& b : other)
          for (int64_t i = 0; i < b.size(); ++i) seen.push_back(b.input[i].item<int64_t>());
        return seen;
      }(),
      first)
      << "a second loader (another rank) draws the same order";
}

TEST(DataLoader, PrefetchThreadsYieldTheSameBatchesInOrder) {
  auto ds = std::make_shared<TensorDataset>(torch::randn({103, 3}), torch::arange(103));
  DataLoader plain(ds, {.batch_size = 7, .shuffle = true, .seed = 1});
  DataLoader threaded(
      ds, {.batch_size = 7, .shuffle = true, .seed = 1, .num_workers = 3, .prefetch_factor = 2});
  std::vector<torch::Tensor> a, b;
  for (auto& x : plain) a.push_back(x.target);
  for (auto& x : threaded) b.push_back(x.target);
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i]));
  EXPECT_EQ(threaded.epoch(), 1);
}

class Failing : public Dataset {
 public:
  std::size_t size() const override { return 20; }
  Example get(std::size_t i) const override {
    if (i == 13) throw DataError("sample 13 is corrupt");
    return {torch::tensor(static_cast<int64_t>(i)), {}};
  }
};

TEST(DataLoader, AnErrorInAWorkerThreadReachesTheLoop) {
  for (std::size_t workers : {0u, 2u}) {
    DataLoader dl(std::make_shared<Failing>(), {.batch_size = 4, .num_workers = workers});
    std::size_t batches = 0;
    try {
      for (auto& b : dl) {
        (void)b;
        ++batches;
      }
      FAIL() << "no error";
    } catch (const DataError& e) {
      EXPECT_STREQ(e.what(), "sample 13 is corrupt");
    }
    EXPECT_LE(batches, 3u);
    EXPECT_EQ(dl.epoch(), 0) << "an interrupted pass does not count as an epoch";
  }
}

class FailsFirst : public Dataset {
 public:
  std::size_t size() const override { return 8; }
  Example get(std::size_t i) const override {
    if (i == 0) throw DataError("sample 0 is corrupt");
    return {torch::tensor(static_cast<int64_t>(i)), {}};
  }
};

// The first batch is built while the pass starts: its error must not leave threads behind
// (std::terminate) nor a stale loader position on the gradient state.
TEST(DataLoader, AnErrorInTheFirstBatchIsThrownCleanly) {
  auto gs = std::make_shared<GradientState>();
  for (std::size_t workers : {0u, 2u}) {
    DataLoader dl =
        DataLoader(std::make_shared<FailsFirst>(), {.batch_size = 2, .num_workers = workers})
            .shard({}, gs);
    EXPECT_THROW(for (auto& b : dl)(void) b, DataError);
    EXPECT_FALSE(gs->in_dataloader());
  }
}

TEST(DataLoader, BreakingOutEarlyStopsThreads) {
  DataLoader dl(std::make_shared<TensorDataset>(torch::arange(1000)),
                {.batch_size = 1, .num_workers = 2});
  int k = 0;
  for (auto& b : dl) {
    (void)b;
    if (++k == 3) break;
  }
  EXPECT_EQ(k, 3);
}

// The batches of one pass as their first sample ("0,2,4"), starting where the loader stands;
// stops after `limit` batches, as a loop with a break would.
std::string pass_of(DataLoader& dl, std::size_t limit = SIZE_MAX, LoaderState* inside = nullptr) {
  std::string out;
  std::size_t k = 0;
  for (auto& b : dl) {
    out += (out.empty() ? "" : ",") + std::to_string(b.input[0].item<int64_t>());
    if (inside) *inside = dl.state();
    if (++k == limit) break;
  }
  return out;
}

// A loop left with a break keeps the loader's place: state() after the loop is the position the
// loop reached (so save_state there resumes at the next unseen batch), and the next pass starts
// there. A break on the last batch has finished the epoch.
TEST(DataLoader, ABreakKeepsThePositionForStateAndTheNextPass) {
  for (std::size_t workers : {0u, 2u}) {
    SCOPED_TRACE("workers " + std::to_string(workers));
    DataLoader dl(std::make_shared<TensorDataset>(torch::arange(10)),
                  {.batch_size = 2, .num_workers = workers});
    LoaderState inside;
    EXPECT_EQ(pass_of(dl, 3, &inside), "0,2,4");
    EXPECT_EQ(inside, (LoaderState{0, 3}));
    EXPECT_EQ(dl.state(), (LoaderState{0, 3}))
        << "the position reached, not the start of the epoch";
    EXPECT_EQ(pass_of(dl, 2, &inside), "6,8")
        << "the next pass goes on with the first unseen batch";
    EXPECT_EQ(inside, (LoaderState{1, 0})) << "the last batch was handed out";
    EXPECT_EQ(dl.state(), (LoaderState{1, 0})) << "a break on the last batch finished the epoch";
    EXPECT_EQ(pass_of(dl), "0,2,4,6,8");
    EXPECT_EQ(dl.state(), (LoaderState{2, 0}));
    EXPECT_EQ(pass_of(dl, 1), "0");
    dl.set_epoch(2);
    EXPECT_EQ(dl.state(), (LoaderState{2, 1}))
        << "set_epoch to the same epoch keeps the place (a resume)";
    dl.set_epoch(5);
    EXPECT_EQ(dl.state(), (LoaderState{5, 0})) << "another epoch starts at its first batch";
    dl.load_state({5, 4});
    EXPECT_EQ(pass_of(dl), "8");
  }
}

class Stream : public IterableDataset {
 public:
  explicit Stream(int64_t n) : n_(n) {}
  ExampleStream stream(int64_t) const override {
    auto i = std::make_shared<int64_t>(0);
    int64_t n = n_;
    return [i, n]() -> std::optional<Example> {
      if (*i >= n) return std::nullopt;
      return Example{torch::tensor((*i)++), {}};
    };
  }

 private:
  int64_t n_;
};

std::string stream_pass(DataLoader& dl) {
  std::string out;
  for (auto& b : dl) {
    out += out.empty() ? "[" : " [";
    for (int64_t i = 0; i < b.size(); ++i)
      out += (i ? "," : "") + std::to_string(b.input[i].item<int64_t>());
    out += "]";
  }
  return out;
}

TEST(DataLoader, IterableShardKeepsItsSliceAndPadsTheTail) {
  DataLoader base(std::make_shared<Stream>(9), {.batch_size = 2});
  auto r0 = base.shard({.num_processes = 2, .process_index = 0});
  auto r1 = base.shard({.num_processes = 2, .process_index = 1});
  EXPECT_EQ(stream_pass(r0), "[0,1] [4,5] [8,0]");
  EXPECT_EQ(stream_pass(r1), "[2,3] [6,7] [1,2]");
  EXPECT_EQ(r0.remainder(), 1) << "the last buffer had one real sample";
  EXPECT_EQ(stream_pass(base), "[0,1] [2,3] [4,5] [6,7] [8]") << "one process: no padding";
  DataLoader threaded(std::make_shared<Stream>(9), {.batch_size = 2, .num_workers = 1});
  auto t1 = threaded.shard({.num_processes = 2, .process_index = 1});
  EXPECT_EQ(stream_pass(t1), "[2,3] [6,7] [1,2]");
  EXPECT_THROW(DataLoader(std::make_shared<Stream>(3), {.shuffle = true}), DataError);
}

TEST(DataLoader, BadOptionsAreClearErrors) {
  auto ds = std::make_shared<TensorDataset>(torch::arange(4));
  EXPECT_THROW(DataLoader(ds, {.batch_size = 0}), DataError);
  EXPECT_THROW(DataLoader(std::shared_ptr<const Dataset>(), {}), DataError);
  try {
    TensorDataset(torch::zeros({3, 2}), torch::zeros({4}));
    FAIL();
  } catch (const DataError& e) {
    EXPECT_STREQ(e.what(), "accel: TensorDataset inputs have 3 rows but targets have 4");
  }
}

// HF §6: 10 batches with 4 accumulation steps sync at 4, 8 and 10, and the count restarts.
TEST(Accelerator, AccumulationSyncsAtWindowEndsAndAtTheEndOfTheLoader) {
  Accelerator acc({.gradient_accumulation_steps = 4});
  auto model = torch::nn::Linear(2, 1);
  auto opt = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  DataLoader loader(std::make_shared<TensorDataset>(torch::randn({10, 2}), torch::randn({10, 1})),
                    {.batch_size = 1});
  auto [m, o, dl] = acc.prepare(model, opt, loader);
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::vector<int> synced;
    int i = 0;
    for (auto& b : dl) {
      ++i;
      auto scope = acc.accumulate(m);
      acc.backward(torch::mse_loss(m->forward(b.input), b.target));
      o.step();
      if (acc.sync_gradients()) synced.push_back(i);
      EXPECT_EQ(o.step_was_skipped(), !acc.sync_gradients());
      o.zero_grad();
    }
    EXPECT_EQ(synced, (std::vector<int>{4, 8, 10})) << "epoch " << epoch;
  }
}

// Two parameters; b takes part only when asked, as an expert a router did not pick.
struct TwoPartsImpl : torch::nn::Module {
  TwoPartsImpl() {
    a = register_parameter("a", torch::randn({3}));
    b = register_parameter("b", torch::randn({3}));
  }
  torch::Tensor forward(const torch::Tensor& x, bool use_b) {
    return use_b ? (x * a + x * b).pow(2).sum() : (x * a).pow(2).sum();
  }
  torch::Tensor a, b;
};
TORCH_MODULE(TwoParts);

// zero_grad(true) drops the gradients, so AdamW leaves a parameter that got none since as it is
// (PyTorch 2's optimizer.zero_grad()); zero_grad(false) zeroes them in place, and AdamW steps the
// parameter anyway (weight decay, momentum). Each trains as the same loop on libtorch's own
// optimizer with the gradients dropped or zeroed by hand; neither does anything on a micro-step.
TEST(Accelerator, ZeroGradSetToNoneDropsGradientsSoAnUnusedParameterIsNotStepped) {
  for (bool set_to_none : {true, false}) {
    SCOPED_TRACE(set_to_none ? "set_to_none" : "in place");
    torch::manual_seed(3);
    TwoParts reference, model;
    {
      torch::NoGradGuard no_grad;
      for (std::size_t i = 0; i < 2; ++i) model->parameters()[i].copy_(reference->parameters()[i]);
    }
    auto options = torch::optim::AdamWOptions(0.1).weight_decay(0.5);
    torch::optim::AdamW ref_opt(reference->parameters(), options);
    Accelerator acc;
    auto [m, o] =
        acc.prepare(model, std::make_shared<torch::optim::AdamW>(model->parameters(), options));
    const auto x = torch::tensor({1.0f, -2.0f, 0.5f});
    for (bool use_b : {true, false, false}) {
      reference->forward(x, use_b).backward();
      ref_opt.step();
      for (auto& p : reference->parameters()) {
        if (set_to_none)
          p.mutable_grad() = torch::Tensor();
        else
          p.mutable_grad().zero_();
      }
      const auto b_before = model->b.detach().clone();
      acc.backward(m->forward(x, use_b));
      o.step();
      // Without a gradient since the last zero_grad, b is stepped only if it was zeroed in place.
      if (!use_b) {
        EXPECT_EQ(torch::equal(model->b, b_before), set_to_none);
      }
      o.zero_grad(set_to_none);
      for (const auto& p : model->parameters()) EXPECT_EQ(p.grad().defined(), !set_to_none);
    }
    for (std::size_t i = 0; i < 2; ++i) {
      EXPECT_TRUE(torch::allclose(model->parameters()[i], reference->parameters()[i], 1e-6, 1e-7))
          << i << ": " << model->parameters()[i] << " against " << reference->parameters()[i];
    }
  }
  // On an accumulation micro-step the gradients stay, whichever way.
  auto model = TwoParts();
  Accelerator acc({.gradient_accumulation_steps = 2});
  auto [m, o] = acc.prepare(model, std::make_shared<torch::optim::SGD>(model->parameters(), 0.1));
  auto scope = acc.accumulate(m);
  acc.backward(m->forward(torch::ones({3}), true));
  o.step();
  ASSERT_FALSE(acc.sync_gradients());
  o.zero_grad(true);
  o.zero_grad(false);
  EXPECT_TRUE(model->a.grad().defined() && model->a.grad().abs().sum().item<float>() > 0);
}

TEST(Accelerator, BackwardScalesTheLossByTheAccumulationSteps) {
  Accelerator acc({.gradient_accumulation_steps = 4});
  auto w = torch::ones({1}, torch::requires_grad());
  acc.backward((w * 8).sum());
  EXPECT_DOUBLE_EQ(w.grad().item<double>(), 2.0);
}

TEST(Accelerator, SingleProcessCollectivesAreIdentities) {
  Accelerator acc;
  EXPECT_EQ(acc.num_processes(), 1);
  EXPECT_TRUE(acc.is_main_process() && acc.is_local_main_process() && acc.is_last_process());
  EXPECT_EQ(acc.distributed_type(), DistributedType::kNo);
  auto t = torch::arange(5);
  EXPECT_TRUE(torch::equal(acc.gather(t), t));
  EXPECT_TRUE(torch::equal(acc.reduce(t, ReduceOp::kMax), t));
  EXPECT_EQ(acc.gather_object("x"), std::vector<std::string>{"x"});
  EXPECT_EQ(acc.split_between_processes(std::vector<int>{1, 2, 3}), (std::vector<int>{1, 2, 3}));
  acc.wait_for_everyone();
  { auto first = acc.main_process_first(); }
  acc.set_trigger();
  EXPECT_TRUE(acc.check_trigger());
  EXPECT_FALSE(acc.check_trigger());
}

TEST(Accelerator, MisuseIsAClearError) {
  Accelerator acc;
  auto model = torch::nn::Linear(2, 1);
  EXPECT_THROW((void)acc.no_sync(model), UsageError);
  EXPECT_THROW(acc.backward(torch::Tensor()), UsageError);
  EXPECT_THROW(acc.set_gradient_accumulation_steps(0), ConfigError);
  EXPECT_THROW(acc.broadcast(torch::ones({1}), 3), UsageError);
  try {
    Accelerator fp16({.mixed_precision = "fp16"});  // this process runs on the CPU
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("mixed_precision=fp16 needs a CUDA device"),
              std::string::npos)
        << e.what();
  }
  try {
    Accelerator fp8({.mixed_precision = "fp8x"});
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("\"fp8x\": expected no, fp16 or bf16"), std::string::npos)
        << e.what();
  }
}

TEST(Env, DurationsAndIntegersNameTheVariable) {
  EXPECT_EQ(env::parse_duration("30m", "x"), std::chrono::minutes(30));
  EXPECT_EQ(env::parse_duration("2s", "x"), std::chrono::seconds(2));
  EXPECT_EQ(env::parse_duration("1.5", "x"), std::chrono::milliseconds(1500));
  EXPECT_EQ(env::parse_duration("250ms", "x"), std::chrono::milliseconds(250));
  try {
    env::parse_duration("soon", "environment variable ACCEL_COLLECTIVE_TIMEOUT");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_STREQ(
        e.what(),
        "accel: environment variable ACCEL_COLLECTIVE_TIMEOUT=\"soon\": expected a positive "
        "duration such as 30m, 90s, 500ms or a number of seconds");
  }
  EXPECT_THROW(env::parse_duration("-1s", "x"), ConfigError);
}

env::WorkerEnv parse_env(std::map<std::string, std::string> vars) {
  return env::read_worker_env([&vars](const char* name) -> std::optional<std::string> {
    auto it = vars.find(name);
    return it == vars.end() ? std::nullopt : std::optional<std::string>(it->second);
  });
}

std::string env_error(std::map<std::string, std::string> vars) {
  try {
    parse_env(std::move(vars));
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "no error";
}

TEST(Env, TheWorkerEnvironmentIsParsedIntoOneStruct) {
  env::WorkerEnv lone = parse_env({});
  EXPECT_EQ(lone.world_size, 1);
  EXPECT_EQ(lone.rank, 0);
  EXPECT_FALSE(lone.mixed_precision);
  EXPECT_EQ(lone.collective_timeout, contract::kDefaultCollectiveTimeout);
  EXPECT_EQ(lone.log_level, env::LogLevel::kInfo);

  env::WorkerEnv e = parse_env({{"WORLD_SIZE", "8"},
                                {"RANK", "5"},
                                {"LOCAL_WORLD_SIZE", "4"},
                                {"MASTER_ADDR", "10.0.0.1"},
                                {"MASTER_PORT", "29500"},
                                {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                {"TORCHELASTIC_RESTART_COUNT", "2"},
                                {"ACCELERATE_MIXED_PRECISION", "bf16"},  // HF's name alone
                                {"ACCEL_GRADIENT_ACCUMULATION_STEPS", "4"},
                                {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "9"},  // accel's wins
                                {"ACCEL_COLLECTIVE_TIMEOUT", "90s"},
                                {"ACCEL_CHECKPOINT_INTERVAL", "0"},
                                {"ACCEL_LOG_LEVEL", "WARNING"}});
  EXPECT_EQ(e.local_rank, 1);  // derived: 5 % 4
  EXPECT_EQ(e.group_rank, 1);
  EXPECT_EQ(e.master_port, 29500);
  EXPECT_TRUE(e.agent_store);
  EXPECT_EQ(e.restart_count, "2");
  EXPECT_EQ(e.mixed_precision, "bf16");
  EXPECT_EQ(e.mixed_precision_variable, "ACCELERATE_MIXED_PRECISION");
  EXPECT_EQ(e.gradient_accumulation_steps, 4);
  EXPECT_EQ(e.collective_timeout, std::chrono::seconds(90));
  EXPECT_EQ(e.checkpoint_interval, 0);
  EXPECT_EQ(e.log_level, env::LogLevel::kWarning);
}

TEST(Env, ARankStartedBySrunReadsSlurmsVariables) {
  std::map<std::string, std::string> step{{"SLURM_JOB_ID", "4242"},
                                          {"SLURM_STEP_ID", "0"},
                                          {"SLURM_PROCID", "3"},
                                          {"SLURM_LOCALID", "1"},
                                          {"SLURM_NODEID", "1"},
                                          {"SLURM_STEP_NUM_TASKS", "4"},
                                          {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"},
                                          {"SLURM_STEP_NODELIST", "n[1-2]"}};
  env::WorkerEnv e = parse_env(step);
  EXPECT_TRUE(e.from_slurm);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.group_rank, 1);
  EXPECT_EQ(e.master_addr, "n1");
  EXPECT_EQ(e.master_port, 12000 + 4242);

  // torchrun's variables (accel-launch's workers inside srun) win; so do MASTER_ADDR/PORT.
  auto launched = step;
  launched["RANK"] = "0";
  launched["WORLD_SIZE"] = "2";
  EXPECT_FALSE(parse_env(launched).from_slurm);
  EXPECT_EQ(parse_env(launched).world_size, 2);
  auto own = step;
  own["MASTER_ADDR"] = "10.0.0.1";
  own["MASTER_PORT"] = "29500";
  EXPECT_EQ(parse_env(own).master_addr, "10.0.0.1");
  EXPECT_EQ(parse_env(own).master_port, 29500);

  // A batch script (no SLURM_STEP_ID) is not a rank of the allocation's tasks.
  auto batch = step;
  batch.erase("SLURM_STEP_ID");
  EXPECT_EQ(parse_env(batch).world_size, 1);

  auto broken = step;
  broken["SLURM_STEP_NODELIST"] = "n[1-2";
  EXPECT_EQ(env_error(broken),
            "accel: environment variable SLURM_STEP_NODELIST=\"n[1-2\": expected a Slurm host list "
            "such as n[01-04]: '[' without ']' in 'n[1-2'");
}

TEST(Env, ABadVariableIsNamedWithItsValue) {
  EXPECT_EQ(env_error({{"WORLD_SIZE", "12x"}}),
            "accel: environment variable WORLD_SIZE=\"12x\": expected an integer in [1, 1048576]");
  EXPECT_EQ(env_error({{"WORLD_SIZE", "2"}, {"RANK", "2"}}),
            "accel: environment variable RANK=\"2\": expected an integer in [0, 1]");
  EXPECT_EQ(env_error({{"ACCEL_LOG_LEVEL", "loud"}}),
            "accel: environment variable ACCEL_LOG_LEVEL=\"loud\": expected one of debug, info, "
            "warning, error");
  EXPECT_EQ(env_error({{"ACCEL_USE_CPU", "maybe"}}),
            "accel: environment variable ACCEL_USE_CPU=\"maybe\": expected true or false");
  EXPECT_EQ(env_error({{"ACCEL_COLLECTIVE_TIMEOUT", "0"}}),
            "accel: environment variable ACCEL_COLLECTIVE_TIMEOUT=\"0\": expected a positive "
            "duration such as 30m, 90s, 500ms or a number of seconds");
  EXPECT_EQ(env_error({{"ACCEL_BACKEND", "mpi"}}),
            "accel: environment variable ACCEL_BACKEND=\"mpi\": expected auto, nccl or gloo");
  EXPECT_EQ(
      env_error({{"ACCEL_GROUP_OF_ONE", "yes please"}}),
      "accel: environment variable ACCEL_GROUP_OF_ONE=\"yes please\": expected true or false");
  EXPECT_EQ(env_error({{"ACCEL_CHECKPOINT_WRITER_CPUS", "fast"}}),
            "accel: environment variable ACCEL_CHECKPOINT_WRITER_CPUS=\"fast\": expected auto, any "
            "or a list of CPUs such as 1 or 2-3,6");
  EXPECT_EQ(parse_env({{"ACCEL_CHECKPOINT_WRITER_CPUS", "2-3"}}).checkpoint_writer_cpus, "2-3");
  EXPECT_EQ(
      env_error({{"ACCEL_SPLIT_OPTIMIZER_STEP", "yes"}}),
      "accel: environment variable ACCEL_SPLIT_OPTIMIZER_STEP=\"yes\": expected auto, 1 or 0");
  EXPECT_EQ(parse_env({}).split_optimizer_step, "auto");
  EXPECT_EQ(parse_env({{"ACCEL_SPLIT_OPTIMIZER_STEP", "0"}}).split_optimizer_step, "0");
  EXPECT_TRUE(parse_env({}).keep_freed_memory);
  EXPECT_FALSE(parse_env({{"ACCEL_KEEP_FREED_MEMORY", "0"}}).keep_freed_memory);
  EXPECT_EQ(env_error({{"ACCEL_KEEP_FREED_MEMORY", "sometimes"}}),
            "accel: environment variable ACCEL_KEEP_FREED_MEMORY=\"sometimes\": expected true or "
            "false");
}

TEST(Env, TheBackendAndAGroupOfOneAreRead) {
  EXPECT_EQ(parse_env({}).backend, "auto");
  EXPECT_FALSE(parse_env({}).group_of_one);
  EXPECT_EQ(parse_env({{"ACCEL_BACKEND", "NCCL"}}).backend, "nccl");
  EXPECT_EQ(parse_env({{"ACCEL_BACKEND", "gloo"}}).backend, "gloo");
  EXPECT_TRUE(parse_env({{"ACCEL_GROUP_OF_ONE", "1"}}).group_of_one);
}

// The launcher writes durations with the config's formatter; the runtime must read every one
// of them back to the same value.
TEST(Env, TheRuntimeReadsEveryDurationTheLauncherWrites) {
  for (long long ms : {1LL, 500LL, 1000LL, 1500LL, 60'000LL, 90'000LL, 1'800'000LL, 3'600'000LL,
                       5'400'000LL, 86'400'000LL}) {
    std::string text = contract::format_duration(std::chrono::milliseconds(ms));
    EXPECT_EQ(env::parse_duration(text, "x").count(), ms) << text;
  }
}

TEST(ErrorFile, WritesTheFormatTheLauncherReads) {
  std::string path = ::testing::TempDir() + "/accel_error_file_test.json";
  write_error_file(path, "boom \"quoted\"", "std::runtime_error", "frame #0");
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  EXPECT_NE(text.find("\"message\":\"boom \\\"quoted\\\"\""), std::string::npos) << text;
  EXPECT_NE(text.find("\"type\":\"std::runtime_error\""), std::string::npos) << text;
  EXPECT_NE(text.find("\"stack\":\"frame #0\""), std::string::npos) << text;
  std::remove(path.c_str());
}

}  // namespace
}  // namespace accel

namespace accel {
namespace {

TEST(DataLoader, CustomCollateSeesEveryExample) {
  auto ds = std::make_shared<TensorDataset>(torch::arange(6), torch::arange(6));
  DataLoader dl(ds, {.batch_size = 4, .collate = [](std::vector<Example>&& examples) {
                       Batch b;
                       b.input = torch::full({1}, static_cast<int64_t>(examples.size()));
                       b.target = torch::zeros({1});
                       return b;
                     }});
  std::vector<int64_t> sizes;
  for (auto& b : dl) sizes.push_back(b.input.item<int64_t>());
  EXPECT_EQ(sizes, (std::vector<int64_t>{4, 2}));
}

}  // namespace
}  // namespace accel

namespace accel {
namespace {

double lr_of(torch::optim::Optimizer& opt) { return opt.param_groups()[0].options().get_lr(); }

// HF: the scheduler steps only on synchronizing steps (and num_processes times; 1 here).
TEST(Accelerator, SchedulerStepsOnlyWithTheOptimizer) {
  Accelerator acc({.gradient_accumulation_steps = 2});
  auto model = torch::nn::Linear(2, 1);
  auto opt = std::make_shared<torch::optim::SGD>(model->parameters(), 1.0);
  auto sched = std::make_shared<torch::optim::StepLR>(*opt, /*step_size=*/1, /*gamma=*/0.5);
  DataLoader loader(std::make_shared<TensorDataset>(torch::randn({8, 2}), torch::randn({8, 1})),
                    {.batch_size = 1});
  auto [m, o, dl, s] = acc.prepare(model, opt, loader, sched);
  std::vector<double> lrs;
  for (auto& b : dl) {
    auto scope = acc.accumulate(m);
    acc.backward(torch::mse_loss(m->forward(b.input), b.target));
    o.step();
    s.step();
    o.zero_grad();
    lrs.push_back(lr_of(*opt));
  }
  // Steps at micro-steps 2, 4, 6, 8 only. libtorch's StepLR leaves the rate alone on its first
  // step (step_count_ 0), so the halvings land after micro-steps 4, 6 and 8.
  EXPECT_EQ(lrs, (std::vector<double>{1.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.125}));
}

}  // namespace
}  // namespace accel

// bf16 on this CPU: the timing gives positive figures, and the line appears only when bf16 takes
// at least 1.25x fp32's time, naming what the CPU lacks or that it has bf16 instructions.
TEST(CpuPrecision, TheSlowBf16LineAppearsOnlyWhenBf16IsSlowerByAQuarter) {
  constexpr auto kNone = accel::cpu_precision::Bf16Instructions::kNone;
  constexpr auto kPresent = accel::cpu_precision::Bf16Instructions::kPresent;
  auto measured = accel::cpu_precision::measure_step();
  EXPECT_GT(measured.fp32_ms, 0);
  EXPECT_GT(measured.bf16_ms, 0);
  EXPECT_NE(accel::cpu_precision::speed_text(measured).find("x the time of fp32's"),
            std::string::npos);
  accel::cpu_precision::StepSpeed fast{1.0, 0.7};
  EXPECT_EQ(accel::cpu_precision::slow_bf16_line(fast, "Some CPU", kNone), "");
  EXPECT_EQ(accel::cpu_precision::slow_bf16_line({1.0, 1.2}, "Some CPU", kNone), "");
  accel::cpu_precision::StepSpeed slow{0.5, 8.0};
  const std::string line = accel::cpu_precision::slow_bf16_line(slow, "Some CPU", kNone);
  EXPECT_NE(line.find("mixed_precision bf16 is slow on this CPU (Some CPU)"), std::string::npos)
      << line;
  EXPECT_NE(line.find("16.0x as long as in fp32 (8.00 ms against 0.50 ms"), std::string::npos)
      << line;
  EXPECT_NE(line.find("without native bf16 (AVX-512 BF16 or AMX)"), std::string::npos) << line;
  EXPECT_NE(line.find("mixed_precision \"no\" (fp32) is the faster choice here"), std::string::npos)
      << line;
  EXPECT_NE(accel::cpu_precision::speed_text(slow).find("libaccel says so at start"),
            std::string::npos);
  // A CPU with bf16 instructions on which this libtorch's bf16 is still slower (model M: 1.6x).
  const std::string native = accel::cpu_precision::slow_bf16_line({2.0, 3.2}, "", kPresent);
  EXPECT_EQ(native,
            "mixed_precision bf16 is slow on this CPU: a small training step under bf16 autocast "
            "took 1.6x as long as in fp32 (3.20 ms against 2.00 ms, measured at start); this CPU "
            "has bf16 instructions, but this libtorch's bf16 kernels train slower than its fp32 "
            "ones here: mixed_precision \"no\" (fp32) is the faster choice here");
  EXPECT_NE(accel::cpu_precision::speed_text({2.0, 3.2}).find("libaccel says so at start"),
            std::string::npos);
  // A CPU whose bf16 instructions libaccel cannot read (not x86): no claim about them.
  EXPECT_NE(
      accel::cpu_precision::slow_bf16_line({2.0, 3.2}, "",
                                           accel::cpu_precision::Bf16Instructions::kUnknown)
          .find("; this libtorch's bf16 kernels train slower than its fp32 ones on this CPU: "),
      std::string::npos);
}

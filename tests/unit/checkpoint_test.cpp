// Checkpoints and mixed precision in one process: the loss scaler's algorithm and how it gates
// optimizer and scheduler steps, bf16 autocast and training, bitwise save_state/load_state round
// trips (resuming inside an epoch included), automatic naming and rotation, refusal of corrupt or
// foreign checkpoints, atomic publication under injected I/O faults, and save_model's sharding.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <c10/util/string_utils.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <torch/torch.h>

#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <fstream>
#include <functional>
#include <future>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>

#include "accel/accel.h"
#include "contract/json_depth.h"
#include "runtime/checkpoint_io.h"
#include "runtime/checkpoint_snapshot.h"
#include "runtime/safetensors.h"
#include "tests/common/files.h"

namespace accel {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

using testing::read_file;
using testing::TempDir;
using testing::write_file;

double lr_of(torch::optim::Optimizer& opt) { return opt.param_groups()[0].options().get_lr(); }

std::vector<torch::Tensor> copies(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> out;
  for (const auto& t : tensors) out.push_back(t.detach().clone());
  return out;
}

void expect_bitwise(const std::vector<torch::Tensor>& want, const std::vector<torch::Tensor>& got,
                    const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  for (std::size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(torch::equal(want[i], got[i])) << what << " #" << i << " differs";
  }
}

// Runs `f`, which must throw CheckpointError with every one of `parts` in its message.
template <class F>
void expect_checkpoint_error(F&& f, std::initializer_list<std::string> parts) {
  try {
    std::forward<F>(f)();
    ADD_FAILURE() << "no CheckpointError was thrown";
  } catch (const CheckpointError& e) {
    for (const auto& part : parts) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
          << "\"" << part << "\" is not in: " << e.what();
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected a CheckpointError, got: " << e.what();
  }
}

// --- GradScaler on its own ------------------------------------------------------------------

// One weight vector under SGD(lr 0.5); backward(c) leaves w.grad = c * scale.
struct ScalerRig {
  torch::Tensor w = torch::ones({3}, torch::requires_grad());
  torch::optim::SGD opt{std::vector<torch::Tensor>{w}, torch::optim::SGDOptions(0.5)};

  void backward(GradScaler& scaler, const torch::Tensor& c) {
    opt.zero_grad();
    scaler.scale((w * c).sum()).backward();
  }
  void clean_step(GradScaler& scaler) {
    backward(scaler, torch::ones({3}));
    EXPECT_TRUE(scaler.step(opt));
    scaler.update();
  }
};

TEST(GradScaler, ScaleMultipliesByTheInitialScale) {
  GradScaler scaler;
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  EXPECT_EQ(scaler.scale(torch::tensor(3.0f)).item<float>(), 3.0f * 65536.0f);
  GradScaler off({.enabled = false});
  EXPECT_EQ(off.scale(torch::tensor(3.0f)).item<float>(), 3.0f);
}

TEST(GradScaler, ACleanStepUnscalesStepsAndKeepsTheScale) {
  GradScaler scaler;
  ScalerRig rig;
  auto c = torch::tensor({1.0f, 2.0f, 3.0f});
  rig.backward(scaler, c);
  EXPECT_TRUE(torch::equal(rig.w.grad(), c * 65536.0f));
  EXPECT_TRUE(scaler.step(rig.opt));
  scaler.update();
  // Powers of two scale exactly: the step used c itself, so w = 1 - 0.5 c exactly.
  EXPECT_TRUE(torch::equal(rig.w.detach(), torch::tensor({0.5f, 0.0f, -0.5f}))) << rig.w;
  EXPECT_TRUE(torch::equal(rig.w.grad(), c)) << "the gradients are left unscaled";
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  EXPECT_EQ(scaler.growth_tracker(), 1);
}

TEST(GradScaler, ANonFiniteGradientSkipsTheStepAndBacksOff) {
  for (float bad : {kInf, -kInf, kNaN}) {
    SCOPED_TRACE("bad gradient " + std::to_string(bad));
    GradScaler scaler;
    ScalerRig rig;
    rig.clean_step(scaler);
    ASSERT_EQ(scaler.growth_tracker(), 1);
    auto before = rig.w.detach().clone();
    rig.backward(scaler, torch::ones({3}));
    {
      torch::NoGradGuard no_grad;
      rig.w.grad()[1].fill_(bad);
    }
    EXPECT_FALSE(scaler.step(rig.opt));
    EXPECT_TRUE(torch::equal(rig.w.detach(), before)) << "the optimizer must not step";
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), 32768.0);
    EXPECT_EQ(scaler.growth_tracker(), 0);
    rig.clean_step(scaler);  // and training goes on at the new scale
    EXPECT_FALSE(torch::equal(rig.w.detach(), before));
    EXPECT_EQ(scaler.get_scale(), 32768.0);
  }
}

TEST(GradScaler, GrowsAfterGrowthIntervalCleanSteps) {
  GradScaler scaler({.growth_interval = 3});
  ScalerRig rig;
  rig.clean_step(scaler);
  rig.clean_step(scaler);
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  EXPECT_EQ(scaler.growth_tracker(), 2);
  rig.clean_step(scaler);
  EXPECT_EQ(scaler.get_scale(), 131072.0);
  EXPECT_EQ(scaler.growth_tracker(), 0);
}

TEST(GradScaler, UnscalingTwiceBeforeUpdateIsAUsageError) {
  GradScaler scaler;
  ScalerRig rig;
  rig.backward(scaler, torch::ones({3}));
  scaler.unscale_(rig.opt);
  EXPECT_THROW(scaler.unscale_(rig.opt), UsageError);
  EXPECT_TRUE(torch::equal(rig.w.grad(), torch::ones({3}))) << "the failed call divided again";
  EXPECT_TRUE(scaler.step(rig.opt)) << "step() after unscale_() does not unscale again";
  EXPECT_TRUE(torch::equal(rig.w.detach(), torch::full({3}, 0.5f)));
  scaler.update();
  rig.backward(scaler, torch::ones({3}));
  EXPECT_NO_THROW(scaler.unscale_(rig.opt)) << "update() starts a new step";
}

TEST(GradScaler, StateDictRoundTrips) {
  GradScalerOptions options{.init_scale = 1024, .growth_interval = 5};
  GradScaler scaler(options);
  ScalerRig rig;
  rig.clean_step(scaler);
  rig.backward(scaler, torch::full({3}, kInf));
  EXPECT_FALSE(scaler.step(rig.opt));
  scaler.update();
  rig.clean_step(scaler);
  rig.clean_step(scaler);
  ASSERT_EQ(scaler.get_scale(), 512.0);
  ASSERT_EQ(scaler.growth_tracker(), 2);
  GradScaler restored(options);
  restored.load_state_dict(scaler.state_dict(), "/ckpt/scaler.json");
  EXPECT_EQ(restored.get_scale(), 512.0);
  EXPECT_EQ(restored.growth_tracker(), 2);
  EXPECT_EQ(restored.scale(torch::tensor(1.0f)).item<float>(), 512.0f);
  ScalerRig other;
  other.clean_step(restored);
  other.clean_step(restored);
  other.clean_step(restored);
  EXPECT_EQ(restored.get_scale(), 1024.0)
      << "the restored tracker counts on toward growth_interval";
}

TEST(GradScaler, LoadingGarbageIsACheckpointErrorNamingTheFile) {
  for (std::string bad :
       {"not json", "[1, 2]", R"({"scale": 2.0})", R"({"scale": -1, "growth_tracker": 0})",
        R"({"scale": "big", "growth_tracker": 0})", R"({"scale": 2, "growth_tracker": 0.5})",
        R"({"scale": 1e39, "growth_tracker": 0})", R"({"scale": 2, "growth_tracker": -1})",
        R"({"scale": 2, "growth_tracker": 3000000000})"}) {
    SCOPED_TRACE(bad);
    GradScaler scaler;
    expect_checkpoint_error([&] { scaler.load_state_dict(bad, "/ckpt/step_9/scaler.json"); },
                            {"/ckpt/step_9/scaler.json"});
    EXPECT_EQ(scaler.get_scale(), 65536.0) << "a refused state changes nothing";
  }
  GradScaler scaler;
  expect_checkpoint_error(
      [&] {
        scaler.load_state_dict(R"({"scale": )" + std::string(100000, '[') +
                                   std::string(100000, ']') + R"(, "growth_tracker": 0})",
                               "/ckpt/step_9/scaler.json");
      },
      {"/ckpt/step_9/scaler.json", "nests arrays and objects more than 64 levels deep"});
}

// The depth counted before any untrusted JSON is parsed: brackets in strings (escaped quotes
// included) do not count; 64 levels pass, 65 do not.
TEST(JsonDepth, CountsNestingOutsideStrings) {
  auto nest = [](int n) { return std::string(n, '[') + std::string(n, ']'); };
  EXPECT_FALSE(contract::json_nesting_exceeds(nest(64)));
  EXPECT_TRUE(contract::json_nesting_exceeds(nest(65)));
  EXPECT_FALSE(contract::json_nesting_exceeds("{\"a\": \"" + std::string(500, '[') + "\"}"));
  EXPECT_FALSE(contract::json_nesting_exceeds(R"({"a": "\"[[[[", "b": [1]})", 2));
  EXPECT_TRUE(contract::json_nesting_exceeds(R"({"a": "\\", "b": [[1]]})", 2))
      << "an escaped backslash ends the string";
  EXPECT_FALSE(contract::json_nesting_exceeds(""));
}

// --- GradScaler through the Accelerator -----------------------------------------------------

std::vector<torch::Tensor> parameters_of(const torch::nn::Module& m) {
  return copies(m.parameters());
}

TEST(GradScalerAccelerator, AnOverflowSkipsTheOptimizerAndTheScheduler) {
  TempDir tmp;
  auto options = AcceleratorOptions{.grad_scaler = GradScalerOptions{.init_scale = 1024}};
  Accelerator acc(options);
  ASSERT_NE(acc.scaler(), nullptr) << "grad_scaler options enable loss scaling on CPU";
  torch::manual_seed(0);
  auto model = torch::nn::Linear(3, 1);
  auto opt = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  auto sched = std::make_shared<torch::optim::StepLR>(*opt, /*step_size=*/1, /*gamma=*/0.5);
  auto prepared = acc.prepare(model, opt, sched);
  auto& m = std::get<0>(prepared);
  auto& o = std::get<1>(prepared);
  auto& s = std::get<2>(prepared);
  auto x = torch::randn({4, 3});
  auto y = torch::randn({4, 1});
  auto train = [&](float factor) {
    acc.backward(torch::mse_loss(m->forward(x), y) * factor);
    o.step();
    s.step();
    o.zero_grad();
  };

  train(1.0f);  // libtorch's StepLR keeps the rate on its first step; it halves on every later one
  EXPECT_FALSE(acc.optimizer_step_was_skipped());
  EXPECT_FALSE(o.step_was_skipped());
  EXPECT_EQ(lr_of(*opt), 0.1);

  auto before = parameters_of(*model);
  train(kInf);
  EXPECT_TRUE(acc.optimizer_step_was_skipped());
  EXPECT_TRUE(o.step_was_skipped());
  expect_bitwise(before, parameters_of(*model), "parameter after an overflow");
  EXPECT_EQ(acc.scaler()->get_scale(), 512.0);
  EXPECT_EQ(lr_of(*opt), 0.1) << "the scheduler stepped although the optimizer step was skipped";

  train(1.0f);
  EXPECT_FALSE(acc.optimizer_step_was_skipped());
  EXPECT_FALSE(o.step_was_skipped());
  EXPECT_FALSE(torch::equal(before[0], model->weight));
  EXPECT_EQ(lr_of(*opt), 0.05);
  EXPECT_EQ(acc.scaler()->get_scale(), 512.0);
  EXPECT_EQ(acc.completed_steps(), 3) << "overflowed steps count as completed";

  // The scale is part of the checkpoint.
  auto dir = acc.save_state(tmp.path() / "ckpt");
  EXPECT_TRUE(fs::exists(dir / "scaler.json"));
  Accelerator fresh(options);
  auto model2 = torch::nn::Linear(3, 1);
  auto opt2 = std::make_shared<torch::optim::SGD>(model2->parameters(), 0.1);
  auto sched2 = std::make_shared<torch::optim::StepLR>(*opt2, 1, 0.5);
  fresh.prepare(model2, opt2, sched2);
  fresh.load_state(dir);
  EXPECT_EQ(fresh.scaler()->get_scale(), 512.0);
  EXPECT_EQ(lr_of(*opt2), 0.05);
  EXPECT_EQ(fresh.completed_steps(), 3);
}

TEST(GradScalerAccelerator, ClipGradNormSeesUnscaledGradients) {
  torch::manual_seed(3);
  auto scaled_model = torch::nn::Linear(5, 2);
  auto plain_model = torch::nn::Linear(5, 2);
  {
    torch::NoGradGuard no_grad;
    plain_model->weight.copy_(scaled_model->weight);
    plain_model->bias.copy_(scaled_model->bias);
  }
  auto x = torch::randn({6, 5});
  auto y = torch::randn({6, 2});
  Accelerator scaled({.grad_scaler = GradScalerOptions{.init_scale = 1024}});
  Accelerator plain;
  auto scaled_opt = std::make_shared<torch::optim::SGD>(scaled_model->parameters(), 0.1);
  auto plain_opt = std::make_shared<torch::optim::SGD>(plain_model->parameters(), 0.1);
  auto so = std::get<1>(scaled.prepare(scaled_model, scaled_opt));
  auto po = std::get<1>(plain.prepare(plain_model, plain_opt));
  scaled.backward(torch::mse_loss(scaled_model->forward(x), y));
  plain.backward(torch::mse_loss(plain_model->forward(x), y));
  constexpr double kMaxNorm = 1e-3;  // small enough that both clip
  double plain_norm = plain.clip_grad_norm_(plain_model, kMaxNorm);
  double scaled_norm = scaled.clip_grad_norm_(scaled_model, kMaxNorm);
  ASSERT_GT(plain_norm, kMaxNorm);
  EXPECT_NEAR(scaled_norm, plain_norm, 1e-6 * plain_norm)
      << "clip_grad_norm_ measured the scaled gradients";
  so.step();
  po.step();
  EXPECT_FALSE(so.step_was_skipped());
  EXPECT_TRUE(torch::allclose(scaled_model->weight, plain_model->weight, 1e-6, 1e-7));
  EXPECT_TRUE(torch::allclose(scaled_model->bias, plain_model->bias, 1e-6, 1e-7));
}

// --- mixed precision ------------------------------------------------------------------------

TEST(MixedPrecision, Fp16OnCpuIsAConfigErrorNamingCuda) {
  if (Accelerator().device().is_cuda()) GTEST_SKIP() << "this process has a CUDA device";
  try {
    Accelerator acc({.mixed_precision = "fp16"});
    FAIL() << "fp16 on CPU was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("CUDA"), std::string::npos) << e.what();
  }
}

TEST(MixedPrecision, AFloat16AutocastOnCpuIsAUsageErrorNamingCuda) {
  try {
    AutocastGuard guard(torch::kCPU, torch::kHalf, true);
    FAIL() << "float16 autocast on CPU was accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("float16 needs a CUDA device"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(at::autocast::is_cpu_enabled()) << "a refused scope must leave autocast off";
}

TEST(MixedPrecision, Bf16AutocastRunsLinearInBf16AndNestedScopesRestore) {
  Accelerator acc({.mixed_precision = "bf16"});
  Accelerator plain({.mixed_precision = "no"});
  EXPECT_EQ(acc.mixed_precision(), "bf16");
  torch::manual_seed(0);
  auto linear = torch::nn::Linear(4, 3);
  auto x = torch::randn({2, 4});
  EXPECT_EQ(linear(x).scalar_type(), torch::kFloat);
  {
    auto outer = acc.autocast();
    EXPECT_TRUE(at::autocast::is_cpu_enabled());
    EXPECT_EQ(linear(x).scalar_type(), torch::kBFloat16);
    EXPECT_EQ(linear->weight.scalar_type(), torch::kFloat) << "the weights stay float32";
    {
      auto inner = acc.autocast();
      EXPECT_EQ(linear(x).scalar_type(), torch::kBFloat16);
    }
    EXPECT_TRUE(at::autocast::is_cpu_enabled())
        << "leaving the inner scope turned the outer one off";
    EXPECT_EQ(linear(x).scalar_type(), torch::kBFloat16);
    {
      auto nothing = plain.autocast();  // mixed precision "no": a scope that changes nothing
      EXPECT_EQ(linear(x).scalar_type(), torch::kBFloat16);
    }
    EXPECT_EQ(linear(x).scalar_type(), torch::kBFloat16);
  }
  EXPECT_FALSE(at::autocast::is_cpu_enabled());
  EXPECT_EQ(linear(x).scalar_type(), torch::kFloat);
  {
    auto nothing = plain.autocast();
    EXPECT_FALSE(at::autocast::is_cpu_enabled());
    EXPECT_EQ(linear(x).scalar_type(), torch::kFloat);
  }
}

struct Fit {
  double first_loss = 0;  // float32 evaluation of the initial model
  double final_loss = 0;  // float32 evaluation of the trained model
  bool saw_bf16 = false;  // the forward pass produced bf16 activations
};

// 120 full-batch AdamW steps on a noisy linear teacher (noise std 0.1, so the best possible MSE
// is ~0.01), from the same seed and data whatever the precision.
Fit fit_regression(const std::string& mixed_precision) {
  Accelerator acc({.mixed_precision = mixed_precision});
  auto gen = at::make_generator<at::CPUGeneratorImpl>(42);
  auto x = torch::randn({512, 8}, gen);
  auto w = torch::randn({8, 1}, gen) * 0.5;
  auto y = x.matmul(w) + 0.25 + 0.1 * torch::randn({512, 1}, gen);
  torch::manual_seed(7);
  auto model =
      torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 1));
  auto opt = std::make_shared<torch::optim::AdamW>(
      model->parameters(), torch::optim::AdamWOptions(0.1).weight_decay(0.0));
  auto sched = std::make_shared<torch::optim::StepLR>(*opt, /*step_size=*/40, /*gamma=*/0.3);
  auto prepared = acc.prepare(model, opt, sched);
  auto& o = std::get<1>(prepared);
  auto& s = std::get<2>(prepared);
  auto evaluate = [&] {
    torch::NoGradGuard no_grad;
    return torch::mse_loss(model->forward(x), y).item<double>();
  };
  Fit fit;
  fit.first_loss = evaluate();
  for (int step = 0; step < 120; ++step) {
    torch::Tensor loss;
    {
      auto scope = acc.autocast();
      auto out = model->forward(x);
      fit.saw_bf16 = fit.saw_bf16 || out.scalar_type() == torch::kBFloat16;
      loss = torch::mse_loss(out.to(torch::kFloat), y);
    }
    acc.backward(loss);
    o.step();
    s.step();
    o.zero_grad();
  }
  fit.final_loss = evaluate();
  return fit;
}

TEST(MixedPrecision, Bf16TrainingConvergesAndMatchesFp32) {
  auto fp32 = fit_regression("no");
  auto bf16 = fit_regression("bf16");
  EXPECT_FALSE(fp32.saw_bf16);
  EXPECT_TRUE(bf16.saw_bf16) << "autocast did not run the model in bf16";
  EXPECT_EQ(fp32.first_loss, bf16.first_loss) << "both runs must start from the same model";
  // From ~1.6 to near the 0.01 noise floor (0.0117 in fp32 with this seed).
  EXPECT_GT(fp32.first_loss / fp32.final_loss, 50.0)
      << fp32.first_loss << " -> " << fp32.final_loss;
  EXPECT_GT(bf16.first_loss / bf16.final_loss, 50.0)
      << bf16.first_loss << " -> " << bf16.final_loss;
  EXPECT_LT(fp32.final_loss, 0.015);
  EXPECT_NE(fp32.final_loss, bf16.final_loss) << "bitwise equal: the bf16 run did not use bf16";
  // Why 5%: bf16 keeps 8 significant bits, so each rounding (input, weight, activation, output)
  // is off by up to 2^-9 ~ 0.2% relative; the predictions (|y| ~ 1.5) carry up to ~1% error,
  // which adds at most ~(0.015)^2 ~ 2e-4, i.e. ~2%, to an MSE at the 0.01 noise floor. The
  // gradients carry the same relative error, so the runs take slightly different paths. Across
  // learning rates 0.03-0.1, widths 8-16 and 100-160 steps the gap measured about 1% at most;
  // 5% leaves margin for that and still fails a bf16 path that trains noticeably worse.
  EXPECT_NEAR(bf16.final_loss, fp32.final_loss, 0.05 * fp32.final_loss);
}

// --- checkpoint fixtures --------------------------------------------------------------------

// 20 samples (4 features, 2 targets), the same in every rig.
std::shared_ptr<TensorDataset> fixed_data() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  auto inputs = torch::randn({20, 4}, gen);
  auto targets = torch::randn({20, 2}, gen);
  return std::make_shared<TensorDataset>(inputs, targets);
}

// A model with dropout (training consumes the RNG) and a buffer (saved too).
struct Net : torch::nn::Module {
  explicit Net(int64_t hidden)
      : fc1(register_module("fc1", torch::nn::Linear(4, hidden))),
        drop(register_module("drop", torch::nn::Dropout(0.25))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, 2))),
        seen(register_buffer("seen", torch::zeros({1}, torch::kLong))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    {
      torch::NoGradGuard no_grad;
      seen.add_(x.size(0));
    }
    return fc2(drop(torch::tanh(fc1(x))));
  }
  torch::nn::Linear fc1;
  torch::nn::Dropout drop;
  torch::nn::Linear fc2;
  torch::Tensor seen;
};

// Registered for checkpointing through state_dict()/load_state_dict() strings.
struct Counter {
  int64_t calls = 0;
  std::string state_dict() const { return "calls=" + std::to_string(calls); }
  void load_state_dict(const std::string& s) { calls = std::stoll(s.substr(6)); }
};

struct RigOptions {
  AcceleratorOptions accelerator{};
  uint64_t init_seed = 1;
  int64_t hidden = 8;
  bool extra_optimizer = false;  // prepare an SGD over the model before everything else
};

// An Accelerator with a prepared model, AdamW, StepLR and shuffling loader (7 batches an epoch:
// 6 of 3 samples, 1 of 2), and two registered objects: a Counter and an "EMA" Linear module.
// Everything is registered before prepare(), so automatic resume can restore it.
class Rig {
 public:
  explicit Rig(const RigOptions& options = {}) : acc(options.accelerator) {
    torch::manual_seed(options.init_seed);
    model = std::make_shared<Net>(options.hidden);
    adamw = std::make_shared<torch::optim::AdamW>(
        model->parameters(), torch::optim::AdamWOptions(0.01).weight_decay(0.1));
    ema = torch::nn::Linear(4, options.hidden);
    acc.register_for_checkpointing(counter);
    acc.register_for_checkpointing(ema.ptr());
    if (options.extra_optimizer) {
      acc.prepare(
          std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1)));
    }
    auto sched = std::make_shared<torch::optim::StepLR>(*adamw, /*step_size=*/2, /*gamma=*/0.5);
    DataLoader loader(fixed_data(), {.batch_size = 3, .shuffle = true, .seed = 7});
    auto prepared = acc.prepare(model, adamw, loader, sched);
    optimizer.emplace(std::get<1>(prepared));
    loader_.emplace(std::get<2>(prepared));
    scheduler.emplace(std::get<3>(prepared));
  }

  // The next batch, starting a new pass when the current one is done.
  const Batch& next_batch() {
    if (pass_) {
      ++*pass_;
      if (*pass_ == std::default_sentinel) pass_.reset();
    }
    for (int attempt = 0; !pass_ && attempt < 2; ++attempt) {
      pass_ = loader_->begin();
      if (*pass_ == std::default_sentinel) pass_.reset();
    }
    if (!pass_) throw std::runtime_error("the loader yields no batches");
    return **pass_;
  }

  // One training step; returns the loss.
  double step() {
    const Batch& batch = next_batch();
    inputs_seen.push_back(batch.input.clone());
    auto loss = torch::mse_loss(model->forward(batch.input), batch.target);
    acc.backward(loss);
    optimizer->step();
    scheduler->step();
    optimizer->zero_grad();
    ++counter->calls;
    {
      torch::NoGradGuard no_grad;
      ema->weight.mul_(0.5).add_(model->fc1->weight, 0.5);
    }
    return loss.item<double>();
  }

  DataLoader& loader() { return *loader_; }
  // Leaves the current pass, as a `break` out of the loop does.
  void break_out() { pass_.reset(); }

  Accelerator acc;
  std::shared_ptr<Net> model;
  std::shared_ptr<torch::optim::AdamW> adamw;
  torch::nn::Linear ema{nullptr};
  std::shared_ptr<Counter> counter = std::make_shared<Counter>();
  std::optional<PreparedOptimizer> optimizer;
  std::optional<PreparedScheduler> scheduler;
  std::vector<torch::Tensor> inputs_seen;  // every batch's input, in order

 private:
  std::optional<DataLoader> loader_;
  std::optional<DataLoader::Iterator> pass_;
};

// Everything a checkpoint restores, copied out of a rig.
struct Snapshot {
  std::vector<torch::Tensor> params, buffers, exp_avg, exp_avg_sq, ema;
  std::vector<int64_t> adam_steps;
  double lr = 0;
  int64_t completed_steps = 0;
  LoaderState loader;
  int64_t counter = 0;
};

Snapshot snapshot(Rig& rig) {
  Snapshot s;
  // First: asking a prepared loader its state is where an automatic resume happens.
  s.loader = rig.loader().state();
  s.params = copies(rig.model->parameters());
  s.buffers = copies(rig.model->buffers());
  for (const auto& p : rig.adamw->param_groups()[0].params()) {
    auto it = rig.adamw->state().find(c10::guts::to_string(p.unsafeGetTensorImpl()));
    if (it == rig.adamw->state().end()) continue;
    auto& state = static_cast<torch::optim::AdamWParamState&>(*it->second);
    s.exp_avg.push_back(state.exp_avg().clone());
    s.exp_avg_sq.push_back(state.exp_avg_sq().clone());
    s.adam_steps.push_back(state.step());
  }
  s.ema = copies(rig.ema->parameters());
  s.lr = lr_of(*rig.adamw);
  s.completed_steps = rig.acc.completed_steps();
  s.counter = rig.counter->calls;
  return s;
}

void expect_same(const Snapshot& want, const Snapshot& got) {
  expect_bitwise(want.params, got.params, "parameter");
  expect_bitwise(want.buffers, got.buffers, "buffer");
  expect_bitwise(want.exp_avg, got.exp_avg, "AdamW exp_avg");
  expect_bitwise(want.exp_avg_sq, got.exp_avg_sq, "AdamW exp_avg_sq");
  EXPECT_EQ(want.adam_steps, got.adam_steps) << "AdamW step";
  expect_bitwise(want.ema, got.ema, "registered module parameter");
  EXPECT_EQ(want.lr, got.lr);
  EXPECT_EQ(want.completed_steps, got.completed_steps);
  EXPECT_EQ(want.loader.epoch, got.loader.epoch);
  EXPECT_EQ(want.loader.batches, got.loader.batches);
  EXPECT_EQ(want.counter, got.counter) << "registered state_dict object";
}

// --- save_state / load_state round trips ----------------------------------------------------

void edit_manifest(const fs::path& dir, const std::function<void(json&)>& edit) {
  auto manifest = json::parse(read_file(dir / "manifest.json"));
  edit(manifest);
  write_file(dir / "manifest.json", manifest.dump(2));
}

TEST(CheckpointRoundTrip, RestoresEverythingBitwiseAndTrainingContinuesIdentically) {
  TempDir tmp;
  Rig original({.init_seed = 1});
  for (int i = 0; i < 5; ++i) original.step();
  auto dir = original.acc.save_state(tmp.path() / "ckpt");
  EXPECT_EQ(dir, tmp.path() / "ckpt");
  auto saved = snapshot(original);
  ASSERT_EQ(saved.exp_avg.size(), 4u) << "AdamW has state for every parameter";
  EXPECT_EQ(saved.loader, (LoaderState{0, 5}));
  EXPECT_EQ(saved.completed_steps, 5);
  auto rand_after_save = torch::rand({8});

  // 2 more batches of epoch 0 (7 batches), then 4 of epoch 1; the scheduler halves every 2 steps.
  constexpr int kMore = 6;
  original.inputs_seen.clear();
  std::vector<double> original_lrs;
  for (int i = 0; i < kMore; ++i) {
    original.step();
    original_lrs.push_back(lr_of(*original.adamw));
  }
  EXPECT_EQ(original.loader().epoch(), 1);

  Rig resumed({.init_seed = 2});
  ASSERT_FALSE(torch::equal(resumed.model->fc1->weight, saved.params[0]))
      << "fresh objects start elsewhere";
  EXPECT_EQ(resumed.acc.load_state(dir), dir);
  expect_same(saved, snapshot(resumed));
  EXPECT_TRUE(torch::equal(torch::rand({8}), rand_after_save))
      << "the RNG does not continue where it was saved";

  std::vector<double> resumed_lrs;
  for (int i = 0; i < kMore; ++i) {
    resumed.step();
    resumed_lrs.push_back(lr_of(*resumed.adamw));
  }
  EXPECT_EQ(resumed_lrs, original_lrs);
  expect_bitwise(original.inputs_seen, resumed.inputs_seen, "batch after resume");
  expect_same(snapshot(original), snapshot(resumed));
}

// libtorch's own optimizers are saved as optimizer.safetensors (a standard file, no CRC-32'd zip);
// a checkpoint written before that keeps an AdamW's state in libtorch's archive, optimizer.bin,
// and still loads, bitwise.
TEST(CheckpointRoundTrip, AnOptimizersStateIsASafetensorsFileAndTheOlderArchiveStillLoads) {
  TempDir tmp;
  Rig original({.init_seed = 1});
  for (int i = 0; i < 4; ++i) original.step();
  auto dir = original.acc.save_state(tmp.path() / "ckpt");
  Snapshot saved = snapshot(original);
  ASSERT_TRUE(fs::exists(dir / "optimizer.safetensors"));
  EXPECT_FALSE(fs::exists(dir / "optimizer.bin"));
  auto decoded = accel::safetensors::decode(read_file(dir / "optimizer.safetensors"), "optimizer");
  EXPECT_EQ(decoded.metadata.at("optimizer"), "AdamW");
  EXPECT_EQ(decoded.tensors.size(), 2 * original.model->parameters().size())
      << "exp_avg and exp_avg_sq of every parameter";

  // The older layout: the same state as libtorch's archive, listed in the manifest instead.
  torch::save(*original.adamw, (dir / "optimizer.bin").string());
  fs::remove(dir / "optimizer.safetensors");
  const std::string archive = read_file(dir / "optimizer.bin");
  edit_manifest(dir, [&](json& m) {
    for (auto& file : m["files"]) {
      if (file["name"] != "optimizer.safetensors") continue;
      file = {{"name", "optimizer.bin"},
              {"size", archive.size()},
              {"xxh64", accel::ckpt::to_hex(accel::ckpt::checksum(archive))}};
    }
  });
  Rig resumed({.init_seed = 2});
  EXPECT_EQ(resumed.acc.load_state(dir), dir);
  expect_same(saved, snapshot(resumed));
}

// The batches a rig yields next, after `before` training steps, straight or through a checkpoint.
TEST(CheckpointRoundTrip, ResumedLoaderYieldsTheBatchesTheOriginalWouldHaveNext) {
  TempDir tmp;
  for (int before : {0, 1, 4, 6, 7, 8, 13}) {  // 7 = the last batch of epoch 0 was handed out
    SCOPED_TRACE("saved after " + std::to_string(before) + " batches");
    Rig original({.init_seed = 1});
    for (int i = 0; i < before; ++i) original.step();
    auto dir = original.acc.save_state(tmp.path() / ("after_" + std::to_string(before)));
    original.inputs_seen.clear();
    for (int i = 0; i < 9; ++i) original.step();  // crosses at least one epoch boundary

    Rig resumed({.init_seed = 3});
    resumed.acc.load_state(dir);
    EXPECT_EQ(resumed.loader().state(),
              (LoaderState{before / 7, static_cast<uint64_t>(before % 7)}));
    for (int i = 0; i < 9; ++i) resumed.step();
    expect_bitwise(original.inputs_seen, resumed.inputs_seen, "batch");
  }
}

// "Train to max_steps, break, save_state()": the checkpoint resumes at the first batch the loop
// did not take, and so does the loop itself when it goes on; both see what an uninterrupted run
// sees next.
TEST(CheckpointRoundTrip, SaveAfterABreakResumesAtTheNextUnseenBatch) {
  TempDir tmp;
  Rig uninterrupted({.init_seed = 1});
  for (int i = 0; i < 12; ++i) uninterrupted.step();
  const std::vector<torch::Tensor> after_three(uninterrupted.inputs_seen.begin() + 3,
                                               uninterrupted.inputs_seen.end());

  Rig original({.init_seed = 1});
  for (int i = 0; i < 3; ++i) original.step();
  original.break_out();
  EXPECT_EQ(original.loader().state(), (LoaderState{0, 3}));
  auto dir = original.acc.save_state(tmp.path() / "ckpt");
  for (int i = 0; i < 9; ++i) original.step();
  expect_bitwise(uninterrupted.inputs_seen, original.inputs_seen,
                 "batch of the run that broke out and went on");

  Rig resumed({.init_seed = 2});
  resumed.acc.load_state(dir);
  EXPECT_EQ(resumed.loader().state(), (LoaderState{0, 3}));
  for (int i = 0; i < 9; ++i) resumed.step();
  expect_bitwise(after_three, resumed.inputs_seen, "batch after resume");
  expect_same(snapshot(uninterrupted), snapshot(resumed));
}

std::vector<torch::Tensor> one_pass(DataLoader& loader) {
  std::vector<torch::Tensor> out;
  for (auto& batch : loader) out.push_back(batch.input.clone());
  return out;
}

TEST(CheckpointRoundTrip, SkipFirstBatchesYieldsTheRestOfTheSameOrder) {
  DataLoaderOptions options{.batch_size = 3, .shuffle = true, .seed = 7};
  DataLoader reference(fixed_data(), options);
  auto epoch0 = one_pass(reference);
  auto epoch1 = one_pass(reference);
  ASSERT_EQ(epoch0.size(), 7u);
  ASSERT_FALSE(torch::equal(epoch0[0], epoch1[0])) << "epochs are shuffled differently";
  // With prefetch threads too: they must start at the first batch not skipped.
  for (std::size_t workers : {0u, 2u}) {
    for (std::size_t n : {0u, 1u, 4u, 6u, 7u}) {
      SCOPED_TRACE("skip " + std::to_string(n) + ", workers " + std::to_string(workers));
      DataLoaderOptions threaded = options;
      threaded.num_workers = workers;
      auto skipping = DataLoader(fixed_data(), threaded).skip_first_batches(n);
      auto first = one_pass(skipping);
      expect_bitwise(
          std::vector<torch::Tensor>(epoch0.begin() + static_cast<std::ptrdiff_t>(n), epoch0.end()),
          first, "batch");
      expect_bitwise(epoch1, one_pass(skipping), "next-epoch batch");
    }
  }
  Accelerator acc;
  auto prepared = acc.prepare(DataLoader(fixed_data(), options));
  auto skipping = acc.skip_first_batches(prepared, 5);
  expect_bitwise(std::vector<torch::Tensor>(epoch0.begin() + 5, epoch0.end()), one_pass(skipping),
                 "prepared batch");
}

// --- automatic naming, rotation, resume -----------------------------------------------------

RigOptions project_rig(const fs::path& project, std::optional<int64_t> total_limit,
                       bool automatic_resume, uint64_t init_seed = 1) {
  RigOptions options{.init_seed = init_seed};
  options.accelerator.project.project_dir = project.string();
  options.accelerator.project.total_limit = total_limit;
  options.accelerator.project.automatic_resume = automatic_resume;
  return options;
}

// `n` steps of a rig in `project` with no total_limit, each followed by an automatic save
// (checkpoint_0 .. checkpoint_<n-1>); the rig's state after each save.
std::vector<Snapshot> save_automatic_checkpoints(const fs::path& project, int n) {
  Rig rig(project_rig(project, std::nullopt, /*automatic_resume=*/true));
  std::vector<Snapshot> after;
  for (int i = 0; i < n; ++i) {
    rig.step();
    rig.acc.save_state();
    after.push_back(snapshot(rig));
  }
  return after;
}

TEST(CheckpointNaming, AutomaticNamesRotationAndLatest) {
  TempDir tmp;
  auto root = tmp.path() / "checkpoints";
  Rig rig(project_rig(tmp.path(), 2, /*automatic_resume=*/true));
  EXPECT_EQ(rig.acc.latest_checkpoint(), fs::path()) << "nothing saved yet";
  std::vector<fs::path> saved;
  for (int i = 0; i < 3; ++i) {
    rig.step();
    saved.push_back(rig.acc.save_state());
  }
  auto last = snapshot(rig);
  EXPECT_EQ(saved, (std::vector<fs::path>{root / "checkpoint_0", root / "checkpoint_1",
                                          root / "checkpoint_2"}));
  EXPECT_FALSE(fs::exists(root / "checkpoint_0")) << "total_limit 2 keeps the newest two";
  EXPECT_TRUE(fs::exists(root / "checkpoint_1" / "manifest.json"));
  EXPECT_TRUE(fs::exists(root / "checkpoint_2" / "manifest.json"));
  EXPECT_EQ(rig.acc.latest_checkpoint(), root / "checkpoint_2");

  // A crashed save's temp folder (never renamed) and a numbered folder with no manifest.
  fs::create_directories(root / ".checkpoint_5.tmp-123");
  write_file(root / ".checkpoint_5.tmp-123" / "manifest.json",
             read_file(root / "checkpoint_2" / "manifest.json"));
  write_file(root / ".checkpoint_5.tmp-123" / "model.safetensors", "half");
  fs::create_directories(root / "checkpoint_9");
  write_file(root / "checkpoint_9" / "model.safetensors", "half");
  EXPECT_EQ(rig.acc.latest_checkpoint(), root / "checkpoint_2");

  Rig manual(project_rig(tmp.path(), 2, /*automatic_resume=*/false, /*init_seed=*/5));
  EXPECT_EQ(manual.acc.completed_steps(), 0) << "automatic_resume=false must not load";
  EXPECT_EQ(manual.acc.load_state(), root / "checkpoint_2");
  expect_same(last, snapshot(manual));
  fs::remove_all(root / "checkpoint_9");
  EXPECT_EQ(manual.acc.save_state(), root / "checkpoint_3")
      << "the next save follows the loaded one";
  EXPECT_TRUE(fs::exists(root / "checkpoint_2"));
  EXPECT_FALSE(fs::exists(root / "checkpoint_1"));

  // Automatic resume: the first prepare() with a loader loads the newest complete checkpoint.
  Rig automatic(project_rig(tmp.path(), 2, /*automatic_resume=*/true, /*init_seed=*/6));
  expect_same(last, snapshot(automatic));
  EXPECT_EQ(automatic.acc.save_state(), root / "checkpoint_4");
}

// A damaged newest checkpoint must not fail every restart: automatic resume takes the newest
// intact one and says why it skipped the others; with none intact it refuses to start from scratch.
TEST(CheckpointNaming, AutomaticResumeSkipsADamagedNewestCheckpoint) {
  TempDir tmp;
  auto root = tmp.path() / "checkpoints";
  Snapshot at_1 = save_automatic_checkpoints(tmp.path(), 3)[1];
  auto flip = [](const fs::path& file) {
    auto bytes = read_file(file);
    bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x40);
    write_file(file, bytes);
  };
  flip(root / "checkpoint_2" / "optimizer.safetensors");
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  std::optional<Rig> resumed;
  resumed.emplace(
      project_rig(tmp.path(), std::nullopt, /*automatic_resume=*/true, /*init_seed=*/7));
  (void)resumed->loader().epoch();  // training starts: the automatic resume happens here
  auto said = ::testing::internal::GetCapturedStdout() + ::testing::internal::GetCapturedStderr();
  expect_same(at_1, snapshot(*resumed));
  EXPECT_NE(
      said.find("not resuming from " + (root / "checkpoint_2").string() + " because it is damaged"),
      std::string::npos)
      << said;
  EXPECT_NE(said.find((root / "checkpoint_2" / "optimizer.safetensors").string() + " is corrupt"),
            std::string::npos)
      << said;
  EXPECT_NE(said.find("resumed from " + (root / "checkpoint_1").string()), std::string::npos)
      << said;
  EXPECT_EQ(resumed->acc.save_state(), root / "checkpoint_2")
      << "the next save replaces the damaged one";
  EXPECT_NO_THROW(resumed->acc.load_state(root / "checkpoint_2"));
  resumed.reset();

  for (const char* name : {"checkpoint_0", "checkpoint_1", "checkpoint_2"})
    flip(root / name / "model.safetensors");
  ::testing::internal::CaptureStdout();
  expect_checkpoint_error(
      [&] {
        Rig none(project_rig(tmp.path(), std::nullopt, true, 8));
        (void)none.loader().epoch();  // training starts: the automatic resume
      },
      {"none of the 3 checkpoints under " + root.string() + " is intact",
       (root / "checkpoint_2" / "model.safetensors").string() + " is corrupt"});
  ::testing::internal::GetCapturedStdout();
}

TEST(CheckpointNaming, RotationNeverRemovesTheCheckpointJustWritten) {
  TempDir tmp;
  auto root = tmp.path() / "checkpoints";
  fs::create_directories(root / "checkpoint_9");  // an unfinished folder from some other run
  write_file(root / "checkpoint_9" / "model.safetensors", "half");
  Rig rig(project_rig(tmp.path(), 1, /*automatic_resume=*/true));
  rig.step();
  auto saved = rig.acc.save_state();
  EXPECT_EQ(saved, root / "checkpoint_0");
  EXPECT_TRUE(fs::exists(saved / "manifest.json"))
      << "total_limit rotation deleted the checkpoint it had just written "
         "because an incomplete checkpoint_9 counted as newer";
  EXPECT_EQ(rig.acc.latest_checkpoint(), saved);
}

TEST(CheckpointNaming, RotationRemovesAnOlderFolderAKilledRotationHalfDeleted) {
  TempDir tmp;
  auto root = tmp.path() / "checkpoints";
  Rig rig(project_rig(tmp.path(), 2, /*automatic_resume=*/true));
  rig.step();
  rig.acc.save_state();  // checkpoint_0
  // A process killed inside a rotation's remove_all: the manifest is gone, other files remain.
  fs::remove(root / "checkpoint_0" / "manifest.json");
  rig.step();
  rig.acc.save_state();  // checkpoint_1
  EXPECT_FALSE(fs::exists(root / "checkpoint_0"))
      << "a half-deleted older checkpoint stayed forever";
  EXPECT_TRUE(fs::exists(root / "checkpoint_1" / "manifest.json"));
}

// A job killed after a save published its checkpoint but before the rotation (or inside it), that
// then resumes and ends before its next save: the resume enforces total_limit itself.
TEST(CheckpointNaming, AutomaticResumeRemovesCheckpointsAKilledRotationLeftBehind) {
  TempDir tmp;
  auto root = tmp.path() / "checkpoints";
  Snapshot newest = save_automatic_checkpoints(tmp.path(), 4).back();
  fs::remove(root / "checkpoint_0" / "manifest.json");  // killed inside a rotation's remove_all
  Rig resumed(project_rig(tmp.path(), 2, /*automatic_resume=*/true, /*init_seed=*/9));
  (void)resumed.loader().epoch();  // training starts: the automatic resume happens here
  expect_same(newest, snapshot(resumed));
  EXPECT_FALSE(fs::exists(root / "checkpoint_0")) << "the half-removed folder stayed";
  EXPECT_FALSE(fs::exists(root / "checkpoint_1")) << "total_limit 2 keeps the newest two";
  EXPECT_TRUE(fs::exists(root / "checkpoint_2" / "manifest.json"));
  EXPECT_TRUE(fs::exists(root / "checkpoint_3" / "manifest.json"));
}

TEST(CheckpointNaming, SaveStateWithNoFolderNeedsAProject) {
  Rig rig;
  EXPECT_THROW(rig.acc.save_state(), UsageError);
  EXPECT_EQ(rig.acc.latest_checkpoint(), fs::path());
  expect_checkpoint_error([&] { rig.acc.load_state(); }, {"no complete checkpoint"});
}

// --- corrupt and foreign checkpoints --------------------------------------------------------

// A checkpoint of a rig trained 3 steps, in `dir`.
fs::path good_checkpoint(const fs::path& dir, const RigOptions& options = {}) {
  Rig rig(options);
  for (int i = 0; i < 3; ++i) rig.step();
  return rig.acc.save_state(dir);
}

// Loading `dir` into a fresh rig throws a CheckpointError naming every one of `parts`, and leaves
// the rig's model as it was.
void expect_refused(const fs::path& dir, std::initializer_list<std::string> parts) {
  Rig rig({.init_seed = 11});
  auto before = copies(rig.model->parameters());
  expect_checkpoint_error([&] { rig.acc.load_state(dir); }, parts);
  expect_bitwise(before, copies(rig.model->parameters()), "parameter after a refused load");
  EXPECT_EQ(rig.acc.completed_steps(), 0);
}

// A manifest is input like any other: a listed name that leads outside the folder is refused
// before anything is opened, so no foreign file is read, hashed or loaded, even one whose size
// and hash match (here: a copy of the real model file outside the folder).
TEST(CheckpointCorrupt, AManifestNameOutsideTheFolderIsRefusedUnread) {
  TempDir tmp;
  auto dir = good_checkpoint(tmp.path() / "ckpt");
  fs::copy_file(dir / "model.safetensors", tmp.path() / "outside.safetensors");
  for (const std::string& name : std::vector<std::string>{
           "../outside.safetensors", (tmp.path() / "outside.safetensors").string(), "sub/x", "..",
           "."}) {
    SCOPED_TRACE(name);
    auto bad = tmp.path() / "bad";
    fs::remove_all(bad);
    fs::copy(dir, bad);
    edit_manifest(bad, [&](json& m) {
      for (auto& f : m["files"]) {
        if (f["name"] == "model.safetensors") f["name"] = name;
      }
    });
    try {
      Rig rig({.init_seed = 11});
      rig.acc.load_state(bad);
      ADD_FAILURE() << "loaded a checkpoint whose manifest names " << name;
    } catch (const CheckpointError& e) {
      std::string what = e.what();
      EXPECT_NE(what.find((bad / "manifest.json").string()), std::string::npos) << what;
      EXPECT_NE(what.find("plain file names inside its folder"), std::string::npos) << what;
      EXPECT_EQ(what.find("xxh64"), std::string::npos) << "no hash of any file: " << what;
    }
  }
}

// Files are opened without following a symbolic link, and only if they are regular files: a
// link to a copy with the right size and hash is refused, and a FIFO fails at once (it would
// block every rank's open until a writer came).
TEST(CheckpointCorrupt, ASymbolicLinkOrAFifoInTheFolderIsRefused) {
  TempDir tmp;
  auto dir = good_checkpoint(tmp.path() / "ckpt");
  fs::rename(dir / "model.safetensors", tmp.path() / "real.safetensors");
  fs::create_symlink(tmp.path() / "real.safetensors", dir / "model.safetensors");
  expect_refused(dir, {(dir / "model.safetensors").string(), "is a symbolic link"});
  fs::remove(dir / "model.safetensors");
  ASSERT_EQ(::mkfifo((dir / "model.safetensors").c_str(), 0600), 0);
  expect_refused(dir, {(dir / "model.safetensors").string(), "is not a regular file"});
}

TEST(CheckpointCorrupt, TruncatedModelFile) {
  TempDir tmp;
  auto dir = good_checkpoint(tmp.path() / "ckpt");
  fs::resize_file(dir / "model.safetensors", fs::file_size(dir / "model.safetensors") / 2);
  expect_refused(dir, {(dir / "model.safetensors").string(), "truncated"});
}

TEST(CheckpointCorrupt, FlippedByteInOptimizerFile) {
  TempDir tmp;
  auto dir = good_checkpoint(tmp.path() / "ckpt");
  auto bytes = read_file(dir / "optimizer.safetensors");
  ASSERT_GT(bytes.size(), 100u);
  bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x01);
  write_file(dir / "optimizer.safetensors", bytes);
  expect_refused(dir, {(dir / "optimizer.safetensors").string(), "corrupt"});
}

TEST(CheckpointCorrupt, MissingManifest) {
  TempDir tmp;
  auto dir = good_checkpoint(tmp.path() / "ckpt");
  fs::remove(dir / "manifest.json");
  expect_refused(dir, {dir.string(), "no manifest.json"});
  expect_refused(tmp.path() / "nowhere", {(tmp.path() / "nowhere").string(), "not a folder"});
}

TEST(CheckpointCorrupt, ForeignFormat) {
  TempDir tmp;
  auto dir = good_checkpoint(tmp.path() / "ckpt");
  edit_manifest(dir, [](json& m) { m["format"] = "other"; });
  expect_refused(dir, {(dir / "manifest.json").string(), "format"});
}

// A manifest nested 100,000 levels deep (its format_version an array of arrays) is refused
// before it is parsed; it used to overflow the stack, and every restart crashed again.
TEST(CheckpointCorrupt, ADeeplyNestedManifestIsRefused) {
  TempDir tmp;
  auto dir = good_checkpoint(tmp.path() / "ckpt");
  std::string text = read_file(dir / "manifest.json");
  auto at = text.find('{');
  ASSERT_NE(at, std::string::npos);
  text.insert(at + 1,
              R"("format_version": )" + std::string(100000, '[') + std::string(100000, ']') + ", ");
  write_file(dir / "manifest.json", text);
  expect_refused(
      dir, {(dir / "manifest.json").string(), "nests arrays and objects more than 64 levels deep"});
}

TEST(CheckpointCorrupt, WorldSizeIsNotANumber) {
  TempDir tmp;
  auto dir = good_checkpoint(tmp.path() / "ckpt");
  edit_manifest(dir, [](json& m) { m["world_size"] = "two"; });
  expect_refused(dir, {(dir / "manifest.json").string(), "world_size", "\"two\""});
}

TEST(CheckpointCorrupt, ModelOfAnotherShape) {
  TempDir tmp;
  auto dir = good_checkpoint(tmp.path() / "ckpt", {.hidden = 16});
  expect_refused(dir, {(dir / "model.safetensors").string(), "does not match the prepared model",
                       "fc1.weight"});
}

TEST(CheckpointCorrupt, MoreOptimizersThanPrepared) {
  TempDir tmp;
  auto dir = good_checkpoint(tmp.path() / "ckpt", {.extra_optimizer = true});
  expect_refused(dir, {dir.string(), "holds 2 optimizers", "1 are prepared"});
}

// Linear(3, 3) and Linear(3, second_out), initialized from `seed` and prepared. The caller keeps
// them alive: the Accelerator does not own its models.
std::pair<torch::nn::Linear, torch::nn::Linear> prepare_two_models(Accelerator& acc, uint64_t seed,
                                                                   int64_t second_out) {
  torch::manual_seed(seed);
  std::pair<torch::nn::Linear, torch::nn::Linear> models{torch::nn::Linear(3, 3),
                                                         torch::nn::Linear(3, second_out)};
  acc.prepare(models.first, models.second);
  return models;
}

// "Read and check everything first, so a bad file changes nothing" (checkpoint.cpp): a second
// model that does not match must not leave the first one overwritten.
TEST(CheckpointCorrupt, AMismatchInTheSecondModelLeavesTheFirstUnchanged) {
  TempDir tmp;
  auto dir = tmp.path() / "ckpt";
  {
    Accelerator acc;
    auto models = prepare_two_models(acc, 1, 4);
    acc.save_state(dir);
  }
  Accelerator acc;
  auto models = prepare_two_models(acc, 2, 5);
  auto& first = models.first;
  auto before = copies(first->parameters());
  expect_checkpoint_error([&] { acc.load_state(dir); }, {(dir / "model_1.safetensors").string(),
                                                         "does not match the prepared model"});
  expect_bitwise(before, copies(first->parameters()),
                 "first model's parameter after a refused load");
}

// The same promise for an optimizer file that does not fit the prepared optimizer.
TEST(CheckpointCorrupt, AnOptimizerThatDoesNotFitLeavesTheModelUnchanged) {
  TempDir tmp;
  auto dir = tmp.path() / "ckpt";
  {
    Accelerator acc;
    torch::manual_seed(1);
    auto model = torch::nn::Linear(3, 2);
    auto opt = std::make_shared<torch::optim::AdamW>(model->parameters());
    auto o = std::get<1>(acc.prepare(model, opt));
    acc.backward(model->forward(torch::ones({1, 3})).sum());
    o.step();
    acc.save_state(dir);
  }
  Accelerator acc;
  torch::manual_seed(2);
  auto model = torch::nn::Linear(3, 2);
  auto weight_only =
      std::make_shared<torch::optim::AdamW>(std::vector<torch::Tensor>{model->weight});
  acc.prepare(model, weight_only);
  auto before = copies(model->parameters());
  expect_checkpoint_error(
      [&] { acc.load_state(dir); },
      {(dir / "optimizer.safetensors").string(), "is for 2 parameters, this optimizer has 1"});
  expect_bitwise(before, copies(model->parameters()), "parameter after a refused optimizer");
}

// The first optimizer loads, the second does not fit: the first gets its own state back.
TEST(CheckpointCorrupt, AFailedOptimizerLoadRestoresTheOptimizersLoadedBeforeIt) {
  TempDir tmp;
  auto dir = tmp.path() / "ckpt";
  auto train_once = [](Accelerator& acc, torch::nn::Linear& model, PreparedOptimizer& a,
                       PreparedOptimizer& b) {
    acc.backward(model->forward(torch::ones({1, 3})).sum());
    a.step();
    b.step();
  };
  {
    Accelerator acc;
    torch::manual_seed(1);
    auto model = torch::nn::Linear(3, 2);
    auto [m, a, b] = acc.prepare(
        model, std::make_shared<torch::optim::AdamW>(std::vector<torch::Tensor>{model->weight}),
        std::make_shared<torch::optim::AdamW>(std::vector<torch::Tensor>{model->bias}));
    for (int i = 0; i < 3; ++i) train_once(acc, model, a, b);
    acc.save_state(dir);
  }
  Accelerator acc;
  torch::manual_seed(2);
  auto model = torch::nn::Linear(3, 2);
  auto first = std::make_shared<torch::optim::AdamW>(std::vector<torch::Tensor>{model->weight});
  // two tensors, saved with one
  auto second = std::make_shared<torch::optim::AdamW>(model->parameters());
  auto [m, a, b] = acc.prepare(model, first, second);
  train_once(acc, model, a, b);
  auto state_of_first = [&] {
    const auto& s =
        static_cast<const torch::optim::AdamWParamState&>(*first->state().begin()->second);
    return std::vector<torch::Tensor>{s.exp_avg().clone(), s.exp_avg_sq().clone(),
                                      torch::tensor(static_cast<int64_t>(s.step()))};
  };
  ASSERT_EQ(first->state().size(), 1u);
  auto before = state_of_first();
  expect_checkpoint_error([&] { acc.load_state(dir); },
                          {(dir / "optimizer_1.safetensors").string(), "prepared optimizer 1"});
  ASSERT_EQ(first->state().size(), 1u);
  expect_bitwise(before, state_of_first(), "first optimizer's state after a refused load");
}

// --- atomic publication under injected faults -----------------------------------------------

// The real file system, except that every file write, rename and sync_dir from the `fail_at`-th
// (0-based, counted together) on throws, as a full or failing disk would; a failing write has been
// given half of its first part (which the O_DIRECT writer may still hold in its buffer, not on
// disk). Records the operations it saw.
class FaultyFs : public ckpt::CheckpointFs {
 public:
  // `can_exchange` false: a file system without RENAME_EXCHANGE (NFS), exchange() says so.
  explicit FaultyFs(int64_t fail_at, bool can_exchange = true)
      : fail_at_(fail_at), can_exchange_(can_exchange) {}

  ckpt::WrittenFile write_stream(const fs::path& path,
                                 const std::function<void(const ckpt::Sink&)>& produce) override {
    if (next("write " + path.filename().string())) {
      // The failure comes from inside the producer, as a failing write(2) would.
      CheckpointFs::write_stream(path, [&](const ckpt::Sink& sink) {
        produce([&](std::string_view part) {
          sink(part.substr(0, part.size() / 2));
          throw CheckpointError("accel: checkpoint: " + path.string() + ": injected write failure");
        });
      });
      ADD_FAILURE() << "the injected failure of " << path << " did not reach the caller";
    }
    return CheckpointFs::write_stream(path, produce);
  }
  void rename(const fs::path& from, const fs::path& to) override {
    if (next("rename " + from.filename().string() + " -> " + to.filename().string())) {
      throw CheckpointError("accel: checkpoint: " + from.string() + ": injected rename failure");
    }
    CheckpointFs::rename(from, to);
  }
  bool exchange(const fs::path& a, const fs::path& b) override {
    if (next("exchange " + a.filename().string() + " <-> " + b.filename().string())) {
      throw CheckpointError("accel: checkpoint: " + a.string() + ": injected exchange failure");
    }
    return can_exchange_ && CheckpointFs::exchange(a, b);
  }
  void sync_dir(const fs::path& dir) override {
    if (next("sync " + dir.filename().string())) {
      throw CheckpointError("accel: checkpoint: " + dir.string() + ": injected fsync failure");
    }
    CheckpointFs::sync_dir(dir);
  }

  const std::vector<std::string>& operations() const { return operations_; }

 private:
  bool next(const std::string& what) {
    operations_.push_back(what);
    return static_cast<int64_t>(operations_.size()) - 1 >= fail_at_;
  }

  int64_t fail_at_;
  bool can_exchange_;
  std::vector<std::string> operations_;
};

// Installs a CheckpointFs for the scope; the real one is back even when an assertion throws.
class UseFs {
 public:
  explicit UseFs(ckpt::CheckpointFs* fs) { ckpt::set_checkpoint_fs_for_testing(fs); }
  ~UseFs() { ckpt::set_checkpoint_fs_for_testing(nullptr); }
  UseFs(const UseFs&) = delete;
  UseFs& operator=(const UseFs&) = delete;
};

// The operations of one save_state(`target`) of a rig like `options`'s (after a first save to the
// same place when `overwrite`).
std::vector<std::string> save_operations(const RigOptions& options, const fs::path& target,
                                         bool overwrite, bool can_exchange = true) {
  Rig probe(options);
  probe.step();
  if (overwrite) probe.acc.save_state(target);
  FaultyFs counting(std::numeric_limits<int64_t>::max(), can_exchange);
  UseFs use(&counting);
  probe.acc.save_state(target);
  return counting.operations();
}

std::size_t last_index_of(const std::vector<std::string>& ops, const std::string& prefix) {
  std::size_t found = ops.size();
  for (std::size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].rfind(prefix, 0) == 0) found = i;
  }
  return found;
}

// `ops` come from a probe rig's save, so the folder names in them are the probe's.
std::string describe(const std::vector<std::string>& ops, std::size_t k) {
  return "failing operation " + std::to_string(k) + " of " + std::to_string(ops.size()) +
         " (in the probe: " + (k < ops.size() ? ops[k] : std::string("none")) + ")";
}

TEST(CheckpointAtomicity, AFailedSaveLeavesThePreviousCheckpointIntact) {
  TempDir tmp, probe_dir;
  auto root = tmp.path() / "checkpoints";
  fs::create_directories(probe_dir.path() / "checkpoints");  // as the rig's, made by its first save
  auto ops = save_operations(project_rig(probe_dir.path(), std::nullopt, false), fs::path(), false);
  auto publish = last_index_of(ops, "rename ");
  ASSERT_LT(publish, ops.size()) << "a save renames its temp folder into place";

  Rig rig(project_rig(tmp.path(), std::nullopt, false));
  for (int i = 0; i < 3; ++i) rig.step();
  auto first = rig.acc.save_state();
  ASSERT_EQ(first, root / "checkpoint_0");
  auto first_state = snapshot(rig);
  rig.step();  // a second checkpoint would differ from the first
  auto second_state = snapshot(rig);

  for (std::size_t k = 0; k <= ops.size(); ++k) {
    SCOPED_TRACE(describe(ops, k));
    bool published = k > publish;
    {
      // The last round injects nothing (a save over a published checkpoint_1 has more steps).
      FaultyFs faulty(k < ops.size() ? static_cast<int64_t>(k)
                                     : std::numeric_limits<int64_t>::max());
      UseFs use(&faulty);
      if (k < ops.size()) {
        EXPECT_THROW(rig.acc.save_state(), CheckpointError);
      } else {
        EXPECT_EQ(rig.acc.save_state(), root / "checkpoint_1");
      }
    }
    EXPECT_EQ(fs::exists(root / "checkpoint_1"), published);
    auto expected = published ? root / "checkpoint_1" : first;
    EXPECT_EQ(rig.acc.latest_checkpoint(), expected);
    Rig check(project_rig(tmp.path(), std::nullopt, /*automatic_resume=*/false, /*init_seed=*/9));
    EXPECT_EQ(check.acc.load_state(), expected);
    expect_same(published ? second_state : first_state, snapshot(check));
  }
}

// STYLE.md: "write temp -> fsync -> rename, delete temp on failure".
TEST(CheckpointAtomicity, AFailedSaveRemovesItsTempFolder) {
  TempDir tmp, probe_dir;
  auto root = tmp.path() / "checkpoints";
  fs::create_directories(probe_dir.path() / "checkpoints");  // as the rig's, made by its first save
  auto ops = save_operations(project_rig(probe_dir.path(), std::nullopt, false), fs::path(), false);
  auto publish = last_index_of(ops, "rename ");
  Rig rig(project_rig(tmp.path(), std::nullopt, false));
  rig.step();
  rig.acc.save_state();
  for (std::size_t k = 0; k <= publish; ++k) {
    SCOPED_TRACE(describe(ops, k));
    {
      FaultyFs faulty(static_cast<int64_t>(k));
      UseFs use(&faulty);
      EXPECT_THROW(rig.acc.save_state(), CheckpointError);
    }
    std::vector<std::string> left;
    for (const auto& entry : fs::directory_iterator(root)) {
      auto name = entry.path().filename().string();
      if (name != "checkpoint_0") left.push_back(name);
    }
    EXPECT_TRUE(left.empty()) << "left behind: " << ::testing::PrintToString(left);
  }
}

// --- background saves (SaveStateOptions::async) ----------------------------------------------

// The real file system, except that writing a file waits until open() is called (or the object
// is destroyed, or 60 s pass: a save that waited on its caller would otherwise hang the test).
class GatedFs : public ckpt::CheckpointFs {
 public:
  ~GatedFs() override { open(); }
  void open() {
    if (!opened_flag_.exchange(true)) gate_.set_value();
  }
  ckpt::WrittenFile write_stream(const fs::path& path,
                                 const std::function<void(const ckpt::Sink&)>& produce) override {
    if (opened_.wait_for(std::chrono::seconds(60)) != std::future_status::ready)
      throw std::runtime_error("GatedFs: never opened");
    return CheckpointFs::write_stream(path, produce);
  }

 private:
  std::promise<void> gate_;
  std::shared_future<void> opened_ = gate_.get_future().share();
  std::atomic<bool> opened_flag_{false};
};

// Training goes on while the files are written (the fused optimizer step, the EMA update and the
// counter change the live state in place): the checkpoint holds the state of the save_state call.
TEST(CheckpointAsync, ABackgroundSaveHoldsTheStateOfItsCallWhileTrainingGoesOn) {
  TempDir tmp;
  GatedFs gated;  // the writer writes no file before the training below has changed the state
  UseFs use(&gated);
  Rig rig({.init_seed = 1});
  // Why: destroyed first (reverse order) if anything below fails, so the writer the Rig's
  // Accelerator waits for is let through, before the file system it uses goes.
  struct OpenAtExit {
    GatedFs& gate;
    ~OpenAtExit() { gate.open(); }
  } open_at_exit{gated};
  for (int i = 0; i < 5; ++i) rig.step();
  auto saved = snapshot(rig);
  auto dir = rig.acc.save_state(tmp.path() / "ckpt", {.async = true});
  EXPECT_EQ(dir, tmp.path() / "ckpt");
  for (int i = 0; i < 3; ++i) rig.step();
  gated.open();
  rig.acc.wait_for_checkpoint();
  rig.acc.wait_for_checkpoint();  // nothing in flight: returns at once
  Rig resumed({.init_seed = 2});
  resumed.acc.load_state(dir);
  expect_same(saved, snapshot(resumed));
}

// The writer thread copies the weights and AdamW's state while the program's next forward and
// backward run, and the optimizer step waits for those copies. Here the copies are held back
// until well after that step began: the checkpoint still holds the state of the save_state call,
// "seen" included (a buffer the forward changes, copied during the call).
TEST(CheckpointAsync, TheNextStepWaitsForTheBackgroundCopyOfTheWeights) {
  TempDir tmp;
  Rig rig({.init_seed = 1});
  for (int i = 0; i < 3; ++i) rig.step();
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<bool> copy_began{false};
  ckpt::set_copy_hook_for_testing([&] {
    copy_began = true;
    released.wait();
  });
  struct ClearHook {
    std::promise<void>& release;
    bool opened = false;
    ~ClearHook() {
      if (!opened) release.set_value();
      ckpt::set_copy_hook_for_testing(nullptr);
    }
  } clear_hook{release};
  auto saved = snapshot(rig);
  auto dir = rig.acc.save_state(tmp.path() / "ckpt", {.async = true});
  std::thread opener([&] {
    while (!copy_began) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    // Why 200 ms: the step below (a forward, a backward and AdamW on a tiny model) begins long
    // before; it must wait here, or the weights it changes would be copied changed.
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    clear_hook.opened = true;
    release.set_value();
  });
  rig.step();
  opener.join();
  rig.acc.wait_for_checkpoint();
  Rig resumed({.init_seed = 2});
  resumed.acc.load_state(dir);
  expect_same(saved, snapshot(resumed));
}

// A background save that fails at any of its file operations is reported by the next
// wait_for_checkpoint (or save_state, or end_training), and the previous checkpoint still loads.
TEST(CheckpointAsync, AFailedBackgroundSaveIsReportedAndLeavesThePreviousCheckpoint) {
  TempDir tmp, probe_dir;
  auto root = tmp.path() / "checkpoints";
  fs::create_directories(probe_dir.path() / "checkpoints");
  auto ops = save_operations(project_rig(probe_dir.path(), std::nullopt, false), fs::path(), false);
  auto publish = last_index_of(ops, "rename ");
  ASSERT_LT(publish, ops.size());
  Rig rig(project_rig(tmp.path(), std::nullopt, false));
  rig.step();
  auto first = rig.acc.save_state();
  auto first_state = snapshot(rig);
  for (std::size_t k = 0; k <= publish; ++k) {
    SCOPED_TRACE(describe(ops, k));
    FaultyFs faulty(static_cast<int64_t>(k));
    UseFs use(&faulty);
    auto target = rig.acc.save_state({}, {.async = true});
    rig.step();
    if (k % 2 == 0) {
      expect_checkpoint_error([&] { rig.acc.wait_for_checkpoint(); },
                              {"background save of " + target.string(), "intact"});
    } else {
      expect_checkpoint_error([&] { rig.acc.end_training(); },
                              {"background save of " + target.string()});
      rig.acc.wait_for_checkpoint();  // reported once: the collective finds nothing more
    }
    EXPECT_FALSE(fs::exists(target));
    EXPECT_EQ(rig.acc.latest_checkpoint(), first);
  }
  Rig check(project_rig(tmp.path(), std::nullopt, /*automatic_resume=*/false, /*init_seed=*/9));
  EXPECT_EQ(check.acc.load_state(), first);
  expect_same(first_state, snapshot(check));
}

// The automatic saves of ProjectConfiguration::async_checkpoints: each is complete once the next
// one starts, and rotation keeps total_limit of them.
TEST(CheckpointAsync, AutomaticSavesInTheBackgroundRotateAndLoad) {
  TempDir tmp;
  auto options = project_rig(tmp.path(), 2, false);
  options.accelerator.project.save_interval = 2;
  options.accelerator.project.async_checkpoints = true;
  Snapshot at6;
  {
    Rig rig(options);
    for (int i = 0; i < 7; ++i) {
      if (i == 6) at6 = snapshot(rig);  // the automatic save at step 6 happens at the 7th batch
      rig.step();
    }
    rig.acc.wait_for_checkpoint();
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(tmp.path() / "checkpoints"))
      names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    EXPECT_EQ(names, (std::vector<std::string>{"checkpoint_1", "checkpoint_2"}));
  }
  Rig check(project_rig(tmp.path(), std::nullopt, false, 9));
  EXPECT_EQ(check.acc.load_state(), tmp.path() / "checkpoints" / "checkpoint_2");
  expect_same(at6, snapshot(check));
}

// save_state(dir) over an existing checkpoint: at every failure point, `dir` still loads, as the
// old checkpoint until the new one is complete, then as the new one. Also where the file system
// has no RENAME_EXCHANGE (the old folder steps aside while the new one moves in).
TEST(CheckpointAtomicity, OverwritingAFolderKeepsALoadableCheckpointThere) {
  for (bool can_exchange : {true, false}) {
    SCOPED_TRACE(can_exchange ? "with RENAME_EXCHANGE" : "without RENAME_EXCHANGE");
    TempDir tmp, probe_dir;
    auto dir = tmp.path() / "ckpt";
    auto ops = save_operations({}, probe_dir.path() / "ckpt", /*overwrite=*/true, can_exchange);
    // The new folder takes the old one's place: a swap, or its rename after the old one's.
    auto publish = last_index_of(ops, can_exchange ? "exchange .ckpt.tmp-" : "rename .ckpt.tmp-");
    ASSERT_LT(publish, ops.size()) << ::testing::PrintToString(ops);
    if (!can_exchange) {
      ASSERT_EQ(ops[publish - 1].rfind("rename ckpt -> .ckpt.old-", 0), 0u)
          << ::testing::PrintToString(ops);
    }

    Rig rig;
    rig.step();
    rig.acc.save_state(dir);
    auto first_state = snapshot(rig);
    rig.step();
    auto second_state = snapshot(rig);
    for (std::size_t k = 0; k < ops.size(); ++k) {
      SCOPED_TRACE(describe(ops, k));
      {
        FaultyFs faulty(static_cast<int64_t>(k), can_exchange);
        UseFs use(&faulty);
        EXPECT_THROW(rig.acc.save_state(dir), CheckpointError);
      }
      // Without RENAME_EXCHANGE, a failure of the new folder's rename that also fails the old
      // one's rename back (every operation fails from k on) leaves the old folder set aside,
      // complete, for the next save to put back (the next test); nothing else may go missing.
      auto loads_from = dir;
      std::optional<fs::path> aside;
      for (const auto& entry : fs::directory_iterator(tmp.path())) {
        if (entry.path().filename() == "ckpt") continue;
        EXPECT_EQ(entry.path().filename().string().rfind(".ckpt.old-", 0), 0u)
            << "left behind: " << entry.path();
        aside = entry.path();
      }
      if (aside) {
        EXPECT_FALSE(can_exchange);
        EXPECT_EQ(k, publish) << "only the new folder's rename can leave the old one aside";
        EXPECT_FALSE(fs::exists(dir));
        loads_from = *aside;
      }
      Rig check({.init_seed = 9});
      try {
        check.acc.load_state(loads_from);
        expect_same(k > publish ? second_state : first_state, snapshot(check));
      } catch (const CheckpointError& e) {
        ADD_FAILURE() << "the checkpoint no longer loads: " << e.what();
      }
      if (aside) fs::rename(*aside, dir);  // as the next save would, so the next round starts alike
    }
  }
}

// A process killed between the two renames of an overwrite without RENAME_EXCHANGE leaves the
// old checkpoint set aside and no folder at its name; the next save there puts it back first,
// so even a save that then fails leaves it loadable.
TEST(CheckpointAtomicity, AnOverwriteKilledBetweenItsRenamesIsRepairedByTheNextSave) {
  TempDir tmp;
  auto dir = tmp.path() / "ckpt";
  Rig rig;
  rig.step();
  rig.acc.save_state(dir);
  auto first_state = snapshot(rig);
  fs::rename(dir, tmp.path() / ".ckpt.old-12345");  // what the killed overwrite left
  {
    FaultyFs faulty(/*fail_at=*/1, /*can_exchange=*/false);  // the save fails after putting it back
    UseFs use(&faulty);
    EXPECT_THROW(rig.acc.save_state(dir), CheckpointError);
  }
  Rig check({.init_seed = 9});
  check.acc.load_state(dir);
  expect_same(first_state, snapshot(check));
  EXPECT_FALSE(fs::exists(tmp.path() / ".ckpt.old-12345"));
}

// A save that creates its folder fsyncs the parent of every folder it made, so the new folder's
// entry is on disk before the checkpoint is called saved.
TEST(CheckpointAtomicity, ANewFolderIsSyncedIntoItsParent) {
  TempDir tmp;
  auto dir = tmp.path() / "runs" / "a" / "ckpt";
  auto ops = [&] {
    Rig rig;
    rig.step();
    FaultyFs counting(std::numeric_limits<int64_t>::max());
    UseFs use(&counting);
    rig.acc.save_state(dir);
    return counting.operations();
  }();
  ASSERT_GE(ops.size(), 2u);
  // Before anything else: "runs" into tmp, "a" into runs (ckpt itself is renamed into "a").
  EXPECT_EQ(ops[0], "sync " + tmp.path().filename().string()) << ::testing::PrintToString(ops);
  EXPECT_EQ(ops[1], "sync runs") << ::testing::PrintToString(ops);
}

// --- save_model -----------------------------------------------------------------------------

std::map<std::string, torch::Tensor> decoded(const fs::path& file) {
  auto d = safetensors::decode(read_file(file), file.string());
  return {d.tensors.begin(), d.tensors.end()};
}

// What a loader finds in a save_model folder, entering as transformers does (model.safetensors,
// else the index and the shards it names): "none", or which of `models` every tensor matches
// ("0", "1"), or "mixed".
std::string model_found(const fs::path& dir,
                        const std::vector<std::map<std::string, torch::Tensor>>& models) {
  std::map<std::string, torch::Tensor> found;
  if (fs::exists(dir / "model.safetensors")) {
    found = decoded(dir / "model.safetensors");
  } else if (fs::exists(dir / "model.safetensors.index.json")) {
    auto index = json::parse(read_file(dir / "model.safetensors.index.json"));
    for (const auto& [name, file] : index["weight_map"].items())
      found[name] = decoded(dir / file.get<std::string>()).at(name);
  } else {
    return "none";
  }
  for (std::size_t m = 0; m < models.size(); ++m) {
    bool all = found.size() == models[m].size();
    for (const auto& [name, t] : models[m])
      all = all && found.count(name) && torch::equal(found.at(name), t);
    if (all) return std::to_string(m);
  }
  return "mixed";
}

// Re-saving a sharded model (same shard names) that fails at any file operation: a loader finds
// the old model, the new one, or none, never old and new shards under one index.
TEST(CheckpointSaveModel, AFailedResaveNeverMixesOldAndNewShards) {
  TempDir tmp;
  Accelerator acc;
  auto dir = tmp.path() / "model";
  auto make = [](int seed) {
    torch::manual_seed(seed);
    return torch::nn::Sequential(torch::nn::Linear(16, 16), torch::nn::Linear(16, 16),
                                 torch::nn::Linear(16, 4));
  };
  auto old_model = make(1), new_model = make(2);
  std::vector<std::map<std::string, torch::Tensor>> models;
  for (auto* m : {&old_model, &new_model}) {
    std::map<std::string, torch::Tensor> named;
    for (const auto& p : (*m)->named_parameters()) named[p.key()] = p.value().detach().clone();
    models.push_back(named);
  }
  acc.save_model(old_model.ptr(), dir, {.max_shard_size = "1KB"});
  ASSERT_EQ(model_found(dir, models), "0");
  std::vector<std::string> ops;
  {
    TempDir probe;
    acc.save_model(old_model.ptr(), probe.path(), {.max_shard_size = "1KB"});
    FaultyFs counting(std::numeric_limits<int64_t>::max());
    UseFs use(&counting);
    acc.save_model(new_model.ptr(), probe.path(), {.max_shard_size = "1KB"});
    ops = counting.operations();
  }
  ASSERT_GE(std::count_if(ops.begin(), ops.end(),
                          [](const std::string& op) { return op.rfind("rename ", 0) == 0; }),
            3)
      << "several shards: " << ::testing::PrintToString(ops);
  for (std::size_t k = 0; k < ops.size(); ++k) {
    SCOPED_TRACE(describe(ops, k));
    acc.save_model(old_model.ptr(), dir, {.max_shard_size = "1KB"});
    {
      FaultyFs faulty(static_cast<int64_t>(k));
      UseFs use(&faulty);
      EXPECT_THROW(acc.save_model(new_model.ptr(), dir, {.max_shard_size = "1KB"}),
                   CheckpointError);
    }
    EXPECT_NE(model_found(dir, models), "mixed");
    for (const auto& entry : fs::directory_iterator(dir)) {
      EXPECT_NE(entry.path().extension(), ".tmp") << "left behind: " << entry.path();
    }
  }
  acc.save_model(new_model.ptr(), dir, {.max_shard_size = "1KB"});
  EXPECT_EQ(model_found(dir, models), "1");
}

TEST(CheckpointSaveModel, OneFileUnderTheLimitShardsWithAnIndexOverIt) {
  TempDir tmp;
  Accelerator acc;
  torch::manual_seed(0);
  // 16x16 float weights are 1024 bytes each: with "1KB" (1000 bytes) every layer gets a shard.
  auto model = torch::nn::Sequential(torch::nn::Linear(16, 16), torch::nn::ReLU(),
                                     torch::nn::Linear(16, 16), torch::nn::Linear(16, 4));
  auto params = model->named_parameters();
  uint64_t total = 0;
  for (const auto& p : params) total += p.value().nbytes();

  auto single = tmp.path() / "single";
  acc.save_model(model.ptr(), single);
  EXPECT_TRUE(fs::exists(single / "model.safetensors"));
  EXPECT_FALSE(fs::exists(single / "model.safetensors.index.json"));
  auto all = decoded(single / "model.safetensors");
  EXPECT_EQ(all.size(), params.size());
  for (const auto& p : params) {
    ASSERT_TRUE(all.count(p.key())) << p.key();
    EXPECT_TRUE(torch::equal(all.at(p.key()), p.value())) << p.key();
  }

  auto sharded = tmp.path() / "sharded";
  acc.save_model(model.ptr(), sharded, {.max_shard_size = "1KB"});
  EXPECT_FALSE(fs::exists(sharded / "model.safetensors"));
  auto index = json::parse(read_file(sharded / "model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);
  const auto& weight_map = index["weight_map"];
  EXPECT_EQ(weight_map.size(), params.size());
  std::set<std::string> files;
  for (const auto& p : params) {
    ASSERT_TRUE(weight_map.contains(p.key())) << p.key() << " is not in the index";
    auto file = weight_map[p.key()].get<std::string>();
    files.insert(file);
    auto shard = decoded(sharded / file);
    ASSERT_TRUE(shard.count(p.key())) << p.key() << " is not in " << file;
    EXPECT_TRUE(torch::equal(shard.at(p.key()), p.value())) << p.key();
  }
  EXPECT_GE(files.size(), 3u);
  for (const auto& file : files) {
    EXPECT_LE(fs::file_size(sharded / file), 1000u + 1024u + 512u)
        << file << ": a shard holds one big tensor at most";
  }
}

// --- load_model, get_state_dict, set_seed, state pre-hooks ---------------------------------

torch::nn::Sequential small_model(int seed, int64_t hidden = 16) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(16, hidden), torch::nn::ReLU(),
                               torch::nn::Linear(hidden, 16), torch::nn::BatchNorm1d(16),
                               torch::nn::Linear(16, 4));
}

std::vector<torch::Tensor> state_tensors(const Accelerator& acc, const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& [name, t] : acc.get_state_dict(m)) out.push_back(t.detach().clone());
  return out;
}

// A model saved by save_model (one file, and sharded under an index) loads back bitwise into a
// fresh model, buffers included.
TEST(LoadModel, ASaveModelFolderLoadsBackBitwiseOneFileOrSharded) {
  TempDir tmp;
  Accelerator acc;
  auto trained = small_model(1);
  trained->forward(torch::randn({8, 16}));  // BatchNorm's running stats move: buffers differ
  auto want = state_tensors(acc, *trained);
  ASSERT_EQ(acc.get_state_dict(*trained).size(),
            trained->named_parameters().size() + trained->named_buffers().size());
  acc.save_model(trained.ptr(), tmp.path() / "one");
  acc.save_model(trained.ptr(), tmp.path() / "sharded", {.max_shard_size = "1KB"});
  ASSERT_TRUE(fs::exists(tmp.path() / "sharded" / "model.safetensors.index.json"));
  for (const auto& path :
       {tmp.path() / "one", tmp.path() / "sharded", tmp.path() / "one" / "model.safetensors"}) {
    SCOPED_TRACE(path.string());
    auto fresh = small_model(2);
    ASSERT_FALSE(torch::equal(state_tensors(acc, *fresh)[0], want[0]));
    auto keys = load_model(fresh.ptr(), path);
    EXPECT_TRUE(keys.missing.empty());
    EXPECT_TRUE(keys.unexpected.empty());
    expect_bitwise(want, state_tensors(acc, *fresh), "loaded");
  }
}

// strict names every missing and unexpected key and loads nothing; not strict loads the names
// that match and returns the others (HF's load_checkpoint_in_model).
TEST(LoadModel, StrictNamesMissingAndUnexpectedKeysNotStrictLoadsTheRest) {
  TempDir tmp;
  Accelerator acc;
  torch::manual_seed(3);
  auto saved = torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::Linear(4, 2));
  acc.save_model(saved.ptr(), tmp.path() / "m");
  torch::manual_seed(4);
  auto other = torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::Linear(4, 2),
                                     torch::nn::Linear(2, 2));
  auto before = state_tensors(acc, *other);
  try {
    load_model(other.ptr(), tmp.path() / "m");
    ADD_FAILURE() << "a missing key loaded in strict mode";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("missing keys (in the model only): 2.weight, 2.bias"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("Nothing was loaded"), std::string::npos) << e.what();
  }
  expect_bitwise(before, state_tensors(acc, *other), "after a refused strict load");
  auto keys = load_checkpoint_in_model(other.ptr(), tmp.path() / "m");
  EXPECT_EQ(keys.missing, (std::vector<std::string>{"2.weight", "2.bias"}));
  EXPECT_TRUE(keys.unexpected.empty());
  EXPECT_TRUE(torch::equal(other[0]->as<torch::nn::Linear>()->weight,
                           saved[0]->as<torch::nn::Linear>()->weight));
  EXPECT_TRUE(torch::equal(other[2]->as<torch::nn::Linear>()->weight, before[4]));

  auto smaller = torch::nn::Sequential(torch::nn::Linear(4, 4));
  try {
    load_model(smaller.ptr(), tmp.path() / "m");
    ADD_FAILURE() << "an unexpected key loaded in strict mode";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("unexpected keys (in the files only): 1.bias, 1.weight"),
              std::string::npos)
        << e.what();
  }
}

// Shapes that differ, a folder without model files, a damaged file: errors that say where, and
// the model is unchanged.
TEST(LoadModel, ShapeMismatchAndDamagedFilesAreErrorsThatChangeNothing) {
  TempDir tmp;
  Accelerator acc;
  acc.save_model(small_model(1, 16).ptr(), tmp.path() / "m");
  auto wider = small_model(2, 32);
  auto before = state_tensors(acc, *wider);
  try {
    load_model(wider.ptr(), tmp.path() / "m", /*strict=*/false);
    ADD_FAILURE() << "a shape mismatch loaded";
  } catch (const CheckpointError& e) {
    EXPECT_NE(
        std::string(e.what()).find("0.weight is [16, 16] in the files, [32, 16] in the model"),
        std::string::npos)
        << e.what();
  }
  expect_bitwise(before, state_tensors(acc, *wider), "after a refused load");

  fs::create_directories(tmp.path() / "empty");
  try {
    load_model(wider.ptr(), tmp.path() / "empty");
    ADD_FAILURE();
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("has neither model.safetensors nor "
                                         "model.safetensors.index.json"),
              std::string::npos)
        << e.what();
  }
  auto bytes = read_file(tmp.path() / "m" / "model.safetensors");
  write_file(tmp.path() / "m" / "model.safetensors", bytes.substr(0, bytes.size() - 5));
  EXPECT_THROW(load_model(small_model(2).ptr(), tmp.path() / "m"), CheckpointError);
}

// set_seed seeds libtorch's generator as manual_seed does, and is the shuffle seed of loaders
// made afterwards without one of their own.
TEST(SetSeed, SeedsLibtorchAndTheDefaultShuffleOfLaterLoaders) {
  set_seed(7);
  auto a = torch::randn({4});
  torch::manual_seed(7);
  EXPECT_TRUE(torch::equal(a, torch::randn({4})));
  ASSERT_EQ(last_seed(), std::optional<uint64_t>(7));

  auto ds = std::make_shared<TensorDataset>(torch::arange(32).unsqueeze(1), torch::arange(32));
  auto order = [](DataLoader& dl) {
    std::vector<int64_t> out;
    for (auto& b : dl)
      for (int64_t i = 0; i < b.target.size(0); ++i) out.push_back(b.target[i].item<int64_t>());
    return out;
  };
  DataLoader implicit(ds, {.batch_size = 4, .shuffle = true});
  DataLoader explicit_seven(ds, {.batch_size = 4, .shuffle = true, .seed = 7});
  DataLoader explicit_zero(ds, {.batch_size = 4, .shuffle = true, .seed = 0});
  EXPECT_EQ(order(implicit), order(explicit_seven));
  EXPECT_NE(order(implicit), order(explicit_zero));
  set_seed(0);
}

// Pre-hooks see the prepared models and the folder, on save_state and load_state; a removed one
// is not called; one that throws stops the save before anything is written.
TEST(StateHooks, SaveAndLoadPreHooksRunFirstAndCanBeRemoved) {
  TempDir tmp;
  Accelerator acc;
  auto model = torch::nn::Linear(3, 1);
  auto opt = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  acc.prepare(model, opt);
  std::vector<std::string> calls;
  auto save = acc.register_save_state_pre_hook(
      [&](const std::vector<torch::nn::Module*>& models, const fs::path& dir) {
        calls.push_back("save " + std::to_string(models.size()) + " " + dir.filename().string());
      });
  acc.register_load_state_pre_hook(
      [&](const std::vector<torch::nn::Module*>& models, const fs::path& dir) {
        EXPECT_EQ(models.at(0), model.ptr().get());
        calls.push_back("load " + dir.filename().string());
      });
  acc.save_state(tmp.path() / "a");
  acc.load_state(tmp.path() / "a");
  save.remove();
  acc.save_state(tmp.path() / "b");
  EXPECT_EQ(calls, (std::vector<std::string>{"save 1 a", "load a"}));
  acc.register_save_state_pre_hook(
      [](const std::vector<torch::nn::Module*>&, const fs::path&) { throw UsageError("not now"); });
  EXPECT_THROW(acc.save_state(tmp.path() / "c"), UsageError);
  EXPECT_FALSE(fs::exists(tmp.path() / "c"));
}

// write_stream writes large files with O_DIRECT through two aligned buffers and the last partial
// block through the page cache: every size around the block (4 KiB) and buffer (8 MiB) edges,
// fed in parts that do not line up with either, must come back byte for byte, with the checksum
// of what was written. /dev/shm (tmpfs) may refuse O_DIRECT, which takes the page-cache path.
TEST(CheckpointFsWrite, EverySizeAroundTheBlockAndBufferEdgesIsWrittenExactly) {
  TempDir tmp;
  std::vector<fs::path> folders{tmp.path()};
  std::error_code ec;
  fs::path shm = fs::path("/dev/shm") / ("accel-test-" + std::to_string(::getpid()));
  if (fs::create_directory(shm, ec)) folders.push_back(shm);
  const std::size_t mib8 = std::size_t{8} << 20;
  std::string all(mib8 * 2 + 5000, '\0');
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<char>((i * 2654435761u) >> 13);
  for (const auto& folder : folders) {
    for (std::size_t size : {std::size_t{0}, std::size_t{1}, std::size_t{4095}, std::size_t{4096},
                             std::size_t{4097}, mib8 - 1, mib8, mib8 + 4097, 2 * mib8 + 4999}) {
      SCOPED_TRACE(folder.string() + ", " + std::to_string(size) + " bytes");
      const std::string_view content(all.data(), size);
      auto path = folder / "f.bin";
      auto written = ckpt::CheckpointFs().write_stream(path, [&](const ckpt::Sink& sink) {
        std::size_t at = 0, step = 1;
        while (at < size) {  // parts of 1, 1000003, 1, 1000003, ... bytes
          std::size_t n = std::min(step, size - at);
          sink(content.substr(at, n));
          at += n;
          step = step == 1 ? 1000003 : 1;
        }
      });
      EXPECT_EQ(written.size, size);
      EXPECT_EQ(written.checksum, ckpt::checksum(content));
      EXPECT_EQ(fs::file_size(path), size);
      EXPECT_TRUE(read_file(path) == content) << "the bytes on disk differ";
    }
  }
  fs::remove_all(shm, ec);
}

// The writer thread's failures reach the caller: a file-size limit just past the first 8 MiB
// buffer makes the second O_DIRECT write short, then refused (EINVAL), then the page-cache retry
// fails with EFBIG: a CheckpointError naming the file and the OS error, with the thread joined.
// A producer that throws while a buffer is being written does not hang either.
TEST(CheckpointFsWrite, AFailedWriteOrProducerIsACheckpointErrorNamingTheFile) {
  TempDir tmp;
  const std::string chunk(std::size_t{1} << 20, 'x');
  auto twenty_mib = [&](const ckpt::Sink& sink) {
    for (int i = 0; i < 20; ++i) sink(chunk);
  };
  {
    struct rlimit old {};
    ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
    auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
    struct rlimit small = old;
    small.rlim_cur = (std::size_t{8} << 20) + 100;
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
    std::string what;
    try {
      ckpt::CheckpointFs().write_stream(tmp.path() / "big.bin", twenty_mib);
    } catch (const CheckpointError& e) {
      what = e.what();
    }
    ::setrlimit(RLIMIT_FSIZE, &old);
    std::signal(SIGXFSZ, old_handler);
    EXPECT_NE(what.find("big.bin"), std::string::npos) << what;
    EXPECT_NE(what.find("File too large"), std::string::npos) << what;
  }
  std::string what;
  try {
    ckpt::CheckpointFs().write_stream(tmp.path() / "half.bin", [&](const ckpt::Sink& sink) {
      for (int i = 0; i < 12; ++i) sink(chunk);  // one buffer handed to the thread, one filling
      throw std::runtime_error("the serializer gave up");
    });
  } catch (const CheckpointError& e) {
    what = e.what();
  }
  EXPECT_NE(what.find("half.bin"), std::string::npos) << what;
  EXPECT_NE(what.find("the serializer gave up"), std::string::npos) << what;
}

}  // namespace
}  // namespace accel

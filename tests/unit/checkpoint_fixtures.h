// Fixtures shared by the checkpoint unit tests (checkpoint_test.cpp, checkpoint_faults_test.cpp,
// mixed_precision_test.cpp, model_io_test.cpp): a Rig (a prepared model, AdamW, scheduler,
// loader and registered objects) whose whole state a Snapshot holds, and the checks on them.
#pragma once

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
#include "runtime/optimizer_steps.h"
#include "runtime/safetensors.h"
#include "tests/common/files.h"

namespace accel::ckpt_testing {

namespace fs = std::filesystem;
using json = nlohmann::json;

using testing::read_file;
using testing::TempDir;
using testing::write_file;

inline double lr_of(torch::optim::Optimizer& opt) {
  return opt.param_groups()[0].options().get_lr();
}

inline std::vector<torch::Tensor> copies(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> out;
  for (const auto& t : tensors) out.push_back(t.detach().clone());
  return out;
}

inline void expect_bitwise(const std::vector<torch::Tensor>& want,
                           const std::vector<torch::Tensor>& got, const std::string& what) {
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

// --- checkpoint fixtures --------------------------------------------------------------------

// 20 samples (4 features, 2 targets), the same in every rig.
inline std::shared_ptr<TensorDataset> fixed_data() {
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

inline Snapshot snapshot(Rig& rig) {
  Snapshot s;
  // First: asking a prepared loader its state is where an automatic resume happens.
  s.loader = rig.loader().state();
  s.params = copies(rig.model->parameters());
  s.buffers = copies(rig.model->buffers());
  for (const auto& p : rig.adamw->param_groups()[0].params()) {
    auto it = rig.adamw->state().find(accel::detail::state_key(p));
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

inline void expect_same(const Snapshot& want, const Snapshot& got) {
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

inline RigOptions project_rig(const fs::path& project, std::optional<int64_t> total_limit,
                              bool automatic_resume, uint64_t init_seed = 1) {
  RigOptions options{.init_seed = init_seed};
  options.accelerator.project.project_dir = project.string();
  options.accelerator.project.total_limit = total_limit;
  options.accelerator.project.automatic_resume = automatic_resume;
  return options;
}

// A safetensors file's tensors by name.
inline std::map<std::string, torch::Tensor> decoded(const fs::path& file) {
  auto d = safetensors::decode(read_file(file), file.string());
  return {d.tensors.begin(), d.tensors.end()};
}

}  // namespace accel::ckpt_testing

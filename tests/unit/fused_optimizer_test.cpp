// The prepared optimizer's fused Adam/AdamW/SGD step against libtorch's own step: same state
// objects, bitwise the same results, and a fallback that changes nothing.
#include "runtime/fused_optimizer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "accel/accel.h"
#include "runtime/optimizer_steps.h"

namespace accel {
namespace {

namespace o = torch::optim;
using MakeOptimizer = std::function<std::shared_ptr<o::Optimizer>(std::vector<torch::Tensor>)>;

// Shapes: a matrix larger than one thread's grain (so parallel_for splits it when it can), a
// vector, a scalar, and one parameter that never gets a gradient.
std::vector<torch::Tensor> make_params(torch::Dtype dtype) {
  torch::manual_seed(7);
  std::vector<torch::Tensor> params;
  for (auto shape : std::vector<std::vector<int64_t>>{{300, 257}, {257}, {}, {5, 3}}) {
    params.push_back(torch::randn(shape, torch::dtype(dtype)).requires_grad_(true));
  }
  return params;
}

std::vector<torch::Tensor> clone_params(const std::vector<torch::Tensor>& from) {
  std::vector<torch::Tensor> out;
  for (auto& p : from) out.push_back(p.detach().clone().requires_grad_(true));
  return out;
}

// Step `steps` times with the same gradients on both sides; the last parameter gets none.
void set_grads(std::vector<torch::Tensor>& params, int step) {
  torch::manual_seed(100 + step);
  for (std::size_t i = 0; i + 1 < params.size(); ++i) {
    params[i].mutable_grad() =
        torch::randn(params[i].sizes(), params[i].options()) * static_cast<double>(i + 1);
  }
}

struct Case {
  std::string name;
  MakeOptimizer make;
};

std::vector<Case> cases() {
  return {
      {"AdamW wd 0.01",
       [](auto p) {
         return std::make_shared<o::AdamW>(p, o::AdamWOptions(1e-2).weight_decay(0.01));
       }},
      {"AdamW wd 0",
       [](auto p) { return std::make_shared<o::AdamW>(p, o::AdamWOptions(1e-3).weight_decay(0)); }},
      {"Adam", [](auto p) { return std::make_shared<o::Adam>(p, o::AdamOptions(1e-2)); }},
      {"Adam wd 0.1 betas",
       [](auto p) {
         return std::make_shared<o::Adam>(
             p, o::AdamOptions(3e-3).weight_decay(0.1).betas({0.8, 0.99}).eps(1e-6));
       }},
      {"SGD", [](auto p) { return std::make_shared<o::SGD>(p, o::SGDOptions(0.1)); }},
      {"SGD momentum dampening wd",
       [](auto p) {
         return std::make_shared<o::SGD>(
             p, o::SGDOptions(0.05).momentum(0.9).dampening(0.1).weight_decay(1e-3));
       }},
      {"SGD nesterov",
       [](auto p) {
         return std::make_shared<o::SGD>(p, o::SGDOptions(0.05).momentum(0.9).nesterov(true));
       }},
  };
}

// The largest difference between the two runs' parameters, relative to each tensor's largest
// element (an element near zero may differ by ulps of the values it passed through).
double max_relative_difference(const std::vector<torch::Tensor>& a,
                               const std::vector<torch::Tensor>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    double diff = (a[i] - b[i]).abs().max().item<double>();
    worst = std::max(worst, diff / std::max(b[i].abs().max().item<double>(), 1e-30));
  }
  return worst;
}

// Bitwise: every operation rounds as ATen's kernel for it (fused_optimizer.h). A wrong coefficient
// (bias correction, decay, dampening) or a multiply-add rounded once where ATen rounds twice (or
// the other way) shows up as a difference in some element within a step or two.
TEST(FusedOptimizer, MatchesLibtorchsStepForEachOptimizerAndDtype) {
  for (auto dtype : {torch::kFloat, torch::kDouble}) {
    for (const auto& c : cases()) {
      SCOPED_TRACE(c.name + (dtype == torch::kFloat ? " float" : " double"));
      auto ref_params = make_params(dtype);
      auto fused_params = clone_params(ref_params);
      auto ref = c.make(ref_params);
      auto fused = c.make(fused_params);
      for (int step = 0; step < 30; ++step) {
        set_grads(ref_params, step);
        set_grads(fused_params, step);
        ref->step();
        ASSERT_TRUE(detail::fused_step(*fused));
      }
      for (std::size_t i = 0; i < ref_params.size(); ++i) {
        EXPECT_TRUE(torch::equal(fused_params[i], ref_params[i]))
            << "parameter " << i << " differs by up to "
            << max_relative_difference({fused_params[i]}, {ref_params[i]})
            << " of its largest element";
      }
      EXPECT_TRUE(torch::equal(fused_params.back(), ref_params.back()));  // no gradient: untouched
      EXPECT_EQ(fused->state().size(), ref->state().size());
    }
  }
}

// The fused step keeps libtorch's state objects: a run may go from one to the other at any step
// (a checkpoint written by either loads into either), and the state serializes as libtorch's.
TEST(FusedOptimizer, ContinuesLibtorchsStateAndSerializesAsLibtorch) {
  auto base = make_params(torch::kFloat);
  auto mixed_params = clone_params(base);
  auto ref_params = clone_params(base);
  auto mixed = std::make_shared<o::AdamW>(mixed_params, o::AdamWOptions(1e-2).weight_decay(0.01));
  auto ref = std::make_shared<o::AdamW>(ref_params, o::AdamWOptions(1e-2).weight_decay(0.01));
  for (int step = 0; step < 10; ++step) {
    set_grads(mixed_params, step);
    set_grads(ref_params, step);
    ref->step();
    if (step < 5)
      mixed->step();
    else
      ASSERT_TRUE(detail::fused_step(*mixed));
  }
  for (std::size_t i = 0; i < ref_params.size(); ++i)
    EXPECT_TRUE(torch::equal(mixed_params[i], ref_params[i])) << i;
  auto key = accel::detail::state_key(mixed_params[0]);
  EXPECT_EQ(static_cast<o::AdamWParamState&>(*mixed->state().at(key)).step(), 10);

  std::ostringstream saved;
  torch::save(*mixed, saved);
  auto reloaded_params = clone_params(mixed_params);
  o::AdamW reloaded(reloaded_params, o::AdamWOptions(1e-2).weight_decay(0.01));
  std::istringstream in(saved.str());
  torch::load(reloaded, in);
  set_grads(reloaded_params, 10);
  set_grads(mixed_params, 10);
  ASSERT_TRUE(detail::fused_step(reloaded));
  ASSERT_TRUE(detail::fused_step(*mixed));
  for (std::size_t i = 0; i < mixed_params.size(); ++i)
    EXPECT_TRUE(torch::equal(reloaded_params[i], mixed_params[i])) << i;
}

// Bitwise deterministic whatever the thread count (each element's update depends on it alone).
TEST(FusedOptimizer, GivesTheSameBitsOnOneThreadAndMany) {
  auto base = make_params(torch::kFloat);
  std::vector<std::vector<torch::Tensor>> results;
  const int before = at::get_num_threads();
  for (int threads : {1, 2}) {
    at::set_num_threads(threads);
    auto params = clone_params(base);
    o::AdamW opt(params, o::AdamWOptions(1e-2));
    for (int step = 0; step < 3; ++step) {
      set_grads(params, step);
      ASSERT_TRUE(detail::fused_step(opt));
    }
    results.push_back(params);
  }
  at::set_num_threads(before);
  for (std::size_t i = 0; i < base.size(); ++i)
    EXPECT_TRUE(torch::equal(results[0][i], results[1][i]));
}

// An update of a range of elements (what each rank of a split step runs) changes exactly those
// elements, as the whole update changes them, and reports them written in order, in pieces that
// cover the range once.
TEST(FusedOptimizer, UpdatesARangeAsTheWholeUpdateAndSaysWhatItWrote) {
  torch::manual_seed(3);
  const int64_t n = 100'000, lo = 1'234, hi = 90'001;
  auto p = torch::randn({n}), g = torch::randn({n});
  auto m = torch::randn({n}).abs(), v = torch::randn({n}).abs();
  const detail::AdamRule adam{1e-2, 0.9, 0.999, 1e-8, 0.01, true};
  const detail::SgdRule sgd{1e-2, 0.9, 0.0, 1e-3, true};
  for (bool is_adam : {true, false}) {
    SCOPED_TRACE(is_adam ? "AdamW" : "SGD");
    auto wp = p.clone(), wm = m.clone(), wv = v.clone();  // the whole update
    auto rp = p.clone(), rm = m.clone(), rv = v.clone();  // the range
    std::vector<std::pair<int64_t, int64_t>> pieces;
    detail::UpdateRange range{
        lo, hi, [&](int64_t b, int64_t e) {
          // Written by now: the piece holds the whole update's values.
          EXPECT_TRUE(torch::equal(rp.narrow(0, b, e - b), wp.narrow(0, b, e - b)));
          pieces.emplace_back(b, e);
        }};
    if (is_adam) {
      detail::fused_adam_update(wp, g, wm, wv, 3, adam);
      detail::fused_adam_update(rp, g, rm, rv, 3, adam, range);
    } else {
      detail::fused_sgd_update(wp, g, wm, false, sgd);
      detail::fused_sgd_update(rp, g, rm, false, sgd, range);
    }
    ASSERT_GT(pieces.size(), 1u);
    EXPECT_EQ(pieces.front().first, lo);
    EXPECT_EQ(pieces.back().second, hi);
    for (std::size_t i = 1; i < pieces.size(); ++i)
      EXPECT_EQ(pieces[i].first, pieces[i - 1].second) << i;
    for (const auto& [range_result, whole, before] :
         {std::tuple{rp, wp, p}, std::tuple{rm, wm, m}, std::tuple{rv, wv, v}}) {
      EXPECT_TRUE(torch::equal(range_result.narrow(0, lo, hi - lo), whole.narrow(0, lo, hi - lo)));
      EXPECT_TRUE(torch::equal(range_result.narrow(0, 0, lo), before.narrow(0, 0, lo)));
      EXPECT_TRUE(torch::equal(range_result.narrow(0, hi, n - hi), before.narrow(0, hi, n - hi)));
    }
    EXPECT_FALSE(torch::equal(rp, p)) << "nothing was updated";
  }
}

struct MyAdamW : o::AdamW {
  using o::AdamW::AdamW;
};

// What it does not handle it leaves alone, for libtorch's step.
TEST(FusedOptimizer, LeavesWhatItDoesNotHandleUntouched) {
  auto check = [](const std::string& what, o::Optimizer& opt, std::vector<torch::Tensor>& params) {
    SCOPED_TRACE(what);
    for (auto& p : params) p.mutable_grad() = torch::ones_like(p);
    auto before = clone_params(params);
    auto states = opt.state().size();  // Adagrad makes its state in its constructor
    EXPECT_FALSE(detail::fused_step(opt));
    for (std::size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i], before[i]));
    EXPECT_EQ(opt.state().size(), states);
  };
  {
    auto params = make_params(torch::kFloat);
    o::AdamW opt(params, o::AdamWOptions(1e-2).amsgrad(true));
    check("amsgrad", opt, params);
  }
  {
    auto params = make_params(torch::kFloat);
    MyAdamW opt(params, o::AdamWOptions(1e-2));
    check("a subclass", opt, params);
  }
  {
    auto params = make_params(torch::kFloat);
    o::Adagrad opt(params, o::AdagradOptions(1e-2));
    check("Adagrad", opt, params);
  }
  {
    auto params = make_params(torch::kFloat);
    params.push_back(torch::randn({4, 6}).t().requires_grad_(true));  // not contiguous
    o::SGD opt(params, o::SGDOptions(0.1));
    check("a transposed parameter", opt, params);
  }
  {
    auto params = make_params(torch::kFloat);
    params.push_back(torch::randn({3}, torch::kBFloat16).requires_grad_(true));
    o::Adam opt(params, o::AdamOptions(1e-2));
    check("a bf16 parameter", opt, params);
  }
}

// Through the Accelerator: the prepared optimizer steps with the fused loop by default and with
// libtorch's step with fused_optimizer = false, both bitwise where a plain libtorch loop ends.
// Which one ran shows in the weight's version counter: libtorch's AdamW step changes the weight
// in place twice (decay, update), the fused loop once.
TEST(FusedOptimizer, ThePreparedOptimizerUsesItUnlessTurnedOff) {
  struct Run {
    torch::Tensor weights;
    int64_t weight_writes;
  };
  // fused: std::nullopt for a plain libtorch loop without an Accelerator.
  auto train = [](std::optional<bool> fused) {
    torch::manual_seed(3);
    auto model = torch::nn::Linear(64, 8);
    auto opt =
        std::make_shared<o::AdamW>(model->parameters(), o::AdamWOptions(1e-2).weight_decay(0.01));
    AcceleratorOptions options;
    options.fused_optimizer = fused.value_or(false);
    Accelerator acc(options);
    std::optional<PreparedOptimizer> po;
    if (fused) po = std::get<1>(acc.prepare(model, opt));
    const int64_t version_before = model->weight._version();
    for (int step = 0; step < 20; ++step) {
      torch::manual_seed(50 + step);
      auto loss = model->forward(torch::randn({16, 64})).pow(2).mean();
      if (po) {
        acc.backward(loss);
        po->step();
        po->zero_grad();
      } else {
        loss.backward();
        opt->step();
        opt->zero_grad();
      }
    }
    return Run{torch::cat({model->weight.detach().flatten(), model->bias.detach()}),
               model->weight._version() - version_before};
  };
  auto libtorch = train(std::nullopt);
  auto unfused = train(false);
  auto fused = train(true);
  EXPECT_TRUE(torch::equal(unfused.weights, libtorch.weights));
  EXPECT_TRUE(torch::equal(fused.weights, libtorch.weights));
  EXPECT_EQ(libtorch.weight_writes, 40);
  EXPECT_EQ(unfused.weight_writes, 40);
  EXPECT_EQ(fused.weight_writes, 20) << "the prepared optimizer did not use the fused step";
}

}  // namespace
}  // namespace accel

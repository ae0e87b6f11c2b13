// accel::LambdaLR and transformers' warmup schedules against PyTorch's own LambdaLR (Debian's
// torch 1.13, run by /usr/bin/python3) with transformers' formulas, step by step; and their
// round trip through save_state/load_state.
#include "accel/schedulers.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "accel/accel.h"
#include "tests/common/files.h"

namespace accel {
namespace {

namespace fs = std::filesystem;

// The learning rates PyTorch's LambdaLR gives over `steps` steps (the one at construction first),
// with the lambda `lambda_source` (Python, of `s`), from lr 0.1; empty when no torch is there.
std::vector<double> pytorch_lrs(const std::string& lambda_source, int steps) {
  const std::string python = "/usr/bin/python3";
  if (!fs::exists(python)) return {};
  testing::TempDir tmp;
  const auto script = tmp.path() / "lrs.py";
  std::ofstream(script) << "import math, torch\n"
                           "p = torch.nn.Parameter(torch.zeros(1))\n"
                           "opt = torch.optim.SGD([p], lr=0.1)\n"
                           "sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: "
                        << lambda_source << ")\n"
                        << "out = [opt.param_groups[0]['lr']]\n"
                        << "for _ in range(" << steps << "):\n"
                        << "    opt.step(); sched.step(); out.append(opt.param_groups[0]['lr'])\n"
                        << "print(' '.join(repr(x) for x in out))\n";
  FILE* p = ::popen((python + " -W ignore " + script.string() + " 2>&1").c_str(), "r");
  std::string text;
  char buf[4096];
  while (p != nullptr && std::fgets(buf, sizeof buf, p) != nullptr) text += buf;
  if (p == nullptr || ::pclose(p) != 0) {
    ADD_FAILURE() << "python failed: " << text;
    return {};
  }
  std::vector<double> out;
  std::istringstream in(text);
  for (double v; in >> v;) out.push_back(v);
  return out;
}

// The same through accel's scheduler made by `make`.
template <class F>
std::vector<double> accel_lrs(F make, int steps) {
  auto p = torch::zeros({1}, torch::requires_grad());
  torch::optim::SGD opt({p}, torch::optim::SGDOptions(0.1));
  auto sched = make(opt);
  std::vector<double> out = {opt.param_groups()[0].options().get_lr()};
  for (int i = 0; i < steps; ++i) {
    sched->step();
    out.push_back(opt.param_groups()[0].options().get_lr());
  }
  return out;
}

// transformers' formulas in Python, as in transformers/optimization.py.
constexpr const char* kWarm = "float(s) / float(max(1, W)) if s < W else ";

std::string with(std::string text, const std::string& from, const std::string& to) {
  for (auto at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size()))
    text.replace(at, from.size(), to);
  return text;
}

TEST(Schedulers, MatchPyTorchsLambdaLRWithTransformersFormulasStepByStep) {
  const int steps = 40;
  struct Case {
    std::string name, python;
    std::function<std::shared_ptr<LambdaLR>(torch::optim::Optimizer&)> make;
  };
  const std::vector<Case> cases = {
      {"constant", "1.0", [](auto& o) { return get_constant_schedule(o); }},
      {"constant with warmup", with(std::string(kWarm) + "1.0", "W", "7"),
       [](auto& o) { return get_constant_schedule_with_warmup(o, 7); }},
      {"linear with warmup",
       with(std::string(kWarm) + "max(0.0, float(30 - s) / float(max(1, 30 - W)))", "W", "5"),
       [](auto& o) { return get_linear_schedule_with_warmup(o, 5, 30); }},
      {"cosine with warmup",
       with(std::string(kWarm) + "max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(0.5) * 2.0 * "
                                 "(float(s - W) / float(max(1, 33 - W))))))",
            "W", "3"),
       [](auto& o) { return get_cosine_schedule_with_warmup(o, 3, 33); }},
      {"cosine, 2 cycles, no warmup",
       with(std::string(kWarm) + "max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(2.0) * 2.0 * "
                                 "(float(s - W) / float(max(1, 20 - W))))))",
            "W", "0"),
       [](auto& o) { return get_cosine_schedule_with_warmup(o, 0, 20, 2.0); }},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    auto want = pytorch_lrs(c.python, steps);
    if (want.empty()) GTEST_SKIP() << "no /usr/bin/python3 with torch";
    auto got = accel_lrs(c.make, steps);
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t i = 0; i < got.size(); ++i)
      EXPECT_DOUBLE_EQ(got[i], want[i]) << "after " << i << " steps";
  }
  EXPECT_EQ(accel_lrs([](auto& o) { return get_linear_schedule_with_warmup(o, 5, 30); }, 0)[0], 0.0)
      << "a warmup starts at 0, as PyTorch's LambdaLR applies lambda(0) at construction";
}

TEST(Schedulers, OneLambdaPerGroupAndBadArgumentsAreConfigErrors) {
  auto a = torch::zeros({1}, torch::requires_grad());
  auto b = torch::zeros({1}, torch::requires_grad());
  torch::optim::SGD opt(
      {torch::optim::OptimizerParamGroup({a}), torch::optim::OptimizerParamGroup({b})},
      torch::optim::SGDOptions(1.0));
  LambdaLR sched(opt, std::vector<LambdaLR::Lambda>{[](int64_t s) { return 0.5 * s; },
                                                    [](int64_t) { return 2.0; }});
  sched.step();
  EXPECT_DOUBLE_EQ(opt.param_groups()[0].options().get_lr(), 0.5);
  EXPECT_DOUBLE_EQ(opt.param_groups()[1].options().get_lr(), 2.0);
  EXPECT_EQ(sched.last_step(), 1);
  EXPECT_THROW(LambdaLR(opt, std::vector<LambdaLR::Lambda>{[](int64_t) { return 1.0; }}),
               ConfigError);
  EXPECT_THROW(get_linear_schedule_with_warmup(opt, -1, 10), ConfigError);
}

// Prepared and checkpointed like any scheduler: a run saved after 6 steps and loaded into a fresh
// model, optimizer and schedule continues at the same learning rate as the run that went on.
TEST(Schedulers, AWarmupScheduleResumesAtItsStep) {
  testing::TempDir tmp;
  auto run = [&](bool save, bool load) {
    Accelerator acc;
    torch::manual_seed(1);
    auto model = torch::nn::Linear(3, 1);
    auto opt = std::make_shared<torch::optim::AdamW>(model->parameters(),
                                                     torch::optim::AdamWOptions(0.01));
    auto sched = get_linear_schedule_with_warmup(opt, 4, 20);
    auto [m, o, s] = acc.prepare(model, opt, sched);
    if (load) acc.load_state(tmp.path() / "ck");
    auto x = torch::randn({8, 3});
    for (int i = load ? 6 : 0; i < 10; ++i) {
      acc.backward(m(x).sum());
      o.step();
      s.step();
      o.zero_grad();
      if (save && i == 5) acc.save_state(tmp.path() / "ck");
    }
    return opt->param_groups()[0].options().get_lr();
  };
  const double straight = run(true, false);
  EXPECT_DOUBLE_EQ(straight, 0.01 * (20.0 - 10.0) / (20.0 - 4.0));
  EXPECT_DOUBLE_EQ(run(false, true), straight);
}

}  // namespace
}  // namespace accel

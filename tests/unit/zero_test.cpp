// ZeRO stage 1's optimizer on one process (its slices are then whole parameters): the same bits
// as the fused step, libtorch's state objects out of gather_state and back in through
// adopt_state, and the optimizers it refuses. The sharding across processes is tested in
// tests/integration (2 and 3 processes, bitwise against the unsharded run).
#include "runtime/zero.h"

#include <gtest/gtest.h>
#include <malloc.h>
#include <torch/torch.h>

#include <functional>
#include <sstream>

#include "accel/error.h"
#include "runtime/fused_optimizer.h"
#include "runtime/optimizer_steps.h"

namespace accel {
namespace {

namespace o = torch::optim;

// One parameter larger than the all-gather's piece (2^20 elements), so a step all-gathers in
// several pieces even on one process.
std::vector<torch::Tensor> make_params(uint64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({1100, 1000}).requires_grad_(true), torch::randn({30}).requires_grad_(true),
          torch::randn({0}).requires_grad_(true), torch::randn({7}).requires_grad_(true)};
}

void set_grads(std::vector<torch::Tensor>& params, int step) {
  torch::manual_seed(500 + step);
  for (std::size_t i = 0; i + 1 < params.size(); ++i)  // the last gets none
    params[i].mutable_grad() = torch::randn(params[i].sizes());
}

using Make = std::function<std::shared_ptr<o::Optimizer>(std::vector<torch::Tensor>)>;

TEST(Zero, StepsAsTheFusedStepAndRoundTripsLibtorchsState) {
  std::vector<std::pair<std::string, Make>> kinds = {
      {"AdamW",
       [](auto p) {
         return std::make_shared<o::AdamW>(p, o::AdamWOptions(1e-2).weight_decay(0.1));
       }},
      {"Adam",
       [](auto p) {
         return std::make_shared<o::Adam>(p, o::AdamOptions(1e-2).weight_decay(0.01));
       }},
      {"SGD", [](auto p) { return std::make_shared<o::SGD>(p, o::SGDOptions(0.1).momentum(0.9)); }},
  };
  for (const auto& [name, make] : kinds) {
    SCOPED_TRACE(name);
    auto fused_params = make_params(1), zero_params = make_params(1);
    auto fused = make(fused_params);
    auto sharded = make(zero_params);
    detail::ZeroOptimizer zero(*sharded, State::shared({}));  // one process
    for (int step = 0; step < 5; ++step) {
      set_grads(fused_params, step);
      set_grads(zero_params, step);
      ASSERT_TRUE(detail::fused_step(*fused));
      zero.step();
    }
    for (std::size_t i = 0; i < fused_params.size(); ++i)
      EXPECT_TRUE(torch::equal(fused_params[i], zero_params[i])) << "parameter " << i;
    EXPECT_TRUE(sharded->state().empty()) << "the state lives in the shards";
    EXPECT_GT(zero.state_bytes(), 0);

    // gather_state: libtorch's objects, equal to the fused optimizer's; saved as libtorch saves.
    zero.gather_state(true);
    ASSERT_EQ(sharded->state().size(), fused->state().size());
    std::ostringstream a, b;
    torch::save(*sharded, a);
    torch::save(*fused, b);
    zero.clear_installed();
    EXPECT_TRUE(sharded->state().empty());

    // Loaded back (here: the fused optimizer's bytes) and adopted, training goes on identically.
    std::istringstream in(b.str());
    torch::load(*sharded, in);
    zero.check_loaded("test");
    zero.adopt_state();
    EXPECT_TRUE(sharded->state().empty());
    for (int step = 5; step < 8; ++step) {
      set_grads(fused_params, step);
      set_grads(zero_params, step);
      ASSERT_TRUE(detail::fused_step(*fused));
      zero.step();
    }
    for (std::size_t i = 0; i < fused_params.size(); ++i)
      EXPECT_TRUE(torch::equal(fused_params[i], zero_params[i]))
          << "parameter " << i << " after the load";
  }
}

TEST(Zero, ALoadedStateThatDoesNotFitIsACheckpointErrorAndChangesNothing) {
  auto params = make_params(2);
  auto opt = std::make_shared<o::AdamW>(params, o::AdamWOptions(1e-2));
  detail::ZeroOptimizer zero(*opt, State::shared({}));
  set_grads(params, 0);
  zero.step();
  // The shards' contents, through libtorch's objects.
  auto contents = [&] {
    zero.gather_state(true);
    std::vector<torch::Tensor> out;
    for (const auto& p : params) {
      auto it = opt->state().find(detail::state_key(p));
      if (it == opt->state().end()) continue;
      const auto& s = static_cast<const o::AdamWParamState&>(*it->second);
      out.push_back(s.exp_avg().clone());
      out.push_back(s.exp_avg_sq().clone());
    }
    zero.clear_installed();
    return out;
  };
  auto before = contents();
  auto state = std::make_unique<o::AdamWParamState>();
  state->step(3).exp_avg(torch::zeros({5})).exp_avg_sq(torch::zeros({5}));
  opt->state()[detail::state_key(params[0])] = std::move(state);
  try {
    zero.check_loaded("ck/optimizer.bin");
    ADD_FAILURE() << "no CheckpointError";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("ck/optimizer.bin: the state of parameter 0 is Float [5]"),
              std::string::npos)
        << e.what();
  }
  opt->state().clear();
  auto after = contents();
  ASSERT_EQ(after.size(), before.size());
  for (std::size_t i = 0; i < before.size(); ++i)
    EXPECT_TRUE(torch::equal(after[i], before[i])) << i;
}

TEST(Zero, RefusesWhatItCannotShardNamingWhy) {
  auto expect_refused = [&](o::Optimizer& opt, const std::string& part) {
    try {
      detail::ZeroOptimizer zero(opt, State::shared({}));
      ADD_FAILURE() << "no UsageError for " << part;
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  auto params = make_params(3);
  o::Adagrad adagrad(params, o::AdagradOptions(0.1));
  expect_refused(adagrad, "it shards torch::optim::Adam, AdamW and SGD");
  o::AdamW ams(params, o::AdamWOptions(0.1).amsgrad(true));
  expect_refused(ams, "amsgrad");
  std::vector<torch::Tensor> mixed{torch::randn({3}).requires_grad_(true),
                                   torch::randn({3}, torch::kDouble).requires_grad_(true)};
  o::SGD sgd(mixed, o::SGDOptions(0.1));
  expect_refused(sgd, "its parameters mix Float and Double");
}

// What changes after prepare() is refused at the next step, before any slice is updated.
TEST(Zero, AChangedOptimizerIsRefusedAtTheStepBeforeAnythingMoves) {
  auto params = make_params(4);
  auto opt = std::make_shared<o::AdamW>(params, o::AdamWOptions(1e-2));
  detail::ZeroOptimizer zero(*opt, State::shared({}));
  set_grads(params, 0);
  zero.step();
  auto expect_refused = [&](const std::string& part) {
    std::vector<torch::Tensor> before;
    for (const auto& p : params) before.push_back(p.detach().clone());
    try {
      zero.step();
      ADD_FAILURE() << "no UsageError for " << part;
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
    for (std::size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i], before[i]));
  };
  params[1].mutable_grad() = torch::randn({31});
  expect_refused("the gradient of parameter 1 is Float [31]");
  params[1].mutable_grad() = torch::randn({30});
  opt->state()[detail::state_key(params[0])] = std::make_unique<o::AdamWParamState>();
  expect_refused("stepped through its original handle");
  opt->state().clear();
  opt->add_param_group(o::OptimizerParamGroup({torch::randn({3}).requires_grad_(true)}));
  expect_refused("the optimizer has 5 parameters now, 4 when it was prepared");
}

// The state is made when the optimizer is prepared, for the parameters that require a gradient
// only, in a block mapped apart from malloc's heap: the steps and a load take nothing from the
// heap for it, where slices made at the first step among the step's freed temporaries grew the
// heap past the unsharded run's. A parameter unfrozen later gets a block at its first step.
TEST(Zero, TheStateIsMadeAtPrepareOutsideTheHeapForTrainableParametersOnly) {
  torch::manual_seed(3);
  std::vector<torch::Tensor> params = {torch::randn({1100, 1000}).requires_grad_(true),
                                       torch::randn({300, 1000}),  // frozen
                                       torch::randn({30}).requires_grad_(true)};
  auto heap_in_use = [] {
    const struct mallinfo2 m = mallinfo2();
    return static_cast<int64_t>(m.uordblks + m.hblkhd);
  };
  const int64_t trainable_bytes = (1100 * 1000 + 30) * 4, frozen_bytes = 300 * 1000 * 4;
  auto grads = [&](int step) {
    torch::manual_seed(900 + step);
    for (auto& p : params)
      if (p.requires_grad()) p.mutable_grad() = torch::randn(p.sizes());
  };
  grads(0);  // made before the baselines: only the optimizer's own memory is measured
  {
    // Why: the first torch::load in a process makes caches of libtorch's own (1.6 MB seen in a
    // process running this test alone), which the load below must not be charged with.
    auto p = torch::zeros({4}).requires_grad_(true);
    p.mutable_grad() = torch::ones({4});
    o::AdamW warm({p});
    warm.step();
    std::ostringstream out;
    torch::save(warm, out);
    std::istringstream in(out.str());
    torch::load(warm, in);
  }
  const int64_t mapped_at_start = detail::ZeroOptimizer::mapped_bytes();
  {
    auto opt = std::make_shared<o::AdamW>(params, o::AdamWOptions(1e-2));
    detail::ZeroOptimizer zero(*opt, State::shared({}));
    EXPECT_EQ(zero.state_bytes(), 2 * trainable_bytes) << "exp_avg and exp_avg_sq, before a step";
    EXPECT_EQ(detail::ZeroOptimizer::mapped_bytes() - mapped_at_start, 2 * trainable_bytes);
    const int64_t before = heap_in_use();  // with the all-gather's buffers, made at prepare too
    for (int step = 0; step < 3; ++step) {
      grads(step);
      zero.step();
    }
    EXPECT_EQ(zero.state_bytes(), 2 * trainable_bytes);
    EXPECT_LT(heap_in_use() - before, trainable_bytes / 4) << "the steps made state on the heap";

    // A loaded state goes into the same block.
    zero.gather_state(true);
    std::ostringstream saved;
    torch::save(*opt, saved);
    zero.clear_installed();
    std::istringstream in(saved.str());
    const int64_t unloaded = heap_in_use();
    torch::load(*opt, in);  // the whole state, on the heap until adopt_state() lets it go
    zero.check_loaded("test");
    zero.adopt_state();
    EXPECT_EQ(zero.state_bytes(), 2 * trainable_bytes);
    EXPECT_LT(heap_in_use() - unloaded, trainable_bytes / 4) << "the load was kept on the heap";
    EXPECT_EQ(detail::ZeroOptimizer::mapped_bytes() - mapped_at_start, 2 * trainable_bytes);

    // Unfrozen after prepare(): its state gets a block of its own at its first step.
    params[1].requires_grad_(true);
    grads(3);
    zero.step();
    EXPECT_EQ(zero.state_bytes(), 2 * (trainable_bytes + frozen_bytes));
    EXPECT_EQ(detail::ZeroOptimizer::mapped_bytes() - mapped_at_start,
              2 * (trainable_bytes + frozen_bytes));
    params[1].requires_grad_(false);
    params[1].mutable_grad() = torch::Tensor();
  }
  EXPECT_EQ(detail::ZeroOptimizer::mapped_bytes(), mapped_at_start) << "blocks left mapped";

  // SGD: one part, and only where the group has momentum.
  auto sgd = std::make_shared<o::SGD>(params, o::SGDOptions(0.1).momentum(0.9));
  detail::ZeroOptimizer with_momentum(*sgd, State::shared({}));
  EXPECT_EQ(with_momentum.state_bytes(), trainable_bytes);
  auto plain_sgd = std::make_shared<o::SGD>(params, o::SGDOptions(0.1));
  detail::ZeroOptimizer plain(*plain_sgd, State::shared({}));
  EXPECT_EQ(plain.state_bytes(), 0);
}

// The values where the state block is reused: a load whose checkpoint has no state for a
// parameter leaves that parameter's slices of the block holding the earlier steps' values, and
// its next step must start them afresh; a parameter unfrozen after prepare() steps from a block
// made then. Both as the fused step (fused_optimizer.h) does from nothing.
TEST(Zero, SlicesALoadLeftOrAnUnfreezeMadeStepAsFreshState) {
  std::vector<std::pair<std::string, Make>> kinds = {
      {"AdamW",
       [](auto p) {
         return std::make_shared<o::AdamW>(p, o::AdamWOptions(1e-2).weight_decay(0.1));
       }},
      {"Adam", [](auto p) { return std::make_shared<o::Adam>(p, o::AdamOptions(1e-2)); }},
      {"SGD", [](auto p) { return std::make_shared<o::SGD>(p, o::SGDOptions(0.1).momentum(0.9)); }},
  };
  auto make = [] {
    torch::manual_seed(11);
    return std::vector<torch::Tensor>{torch::randn({1000}).requires_grad_(true),
                                      torch::randn({500}).requires_grad_(true),
                                      torch::randn({300})};  // frozen at prepare()
  };
  auto set = [](std::vector<torch::Tensor>& params, int step, std::size_t count) {
    torch::manual_seed(700 + step);
    for (std::size_t i = 0; i < count; ++i)
      params[i].mutable_grad() = torch::randn(params[i].sizes());
  };
  for (const auto& [name, make_optimizer] : kinds) {
    SCOPED_TRACE(name);
    auto zero_params = make(), fused_params = make(), source_params = make();
    auto sharded = make_optimizer(zero_params);
    detail::ZeroOptimizer zero(*sharded, State::shared({}));
    for (int step = 0; step < 3; ++step) {  // the first two parameters' slices now hold values
      set(zero_params, step, 2);
      zero.step();
    }
    zero.gather_state(true);
    ASSERT_EQ(sharded->state().size(), 2u) << "both parameters have state to leave behind";
    zero.clear_installed();
    // A checkpoint with the first parameter's state only.
    auto source = make_optimizer(source_params);
    set(source_params, 10, 1);
    ASSERT_TRUE(detail::fused_step(*source));
    ASSERT_EQ(source->state().size(), 1u);
    std::ostringstream saved;
    torch::save(*source, saved);
    auto fused = make_optimizer(fused_params);
    {
      torch::NoGradGuard no_grad;
      for (std::size_t i = 0; i < source_params.size(); ++i) {
        zero_params[i].copy_(source_params[i]);
        fused_params[i].copy_(source_params[i]);
      }
    }
    std::istringstream for_zero(saved.str()), for_fused(saved.str());
    torch::load(*sharded, for_zero);
    zero.check_loaded("test");
    zero.adopt_state();
    torch::load(*fused, for_fused);
    zero_params[2].requires_grad_(true);
    fused_params[2].requires_grad_(true);
    for (int step = 20; step < 23; ++step) {
      set(zero_params, step, 3);
      set(fused_params, step, 3);
      zero.step();
      ASSERT_TRUE(detail::fused_step(*fused));
    }
    for (std::size_t i = 0; i < zero_params.size(); ++i)
      EXPECT_TRUE(torch::equal(zero_params[i], fused_params[i])) << "parameter " << i;
  }
}

}  // namespace
}  // namespace accel

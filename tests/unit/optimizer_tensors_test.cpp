// An optimizer's state as named tensors (in-memory snapshots): for each of libtorch's own
// optimizers, a state written and read back into a fresh optimizer steps on exactly as the
// original does; files of another type, parameter count or shape are refused, the state kept.
#include "runtime/optimizer_tensors.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>

#include "accel/error.h"

namespace accel::ckpt {
namespace {

namespace o = torch::optim;

using MakeOptimizer =
    std::function<std::unique_ptr<o::Optimizer>(const std::vector<torch::Tensor>&)>;

struct Model {
  torch::nn::Linear a{torch::nn::LinearOptions(4, 3)};
  torch::nn::Linear b{torch::nn::LinearOptions(3, 2)};
  Model() {
    torch::NoGradGuard no_grad;
    for (auto& p : params()) p.copy_(torch::linspace(-1, 1, p.numel()).reshape(p.sizes()));
  }
  std::vector<torch::Tensor> params() {
    auto out = a->parameters();
    for (auto& p : b->parameters()) out.push_back(p);
    return out;
  }
  void step(o::Optimizer& opt, int i) {
    opt.zero_grad();
    auto x = torch::full({5, 4}, 0.1 * (i + 1));
    b(torch::relu(a(x))).pow(2).sum().backward();
    opt.step();
  }
};

safetensors::Decoded round_trip(o::Optimizer& opt) {
  std::map<std::string, std::string> metadata;
  auto tensors = optimizer_tensors(opt, metadata);
  auto encoded = safetensors::encode(tensors, metadata, "test");
  std::string bytes;
  for (auto part : encoded.parts()) bytes.append(part);
  return safetensors::decode(bytes, "test");
}

TEST(OptimizerTensors, EachOfLibtorchsOptimizersStepsOnBitwiseAfterARoundTrip) {
  const std::vector<std::pair<std::string, MakeOptimizer>> kinds = {
      {"Adam", [](auto p) { return std::make_unique<o::Adam>(p, o::AdamOptions(0.01)); }},
      {"AdamW amsgrad",
       [](auto p) { return std::make_unique<o::AdamW>(p, o::AdamWOptions(0.01).amsgrad(true)); }},
      {"SGD momentum",
       [](auto p) { return std::make_unique<o::SGD>(p, o::SGDOptions(0.1).momentum(0.9)); }},
      {"Adagrad", [](auto p) { return std::make_unique<o::Adagrad>(p, o::AdagradOptions(0.1)); }},
      {"RMSprop centered",
       [](auto p) {
         return std::make_unique<o::RMSprop>(p,
                                             o::RMSpropOptions(0.01).momentum(0.5).centered(true));
       }},
  };
  for (const auto& [name, make] : kinds) {
    Model original, restored;
    auto opt = make(original.params());
    for (int i = 0; i < 3; ++i) original.step(*opt, i);
    ASSERT_TRUE(has_tensor_state(*opt)) << name;
    auto decoded = round_trip(*opt);
    {  // the restored model starts from the original's weights, its optimizer from the file
      torch::NoGradGuard no_grad;
      auto from = original.params(), to = restored.params();
      for (std::size_t k = 0; k < from.size(); ++k) to[k].copy_(from[k]);
    }
    auto fresh = make(restored.params());
    load_optimizer_tensors(*fresh, decoded, "test", torch::kCPU);
    for (int i = 3; i < 6; ++i) {
      original.step(*opt, i);
      restored.step(*fresh, i);
    }
    auto a = original.params(), b = restored.params();
    for (std::size_t k = 0; k < a.size(); ++k)
      EXPECT_TRUE(torch::equal(a[k], b[k])) << name << ": parameter " << k << " differs";
  }
}

TEST(OptimizerTensors, AnotherTypeCountOrShapeIsRefusedAndTheStateKept) {
  Model m;
  o::AdamW adamw(m.params(), o::AdamWOptions(0.01));
  m.step(adamw, 0);
  auto decoded = round_trip(adamw);
  auto expect_refused = [](o::Optimizer& opt, const safetensors::Decoded& d,
                           const std::string& says) {
    const auto before = opt.state().size();
    try {
      load_optimizer_tensors(opt, d, "snap/optimizer.safetensors", torch::kCPU);
      ADD_FAILURE() << "loaded; expected: " << says;
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("snap/optimizer.safetensors"), std::string::npos);
    }
    EXPECT_EQ(opt.state().size(), before) << "the state changed on a refused load";
  };
  Model other;
  o::SGD sgd(other.params(), o::SGDOptions(0.1));
  expect_refused(sgd, decoded, "holds the state of a torch::optim::AdamW, not of this optimizer");
  o::AdamW fewer(std::vector<torch::Tensor>{m.params()[0]}, o::AdamWOptions(0.01));
  expect_refused(fewer, decoded, "is for 4 parameters, this optimizer has 1");
  auto reshaped = decoded;
  for (auto& [name, t] : reshaped.tensors) {
    if (name == "0.exp_avg") t = torch::zeros({2, 2});
  }
  o::AdamW same(m.params(), o::AdamWOptions(0.01));
  m.step(same, 0);
  expect_refused(same, reshaped, "has 0.exp_avg of shape [2, 2]");
}

}  // namespace
}  // namespace accel::ckpt

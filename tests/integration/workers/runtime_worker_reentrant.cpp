// runtime_worker reentrant: a parameter whose gradient is accumulated a second time in one
// backward, by a backward run inside it (as reentrant activation checkpointing does), after its
// bucket's all-reduce has begun. That second gradient would be added into a buffer other ranks
// are summing (a race) or into the average (a wrong step), so backward must refuse it, on every
// rank, naming the parameter, and leave the run able to go on.
#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <vector>

#include "accel/accel.h"
#include "tests/integration/workers/runtime_worker.h"

namespace runtime_worker {

namespace {

// Holds fc2's weight outside autograd's inputs, so that the outer graph has no edge to it: the
// weight is reached only through the backward this Function's backward runs (what reentrant
// checkpointing does with the parameters of the segment it recomputes).
struct Weight {
  torch::Tensor w;
};

// forward: h @ w^T without a graph; backward: recomputes it with one and runs backward on it.
struct ReentrantUse : torch::autograd::Function<ReentrantUse> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& h,
                               Weight weight) {
    ctx->save_for_backward({h});
    ctx->saved_data["w"] = weight.w;
    torch::NoGradGuard no_grad;
    return h.matmul(weight.w.t());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto h = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    auto w = ctx->saved_data["w"].toTensor();
    torch::AutoGradMode grad_on(true);
    torch::autograd::backward({h.matmul(w.t())}, {grads[0]});
    return {h.grad(), torch::Tensor()};
  }
};

}  // namespace

// The largest difference between the prepared model's gradients and `expected` (one per
// parameter; undefined where no rank had a gradient).
double worst_difference(torch::nn::Module& model, const std::vector<torch::Tensor>& expected) {
  auto params = model.parameters();
  double worst = 0;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (expected[i].defined())
      worst = std::max(worst, (params[i].grad() - expected[i]).abs().max().item<double>());
  }
  return worst;
}

int reentrant(bool launched, bool plain) {
  accel::AcceleratorOptions options;
  // "launched": fc2's weight and bias in the first bucket, launched before the inner backward
  // adds to the weight. Otherwise all in one bucket, which unused_head (no gradient) holds until
  // backward ends.
  if (launched) options.bucket_cap_bytes = 64;
  accel::Accelerator acc(options);
  auto [m, o] = prepare_small_sgd(acc);
  const auto x = torch::randn({4, 6}), y = torch::randn({4, 2});
  // A plain synced backward first: from then on each .grad is a view of its bucket.
  acc.backward(torch::mse_loss(m->forward(x), y));
  o.zero_grad();
  // Why the Function's node is made before fc2's: backward runs the later node first, so fc2's
  // weight gets its gradient (and its bucket is launched) before the inner backward adds more.
  // `inner` false: the same loss with the Function's value as a constant (no second gradient).
  auto loss_of = [&](bool inner) {
    auto h = torch::tanh(m->fc1->forward(x));
    auto again = inner ? ReentrantUse::apply(h, Weight{m->fc2->weight})
                       : h.detach().matmul(m->fc2->weight.detach().t());
    return torch::mse_loss(m->fc2->forward(h) + again, y);
  };
  // What a synced backward must give: each rank's own gradients, averaged by hand; with and
  // without the inner backward's.
  auto averaged_by_hand = [&](bool inner) {
    {
      auto scope = acc.no_sync(m);
      acc.backward(loss_of(inner));
    }
    std::vector<torch::Tensor> out;
    for (auto& p : m->parameters())
      out.push_back(p.grad().defined() ? acc.reduce(p.grad(), accel::ReduceOp::kMean)
                                       : torch::Tensor());
    o.zero_grad();
    return out;
  };
  const auto expected = averaged_by_hand(true), outer_only = averaged_by_hand(false);
  REQUIRE((expected[4] - outer_only[4]).abs().max().item<double>() > 1e-3,
          "the inner backward adds nothing to fc2's weight: the checks below could not tell");
  std::string refused;
  // `plain`: a bare loss.backward(), as a program ported from HF Accelerate may call it.
  try {
    if (plain) {
      loss_of(true).backward();
    } else {
      acc.backward(loss_of(true));
    }
  } catch (const accel::UsageError& e) {
    refused = e.what();
  }
  if (!launched) {
    REQUIRE(refused.empty(),
            "refused a second gradient before its bucket was launched: " + refused);
    const double worst = worst_difference(*m, expected);
    REQUIRE(worst < 1e-6,
            "a second gradient before its bucket was launched: the gradients "
            "differ from the average of the ranks' own by " +
                std::to_string(worst));
    acc.print("OK reentrant accepted before the launch, gradients averaged");
    return 0;
  }
  REQUIRE(!refused.empty(),
          "a second gradient into a launched bucket was accepted; the gradients "
          "differ from the average of the ranks' own by up to " +
              std::to_string(worst_difference(*m, expected)));
  std::printf("rank %d refused: %s\n", acc.process_index(), refused.c_str());
  // Refused before it was added: fc2's weight holds the average of the outer backward's alone.
  {
    auto fc2 = m->fc2->weight.grad(), want = outer_only[4];
    REQUIRE(fc2.defined() && (fc2 - want).abs().max().item<double>() < 1e-6,
            "the refused gradient was added into fc2's weight");
  }
  // The run goes on: the failed backward's buckets were drained, and a plain step syncs.
  o.zero_grad();
  acc.backward(torch::mse_loss(m->forward(x), y));
  o.step();
  same_weights_everywhere(acc, *m, "ranks disagree on the weights after a step");
  acc.print("OK reentrant refused on every rank, and the next step synced");
  return 0;
}

}  // namespace runtime_worker

// bench_train: steps/s of model T (10->64->1, batch 8) or model M (784->2048->2048->10, batch 64),
// AdamW, on libaccel; run under accel-launch -n 1|2. The same loop as ddp_bench.py: a fixed set of
// pre-generated batches, forward, loss, accelerator.backward, step, zero_grad. The forward pass
// and loss run under acc.autocast(), so ACCEL_MIXED_PRECISION=bf16 times bf16 (a no-op scope at
// the default "no"). Rank 0 prints one JSON line.
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>

#include "accel/accel.h"
#include "examples/common/args.h"

int main(int argc, char** argv) {
  accel::examples::Args args("bench_train", "Times training steps of model T or M on libaccel.");
  args.flag("model", "T", "T (10->64->1, batch 8) or M (784->2048->2048->10, batch 64)")
      .flag("steps", "2000", "timed steps")
      .flag("warmup", "100", "untimed steps first")
      .flag("optimizer-step", "fused",
            "fused (the prepared optimizer's one-pass step) or libtorch (AdamW::step)")
      .flag("zero-stage", "0", "1: ZeRO stage 1 (the optimizer state sharded across processes)");
  args.parse(argc, argv);
  const bool big = args.str("model") == "M";
  if (!big && args.str("model") != "T") {
    std::fprintf(stderr, "bench_train: --model must be T or M\n");
    return 2;
  }
  torch::manual_seed(0);
  accel::AcceleratorOptions options;
  options.fused_optimizer = args.str("optimizer-step") == "fused";
  options.zero_stage = static_cast<int>(args.integer("zero-stage"));
  accel::Accelerator acc(options);
  const int64_t in = big ? 784 : 10, hidden = big ? 2048 : 64, out = big ? 10 : 1,
                batch = big ? 64 : 8;
  torch::nn::Sequential model =
      big ? torch::nn::Sequential(torch::nn::Linear(in, hidden), torch::nn::ReLU(),
                                  torch::nn::Linear(hidden, hidden), torch::nn::ReLU(),
                                  torch::nn::Linear(hidden, out))
          : torch::nn::Sequential(torch::nn::Linear(in, hidden), torch::nn::ReLU(),
                                  torch::nn::Linear(hidden, out));
  auto opt =
      std::make_shared<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-3));
  auto [m, o] = acc.prepare(model, opt);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;
  for (int i = 0; i < 16; ++i) {
    auto x = torch::randn({batch, in});
    auto y = big ? torch::randint(out, {batch}, torch::kLong) : torch::randn({batch, 1});
    batches.emplace_back(x, y);
  }
  torch::ScalarType forward_dtype = torch::kFloat;
  auto step = [&](int64_t i) {
    auto& [x, y] = batches[static_cast<std::size_t>(i % 16)];
    torch::Tensor loss;
    {
      auto cast = acc.autocast();
      auto pred = m->forward(x);
      forward_dtype = pred.scalar_type();
      loss = big ? torch::cross_entropy_loss(pred, y) : torch::mse_loss(pred, y);
    }
    acc.backward(loss);
    o.step();
    o.zero_grad();
  };
  for (int64_t i = 0; i < args.integer("warmup"); ++i) step(i);
  acc.wait_for_everyone();
  const int64_t steps = args.integer("steps");
  auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < steps; ++i) step(i);
  acc.wait_for_everyone();
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // This process's peak resident memory (VmHWM), in bytes; ranks' peaks differ little.
  long peak_kb = 0;
  {
    std::ifstream status("/proc/self/status");
    for (std::string line; std::getline(status, line);)
      if (line.rfind("VmHWM:", 0) == 0) peak_kb = std::stol(line.substr(6));
  }
  if (acc.is_main_process()) {
    double sps = static_cast<double>(steps) / seconds;
    std::printf(
        "{\"steps_per_s\": %.2f, \"samples_per_s\": %.1f, \"processes\": %d, \"mixed_precision\": "
        "\"%s\", "
        "\"forward_dtype\": \"%s\", \"optimizer_step\": \"%s\", \"zero_stage\": %ld, "
        "\"peak_rss_bytes\": %ld}\n",
        sps, sps * static_cast<double>(batch) * acc.num_processes(), acc.num_processes(),
        acc.mixed_precision().c_str(), c10::toString(forward_dtype),
        args.str("optimizer-step").c_str(), args.integer("zero-stage"), peak_kb * 1024);
  }
  return 0;
}

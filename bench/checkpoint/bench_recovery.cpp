// bench_recovery: a training job to kill. Model M (784->2048->2048->10, AdamW, batch 64 per
// process) or a wider one of about --state-mb MB of parameters and AdamW state, on a prepared
// DataLoader of synthetic data (so automatic resume puts it back at the exact batch), for --steps
// optimizer steps. Rank 0 prints "STEP <n> <unix ms>" after each step and, at the end, a JSON line
// with the steps/s of the steps after the first --warmup (of this attempt) and the final weights'
// checksum. bench_recovery.py runs it under accel-launch, kills a worker, and reads the lines.
#include <sys/time.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>

#include "accel/accel.h"
#include "examples/common/args.h"

namespace {

int64_t unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

int main(int argc, char** argv) {
  accel::examples::Args args("bench_recovery", "A model M training job to kill and resume.");
  args.flag("steps", "300", "optimizer steps in all")
      .flag("warmup", "5", "steps of each attempt left out of its steps/s")
      .flag("state-mb", "0",
            "0: model M; else a 784->H->H->10 model whose parameters and AdamW state take about "
            "this many MB");
  args.parse(argc, argv);
  accel::Accelerator acc;
  accel::set_seed(0);
  int64_t hidden = 2048;
  if (const double mb = static_cast<double>(args.integer("state-mb")); mb > 0) {
    // parameters ~ H^2 + 794 H; parameters and AdamW's two moments: 12 bytes each.
    const double params = mb * 1e6 / 12.0;
    hidden = static_cast<int64_t>((-794.0 + std::sqrt(794.0 * 794.0 + 4.0 * params)) / 2.0);
  }
  torch::nn::Sequential model(torch::nn::Linear(784, hidden), torch::nn::ReLU(),
                              torch::nn::Linear(hidden, hidden), torch::nn::ReLU(),
                              torch::nn::Linear(hidden, 10));
  auto opt =
      std::make_shared<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-4));
  const int64_t steps = args.integer("steps");
  const int64_t batch = 64;
  // 16 batches per process and epoch; as many epochs as the steps need.
  const int64_t samples = batch * 16 * acc.num_processes();
  auto x = torch::randn({samples, 784});
  auto y = torch::randint(10, {samples}, torch::kLong);
  accel::DataLoader loader(std::make_shared<accel::TensorDataset>(x, y),
                           {.batch_size = static_cast<std::size_t>(batch), .shuffle = true});
  auto [m, o, dl] = acc.prepare(model.ptr(), opt, loader);
  int64_t done = 0, timed = 0;
  std::chrono::steady_clock::time_point start;
  (void)dl.epoch();  // where an automatic resume happens: before the first step counted here
  while (acc.completed_steps() < steps) {
    for (auto& b : dl) {
      auto loss = torch::cross_entropy_loss(m(b.input), b.target);
      acc.backward(loss);
      o.step();
      o.zero_grad();
      ++done;
      if (done == args.integer("warmup")) start = std::chrono::steady_clock::now();
      if (done > args.integer("warmup")) ++timed;
      if (acc.is_main_process()) {
        std::printf("STEP %lld %lld\n", static_cast<long long>(acc.completed_steps()),
                    static_cast<long long>(unix_ms()));
        std::fflush(stdout);
      }
      if (acc.completed_steps() >= steps) break;
    }
  }
  acc.wait_for_everyone();
  const double seconds =
      timed > 0 ? std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()
                : 0.0;
  double sum = 0;
  for (const auto& p : model->parameters()) sum += p.to(torch::kDouble).sum().item<double>();
  if (acc.is_main_process()) {
    std::printf(
        "{\"steps_per_s\": %.3f, \"timed_steps\": %lld, \"hidden\": %lld, "
        "\"state_bytes\": %lld, \"weights_sum\": %.17g}\n",
        timed > 0 ? static_cast<double>(timed) / seconds : 0.0, static_cast<long long>(timed),
        static_cast<long long>(hidden),
        static_cast<long long>(12 * (hidden * hidden + 794 * hidden + 10 * hidden + 10)), sum);
  }
  acc.end_training();
  return 0;
}

// train_mlp: the regression MLP (10 -> 64 -> 1, AdamW, MSE, batch 8) on a seeded synthetic data
// set. The same program runs on 1 or N processes; the main process prints each epoch's loss.
#include <torch/torch.h>

#include <chrono>

#include "accel/accel.h"
#include "examples/common/args.h"

namespace {

struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(10, 64))),
        fc2(register_module("fc2", torch::nn::Linear(64, 1))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return fc2->forward(torch::relu(fc1->forward(x)));
  }
  torch::nn::Linear fc1, fc2;
};

}  // namespace

namespace {

int run_training(int argc, char** argv) {
  accel::examples::Args args(
      "train_mlp", "Trains a 10->64->1 MLP regressor on y = x.w + noise (seeded), with AdamW.");
  args.flag("epochs", "2", "passes over the data set")
      .flag("batch-size", "8", "batch size per process")
      .flag("samples", "4096", "size of the synthetic data set")
      .flag("lr", "0.001", "AdamW learning rate")
      .flag("seed", "0", "seed for the data, the initial weights and the shuffle order")
      .flag("log-every", "64",
            "print the main process's running loss every this many steps (0: never)");
  args.parse(argc, argv);
  const int64_t epochs = args.integer("epochs");
  const int64_t log_every = args.integer("log-every");

  accel::Accelerator acc;
  const auto seed = static_cast<uint64_t>(args.integer("seed"));
  torch::manual_seed(seed);
  const int64_t n = args.integer("samples");
  auto x = torch::randn({n, 10});
  auto w = torch::randn({10, 1});
  auto y = x.matmul(w) + 0.1 * torch::randn({n, 1});

  auto model = std::make_shared<MlpImpl>();
  auto opt = std::make_shared<torch::optim::AdamW>(model->parameters(),
                                                   torch::optim::AdamWOptions(args.real("lr")));
  accel::DataLoader loader(std::make_shared<accel::TensorDataset>(x, y),
                           {.batch_size = static_cast<std::size_t>(args.integer("batch-size")),
                            .shuffle = true,
                            .seed = seed});
  auto [m, o, dl] = acc.prepare(model, opt, loader);

  acc.print("train_mlp:", acc.num_processes(), "process(es),", dl.size(),
            "steps per epoch, global batch", dl.total_batch_size());
  acc.init_trackers("train_mlp");  // accel-launch --log-with ... --project-dir DIR
  // From dl.epoch(): after an automatic resume (accel-launch --checkpoint-dir) the loader is
  // already at the saved epoch and batch.
  for (int64_t epoch = dl.epoch(); epoch < epochs; ++epoch) {
    auto start = std::chrono::steady_clock::now();
    auto total = torch::zeros({}, torch::dtype(torch::kDouble).device(acc.device()));
    int64_t steps = 0;
    for (auto& batch : dl) {
      // m(x): the forward in bf16 when ACCEL_MIXED_PRECISION=bf16 (accel-launch
      // --mixed-precision), its output in float32 (as HF's model(x))
      auto loss = torch::mse_loss(m(batch.input), batch.target);
      acc.backward(loss);
      o.step();
      o.zero_grad();
      total += loss.detach().to(torch::kDouble);
      ++steps;
      if (log_every > 0 && steps % log_every == 0) {
        acc.print("  epoch", epoch, "step", std::to_string(steps) + "/" + std::to_string(dl.size()),
                  "loss", (total / steps).item<double>(), "(running mean, local rank 0)");
      }
    }
    auto mean = acc.reduce(total / std::max<int64_t>(steps, 1), accel::ReduceOp::kMean);
    double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    acc.print("epoch", epoch, "loss", mean.item<double>(), "steps", steps, "time",
              std::to_string(seconds).substr(0, 5) + "s");
    acc.log({{"loss", mean.item<double>()}, {"epoch", static_cast<double>(epoch)}});
  }
  acc.wait_for_everyone();
  // HF's end_training: the trackers' files closed, and a background save's failure raised here.
  acc.end_training();
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return accel::examples::run_example(run_training, argc, argv); }

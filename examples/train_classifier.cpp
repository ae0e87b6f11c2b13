// train_classifier: an MLP classifier on a seeded, learnable, non-linear 4-class problem,
// evaluated every epoch with gather_for_metrics so each evaluation sample counts once whatever
// the number of processes. Under `accel-launch --checkpoint-dir D --checkpoint-interval N` it
// saves every N steps and a restarted job resumes where it was (docs/checkpointing.md).
#include <torch/torch.h>

#include <cstdio>
#include <tuple>
#include <utility>

#include "accel/accel.h"
#include "examples/common/args.h"

namespace {

struct ClassifierImpl : torch::nn::Module {
  ClassifierImpl(int64_t in, int64_t hidden, int64_t classes)
      : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, hidden))),
        out(register_module("out", torch::nn::Linear(hidden, classes))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return out->forward(torch::relu(fc2->forward(torch::relu(fc1->forward(x)))));
  }
  torch::nn::Linear fc1, fc2, out;
};

// Gaussian points labelled by which side of three random hyperplanes they fall on: class =
// 2*[side of a] + ([side of b] XOR [side of c]). The XOR makes it non-linear, so a model must
// learn features; accuracy starts near chance and climbs over the epochs.
std::pair<torch::Tensor, torch::Tensor> make_data(const torch::Tensor& planes, int64_t n) {
  auto points = torch::randn({n, planes.size(1)});
  auto side = points.matmul(planes.t()).gt(0).to(torch::kLong);  // [n, 3]
  auto labels = 2 * side.select(1, 0) + side.select(1, 1).bitwise_xor(side.select(1, 2));
  return {points, labels};
}

constexpr int64_t kClasses = 4;

}  // namespace

namespace {

int run_training(int argc, char** argv) {
  accel::examples::Args args(
      "train_classifier",
      "Trains an MLP classifier on a seeded non-linear 4-class problem and reports the evaluation "
      "accuracy over exactly --eval-samples samples (gather_for_metrics).");
  args.flag("epochs", "6", "passes over the training set")
      .flag("batch-size", "32", "batch size per process")
      .flag("features", "16", "input features")
      .flag("train-samples", "4000", "training set size")
      .flag("eval-samples", "1001",
            "evaluation set size (not a multiple of the global batch on purpose)")
      .flag("lr", "0.003", "AdamW learning rate")
      .flag("seed", "0", "seed for the data, weights and shuffle order")
      .flag("require-accuracy", "0", "exit 1 unless the final accuracy reaches this (0..1)")
      .flag("save-model", "", "write the trained model to this folder (safetensors)")
      .flag("load-model", "",
            "start from the weights in this save-model folder (--epochs 0: only evaluate them)");
  args.parse(argc, argv);
  const int64_t epochs = args.integer("epochs");

  accel::Accelerator acc;
  const auto seed = static_cast<uint64_t>(args.integer("seed"));
  accel::set_seed(seed);  // the weights, the data and (below) the training loader's shuffle
  auto planes = torch::randn({3, args.integer("features")});
  auto [train_x, train_y] = make_data(planes, args.integer("train-samples"));
  auto [eval_x, eval_y] = make_data(planes, args.integer("eval-samples"));

  auto model = std::make_shared<ClassifierImpl>(args.integer("features"), 64, kClasses);
  if (!args.str("load-model").empty()) {
    accel::load_model(model, args.str("load-model"));  // strict: every name must match
    acc.print("loaded the weights of", args.str("load-model"));
  }
  auto opt = std::make_shared<torch::optim::AdamW>(model->parameters(),
                                                   torch::optim::AdamWOptions(args.real("lr")));
  const auto bs = static_cast<std::size_t>(args.integer("batch-size"));
  accel::DataLoader train(std::make_shared<accel::TensorDataset>(train_x, train_y),
                          {.batch_size = bs, .shuffle = true});
  accel::DataLoader eval(std::make_shared<accel::TensorDataset>(eval_x, eval_y),
                         {.batch_size = bs});
  auto [m, o, train_dl, eval_dl] = acc.prepare(model, opt, train, eval);
  // accel-launch --log-with jsonl --project-dir DIR: every step's loss and each epoch's metrics
  // go to DIR/train_classifier/ (without --log-with this does nothing).
  acc.init_trackers("train_classifier", {{"lr", args.real("lr")},
                                         {"batch_size", static_cast<int64_t>(bs)},
                                         {"processes", static_cast<int64_t>(acc.num_processes())}});

  // Accuracy over exactly the evaluation set, and its size, whatever the number of processes.
  auto evaluate = [&, &m = m, &eval_dl = eval_dl] {
    m->eval();
    torch::NoGradGuard no_grad;
    int64_t correct = 0, seen = 0;
    for (auto& batch : eval_dl) {
      auto predictions = m(batch.input).argmax(1);
      auto all_predictions = acc.gather_for_metrics(predictions);
      auto all_labels = acc.gather_for_metrics(batch.target);
      correct += all_predictions.eq(all_labels).sum().item<int64_t>();
      seen += all_labels.size(0);
    }
    double accuracy =
        static_cast<double>(correct) / static_cast<double>(std::max<int64_t>(seen, 1));
    return std::make_pair(accuracy, seen);
  };
  double accuracy = 0;
  if (epochs == 0) {
    int64_t seen = 0;
    std::tie(accuracy, seen) = evaluate();
    char line[120];
    std::snprintf(line, sizeof line,
                  "no training (--epochs 0): eval_accuracy %.4f eval_samples %lld", accuracy,
                  static_cast<long long>(seen));
    acc.print(line);
  }
  // Why train_dl.epoch(): after an automatic resume the loader is already at the saved epoch.
  for (int64_t epoch = train_dl.epoch(); epoch < epochs; ++epoch) {
    m->train();
    auto total = torch::zeros({}, torch::dtype(torch::kDouble).device(acc.device()));
    int64_t steps = 0;
    for (auto& batch : train_dl) {
      // m(x): the forward under autocast with --mixed-precision bf16, float32 logits (as HF).
      auto loss = torch::cross_entropy_loss(m(batch.input), batch.target);
      acc.backward(loss);
      o.step();
      o.zero_grad();
      total += loss.detach().to(torch::kDouble);
      ++steps;
      acc.log({{"loss", loss.item<double>()}});  // the main process's batch
    }
    int64_t seen = 0;
    std::tie(accuracy, seen) = evaluate();
    auto loss =
        acc.reduce(total / std::max<int64_t>(steps, 1), accel::ReduceOp::kMean).item<double>();
    char line[160];
    std::snprintf(line, sizeof line,
                  "epoch %lld train_loss %.4f eval_accuracy %.4f eval_samples %lld",
                  static_cast<long long>(epoch), loss, accuracy, static_cast<long long>(seen));
    acc.print(line);
    acc.log(
        {{"train_loss", loss}, {"eval_accuracy", accuracy}, {"epoch", static_cast<double>(epoch)}});
  }
  acc.wait_for_everyone();
  // HF's idiom; save_model is not a collective, so the other ranks need not call it.
  if (!args.str("save-model").empty() && acc.is_main_process()) {
    acc.save_model(m, args.str("save-model"));
  }
  // HF's end_training: the trackers' files closed, and a background save's failure raised here.
  acc.end_training();
  if (accuracy < args.real("require-accuracy")) {
    acc.print("accuracy", accuracy, "is below --require-accuracy", args.real("require-accuracy"));
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return accel::examples::run_example(run_training, argc, argv); }

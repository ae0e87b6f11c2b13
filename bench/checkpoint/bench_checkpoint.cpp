// bench_checkpoint: times Accelerator::save_state / load_state on a model of --mb MB with AdamW
// state (io), training steps of model M under autocast with mixed precision no or bf16 (amp),
// loads a checkpoint and prints the error if any (load), and trains a small model that resumes
// itself under accel-launch --checkpoint-dir (resume). bench_checkpoint.py drives io and amp.
// Each mode prints one JSON line per result on stdout.
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <sstream>
#include <string_view>

#include "accel/accel.h"
#include "examples/common/args.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A JSON string literal (quotes and backslashes escaped; the messages here have no control bytes).
std::string quoted(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    out += c == '\n' ? ' ' : c;
  }
  return out + "\"";
}

// An object saved with every checkpoint through register_for_checkpointing's string interface.
struct Counter {
  int64_t value = 0;
  std::string state_dict() const { return std::to_string(value); }
  void load_state_dict(const std::string& bytes) { value = std::stoll(bytes); }
};

// --- io / load: a model of about --mb MB of float32 parameters ------------------------------------

// ceil(mb / 16) square Linear layers, each about 16 MB or less, totalling mb * 10^6 bytes.
torch::nn::Sequential big_model(int64_t mb, int64_t* width) {
  const int64_t layers = std::max<int64_t>(1, (mb + 15) / 16);
  *width = std::max<int64_t>(8, static_cast<int64_t>(std::sqrt(static_cast<double>(mb) * 1e6 / 4.0 / layers)));
  torch::nn::Sequential model;
  for (int64_t i = 0; i < layers; ++i) model->push_back(torch::nn::Linear(*width, *width));
  return model;
}

// Every kind of object a checkpoint holds: model, AdamW (with state after one step), loader
// position, LR scheduler and a registered object. Owns nothing the Accelerator does not outlive.
struct IoSetup {
  torch::nn::Sequential model;
  accel::PreparedOptimizer optimizer;
  accel::DataLoader loader;
  accel::PreparedScheduler scheduler;
  std::shared_ptr<Counter> counter;
};

IoSetup prepare_io(accel::Accelerator& acc, int64_t mb) {
  torch::manual_seed(0);
  int64_t width = 0;
  auto model = big_model(mb, &width);
  auto opt = std::make_shared<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-3));
  auto sched = std::make_shared<torch::optim::StepLR>(*opt, 1, 0.5);
  accel::DataLoader loader(std::make_shared<accel::TensorDataset>(torch::randn({8, width})), {.batch_size = 8});
  auto [m, o, dl, s] = acc.prepare(model, opt, loader, sched);
  auto counter = std::make_shared<Counter>();
  acc.register_for_checkpointing(counter);
  return {m, o, dl, s, counter};
}

// One AdamW step, so the optimizer holds exp_avg and exp_avg_sq for every parameter.
void train_one_step(accel::Accelerator& acc, IoSetup& io) {
  for (auto& batch : io.loader) {
    auto loss = io.model->forward(batch.input).pow(2).mean();
    acc.backward(loss);
    io.optimizer.step();
    io.scheduler.step();
    io.optimizer.zero_grad();
    ++io.counter->value;
  }
}

uint64_t folder_bytes(const fs::path& dir) {
  uint64_t total = 0;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (entry.is_regular_file()) total += entry.file_size();
  }
  return total;
}

// Writes dirty pages and empties the page cache, so the next read comes from the disk.
void drop_caches() {
  ::sync();
  std::ofstream out("/proc/sys/vm/drop_caches");
  out << "3\n";
  out.flush();
  if (!out) throw std::runtime_error("cannot write /proc/sys/vm/drop_caches (needs root)");
}

int run_io(int argc, char** argv) {
  accel::examples::Args args("bench_checkpoint io", "Times save_state and load_state of a --mb MB model with AdamW state.");
  args.flag("dir", "", "folder to write the checkpoint in (as <dir>/ck, left there after the last run)")
      .flag("mb", "100", "model size in MB (10^6 bytes) of float32 parameters")
      .flag("runs", "3", "save + load pairs")
      .flag("drop-caches", "0", "1: sync and drop the page cache before each load_state (root only)")
      .flag("scaler", "0", "1: also enable a GradScaler, so the checkpoint holds scaler.json");
  args.parse(argc, argv);
  if (args.str("dir").empty()) {
    std::fprintf(stderr, "bench_checkpoint io: --dir is required\n");
    return 2;
  }
  accel::AcceleratorOptions options;
  if (args.integer("scaler") != 0) options.grad_scaler = accel::GradScalerOptions{};
  accel::Accelerator acc(options);
  auto io = prepare_io(acc, args.integer("mb"));
  train_one_step(acc, io);
  const fs::path ck = fs::path(args.str("dir")) / "ck";
  std::vector<torch::Tensor> expected;
  for (const auto& p : io.model->parameters()) expected.push_back(p.detach().clone());
  for (long run = 0; run < args.integer("runs"); ++run) {
    fs::remove_all(ck);
    ::sync();  // Why: the previous run's deletion must not be flushed inside the timed save.
    auto start = Clock::now();
    acc.save_state(ck);
    double save_s = seconds_since(start);
    uint64_t bytes = folder_bytes(ck);
    {
      torch::NoGradGuard no_grad;
      for (auto& p : io.model->parameters()) p.zero_();  // load_state must bring them back
    }
    if (args.integer("drop-caches") != 0) drop_caches();
    start = Clock::now();
    acc.load_state(ck);
    double load_s = seconds_since(start);
    bool same = true;
    auto params = io.model->parameters();
    for (std::size_t i = 0; i < params.size(); ++i) same = same && torch::equal(params[i], expected[i]);
    std::printf("{\"run\": %ld, \"bytes\": %llu, \"save_s\": %.4f, \"load_s\": %.4f, \"cold_cache\": %s, "
                "\"weights_restored\": %s}\n",
                run, static_cast<unsigned long long>(bytes), save_s, load_s,
                args.integer("drop-caches") != 0 ? "true" : "false", same ? "true" : "false");
    std::fflush(stdout);
    if (!same) return 1;
  }
  return 0;
}

int run_load(int argc, char** argv) {
  accel::examples::Args args("bench_checkpoint load", "Loads a checkpoint written by `bench_checkpoint io` and prints the error, if any.");
  args.flag("dir", "", "the checkpoint folder (e.g. <io --dir>/ck)")
      .flag("mb", "100", "the --mb the checkpoint was written with")
      .flag("scaler", "0", "the --scaler the checkpoint was written with");
  args.parse(argc, argv);
  accel::AcceleratorOptions options;
  if (args.integer("scaler") != 0) options.grad_scaler = accel::GradScalerOptions{};
  accel::Accelerator acc(options);
  auto io = prepare_io(acc, args.integer("mb"));
  try {
    auto dir = acc.load_state(args.str("dir"));
    std::printf("{\"loaded\": %s, \"step\": %lld, \"counter\": %lld}\n", quoted(dir.string()).c_str(),
                static_cast<long long>(acc.completed_steps()), static_cast<long long>(io.counter->value));
    return 0;
  } catch (const accel::CheckpointError& e) {
    std::printf("{\"error\": \"CheckpointError\", \"message\": %s}\n", quoted(e.what()).c_str());
    return 1;
  }
}

// --- amp: model M under autocast ---------------------------------------------------------------

int run_amp(int argc, char** argv) {
  accel::examples::Args args("bench_checkpoint amp", "Steps/s of model M (784->2048->2048->10, AdamW, batch 64) under acc.autocast().");
  args.flag("mode", "no", "mixed precision: no or bf16")
      .flag("steps", "100", "timed steps")
      .flag("warmup", "10", "untimed steps first");
  args.parse(argc, argv);
  torch::manual_seed(0);
  accel::Accelerator acc({.mixed_precision = args.str("mode")});
  torch::nn::Sequential model(torch::nn::Linear(784, 2048), torch::nn::ReLU(), torch::nn::Linear(2048, 2048),
                              torch::nn::ReLU(), torch::nn::Linear(2048, 10));
  auto opt = std::make_shared<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-3));
  auto [m, o] = acc.prepare(model, opt);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;
  for (int i = 0; i < 16; ++i) batches.emplace_back(torch::randn({64, 784}), torch::randint(10, {64}, torch::kLong));
  torch::ScalarType output_dtype = torch::kFloat;
  double last_loss = 0;
  auto step = [&](int64_t i) {
    auto& [x, y] = batches[static_cast<std::size_t>(i % 16)];
    torch::Tensor loss;
    {
      auto autocast = acc.autocast();
      auto logits = m->forward(x);
      output_dtype = logits.scalar_type();
      loss = torch::cross_entropy_loss(logits, y);
    }
    acc.backward(loss);
    o.step();
    o.zero_grad();
    return loss;
  };
  for (int64_t i = 0; i < args.integer("warmup"); ++i) step(i);
  const int64_t steps = args.integer("steps");
  auto start = Clock::now();
  for (int64_t i = 0; i < steps; ++i) last_loss = step(i).item<double>();
  double seconds = seconds_since(start);
  std::ostringstream dtype;
  dtype << output_dtype;
  std::printf("{\"mode\": %s, \"steps_per_s\": %.3f, \"forward_dtype\": %s, \"last_loss\": %.4f}\n",
              quoted(args.str("mode")).c_str(), static_cast<double>(steps) / seconds, quoted(dtype.str()).c_str(),
              last_loss);
  return 0;
}

// --- resume: automatic resume under accel-launch --checkpoint-dir ---------------------------------

// A hash of every parameter's bytes: equal hashes mean bitwise-equal weights.
std::size_t weights_hash(const torch::nn::Module& model) {
  std::size_t h = 0;
  for (const auto& p : model.parameters()) {
    auto t = p.detach().contiguous();
    std::string_view bytes(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size());
    h = h * 1000003u ^ std::hash<std::string_view>{}(bytes);
  }
  return h;
}

int run_resume(int argc, char** argv) {
  accel::examples::Args args("bench_checkpoint resume",
                             "Trains 10->64->1 with dropout, AdamW and StepLR over a shuffled loader, from where the newest "
                             "checkpoint left off; prints a hash of the final weights.");
  args.flag("epochs", "3", "passes over the data")
      .flag("samples", "512", "data set size")
      .flag("crash-at-step", "0", "exit(1) right after this optimizer step, on the first attempt only (0: never)");
  args.parse(argc, argv);
  accel::Accelerator acc;
  torch::manual_seed(0);
  auto x = torch::randn({args.integer("samples"), 10});
  auto y = x.sum(1, true);
  torch::nn::Sequential model(torch::nn::Linear(10, 64), torch::nn::ReLU(), torch::nn::Dropout(0.1),
                              torch::nn::Linear(64, 1));
  auto opt = std::make_shared<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-2));
  auto sched = std::make_shared<torch::optim::StepLR>(*opt, 20, 0.5);
  accel::DataLoader loader(std::make_shared<accel::TensorDataset>(x, y), {.batch_size = 16, .shuffle = true, .seed = 7});
  // With ACCEL_CHECKPOINT_DIR set, this prepare() loads the newest complete checkpoint.
  auto [m, o, dl, s] = acc.prepare(model, opt, loader, sched);
  const char* attempt = std::getenv("ACCEL_RESTART_COUNT");
  const bool first_attempt = attempt == nullptr || std::string(attempt) == "0";
  const int64_t crash_at = args.integer("crash-at-step");
  for (int64_t epoch = dl.epoch(); epoch < args.integer("epochs"); ++epoch) {
    for (auto& batch : dl) {
      auto loss = torch::mse_loss(m->forward(batch.input), batch.target);
      acc.backward(loss);
      o.step();
      s.step();
      o.zero_grad();
      if (first_attempt && acc.completed_steps() == crash_at) {
        acc.print("bench_checkpoint resume: crashing after step", crash_at);
        std::_Exit(1);
      }
    }
  }
  acc.wait_for_everyone();
  if (acc.is_main_process()) {
    std::printf("{\"steps\": %lld, \"weights_hash\": \"%016zx\"}\n", static_cast<long long>(acc.completed_steps()),
                weights_hash(*m));
  }
  return 0;
}

void usage(std::FILE* out) {
  std::fprintf(out,
               "usage: bench_checkpoint io|load|amp|resume [flags]   (bench_checkpoint MODE --help for the flags)\n"
               "  io      time save_state/load_state of a --mb MB model with AdamW state\n"
               "  load    load a checkpoint written by io and print the error, if any\n"
               "  amp     steps/s of model M under autocast, --mode no|bf16\n"
               "  resume  train a small model that resumes from ACCEL_CHECKPOINT_DIR\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  const std::string mode = argv[1];
  // Args parses from index 1, so the mode takes the place of the program name.
  if (mode == "io") return run_io(argc - 1, argv + 1);
  if (mode == "load") return run_load(argc - 1, argv + 1);
  if (mode == "amp") return run_amp(argc - 1, argv + 1);
  if (mode == "resume") return run_resume(argc - 1, argv + 1);
  usage(mode == "--help" || mode == "-h" ? stdout : stderr);
  return mode == "--help" || mode == "-h" ? 0 : 2;
}

// What the C++ blocks of the docs assume without writing it (tests/docs/cpp_blocks.py compiles
// every block against this): the types a page names (Net, a counter), and for a fragment the
// variables it uses, as members of a context struct the fragment's code runs in. Nothing here
// is run, except the programs, which define all they use themselves.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "accel/accel.h"
#include "accel/logging.h"
#include "accel/model_io.h"

namespace doc {

namespace types {

// The model the pages train: x [N, 4] -> [N, 1].
struct Net : torch::nn::Module {
  Net() { fc = register_module("fc", torch::nn::Linear(4, 1)); }
  torch::Tensor forward(torch::Tensor x) { return fc->forward(x); }
  torch::nn::Linear fc{nullptr};
};

// A language model: token ids and an attention mask [B, T] -> logits [B, T, vocab].
struct LM : torch::nn::Module {
  LM() { emb = register_module("emb", torch::nn::Embedding(100, 100)); }
  torch::Tensor forward(torch::Tensor ids, torch::Tensor mask) {
    return emb->forward(ids) * mask.unsqueeze(-1);
  }
  torch::nn::Embedding emb{nullptr};
};

// An object of the program's own that register_for_checkpointing saves.
struct Counter {
  int64_t value = 0;
  std::string state_dict() const { return std::to_string(value); }
  void load_state_dict(const std::string& s) { value = std::stoll(s); }
};

}  // namespace types

namespace context {

using namespace types;

// A training program part-way through: the objects before and after prepare(), a batch, a loss.
// Never constructed (its Accelerator would start a process group); fragments only compile.
struct loop {
  accel::Accelerator acc;
  std::shared_ptr<Net> model;
  std::shared_ptr<torch::optim::AdamW> opt, optimizer;
  std::shared_ptr<torch::optim::LRScheduler> sched, scheduler;
  std::shared_ptr<accel::TensorDataset> dataset;
  accel::DataLoader loader, eval_loader;
  accel::PreparedModel<Net> m;
  accel::PreparedOptimizer o;
  accel::DataLoader dl, eval_dl;
  accel::PreparedScheduler s;
  accel::Batch batch;
  torch::Tensor x, y, loss, value;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;
  std::vector<torch::Tensor> params;
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> loss_fn;
  std::function<torch::Tensor(const accel::Batch&)> loss_of;
  std::shared_ptr<Counter> my_counter;
  accel::Logger logger = accel::get_logger("doc");
  std::filesystem::path dir;
  std::map<std::string, accel::Accelerator::ConfigValue> config;
  int64_t epoch = 0, epochs = 0, step = 0, n = 0, w = 0, vocab = 0, correct = 0, seen = 0;
  double l = 0, accuracy = 0;
  std::string msg;
};

// The same with a language model: m(batch["input_ids"], batch["attention_mask"]).
struct lm : loop {
  std::shared_ptr<LM> model;
  accel::PreparedModel<LM> m;
};

}  // namespace context

// A runnable program of the docs: its name (name=NAME in its marker) and its main.
struct Program {
  const char* name;
  int (*main)(int, char**);
};

inline int call(int (*main)(), int, char**) { return main(); }
inline int call(int (*main)(int, char**), int argc, char** argv) { return main(argc, argv); }

// `docs_cpp_blocks NAME args...` runs the program NAME with args (argv[0] is NAME).
inline int dispatch(const std::vector<Program>& programs, int argc, char** argv) {
  if (argc >= 2) {
    for (const auto& p : programs)
      if (std::string(argv[1]) == p.name) return p.main(argc - 1, argv + 1);
  }
  std::fprintf(stderr, "usage: %s PROGRAM [ARGS...]; the docs' programs:", argv[0]);
  for (const auto& p : programs) std::fprintf(stderr, " %s", p.name);
  std::fprintf(stderr, "\n");
  return 2;
}

}  // namespace doc

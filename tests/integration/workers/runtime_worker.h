// What runtime_worker's source files share: the rank its messages name, REQUIRE, the equivalence
// model and its small SGD setup, the weights check, and the modes that live in the other files.
#pragma once

#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "accel/accel.h"

namespace runtime_worker {

// This process's rank, for messages (RANK, or the Accelerator's process index once made).
extern int g_rank;

#define REQUIRE(cond, what)                                                                        \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      std::fprintf(stderr, "CHECK FAILED on rank %d (line %d): %s: %s\n", g_rank, __LINE__, #cond, \
                   std::string(what).c_str());                                                     \
      std::exit(1);                                                                                \
    }                                                                                              \
  } while (0)

// The equivalence model: a 2-layer MLP with fixed initial weights (seeded on every rank alike),
// and a head that forward never uses: on 1 process its gradient stays undefined and AdamW's
// weight decay leaves it alone, so it must not move on N processes either. Registered first, so
// its bucket is the last one (the fc buckets still launch during backward).
// `wide` > 0 adds a wide x wide layer between fc1 and fc2 (the "wide" training mode: enough
// parameters that ZeRO's shards move in several pieces).
struct NetImpl : torch::nn::Module {
  explicit NetImpl(int64_t wide = 0)
      : unused_head(register_module("unused_head", torch::nn::Linear(16, 3))),
        fc1(register_module("fc1", torch::nn::Linear(6, wide > 0 ? wide : 16))),
        fc2(register_module("fc2", torch::nn::Linear(wide > 0 ? wide : 16, 2))) {
    if (wide > 0) mid = register_module("mid", torch::nn::Linear(wide, wide));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::tanh(fc1->forward(x));
    if (mid) h = torch::tanh(mid->forward(h));
    return fc2->forward(h);
  }
  torch::nn::Linear unused_head, fc1, fc2;
  torch::nn::Linear mid{nullptr};
};

// xxh64 of every parameter's bytes, in order: equal hashes = bitwise-equal weights.
std::string weights_hash(torch::nn::Module& model);

// All of the model's weights, flattened; fails with `what` unless every rank holds the same bits.
torch::Tensor same_weights_everywhere(accel::Accelerator& acc, torch::nn::Module& model,
                                      const std::string& what);

// The gradient-sync tests' setup: NetImpl with seed 5's weights (every rank alike, before the
// broadcast) and SGD at 0.1, prepared; g_rank set; then seed 100 + rank, so that every rank
// draws different data.
struct SmallSgd {
  accel::PreparedModel<NetImpl> model;
  accel::PreparedOptimizer optimizer;
};
SmallSgd prepare_small_sgd(accel::Accelerator& acc);

// The checkpoint modes (runtime_worker_checkpoints.cpp); see runtime_worker.cpp's usage.
int save_killed(const std::string& dir, int kill_at, bool async);
int load_newest(const std::string& dir, int steps);
int late_order(int steps, int kill_rank, int kill_at, const std::string& model_dir);
int foreign();
int usr1_at(int steps, int save_at, int signal_at);
// The nested-backward mode (runtime_worker_reentrant.cpp).
int reentrant(bool launched, bool plain);

}  // namespace runtime_worker

// bench_train: steps/s of model T (10->64->1, batch 8), model M (784->2048->2048->10, batch 64) or
// model L (train_lm's character transformer at its defaults: 64 tokens of context, width 64, 2
// layers of 4 heads, batch 16, causal mask) or model V (a vocabulary's head: 512 tokens through an
// embedding of 32,000 words by 256, a 256x256 layer and a linear head back to 32,000 words: its
// logits and their gradient are 65.5 MB each, allocated and freed at every step), AdamW, on
// libaccel; run under accel-launch -n 1|2. The same loop as ddp_bench.py: a fixed set of
// pre-generated batches, forward, loss, accelerator.backward, step, zero_grad. The forward pass and
// loss run under acc.autocast(), so ACCEL_MIXED_PRECISION=bf16 times bf16 (a no-op scope at the
// default "no"). Rank 0 prints one JSON line.
#include <c10/core/CPUAllocator.h>
#include <malloc.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <limits>
#include <string>

#include "accel/accel.h"
#include "examples/common/args.h"
#include "runtime/large_blocks.h"
#include "runtime/zero.h"

namespace {

// examples/train_lm.cpp's model without its padding mask: the same modules, sizes and defaults.
struct TinyLmImpl : torch::nn::Module {
  TinyLmImpl(int64_t vocab, int64_t block, int64_t dim, int64_t layers, int64_t heads)
      : tok(register_module("tok", torch::nn::Embedding(vocab, dim))),
        pos(register_module("pos", torch::nn::Embedding(block, dim))),
        blocks(register_module(
            "blocks",
            torch::nn::TransformerEncoder(torch::nn::TransformerEncoderOptions(
                torch::nn::TransformerEncoderLayerOptions(dim, heads).dim_feedforward(4 * dim),
                layers)))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))),
        head(register_module("head", torch::nn::Linear(dim, vocab))),
        causal(register_buffer(
            "causal",
            torch::triu(torch::full({block, block}, -std::numeric_limits<float>::infinity()), 1))) {
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    auto positions = torch::arange(idx.size(1), torch::dtype(torch::kLong).device(idx.device()));
    auto x = tok->forward(idx) + pos->forward(positions).unsqueeze(0);
    x = blocks->forward(x.transpose(0, 1), causal).transpose(0, 1);
    return head->forward(norm->forward(x));
  }
  torch::nn::Embedding tok, pos;
  torch::nn::TransformerEncoder blocks;
  torch::nn::LayerNorm norm;
  torch::nn::Linear head;
  torch::Tensor causal;
};
TORCH_MODULE(TinyLm);

}  // namespace

int main(int argc, char** argv) {
  accel::examples::Args args("bench_train", "Times training steps of model T or M on libaccel.");
  args.flag("model", "T",
            "T (10->64->1, batch 8), M (784->2048->2048->10, batch 64) or L (train_lm's "
            "transformer, batch 16 x 64 tokens) or V (a 32,000-word vocabulary's head, 512 tokens)")
      .flag("steps", "2000", "timed steps")
      .flag("warmup", "100", "untimed steps first")
      .flag("optimizer-step", "fused",
            "fused (the prepared optimizer's one-pass step) or libtorch (AdamW::step)")
      .flag("zero-stage", "0", "1: ZeRO stage 1 (the optimizer state sharded across processes)")
      .flag("zero-grad", "libtorch",
            "libtorch (zero_grad(): libtorch's own default), none (zero_grad(true)) or in-place "
            "(zero_grad(false))")
      .flag("large-blocks", "kept",
            "kept (libaccel's CPU allocator, which reuses freed blocks of 32 MiB and more) or "
            "libtorch (libtorch's own allocator put back after the Accelerator is made)");
  args.parse(argc, argv);
  const std::string zero_grad = args.str("zero-grad");
  if (zero_grad != "libtorch" && zero_grad != "none" && zero_grad != "in-place") {
    std::fprintf(stderr, "bench_train: --zero-grad must be libtorch, none or in-place\n");
    return 2;
  }
  const bool big = args.str("model") == "M", lm = args.str("model") == "L",
             head = args.str("model") == "V";
  if (!big && !lm && !head && args.str("model") != "T") {
    std::fprintf(stderr, "bench_train: --model must be T, M, L or V\n");
    return 2;
  }
  if (args.str("large-blocks") != "kept" && args.str("large-blocks") != "libtorch") {
    std::fprintf(stderr, "bench_train: --large-blocks must be kept or libtorch\n");
    return 2;
  }
  torch::manual_seed(0);
  accel::AcceleratorOptions options;
  options.fused_optimizer = args.str("optimizer-step") == "fused";
  options.zero_stage = static_cast<int>(args.integer("zero-stage"));
  accel::Accelerator acc(options);
  if (args.str("large-blocks") == "libtorch") c10::SetCPUAllocator(c10::GetDefaultCPUAllocator());
  const int64_t in = big ? 784 : 10, hidden = big ? 2048 : 64, out = big ? 10 : 1,
                batch = big    ? 64
                        : lm   ? 16
                        : head ? 512
                               : 8;
  constexpr int64_t kVocab = 64, kBlock = 64, kWords = 32000, kWidth = 256;
  torch::nn::Sequential mlp =
      big ? torch::nn::Sequential(torch::nn::Linear(in, hidden), torch::nn::ReLU(),
                                  torch::nn::Linear(hidden, hidden), torch::nn::ReLU(),
                                  torch::nn::Linear(hidden, out))
          : torch::nn::Sequential(torch::nn::Linear(in, hidden), torch::nn::ReLU(),
                                  torch::nn::Linear(hidden, out));
  if (head) {
    mlp = torch::nn::Sequential(torch::nn::Embedding(kWords, kWidth),
                                torch::nn::Linear(kWidth, kWidth), torch::nn::ReLU(),
                                torch::nn::Linear(kWidth, kWords));
  }
  TinyLm tiny(kVocab, kBlock, 64, 2, 4);
  std::shared_ptr<torch::nn::Module> model =
      lm ? std::static_pointer_cast<torch::nn::Module>(tiny.ptr()) : mlp.ptr();
  auto opt =
      std::make_shared<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-3));
  auto [m, o] = acc.prepare(model, opt);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;
  for (int i = 0; i < 16; ++i) {
    if (head) {
      batches.emplace_back(torch::randint(kWords, {batch}, torch::kLong).to(acc.device()),
                           torch::randint(kWords, {batch}, torch::kLong).to(acc.device()));
      continue;
    }
    if (lm) {
      batches.emplace_back(torch::randint(kVocab, {batch, kBlock}, torch::kLong).to(acc.device()),
                           torch::randint(kVocab, {batch, kBlock}, torch::kLong).to(acc.device()));
      continue;
    }
    auto x = torch::randn({batch, in});
    auto y = big ? torch::randint(out, {batch}, torch::kLong) : torch::randn({batch, 1});
    batches.emplace_back(x.to(acc.device()), y.to(acc.device()));
  }
  // Why: on a GPU the steps only queue kernels; the clock must wait for them.
  auto wait_for_device = [&] {
    if (acc.device().is_cuda()) torch::cuda::synchronize();
    acc.wait_for_everyone();
  };
  torch::ScalarType forward_dtype = torch::kFloat;
  // Seconds spent in each phase of the timed steps: forward and loss, backward (with the gradient
  // all-reduce, which runs in backward's hooks), the optimizer step, zero_grad.
  double phase_s[4] = {0, 0, 0, 0};
  bool timing = false;
  using Clock = std::chrono::steady_clock;
  auto lap = [&](Clock::time_point& t, int phase) {
    auto now = Clock::now();
    if (timing) phase_s[phase] += std::chrono::duration<double>(now - t).count();
    t = now;
  };
  auto step = [&](int64_t i) {
    auto& [x, y] = batches[static_cast<std::size_t>(i % 16)];
    torch::Tensor loss;
    auto t = Clock::now();
    {
      auto cast = acc.autocast();
      auto pred = lm ? tiny->forward(x) : mlp->forward(x);
      forward_dtype = pred.scalar_type();
      loss = lm            ? torch::cross_entropy_loss(pred.reshape({-1, kVocab}), y.reshape({-1}))
             : big || head ? torch::cross_entropy_loss(pred, y)
                           : torch::mse_loss(pred, y);
    }
    lap(t, 0);
    acc.backward(loss);
    lap(t, 1);
    o.step();
    lap(t, 2);
    if (zero_grad == "libtorch")
      o.zero_grad();
    else
      o.zero_grad(zero_grad == "none");
    lap(t, 3);
  };
  for (int64_t i = 0; i < args.integer("warmup"); ++i) step(i);
  wait_for_device();
  const int64_t steps = args.integer("steps");
  auto start = std::chrono::steady_clock::now();
  timing = true;
  for (int64_t i = 0; i < steps; ++i) step(i);
  wait_for_device();
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // This process's peak resident memory (VmHWM), in bytes; ranks' peaks differ little. And, at
  // the end, its private (RssAnon) and shared-memory (RssShmem: the gradient buckets' block,
  // this rank's part and the parts of others it touched) resident memory.
  // And the bytes of live allocations: malloc's (mallinfo2: in-use heap + mmapped chunks), which
  // leaves out what the allocator keeps resident after a free, and ZeRO's state block, which
  // libaccel maps itself.
  const struct mallinfo2 heap = ::mallinfo2();
  const accel::large_blocks::Stats blocks = accel::large_blocks::installed_stats();
  const long heap_in_use = static_cast<long>(heap.uordblks + heap.hblkhd);
  const long zero_state = static_cast<long>(accel::detail::ZeroOptimizer::mapped_bytes());
  long peak_kb = 0, anon_kb = 0, shmem_kb = 0;
  {
    std::ifstream status("/proc/self/status");
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("VmHWM:", 0) == 0) peak_kb = std::stol(line.substr(6));
      if (line.rfind("RssAnon:", 0) == 0) anon_kb = std::stol(line.substr(8));
      if (line.rfind("RssShmem:", 0) == 0) shmem_kb = std::stol(line.substr(9));
    }
  }
  if (acc.is_main_process()) {
    double sps = static_cast<double>(steps) / seconds;
    const double per = static_cast<double>(std::max<int64_t>(steps, 1));  // --steps 0: zeros
    std::printf(
        "{\"steps_per_s\": %.2f, \"samples_per_s\": %.1f, \"tokens_per_s\": %.0f, \"device\": "
        "\"%s\", \"processes\": %d, \"mixed_precision\": "
        "\"%s\", "
        "\"forward_dtype\": \"%s\", \"optimizer_step\": \"%s\", \"zero_stage\": %ld, "
        "\"zero_grad\": \"%s\", "
        "\"peak_rss_bytes\": %ld, \"rss_anon_bytes\": %ld, \"rss_shmem_bytes\": %ld, "
        "\"heap_in_use_bytes\": %ld, \"zero_state_mapped_bytes\": %ld, \"phase_ms\": {\"forward\": "
        "%.2f, \"backward\": %.2f, "
        "\"step\": %.2f, \"zero_grad\": %.2f}, \"large_blocks\": {\"made\": %llu, \"reused\": "
        "%llu, \"peak_live_bytes\": %zu}}\n",
        sps, sps * static_cast<double>(batch) * acc.num_processes(),
        lm ? sps * static_cast<double>(batch * kBlock) * acc.num_processes() : 0.0,
        acc.device().str().c_str(), acc.num_processes(), acc.mixed_precision().c_str(),
        c10::toString(forward_dtype), args.str("optimizer-step").c_str(),
        args.integer("zero-stage"), zero_grad.c_str(), peak_kb * 1024, anon_kb * 1024,
        shmem_kb * 1024, heap_in_use, zero_state, 1e3 * phase_s[0] / per, 1e3 * phase_s[1] / per,
        1e3 * phase_s[2] / per, 1e3 * phase_s[3] / per,
        static_cast<unsigned long long>(blocks.made),
        static_cast<unsigned long long>(blocks.reused), blocks.peak_live_bytes);
  }
  return 0;
}

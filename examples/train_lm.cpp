// train_lm: a small character-level transformer language model. Trains on --text FILE, or on a
// corpus the program generates from a seeded grammar; prints the loss and samples text.
#include <torch/torch.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "accel/accel.h"
#include "examples/common/args.h"

namespace {

// Sentences from a small grammar: enough structure that a model visibly learns words and syntax.
std::string generated_corpus(int64_t sentences, uint64_t seed) {
  const std::vector<std::string> subjects{"the cat",     "a dog",        "the old man",
                                          "my sister",   "the robot",    "a small bird",
                                          "the teacher", "our neighbour"};
  const std::vector<std::string> verbs{"sees",    "likes", "carries", "paints",
                                       "follows", "finds", "builds",  "reads"};
  const std::vector<std::string> objects{"a red ball",    "the green door", "an old book",
                                         "the tall tree", "a blue boat",    "the quiet river",
                                         "a warm bed",    "the long road"};
  const std::vector<std::string> endings{".", " today.", " at night.", " in the garden.",
                                         " every morning."};
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto pick = [&](const std::vector<std::string>& v) {
    return v[static_cast<std::size_t>(
        torch::randint(static_cast<int64_t>(v.size()), {1}, gen).item<int64_t>())];
  };
  std::ostringstream out;
  for (int64_t i = 0; i < sentences; ++i)
    out << pick(subjects) << " " << pick(verbs) << " " << pick(objects) << pick(endings) << "\n";
  return out.str();
}

struct TinyLmImpl : torch::nn::Module {
  TinyLmImpl(int64_t vocab, int64_t block, int64_t dim, int64_t heads, int64_t layers)
      : tok(register_module("tok", torch::nn::Embedding(vocab, dim))),
        pos(register_module("pos", torch::nn::Embedding(block, dim))),
        blocks(register_module("blocks",
                               torch::nn::TransformerEncoder(torch::nn::TransformerEncoderOptions(
                                   torch::nn::TransformerEncoderLayerOptions(dim, heads)
                                       .dim_feedforward(4 * dim)
                                       .dropout(0.0),
                                   layers)))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))),
        head(register_module("head", torch::nn::Linear(dim, vocab))) {}

  // idx [B, T] of character ids -> logits [B, T, vocab]; position t sees positions <= t only,
  // and none where attention_mask [B, T] (if given) is 0 (padding).
  torch::Tensor forward(const torch::Tensor& idx, const torch::Tensor& attention_mask = {}) {
    const int64_t t = idx.size(1);
    auto positions =
        torch::arange(t, torch::TensorOptions().dtype(torch::kLong).device(idx.device()));
    auto x = tok->forward(idx) + pos->forward(positions).unsqueeze(0);
    auto mask = torch::triu(torch::full({t, t}, -std::numeric_limits<float>::infinity(),
                                        torch::TensorOptions().device(idx.device())),
                            1);
    torch::Tensor padding;
    if (attention_mask.defined()) padding = attention_mask == 0;
    x = blocks->forward(x.transpose(0, 1), mask, padding).transpose(0, 1);
    return head->forward(norm->forward(x));
  }

  torch::nn::Embedding tok, pos;
  torch::nn::TransformerEncoder blocks;
  torch::nn::LayerNorm norm;
  torch::nn::Linear head;
};

}  // namespace

namespace {

int run_training(int argc, char** argv) {
  accel::examples::Args args(
      "train_lm", "Trains a character-level transformer language model and samples from it.");
  args.flag("text", "", "a UTF-8/ASCII text file to train on (default: a generated corpus)")
      .flag("sentences", "1500", "sentences in the generated corpus")
      .flag("epochs", "3", "passes over the text")
      .flag("batch-size", "16", "windows per batch per process")
      .flag("block", "64", "context length in characters")
      .flag("dim", "64", "model width")
      .flag("layers", "2", "transformer layers")
      .flag("heads", "4", "attention heads")
      .flag("lr", "0.003", "AdamW learning rate")
      .flag("sample-chars", "200", "characters to sample at the end")
      .flag("seed", "0", "seed for the corpus, weights, shuffle and sampling")
      .flag("save-model", "", "write the trained model to this folder (safetensors)")
      .flag("load-model", "",
            "start from the weights in this save-model folder (--epochs 0: only sample from them)");
  args.parse(argc, argv);
  const int64_t epochs = args.integer("epochs");
  const int64_t sample_chars = args.integer("sample-chars");

  accel::Accelerator acc;
  const auto seed = static_cast<uint64_t>(args.integer("seed"));
  torch::manual_seed(seed);
  std::string text;
  if (args.str("text").empty()) {
    text = generated_corpus(args.integer("sentences"), seed);
  } else {
    std::ifstream in(args.str("text"), std::ios::binary);
    if (!in) {
      std::cerr << "train_lm: cannot read --text " << args.str("text") << ": "
                << std::strerror(errno) << "\n";
      return 2;
    }
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  const int64_t block = args.integer("block");
  if (static_cast<int64_t>(text.size()) < 2 * block + 1) {
    std::cerr << "train_lm: the text has " << text.size() << " characters; it needs at least "
              << 2 * block + 1 << " for --block " << block << "\n";
    return 2;
  }
  // Vocabulary: the bytes that occur, in byte order, so every rank derives the same ids.
  std::vector<int64_t> id_of(256, -1);
  std::string chars;
  for (unsigned char c : text) id_of[c] = 0;
  for (int c = 0; c < 256; ++c) {
    if (id_of[c] == 0) {
      id_of[c] = static_cast<int64_t>(chars.size());
      chars.push_back(static_cast<char>(c));
    }
  }
  auto ids = torch::empty({static_cast<int64_t>(text.size())}, torch::kLong);
  for (std::size_t i = 0; i < text.size(); ++i)
    ids[static_cast<int64_t>(i)] = id_of[static_cast<unsigned char>(text[i])];
  // Windows at half-block stride, as a tokenized Hugging Face dataset has them: input_ids
  // text[i, i+block), labels text[i+1, i+block+1), and attention_mask 1; the text's tail that
  // fills no whole window is one more window, padded (attention_mask 0, labels -100: ignored).
  auto starts = torch::arange(0, ids.size(0) - block - 1, block / 2, torch::kLong);
  auto offsets = torch::arange(block, torch::kLong);
  auto index = starts.unsqueeze(1) + offsets.unsqueeze(0);
  auto input_ids = ids.index({index});
  auto labels = ids.index({index + 1});
  auto attention_mask = torch::ones_like(input_ids);
  const int64_t tail_start = starts[-1].item<int64_t>() + block / 2;
  const int64_t tail = ids.size(0) - 1 - tail_start;  // characters with a next character
  if (tail > 0 && tail < block) {
    auto pad_ids = torch::zeros({1, block}, torch::kLong);
    auto pad_labels = torch::full({1, block}, -100, torch::kLong);
    auto pad_mask = torch::zeros({1, block}, torch::kLong);
    pad_ids[0].narrow(0, 0, tail).copy_(ids.narrow(0, tail_start, tail));
    pad_labels[0].narrow(0, 0, tail).copy_(ids.narrow(0, tail_start + 1, tail));
    pad_mask[0].narrow(0, 0, tail).fill_(1);
    input_ids = torch::cat({input_ids, pad_ids});
    labels = torch::cat({labels, pad_labels});
    attention_mask = torch::cat({attention_mask, pad_mask});
  }

  const auto vocab = static_cast<int64_t>(chars.size());
  auto model = std::make_shared<TinyLmImpl>(vocab, block, args.integer("dim"),
                                            args.integer("heads"), args.integer("layers"));
  if (!args.str("load-model").empty()) {
    accel::load_model(model, args.str("load-model"));  // the same text, so the same vocabulary
    acc.print("loaded the weights of", args.str("load-model"));
  }
  auto opt = std::make_shared<torch::optim::AdamW>(model->parameters(),
                                                   torch::optim::AdamWOptions(args.real("lr")));
  accel::DataLoader loader(
      std::make_shared<accel::TensorDataset>(accel::TensorMap{
          {"input_ids", input_ids}, {"attention_mask", attention_mask}, {"labels", labels}}),
      {.batch_size = static_cast<std::size_t>(args.integer("batch-size")),
       .shuffle = true,
       .seed = seed});
  auto [m, o, dl] = acc.prepare(model, opt, loader);
  acc.print("train_lm:", text.size(), "characters,", vocab, "symbols,", input_ids.size(0),
            "windows,", acc.num_processes(), "process(es)");
  // accel-launch --log-with tensorboard,jsonl --project-dir DIR: the loss of every step and
  // each epoch's mean go to DIR/train_lm/ (without --log-with this does nothing).
  acc.init_trackers("train_lm", {{"lr", args.real("lr")},
                                 {"batch_size", args.integer("batch-size")},
                                 {"block", block},
                                 {"dim", args.integer("dim")},
                                 {"layers", args.integer("layers")},
                                 {"processes", static_cast<int64_t>(acc.num_processes())}});

  // From dl.epoch(): after an automatic resume (accel-launch --checkpoint-dir) the loader is
  // already at the saved epoch and batch.
  for (int64_t epoch = dl.epoch(); epoch < epochs; ++epoch) {
    auto total = torch::zeros({}, torch::dtype(torch::kDouble).device(acc.device()));
    int64_t steps = 0;
    for (auto& batch : dl) {
      // m(...): the forward under autocast with --mixed-precision bf16, float32 logits (as HF).
      auto logits = m(batch["input_ids"], batch["attention_mask"]);
      auto loss = torch::nn::functional::cross_entropy(
          logits.reshape({-1, vocab}), batch["labels"].reshape({-1}),
          torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100));
      acc.backward(loss);
      acc.clip_grad_norm_(m, 1.0);
      o.step();
      o.zero_grad();
      total += loss.detach().to(torch::kDouble);
      ++steps;
      acc.log({{"loss", loss.item<double>()}});  // main process: its own batch's loss
    }
    auto mean =
        acc.reduce(total / std::max<int64_t>(steps, 1), accel::ReduceOp::kMean).item<double>();
    acc.log({{"epoch_loss", mean}, {"epoch", static_cast<double>(epoch)}});
    char line[96];
    std::snprintf(line, sizeof line, "epoch %lld loss %.4f (%.3f bits/char)",
                  static_cast<long long>(epoch), mean, mean / std::log(2.0));
    acc.print(line);
  }

  acc.on_main_process([&] {
    torch::NoGradGuard no_grad;
    m->eval();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed + 1);
    std::string sample(1, text[0]);
    for (int64_t i = 0; i < sample_chars; ++i) {
      std::string context = sample.substr(
          sample.size() > static_cast<std::size_t>(block) ? sample.size() - block : 0);
      auto x = torch::empty({1, static_cast<int64_t>(context.size())}, torch::kLong);
      for (std::size_t k = 0; k < context.size(); ++k)
        x[0][static_cast<int64_t>(k)] = id_of[static_cast<unsigned char>(context[k])];
      auto logits = m(x.to(acc.device()))[0][-1].to(torch::kCPU);
      auto next =
          torch::multinomial(torch::softmax(logits / 0.8, 0), 1, false, gen).item<int64_t>();
      sample.push_back(chars[static_cast<std::size_t>(next)]);
    }
    std::cout << "sample:\n" << sample << "\n" << std::flush;
  });
  acc.wait_for_everyone();
  if (!args.str("save-model").empty() && acc.is_main_process()) {
    acc.save_model(m, args.str("save-model"));
  }
  // HF's end_training: the trackers' files closed, and a background save's failure raised here.
  acc.end_training();
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return accel::examples::run_example(run_training, argc, argv); }

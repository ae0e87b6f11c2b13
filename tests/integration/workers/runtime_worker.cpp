// A libaccel worker for the multi-process tests, run under accel-launch. Each mode checks its
// own results against values computed independently here and exits 1 with a message on the
// first mismatch; modes that need a cross-run comparison write files for the test to compare.
//   runtime_worker collectives
//   runtime_worker shard SIZE BATCH {even|uneven|drop_last|split}
//   runtime_worker metrics SIZE BATCH {even|uneven} [stream]
//   runtime_worker train OUT_FILE GLOBAL_BATCH STEPS
//   {plain|set_to_none|accumulate|no_sync|throw_acc|throw_plain|wide|huge|tied|frozen}
//   runtime_worker foreign (ZeRO: an optimizer holding a tensor of no prepared model)
//   runtime_worker mismatch
//   runtime_worker reentrant {launched|held} [plain] (a second gradient, by a nested backward,
//   into a launched bucket: refused; into one not yet launched: summed; plain: loss.backward())
//   {sleep|other_collective|dtype|place} runtime_worker backward_throws {acc|plain} [STEP_MS]
//   runtime_worker save_killed DIR K [async] (one process: checkpoint_0, then SIGKILL at I/O op K
//   of checkpoint_1) runtime_worker load_newest DIR [STEPS] (load_state() of the newest
//   checkpoint, print its hash; then STEPS training steps and their hash)
//   runtime_worker usr1_at STEPS SAVE_AT SIGNAL_AT (under --checkpoint-dir)
#include "tests/integration/workers/runtime_worker.h"

#include <ATen/CPUGeneratorImpl.h>
#include <signal.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <thread>

#include "accel/accel.h"
#include "contract/progress_page.h"
#include "runtime/checkpoint_io.h"
#include "runtime/comm.h"
#include "runtime/optimizer_steps.h"
#include "runtime/optimizer_tensors.h"
#include "runtime/safetensors.h"

namespace runtime_worker {

int g_rank = 0;

torch::Tensor same_weights_everywhere(accel::Accelerator& acc, torch::nn::Module& model,
                                      const std::string& what) {
  std::vector<torch::Tensor> flat;
  for (auto& p : model.parameters()) flat.push_back(p.detach().reshape({-1}));
  auto weights = torch::cat(flat);
  auto spread =
      acc.reduce(weights, accel::ReduceOp::kMax) - acc.reduce(weights, accel::ReduceOp::kMin);
  REQUIRE(spread.abs().max().item<float>() == 0.0f, what);
  return weights;
}

SmallSgd prepare_small_sgd(accel::Accelerator& acc) {
  g_rank = acc.process_index();
  torch::manual_seed(5);
  auto model = std::make_shared<NetImpl>();
  auto opt = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  auto [m, o] = acc.prepare(model, opt);
  torch::manual_seed(100 + acc.process_index());  // every rank trains on different data
  return {m, o};
}

}  // namespace runtime_worker

using runtime_worker::foreign;
using runtime_worker::g_rank;
using runtime_worker::late_order;
using runtime_worker::load_newest;
using runtime_worker::NetImpl;
using runtime_worker::prepare_small_sgd;
using runtime_worker::reentrant;
using runtime_worker::same_weights_everywhere;
using runtime_worker::save_killed;
using runtime_worker::usr1_at;

namespace {

std::string str(const torch::Tensor& t) {
  std::ostringstream out;
  out << t.flatten().to(torch::kDouble);
  return out.str();
}

// What every rank's random tensor `of_rank(k)` sums to, added in rank order as shared memory adds.
torch::Tensor rank_order_sum(int n, const std::function<torch::Tensor(int)>& of_rank) {
  auto sum = of_rank(0).clone();
  for (int k = 1; k < n; ++k) sum += of_rank(k);
  return sum;
}

// Buffers placed in shared memory (where the gradient buckets live): all-reduced where they lie,
// each rank reducing a slice for all. Over shared memory on one machine the sum is the rank-order
// sum bit for bit on every rank; elsewhere they are private memory and gloo's sum.
void shared_buffers(accel::Accelerator& acc) {
  const int n = acc.num_processes(), r = acc.process_index();
  auto& comm = acc.state().comm();
  const bool in_order = comm.uses_shared_memory();
  const int64_t big = 3L * (1 << 20) + 7;  // more than a slot, not a multiple of a cache line
  auto bufs = comm.shared_zeros({{1, torch::TensorOptions(torch::kFloat)},
                                 {big, torch::TensorOptions(torch::kFloat)},
                                 {1000, torch::TensorOptions(torch::kDouble)},
                                 {4099, torch::TensorOptions(torch::kBFloat16)},
                                 {0, torch::TensorOptions(torch::kFloat)}},
                                "the test's buffers");
  REQUIRE(bufs.size() == 5 && bufs[1].numel() == big && bufs[3].scalar_type() == torch::kBFloat16,
          "shared_zeros sizes");
  for (auto& b : bufs) REQUIRE(b.numel() == 0 || b.abs().max().item<double>() == 0, "zeroed");
  for (int64_t i : {1, 2}) {
    auto numel = bufs[static_cast<std::size_t>(i)].numel();
    auto dtype = bufs[static_cast<std::size_t>(i)].scalar_type();
    auto of_rank = [&](int k) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(2000 + k);
      return torch::randn({numel}, gen).to(dtype);
    };
    auto& buf = bufs[static_cast<std::size_t>(i)];
    buf.copy_(of_rank(r));
    comm.allreduce(buf, c10d::ReduceOp::SUM);
    auto want = rank_order_sum(n, of_rank);
    REQUIRE(in_order ? torch::equal(buf, want) : torch::allclose(buf, want, 1e-5, 1e-5),
            "shared-buffer sum of " + std::to_string(numel));
    // Twice in a row: the second reads what the first wrote into every rank's part.
    comm.allreduce(buf, c10d::ReduceOp::MAX);
    REQUIRE(torch::allclose(buf, want, 1e-5, 1e-5), "max of equal sums");
  }
  // A part of a buffer (an offset inside it), averaged as the gradient buckets are.
  auto part = bufs[1].narrow(0, 12345, 100000);
  part.fill_(static_cast<float>(r + 1));
  auto pending = comm.allreduce_async(part, c10d::ReduceOp::SUM, /*average=*/true);
  comm.wait(pending);
  REQUIRE(torch::equal(part, torch::full({100000}, (n + 1) / 2.0f)),
          "averaged part " + str(part[0]));
  // bf16: summed in fp32 and rounded once. 256 + (n - 1) times 1: in bf16 (8 bits of mantissa)
  // each 256 + 1 rounds back to 256, so a sum in bf16 would stay at 256; in fp32 it is 258 on 3
  // ranks. (On 2 the two are the same: one addition rounds once either way.)
  if (in_order && n >= 3) {
    bufs[3].fill_(r == 0 ? 256.0 : 1.0);
    comm.allreduce(bufs[3], c10d::ReduceOp::SUM);
    const float want = static_cast<float>(c10::BFloat16(256.0f + static_cast<float>(n - 1)));
    REQUIRE(want != 256.0f, "the test needs a sum bf16 additions would lose");
    REQUIRE(bufs[3].to(torch::kFloat).eq(want).all().item<bool>(),
            "bf16 sum " + str(bufs[3].narrow(0, 0, 1)));
  }
  comm.allreduce(bufs[4], c10d::ReduceOp::SUM);  // empty: nothing to do on any rank
}

// This worker's time blocked in collectives so far, from its progress page.
std::uint64_t waited_ns_on_progress_page() {
  const char* path = std::getenv("ACCEL_PROGRESS_FILE");
  std::ifstream in(path, std::ios::binary);
  accel::progress::Page page{};
  in.read(reinterpret_cast<char*>(&page), sizeof page);
  REQUIRE(in.gcount() == static_cast<std::streamsize>(sizeof page),
          std::string("short progress page ") + path);
  return page.stats.collective_wait_ns;
}

int collectives(accel::Accelerator& acc) {
  const int n = acc.num_processes(), r = acc.process_index();
  // gather: rank r contributes [r*10, r*10+1]; a 0-dim tensor gathers to [n].
  auto mine = torch::tensor({r * 10, r * 10 + 1}, torch::kLong);
  auto all = acc.gather(mine);
  std::vector<int64_t> expected;
  for (int k = 0; k < n; ++k) expected.insert(expected.end(), {k * 10, k * 10 + 1});
  REQUIRE(torch::equal(all, torch::tensor(expected)), "gather " + str(all));
  auto scalars = acc.gather(torch::tensor(static_cast<double>(r)));
  REQUIRE(scalars.dim() == 1 && scalars.size(0) == n && scalars[n - 1].item<double>() == n - 1,
          "gather scalar " + str(scalars));
  // 2-D gather keeps the trailing shape.
  auto rows = acc.gather(torch::full({2, 3}, r, torch::kFloat));
  REQUIRE(
      rows.sizes() == torch::IntArrayRef({2 * n, 3}) && rows[2 * n - 1][2].item<float>() == n - 1,
      "gather 2-D");

  // Random payloads of several sizes (some larger than a shared-memory slot, so chunked):
  // every rank can compute every other rank's tensor from its seed, hence the exact answer.
  for (int64_t numel : {1L, 1000L, 1L << 20, 3L * (1 << 20) + 7}) {
    auto of_rank = [&](int k) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + k);
      return torch::randn({numel}, gen);
    };
    auto expected_sum = of_rank(0);
    auto expected_max = of_rank(0);
    std::vector<torch::Tensor> parts{of_rank(0)};
    for (int k = 1; k < n; ++k) {
      expected_sum = expected_sum + of_rank(k);
      expected_max = torch::maximum(expected_max, of_rank(k));
      parts.push_back(of_rank(k));
    }
    auto got = acc.reduce(of_rank(r), accel::ReduceOp::kSum);
    REQUIRE(torch::allclose(got, expected_sum, 1e-5, 1e-5),
            "reduce sum of " + std::to_string(numel) + " floats");
    REQUIRE(torch::equal(acc.reduce(of_rank(r), accel::ReduceOp::kMax), expected_max),
            "reduce max of random floats");
    REQUIRE(torch::equal(acc.gather(of_rank(r)), torch::cat(parts)),
            "gather of " + std::to_string(numel) + " floats");
    auto root = acc.broadcast(of_rank(r), n - 1);
    REQUIRE(torch::equal(root, of_rank(n - 1)),
            "broadcast of " + std::to_string(numel) + " floats");
    // Every rank must hold bitwise the same sum (gradients must not drift apart between ranks).
    auto spread = acc.reduce(got, accel::ReduceOp::kMax) - acc.reduce(got, accel::ReduceOp::kMin);
    REQUIRE(spread.abs().max().item<float>() == 0.0f, "ranks disagree on a sum");
  }

  shared_buffers(acc);

  // reduce: values 1..n.
  auto v = torch::tensor({static_cast<double>(r + 1), -static_cast<double>(r + 1)});
  double sum = n * (n + 1) / 2.0;
  REQUIRE(torch::allclose(acc.reduce(v, accel::ReduceOp::kSum), torch::tensor({sum, -sum})),
          "reduce sum");
  REQUIRE(
      torch::allclose(acc.reduce(v, accel::ReduceOp::kMean), torch::tensor({sum / n, -sum / n})),
      "reduce mean");
  REQUIRE(torch::allclose(acc.reduce(v, accel::ReduceOp::kMax), torch::tensor({1.0 * n, -1.0})),
          "reduce max");
  REQUIRE(torch::allclose(acc.reduce(v, accel::ReduceOp::kMin), torch::tensor({1.0, -1.0 * n})),
          "reduce min");
  REQUIRE(v[0].item<double>() == r + 1, "reduce must not modify its input");
  auto int_mean = acc.reduce(torch::tensor({r}, torch::kLong), accel::ReduceOp::kMean);
  REQUIRE(std::abs(int_mean.item<double>() - (n - 1) / 2.0) < 1e-12,
          "integer mean " + str(int_mean));

  // broadcast from the last rank.
  auto b = acc.broadcast(torch::full({3}, static_cast<float>(r)), n - 1);
  REQUIRE(torch::equal(b, torch::full({3}, static_cast<float>(n - 1))), "broadcast " + str(b));

  // pad_across_processes: rank r has r+1 rows.
  auto uneven = torch::full({r + 1, 2}, r + 1, torch::kLong);
  auto padded = acc.pad_across_processes(uneven, 0, -1);
  REQUIRE(padded.size(0) == n && padded[r][0].item<int64_t>() == r + 1, "pad rows " + str(padded));
  if (r + 1 < n) REQUIRE(padded[n - 1][0].item<int64_t>() == -1, "pad value " + str(padded));
  auto padded_first = acc.pad_across_processes(uneven, 0, -1, true);
  REQUIRE(padded_first[n - 1][1].item<int64_t>() == r + 1,
          "pad_first keeps data at the end " + str(padded_first));
  if (r + 1 < n) REQUIRE(padded_first[0][0].item<int64_t>() == -1, "pad_first pads the front");
  // Uneven gather through gather_for_metrics outside a loader: sizes exchanged, nothing dropped.
  auto gathered = acc.gather(acc.pad_across_processes(uneven, 0, -1));
  REQUIRE(gathered.size(0) == n * n, "gather of padded tensors");

  // gather_object / broadcast_object with uneven (and empty) strings.
  std::string me = r == 0
                       ? std::string()
                       : std::string(static_cast<std::size_t>(r * 3), static_cast<char>('a' + r));
  auto objects = acc.gather_object(me);
  REQUIRE(static_cast<int>(objects.size()) == n, "gather_object count");
  for (int k = 0; k < n; ++k) {
    std::string want =
        k == 0 ? std::string()
               : std::string(static_cast<std::size_t>(k * 3), static_cast<char>('a' + k));
    REQUIRE(objects[static_cast<std::size_t>(k)] == want,
            "gather_object[" + std::to_string(k) + "]");
  }
  auto text = acc.broadcast_object(
      r == n - 1 ? std::string("from the last rank\n\0bytes", 25) : std::string("x"), n - 1);
  REQUIRE(text == std::string("from the last rank\n\0bytes", 25), "broadcast_object");

  // split_between_processes: 7 items; the first 7 % n ranks get one more.
  std::vector<int> items{0, 1, 2, 3, 4, 5, 6};
  auto part = acc.split_between_processes(items);
  int base = 7 / n, extra = 7 % n;
  int begin = r * base + std::min(r, extra);
  int len = base + (r < extra ? 1 : 0);
  REQUIRE(static_cast<int>(part.size()) == len && (len == 0 || part.front() == begin),
          "split_between_processes");
  auto padded_part = acc.split_between_processes(items, true);
  REQUIRE(static_cast<int>(padded_part.size()) == base + (extra > 0 ? 1 : 0), "split padded size");
  REQUIRE(padded_part.back() == begin + len - 1, "split pads with its own last item");
  auto tpart = acc.split_between_processes(torch::arange(7), true);
  REQUIRE(tpart.size(0) == base + (extra > 0 ? 1 : 0) && tpart[0].item<int64_t>() == begin,
          "split tensor");
  if (len < tpart.size(0))
    REQUIRE(tpart[-1].item<int64_t>() == 6, "HF pads a tensor share with the last item of all");

  // Trigger: only the last rank sets it; every rank sees it once.
  REQUIRE(!acc.check_trigger(), "trigger before set");
  if (acc.is_last_process()) acc.set_trigger();
  REQUIRE(acc.check_trigger(), "trigger set by the last rank");
  REQUIRE(!acc.check_trigger(), "trigger resets");

  // main_process_first: the main process writes a marker that the others must see.
  static std::string marker =
      std::string(std::getenv("ACCEL_TEST_DIR") ? std::getenv("ACCEL_TEST_DIR") : "/tmp") +
      "/main_first_" + std::getenv("MASTER_PORT");
  {
    auto order = acc.main_process_first();
    if (acc.is_main_process()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      std::ofstream(marker) << "done";
    } else {
      REQUIRE(std::ifstream(marker).good(), "main_process_first: main had not finished first");
    }
  }
  acc.wait_for_everyone();
  if (acc.is_main_process()) std::remove(marker.c_str());

  // A late peer: rank 0's time blocked in the barrier and the all-reduce that follow is its wait
  // in collectives on its progress page (what the agent's straggler rule reads), whichever way
  // the collectives go (shared memory or gloo).
  if (n > 1 && std::getenv("ACCEL_PROGRESS_FILE") != nullptr) {
    const auto before = waited_ns_on_progress_page();
    if (acc.process_index() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    acc.wait_for_everyone();
    if (acc.process_index() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    auto late = torch::ones({64});
    late = acc.reduce(late, accel::ReduceOp::kSum);
    const auto waited = waited_ns_on_progress_page() - before;
    if (acc.process_index() == 0) {
      // Why a bound above too: a wait counted twice (by the transport and by Comm) is wrong.
      REQUIRE(waited >= 500'000'000ULL && waited < 1'000'000'000ULL,
              "rank 0 waited 2 x 300 ms for rank 1, but its progress page counts " +
                  std::to_string(waited / 1'000'000) + " ms");
      acc.print("OK rank 0's progress page counts", waited / 1'000'000, "ms waiting for a peer");
    }
  }
  acc.print("OK collectives on", n, "processes");
  return 0;
}

accel::AcceleratorOptions options_for(const std::string& mode) {
  accel::AcceleratorOptions o;
  o.even_batches = mode != "uneven";
  o.split_batches = mode == "split";
  return o;
}

int shard(int argc, char** argv) {
  REQUIRE(argc >= 5, "shard SIZE BATCH MODE");
  auto size = std::stol(argv[2]);
  auto bs = static_cast<std::size_t>(std::stol(argv[3]));
  std::string mode = argv[4];
  accel::Accelerator acc(options_for(mode));
  g_rank = acc.process_index();
  accel::DataLoader loader(std::make_shared<accel::TensorDataset>(torch::arange(size)),
                           {.batch_size = bs, .drop_last = mode == "drop_last"});
  auto dl = acc.prepare(loader);
  std::ostringstream out;
  out << "SHARD rank " << acc.process_index() << ":";
  std::size_t count = 0;
  for (auto& batch : dl) {
    out << " [";
    for (int64_t i = 0; i < batch.input.size(0); ++i)
      out << (i ? "," : "") << batch.input[i].item<int64_t>();
    out << "]";
    ++count;
  }
  REQUIRE(count == dl.size(), "size() says " + std::to_string(dl.size()) +
                                  " but the pass yielded " + std::to_string(count));
  // Print in rank order so the test reads one line per rank.
  auto lines = acc.gather_object(out.str());
  if (acc.is_main_process()) {
    for (const auto& l : lines) std::printf("%s\n", l.c_str());
    std::fflush(stdout);
  }
  return 0;
}

// Streams 0..size-1 one example at a time.
class Counter : public accel::IterableDataset {
 public:
  explicit Counter(int64_t size) : size_(size) {}
  accel::ExampleStream stream(int64_t) const override {
    auto next = std::make_shared<int64_t>(0);
    int64_t size = size_;
    return [next, size]() -> std::optional<accel::Example> {
      if (*next >= size) return std::nullopt;
      return accel::Example{torch::tensor((*next)++), {}};
    };
  }

 private:
  int64_t size_;
};

int metrics(int argc, char** argv) {
  REQUIRE(argc >= 5, "metrics SIZE BATCH MODE [stream]");
  auto size = std::stol(argv[2]);
  auto bs = static_cast<std::size_t>(std::stol(argv[3]));
  std::string mode = argv[4];
  bool stream = argc > 5 && std::string(argv[5]) == "stream";
  accel::Accelerator acc(options_for(mode));
  g_rank = acc.process_index();
  accel::DataLoaderOptions opts{.batch_size = bs, .num_workers = 2};
  auto loader =
      stream ? accel::DataLoader(std::make_shared<Counter>(size), opts)
             : accel::DataLoader(std::make_shared<accel::TensorDataset>(torch::arange(size)), opts);
  auto dl = acc.prepare(loader);
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::vector<torch::Tensor> seen;
    for (auto& batch : dl) seen.push_back(acc.gather_for_metrics(batch.input));
    auto all = seen.empty() ? torch::empty({0}, torch::kLong) : torch::cat(seen);
    REQUIRE(all.size(0) == size, "gather_for_metrics counted " + std::to_string(all.size(0)) +
                                     " samples of " + std::to_string(size));
    auto sorted = std::get<0>(all.sort());
    REQUIRE(torch::equal(sorted, torch::arange(size)), "each sample exactly once: " + str(sorted));
  }
  acc.print("METRICS count", size);
  return 0;
}

// Identity forward, throwing backward: a backward pass that fails halfway, after some gradient
// hooks have fired (fc2's, whose buckets are launched by then).
struct Boom : torch::autograd::Function<Boom> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) {
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list) {
    throw std::runtime_error("boom in backward");
  }
};

// acc.backward(loss), or autograd's own loss.backward() (the hooks alone must sync then).
void run_backward(accel::Accelerator& acc, const torch::Tensor& loss, bool plain) {
  if (plain)
    loss.backward();
  else
    acc.backward(loss);
}

// A backward that throws halfway, caught as a training loop would, then zero_grad.
void caught_throwing_backward(accel::Accelerator& acc, NetImpl& m, accel::PreparedOptimizer& o,
                              bool plain) {
  try {
    auto hidden = Boom::apply(torch::tanh(m.fc1->forward(torch::randn({4, 6}))));
    run_backward(acc, m.fc2->forward(hidden).pow(2).mean(), plain);
    REQUIRE(false, "backward should have thrown");
  } catch (const std::runtime_error& e) {
    REQUIRE(std::string(e.what()).find("boom in backward") != std::string::npos, e.what());
  }
  o.zero_grad();
}

// The collectives this worker's progress page shows in flight (end time 0); the agent takes one
// that stays open past hang_timeout for a hang.
int open_collectives_on_progress_page() {
  const char* path = std::getenv("ACCEL_PROGRESS_FILE");
  REQUIRE(path != nullptr, "ACCEL_PROGRESS_FILE is not set: run under accel-launch");
  std::ifstream in(path, std::ios::binary);
  accel::progress::Page page{};
  in.read(reinterpret_cast<char*>(&page), sizeof page);
  REQUIRE(in.gcount() == static_cast<std::streamsize>(sizeof page),
          std::string("short progress page ") + path);
  int open = 0;
  for (const auto& e : page.ring) {
    if (e.seq_plus_one != 0 && e.end_ns == 0) ++open;
  }
  return open;
}

int train(int argc, char** argv) {
  REQUIRE(argc >= 6, "train OUT GLOBAL_BATCH STEPS MODE [adamw|adam|sgd]");
  std::string out_file = argv[2];
  auto global = std::stol(argv[3]);
  auto steps = std::stol(argv[4]);
  std::string mode = argv[5];
  const std::string optimizer = argc > 6 ? argv[6] : "adamw";
  accel::AcceleratorOptions opts;
  if (mode == "accumulate") opts.gradient_accumulation_steps = 2;
  if (mode == "throw_acc" || mode == "throw_plain")
    opts.bucket_cap_bytes = 64;  // launched before the throw
  accel::Accelerator acc(opts);
  g_rank = acc.process_index();
  const int n = acc.num_processes();
  const bool throws = mode == "throw_acc" || mode == "throw_plain";
  const long micro =
      mode == "accumulate" || mode == "no_sync" ? 2 : 1;  // micro-steps per optimizer step
  REQUIRE(global % (n * micro) == 0, "global batch must divide by processes x micro-steps");
  torch::manual_seed(1234);
  // Different seeds per rank before this point would not matter: prepare() broadcasts rank 0.
  auto x = torch::randn({global * steps, 6});
  auto y = torch::randn({global * steps, 2});
  torch::manual_seed(99 + acc.process_index());  // ranks start from different weights on purpose
  // "wide": 1.7 M parameters, so that ZeRO's shard of each rank moves in several pieces.
  // "huge": 16 M parameters, so that the gradient buckets' shared block takes a while to set up.
  auto model = std::make_shared<NetImpl>(mode == "wide" ? 1300 : mode == "huge" ? 4000 : 0);
  // "tied": fc2 registered under a second name, so parameters() lists its tensors twice (as
  // libtorch does for tied weights); each must step once.
  if (mode == "tied") model->register_module("fc2_again", model->fc2);
  // "adam": Adam's L2 weight decay (in the gradient); "sgd": Nesterov momentum with decay.
  std::shared_ptr<torch::optim::Optimizer> opt;
  if (optimizer == "adam") {
    opt = std::make_shared<torch::optim::Adam>(model->parameters(),
                                               torch::optim::AdamOptions(1e-2).weight_decay(0.1));
  } else if (optimizer == "sgd") {
    opt = std::make_shared<torch::optim::SGD>(
        model->parameters(),
        torch::optim::SGDOptions(1e-2).momentum(0.9).nesterov(true).weight_decay(1e-3));
  } else {
    REQUIRE(optimizer == "adamw", "optimizer " + optimizer);
    opt = std::make_shared<torch::optim::AdamW>(model->parameters(),
                                                torch::optim::AdamWOptions(1e-2));
  }
  // "frozen": fc1 frozen (in the optimizer all the same, as HF programs often leave it), and
  // after prepare() set to a value of each rank's own: no step may change it.
  if (mode == "frozen")
    for (auto& p : model->fc1->parameters()) p.requires_grad_(false);
  accel::DataLoader loader(
      std::make_shared<accel::TensorDataset>(x, y),
      {.batch_size = static_cast<std::size_t>(global / (n * micro)), .shuffle = true, .seed = 7});
  auto [m, o, dl] = acc.prepare(model, opt, loader);
  const float frozen_value = 0.25f + 0.5f * static_cast<float>(acc.process_index());
  if (mode == "frozen") {
    torch::NoGradGuard no_grad;
    for (auto& p : m->fc1->parameters()) p.fill_(frozen_value);
  }
  long micro_step = 0;
  for (auto& batch : dl) {
    if (mode == "no_sync" && micro_step % 2 == 0) {
      auto scope = acc.no_sync(m);
      acc.backward(torch::mse_loss(m->forward(batch.input), batch.target) / 2);
    } else if (mode == "no_sync") {
      acc.backward(torch::mse_loss(m->forward(batch.input), batch.target) / 2);
      o.step();
      o.zero_grad();
    } else if (throws) {
      // After the first step (gradients live in the all-reduce buckets by then) a backward throws
      // halfway and is caught; the run must go on exactly as if it had never happened.
      if (micro_step == 1) caught_throwing_backward(acc, *m, o, mode == "throw_plain");
      run_backward(acc, torch::mse_loss(m->forward(batch.input), batch.target),
                   mode == "throw_plain");
      o.step();
      o.zero_grad();
    } else if (mode == "set_to_none") {
      // Gradients dropped after each step (torch 2.x's zero_grad default): sync must re-attach
      // them.
      acc.backward(torch::mse_loss(m->forward(batch.input), batch.target));
      o.step();
      o.zero_grad(/*set_to_none=*/true);
    } else {
      auto scope = acc.accumulate(m);
      acc.backward(torch::mse_loss(m->forward(batch.input), batch.target));
      o.step();
      o.zero_grad();
    }
    // "add_group": after 3 steps the optimizer gets a tensor of no prepared model (which never
    // gets a gradient); a split step must then step whole, as it would have all along.
    if (mode == "add_group" && micro_step == 2) {
      o.inner().add_param_group(
          torch::optim::OptimizerParamGroup({torch::zeros({4}, torch::requires_grad())}));
    }
    ++micro_step;
  }
  REQUIRE(micro_step == steps * micro, "micro-steps " + std::to_string(micro_step));
  if (mode == "frozen") {
    torch::NoGradGuard no_grad;
    for (auto& p : m->fc1->parameters()) {
      REQUIRE(torch::equal(p, torch::full_like(p, frozen_value)),
              "a frozen parameter changed in training: " + str(p));
      p.zero_();  // the same on every rank again, for the comparison below
    }
  }
  // Every rank must hold the same weights; rank 0 writes them.
  auto weights = same_weights_everywhere(acc, *m, "ranks disagree on the weights");
  if (acc.is_main_process()) {
    std::ofstream out(out_file);
    if (mode == "wide") {  // raw float32: too many for text
      out.write(static_cast<const char*>(weights.data_ptr()),
                static_cast<std::streamsize>(weights.numel() * 4));
    } else {
      out.precision(9);
      for (int64_t i = 0; i < weights.size(0); ++i) out << weights[i].item<float>() << "\n";
    }
  }
  // "wide" saves a checkpoint too (under ZeRO its optimizer state is gathered from every rank's
  // shard in several pieces), and rank 0 writes the state the checkpoint holds, loaded into a
  // fresh optimizer, in parameter order.
  if (mode == "wide") {
    auto saved = acc.save_state(out_file + ".checkpoint");
    if (acc.is_main_process() && optimizer == "adamw") {
      auto fresh = std::make_shared<NetImpl>(1300);
      torch::optim::AdamW loaded(fresh->parameters(), torch::optim::AdamWOptions(1e-2));
      const auto file = (saved / "optimizer.safetensors").string();
      std::ifstream in(file, std::ios::binary);
      const std::string bytes((std::istreambuf_iterator<char>(in)),
                              std::istreambuf_iterator<char>());
      accel::ckpt::load_optimizer_tensors(loaded, accel::safetensors::decode(bytes, file), file,
                                          torch::kCPU);
      std::ofstream state(out_file + ".state", std::ios::binary);
      for (const auto& p : fresh->parameters()) {
        auto it = loaded.state().find(accel::detail::state_key(p));
        if (it == loaded.state().end()) {
          state << "no state\n";
          continue;
        }
        const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
        state << "step " << s.step() << "\n";
        for (const auto& t : {s.exp_avg(), s.exp_avg_sq()}) {
          REQUIRE(t.sizes() == p.sizes(), "a saved state's shape");
          state.write(static_cast<const char*>(t.contiguous().data_ptr()),
                      static_cast<std::streamsize>(t.numel() * 4));
        }
      }
    }
  }
  acc.wait_for_everyone();
  return 0;
}

// Backwards that throw halfway, each caught on every rank, through acc.backward or a plain
// loss.backward(): no reduction of theirs may land in .grad after zero_grad (gloo finishes it
// later, unless the failed round is drained), none may stay open on the progress page, and
// gradients must sync again afterwards. STEP_MS slows the later steps (for hang detection).
int backward_throws(bool plain, int step_ms) {
  accel::AcceleratorOptions options;
  options.bucket_cap_bytes = 64;  // small buckets: several are launched before the throw
  accel::Accelerator acc(options);
  auto [m, o] = prepare_small_sgd(acc);
  auto step = [&] {
    run_backward(acc, torch::mse_loss(m->forward(torch::randn({4, 6})), torch::randn({4, 2})),
                 plain);
    o.step();
    o.zero_grad();
  };
  step();  // .grad now aliases the buckets, where a late reduction would write
  for (int trial = 0; trial < 10; ++trial) {
    caught_throwing_backward(acc, *m, o, plain);
    // a reduction still in flight lands by now
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    for (auto& p : m->parameters()) {
      REQUIRE(!p.grad().defined() || p.grad().abs().max().item<float>() == 0.0f,
              "trial " + std::to_string(trial) +
                  ": a reduction of the failed backward wrote into .grad after zero_grad");
    }
    // Why not with STEP_MS: then the launcher's hang detection is what must see no open collective.
    if (step_ms == 0) {
      REQUIRE(open_collectives_on_progress_page() == 0,
              "trial " + std::to_string(trial) +
                  ": the failed backward left a collective open on the progress page");
    }
  }
  for (int k = 0; k < 5; ++k) {
    step();
    std::this_thread::sleep_for(std::chrono::milliseconds(step_ms));
  }
  same_weights_everywhere(acc, *m,
                          "ranks diverged: gradients stopped syncing after the failed backward");
  REQUIRE(open_collectives_on_progress_page() == 0,
          "a collective is still open on the progress page");
  acc.print("OK backward_throws");
  return 0;
}

int mismatch(accel::Accelerator& acc, const std::string& how) {
  acc.wait_for_everyone();
  auto shared = how == "place"
                    ? acc.state().comm().shared_zeros({{1000, torch::TensorOptions(torch::kFloat)}},
                                                      "the test's buffers")
                    : std::vector<torch::Tensor>{};
  if (acc.process_index() == 1) {
    if (how == "sleep") {
      std::this_thread::sleep_for(std::chrono::seconds(60));  // skipped the barrier and hangs
    } else if (how == "dtype") {
      acc.reduce(torch::ones({1}, torch::kLong));  // 8 bytes, like rank 0's, but int64
    } else if (how == "place") {
      auto mine = torch::zeros({1000});  // private, where rank 0's lies in shared memory
      acc.state().comm().allreduce(mine, c10d::ReduceOp::SUM);
    } else {
      acc.reduce(torch::ones({1000}));  // skipped the barrier and called another collective
    }
  } else if (how == "dtype") {
    acc.reduce(torch::ones({2}, torch::kFloat));  // 8 bytes of float32
  } else if (how == "place") {
    acc.state().comm().allreduce(shared[0], c10d::ReduceOp::SUM);
  } else {
    acc.wait_for_everyone();
  }
  return 0;
}

// Three barriers, then `hang_rank` spins in pure CPU code (outside any collective) on the first
// attempt while the others wait in a fourth barrier: what the agent's hang detection must catch.
int hang(int hang_rank) {
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  accel::Accelerator acc;
  for (int i = 0; i < 3; ++i) acc.wait_for_everyone();
  std::printf("rank %d ready\n", g_rank);
  std::fflush(stdout);
  if (g_rank == hang_rank && (restart == nullptr || std::atoi(restart) == 0)) {
    volatile unsigned long spin = 0;
    for (;;) spin = spin + 1;
  }
  acc.wait_for_everyone();
  std::printf("rank %d done\n", g_rank);
  return 0;
}

}  // namespace

// Parameters initialised differently on each rank (as set_seed(n, device_specific) makes them),
// the first layer frozen (requires_grad false): after prepare() every rank holds rank 0's values
// of every parameter, as DDP makes it. Rank 0 prints "OK equal ..." or "DIFFERENT ...".
int frozen() {
  accel::Accelerator acc;
  torch::manual_seed(static_cast<uint64_t>(100 + acc.process_index()));
  torch::nn::Sequential model(torch::nn::Linear(4, 4), torch::nn::Linear(4, 1));
  for (auto& p : model->ptr(0)->parameters()) p.requires_grad_(false);
  auto sgd =
      std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1));
  auto prepared = acc.prepare(model, sgd);
  (void)prepared;
  std::vector<torch::Tensor> flat;
  for (auto& p : model->parameters()) flat.push_back(p.detach().reshape({-1}));
  auto mine = torch::cat(flat).unsqueeze(0);
  auto all = acc.gather(mine);
  const bool same = torch::equal(all, mine.expand_as(all)) &&
                    torch::equal(all, all.narrow(0, 0, 1).expand_as(all));
  auto every = acc.reduce(torch::tensor({same ? 0.0 : 1.0}), accel::ReduceOp::kSum);
  const bool ok = every.item<double>() == 0.0;
  if (acc.is_main_process()) {
    std::printf("%s frozen and trainable parameters on %d processes\n",
                ok ? "OK equal" : "DIFFERENT", acc.num_processes());
  }
  return ok ? 0 : 1;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: runtime_worker MODE ...\n");
    return 2;
  }
  std::string mode = argv[1];
  g_rank = std::getenv("RANK") ? std::atoi(std::getenv("RANK")) : 0;
  if (mode == "collectives") {
    accel::Accelerator acc;
    return collectives(acc);
  }
  if (mode == "shard") return shard(argc, argv);
  if (mode == "frozen") return frozen();
  if (mode == "metrics") return metrics(argc, argv);
  if (mode == "train") return train(argc, argv);
  if (mode == "backward_throws" && argc > 2) {
    return backward_throws(std::string(argv[2]) == "plain", argc > 3 ? std::atoi(argv[3]) : 0);
  }
  if (mode == "hang") return hang(argc > 2 ? std::atoi(argv[2]) : 1);
  if (mode == "save_killed" && argc > 3)
    return save_killed(argv[2], std::atoi(argv[3]), argc > 4 && std::string(argv[4]) == "async");
  if (mode == "load_newest" && argc > 2)
    return load_newest(argv[2], argc > 3 ? std::atoi(argv[3]) : 0);
  if (mode == "foreign") return foreign();
  if (mode == "reentrant" && argc > 2)
    return reentrant(std::string(argv[2]) == "launched",
                     argc > 3 && std::string(argv[3]) == "plain");
  if (mode == "usr1_at" && argc > 4)
    return usr1_at(std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]));
  if (mode == "late_order" && argc > 5) {
    return late_order(std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]), argv[5]);
  }
  if (mode == "mismatch" && argc > 2) {
    accel::Accelerator acc;
    return mismatch(acc, argv[2]);
  }
  // Errors nobody catches: libaccel's terminate handler prints them and exits 1.
  if (mode == "uncaught") {
    accel::Accelerator acc;
    throw std::runtime_error("deliberately uncaught on rank " + std::to_string(g_rank));
  }
  if (mode == "config_error") {
    accel::Accelerator acc({.mixed_precision = "fp16", .cpu = true});  // fp16 needs CUDA
    return 0;
  }
  std::fprintf(stderr, "runtime_worker: unknown mode %s\n", mode.c_str());
  return 2;
}

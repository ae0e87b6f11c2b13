// bench_checkpoint: times Accelerator::save_state / load_state on a model of --mb MB with AdamW
// state (io, driven by bench_checkpoint.py), and loads such a checkpoint and prints the error if
// any (load, for trying damaged checkpoints by hand); also training with saves (stall,
// contention), copies into memory of each kind (memory) and the cost of waking another CPU
// (wake). Each prints one JSON line per result; `bench_checkpoint` alone lists the modes.
#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "accel/accel.h"
#include "examples/common/args.h"
#include "runtime/optimizer_steps.h"
#include "runtime/page_touch.h"

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

// --- io / load: a model of about --mb MB of float32 parameters
// ------------------------------------

// ceil(mb / 16) square Linear layers, each about 16 MB or less, totalling mb * 10^6 bytes.
torch::nn::Sequential big_model(int64_t mb, int64_t* width) {
  const int64_t layers = std::max<int64_t>(1, (mb + 15) / 16);
  *width = std::max<int64_t>(
      8, static_cast<int64_t>(std::sqrt(static_cast<double>(mb) * 1e6 / 4.0 / layers)));
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

// The options io wrote its checkpoint with: a GradScaler too when `scaler` is nonzero.
accel::AcceleratorOptions io_options(int64_t scaler) {
  accel::AcceleratorOptions options;
  if (scaler != 0) options.grad_scaler = accel::GradScalerOptions{};
  return options;
}

// Checkpoints into <dir>/checkpoints, 2 kept, no resume. `async_checkpoints` as a program that
// saves in the background sets it (accel-launch --async-checkpoints): the memory those saves copy
// into is made once the optimizer has its state, before the first.
accel::AcceleratorOptions saving_options(const std::string& dir, bool async_checkpoints) {
  auto options = io_options(0);
  options.project.project_dir = dir;
  options.project.total_limit = 2;
  options.project.automatic_resume = false;
  options.project.async_checkpoints = async_checkpoints;
  return options;
}

IoSetup prepare_io(accel::Accelerator& acc, int64_t mb) {
  torch::manual_seed(0);
  int64_t width = 0;
  auto model = big_model(mb, &width);
  auto opt =
      std::make_shared<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-3));
  // Why 0.99: a learning rate halved every step is a denormal float after about 117 steps,
  // whose arithmetic is many times slower; the contention mode runs more steps than that.
  auto sched = std::make_shared<torch::optim::StepLR>(*opt, 1, 0.99);
  accel::DataLoader loader(std::make_shared<accel::TensorDataset>(torch::randn({8, width})),
                           {.batch_size = 8});
  auto [m, o, dl, s] = acc.prepare(model, opt, loader, sched);
  auto counter = std::make_shared<Counter>();
  acc.register_for_checkpointing(counter);
  return {m, o, dl, s, counter};
}

// One AdamW step, so the optimizer holds exp_avg and exp_avg_sq for every parameter.
// `before_step`, when set, runs between the backward pass and the optimizer step.
void train_one_step(accel::Accelerator& acc, IoSetup& io,
                    const std::function<void()>& before_step = {}) {
  for (auto& batch : io.loader) {
    auto loss = io.model->forward(batch.input).pow(2).mean();
    acc.backward(loss);
    if (before_step) before_step();
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
  accel::examples::Args args(
      "bench_checkpoint io",
      "Times save_state and load_state of a --mb MB model with AdamW state.");
  args.flag("dir", "",
            "folder to write the checkpoint in (as <dir>/ck, left there after the last run)")
      .flag("mb", "100", "model size in MB (10^6 bytes) of float32 parameters")
      .flag("runs", "3", "save + load pairs")
      .flag("drop-caches", "0",
            "1: sync and drop the page cache before each load_state (root only)")
      .flag("scaler", "0", "1: also enable a GradScaler, so the checkpoint holds scaler.json");
  args.parse(argc, argv);
  if (args.str("dir").empty()) {
    std::fprintf(stderr, "bench_checkpoint io: --dir is required\n");
    return 2;
  }
  accel::Accelerator acc(io_options(args.integer("scaler")));
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
    for (std::size_t i = 0; i < params.size(); ++i)
      same = same && torch::equal(params[i], expected[i]);
    std::printf(
        "{\"run\": %ld, \"bytes\": %llu, \"save_s\": %.4f, \"load_s\": %.4f, \"cold_cache\": %s, "
        "\"weights_restored\": %s}\n",
        run, static_cast<unsigned long long>(bytes), save_s, load_s,
        args.integer("drop-caches") != 0 ? "true" : "false", same ? "true" : "false");
    std::fflush(stdout);
    if (!same) return 1;
  }
  return 0;
}

int run_load(int argc, char** argv) {
  accel::examples::Args args(
      "bench_checkpoint load",
      "Loads a checkpoint written by `bench_checkpoint io` and prints the error, if any.");
  args.flag("dir", "", "the checkpoint folder (e.g. <io --dir>/ck)")
      .flag("mb", "100", "the --mb the checkpoint was written with")
      .flag("scaler", "0", "the --scaler the checkpoint was written with");
  args.parse(argc, argv);
  accel::Accelerator acc(io_options(args.integer("scaler")));
  auto io = prepare_io(acc, args.integer("mb"));
  try {
    auto dir = acc.load_state(args.str("dir"));
    std::printf("{\"loaded\": %s, \"step\": %lld, \"counter\": %lld}\n",
                quoted(dir.string()).c_str(), static_cast<long long>(acc.completed_steps()),
                static_cast<long long>(io.counter->value));
    return 0;
  } catch (const accel::CheckpointError& e) {
    std::printf("{\"error\": \"CheckpointError\", \"message\": %s}\n", quoted(e.what()).c_str());
    return 1;
  }
}

// Training with a checkpoint every --every steps, each saved in the foreground (sync), in the
// background (async), or not at all (none): the difference in wall time between these runs is
// what the saves cost training.
int run_stall(int argc, char** argv) {
  accel::examples::Args args("bench_checkpoint stall",
                             "Times --steps training steps of a --mb MB model with AdamW, saving "
                             "a checkpoint every --every steps.");
  args.flag("dir", "", "the project folder (checkpoints in <dir>/checkpoints, 2 kept)")
      .flag("mb", "100", "model size in MB (10^6 bytes) of float32 parameters")
      .flag("steps", "24", "training steps")
      .flag("every", "6", "steps between checkpoints")
      .flag("save", "sync",
            "sync, async (with async_checkpoints on), async-fresh (without: the first save copies "
            "into new memory) or none");
  args.parse(argc, argv);
  const std::string save = args.str("save");
  if (args.str("dir").empty() ||
      (save != "sync" && save != "async" && save != "async-fresh" && save != "none")) {
    std::fprintf(stderr,
                 "bench_checkpoint stall: needs --dir and --save sync|async|async-fresh|none\n");
    return 2;
  }
  accel::Accelerator acc(saving_options(args.str("dir"), save == "async"));
  auto io = prepare_io(acc, args.integer("mb"));
  train_one_step(acc, io);  // the optimizer state exists before the clock starts
  const long steps = args.integer("steps"), every = args.integer("every");
  long saves = 0;
  double longest_call = 0;  // the longest save_state call: how long training stood still
  // Each step just after a save (where a background save's copy is waited for), in order, and
  // the time of all the other steps.
  std::string after_saves;
  double other_steps_s = 0;
  bool after_save = false;
  auto start = Clock::now();
  for (long step = 1; step <= steps; ++step) {
    auto began = Clock::now();
    train_one_step(acc, io);
    const double took = seconds_since(began);
    if (after_save) {
      after_saves += (after_saves.empty() ? "" : ", ") + std::to_string(took);
    } else {
      other_steps_s += took;
    }
    after_save = false;
    // Why none at the last step: a run's end waits for its last background write, which no
    // training could hide; the saves measured are those of a run that goes on.
    if (save != "none" && step % every == 0 && step < steps) {
      auto call = Clock::now();
      acc.save_state({}, {.async = save != "sync"});
      longest_call = std::max(longest_call, seconds_since(call));
      ++saves;
      after_save = true;
    }
  }
  acc.wait_for_checkpoint();
  double seconds = seconds_since(start);
  // This process's peak resident memory (VmHWM): under ZeRO (accel-launch -n N with
  // ACCEL_ZERO_STAGE=1), what a save adds to each rank shows against --save none.
  long peak_kb = 0;
  {
    std::ifstream status("/proc/self/status");
    for (std::string line; std::getline(status, line);)
      if (line.rfind("VmHWM:", 0) == 0) peak_kb = std::stol(line.substr(6));
  }
  std::printf(
      "{\"save\": %s, \"rank\": %d, \"steps\": %ld, \"saves\": %ld, \"seconds\": %.4f, "
      "\"longest_save_call_s\": %.4f, \"steps_after_saves_s\": [%s], "
      "\"mean_other_step_s\": %.4f, \"peak_rss_mb\": %.1f}\n",
      quoted(save).c_str(), acc.process_index(), steps, saves, seconds, longest_call,
      after_saves.c_str(), steps > saves ? other_steps_s / static_cast<double>(steps - saves) : 0.0,
      static_cast<double>(peak_kb) / 1024.0);
  return 0;
}

// What a copy of --mb MB costs on this machine by where it goes: memory touched before, new
// memory (a page fault every page), new memory populated first by the kernel, new memory stored
// into first from this program (a page each), and new memory asking for huge pages (the first
// time in the process and again). Why: a background save's first copy goes
// into new memory unless async_checkpoints made it before.
int run_memory(int argc, char** argv) {
  accel::examples::Args args("bench_checkpoint memory",
                             "Times a copy of --mb MB into memory of each kind.");
  args.flag("mb", "300", "bytes copied, in MB (10^6 bytes)");
  args.parse(argc, argv);
  const std::size_t n = static_cast<std::size_t>(args.integer("mb")) * 1000000;
  std::vector<char> from(n, 1);
  auto map = [n] {
    void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("mmap failed");
    return static_cast<char*>(p);
  };
  auto ms = [](Clock::time_point t) { return seconds_since(t) * 1000; };
  // Why before each timed copy: on a VM whose hypervisor shadows the guest's page tables, an
  // munmap of several MiB (the last case's) drops the mappings of the whole process, and the
  // copy would time the source's faults too.
  auto map_source_again = [&from] {
    volatile char sink = 0;
    for (std::size_t at = 0; at < from.size(); at += 4096) sink = sink + from[at];
  };
  std::string out;
  auto add = [&out](const char* key, double value) {
    out += std::string(out.empty() ? "" : ", ") + "\"" + key + "\": " + std::to_string(value);
  };
  {
    char* to = map();
    std::memcpy(to, from.data(), n);  // touched
    map_source_again();
    auto t = Clock::now();
    std::memcpy(to, from.data(), n);
    add("touched_ms", ms(t));
    ::munmap(to, n);
  }
  {
    map_source_again();
    auto t = Clock::now();
    char* to = map();
    std::memcpy(to, from.data(), n);
    add("new_ms", ms(t));
    ::munmap(to, n);
  }
  // New memory made one way first (`make` on the mapping), then copied into: the making, the
  // copy alone, and both.
  auto made_then_copied = [&](const char* made, const char* copied, const char* both, auto make) {
    map_source_again();
    auto t = Clock::now();
    char* to = map();
    make(to);
    add(made, ms(t));
    auto copy = Clock::now();
    std::memcpy(to, from.data(), n);
    add(copied, ms(copy));
    add(both, ms(t));
    ::munmap(to, n);
  };
  made_then_copied("populate_ms", "copy_after_populate_ms", "populated_then_copy_ms",
                   [n](char* to) {
                     // Linux 5.14; without it the copy faults
                     (void)::madvise(to, n, MADV_POPULATE_WRITE);
                   });
  // As libaccel makes the memory of background saves (async_checkpoints): a locked "or 0" into
  // every page from the program, which changes no byte.
  made_then_copied("store_ms", "copy_after_store_ms", "stored_then_copy_ms", [n](char* to) {
    for (std::size_t at = 0; at < n; at += 4096) accel::ckpt::touch_for_writing(to + at);
  });
  for (const char* key : {"huge_pages_first_ms", "huge_pages_again_ms"}) {
    map_source_again();
    auto t = Clock::now();
    char* to = map();
    (void)::madvise(to, n, MADV_HUGEPAGE);
    std::memcpy(to, from.data(), n);
    add(key, ms(t));
    ::munmap(to, n);
  }
  // Into memory touched before, the copy just after an munmap of 64 MiB elsewhere (on a VM that
  // shadows page tables, it drops every mapping of the process); and checkpoint-like reads: the
  // bytes written to a file (in the page cache), then read through a mapping as load_state
  // does, populated by the kernel first (MAP_POPULATE) or not (MADV_WILLNEED, as libaccel).
  {
    char* to = map();
    std::memcpy(to, from.data(), n);
    auto touch_again = [&] {
      map_source_again();
      for (std::size_t at = 0; at < n; at += 4096) accel::ckpt::touch_for_writing(to + at);
    };
    touch_again();
    const std::size_t other = std::size_t{64} << 20;
    char* elsewhere = static_cast<char*>(
        ::mmap(nullptr, other, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (elsewhere == MAP_FAILED) throw std::runtime_error("mmap failed");
    std::memset(elsewhere, 1, other);
    ::munmap(elsewhere, other);
    auto t = Clock::now();
    std::memcpy(to, from.data(), n);
    add("copy_after_munmap_64mib_ms", ms(t));
    const fs::path file =
        fs::temp_directory_path() / ("bench_checkpoint_memory." + std::to_string(::getpid()));
    {
      std::ofstream f(file, std::ios::binary);
      f.write(from.data(), static_cast<std::streamsize>(n));
      if (!f) throw std::runtime_error("cannot write " + file.string());
    }
    for (const bool populate : {true, false}) {
      const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) throw std::runtime_error("cannot open " + file.string());
      touch_again();
      auto r = Clock::now();
      void* p = ::mmap(nullptr, n, PROT_READ, MAP_PRIVATE | (populate ? MAP_POPULATE : 0), fd, 0);
      ::close(fd);
      if (p == MAP_FAILED) throw std::runtime_error("cannot map " + file.string());
      if (!populate) (void)::madvise(p, n, MADV_WILLNEED);
      std::memcpy(to, p, n);
      add(populate ? "read_mapped_populated_ms" : "read_mapped_ms", ms(r));
      ::munmap(p, n);
    }
    fs::remove(file);
    ::munmap(to, n);
  }
  std::printf("{\"mb\": %lld, %s}\n", static_cast<long long>(args.integer("mb")), out.c_str());
  return 0;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// A 95% interval of the median of `v` that assumes nothing of its distribution: the order
// statistics of ranks floor(n/2 - 0.98 sqrt(n)) and ceil(1 + n/2 + 0.98 sqrt(n)), counted from
// 1 (the normal approximation of the binomial). Below 6 values that is the whole range, which
// covers the median less often than 95% (94% with 5, 50% with 2).
std::pair<double, double> median_interval(std::vector<double> v) {
  if (v.empty()) return {0.0, 0.0};
  std::sort(v.begin(), v.end());
  const double n = static_cast<double>(v.size()), half = 0.98 * std::sqrt(n);
  const double lo = std::max(1.0, std::floor(n / 2 - half));
  const double hi = std::min(n, std::ceil(1 + n / 2 + half));
  return {v[static_cast<std::size_t>(lo) - 1], v[static_cast<std::size_t>(hi) - 1]};
}

// Whether `side` (0 or 1) of a paired round is the quiet one (no copy, no save, no thread): the
// first in even rounds, the second in odd ones, so that neither side always runs first.
bool quiet_side(long round, int side) { return (side == 0) == (round % 2 == 0); }

// What a background save costs training, in one process so that the machine's drift cancels.
// First its copy alone: the weights and the optimizer's state (a checkpoint's bytes) copied into
// memory touched before, on another thread while a training step runs, as the writer thread
// copies them, with no checksum and no write. Rounds of two steps, one alone and one alongside
// such a copy; the medians of each and of the copy's time. With --dir, also whole background
// saves (below).
int run_contention(int argc, char** argv) {
  accel::examples::Args args("bench_checkpoint contention",
                             "Times training steps of a --mb MB model with AdamW, alone and "
                             "alongside a copy of its weights and state on another thread.");
  args.flag("mb", "100", "model size in MB (10^6 bytes) of float32 parameters")
      .flag("rounds", "15", "pairs of steps: one alone, one alongside a copy")
      .flag("dir", "",
            "also, in as many rounds: --every steps just after a background save_state (into "
            "<dir>/checkpoints, 2 kept) against as many steps without a save in flight")
      .flag("every", "6", "steps after each background save (with --dir)");
  args.parse(argc, argv);
  const std::string dir = args.str("dir");
  if (!dir.empty() && args.integer("every") < 1) {
    std::fprintf(stderr, "bench_checkpoint contention: --every must be at least 1\n");
    return 2;
  }
  accel::Accelerator acc(dir.empty() ? io_options(0) : saving_options(dir, true));
  auto io = prepare_io(acc, args.integer("mb"));
  train_one_step(acc, io);  // the optimizer state exists from here
  std::vector<torch::Tensor> live;
  for (const auto& p : io.model->parameters()) {
    live.push_back(p.detach());
    auto& state = io.optimizer.inner().state();
    auto it = state.find(accel::detail::state_key(p));
    if (it == state.end()) continue;
    auto& adam = static_cast<torch::optim::AdamWParamState&>(*it->second);
    live.push_back(adam.exp_avg());
    live.push_back(adam.exp_avg_sq());
  }
  std::vector<torch::Tensor> buffers;
  std::size_t bytes = 0;
  for (const auto& t : live) {
    buffers.push_back(torch::ones_like(t));  // touched, as the buffers a save keeps
    bytes += t.nbytes();
  }
  auto copy = [&] {
    for (std::size_t i = 0; i < live.size(); ++i)
      std::memcpy(buffers[i].data_ptr(), live[i].data_ptr(), live[i].nbytes());
  };
  copy();
  train_one_step(acc, io);
  std::vector<double> alone, alongside, copies;
  for (long round = 0; round < args.integer("rounds"); ++round) {
    for (int side = 0; side < 2; ++side) {
      if (quiet_side(round, side)) {
        auto began = Clock::now();
        train_one_step(acc, io);
        alone.push_back(seconds_since(began));
        continue;
      }
      // As a background save's writer: a thread that copies from the start of the step, which
      // waits for it before the optimizer step changes what it copies.
      double copy_s = 0;
      auto began = Clock::now();
      std::jthread copier([&] {
        auto t = Clock::now();
        copy();
        copy_s = seconds_since(t);
      });
      train_one_step(acc, io, [&copier] { copier.join(); });
      alongside.push_back(seconds_since(began));
      copies.push_back(copy_s);
    }
  }
  // A whole background save: `every` steps begun just after save_state (its call included),
  // against `every` steps with no save in flight; and how long a save's write went on after its
  // `every` steps (a cost those steps do not show).
  // Also each step's time by its place after the save (and in the quiet run), and the save_state
  // call's own: where the cost lands.
  std::vector<double> with_save, without_save, outlasted, calls;
  const long every = args.integer("every");
  std::vector<std::vector<double>> step_with(static_cast<std::size_t>(every)),
      step_without(static_cast<std::size_t>(every));
  for (long round = 0; !dir.empty() && round < args.integer("rounds"); ++round) {
    for (int side = 0; side < 2; ++side) {
      auto began = Clock::now();
      if (quiet_side(round, side)) {
        for (long i = 0; i < every; ++i) {
          auto t = Clock::now();
          train_one_step(acc, io);
          step_without[static_cast<std::size_t>(i)].push_back(seconds_since(t));
        }
        without_save.push_back(seconds_since(began));
        continue;
      }
      acc.save_state({}, {.async = true});
      calls.push_back(seconds_since(began));
      for (long i = 0; i < every; ++i) {
        auto t = Clock::now();
        train_one_step(acc, io);
        step_with[static_cast<std::size_t>(i)].push_back(seconds_since(t));
      }
      with_save.push_back(seconds_since(began));
      began = Clock::now();
      acc.wait_for_checkpoint();
      outlasted.push_back(seconds_since(began));
    }
  }
  std::string saves;
  if (!dir.empty()) {
    std::vector<double> cost;
    for (std::size_t i = 0; i < with_save.size(); ++i)
      cost.push_back(with_save[i] - without_save[i]);
    const auto [cost_lo, cost_hi] = median_interval(cost);
    char buf[200];
    std::snprintf(buf, sizeof buf,
                  ", \"steps_after_save_ms\": %.2f, \"steps_without_ms\": %.2f, "
                  "\"save_cost_ms\": %.2f, \"write_outlasted_ms\": %.2f",
                  median(with_save) * 1000, median(without_save) * 1000, median(cost) * 1000,
                  median(outlasted) * 1000);
    saves = buf;
    saves += ", \"save_cost_interval_ms\": [" + std::to_string(cost_lo * 1000) + ", " +
             std::to_string(cost_hi * 1000) + "]";
    saves +=
        ", \"save_call_ms\": " + std::to_string(median(calls) * 1000) + ", \"per_step_cost_ms\": [";
    for (std::size_t i = 0; i < step_with.size(); ++i) {
      std::vector<double> d;
      for (std::size_t r = 0; r < step_with[i].size(); ++r)
        d.push_back(step_with[i][r] - step_without[i][r]);
      saves += (i ? ", " : "") + std::to_string(median(d) * 1000);
    }
    saves += "]";
  }
  std::printf(
      "{\"mb\": %lld, \"copied_mb\": %.1f, \"rounds\": %ld, \"step_alone_ms\": %.2f, "
      "\"step_alongside_copy_ms\": %.2f, \"copy_ms\": %.2f%s}\n",
      static_cast<long long>(args.integer("mb")), static_cast<double>(bytes) / 1e6,
      args.integer("rounds"), median(alone) * 1000, median(alongside) * 1000, median(copies) * 1000,
      saves.c_str());
  return 0;
}

// The cost to a training step of waking another CPU. Each side of a round begins with an untimed
// step during which a thread runs (the wake), then --idle-steps steps with no thread, then the
// timed step: alone on one side, on the other with a thread that works --spin-ms once it runs (0:
// it starts and ends at once). The same again with no idle steps (a thread a step before). The
// threads are started as a background save starts its writer: new threads, placed by the
// scheduler, not pinned, since that is what a save pays. Each notes whether it ran on a CPU other
// than the training thread's, and the mode prints how many did, per case. Expected near zero
// where a CPU that wakes takes nothing from one that runs. Measured on a 2-vCPU VM (a nested
// guest whose kernel boots with sched_vcpu_pack=15) where, after the other vCPU had idled, it was
// not: presumably the host runs a vCPU that wakes on the core of the busy one for a while, which
// the guest does not count as steal time. Meaningful only where training leaves a CPU idle
// (OMP_NUM_THREADS=1; without it OpenBLAS's threads keep the other CPU busy).
int run_wake(int argc, char** argv) {
  accel::examples::Args args("bench_checkpoint wake",
                             "Times a training step of a --mb MB model alone and while a short "
                             "thread runs, after idle steps and without (run it with "
                             "OMP_NUM_THREADS=1, so that training leaves a CPU idle).");
  args.flag("mb", "100", "model size in MB (10^6 bytes) of float32 parameters")
      .flag("rounds", "12", "pairs of timed steps for each of the two cases")
      .flag("idle-steps", "12", "steps with no thread before each timed step, in the first case")
      .flag("spin-ms", "0", "how long the thread works once it runs, in milliseconds (0: no work)");
  args.parse(argc, argv);
  if (args.integer("rounds") < 1 || args.integer("idle-steps") < 0 || args.integer("spin-ms") < 0) {
    std::fprintf(stderr,
                 "bench_checkpoint wake: --rounds must be at least 1, --idle-steps and --spin-ms "
                 "at least 0\n");
    return 2;
  }
  accel::Accelerator acc(io_options(0));
  auto io = prepare_io(acc, args.integer("mb"));
  for (int i = 0; i < 3; ++i) train_one_step(acc, io);
  const auto spin = std::chrono::milliseconds(args.integer("spin-ms"));
  // A step with a thread, joined before its optimizer step (as a save's copy is). True when the
  // thread ran on a CPU other than the one the training thread was on when it started it.
  auto step_with_thread = [&](std::chrono::milliseconds work) {
    const int training_cpu = ::sched_getcpu();
    int its_cpu = -1;
    std::jthread other([&its_cpu, work] {
      its_cpu = ::sched_getcpu();
      const auto from = Clock::now();
      volatile uint64_t spins = 0;
      while (Clock::now() - from < work) spins = spins + 1;
    });
    train_one_step(acc, io, [&other] {
      if (other.joinable()) other.join();
    });
    if (other.joinable()) other.join();  // a loader that yielded no batch
    return its_cpu >= 0 && its_cpu != training_cpu;
  };
  // One case: the median of the rounds' differences and its interval, and how many of the
  // threads (the wakes and the timed ones) ran on another CPU.
  struct Case {
    double cost_ms = 0;
    std::pair<double, double> interval;
    long threads = 0, elsewhere = 0;
  };
  auto measure = [&](long idle_steps) {
    Case out;
    std::vector<double> differences;
    auto count = [&out](bool elsewhere) {
      ++out.threads;
      if (elsewhere) ++out.elsewhere;
    };
    for (long round = 0; round < args.integer("rounds"); ++round) {
      double alone = 0, with_thread = 0;
      for (int side = 0; side < 2; ++side) {
        count(step_with_thread(std::chrono::milliseconds(0)));  // the wake
        for (long i = 0; i < idle_steps; ++i) train_one_step(acc, io);
        const auto began = Clock::now();
        if (quiet_side(round, side)) {
          train_one_step(acc, io);
          alone = seconds_since(began);
        } else {
          count(step_with_thread(spin));
          with_thread = seconds_since(began);
        }
      }
      differences.push_back((with_thread - alone) * 1000);
    }
    out.cost_ms = median(differences);
    out.interval = median_interval(differences);
    return out;
  };
  const Case idle = measure(args.integer("idle-steps"));
  const Case busy = measure(0);
  std::printf(
      "{\"mb\": %lld, \"rounds\": %lld, \"idle_steps\": %lld, \"spin_ms\": %lld, "
      "\"cost_after_idle_ms\": %.2f, \"cost_after_idle_interval_ms\": [%.2f, %.2f], "
      "\"threads_after_idle\": %ld, \"on_another_cpu_after_idle\": %ld, "
      "\"cost_without_idle_ms\": %.2f, \"cost_without_idle_interval_ms\": [%.2f, %.2f], "
      "\"threads_without_idle\": %ld, \"on_another_cpu_without_idle\": %ld}\n",
      static_cast<long long>(args.integer("mb")), static_cast<long long>(args.integer("rounds")),
      static_cast<long long>(args.integer("idle-steps")),
      static_cast<long long>(args.integer("spin-ms")), idle.cost_ms, idle.interval.first,
      idle.interval.second, idle.threads, idle.elsewhere, busy.cost_ms, busy.interval.first,
      busy.interval.second, busy.threads, busy.elsewhere);
  return 0;
}

void usage(std::FILE* out) {
  std::fprintf(
      out,
      "usage: bench_checkpoint io|stall|load|memory|contention|wake [flags]\n"
      "  (bench_checkpoint MODE --help for the flags)\n"
      "  io    time save_state/load_state of a --mb MB model with AdamW state\n"
      "  stall time training with a checkpoint every few steps: sync, async, async-fresh or none\n"
      "  load  load a checkpoint written by io and print the error, if any\n"
      "  memory time a copy into memory touched before, new, populated, or in huge pages\n"
      "  contention time training steps alone and alongside a copy of the weights and state\n"
      "  wake  time a training step alone and while a new thread runs, after idle steps or not\n");
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
  if (mode == "stall") return run_stall(argc - 1, argv + 1);
  if (mode == "memory") return run_memory(argc - 1, argv + 1);
  if (mode == "contention") return run_contention(argc - 1, argv + 1);
  if (mode == "wake") return run_wake(argc - 1, argv + 1);
  usage(mode == "--help" || mode == "-h" ? stdout : stderr);
  return mode == "--help" || mode == "-h" ? 0 : 2;
}

// accel-check: the worker program behind `accel test`, and the libtorch half of `accel env`.
//
//   accel-check --info   libtorch's version and build as Markdown (accel env runs it)
//   accel-check          under accel-launch: checks the worker environment, the collectives,
//                        training against one process on the global batch, a checkpoint round
//                        trip, and (with --max-restarts >= 1) that a failed worker is restarted.
//
// Rank 0 prints one line per check, "ACCEL-CHECK<TAB>attempt<TAB>name<TAB>PASS|FAIL<TAB>detail",
// which `accel test` reads from the launcher's output (so it works wherever rank 0 runs). In the
// first attempt the last rank then exits with code 3 on purpose: the launcher must restart the
// group, and the next attempt reports the restart. Exits 1 when a check failed.
#include <torch/torch.h>
#include <torch/version.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>

#include "accel/accel.h"
#include "contract/worker_contract.h"
#include "runtime/blas_kernels.h"
#include "runtime/cpu_precision.h"
#include "runtime/product_threads.h"

#if __has_include(<ATen/Version.h>)
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#define ACCEL_HAVE_SHOW_CONFIG 1
#endif

namespace {

namespace fs = std::filesystem;
namespace c = accel::contract;

struct Result {
  std::string name;
  bool ok = true;
  std::string detail;
};

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : v;
}

int env_int(const char* name, int fallback) {
  std::string v = env(name);
  if (v.empty()) return fallback;
  try {
    return std::stoi(v);
  } catch (const std::exception&) {
    return fallback;
  }
}

std::string number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

std::string one_line(std::string s) {
  for (char& ch : s) {
    if (ch == '\n' || ch == '\t' || ch == '\r') ch = ' ';
  }
  return s;
}

int info() {
  std::cout << "## libtorch\n\n";
  std::cout << "- version: " << TORCH_VERSION << "\n";
  std::cout << "- CUDA: "
            << (torch::cuda::is_available()
                    ? "available, " + std::to_string(torch::cuda::device_count()) + " device(s)"
                    : std::string("not available (a CPU-only build, or no GPU)"))
            << "\n";
  // The BLAS libtorch really calls: Debian's libtorch says BLAS_INFO=generic and loads
  // libblas.so.3, whichever implementation the alternatives system points that at.
  std::ifstream maps("/proc/self/maps");
  std::set<std::string> blas;
  for (std::string line; std::getline(maps, line);) {
    auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    std::string path = line.substr(slash);
    std::string name = fs::path(path).filename().string();
    if (name.find("blas") != std::string::npos || name.find("mkl_") != std::string::npos) {
      std::error_code ec;
      auto real = fs::canonical(path, ec);
      blas.insert(ec ? path : real.string());
    }
  }
  // Why read before the switch: the switch sets OPENBLAS_CORETYPE, and the line below must say
  // whether the user had.
  const char* chosen = std::getenv("OPENBLAS_CORETYPE");
  const std::string user_kernels = chosen != nullptr ? chosen : "";
  // Why switch here, as a worker does, before timing bf16 against fp32: fp32 on older kernels
  // would make bf16 look faster here than it is in training.
  const auto& kernels = accel::blas_kernels::upgrade_if_behind();
  const std::string core =
      kernels.tried.empty() ? accel::blas_kernels::current_core() : kernels.from;
  std::cout << "- bf16 on this CPU"
            << (kernels.switched()
                    ? " (timed on OpenBLAS's " + kernels.to + " kernels, as a worker runs)"
                    : std::string())
            << ": " << accel::cpu_precision::speed_text(accel::cpu_precision::measure_step())
            << "\n";
  std::cout << "- BLAS loaded:";
  if (blas.empty()) std::cout << " none found in /proc/self/maps";
  for (const auto& b : blas) std::cout << " " << b;
  std::cout << "\n";
  if (!core.empty()) {
    std::cout << "- OpenBLAS kernels: " << core;
    if (chosen != nullptr) {
      std::cout << " (OPENBLAS_CORETYPE=" << user_kernels << ")";
    } else if (kernels.switched()) {
      std::cout << ", made for older CPUs than this one: libaccel switches its workers to "
                << kernels.to
                << " when they start (other programs: OPENBLAS_CORETYPE=" << kernels.to << ")";
    } else if (!kernels.tried.empty()) {
      std::cout << ", made for older CPUs than this one; this OpenBLAS has no " << kernels.tried
                << " kernels to switch to";
    }
    std::cout << "\n";
  }
  const auto threads = accel::product_threads::current();
  if (threads.blas > 0) {
    std::cout << "- OpenBLAS threads: " << threads.blas
              << " (ATen's intra-op threads: " << threads.aten
              << "; OMP_NUM_THREADS sets both, OPENBLAS_NUM_THREADS OpenBLAS's; accel-launch "
                 "gives each of several workers on a node OMP_NUM_THREADS=1)\n";
  }
#ifdef ACCEL_HAVE_SHOW_CONFIG
  std::cout << "\n```\n"
            << at::show_config() << "```\n\n```\n"
            << at::get_parallel_info() << "```\n";
#endif
  return 0;
}

// Every variable of the worker contract is set and consistent with the process group; across
// ranks, the ranks are a permutation and every rank agrees on the rendezvous address.
Result check_contract(accel::Accelerator& acc) {
  Result r{"environment contract", true, {}};
  std::vector<std::string> problems;
  for (const char* name : {c::kRank, c::kLocalRank, c::kGroupRank, c::kWorldSize,
                           c::kLocalWorldSize, c::kGroupWorldSize, c::kMasterAddr, c::kMasterPort,
                           c::kRestartCount, c::kMaxRestarts, c::kRunId}) {
    if (env(name).empty()) problems.push_back(std::string(name) + " is not set");
  }
  int rank = env_int(c::kRank, -1), world = env_int(c::kWorldSize, -1);
  int local = env_int(c::kLocalRank, -1), local_world = env_int(c::kLocalWorldSize, -1);
  int port = env_int(c::kMasterPort, -1);
  if (rank != acc.process_index()) problems.push_back("RANK differs from the process group's");
  if (world != acc.num_processes())
    problems.push_back("WORLD_SIZE differs from the process group's");
  if (local < 0 || local >= local_world)
    problems.push_back("LOCAL_RANK is outside 0..LOCAL_WORLD_SIZE-1");
  if (port < 1 || port > 65535) problems.push_back("MASTER_PORT is not a port");
  std::string mine = env(c::kMasterAddr) + ":" + env(c::kMasterPort) + "|" + env(c::kGroupRank) +
                     "/" + std::to_string(local);
  auto all = acc.gather_object(std::to_string(rank) + "|" + mine);
  if (acc.is_main_process()) {
    std::vector<bool> seen(static_cast<size_t>(std::max(world, 0)), false);
    std::vector<std::string> slots;
    for (const auto& entry : all) {
      int r0 = std::atoi(entry.c_str());
      if (r0 < 0 || r0 >= world || seen[static_cast<size_t>(r0)]) {
        problems.push_back("RANK " + std::to_string(r0) + " is repeated or out of range");
      } else {
        seen[static_cast<size_t>(r0)] = true;
      }
      std::string rest = entry.substr(entry.find('|') + 1);
      if (rest.substr(0, rest.find('|')) != mine.substr(0, mine.find('|')))
        problems.push_back("ranks disagree on MASTER_ADDR:MASTER_PORT");
      slots.push_back(rest.substr(rest.find('|') + 1));
    }
    std::sort(slots.begin(), slots.end());
    if (std::adjacent_find(slots.begin(), slots.end()) != slots.end())
      problems.push_back("two ranks share a (GROUP_RANK, LOCAL_RANK)");
  }
  r.ok = problems.empty();
  r.detail = r.ok ? "RANK 0.." + std::to_string(world - 1) + ", LOCAL_WORLD_SIZE " +
                        std::to_string(local_world) + ", MASTER_ADDR:PORT " + env(c::kMasterAddr) +
                        ":" + env(c::kMasterPort)
                  : problems.front();
  return r;
}

// Each collective against the value it must give. ACCEL_CHECK_FAULT=collective makes the last
// rank send a wrong value, as a broken transport would (accel test's own test uses it).
Result check_collectives(accel::Accelerator& acc) {
  Result r{"collectives", true, {}};
  const int world = acc.num_processes();
  const int rank = acc.process_index();
  std::vector<std::string> problems;
  // On the training device: on a GPU the collectives run through NCCL (or gloo) on CUDA tensors.
  const auto on = torch::TensorOptions().device(acc.device());
  auto mine = torch::full({3}, static_cast<float>(rank + 1), on);
  if (env("ACCEL_CHECK_FAULT") == "collective" && acc.is_last_process()) mine += 1000;
  auto sum = acc.reduce(mine, accel::ReduceOp::kSum).cpu();
  float expect_sum = static_cast<float>(world * (world + 1) / 2);
  if (!torch::allclose(sum, torch::full({3}, expect_sum)))
    problems.push_back("all-reduce sum gave " + number(sum[0].item<float>()) + ", expected " +
                       number(expect_sum));
  auto gathered = acc.gather(mine.unsqueeze(0)).cpu();
  auto expect_gather =
      torch::arange(1, world + 1, torch::kFloat).unsqueeze(1).expand({world, 3}).contiguous();
  if (!gathered.sizes().equals(expect_gather.sizes()) || !torch::equal(gathered, expect_gather))
    problems.push_back("all-gather did not give every rank's tensor in rank order");
  auto from_last = acc.broadcast(torch::full({2}, static_cast<float>(rank), on), world - 1).cpu();
  if (!torch::equal(from_last, torch::full({2}, static_cast<float>(world - 1))))
    problems.push_back("broadcast from the last rank gave another value");
  auto padded = acc.pad_across_processes(torch::ones({rank + 1}, on), 0).cpu();
  if (padded.size(0) != world || padded.sum().item<float>() != static_cast<float>(rank + 1))
    problems.push_back("pad_across_processes did not pad to the longest rank's size");
  auto objects = acc.gather_object("rank " + std::to_string(rank));
  for (int i = 0; i < world; ++i) {
    if (objects.size() != static_cast<size_t>(world) ||
        objects[static_cast<size_t>(i)] != "rank " + std::to_string(i)) {
      problems.push_back("gather_object did not give every rank's string in rank order");
      break;
    }
  }
  r.ok = problems.empty();
  r.detail = r.ok ? "all-reduce, all-gather, broadcast, pad_across_processes, gather_object "
                    "gave the expected values (" +
                        acc.state().backend() + ", " + acc.device().str() + ")"
                  : problems.front();
  return r;
}

torch::nn::Sequential make_model() {
  torch::manual_seed(7);
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 1));
}

// A few SGD steps on the sharded loader against the same steps, on one process, on the whole
// global batch: the averaged gradients must give the same parameters.
Result check_training(accel::Accelerator& acc, torch::nn::Sequential& model,
                      accel::PreparedOptimizer& opt, accel::DataLoader& loader,
                      const torch::Tensor& x, const torch::Tensor& y, int64_t batch) {
  Result r{"training matches 1 process", true, {}};
  int64_t steps = 0;
  for (auto& b : loader) {
    auto loss = torch::mse_loss(model->forward(b.input), b.target);
    acc.backward(loss);
    opt.step();
    opt.zero_grad();
    ++steps;
  }
  auto reference = make_model();
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1));
  const int64_t global = batch * acc.num_processes();
  for (int64_t k = 0; k < steps; ++k) {
    auto xs = x.slice(0, k * global, (k + 1) * global);
    auto ys = y.slice(0, k * global, (k + 1) * global);
    ref_opt.zero_grad();
    torch::mse_loss(reference->forward(xs), ys).backward();
    ref_opt.step();
  }
  double worst = 0;
  auto mine = model->parameters();
  auto ref = reference->parameters();
  for (size_t i = 0; i < mine.size(); ++i) {
    worst = std::max(worst, (mine[i].detach().cpu() - ref[i].detach()).abs().max().item<double>());
  }
  char buf[160];
  std::snprintf(buf, sizeof buf,
                "%lld steps of global batch %lld: largest parameter difference %.1e (limit 1e-5)",
                static_cast<long long>(steps), static_cast<long long>(global), worst);
  r.ok = steps > 0 && worst <= 1e-5;
  r.detail = steps > 0 ? buf : "the prepared loader gave no batch";
  return r;
}

// save_state, spoil the parameters, load_state: every parameter is back, bit for bit.
Result check_checkpoint(accel::Accelerator& acc, torch::nn::Sequential& model,
                        const fs::path& dir) {
  Result r{"checkpoint round trip", true, {}};
  try {
    acc.save_state(dir);
    std::vector<torch::Tensor> saved;
    {
      torch::NoGradGuard no_grad;
      for (auto& p : model->parameters()) {
        saved.push_back(p.detach().clone());
        p.add_(1.0);
      }
    }
    int64_t steps = acc.completed_steps();
    acc.load_state(dir);
    auto now = model->parameters();
    for (size_t i = 0; i < saved.size(); ++i) {
      if (!torch::equal(saved[i], now[i].detach())) {
        r.ok = false;
        r.detail = "parameter " + std::to_string(i) + " differs after load_state";
        return r;
      }
    }
    r.detail = "save_state + load_state restored " + std::to_string(saved.size()) +
               " parameters bit for bit (step " + std::to_string(steps) + ")";
  } catch (const std::exception& e) {
    r.ok = false;
    r.detail = one_line(e.what());
  }
  return r;
}

int run_checks() {
  // Settings that would make the comparison with one process inexact, or touch the user's
  // checkpoints, are fixed here whatever the configuration says.
  accel::AcceleratorOptions options;
  options.mixed_precision = "no";
  options.gradient_accumulation_steps = 1;
  options.project.automatic_resume = false;
  options.project.save_interval = 0;
  accel::Accelerator acc(options);
  const int attempt = env_int(c::kRestartCount, 0);
  const int world = acc.num_processes();

  std::vector<Result> results;
  results.push_back(check_contract(acc));
  results.push_back(check_collectives(acc));

  const int64_t batch = 4, steps = 3;
  torch::manual_seed(1234);
  auto x = torch::randn({batch * world * steps, 8});
  auto y = x.sum(1, true).sin();
  auto model = make_model();
  auto sgd =
      std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1));
  accel::DataLoader loader(std::make_shared<accel::TensorDataset>(x, y),
                           {.batch_size = static_cast<std::size_t>(batch), .shuffle = false});
  auto [m, o, dl] = acc.prepare(model, sgd, loader);
  results.push_back(check_training(acc, model, o, dl, x, y, batch));

  // One folder for every rank: ACCEL_CHECK_DIR (accel test sets it), else a new one under the
  // main process's temporary folder.
  std::string base = env("ACCEL_CHECK_DIR");
  if (base.empty()) {
    base = acc.broadcast_object(
        acc.is_main_process()
            ? (fs::temp_directory_path() / ("accel-check-" + std::to_string(::getpid()))).string()
            : std::string());
  }
  results.push_back(
      check_checkpoint(acc, model, fs::path(base) / ("attempt_" + std::to_string(attempt))));

  if (attempt > 0) {
    results.push_back({"worker failure restarted", true,
                       "attempt " + std::to_string(attempt) + " ran after rank " +
                           std::to_string(world - 1) + " exited with code 3 on purpose"});
  }

  // Rank 0 reports every rank's results: a check passes when it passed everywhere.
  std::string mine;
  for (const auto& res : results) mine += (res.ok ? "1" : "0") + res.detail + "\n";
  auto every = acc.gather_object(mine);
  bool all_ok = true;
  if (acc.is_main_process()) {
    std::vector<Result> merged = results;
    for (size_t rank = 0; rank < every.size(); ++rank) {
      std::istringstream lines(every[rank]);
      std::string line;
      for (size_t i = 0; i < merged.size() && std::getline(lines, line); ++i) {
        if (line.empty() || line[0] == '1' || !merged[i].ok) continue;
        merged[i].ok = false;
        merged[i].detail = "rank " + std::to_string(rank) + ": " + line.substr(1);
      }
    }
    for (const auto& res : merged) {
      all_ok = all_ok && res.ok;
      std::cout << "ACCEL-CHECK\t" << attempt << "\t" << res.name << "\t"
                << (res.ok ? "PASS" : "FAIL") << "\t" << one_line(res.detail) << "\n";
    }
    std::cout << std::flush;
  }
  for (const auto& res : results) all_ok = all_ok && res.ok;
  acc.wait_for_everyone();
  if (attempt == 0 && env_int(c::kMaxRestarts, 0) > 0 && acc.is_last_process()) {
    std::cout << std::flush;
    std::_Exit(3);  // the failure the launcher must answer with a restart
  }
  return all_ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string first = argc > 1 ? argv[1] : "";
  if (first == "--info") return info();
  if (first == "-h" || first == "--help") {
    std::cout << "accel-check: the worker program of `accel test` (run it with accel test, or "
                 "under accel-launch); accel-check --info prints libtorch's build.\n";
    return 0;
  }
  if (!first.empty()) {
    std::cerr << "accel-check: unknown argument '" << first << "' (see accel-check --help)\n";
    return 2;
  }
  try {
    return run_checks();
  } catch (const std::exception& e) {
    std::cerr << "accel-check: " << e.what() << "\n";
    return 1;
  }
}

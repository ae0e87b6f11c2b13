// device_checks: the checks of scripts/gpu-check.sh that need a program of their own, on the GPU
// or (gpu-check.sh --cpu) on the CPU.
//
//   device_checks stale-weights bf16|fp16 plain|accel
//       Trains a Linear layer for 15 SGD steps on a prepared loader under mixed precision,
//       calling loss.backward() (plain) or acc.backward(loss) (accel). Before each backward it
//       compares the prepared model's m(x) (its forward under autocast) with the
//       same product computed from the current weights cast anew: autocast's cached weight copies
//       must never be older than the last optimizer step, so the gap must be exactly 0. Also
//       checks that the weights moved enough for a stale copy to show (else the check is void).
//   device_checks compare-weights A B TOLERANCE
//       The largest absolute difference between two model.safetensors files, tensor by tensor.
//
// Prints one line of figures; exits 0 when the check holds, 1 when not, 2 on bad arguments.
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>

#include "accel/accel.h"
#include "runtime/safetensors.h"

namespace {

int stale_weights(const std::string& precision, const std::string& backward) {
  if ((precision != "bf16" && precision != "fp16") ||
      (backward != "plain" && backward != "accel")) {
    std::cerr << "device_checks: stale-weights takes bf16|fp16 and plain|accel\n";
    return 2;
  }
  accel::AcceleratorOptions options;
  options.mixed_precision = precision;
  // Why a scale of 1: loss.backward() leaves the gradients unscaled, and the step would divide
  // them by 2^16, too little to move fp16 weights and so to tell a stale copy from a fresh one.
  if (precision == "fp16") options.grad_scaler = accel::GradScalerOptions{.init_scale = 1.0};
  accel::Accelerator acc(options);
  const auto dtype = precision == "bf16" ? torch::kBFloat16 : torch::kHalf;
  constexpr int64_t kSteps = 15, kBatch = 8;
  torch::manual_seed(3);
  auto x = torch::randn({kSteps * kBatch, 16});
  auto y = torch::randn({kSteps * kBatch, 8});
  auto linear = torch::nn::Linear(16, 8);
  auto model = linear.ptr();
  auto sgd =
      std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1));
  accel::DataLoader loader(std::make_shared<accel::TensorDataset>(x, y),
                           {.batch_size = kBatch, .shuffle = false});
  auto [m, o, dl] = acc.prepare(model, sgd, loader);
  auto probe = x.slice(0, 0, kBatch).to(acc.device()).to(dtype);
  auto fresh = [&] {
    torch::NoGradGuard no_grad;
    return torch::linear(probe, linear->weight.detach().to(dtype), linear->bias.detach().to(dtype))
        .to(torch::kFloat);
  };
  auto first = fresh();
  double gap = 0;
  int64_t steps = 0;
  for (auto& batch : dl) {
    auto out = m(batch.input);  // HF's model(x): the forward under autocast, float32 out
    torch::Tensor expect;
    {
      torch::NoGradGuard no_grad;
      expect = torch::linear(batch.input.to(dtype), linear->weight.detach().to(dtype),
                             linear->bias.detach().to(dtype));
    }
    gap = std::max(
        gap,
        (out.detach().to(torch::kFloat) - expect.to(torch::kFloat)).abs().max().item<double>());
    auto loss = torch::mse_loss(out.to(torch::kFloat), batch.target);
    if (backward == "plain") {
      loss.backward();
    } else {
      acc.backward(loss);
    }
    o.step();
    o.zero_grad();
    ++steps;
  }
  const double moved = (fresh() - first).abs().max().item<double>();
  std::printf(
      "%s %s backward on %s: %lld steps, forward vs current weights: largest gap %g "
      "(must be 0); the weights moved the output by %g (must be > 0)\n",
      precision.c_str(), backward.c_str(), acc.device().str().c_str(),
      static_cast<long long>(steps), gap, moved);
  return steps == kSteps && gap == 0 && moved > 0 ? 0 : 1;
}

std::map<std::string, torch::Tensor> read_weights(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::stringstream bytes;
  bytes << in.rdbuf();
  std::map<std::string, torch::Tensor> out;
  for (auto& [name, t] : accel::safetensors::decode(bytes.str(), path).tensors) out[name] = t;
  return out;
}

int compare_weights(const std::string& a_path, const std::string& b_path, double tolerance) {
  auto a = read_weights(a_path), b = read_weights(b_path);
  if (a.size() != b.size()) {
    std::printf("%s has %zu tensors, %s %zu\n", a_path.c_str(), a.size(), b_path.c_str(), b.size());
    return 1;
  }
  double worst = 0;
  std::string where;
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end() || !it->second.sizes().equals(t.sizes())) {
      std::printf("tensor %s is missing from %s or has another shape\n", name.c_str(),
                  b_path.c_str());
      return 1;
    }
    double d = (t.to(torch::kDouble) - it->second.to(torch::kDouble)).abs().max().item<double>();
    if (d >= worst) {
      worst = d;
      where = name;
    }
  }
  std::printf("%zu tensors, largest difference %.3g (%s), tolerance %g\n", a.size(), worst,
              where.c_str(), tolerance);
  return worst <= tolerance ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string what = argc > 1 ? argv[1] : "";
  try {
    if (what == "stale-weights" && argc == 4) return stale_weights(argv[2], argv[3]);
    if (what == "compare-weights" && argc == 5)
      return compare_weights(argv[2], argv[3], std::atof(argv[4]));
  } catch (const std::exception& e) {
    std::cerr << "device_checks: " << e.what() << "\n";
    return 1;
  }
  std::cerr << "usage: device_checks stale-weights bf16|fp16 plain|accel\n"
               "       device_checks compare-weights A B TOLERANCE\n";
  return 2;
}

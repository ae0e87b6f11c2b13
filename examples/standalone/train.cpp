// A complete data-parallel training loop on libaccel: linear regression y = 3x - 1 + noise,
// the same on 1 or N processes (run it with `accel-launch -n 2 ./train`).
#include <accel/accel.h>
#include <torch/torch.h>

int main() {
  accel::Accelerator acc;
  torch::manual_seed(0);
  auto x = torch::randn({4096, 1});
  auto y = 3 * x - 1 + 0.01 * torch::randn({4096, 1});

  auto model = std::make_shared<torch::nn::LinearImpl>(1, 1);
  auto opt =
      std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1));
  accel::DataLoader loader(std::make_shared<accel::TensorDataset>(x, y),
                           {.batch_size = 64, .shuffle = true, .seed = 0});
  auto [m, o, dl] = acc.prepare(model, opt, loader);

  for (int64_t epoch = dl.epoch(); epoch < 3; ++epoch) {
    for (auto& batch : dl) {
      auto loss = torch::mse_loss(m(batch.input), batch.target);
      acc.backward(loss);
      o.step();
      o.zero_grad();
    }
  }
  acc.print("weight", model->weight.item<double>(), "bias", model->bias.item<double>(), "processes",
            acc.num_processes());
  acc.wait_for_everyone();
  return 0;
}

// runtime_worker's checkpoint modes: saves killed mid-write, the newest checkpoint loaded,
// automatic resume with a late registration order, ZeRO refusing a foreign tensor, SIGUSR1 after a
// save.
#include <signal.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>

#include "accel/accel.h"
#include "runtime/checkpoint_io.h"
#include "tests/integration/workers/runtime_worker.h"

namespace runtime_worker {
namespace {

// The real file system, except that I/O operation number `kill_at` (counting from 0) SIGKILLs
// the process before it happens: a crash at that exact point of a save.
class KillingFs : public accel::ckpt::CheckpointFs {
 public:
  explicit KillingFs(int kill_at) : kill_at_(kill_at) {}
  accel::ckpt::WrittenFile write_stream(
      const std::filesystem::path& p,
      const std::function<void(const accel::ckpt::Sink&)>& produce) override {
    tick("write " + p.filename().string());
    return CheckpointFs::write_stream(p, produce);
  }
  void sync_dir(const std::filesystem::path& d) override {
    tick("sync_dir");
    CheckpointFs::sync_dir(d);
  }
  void rename(const std::filesystem::path& a, const std::filesystem::path& b) override {
    tick("rename " + a.filename().string() + " -> " + b.filename().string());
    CheckpointFs::rename(a, b);
  }
  void remove_all(const std::filesystem::path& p) override {
    tick("remove " + p.filename().string());
    CheckpointFs::remove_all(p);
  }
  void create_directories(const std::filesystem::path& p) override {
    tick("mkdir " + p.filename().string());
    CheckpointFs::create_directories(p);
  }

 private:
  void tick(const std::string& what) {
    if (op_++ == kill_at_) {
      std::printf("KILLED at op %d: %s\n", kill_at_, what.c_str());
      std::fflush(stdout);
      ::raise(SIGKILL);
    }
  }
  int kill_at_;
  int op_ = 0;
};

}  // namespace

std::string weights_hash(torch::nn::Module& model) {
  std::string bytes;
  for (auto& p : model.parameters()) {
    auto c = p.detach().contiguous();
    bytes.append(static_cast<const char*>(c.data_ptr()), static_cast<std::size_t>(c.nbytes()));
  }
  return accel::ckpt::to_hex(accel::ckpt::checksum(bytes));
}

namespace {

struct CheckpointRig {
  std::shared_ptr<NetImpl> model;
  accel::PreparedOptimizer opt;
  accel::DataLoader loader;
};

CheckpointRig checkpoint_rig(accel::Accelerator& acc) {
  torch::manual_seed(7);
  auto model = std::make_shared<NetImpl>();
  auto opt =
      std::make_shared<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-2));
  accel::DataLoader loader(
      std::make_shared<accel::TensorDataset>(torch::randn({64, 6}), torch::randn({64, 2})),
      {.batch_size = 8, .shuffle = true, .seed = 3});
  auto [m, o, dl] = acc.prepare(model, opt, loader);
  return {m, o, dl};
}

void train_steps(CheckpointRig& rig, int steps, accel::Accelerator& acc) {
  int done = 0;
  while (done < steps) {
    for (auto& batch : rig.loader) {
      acc.backward(torch::mse_loss(rig.model->forward(batch.input), batch.target));
      rig.opt.step();
      rig.opt.zero_grad();
      if (++done == steps) break;
    }
  }
}

}  // namespace

// async: the second save writes in the background while 3 more steps train, then waits for it.
int save_killed(const std::string& dir, int kill_at, bool async) {
  accel::Accelerator acc({.project = {.project_dir = dir}});
  auto rig = checkpoint_rig(acc);
  train_steps(rig, 3, acc);
  acc.save_state();
  std::printf("SAVED checkpoint_0 %s\n", weights_hash(*rig.model).c_str());
  train_steps(rig, 3, acc);
  const std::string saving = weights_hash(*rig.model);
  std::printf("SAVING checkpoint_1 %s\n", saving.c_str());
  std::fflush(stdout);
  KillingFs killing(kill_at);
  accel::ckpt::set_checkpoint_fs_for_testing(&killing);
  acc.save_state({}, {.async = async});
  if (async) {
    train_steps(rig, 3, acc);
    acc.wait_for_checkpoint();
  }
  accel::ckpt::set_checkpoint_fs_for_testing(nullptr);
  std::printf("SAVED checkpoint_1 %s\n", saving.c_str());
  return 0;
}

// Then `steps` more training steps, and their weights' hash (TRAINED).
int load_newest(const std::string& dir, int steps) {
  accel::Accelerator acc({.project = {.project_dir = dir, .automatic_resume = false}});
  auto rig = checkpoint_rig(acc);
  auto loaded = acc.load_state();
  std::printf("LOADED %s %s\n", loaded.filename().c_str(), weights_hash(*rig.model).c_str());
  if (steps > 0) {
    train_steps(rig, steps, acc);
    std::printf("TRAINED %s\n", weights_hash(*rig.model).c_str());
  }
  return 0;
}

namespace {

// Steps done, saved with each checkpoint (registered after prepare()).
struct StepCounter {
  int64_t steps = 0;
  std::string state_dict() const { return std::to_string(steps); }
  void load_state_dict(const std::string& s) { steps = std::stoll(s); }
};

}  // namespace

// The order docs/checkpointing.md shows, which automatic resume must not depend on: the loader
// prepared first, then the model and optimizer, an object registered after prepare(). Trains to
// `steps` optimizer steps under accel-launch --checkpoint-dir; on the first attempt rank
// `kill_rank` (-1: none) SIGKILLs itself after step `kill_at`. Rank 0 prints the final weights'
// hash and the registered counter, and saves the model from the main process alone.
int late_order(int steps, int kill_rank, int kill_at, const std::string& model_dir) {
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  accel::Accelerator acc;
  torch::manual_seed(7);
  accel::DataLoader loader(
      std::make_shared<accel::TensorDataset>(torch::randn({64, 6}), torch::randn({64, 2})),
      {.batch_size = 4, .shuffle = true, .seed = 3});
  auto dl = acc.prepare(loader);
  auto model = std::make_shared<NetImpl>();
  auto opt =
      std::make_shared<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-2));
  auto [m, o] = acc.prepare(model, opt);
  auto counter = std::make_shared<StepCounter>();
  acc.register_for_checkpointing(counter);
  while (acc.completed_steps() < steps) {
    for (auto& batch : dl) {
      acc.backward(torch::mse_loss(m->forward(batch.input), batch.target));
      o.step();
      o.zero_grad();
      ++counter->steps;
      if (g_rank == kill_rank && (restart == nullptr || std::atoi(restart) == 0) &&
          acc.completed_steps() == kill_at) {
        ::raise(SIGKILL);
      }
      if (acc.completed_steps() == steps) break;
    }
  }
  if (acc.is_main_process()) {
    std::printf("FINAL %s counter %lld\n", weights_hash(*m).c_str(),
                static_cast<long long>(counter->steps));
    acc.save_model(m, model_dir);
  }
  acc.wait_for_everyone();
  return 0;
}

// ZeRO stage 1 with an optimizer that also holds a tensor outside the prepared model: the first
// step is refused (its gradient is nobody's average) and nothing changes. Prints "REFUSED <why>".
int foreign() {
  accel::Accelerator acc;
  auto model = std::make_shared<NetImpl>();
  auto extra = torch::zeros({5}, torch::requires_grad());
  auto params = model->parameters();
  params.push_back(extra);
  auto opt = std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1));
  auto [m, o] = acc.prepare(model, opt);
  auto before = weights_hash(*m);
  auto x = torch::randn({4, 6});
  acc.backward(torch::mse_loss(m->forward(x), torch::zeros({4, 2})) + extra.sum());
  try {
    o.step();
  } catch (const accel::UsageError& e) {
    REQUIRE(weights_hash(*m) == before, "the refused step changed the weights");
    if (acc.is_main_process()) std::printf("REFUSED %s\n", e.what());
    return 0;
  }
  REQUIRE(false, "a step with a parameter outside every prepared model was not refused");
  return 1;
}

// Preemption after a save of the program's own (HF's "best" folder): trains to `steps` under
// accel-launch --checkpoint-dir; after step `save_at` every rank calls save_state(<checkpoint
// dir>/best); after step `signal_at` (-1: never) rank 0 sends SIGUSR1 to the launcher, as Slurm
// does, and every rank raises it in itself too, so that all stop at that step. Rank 0 prints the
// final weights' hash.
int usr1_at(int steps, int save_at, int signal_at) {
  accel::Accelerator acc;
  const char* project = std::getenv("ACCEL_CHECKPOINT_DIR");
  REQUIRE(project != nullptr, "usr1_at runs under accel-launch --checkpoint-dir");
  torch::manual_seed(7);
  accel::DataLoader loader(
      std::make_shared<accel::TensorDataset>(torch::randn({64, 6}), torch::randn({64, 2})),
      {.batch_size = 4, .shuffle = true, .seed = 3});
  auto model = std::make_shared<NetImpl>();
  auto opt =
      std::make_shared<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-2));
  auto [m, o, dl] = acc.prepare(model, opt, loader);
  while (acc.completed_steps() < steps) {
    for (auto& batch : dl) {
      acc.backward(torch::mse_loss(m->forward(batch.input), batch.target));
      o.step();
      o.zero_grad();
      if (acc.completed_steps() == save_at) acc.save_state(std::filesystem::path(project) / "best");
      if (acc.completed_steps() == signal_at) {
        if (acc.is_main_process()) ::kill(::getppid(), SIGUSR1);
        ::raise(SIGUSR1);
      }
      if (acc.completed_steps() == steps) break;
    }
  }
  if (acc.is_main_process()) std::printf("FINAL %s\n", weights_hash(*m).c_str());
  return 0;
}

}  // namespace runtime_worker

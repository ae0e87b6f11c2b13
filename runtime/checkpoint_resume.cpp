// Accelerator checkpoints, automatic resume and periodic saves: the newest usable checkpoint (or
// in-memory snapshot) loaded where training starts, the checks that it belongs to this run, the
// saves every N steps, and a stop signal turned into a save on every rank. load_state is in
// checkpoint.cpp, save_state in checkpoint_save.cpp.
#include <c10/util/Type.h>
#include <torch/torch.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "accel/accelerator.h"
#include "runtime/accelerator_impl.h"
#include "runtime/checkpoint_layout.h"
#include "runtime/checkpoint_manifest.h"
#include "runtime/checkpoint_reader.h"
#include "runtime/comm.h"
#include "runtime/env.h"
#include "runtime/log.h"
#include "runtime/snapshot_transfer.h"
#include "runtime/stop_request.h"

namespace accel {

using ckpt::CheckpointReader;
using ckpt::kCheckpointPrefix;
using ckpt::kManifest;
using ckpt::model_identity;
using ckpt::rotate;

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string shape_text(const json& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + shape[i].dump();
  return out + "]";
}

// The differences between a model here and the one a checkpoint was saved from, at most a few.
void model_differences(std::size_t index, const json& here, const json& saved,
                       std::vector<std::string>& out) {
  const std::string model = "model " + std::to_string(index);
  std::vector<std::string> changed, missing, extra;
  for (const auto& [name, shape] : here.items()) {
    if (!saved.contains(name)) {
      extra.push_back(name);
    } else if (saved[name] != shape) {
      changed.push_back(name + " is " + shape_text(shape) + " here, " + shape_text(saved[name]) +
                        " in the checkpoint");
    }
  }
  for (const auto& [name, shape] : saved.items()) {
    if (!here.contains(name)) missing.push_back(name);
  }
  auto some = [](const std::vector<std::string>& names) {
    std::string text;
    for (std::size_t i = 0; i < names.size() && i < 3; ++i) text += (i ? ", " : "") + names[i];
    if (names.size() > 3) text += " and " + std::to_string(names.size() - 3) + " more";
    return text;
  };
  if (!changed.empty()) out.push_back(model + ": " + some(changed));
  if (!extra.empty()) out.push_back(model + " has " + some(extra) + ", the checkpoint does not");
  if (!missing.empty()) out.push_back(model + " lacks " + some(missing) + " of the checkpoint");
}

// How this job's prepared objects differ from the run that saved `manifest` (empty: the same
// run, or a checkpoint too old to say).
std::vector<std::string> run_differences(
    const json& manifest, const std::vector<torch::nn::Module*>& here_models,
    const std::vector<std::shared_ptr<detail::OptimizerSlot>>& here_optimizers,
    const std::vector<DataLoader>& here_loaders) {
  std::vector<std::string> out;
  if (!manifest.contains("run") || !manifest["run"].is_object()) return out;  // older format
  const json& run = manifest["run"];
  const json& sizes = run.value("dataset_sizes", json::array());
  for (std::size_t i = 0; i < here_loaders.size() && i < sizes.size(); ++i) {
    auto here = here_loaders[i].dataset_size();
    if (here && sizes[i].is_number_unsigned() && sizes[i].get<std::size_t>() != *here) {
      out.push_back("data loader " + std::to_string(i) + "'s dataset has " + std::to_string(*here) +
                    " samples here, " + sizes[i].dump() + " in the checkpoint");
    }
  }
  const json& models = run.value("models", json::array());
  for (std::size_t i = 0; i < here_models.size() && i < models.size(); ++i) {
    if (models[i].is_object())
      model_differences(i, model_identity(*here_models[i]), models[i], out);
  }
  const json& optimizers = run.value("optimizers", json::array());
  for (std::size_t i = 0; i < here_optimizers.size() && i < optimizers.size(); ++i) {
    std::string here = c10::demangle(typeid(*here_optimizers[i]->optimizer).name());
    if (optimizers[i].is_string() && optimizers[i].get<std::string>() != here) {
      out.push_back("optimizer " + std::to_string(i) + " is " + here + " here, " +
                    optimizers[i].get<std::string>() + " in the checkpoint");
    }
  }
  return out;
}

}  // namespace

bool Accelerator::automatic_resume_on() const {
  return *impl_->project_.automatic_resume && *impl_->project_.automatic_checkpoint_naming;
}

void Accelerator::check_not_started(const char* what) const {
  if (!impl_->training_started_ || !(automatic_resume_on() || impl_->snapshot_interval_ > 0))
    return;
  throw UsageError(
      std::string("accel: ") + what +
      " after training started (the first pass over a prepared loader, its epoch() or state(), "
      "backward() or save_state()): automatic resume happens there and restores only the "
      "objects prepared and registered by then, so after a restart this one would start fresh "
      "or the checkpoint would not match. prepare() and register_for_checkpointing() every "
      "object before the training loop (models alone may be prepared later, and are then not "
      "checkpointed), or turn automatic resume off (ProjectConfiguration::automatic_resume = "
      "false) and load_state() by hand");
}

void Accelerator::maybe_resume(bool forward_done) {
  if (!impl_->resume_checked_) {
    impl_->resume_checked_ = true;
    if (automatic_resume_on() || impl_->snapshot_interval_ > 0) resume_from_newest(forward_done);
  }
  impl_->training_started_ = true;
  open_trackers();  // nothing when they are open already, or off
}

void Accelerator::resume_from_newest(bool forward_done) {
  // Newest first, the same list on every rank: every rank tries the same ones in the same order.
  std::vector<std::string> candidates = resume_candidates();
  // Why refuse: loading now would overwrite the weights the forward pass just used, under the
  // autograd graph of this step. Every rank sees the same list, so every rank throws.
  if (forward_done && !candidates.empty()) {
    throw UsageError(
        "accel: automatic resume: there is a checkpoint to resume from (" + candidates.front() +
        "), but this program's first backward() came before any prepared DataLoader was "
        "iterated, so its first forward pass already used the weights a resume would replace. "
        "Iterate a prepared DataLoader (its first pass is where a job resumes), or call "
        "acc.load_state() before the first forward pass");
  }
  // Why: a damaged newest checkpoint (a disk error, a file changed by hand) would otherwise fail
  // every restart; the ranks agree on the newest intact one before anything is applied.
  std::string first_problem;
  for (const auto& listed : candidates) {
    // An in-memory snapshot is this node's copy of it: "snapshot:<step>", or
    // "snapshot:<step>@<rank>" when some node lacks it and gets it from that rank's node first.
    const bool in_memory = listed.rfind(ckpt::kSnapshotCandidate, 0) == 0;
    std::string problem;
    bool not_sent = false;  // a snapshot some node lacks, which could not be sent to it
    std::string candidate = listed;
    if (in_memory) {
      std::string step = listed.substr(std::strlen(ckpt::kSnapshotCandidate));
      const auto at = step.find('@');
      if (at != std::string::npos) {
        const int source = std::stoi(step.substr(at + 1));
        step.resize(at);
        // The same outcome on every rank; a failure passes to the next candidate.
        problem = send_snapshot_to_nodes_lacking_it(*this, impl_->snapshot_dir_, std::stoll(step),
                                                    source);
        not_sent = !problem.empty();
      }
      candidate = (impl_->snapshot_dir_ / (kCheckpointPrefix + step)).string();
    }
    try {
      if (problem.empty()) CheckpointReader(candidate).verify_files();
    } catch (const CheckpointError& e) {
      problem = e.what();
    }
    // One byte of verdict first, so no rank sends an empty object.
    auto verdicts =
        use_distributed() ? gather_object("-" + problem) : std::vector<std::string>{"-" + problem};
    std::vector<std::string> problems;
    for (const auto& v : verdicts) problems.push_back(v.substr(1));
    auto bad = std::find_if(problems.begin(), problems.end(),
                            [](const std::string& p) { return !p.empty(); });
    if (bad == problems.end()) {
      // Why refuse: a folder left by an unrelated run (another dataset, another model) would be
      // resumed silently, at an epoch that may train nothing, or fail deep inside a load.
      auto differences = run_differences(CheckpointReader(candidate).manifest(), impl_->models_,
                                         impl_->optimizers_, impl_->loaders_);
      if (!differences.empty()) {
        std::string listed_differences;
        for (const auto& d : differences) listed_differences += "\n  " + d;
        if (!impl_->project_.resume_other_run.value_or(env::worker_env().resume_force)) {
          throw CheckpointError(
              "accel: automatic resume: " + candidate +
              " was saved by another run:" + listed_differences +
              "\nTo start this run from scratch, give it its own folder (accel-launch "
              "--checkpoint-dir DIR) or move the old checkpoints away; to resume from this one "
              "anyway, accel-launch --resume force (ACCEL_RESUME=force)");
        }
        print("accel: warning: resuming (resume=force) from", candidate,
              "although another run saved it:" + listed_differences);
      }
      load_from(candidate, /*verify_checksums=*/false);  // every rank has just verified them
      const std::string from = in_memory ? "the in-memory snapshot " + candidate : candidate;
      if (impl_->loaders_.empty()) {
        print("accel: resumed from", from, "at step", completed_steps());
      } else {
        auto position = impl_->loaders_.front().state();
        print("accel: resumed from", from, "at step", completed_steps(), "(epoch", position.epoch,
              "batch", std::to_string(position.batches) + ")");
      }
      impl_->resumed_from_ = candidate;
      impl_->resumed_at_step_ = completed_steps();
      // Why: a job killed between a save and its rotation (or inside the rotation) left one
      // checkpoint too many, or a half-removed folder; if it ends before its next save, nothing
      // else would ever enforce total_limit on them.
      if (is_main_process() && impl_->project_.total_limit && !in_memory) {
        try {
          rotate(candidate, *impl_->project_.total_limit);
        } catch (const std::exception& e) {
          log::warning("could not remove the checkpoints beyond total_limit (" +
                       std::to_string(*impl_->project_.total_limit) + ") in " +
                       fs::path(candidate).parent_path().string() + " after resuming: " + e.what());
        }
      }
      return;
    }
    if (first_problem.empty()) first_problem = *bad;
    if (not_sent) {
      print("accel: warning: not resuming from the in-memory snapshot", candidate,
            "because it could not be sent to the nodes that lack it:", *bad);
      continue;
    }
    print("accel: warning: not resuming from", candidate, "because it is damaged (rank",
          std::to_string(bad - problems.begin()) + "):", *bad);
  }
  if (!candidates.empty()) {
    std::string where;
    if (impl_->project_.project_dir && !impl_->project_.project_dir->empty())
      where = (fs::path(*impl_->project_.project_dir) / "checkpoints").string();
    if (impl_->snapshot_interval_ > 0)
      where += (where.empty() ? "" : " and ") + impl_->snapshot_dir_.string() + " (in memory)";
    throw CheckpointError("accel: automatic resume: none of the " +
                          std::to_string(candidates.size()) + " checkpoints under " + where +
                          " is intact (the newest: " + first_problem +
                          "); move them away to start from scratch, or repair them");
  }
}

void Accelerator::on_step_boundary() {
  if (impl_->stop_on_signal_ && completed_steps() != impl_->last_signal_check_) {
    impl_->last_signal_check_ = completed_steps();
    // Why every rank agrees first: the signal reaches ranks at different moments; a save is a
    // collective, so all must decide at the same step.
    int signal = stop_request::pending();
    if (use_distributed()) {
      auto flag = torch::full({1}, signal, torch::dtype(torch::kInt).device(device()));
      state_->comm().allreduce(flag, c10d::ReduceOp::MAX);
      signal = flag.cpu().item<int>();
    }
    if (signal != 0) stop_after_checkpoint(signal);
  }
  auto done = completed_steps();
  // Why the snapshot first: a checkpoint due at the same step then waits only for the snapshot's
  // write into memory, not the snapshot for the checkpoint's write to disk.
  if (impl_->snapshot_interval_ > 0 && done != impl_->last_snapshot_ && done > 0 &&
      done % impl_->snapshot_interval_ == 0) {
    save_snapshot();
  }
  auto interval = impl_->project_.save_interval.value_or(0);
  const bool async = impl_->project_.async_checkpoints.value_or(false);
  // Why once the optimizer has its state, not at a save: the first background save would
  // otherwise copy into new memory while the next step waits (GPU state is copied at the call).
  if (async && !impl_->prefaulted_ && done > 0 && (interval <= 0 || done % interval != 0) &&
      is_main_process() && device().is_cpu() && !impl_->save_in_flight_) {
    try {
      impl_->prefault_background_copies();
    } catch (const std::exception& e) {  // only a head start: the first save makes its own
      log::debug(std::string("the memory for background saves was not made ahead: ") + e.what());
    }
  }
  if (interval <= 0) return;
  if (done == impl_->last_auto_save_ || done % interval != 0) return;
  save_state({}, {.async = async});
}

void Accelerator::stop_after_checkpoint(int signal) {
  try {
    wait_for_checkpoint();  // Why: an automatic save may still be writing; _Exit would lose it
  } catch (const CheckpointError& e) {
    log::warning(std::string(e.what()) + "; saving again before stopping");
    impl_->last_auto_save_dir_.clear();  // Why: that step has no checkpoint; save it below
  }
  auto done = completed_steps();
  // Why every rank decides alike: save_state() is a collective; the path and step are the same
  // on every rank (set by the same saves and loads), and the manifest check is rank 0's alone.
  bool have = done == impl_->last_auto_save_ && !impl_->last_auto_save_dir_.empty();
  if (have) {
    std::string ok =
        is_main_process() && fs::is_regular_file(impl_->last_auto_save_dir_ / kManifest) ? "1" : "";
    if (use_distributed()) ok = broadcast_object(ok);
    have = !ok.empty();
  }
  fs::path where = have ? impl_->last_auto_save_dir_ : save_state();
  print("accel: received",
        signal == SIGUSR1 ? std::string("SIGUSR1") : "signal " + std::to_string(signal),
        "(save and stop): saved", where.string(), "at step", done,
        "- stopping; the next run with this checkpoint folder resumes there");
  std::fflush(nullptr);
  // Why _exit: the training loop is still on the stack (its threads, its tensors); the
  // checkpoint is on disk, and unwinding through user code here could only lose it.
  std::_Exit(128 + signal);
}

}  // namespace accel

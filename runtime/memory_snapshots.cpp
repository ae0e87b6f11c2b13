// In-memory snapshots (accel-launch --snapshot-interval N): every N optimizer steps each node's
// local main process writes the whole state, in the checkpoint format, into the folder in
// /dev/shm that the node's agent keeps for the job (ACCEL_SNAPSHOT_DIR), in the background as a
// background checkpoint does; the newest two are kept. A restarted group resumes from the
// newest snapshot that any node holds when it is newer than the newest checkpoint (automatic
// resume's candidates, also here); a node that lacks it gets it from one that holds it
// (snapshot_transfer.h). Checkpoints stay the durable layer.
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <set>
#include <sstream>

#include "accel/accelerator.h"
#include "runtime/accelerator_impl.h"
#include "runtime/checkpoint_layout.h"
#include "runtime/checkpoint_reader.h"
#include "runtime/env.h"
#include "runtime/log.h"
#include "runtime/progress.h"

namespace accel {

namespace fs = std::filesystem;
using ckpt::checkpoint_number;
using ckpt::complete_checkpoints;
using ckpt::kCheckpointPrefix;

namespace {

// Two: a group killed while one node writes a snapshot still finds the one before on every node.
constexpr int64_t kSnapshotsKept = 2;

}  // namespace

void Accelerator::setup_snapshots(bool resume_off_in_code) {
  const auto& e = env::worker_env();
  if (e.snapshot_interval <= 0) return;
  if (!e.snapshot_dir || e.snapshot_dir->empty()) {
    if (is_main_process()) {
      log::warning(
          "ACCEL_SNAPSHOT_INTERVAL is set but ACCEL_SNAPSHOT_DIR is not (accel-launch and "
          "accel-agent give each node's folder): no in-memory snapshots");
    }
    return;
  }
  if (resume_off_in_code) {
    if (is_main_process()) {
      log::warning(
          "ProjectConfiguration::automatic_resume is false: no in-memory snapshots (nothing "
          "would load them)");
    }
    return;
  }
  impl_->snapshot_interval_ = e.snapshot_interval;
  impl_->snapshot_dir_ = *e.snapshot_dir;
}

void Accelerator::save_snapshot() {
  wait_for_checkpoint();                       // one save at a time
  if (impl_->snapshot_interval_ <= 0) return;  // that wait may have turned them off
  const std::uint64_t began = progress::monotonic_ns();
  const int64_t step = completed_steps();
  const fs::path target = impl_->snapshot_dir_ / (kCheckpointPrefix + std::to_string(step));
  // Every node's writer needs every rank's RNG states and loader positions: gather_object is an
  // all-gather.
  auto mine = detail::rank_state(process_index(), impl_->loaders_);
  auto blobs = use_distributed() ? gather_object(mine) : std::vector<std::string>{mine};
  std::string error;
  try {
    // ZeRO: the full optimizer state on each node's writer for the write, gone again after it.
    for (auto& slot : impl_->optimizers_)
      if (slot->zero) slot->zero->gather_state(is_local_main_process());
  } catch (...) {
    for (auto& slot : impl_->optimizers_)
      if (slot->zero) slot->zero->clear_installed();
    throw;  // a collective failed: the group is broken, as in any other collective
  }
  if (is_local_main_process()) {
    try {
      impl_->snapshot_->begin();
      auto write = prepare_write(target, /*async=*/true, /*in_memory=*/true, std::move(blobs),
                                 kSnapshotsKept, began);
      impl_->start_background_write(std::move(write), target, /*copies_first=*/false);
    } catch (const std::exception& ex) {
      error = *ex.what() ? ex.what() : "the snapshot failed";
    }
  }
  for (auto& slot : impl_->optimizers_)
    if (slot->zero) slot->zero->clear_installed();
  impl_->last_snapshot_ = step;
  // Why not snapshot_outcome() now on a failure: it is a collective, and only this rank failed
  // here; every rank agrees on the outcome at the next wait, as for a write that fails later.
  if (!error.empty()) impl_->save_error_ = error;
  impl_->save_in_flight_ = true;
  impl_->save_is_snapshot_ = true;
  impl_->save_target_ = target;
}

void Accelerator::snapshot_outcome(const std::string& error) {
  // One byte first, so that no rank sends an empty object.
  auto all = use_distributed() ? gather_object("-" + error) : std::vector<std::string>{"-" + error};
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (all[r].size() <= 1) continue;
    impl_->snapshot_interval_ = 0;  // every rank alike: they all saw the same list
    if (is_main_process()) {
      log::warning("the in-memory snapshot at step " + std::to_string(impl_->last_snapshot_) +
                   " failed on rank " + std::to_string(r) + ": " + all[r].substr(1) +
                   "; no more snapshots in this run (automatic checkpoints, if any, go on)");
    }
    return;
  }
}

std::vector<std::string> Accelerator::resume_candidates() {
  // Rank 0's automatic checkpoints, newest first, with the step each manifest gives.
  std::vector<std::pair<int64_t, std::string>> disk;
  if (automatic_resume_on() && is_main_process() && impl_->project_.project_dir &&
      !impl_->project_.project_dir->empty()) {
    auto all = complete_checkpoints(fs::path(*impl_->project_.project_dir) / "checkpoints");
    for (auto it = all.rbegin(); it != all.rend(); ++it) {
      int64_t step = -1;  // unreadable: after the rest (its verification will say what is wrong)
      try {
        step = ckpt::CheckpointReader(*it).manifest().value("step", static_cast<int64_t>(-1));
      } catch (const std::exception&) {
      }
      disk.emplace_back(step, it->string());
    }
  }
  // Each rank's node's snapshots ("-": none here, so none is common to every node).
  std::string mine = "-";
  if (impl_->snapshot_interval_ > 0) {
    mine = "+";
    for (const auto& p : complete_checkpoints(impl_->snapshot_dir_))
      mine += " " + std::to_string(checkpoint_number(p.filename().string()));
  }
  auto everyone = use_distributed() ? gather_object(mine) : std::vector<std::string>{mine};
  std::string listed;
  if (is_main_process()) {
    std::map<int64_t, std::size_t> held;    // step -> ranks whose node holds it
    std::map<int64_t, std::size_t> holder;  // step -> the lowest of those ranks
    bool every_node_has_a_folder = true;
    for (std::size_t r = 0; r < everyone.size(); ++r) {
      every_node_has_a_folder = every_node_has_a_folder && everyone[r].rfind('+', 0) == 0;
      std::istringstream in(everyone[r].substr(1));
      std::set<int64_t> steps;
      for (int64_t step = 0; in >> step;) steps.insert(step);
      for (int64_t step : steps) {
        if (held[step]++ == 0) holder[step] = r;
      }
    }
    // Newest step first; at the same step a snapshot (memory) before a checkpoint (disk). A
    // snapshot some node lacks (its agent restarted, or it replaced a lost node) is sent from
    // the memory of a node that holds it: every node's snapshot holds the whole job's state.
    std::vector<std::tuple<int64_t, int, std::string>> all;
    for (const auto& [step, ranks] : held) {
      std::string candidate = ckpt::kSnapshotCandidate + std::to_string(step);
      if (ranks == everyone.size())
        all.emplace_back(step, 1, candidate);
      else if (every_node_has_a_folder)
        all.emplace_back(step, 1, candidate + "@" + std::to_string(holder[step]));
    }
    for (std::size_t i = 0; i < disk.size(); ++i)
      all.emplace_back(disk[i].first, 0, disk[i].second);
    std::stable_sort(all.begin(), all.end(), [](const auto& a, const auto& b) {
      return std::get<0>(a) != std::get<0>(b) ? std::get<0>(a) > std::get<0>(b)
                                              : std::get<1>(a) > std::get<1>(b);
    });
    for (const auto& c : all) listed += std::get<2>(c) + "\n";
  }
  if (use_distributed()) listed = broadcast_object(listed);
  std::vector<std::string> candidates;
  for (std::size_t start = 0, end; (end = listed.find('\n', start)) != std::string::npos;
       start = end + 1) {
    candidates.push_back(listed.substr(start, end - start));
  }
  return candidates;
}

}  // namespace accel

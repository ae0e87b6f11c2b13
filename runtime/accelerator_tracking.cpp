// Accelerator's experiment tracking: init_trackers, log, end_training (docs/tracking.md).
#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>

#include "accel/accelerator.h"
#include "runtime/accelerator_impl.h"
#include "runtime/checkpoint_manifest.h"
#include "runtime/env.h"
#include "runtime/log.h"
#include "runtime/tracking.h"

namespace accel {

namespace fs = std::filesystem;

void Accelerator::init_trackers(const std::string& project_name,
                                const std::map<std::string, ConfigValue>& config) {
  if (impl_->tracking_->kinds.empty()) return;
  if (impl_->tracking_->initialized) {
    throw UsageError("accel: init_trackers() was already called (run " +
                     impl_->tracking_->dir.filename().string() + "); call it once, before logging");
  }
  if (!ckpt::is_plain_file_name(project_name)) {
    throw UsageError("accel: init_trackers(\"" + project_name +
                     "\"): the project name is a folder name (not empty, no '/', not . or ..)");
  }
  if (!impl_->project_.logging_dir || impl_->project_.logging_dir->empty()) {
    throw ConfigError(
        "accel: the trackers (log_with) need a folder to write to: accel-launch --project-dir "
        "DIR (or --checkpoint-dir), or ProjectConfiguration::logging_dir / project_dir");
  }
  impl_->tracking_->initialized = true;
  impl_->tracking_->dir = fs::absolute(fs::path(*impl_->project_.logging_dir) / project_name);
  if (!is_main_process()) return;
  nlohmann::ordered_json c = nlohmann::ordered_json::object();
  for (const auto& [key, value] : config) {
    std::visit([&](const auto& v) { c[key] = v; }, value);
  }
  impl_->tracking_->trackers = std::make_unique<tracking::Trackers>(
      impl_->tracking_->kinds, impl_->tracking_->dir, project_name, c.dump(2));
  // Why not open now: whether the files continue or start anew depends on the checkpoint this
  // run resumes from, known when training starts (automatic resume, or a load_state before it).
  if (impl_->training_started_) open_trackers();
}

void Accelerator::open_trackers() {
  auto& t = *impl_->tracking_;
  if (!t.trackers || t.trackers->is_open()) return;
  std::string note = t.trackers->open(t.resume);
  if (!note.empty()) log::info(note);
  for (const auto& r : t.pending) t.trackers->log(r.values, r.step, r.wall_time, r.only);
  t.pending.clear();
}

void Accelerator::log(const std::map<std::string, double>& values, std::optional<int64_t> step) {
  log_to({}, values, step);
}

void Accelerator::log_to(const std::string& only, const std::map<std::string, double>& values,
                         std::optional<int64_t> step) {
  auto& t = *impl_->tracking_;
  if (t.bar && only.empty()) t.last_values = values;
  if (!t.trackers) return;
  tracking::check_value_names(values);
  detail::Tracking::Record r{
      {values.begin(), values.end()},
      step.value_or(completed_steps()),
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(),
      only};
  // Without automatic resume nothing later decides where the files stand (a load_state() by hand
  // comes before logging, as in HF's order, and cuts them back if not).
  if (!t.trackers->is_open() && (impl_->training_started_ || !automatic_resume_on())) {
    open_trackers();
  }
  if (!t.trackers->is_open()) {
    t.pending.push_back(std::move(r));
    return;
  }
  t.trackers->log(r.values, r.step, r.wall_time, r.only);
}

Tracker Accelerator::get_tracker(const std::string& name) {
  const auto& kinds = impl_->tracking_->kinds;
  if (std::find(kinds.begin(), kinds.end(), name) == kinds.end()) {
    std::string on;
    for (const auto& k : kinds) on += (on.empty() ? "" : ", ") + k;
    throw UsageError(
        "accel: get_tracker(\"" + name + "\"): not a tracker of this run (" +
        (on.empty() ? std::string("none is on: set log_with or --log-with") : "on: " + on) + ")");
  }
  return Tracker(this, name);
}

fs::path Accelerator::project_dir() const {
  return impl_->project_.project_dir ? fs::path(*impl_->project_.project_dir) : fs::path();
}

fs::path Accelerator::logging_dir() const {
  return impl_->project_.logging_dir ? fs::path(*impl_->project_.logging_dir) : fs::path();
}

void Tracker::log(const std::map<std::string, double>& values, std::optional<int64_t> step) {
  acc_->log_to(name_, values, step);
}

fs::path Tracker::file() const {
  const auto& t = *acc_->impl_->tracking_;
  return t.trackers ? t.trackers->file_of(name_) : fs::path();
}

void Accelerator::end_training() {
  // Why not wait_for_checkpoint(): HF programs often call end_training on the main process
  // alone; only the main process writes, so it alone waits.
  std::string failed = impl_->join_background_save();
  impl_->save_error_.clear();  // Why: reported here, once
  auto& t = *impl_->tracking_;
  if (t.trackers) {
    // Why not when an automatic resume is still undecided (it failed, or training never
    // started): opening would start the files anew and move the previous run's aside.
    if (!t.pending.empty() && (impl_->resume_checked_ || !automatic_resume_on())) open_trackers();
    t.trackers->close();
    t.trackers.reset();
  }
  if (!failed.empty() && impl_->save_is_snapshot_) {
    // A snapshot is no checkpoint: it is gone with the job anyway.
    log::warning("the last in-memory snapshot (" + impl_->save_target_.string() +
                 ") failed: " + failed);
    failed.clear();
  }
  if (!failed.empty()) {
    throw CheckpointError("accel: the background save of " + impl_->save_target_.string() +
                          " failed (the checkpoints before it are intact): " + failed);
  }
}

fs::path Accelerator::tracker_dir() const { return impl_->tracking_->dir; }

void Accelerator::on_loader_progress(std::size_t loader, const PassProgress& progress) {
  auto& t = *impl_->tracking_;
  if (!t.bar) return;
  std::string label = "epoch " + std::to_string(progress.epoch);
  if (impl_->loaders_.size() > 1) label = "loader " + std::to_string(loader) + " " + label;
  t.bar->update(label, progress, t.last_values);
}

}  // namespace accel

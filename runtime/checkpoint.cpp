// Accelerator checkpoints: load_state, the project's checkpoint settings (automatic naming, the
// folder, latest_checkpoint), get_state_dict and the save/load state hooks. The save half
// (save_state, the background save, save_model) is in checkpoint_save.cpp; automatic resume and
// periodic saves in checkpoint_resume.cpp; the folder's layout in checkpoint_layout.h.
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>

#include "accel/accelerator.h"
#include "contract/json_depth.h"
#include "contract/worker_contract.h"
#include "runtime/accelerator_impl.h"
#include "runtime/checkpoint_io.h"
#include "runtime/checkpoint_layout.h"
#include "runtime/checkpoint_manifest.h"
#include "runtime/checkpoint_reader.h"
#include "runtime/comm.h"
#include "runtime/env.h"
#include "runtime/log.h"
#include "runtime/optimizer_steps.h"
#include "runtime/optimizer_tensors.h"
#include "runtime/safetensors.h"
#include "runtime/stop_request.h"
#include "runtime/tracking.h"

namespace accel {

using ckpt::checkpoint_number;
using ckpt::CheckpointReader;
using ckpt::complete_checkpoints;
using ckpt::indexed;
using ckpt::kDefaultLauncherTotalLimit;
using ckpt::kManifest;
using ckpt::rank_file;

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

using safetensors::module_tensors;

// True when `dir` is an automatic checkpoint: checkpoint_<n> directly under `root`.
bool is_automatic_checkpoint(const fs::path& dir, const std::optional<std::string>& project_dir) {
  if (!project_dir || project_dir->empty()) return false;
  auto d = fs::absolute(dir).lexically_normal();
  if (d.filename().empty()) d = d.parent_path();  // "…/checkpoint_3/"
  std::error_code ec, ec2;
  auto parent = fs::weakly_canonical(d.parent_path(), ec);
  auto root = fs::weakly_canonical(fs::path(*project_dir) / "checkpoints", ec2);
  return !ec && !ec2 && parent == root && checkpoint_number(d.filename().string()) >= 0;
}

// Checks that every name, shape and dtype of `tensors` (decoded from `where`) matches `model`;
// with `copy`, then copies them in (nothing is copied when anything does not match).
void apply_model_state(torch::nn::Module& model, const safetensors::NamedTensors& tensors,
                       const fs::path& where, bool copy) {
  std::map<std::string, torch::Tensor> saved(tensors.begin(), tensors.end());
  auto live = module_tensors(model);
  std::vector<std::string> problems;
  for (auto& [name, tensor] : live) {
    auto it = saved.find(name);
    if (it == saved.end()) {
      problems.push_back("\"" + name + "\" is missing");
    } else if (it->second.sizes() != tensor.sizes() ||
               it->second.scalar_type() != tensor.scalar_type()) {
      std::ostringstream s;
      s << "\"" << name << "\" is " << it->second.scalar_type() << it->second.sizes()
        << ", the model has " << tensor.scalar_type() << tensor.sizes();
      problems.push_back(s.str());
    }
  }
  for (auto& [name, tensor] : saved) {
    bool known =
        std::any_of(live.begin(), live.end(), [&](const auto& l) { return l.first == name; });
    if (!known) problems.push_back("\"" + name + "\" is not in the model");
  }
  if (!problems.empty()) {
    std::string all;
    for (std::size_t i = 0; i < problems.size() && i < 8; ++i) all += (i ? "; " : "") + problems[i];
    if (problems.size() > 8) all += "; and " + std::to_string(problems.size() - 8) + " more";
    CheckpointReader::fail(where, "does not match the prepared model: " + all);
  }
  if (!copy) return;
  torch::NoGradGuard no_grad;
  for (auto& [name, tensor] : live) tensor.copy_(saved.at(name));
}

// An optimizer's state and options, sharing the state's tensors. Enough to undo a failed load:
// libtorch's load puts new state objects with new tensors in place and never writes into the old.
struct OptimizerSnapshot {
  // Why the map's own key type: libtorch 1.13 (Debian's) keys the state by a string, later
  // versions by the parameter's TensorImpl pointer.
  using StateMap =
      std::remove_reference_t<decltype(std::declval<torch::optim::Optimizer&>().state())>;
  std::vector<std::pair<StateMap::key_type, std::unique_ptr<torch::optim::OptimizerParamState>>>
      state;
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> options;

  explicit OptimizerSnapshot(torch::optim::Optimizer& optimizer) {
    for (const auto& [key, value] : optimizer.state()) state.emplace_back(key, value->clone());
    for (auto& group : optimizer.param_groups()) options.push_back(group.options().clone());
  }
  void restore(torch::optim::Optimizer& optimizer) {
    optimizer.state().clear();
    for (auto& [key, value] : state) optimizer.state()[key] = std::move(value);
    auto& groups = optimizer.param_groups();
    for (std::size_t g = 0; g < groups.size() && g < options.size(); ++g)
      groups[g].set_options(std::move(options[g]));
  }
};

void load_archive(torch::optim::Optimizer& optimizer, std::string_view bytes,
                  torch::Device device) {
  torch::serialize::InputArchive archive;
  archive.load_from(bytes.data(), bytes.size(), device);
  optimizer.load(archive);
}

// Why checked: a resumed run cuts these files back, so a damaged or hostile manifest must not
// name anything but a tracker file inside the run's folder.
std::optional<tracking::Position> saved_tracker_position(const json& m, const fs::path& source) {
  if (!m.contains("trackers") || m["trackers"].is_null()) return std::nullopt;
  const json& t = m["trackers"];
  auto where = source / kManifest;
  if (!t.is_object() || !t.contains("run") || !t["run"].is_string() || !t.contains("files") ||
      !t["files"].is_object()) {
    CheckpointReader::fail(where, "has \"trackers\" that is not {\"run\", \"files\"}");
  }
  tracking::Position p;
  p.run = t["run"].get<std::string>();
  for (const auto& [name, size] : t["files"].items()) {
    if (!ckpt::is_plain_file_name(name) || !tracking::is_tracker_file(name) ||
        !size.is_number_unsigned()) {
      CheckpointReader::fail(where, "has a \"trackers\" entry " + json(name).dump().substr(0, 100) +
                                        ": expected a tracker file name and its size in bytes");
    }
    p.files[name] = size.get<uint64_t>();
  }
  return p;
}

}  // namespace

// --- configuration ------------------------------------------------------------------------------

void Accelerator::setup_project() {
  impl_->project_ = options_.project;
  bool from_launcher = false;
  if (!impl_->project_.project_dir) {
    // Why checkpoint_dir first: it names where checkpoints go; project_dir is the folder for
    // everything of the run (trackers too).
    if (const auto& dir = env::worker_env().checkpoint_dir) {
      impl_->project_.project_dir = *dir;
      from_launcher = true;
    } else if (const auto& project = env::worker_env().project_dir) {
      impl_->project_.project_dir = *project;
      from_launcher = true;
    }
  }
  if (!impl_->project_.logging_dir) {
    if (const auto& project = env::worker_env().project_dir) {
      impl_->project_.logging_dir = *project;
    } else if (impl_->project_.project_dir && !impl_->project_.project_dir->empty()) {
      impl_->project_.logging_dir = *impl_->project_.project_dir;
    }
  }
  if (!impl_->project_.total_limit) {
    if (const auto& limit = env::worker_env().checkpoint_total_limit) {
      impl_->project_.total_limit = *limit;
    } else if (from_launcher) {
      // Why: periodic saves under accel-launch would otherwise fill the disk on a long job.
      impl_->project_.total_limit = kDefaultLauncherTotalLimit;
    }
  }
  const bool resume_off_in_code =
      impl_->project_.automatic_resume.has_value() && !*impl_->project_.automatic_resume;
  setup_snapshots(resume_off_in_code);
  // Why only when the launcher gives a folder: that is a job asking to be resumable; a folder in
  // code alone is HF's project_dir, which never resumes by itself.
  if (!impl_->project_.automatic_resume) {
    impl_->project_.automatic_resume =
        env::worker_env().checkpoint_dir.has_value() || env::worker_env().project_dir.has_value();
  }
  bool has_dir = impl_->project_.project_dir && !impl_->project_.project_dir->empty();
  if (!impl_->project_.automatic_checkpoint_naming)
    impl_->project_.automatic_checkpoint_naming = has_dir;
  if (!impl_->project_.save_interval) {
    impl_->project_.save_interval = env::worker_env().checkpoint_interval;
  }
  if (!impl_->project_.async_checkpoints) {
    impl_->project_.async_checkpoints = env::worker_env().async_checkpoints;
  }
  if (*impl_->project_.save_interval < 0) {
    throw ConfigError("accel: ProjectConfiguration::save_interval must be >= 0, got " +
                      std::to_string(*impl_->project_.save_interval));
  }
  if (*impl_->project_.save_interval > 0 &&
      !(has_dir && *impl_->project_.automatic_checkpoint_naming)) {
    throw ConfigError(
        "accel: a save interval of " + std::to_string(*impl_->project_.save_interval) +
        " steps (ACCEL_CHECKPOINT_INTERVAL or ProjectConfiguration::save_interval) needs a "
        "project_dir "
        "with automatic checkpoint naming (ACCEL_CHECKPOINT_DIR or --checkpoint-dir)");
  }
  if (has_dir && *impl_->project_.automatic_checkpoint_naming)
    impl_->stop_on_signal_ = stop_request::arm();
  if (impl_->project_.total_limit && *impl_->project_.total_limit < 1) {
    throw ConfigError("accel: ProjectConfiguration::total_limit must be at least 1, got " +
                      std::to_string(*impl_->project_.total_limit));
  }
}

fs::path Accelerator::latest_checkpoint() const {
  if (!impl_->project_.project_dir || impl_->project_.project_dir->empty()) return {};
  auto all = complete_checkpoints(fs::path(*impl_->project_.project_dir) / "checkpoints");
  return all.empty() ? fs::path() : all.back();
}

// --- load
// -----------------------------------------------------------------------------------------

namespace {

// Checks that the checkpoint holds as many objects of each kind as are prepared.
void check_contents(const CheckpointReader& ckpt,
                    const std::vector<std::pair<const char*, std::size_t>>& prepared,
                    bool has_scaler) {
  const auto manifest = ckpt.dir() / kManifest;
  const auto& c = CheckpointReader::field(ckpt.manifest(), "contents", manifest);
  for (const auto& [kind, count] : prepared) {
    auto saved = c.value(kind, static_cast<std::size_t>(0));
    if (saved != count) {
      CheckpointReader::fail(ckpt.dir(),
                             "holds " + std::to_string(saved) + " " + kind + " but " +
                                 std::to_string(count) +
                                 " are prepared/registered here; prepare() the "
                                 "same objects, in the same order, before load_state()");
    }
  }
  if (has_scaler && !c.value("scaler", false)) {
    log::warning("checkpoint " + ckpt.dir().string() +
                 " has no loss-scaler state; the scaler starts from its initial scale");
  }
}

// The loader positions saved by `rank` (from its random_states file's metadata).
std::vector<LoaderState> saved_positions(const safetensors::Decoded& d, const fs::path& where) {
  std::vector<LoaderState> out;
  auto it = d.metadata.find("loaders");
  if (it == d.metadata.end()) CheckpointReader::fail(where, "has no \"loaders\" metadata");
  if (auto deep = contract::json_nesting_problem(it->second); !deep.empty())
    CheckpointReader::fail(where, "has \"loaders\" metadata that " + deep);
  try {
    for (const auto& p : json::parse(it->second))
      out.push_back({p.at("epoch").get<int64_t>(), p.at("batches").get<uint64_t>()});
  } catch (const json::exception& e) {
    CheckpointReader::fail(where, std::string("has unreadable \"loaders\" metadata: ") + e.what());
  }
  return out;
}

}  // namespace

fs::path Accelerator::load_state(const fs::path& dir) {
  wait_for_checkpoint();  // Why: the newest checkpoint may be the one still being written
  // Why: an explicit load chooses the checkpoint; an automatic resume later would load another.
  impl_->resume_checked_ = true;
  fs::path source = dir;
  if (source.empty()) {
    std::string chosen = is_main_process() ? latest_checkpoint().string() : std::string();
    // Why: ranks must load the same checkpoint even if a shared file system lags.
    if (use_distributed()) chosen = broadcast_object(chosen);
    if (chosen.empty()) {
      throw CheckpointError("accel: load_state(): no complete checkpoint under " +
                            (impl_->project_.project_dir
                                 ? (fs::path(*impl_->project_.project_dir) / "checkpoints").string()
                                 : std::string("(no project_dir set)")));
    }
    source = chosen;
  }
  fs::path loaded = load_from(source, /*verify_checksums=*/true);
  if (is_main_process()) log::debug("resumed from checkpoint " + loaded.string());
  return loaded;
}

fs::path Accelerator::load_from(const fs::path& source, bool verify_checksums) {
  for (const auto& [id, hook] : std::map<int64_t, StateHook>(*impl_->load_hooks_))
    hook(impl_->models_, source);
  CheckpointReader ckpt(source, verify_checksums);
  const auto& m = ckpt.manifest();
  check_contents(ckpt,
                 {{"models", impl_->models_.size()},
                  {"optimizers", impl_->optimizers_.size()},
                  {"schedulers", impl_->schedulers_.size()},
                  {"custom", impl_->custom_.size()}},
                 impl_->scaler_ != nullptr);
  int saved_world = m["world_size"].get<int>();
  bool same_world = saved_world == num_processes();
  auto tracker_resume = saved_tracker_position(m, source);

  // Read and check everything first, so a bad file changes nothing.
  std::vector<ckpt::MappedFile> model_files;  // Why kept: the decoded tensors are views of them
  std::vector<safetensors::Decoded> models;
  for (std::size_t i = 0; i < impl_->models_.size(); ++i) {
    auto name = indexed("model", i, ".safetensors");
    model_files.push_back(ckpt.read(name));
    models.push_back(safetensors::decode(model_files.back().view(), (source / name).string(),
                                         safetensors::Memory::kBorrow));
  }
  // libtorch's own optimizers' state is a safetensors file; any other optimizer's (and, in
  // checkpoints written before the safetensors file, every optimizer's) libtorch's archive (.bin).
  std::vector<ckpt::MappedFile> optimizers;
  std::vector<std::string> optimizer_names;
  for (std::size_t i = 0; i < impl_->optimizers_.size(); ++i) {
    auto tensors = indexed("optimizer", i, ".safetensors");
    optimizer_names.push_back(ckpt.has(tensors) ? tensors : indexed("optimizer", i, ".bin"));
    optimizers.push_back(ckpt.read(optimizer_names.back()));
  }
  std::vector<int64_t> scheduler_steps;
  for (std::size_t i = 0; i < impl_->schedulers_.size(); ++i) {
    auto name = indexed("scheduler", i, ".json");
    const std::string text(ckpt.read(name).view());
    if (auto deep = contract::json_nesting_problem(text); !deep.empty())
      CheckpointReader::fail(source / name, deep);
    try {
      scheduler_steps.push_back(json::parse(text).at("steps").get<int64_t>());
    } catch (const json::exception& e) {
      CheckpointReader::fail(source / name, std::string("is not {\"steps\": n}: ") + e.what());
    }
    if (scheduler_steps.back() < impl_->schedulers_[i]->steps) {
      CheckpointReader::fail(source / name,
                             "was saved after " + std::to_string(scheduler_steps.back()) +
                                 " scheduler steps, but this scheduler has already taken " +
                                 std::to_string(impl_->schedulers_[i]->steps) +
                                 "; load_state() before training, with a fresh scheduler");
    }
  }
  std::vector<std::string> custom;
  for (std::size_t i = 0; i < impl_->custom_.size(); ++i) {
    custom.emplace_back(ckpt.read("custom_checkpoint_" + std::to_string(i) + ".bin").view());
  }
  std::optional<std::string> scaler_state;
  if (impl_->scaler_ && ckpt.has("scaler.json")) {
    scaler_state = std::string(ckpt.read("scaler.json").view());
    // a check only
    GradScaler(impl_->scaler_->options())
        .load_state_dict(*scaler_state, (source / "scaler.json").string());
  }
  auto rank_name = rank_file(static_cast<std::size_t>(same_world ? process_index() : 0));
  auto rank = safetensors::decode(ckpt.read(rank_name).view(), (source / rank_name).string());
  auto positions = saved_positions(rank, source / rank_name);
  if (positions.size() != impl_->loaders_.size()) {
    CheckpointReader::fail(source / rank_name, "holds " + std::to_string(positions.size()) +
                                                   " data loader positions but " +
                                                   std::to_string(impl_->loaders_.size()) +
                                                   " loaders are prepared here");
  }
  for (std::size_t i = 0; i < impl_->models_.size(); ++i) {
    apply_model_state(*impl_->models_[i], models[i].tensors,
                      source / indexed("model", i, ".safetensors"), false);
  }
  // Optimizers first: loading is the only check libtorch offers, so on a failure every optimizer
  // gets its previous state back and nothing else has changed yet.
  std::vector<OptimizerSnapshot> before;
  for (auto& slot : impl_->optimizers_) before.emplace_back(*slot->optimizer);
  for (std::size_t i = 0; i < impl_->optimizers_.size(); ++i) {
    const auto where = source / optimizer_names[i];
    try {
      if (optimizer_names[i].ends_with(".safetensors")) {
        ckpt::load_optimizer_tensors(
            *impl_->optimizers_[i]->optimizer,
            safetensors::decode(optimizers[i].view(), where.string(), safetensors::Memory::kBorrow),
            where.string() + " (prepared optimizer " + std::to_string(i) + ")", device());
      } else {
        load_archive(*impl_->optimizers_[i]->optimizer, optimizers[i].view(), device());
      }
    } catch (const c10::Error& e) {
      for (std::size_t j = 0; j <= i; ++j) before[j].restore(*impl_->optimizers_[j]->optimizer);
      CheckpointReader::fail(where, std::string("cannot be loaded into prepared optimizer ") +
                                        std::to_string(i) + ": " + e.what_without_backtrace());
    } catch (const CheckpointError&) {
      for (std::size_t j = 0; j <= i; ++j) before[j].restore(*impl_->optimizers_[j]->optimizer);
      throw;
    }
  }
  // ZeRO: each rank keeps its slices of the loaded (full) state, once every one fits.
  for (std::size_t i = 0; i < impl_->optimizers_.size(); ++i) {
    if (!impl_->optimizers_[i]->zero) continue;
    try {
      impl_->optimizers_[i]->zero->check_loaded((source / optimizer_names[i]).string());
    } catch (...) {
      for (std::size_t j = 0; j < impl_->optimizers_.size(); ++j)
        before[j].restore(*impl_->optimizers_[j]->optimizer);
      throw;
    }
  }
  for (auto& slot : impl_->optimizers_)
    if (slot->zero) slot->zero->adopt_state();
  for (std::size_t i = 0; i < impl_->optimizers_.size(); ++i) {
    const auto& steps = m["optimizer_steps"];
    impl_->optimizers_[i]->steps =
        i < steps.size() && steps[i].is_number_integer() ? steps[i].get<int64_t>() : 0;
    // The loaded state carries its own step count: the new baseline.
    if (impl_->optimizers_[i]->own_steps >= 0)
      impl_->optimizers_[i]->own_steps = detail::own_step_count(*impl_->optimizers_[i]->optimizer);
  }
  // Schedulers replay their steps (libtorch's have no state to save), which moves the learning
  // rates; the saved rates are then set exactly (libtorch's optimizer load does not).
  for (std::size_t i = 0; i < impl_->schedulers_.size(); ++i) {
    while (impl_->schedulers_[i]->steps < scheduler_steps[i]) {
      impl_->schedulers_[i]->scheduler->step();
      ++impl_->schedulers_[i]->steps;
    }
  }
  const auto& lrs = m.contains("optimizer_lrs") && m["optimizer_lrs"].is_array()
                        ? m["optimizer_lrs"]
                        : json::array();
  for (std::size_t i = 0; i < impl_->optimizers_.size() && i < lrs.size(); ++i) {
    auto& groups = impl_->optimizers_[i]->optimizer->param_groups();
    for (std::size_t g = 0; g < groups.size() && g < lrs[i].size(); ++g) {
      if (lrs[i][g].is_number()) groups[g].options().set_lr(lrs[i][g].get<double>());
    }
  }
  for (std::size_t i = 0; i < impl_->models_.size(); ++i) {
    apply_model_state(*impl_->models_[i], models[i].tensors,
                      source / indexed("model", i, ".safetensors"), true);
  }
  if (scaler_state)
    impl_->scaler_->load_state_dict(*scaler_state, (source / "scaler.json").string());
  for (std::size_t i = 0; i < impl_->custom_.size(); ++i) impl_->custom_[i].load(custom[i]);

  // Per-rank state: exact only with the same world size.
  if (same_world) {
    for (auto& [name, state] : rank.tensors) {
      if (name == "rng.cpu") {
        auto gen = at::detail::getDefaultCPUGenerator();
        std::lock_guard<std::mutex> lock(gen.mutex());
        gen.set_state(state);
      } else if (name.rfind("rng.cuda.", 0) == 0 && torch::cuda::is_available()) {
        auto index = std::stoi(name.substr(9));
        if (index < static_cast<int>(torch::cuda::device_count())) {
          auto gen = at::globalContext().defaultGenerator(
              at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index)));
          std::lock_guard<std::mutex> lock(gen.mutex());
          gen.set_state(state);
        }
      }
    }
    for (std::size_t i = 0; i < impl_->loaders_.size(); ++i)
      impl_->loaders_[i].load_state(positions[i]);
  } else {
    // Map the position to the same number of samples under the new global batch.
    if (is_main_process()) {
      log::warning("checkpoint " + source.string() + " was saved by " +
                   std::to_string(saved_world) + " processes, this job has " +
                   std::to_string(num_processes()) +
                   ": model, optimizer, scheduler and scaler are restored exactly; the RNG "
                   "states are not (each was saved for one of the old ranks)");
    }
    const auto& saved = m["loaders"];
    for (std::size_t i = 0; i < impl_->loaders_.size(); ++i) {
      auto old_total = saved[i].value("total_batch_size", static_cast<uint64_t>(1));
      auto samples = positions[i].batches * old_total;
      auto now = static_cast<uint64_t>(impl_->loaders_[i].total_batch_size());
      impl_->loaders_[i].load_state({positions[i].epoch, samples / now});
      if (is_main_process() && positions[i].batches > 0) {
        std::string text = "loader " + std::to_string(i) + " resumes epoch " +
                           std::to_string(positions[i].epoch) + " at sample " +
                           std::to_string((samples / now) * now);
        if (samples % now != 0) {
          text += ", not " + std::to_string(samples) + ": " + std::to_string(samples % now) +
                  " samples seen before the save are seen again (the new global batch of " +
                  std::to_string(now) + " does not divide " + std::to_string(samples) + ")";
        }
        log::warning(text);
      }
    }
  }
  gradient_state_->set_step(m.value("accumulation_step", static_cast<int64_t>(0)));
  impl_->tracking_->resume = std::move(tracker_resume);
  if (impl_->tracking_->trackers && impl_->tracking_->trackers->is_open()) {
    // Loaded mid-run: the files go back to this checkpoint too.
    impl_->tracking_->trackers->close();
    open_trackers();
  }
  impl_->project_.iteration = m["iteration"].get<int64_t>() + 1;
  // Why: the periodic save need not write the step just loaded again; SIGUSR1 at this step may
  // reuse the loaded folder only if it is an automatic checkpoint (a rotation keeps it, as the
  // newest).
  if (m.value("snapshot", false)) {
    // An in-memory snapshot: the automatic checkpoints stand where they stood when it was taken.
    impl_->last_auto_save_ = m.value("last_checkpoint_step", static_cast<int64_t>(0));
    impl_->last_auto_save_dir_.clear();
    impl_->last_snapshot_ = completed_steps();
  } else {
    impl_->last_auto_save_ = completed_steps();
    impl_->last_auto_save_dir_ =
        is_automatic_checkpoint(source, impl_->project_.project_dir) ? source : fs::path();
  }
  if (m.value("mixed_precision", std::string("no")) != impl_->mixed_precision_ &&
      is_main_process()) {
    log::warning("checkpoint " + source.string() + " was saved with mixed_precision=" +
                 m.value("mixed_precision", std::string("no")) + ", this run uses " +
                 impl_->mixed_precision_);
  }
  return source;
}

std::vector<std::pair<std::string, torch::Tensor>> Accelerator::get_state_dict(
    const torch::nn::Module& model) const {
  return module_tensors(model);
}

namespace {

Accelerator::HookHandle add_hook(std::shared_ptr<std::map<int64_t, Accelerator::StateHook>> hooks,
                                 int64_t id, Accelerator::StateHook hook) {
  if (!hook) throw UsageError("accel: a state pre-hook must not be empty");
  (*hooks)[id] = std::move(hook);
  std::weak_ptr<std::map<int64_t, Accelerator::StateHook>> weak = hooks;
  return {[weak, id] {
    if (auto h = weak.lock()) h->erase(id);
  }};
}

}  // namespace

Accelerator::HookHandle Accelerator::register_save_state_pre_hook(StateHook hook) {
  return add_hook(impl_->save_hooks_, impl_->next_hook_id_++, std::move(hook));
}

Accelerator::HookHandle Accelerator::register_load_state_pre_hook(StateHook hook) {
  return add_hook(impl_->load_hooks_, impl_->next_hook_id_++, std::move(hook));
}

}  // namespace accel

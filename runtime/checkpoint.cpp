// Accelerator checkpoints: save_state / load_state (one folder with a manifest, published
// atomically by rank 0), automatic naming, rotation and resume, and save_model.
#include <c10/util/Type.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>

#include "accel/accelerator.h"
#include "contract/json_depth.h"
#include "contract/worker_contract.h"
#include "runtime/accelerator_impl.h"
#include "runtime/checkpoint_io.h"
#include "runtime/checkpoint_manifest.h"
#include "runtime/comm.h"
#include "runtime/env.h"
#include "runtime/log.h"
#include "runtime/optimizer_steps.h"
#include "runtime/progress.h"
#include "runtime/safetensors.h"
#include "runtime/stop_request.h"
#include "runtime/tracking.h"

namespace accel {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr const char* kFormat = ckpt::kManifestFormat;
constexpr int kFormatVersion = ckpt::kManifestFormatVersion;
constexpr const char* kManifest = "manifest.json";
constexpr const char* kCheckpointPrefix = "checkpoint_";
// Automatic checkpoints kept when ACCEL_CHECKPOINT_DIR comes from accel-launch and neither
// ProjectConfiguration::total_limit nor ACCEL_CHECKPOINT_TOTAL_LIMIT says otherwise.
constexpr int64_t kDefaultLauncherTotalLimit = 3;

std::string indexed(const std::string& stem, std::size_t i, const std::string& ext) {
  return i == 0 ? stem + ext : stem + "_" + std::to_string(i) + ext;
}
std::string rank_file(std::size_t rank) {
  return "random_states_" + std::to_string(rank) + ".safetensors";
}

using safetensors::module_tensors;

// What makes a run the same run, recorded in the manifest's "run" and compared on automatic
// resume: each model's tensor names and shapes, each optimizer's type, each loader's dataset
// size. (World size and accumulation may change between attempts of one elastic job.)
json model_identity(const torch::nn::Module& m) {
  json tensors = json::object();
  for (const auto& [name, t] : module_tensors(m)) tensors[name] = t.sizes().vec();
  return tensors;
}

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

// One file of a checkpoint: its name and what writes its bytes (owning what it writes from).
struct OutFile {
  std::string name;
  std::function<void(const ckpt::Sink&)> produce;
};

OutFile bytes_file(std::string name, std::string bytes) {
  auto owned = std::make_shared<std::string>(std::move(bytes));
  return {std::move(name), [owned](const ckpt::Sink& sink) { sink(*owned); }};
}

// Streams the tensors' bytes from their own memory: no copy of the whole file is made.
OutFile safetensors_file(std::string name, safetensors::Encoded encoded) {
  auto owned = std::make_shared<safetensors::Encoded>(std::move(encoded));
  return {std::move(name), [owned](const ckpt::Sink& sink) {
            for (auto part : owned->parts()) sink(part);
          }};
}

// libtorch's archive, streamed straight into the file as it serializes.
OutFile optimizer_file(std::string name, const torch::optim::Optimizer& optimizer) {
  auto archive = std::make_shared<torch::serialize::OutputArchive>();
  optimizer.save(*archive);
  return {std::move(name), [archive](const ckpt::Sink& sink) {
            std::exception_ptr failed;
            archive->save_to([&](const void* data, std::size_t n) -> std::size_t {
              // Why: an exception must not cross miniz or PyTorchStreamWriter's destructor, which
              // writes the zip's end and, in libtorch 1.13, terminates the process on a second
              // throw. The first error is kept, the rest of the archive dropped, the error
              // rethrown.
              if (!failed) {
                try {
                  sink(std::string_view(static_cast<const char*>(data), n));
                } catch (...) {
                  failed = std::current_exception();
                }
              }
              return n;
            });
            if (failed) std::rethrow_exception(failed);
          }};
}

// For a background save: the optimizer's archive built from deep copies of its state, so the
// writer thread reads memory that training no longer changes. libtorch's own optimizers' states
// are copied tensor by tensor (the archive is then built from the copies: no serialization
// here); any other optimizer is serialized into memory now.
bool deep_copy_state(torch::optim::OptimizerParamState& state) {
  namespace o = torch::optim;
  auto copy = [](const torch::Tensor& t) {
    return t.defined() ? t.detach().clone(torch::MemoryFormat::Preserve) : t;
  };
  if (auto* a = dynamic_cast<o::AdamWParamState*>(&state)) {
    a->exp_avg(copy(a->exp_avg())).exp_avg_sq(copy(a->exp_avg_sq()));
    a->max_exp_avg_sq(copy(a->max_exp_avg_sq()));
  } else if (auto* b = dynamic_cast<o::AdamParamState*>(&state)) {
    b->exp_avg(copy(b->exp_avg())).exp_avg_sq(copy(b->exp_avg_sq()));
    b->max_exp_avg_sq(copy(b->max_exp_avg_sq()));
  } else if (auto* c = dynamic_cast<o::SGDParamState*>(&state)) {
    c->momentum_buffer(copy(c->momentum_buffer()));
  } else if (auto* d = dynamic_cast<o::AdagradParamState*>(&state)) {
    d->sum(copy(d->sum()));
  } else if (auto* e = dynamic_cast<o::RMSpropParamState*>(&state)) {
    e->square_avg(copy(e->square_avg()));
    e->momentum_buffer(copy(e->momentum_buffer()));
    e->grad_avg(copy(e->grad_avg()));
  } else {
    return false;
  }
  return true;
}

OutFile optimizer_snapshot(std::string name, torch::optim::Optimizer& optimizer) {
  namespace o = torch::optim;
  auto& live = optimizer.state();
  std::remove_reference_t<decltype(live)> copies;
  // Why exact types: another optimizer (a subclass included) may save more than its state(), or
  // keep states whose clone() libtorch does not provide; it is serialized into memory instead.
  const auto& type = typeid(optimizer);
  bool copied = type == typeid(o::Adam) || type == typeid(o::AdamW) || type == typeid(o::SGD) ||
                type == typeid(o::Adagrad) || type == typeid(o::RMSprop);
  for (const auto& [key, state] : live) {
    if (!copied) break;
    auto c = state->clone();  // shares the tensors: deep_copy_state replaces them
    if (!deep_copy_state(*c)) {
      copied = false;
      break;
    }
    copies.emplace(key, std::move(c));
  }
  // Why: the copies of CUDA state are queued on this thread's stream; the writer thread reads
  // them from its own.
  if (copied && !copies.empty() && torch::cuda::is_available()) torch::cuda::synchronize();
  if (!copied) {
    std::string bytes;
    auto archive = torch::serialize::OutputArchive();
    optimizer.save(archive);
    archive.save_to([&bytes](const void* data, std::size_t n) -> std::size_t {
      bytes.append(static_cast<const char*>(data), n);
      return n;
    });
    return bytes_file(std::move(name), std::move(bytes));
  }
  // Why a swap: Optimizer::save archives state(); the copies stand in for the live state while it
  // runs, and go back even if it throws.
  std::swap(live, copies);
  struct SwapBack {
    decltype(live)& a;
    decltype(copies)& b;
    ~SwapBack() { std::swap(a, b); }
  } swap_back{live, copies};
  return optimizer_file(std::move(name), optimizer);
}

// A model's tensors copied to CPU memory of their own, for a background save.
safetensors::NamedTensors snapshot(safetensors::NamedTensors tensors) {
  for (auto& [name, t] : tensors)
    t = t.detach().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true).contiguous();
  return tensors;
}

std::string join(const safetensors::Encoded& e) {
  std::string out;
  out.reserve(e.size());
  for (auto part : e.parts()) out.append(part);
  return out;
}

// <n> of "checkpoint_<n>", or -1.
int64_t checkpoint_number(const std::string& name) {
  if (name.rfind(kCheckpointPrefix, 0) != 0) return -1;
  auto digits = name.substr(std::string(kCheckpointPrefix).size());
  if (digits.empty() || digits.size() > 15 || !std::all_of(digits.begin(), digits.end(), ::isdigit))
    return -1;
  return std::stoll(digits);
}

// The complete automatic checkpoints under `root` (checkpoint_<n> folders with a manifest),
// oldest first. A save publishes the manifest last, so a folder without one is not a checkpoint.
std::vector<fs::path> complete_checkpoints(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> numbered;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    int64_t n = checkpoint_number(entry.path().filename().string());
    if (n >= 0 && entry.is_directory(ec) && fs::exists(entry.path() / kManifest, ec))
      numbered.emplace_back(n, entry.path());
  }
  std::sort(numbered.begin(), numbered.end());
  std::vector<fs::path> out;
  for (auto& [n, path] : numbered) out.push_back(std::move(path));
  return out;
}

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

// The checked contents of a checkpoint folder: its manifest, and its files' bytes on demand.
class CheckpointReader {
 public:
  // `checksums` false: read() checks sizes only (the files were verified a moment ago).
  explicit CheckpointReader(fs::path dir, bool checksums = true)
      : dir_(std::move(dir)), checksums_(checksums) {
    auto path = dir_ / kManifest;
    std::error_code ec;
    if (!fs::is_directory(dir_, ec)) fail(dir_, "is not a folder");
    if (!fs::exists(path, ec)) {
      fail(dir_, "has no manifest.json: not an accel checkpoint, or one whose save did not finish");
    }
    auto checked = ckpt::parse_manifest(ckpt::checkpoint_fs().read_file(path), path);
    manifest_ = std::move(checked.manifest);
    files_ = std::move(checked.files);
  }

  const json& manifest() const { return manifest_; }
  // Reads every listed file and checks its size and checksum (CheckpointError on the first bad
  // one).
  void verify_files() const {
    for (const auto& [name, entry] : files_) read(name);
  }
  const fs::path& dir() const { return dir_; }
  bool has(const std::string& name) const { return files_.count(name) != 0; }

  // The file's bytes, checked against the manifest's size and checksum.
  ckpt::MappedFile read(const std::string& name) const {
    auto path = dir_ / name;
    auto it = files_.find(name);
    if (it == files_.end()) fail(path, "is not listed in manifest.json");
    std::error_code ec;
    if (!fs::exists(path, ec)) fail(path, "is missing (listed in manifest.json)");
    auto bytes = ckpt::checkpoint_fs().map_file(path);
    auto expected = it->second["size"].get<uint64_t>();
    if (bytes.size() != expected) {
      fail(path, "has " + std::to_string(bytes.size()) + " bytes, manifest.json says " +
                     std::to_string(expected) + (bytes.size() < expected ? " (truncated)" : ""));
    }
    if (!checksums_) return bytes;
    auto sum = ckpt::to_hex(ckpt::checksum(bytes.view()));
    if (sum != it->second["xxh64"].get<std::string>()) {
      fail(path, "is corrupt: its xxh64 is " + sum + ", manifest.json says " +
                     it->second["xxh64"].get<std::string>());
    }
    return bytes;
  }

  [[noreturn]] static void fail(const fs::path& where, const std::string& what) {
    throw CheckpointError("accel: checkpoint " + where.string() + " " + what);
  }
  static const json& field(const json& j, const char* key, const fs::path& where) {
    if (!j.contains(key)) fail(where, std::string("has no \"") + key + "\"");
    return j[key];
  }

 private:
  fs::path dir_;
  bool checksums_;
  json manifest_;
  std::map<std::string, json> files_;
};

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

// The manifest's "trackers": null, or the run and its tracker files' sizes at the save.
json tracker_position(const detail::Tracking* tracking) {
  if (tracking == nullptr || !tracking->trackers || !tracking->trackers->is_open()) return json();
  auto p = tracking->trackers->position();
  return {{"run", p.run}, {"files", p.files}};
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

// --- save
// -----------------------------------------------------------------------------------------

namespace {

// This rank's part of a checkpoint: its RNG states and its loaders' positions.
std::string rank_state(int rank, const std::vector<DataLoader>& loaders) {
  safetensors::NamedTensors tensors;
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    tensors.emplace_back("rng.cpu", gen.get_state());
  }
  if (torch::cuda::is_available()) {
    for (int i = 0; i < static_cast<int>(torch::cuda::device_count()); ++i) {
      auto gen = at::globalContext().defaultGenerator(
          at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(i)));
      std::lock_guard<std::mutex> lock(gen.mutex());
      tensors.emplace_back("rng.cuda." + std::to_string(i), gen.get_state());
    }
  }
  json positions = json::array();
  for (const auto& l : loaders) {
    auto s = l.state();
    positions.push_back({{"epoch", s.epoch}, {"batches", s.batches}});
  }
  return join(safetensors::encode(tensors,
                                  {{"rank", std::to_string(rank)}, {"loaders", positions.dump()}}));
}

// Where an overwrite without RENAME_EXCHANGE keeps the old folder while the new one moves in.
fs::path set_aside_name(const fs::path& target) {
  return target.parent_path() /
         ("." + target.filename().string() + ".old-" + std::to_string(::getpid()));
}

// Puts a folder an interrupted overwrite set aside back at `target` when `target` is missing,
// and removes it when `target` is there (the overwrite got that far). Returns true when it moved
// one.
bool restore_set_aside(ckpt::CheckpointFs& io, const fs::path& target) {
  const auto prefix = "." + target.filename().string() + ".old-";
  std::error_code ec;
  bool restored = false;
  for (const auto& entry : fs::directory_iterator(
           target.parent_path().empty() ? fs::path(".") : target.parent_path(), ec)) {
    if (entry.path().filename().string().rfind(prefix, 0) != 0) continue;
    if (!restored && !fs::exists(target, ec)) {
      io.rename(entry.path(), target);
      restored = true;
    } else {
      io.remove_all(entry.path());
    }
  }
  return restored;
}

// Writes every file into `tmp`, then the manifest listing them, fsyncs, and puts `tmp` in place
// of `target` (a swap when `target` exists, so there is no moment without it).
void fill_and_publish(ckpt::CheckpointFs& io, const fs::path& tmp, const fs::path& target,
                      const fs::path& parent, const std::vector<std::string>& rank_blobs,
                      const std::vector<OutFile>& files, json manifest) {
  json listed = json::array();
  auto listed_as = [&](const std::string& file, const ckpt::WrittenFile& written) {
    listed.push_back(
        {{"name", file}, {"size", written.size}, {"xxh64", ckpt::to_hex(written.checksum)}});
  };
  for (const auto& file : files)
    listed_as(file.name, io.write_stream(tmp / file.name, file.produce));
  for (std::size_t r = 0; r < rank_blobs.size(); ++r) {
    listed_as(rank_file(r), io.write_file(tmp / rank_file(r), {rank_blobs[r]}));
  }
  manifest["files"] = listed;
  io.write_file(tmp / kManifest, {manifest.dump(2)});
  io.sync_dir(tmp);
  std::error_code ec;
  if (!fs::exists(target, ec)) {
    io.rename(tmp, target);
    io.sync_dir(parent);
  } else if (io.exchange(tmp, target)) {  // the new folder is in place; tmp now holds the old one
    io.sync_dir(parent);
    io.remove_all(tmp);
  } else {
    // No RENAME_EXCHANGE (NFS): the old folder steps aside, then the new one takes its name.
    // Why this is still safe: both folders are complete (fsynced) before either rename, so at
    // every moment a complete checkpoint is at `target` or at `aside`. An error between the two
    // renames puts the old one back at once (write_checkpoint); after a crash there, the next
    // save to `target` puts it back first (restore_set_aside), and latest_checkpoint() meanwhile
    // finds the newest other checkpoint.
    auto aside = set_aside_name(target);
    io.rename(target, aside);
    io.rename(tmp, target);
    io.sync_dir(parent);
    io.remove_all(aside);
  }
}

// Rank 0 writes every file into a temp folder beside `target`, fsyncs, then renames it into place.
void write_checkpoint(const fs::path& target, const std::vector<std::string>& rank_blobs,
                      const std::vector<OutFile>& files, json manifest) {
  auto& io = ckpt::checkpoint_fs();
  auto parent = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  auto name = target.filename().string();
  io.create_directories_durably(parent);
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(parent, ec)) {
    auto other = entry.path().filename().string();
    if (other.rfind("." + name + ".tmp-", 0) == 0)
      io.remove_all(entry.path());  // a crashed save's leftovers
  }
  if (restore_set_aside(io, target)) io.sync_dir(parent);
  auto tmp = parent / ("." + name + ".tmp-" + std::to_string(::getpid()));
  try {
    io.create_directories(tmp);
    fill_and_publish(io, tmp, target, parent, rank_blobs, files, std::move(manifest));
  } catch (...) {
    try {
      io.remove_all(tmp);  // what the failed save wrote; a later save also cleans it
      restore_set_aside(io, target);
    } catch (...) {
    }
    throw;
  }
}

// The bytes of the files under `folder` (what the progress page reports as a checkpoint's size).
std::uint64_t folder_bytes(const fs::path& folder) {
  std::uint64_t total = 0;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(folder, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    std::error_code size_ec;
    if (it->is_regular_file(size_ec)) total += it->file_size(size_ec);
  }
  return total;
}

// Removes the oldest complete automatic checkpoints beyond `limit`, never `just_written`.
void rotate(const fs::path& just_written, int64_t limit) {
  auto complete = complete_checkpoints(just_written.parent_path());
  for (std::size_t i = 0; i + static_cast<std::size_t>(limit) < complete.size(); ++i) {
    if (complete[i] != just_written) ckpt::checkpoint_fs().remove_all(complete[i]);
  }
  // Why: a process killed inside an earlier rotation's remove_all leaves an older numbered folder
  // without its manifest; no save is ever in progress under a numbered name (saves are renamed
  // into place), so such a folder is garbage that would otherwise stay forever.
  int64_t newest = checkpoint_number(just_written.filename().string());
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(just_written.parent_path(), ec)) {
    int64_t n = checkpoint_number(entry.path().filename().string());
    if (n >= 0 && n < newest && entry.is_directory(ec) &&
        !fs::exists(entry.path() / kManifest, ec)) {
      ckpt::checkpoint_fs().remove_all(entry.path());
    }
  }
}

}  // namespace

fs::path Accelerator::save_state(const fs::path& dir) { return save_state(dir, {}); }

fs::path Accelerator::save_state(const fs::path& dir, const SaveStateOptions& options) {
  maybe_resume(/*forward_done=*/false);
  wait_for_checkpoint();  // Why: one save at a time, and its outcome known before the next
  const std::uint64_t began = progress::monotonic_ns();
  const bool async = options.async;
  fs::path target = dir;
  bool automatic = dir.empty();
  if (automatic) {
    if (!impl_->project_.project_dir || impl_->project_.project_dir->empty() ||
        !*impl_->project_.automatic_checkpoint_naming) {
      throw UsageError(
          "accel: save_state() with no folder needs ProjectConfiguration::project_dir with "
          "automatic_checkpoint_naming (or ACCEL_CHECKPOINT_DIR / accel-launch --checkpoint-dir)");
    }
    target = fs::path(*impl_->project_.project_dir) / "checkpoints" /
             (kCheckpointPrefix + std::to_string(impl_->project_.iteration));
  }
  // Copied first: a hook may remove itself (or another) while it runs.
  for (const auto& [id, hook] : std::map<int64_t, StateHook>(*impl_->save_hooks_))
    hook(impl_->models_, target);
  auto mine = rank_state(process_index(), impl_->loaders_);
  auto blobs = use_distributed() ? gather_object(mine) : std::vector<std::string>{mine};
  // ZeRO: the shards of each optimizer's state become libtorch's full state on the main process
  // for the save (the checkpoint is the unsharded one), and go again after it.
  try {
    for (auto& slot : impl_->optimizers_)
      if (slot->zero) slot->zero->gather_state(is_main_process());
  } catch (...) {
    for (auto& slot : impl_->optimizers_)
      if (slot->zero) slot->zero->clear_installed();
    throw;
  }
  std::string error;
  if (is_main_process()) {
    try {
      std::vector<OutFile> files;
      for (std::size_t i = 0; i < impl_->models_.size(); ++i) {
        auto name = indexed("model", i, ".safetensors");
        auto tensors = module_tensors(*impl_->models_[i]);
        if (async) tensors = snapshot(std::move(tensors));
        files.push_back(safetensors_file(
            name, safetensors::encode(tensors, {{"format", "pt"}}, (target / name).string())));
      }
      json optimizer_steps = json::array(), optimizer_lrs = json::array();
      for (std::size_t i = 0; i < impl_->optimizers_.size(); ++i) {
        // Why: libtorch 1.13 saves param-group options but does not apply them on load.
        json lrs = json::array();
        for (auto& group : impl_->optimizers_[i]->optimizer->param_groups())
          lrs.push_back(group.options().get_lr());
        optimizer_lrs.push_back(lrs);
        auto name = indexed("optimizer", i, ".bin");
        auto& optimizer = *impl_->optimizers_[i]->optimizer;
        files.push_back(async ? optimizer_snapshot(name, optimizer)
                              : optimizer_file(name, optimizer));
        optimizer_steps.push_back(impl_->optimizers_[i]->steps);
      }
      for (std::size_t i = 0; i < impl_->schedulers_.size(); ++i) {
        files.push_back(bytes_file(indexed("scheduler", i, ".json"),
                                   json({{"steps", impl_->schedulers_[i]->steps}}).dump()));
      }
      if (impl_->scaler_) files.push_back(bytes_file("scaler.json", impl_->scaler_->state_dict()));
      for (std::size_t i = 0; i < impl_->custom_.size(); ++i) {
        files.push_back(bytes_file("custom_checkpoint_" + std::to_string(i) + ".bin",
                                   impl_->custom_[i].save()));
      }
      json loaders = json::array();
      for (const auto& l : impl_->loaders_) {
        auto s = l.state();
        json size = l.dataset_size() ? json(*l.dataset_size()) : json();
        loaders.push_back({{"epoch", s.epoch},
                           {"batches", s.batches},
                           {"total_batch_size", l.total_batch_size()},
                           {"seed", l.options().seed.value_or(0)},
                           {"shuffle", l.options().shuffle},
                           {"dataset_size", size}});
      }
      json run = {{"models", json::array()},
                  {"optimizers", json::array()},
                  {"dataset_sizes", json::array()}};
      for (const auto& m : impl_->models_) run["models"].push_back(model_identity(*m));
      for (const auto& o : impl_->optimizers_)
        run["optimizers"].push_back(c10::demangle(typeid(*o->optimizer).name()));
      for (const auto& l : loaders) run["dataset_sizes"].push_back(l["dataset_size"]);
      json manifest = {
          {"format", kFormat},
          {"format_version", kFormatVersion},
          {"created_unix", static_cast<int64_t>(std::time(nullptr))},
          {"step", completed_steps()},
          {"iteration", impl_->project_.iteration},
          {"epoch", impl_->loaders_.empty() ? json() : loaders[0]["epoch"]},
          {"batches_in_epoch", impl_->loaders_.empty() ? json() : loaders[0]["batches"]},
          {"world_size", num_processes()},
          {"mixed_precision", impl_->mixed_precision_},
          {"gradient_accumulation_steps", gradient_accumulation_steps()},
          {"accumulation_step", gradient_state_->step()},
          {"optimizer_steps", optimizer_steps},
          {"optimizer_lrs", optimizer_lrs},
          {"loaders", loaders},
          {"run", run},
          {"trackers", tracker_position(impl_->tracking_.get())},
          {"contents",
           {{"models", impl_->models_.size()},
            {"optimizers", impl_->optimizers_.size()},
            {"schedulers", impl_->schedulers_.size()},
            {"scaler", impl_->scaler_ != nullptr},
            {"custom", impl_->custom_.size()}}},
      };
      std::optional<int64_t> limit;
      if (automatic) limit = impl_->project_.total_limit;
      std::function<void()> write = [target, blobs = std::move(blobs), files = std::move(files),
                                     manifest = std::move(manifest), limit, began]() mutable {
        write_checkpoint(target, blobs, files, std::move(manifest));
        if (limit) rotate(target, *limit);
        progress::checkpoint_saved(folder_bytes(target), progress::monotonic_ns() - began);
      };
      if (!async) {
        write();
      } else {
        // Why here, before the broadcast: a thread that cannot start is this save's error, which
        // every rank must learn now, not at a wait that only some ranks would reach.
        impl_->save_writer_ = std::async(std::launch::async, [write = std::move(write)] {
          try {
            write();
          } catch (const std::exception& e) {
            return std::string(*e.what() ? e.what() : "accel: save_state failed");
          } catch (...) {
            return std::string("accel: save_state failed (an unknown exception)");
          }
          return std::string();
        });
      }
    } catch (const std::exception& e) {
      error = e.what();
      if (error.empty()) error = "accel: save_state failed";
    }
  }
  for (auto& slot : impl_->optimizers_)
    if (slot->zero) slot->zero->clear_installed();
  // Why: every rank must learn that rank 0's write (or, async, its copy) failed, or the others
  // would carry on as if the checkpoint existed.
  if (use_distributed()) error = broadcast_object(error);
  if (!error.empty()) throw CheckpointError(error);
  if (async) {
    impl_->save_in_flight_ = true;
    impl_->save_target_ = target;
  }
  ++impl_->project_.iteration;
  if (automatic) {
    impl_->last_auto_save_ = completed_steps();
    impl_->last_auto_save_dir_ = target;
  }
  if (is_main_process()) {
    log::debug(std::string(async ? "saving checkpoint " : "saved checkpoint ") + target.string() +
               " at step " + std::to_string(completed_steps()) +
               (async ? " in the background" : ""));
  }
  return target;
}

const std::string& Accelerator::Impl::join_background_save() {
  if (save_writer_.valid()) {
    save_error_ = save_writer_.get();
    if (save_error_.empty()) log::debug("saved checkpoint " + save_target_.string());
  }
  return save_error_;
}

void Accelerator::wait_for_checkpoint() {
  if (!impl_->save_in_flight_) return;
  std::string error = impl_->join_background_save();
  impl_->save_in_flight_ = false;
  impl_->save_error_.clear();
  if (use_distributed()) error = broadcast_object(error);
  if (!error.empty()) {
    throw CheckpointError("accel: the background save of " + impl_->save_target_.string() +
                          " failed (the checkpoints before it are intact): " + error);
  }
}

void Accelerator::save_model(const torch::nn::Module& model, const fs::path& dir,
                             const SaveModelOptions& options) {
  auto limit = safetensors::parse_size(options.max_shard_size, "SaveModelOptions::max_shard_size");
  // Why no collective: HF's idiom `if (is_main_process()) save_model(...)` must not hang the
  // main process waiting for ranks that never call it.
  if (!is_main_process()) return;
  try {
    safetensors::save_sharded(module_tensors(model), dir, limit);
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::exception& e) {
    throw CheckpointError(std::string("accel: save_model ") + dir.string() + ": " + e.what());
  }
}

// --- load
// -----------------------------------------------------------------------------------------

namespace {

// Checks that the checkpoint holds as many objects of each kind as are prepared.
void check_contents(const CheckpointReader& ckpt,
                    const std::vector<std::pair<const char*, std::size_t>>& prepared,
                    bool has_scaler) {
  const auto& c = CheckpointReader::field(ckpt.manifest(), "contents", ckpt.dir() / kManifest);
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
  std::vector<ckpt::MappedFile> optimizers;
  for (std::size_t i = 0; i < impl_->optimizers_.size(); ++i)
    optimizers.push_back(ckpt.read(indexed("optimizer", i, ".bin")));
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
    try {
      load_archive(*impl_->optimizers_[i]->optimizer, optimizers[i].view(), device());
    } catch (const c10::Error& e) {
      for (std::size_t j = 0; j <= i; ++j) before[j].restore(*impl_->optimizers_[j]->optimizer);
      CheckpointReader::fail(source / indexed("optimizer", i, ".bin"),
                             std::string("cannot be loaded into prepared optimizer ") +
                                 std::to_string(i) + ": " + e.what_without_backtrace());
    }
  }
  // ZeRO: each rank keeps its slices of the loaded (full) state, once every one fits.
  for (std::size_t i = 0; i < impl_->optimizers_.size(); ++i) {
    if (!impl_->optimizers_[i]->zero) continue;
    try {
      impl_->optimizers_[i]->zero->check_loaded(
          (source / indexed("optimizer", i, ".bin")).string());
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
  impl_->last_auto_save_ = completed_steps();
  impl_->last_auto_save_dir_ =
      is_automatic_checkpoint(source, impl_->project_.project_dir) ? source : fs::path();
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

// --- automatic resume and periodic saves
// ------------------------------------------------------------

namespace {

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
  if (!impl_->training_started_ || !automatic_resume_on()) return;
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
    if (automatic_resume_on()) resume_from_newest(forward_done);
  }
  impl_->training_started_ = true;
  open_trackers();  // nothing when they are open already, or off
}

void Accelerator::resume_from_newest(bool forward_done) {
  // Newest first, as rank 0 sees them: every rank tries the same ones in the same order.
  std::string listed;
  if (is_main_process() && impl_->project_.project_dir && !impl_->project_.project_dir->empty()) {
    auto all = complete_checkpoints(fs::path(*impl_->project_.project_dir) / "checkpoints");
    for (auto it = all.rbegin(); it != all.rend(); ++it) listed += it->string() + "\n";
  }
  if (use_distributed()) listed = broadcast_object(listed);
  std::vector<std::string> candidates;
  for (std::size_t start = 0, end; (end = listed.find('\n', start)) != std::string::npos;
       start = end + 1) {
    candidates.push_back(listed.substr(start, end - start));
  }
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
  for (const auto& candidate : candidates) {
    std::string problem;
    try {
      CheckpointReader(candidate).verify_files();
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
      if (impl_->loaders_.empty()) {
        print("accel: resumed from", candidate, "at step", completed_steps());
      } else {
        auto position = impl_->loaders_.front().state();
        print("accel: resumed from", candidate, "at step", completed_steps(), "(epoch",
              position.epoch, "batch", std::to_string(position.batches) + ")");
      }
      impl_->resumed_from_ = candidate;
      impl_->resumed_at_step_ = completed_steps();
      // Why: a job killed between a save and its rotation (or inside the rotation) left one
      // checkpoint too many, or a half-removed folder; if it ends before its next save, nothing
      // else would ever enforce total_limit on them.
      if (is_main_process() && impl_->project_.total_limit) {
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
    print("accel: warning: not resuming from", candidate, "because it is damaged (rank",
          std::to_string(bad - problems.begin()) + "):", *bad);
  }
  if (!candidates.empty()) {
    throw CheckpointError("accel: automatic resume: none of the " +
                          std::to_string(candidates.size()) + " checkpoints under " +
                          (fs::path(*impl_->project_.project_dir) / "checkpoints").string() +
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
  auto interval = impl_->project_.save_interval.value_or(0);
  if (interval <= 0) return;
  auto done = completed_steps();
  if (done == impl_->last_auto_save_ || done % interval != 0) return;
  save_state({}, {.async = impl_->project_.async_checkpoints.value_or(false)});
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

// Accelerator checkpoints, the save half: save_state (one folder with a manifest, published
// atomically by rank 0; in the foreground or in the background), rotation, wait_for_checkpoint
// and save_model.
#include <c10/util/Type.h>
#include <sys/resource.h>
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
#include <mutex>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "accel/accelerator.h"
#include "contract/json_depth.h"
#include "contract/worker_contract.h"
#include "runtime/accelerator_impl.h"
#include "runtime/checkpoint_io.h"
#include "runtime/checkpoint_layout.h"
#include "runtime/checkpoint_manifest.h"
#include "runtime/checkpoint_snapshot.h"
#include "runtime/comm.h"
#include "runtime/env.h"
#include "runtime/log.h"
#include "runtime/optimizer_steps.h"
#include "runtime/optimizer_tensors.h"
#include "runtime/product_threads.h"
#include "runtime/progress.h"
#include "runtime/safetensors.h"
#include "runtime/stop_request.h"
#include "runtime/term_grace.h"
#include "runtime/tracking.h"
#include "runtime/writer_placement.h"
#include "runtime/yielding.h"

namespace accel {

using ckpt::checkpoint_number;
using ckpt::complete_checkpoints;
using ckpt::indexed;
using ckpt::kCheckpointPrefix;
using ckpt::kFormat;
using ckpt::kFormatVersion;
using ckpt::kManifest;
using ckpt::model_identity;
using ckpt::rank_file;
using ckpt::rotate;

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using safetensors::module_tensors;

// The niceness of a background save's writer once its copies are made (0 = training's, 19 = the
// lowest priority): training's threads win a contended core, and the writer still progresses.
constexpr int kWriterNiceness = 10;

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

// A copy of `t` on the CPU, made now (from a GPU, too), that training cannot change.
torch::Tensor cpu_copy(const torch::Tensor& t) {
  return t.detach().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true).contiguous();
}

// For a background save of an optimizer whose state is not plain tensors (any but libtorch's own
// types): its archive, serialized into memory now, so the writer reads nothing training changes.
OutFile optimizer_archived_now(std::string name, const torch::optim::Optimizer& optimizer) {
  std::string bytes;
  auto archive = torch::serialize::OutputArchive();
  optimizer.save(archive);
  archive.save_to([&bytes](const void* data, std::size_t n) -> std::size_t {
    bytes.append(static_cast<const char*>(data), n);
    return n;
  });
  return bytes_file(std::move(name), std::move(bytes));
}

// Which of a model's tensors only an optimizer step changes, so that a background save may copy
// them later, on the writer thread (SnapshotCopies): its parameters. Everything else is copied
// during the call (buffers such as BatchNorm's running statistics change in the next forward).
std::vector<bool> parameters_copied_later(const safetensors::NamedTensors& tensors,
                                          const torch::nn::Module& model) {
  std::unordered_set<const void*> parameters;
  for (const auto& p : model.parameters()) parameters.insert(p.data_ptr());
  std::vector<bool> later;
  for (const auto& [name, t] : tensors) later.push_back(parameters.contains(t.data_ptr()));
  return later;
}

// A model's file for a background save, laid out in the save's kept memory (SnapshotCopies).
safetensors::Encoded background_model_file(const torch::nn::Module& model,
                                           ckpt::SnapshotCopies& copies, const std::string& where) {
  auto tensors = module_tensors(model);
  return copies.defer_file(tensors, parameters_copied_later(tensors, model), {{"format", "pt"}},
                           where);
}

// An optimizer's file for a background save, as background_model_file.
safetensors::Encoded background_optimizer_file(const torch::optim::Optimizer& optimizer,
                                               ckpt::SnapshotCopies& copies,
                                               const std::string& where) {
  std::map<std::string, std::string> metadata;
  auto tensors = ckpt::optimizer_tensors(optimizer, metadata);
  // All of an optimizer's state changes only in its step.
  return copies.defer_file(tensors, std::vector<bool>(tensors.size(), true), metadata, where);
}

// A model's tensors for an in-memory snapshot: its CPU parameters as they are (the writer thread
// writes them before the next optimizer step may change them); everything else copied now, as
// for a background save.
safetensors::NamedTensors live_parameters(safetensors::NamedTensors tensors,
                                          const torch::nn::Module& model) {
  std::unordered_set<const void*> parameters;
  for (const auto& p : model.parameters()) parameters.insert(p.data_ptr());
  for (auto& [name, t] : tensors) {
    if (!(t.device().is_cpu() && t.layout() == torch::kStrided &&
          parameters.contains(t.data_ptr()))) {
      t = cpu_copy(t);
    }
  }
  return tensors;
}

std::string join(const safetensors::Encoded& e) {
  std::string out;
  out.reserve(e.size());
  for (auto part : e.parts()) out.append(part);
  return out;
}

// The manifest's "trackers": null, or the run and its tracker files' sizes at the save.
json tracker_position(const detail::Tracking* tracking) {
  if (tracking == nullptr || !tracking->trackers || !tracking->trackers->is_open()) return json();
  auto p = tracking->trackers->position();
  return {{"run", p.run}, {"files", p.files}};
}

}  // namespace

// --- save
// -----------------------------------------------------------------------------------------

// This rank's part of a checkpoint: its RNG states and its loaders' positions.
std::string detail::rank_state(int rank, const std::vector<DataLoader>& loaders) {
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

namespace {

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

// How an in-memory snapshot is written (null for a checkpoint on disk).
struct InMemory {
  // An older snapshot's folder, unpublished, whose files are overwritten in place (their pages
  // reused) rather than new ones made; empty: none.
  fs::path recycle;
  // Runs once the files of `files` are written (the live state they were read from may change).
  std::function<void()> files_written;
};

// Writes every file into `tmp`, then the manifest listing them, fsyncs, and puts `tmp` in place
// of `target` (a swap when `target` exists, so there is no moment without it).
void fill_and_publish(ckpt::CheckpointFs& io, const fs::path& tmp, const fs::path& target,
                      const fs::path& parent, const std::vector<std::string>& rank_blobs,
                      const std::vector<OutFile>& files, json manifest, const InMemory* in_memory) {
  json listed = json::array();
  auto listed_as = [&](const std::string& file, const ckpt::WrittenFile& written) {
    listed.push_back({{"name", file},
                      {"size", written.size},
                      {"xxh64", in_memory ? std::string() : ckpt::to_hex(written.checksum)}});
  };
  auto write = [&](const std::string& name, const std::function<void(const ckpt::Sink&)>& produce) {
    if (!in_memory) return io.write_stream(tmp / name, produce);
    std::error_code ec;
    if (!in_memory->recycle.empty() && fs::is_regular_file(in_memory->recycle / name, ec))
      io.rename(in_memory->recycle / name, tmp / name);
    return io.write_in_place(tmp / name, produce);
  };
  for (const auto& file : files) listed_as(file.name, write(file.name, file.produce));
  if (in_memory && in_memory->files_written) in_memory->files_written();
  for (std::size_t r = 0; r < rank_blobs.size(); ++r) {
    const std::string& blob = rank_blobs[r];
    listed_as(rank_file(r), write(rank_file(r), [&blob](const ckpt::Sink& sink) { sink(blob); }));
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
// `in_memory`: a snapshot's, whose files are written as InMemory says.
void write_checkpoint(const fs::path& target, const std::vector<std::string>& rank_blobs,
                      const std::vector<OutFile>& files, json manifest,
                      const InMemory* in_memory = nullptr) {
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
    fill_and_publish(io, tmp, target, parent, rank_blobs, files, std::move(manifest), in_memory);
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

// Moves the calling thread (a background save's writer, before it writes; the thread it starts
// for the disk inherits the place) onto the CPUs ACCEL_CHECKPOINT_WRITER_CPUS names, by default
// those taking the interrupts of the disk under `target` when training leaves a CPU to spare.
// Says what it did, at debug level (a warning when a CPU list given could not be followed), when
// that differs from the last save's.
void place_writer(const fs::path& target, int training_threads) {
  static std::mutex said_m;
  static std::string said;
  const auto placed = writer_placement::place_calling_writer(
      env::worker_env().checkpoint_writer_cpus.c_str(), target, training_threads);
  std::lock_guard<std::mutex> lock(said_m);
  if (placed.line != said) {
    if (placed.warning) {
      log::warning(placed.line);
    } else {
      log::debug(placed.line);
    }
  }
  said = placed.line;
}

}  // namespace

// Starts the background save's thread: the copies of the CPU state first (the next optimizer
// step waits for them), then `write`. Why on the calling thread's error path, before any
// collective: a thread that cannot start is this save's error, which every rank must learn now,
// not at a wait that only some ranks would reach.
void Accelerator::Impl::start_background_write(std::function<void()> write, const fs::path& target,
                                               bool copies_first) {
  term_grace::arm();  // a SIGTERM now lets the write finish first
  if (copies_first) {
    snapshot_->start();
  } else {
    snapshot_->hold();
  }
  term_grace::write_started();  // Why here: a SIGTERM before the thread runs waits for it too
  // Why here, on the training thread: its intra-op thread count is what training uses, and
  // asking for it from a new thread could set up a thread pool there. OpenBLAS's own threads
  // count too: they run training's products on every CPU even where ATen's count is 1.
  const int training_threads = std::max(1, env::worker_env().local_world_size) *
                               std::max(1, product_threads::current().most());
  const bool cpus_busy =
      training_threads >= static_cast<int>(writer_placement::allowed_cpus().size());
  try {
    save_writer_ =
        std::async(std::launch::async, [write = std::move(write), copying = snapshot_, copies_first,
                                        target, training_threads, cpus_busy] {
          struct Ended {
            ~Ended() { term_grace::write_ended(); }
          } ended;
          // Why: it shares a CPU with training's threads (runtime/yielding.h). Not a write the
          // next step waits for (an in-memory snapshot's, copies_first false).
          ckpt::yields_between_pieces = cpus_busy && copies_first;
          try {
            if (copies_first) {
              // Why first: the next optimizer step waits for these copies, not the write.
              copying->copy();
              // Why: the write (checksums, the disk) must not take a core from training; raising
              // this thread's niceness lowers only its own priority (Linux). Not for a write that
              // the next step waits for (copies_first false).
              ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), kWriterNiceness);
              place_writer(target, training_threads);
            }
            write();
          } catch (const std::exception& e) {
            return std::string(*e.what() ? e.what() : "accel: save_state failed");
          } catch (...) {
            return std::string("accel: save_state failed (an unknown exception)");
          }
          return std::string();
        });
  } catch (...) {
    term_grace::write_ended();
    snapshot_->abandon();
    throw;
  }
}

void Accelerator::Impl::prefault_background_copies() {
  prefaulted_ = true;
  auto& copies = *snapshot_;
  if (copies.has_blocks()) return;  // a background save made them
  // The same defer_file() calls, in the same order, as a background save's (prepare_write).
  copies.begin();
  for (const auto& model : models_)
    (void)background_model_file(*model, copies, "accel: background checkpoint memory");
  for (const auto& slot : optimizers_) {
    if (ckpt::has_tensor_state(*slot->optimizer))
      (void)background_optimizer_file(*slot->optimizer, copies,
                                      "accel: background checkpoint memory");
  }
  copies.prefault();
}

std::function<void()> Accelerator::prepare_write(const fs::path& target, bool async, bool in_memory,
                                                 std::vector<std::string> rank_blobs,
                                                 std::optional<int64_t> limit, uint64_t began) {
  auto& copies = *impl_->snapshot_;
  std::vector<OutFile> files;
  for (std::size_t i = 0; i < impl_->models_.size(); ++i) {
    auto name = indexed("model", i, ".safetensors");
    const auto where = (target / name).string();
    if (async && !in_memory) {
      files.push_back(
          safetensors_file(name, background_model_file(*impl_->models_[i], copies, where)));
      continue;
    }
    auto tensors = module_tensors(*impl_->models_[i]);
    if (in_memory) tensors = live_parameters(std::move(tensors), *impl_->models_[i]);
    files.push_back(
        safetensors_file(name, safetensors::encode(tensors, {{"format", "pt"}}, where)));
  }
  json optimizer_steps = json::array(), optimizer_lrs = json::array();
  for (std::size_t i = 0; i < impl_->optimizers_.size(); ++i) {
    // Why: libtorch 1.13 saves param-group options but does not apply them on load.
    json lrs = json::array();
    for (auto& group : impl_->optimizers_[i]->optimizer->param_groups())
      lrs.push_back(group.options().get_lr());
    optimizer_lrs.push_back(lrs);
    auto& optimizer = *impl_->optimizers_[i]->optimizer;
    if (ckpt::has_tensor_state(optimizer)) {
      // libtorch's own optimizers: their state as tensors in a safetensors file, written from the
      // tensors' memory (or, in the background, from copies), without libtorch's archive (a zip
      // whose every record is CRC-32'd: most of a save's time otherwise).
      auto name = indexed("optimizer", i, ".safetensors");
      const auto where = (target / name).string();
      if (async && !in_memory) {
        files.push_back(
            safetensors_file(name, background_optimizer_file(optimizer, copies, where)));
      } else {
        std::map<std::string, std::string> metadata;
        auto tensors = ckpt::optimizer_tensors(optimizer, metadata);
        files.push_back(safetensors_file(name, safetensors::encode(tensors, metadata, where)));
      }
    } else {
      // Any other optimizer: libtorch's archive. An in-memory snapshot's holds the live state,
      // written before the next step may change it.
      auto name = indexed("optimizer", i, ".bin");
      files.push_back(async && !in_memory ? optimizer_archived_now(name, optimizer)
                                          : optimizer_file(name, optimizer));
    }
    optimizer_steps.push_back(impl_->optimizers_[i]->steps);
  }
  for (std::size_t i = 0; i < impl_->schedulers_.size(); ++i) {
    files.push_back(bytes_file(indexed("scheduler", i, ".json"),
                               json({{"steps", impl_->schedulers_[i]->steps}}).dump()));
  }
  if (impl_->scaler_) files.push_back(bytes_file("scaler.json", impl_->scaler_->state_dict()));
  for (std::size_t i = 0; i < impl_->custom_.size(); ++i) {
    files.push_back(
        bytes_file("custom_checkpoint_" + std::to_string(i) + ".bin", impl_->custom_[i].save()));
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
  json run = {
      {"models", json::array()}, {"optimizers", json::array()}, {"dataset_sizes", json::array()}};
  for (const auto& m : impl_->models_) run["models"].push_back(model_identity(*m));
  for (const auto& o : impl_->optimizers_)
    run["optimizers"].push_back(c10::demangle(typeid(*o->optimizer).name()));
  for (const auto& l : loaders) run["dataset_sizes"].push_back(l["dataset_size"]);
  json manifest = {
      {"format", kFormat},
      {"format_version", kFormatVersion},
      {"created_unix", static_cast<int64_t>(std::time(nullptr))},
      {"step", completed_steps()},
      // A snapshot's keeps the automatic checkpoints' numbering as it is.
      {"iteration", in_memory ? impl_->project_.iteration - 1 : impl_->project_.iteration},
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
  if (in_memory) {
    // Why: a run resumed from the snapshot times its next automatic checkpoint as this run would
    // have (the one at the snapshot's step may not exist yet).
    manifest["snapshot"] = true;
    manifest["last_checkpoint_step"] = impl_->last_auto_save_;
    return [target, blobs = std::move(rank_blobs), files = std::move(files),
            manifest = std::move(manifest), limit, copies = impl_->snapshot_]() mutable {
      // The next optimizer step waits until the files are written from the live state (or this
      // fails).
      struct Release {
        std::shared_ptr<ckpt::SnapshotCopies> copies;
        ~Release() { copies->abandon(); }
      } release{copies};
      InMemory how;
      how.files_written = [&copies] { copies->copy(); };
      auto& io = ckpt::checkpoint_fs();
      const fs::path parent = target.parent_path();
      // What a writer killed half-way left (only this node's local main writes here).
      std::error_code ec;
      for (const auto& entry : fs::directory_iterator(parent, ec)) {
        const auto name = entry.path().filename().string();
        if (name.rfind(".checkpoint_", 0) == 0 || name.rfind(".recycle-", 0) == 0)
          io.remove_all(entry.path());
      }
      // The oldest snapshot, once there are enough, lends its pages to this one; the newest
      // stays complete until this one is published.
      auto complete = complete_checkpoints(parent);
      if (limit && static_cast<int64_t>(complete.size()) >= *limit && complete.front() != target) {
        how.recycle = parent / (".recycle-" + std::to_string(::getpid()));
        io.rename(complete.front(), how.recycle);
      }
      write_checkpoint(target, blobs, files, std::move(manifest), &how);
      if (!how.recycle.empty()) io.remove_all(how.recycle);
      if (limit) rotate(target, *limit);
    };
  }
  return [target, blobs = std::move(rank_blobs), files = std::move(files),
          manifest = std::move(manifest), limit, began, in_memory]() mutable {
    write_checkpoint(target, blobs, files, std::move(manifest));
    if (limit) rotate(target, *limit);
    // Why not a snapshot: the progress page's checkpoint is the durable one.
    if (!in_memory)
      progress::checkpoint_saved(folder_bytes(target), progress::monotonic_ns() - began);
  };
}

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
  auto mine = detail::rank_state(process_index(), impl_->loaders_);
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
  auto& copies = *impl_->snapshot_;
  if (is_main_process()) {
    try {
      if (async) copies.begin();
      std::optional<int64_t> limit;
      if (automatic) limit = impl_->project_.total_limit;
      auto write = prepare_write(target, async, /*snapshot=*/false, std::move(blobs), limit, began);
      if (!async) {
        write();
      } else {
        impl_->start_background_write(std::move(write), target);
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
    if (save_error_.empty()) {
      log::debug(std::string(save_is_snapshot_ ? "saved snapshot " : "saved checkpoint ") +
                 save_target_.string());
    }
  }
  return save_error_;
}

void Accelerator::wait_for_checkpoint() {
  if (!impl_->save_in_flight_) return;
  std::string error = impl_->join_background_save();
  impl_->save_in_flight_ = false;
  impl_->save_error_.clear();
  if (impl_->save_is_snapshot_) {
    impl_->save_is_snapshot_ = false;
    snapshot_outcome(error);
    return;
  }
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

}  // namespace accel

// A checkpoint folder's names and layout, shared by the save and the load halves of
// Accelerator's checkpoints (runtime/checkpoint_save.cpp, runtime/checkpoint.cpp,
// runtime/checkpoint_resume.cpp).
#pragma once

#include <torch/nn/module.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "runtime/checkpoint_io.h"
#include "runtime/checkpoint_manifest.h"
#include "runtime/safetensors.h"

namespace accel::ckpt {

inline constexpr const char* kFormat = kManifestFormat;
inline constexpr int kFormatVersion = kManifestFormatVersion;
inline constexpr const char* kManifest = "manifest.json";
inline constexpr const char* kCheckpointPrefix = "checkpoint_";
// Automatic checkpoints kept when ACCEL_CHECKPOINT_DIR comes from accel-launch and neither
// ProjectConfiguration::total_limit nor ACCEL_CHECKPOINT_TOTAL_LIMIT says otherwise.
inline constexpr int64_t kDefaultLauncherTotalLimit = 3;

inline std::string indexed(const std::string& stem, std::size_t i, const std::string& ext) {
  return i == 0 ? stem + ext : stem + "_" + std::to_string(i) + ext;
}

inline std::string rank_file(std::size_t rank) {
  return "random_states_" + std::to_string(rank) + ".safetensors";
}

// What makes a run the same run, recorded in the manifest's "run" and compared on automatic
// resume: each model's tensor names and shapes, each optimizer's type, each loader's dataset
// size. (World size and accumulation may change between attempts of one elastic job.)
inline nlohmann::json model_identity(const torch::nn::Module& m) {
  nlohmann::json tensors = nlohmann::json::object();
  for (const auto& [name, t] : safetensors::module_tensors(m)) tensors[name] = t.sizes().vec();
  return tensors;
}

// <n> of "checkpoint_<n>", or -1.
// Automatic resume's name for an in-memory snapshot: "snapshot:<step>", which each node finds in
// its own ACCEL_SNAPSHOT_DIR as checkpoint_<step>.
inline constexpr char kSnapshotCandidate[] = "snapshot:";

inline int64_t checkpoint_number(const std::string& name) {
  if (name.rfind(kCheckpointPrefix, 0) != 0) return -1;
  auto digits = name.substr(std::string(kCheckpointPrefix).size());
  if (digits.empty() || digits.size() > 15 || !std::all_of(digits.begin(), digits.end(), ::isdigit))
    return -1;
  return std::stoll(digits);
}

// The complete automatic checkpoints under `root` (checkpoint_<n> folders with a manifest),
// oldest first. A save publishes the manifest last, so a folder without one is not a checkpoint.
inline std::vector<std::filesystem::path> complete_checkpoints(const std::filesystem::path& root) {
  std::vector<std::pair<int64_t, std::filesystem::path>> numbered;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(root, ec)) {
    int64_t n = checkpoint_number(entry.path().filename().string());
    if (n >= 0 && entry.is_directory(ec) && std::filesystem::exists(entry.path() / kManifest, ec))
      numbered.emplace_back(n, entry.path());
  }
  std::sort(numbered.begin(), numbered.end());
  std::vector<std::filesystem::path> out;
  for (auto& [n, path] : numbered) out.push_back(std::move(path));
  return out;
}
// Removes the oldest complete automatic checkpoints beyond `limit`, never `just_written`.
inline void rotate(const std::filesystem::path& just_written, int64_t limit) {
  auto complete = complete_checkpoints(just_written.parent_path());
  for (std::size_t i = 0; i + static_cast<std::size_t>(limit) < complete.size(); ++i) {
    if (complete[i] != just_written) checkpoint_fs().remove_all(complete[i]);
  }
  // Why: a process killed inside an earlier rotation's remove_all leaves an older numbered folder
  // without its manifest; no save is ever in progress under a numbered name (saves are renamed
  // into place), so such a folder is garbage that would otherwise stay forever.
  int64_t newest = checkpoint_number(just_written.filename().string());
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(just_written.parent_path(), ec)) {
    int64_t n = checkpoint_number(entry.path().filename().string());
    if (n >= 0 && n < newest && entry.is_directory(ec) &&
        !std::filesystem::exists(entry.path() / kManifest, ec)) {
      checkpoint_fs().remove_all(entry.path());
    }
  }
}

}  // namespace accel::ckpt

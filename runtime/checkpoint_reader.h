// CheckpointReader: a checkpoint folder's manifest, checked, and its files' bytes on demand,
// checked against the manifest's sizes and xxh64 sums (runtime/checkpoint.cpp's loads and
// runtime/checkpoint_resume.cpp's automatic resume).
#pragma once

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "accel/accelerator.h"
#include "runtime/checkpoint_io.h"
#include "runtime/checkpoint_layout.h"
#include "runtime/checkpoint_manifest.h"

namespace accel::ckpt {

namespace fs = std::filesystem;
using json = nlohmann::json;

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
    // An in-memory snapshot's files have no checksum (""): written to memory and published by
    // a rename, they cannot be torn; their sizes are checked.
    if (!checksums_ ||
        (manifest_.value("snapshot", false) && it->second["xxh64"].get<std::string>().empty())) {
      return bytes;
    }
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

}  // namespace accel::ckpt

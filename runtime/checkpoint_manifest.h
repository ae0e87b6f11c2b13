// A checkpoint's manifest.json, parsed and checked field by field before anything trusts it:
// the format and version, the counters, and a file list of plain names inside the folder. The
// manifest is input (a folder can be damaged, foreign or hostile); fuzzed by fuzz/fuzz_manifest.
#pragma once

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace accel::ckpt {

inline constexpr const char* kManifestFormat = "accel-checkpoint";
inline constexpr int kManifestFormatVersion = 1;

struct CheckedManifest {
  nlohmann::json manifest;
  std::map<std::string, nlohmann::json> files;  // by name: {"name", "size", "xxh64"}
};

// `text` as read from `where`; CheckpointError ("accel: checkpoint <where> ...") on any problem.
CheckedManifest parse_manifest(std::string_view text, const std::filesystem::path& where);

// A name that stays inside its folder when joined to it: no separator, not "." or "..", no NUL.
bool is_plain_file_name(const std::string& name);

}  // namespace accel::ckpt

// Parsing and checking a checkpoint manifest (checkpoint_manifest.h).
#include "runtime/checkpoint_manifest.h"

#include <algorithm>

#include "accel/error.h"
#include "contract/json_depth.h"

namespace accel::ckpt {

using json = nlohmann::json;

namespace {

[[noreturn]] void fail(const std::filesystem::path& where, const std::string& what) {
  throw CheckpointError("accel: checkpoint " + where.string() + " " + what);
}

}  // namespace

bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name.size() <= 255 && name != "." && name != ".." &&
         name.find('/') == std::string::npos && name.find('\0') == std::string::npos;
}

CheckedManifest parse_manifest(std::string_view text, const std::filesystem::path& path) {
  CheckedManifest out;
  json& m = out.manifest;
  if (auto deep = contract::json_nesting_problem(text); !deep.empty())
    fail(path, deep + "; not an accel checkpoint manifest");
  try {
    m = json::parse(text);
  } catch (const json::exception& e) {
    fail(path, std::string("is not valid JSON (") + e.what() + ")");
  }
  if (!m.is_object() || !m.contains("format") || !m["format"].is_string() ||
      m["format"].get<std::string>() != kManifestFormat) {
    fail(path, std::string("is not an accel checkpoint manifest (\"format\" is not \"") +
                   kManifestFormat + "\")");
  }
  if (!m.contains("format_version") || !m["format_version"].is_number_integer() ||
      m["format_version"].get<int64_t>() != kManifestFormatVersion) {
    fail(path,
         "has format_version " +
             (m.contains("format_version") ? m["format_version"].dump() : std::string("none")) +
             "; this libaccel reads version " + std::to_string(kManifestFormatVersion));
  }
  for (const char* key :
       {"files", "contents", "world_size", "step", "iteration", "loaders", "optimizer_steps"}) {
    if (!m.contains(key)) fail(path, std::string("has no \"") + key + "\"");
  }
  auto expect = [&](const char* key, bool ok, const char* what) {
    if (!ok)
      fail(path, std::string("has \"") + key + "\": " + m[key].dump().substr(0, 200) +
                     ", expected " + what);
  };
  expect("world_size",
         m["world_size"].is_number_integer() && m["world_size"].get<int64_t>() >= 1 &&
             m["world_size"].get<int64_t>() <= (1 << 20),
         "an integer from 1 to 1048576");
  expect("step", m["step"].is_number_integer(), "an integer");
  expect("iteration", m["iteration"].is_number_integer(), "an integer");
  expect("files", m["files"].is_array(), "a list");
  expect("contents", m["contents"].is_object(), "an object");
  expect("optimizer_steps", m["optimizer_steps"].is_array(), "a list");
  expect("loaders",
         m["loaders"].is_array() && std::all_of(m["loaders"].begin(), m["loaders"].end(),
                                                [](const json& l) { return l.is_object(); }),
         "a list of objects");
  for (const auto& f : m["files"].items()) {
    const auto& v = f.value();
    if (!v.is_object() || !v.contains("name") || !v["name"].is_string() || !v.contains("size") ||
        !v["size"].is_number_unsigned() || !v.contains("xxh64") || !v["xxh64"].is_string()) {
      fail(path, "files[" + f.key() + "] is not {\"name\", \"size\", \"xxh64\"}");
    }
    const auto name = v["name"].get<std::string>();
    // Why: a name is joined to the folder and opened; "../x", "/etc/passwd" or "a/b" would read
    // (and checksum) a file outside the checkpoint.
    if (!is_plain_file_name(name)) {
      fail(path,
           "files[" + f.key() + "] has the name " + json(name).dump().substr(0, 200) +
               ": a checkpoint lists plain file names inside its folder (no '/', not '.' or '..')");
    }
    out.files[name] = v;
  }
  return out;
}

}  // namespace accel::ckpt

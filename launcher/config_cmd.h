// `accel config show | validate FILE | default | import FILE`: the configuration without the
// interactive wizard. Each returns the process exit code (0, or 2 for a bad file or flag, 1 for
// a file that cannot be written) and prints what it did.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "agent/config/config_loader.h"

namespace accel::launcher {

// The resolved configuration with the origin of every value (as accel-launch --print-config).
int config_show(const config::ConfigSources& sources);
// Reads FILE (accel's or HF Accelerate's) and says whether accel accepts it.
int config_validate(const std::string& file);
// Writes a minimal file: the keys in `flags` (the rest are defaults) to `path`, or the default
// location. An existing file is kept unless `force`.
int config_default(const std::vector<config::FlagValue>& flags, const config::EnvMap& env,
                   const std::optional<std::string>& path, bool force);
// Converts an HF Accelerate config file to accel's keys, written like config_default.
int config_import(const std::string& hf_file, const config::EnvMap& env,
                  const std::optional<std::string>& path, bool force);

// Writes `text` to `path` atomically (a temporary file in the same folder, then rename), making
// the folder; never replaces an existing file unless `force`. Returns 0, or 1 after an error
// message on stderr.
int write_config(const std::string& path, const std::string& text, bool force);

// The keys of `cfg` that are not at their default, as YAML, under a comment header.
std::string minimal_yaml(const config::ClusterConfig& cfg, const std::string& header);

}  // namespace accel::launcher

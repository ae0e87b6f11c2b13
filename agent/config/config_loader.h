// Resolves a ClusterConfig from its sources (defaults, a YAML file, a Slurm job step, ACCEL_*
// environment variables, typed flags) and renders the result with where each value came from.
#pragma once

#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "agent/common/status.h"
#include "agent/config/cluster_config.h"
#include "agent/config/slurm_source.h"

namespace accel::config {

// The largest config file read (a config is a few dozen lines; yaml-cpp needs ~60x a file's size).
inline constexpr std::size_t kMaxConfigFileBytes = 1u << 20;

// A flag the user typed: key, its value as text, and the flag's spelling for messages.
struct FlagValue {
  std::string key;
  std::string value;
  std::string flag;  // "--num-processes"
};

struct ConfigSources {
  std::optional<std::string> config_file;  // --config, if typed
  EnvMap env;                              // the process environment
  std::vector<FlagValue> flags;            // in the order typed; a later one wins
  // accel-launch and `accel config show` read Slurm's variables (--slurm/--no-slurm); the agent
  // does not.
  SlurmUse slurm = SlurmUse::kOff;
  HostResolver resolve_host = resolve_host_address;
};

struct ResolvedConfig {
  ClusterConfig config;
  std::string file;          // the file that was read; empty if none
  std::string file_reason;   // "--config", "ACCEL_CONFIG_FILE", "default location"
  std::string default_path;  // where the default file is looked for
  // What the file had that accel ignores (keys of an HF Accelerate config), one line each: the
  // CLIs print them as warnings.
  std::vector<std::string> warnings;
  bool slurm = false;  // Slurm's variables were read
};

// The default file: $ACCEL_HOME/config.yaml, else $XDG_CONFIG_HOME/accel/config.yaml, else
// ~/.config/accel/config.yaml. Empty when none of HOME, XDG_CONFIG_HOME, ACCEL_HOME is set.
std::string default_config_path(const EnvMap& env);

// Reads one YAML file into `cfg`: accel's keys, or an HF Accelerate config file (hf_config.h),
// whose ignored keys go to `warnings`. Errors name the file, line, column and key.
Status load_yaml_file(ClusterConfig& cfg, const std::string& path,
                      std::vector<std::string>* warnings = nullptr);
// Same for YAML text; `name` stands for the file in messages (tests use this).
Status load_yaml_text(ClusterConfig& cfg, const std::string& text, const std::string& name,
                      std::vector<std::string>* warnings = nullptr);

// Applies defaults < file < Slurm < environment < flags, then cross-key validation. The file:
// --config, else $ACCEL_CONFIG_FILE, else accel's default location, else HF Accelerate's.
Result<ResolvedConfig> resolve_config(const ConfigSources& sources);

// YAML that can be saved and reused as a config file, each line commented with its origin.
std::string render_config(const ResolvedConfig& resolved);

EnvMap environment_snapshot();

// `v` as a YAML scalar that reads back as the same string: plain when it can be, else quoted.
std::string yaml_scalar(const std::string& v);

}  // namespace accel::config

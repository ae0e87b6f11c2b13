// ClusterConfig's operations over its key table (cluster_config_keys.cpp): setting a key from
// text, the checks across keys, finding a key or the nearest to a typo, the workers' settings.
#include "agent/config/cluster_config.h"

#include <algorithm>
#include <cctype>
#include <cstdint>

#include "agent/config/key_parsers.h"

namespace accel::config {

using detail::lower;
using detail::quoted;

namespace {

// "c.yaml:2:15: machine_rank", or just the key when it has its default.
std::string where_key(const ClusterConfig& cfg, std::string_view key) {
  const Origin& o = cfg.origin(key);
  return o.where.empty() ? std::string(key) : o.where + ": " + std::string(key);
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

}  // namespace

std::string_view source_name(Source s) {
  switch (s) {
    case Source::kDefault:
      return "default";
    case Source::kFile:
      return "file";
    case Source::kSlurm:
      return "slurm";
    case Source::kEnv:
      return "env";
    case Source::kFlag:
      return "flag";
  }
  return "?";
}

std::string_view to_string(MixedPrecision m) {
  switch (m) {
    case MixedPrecision::kNo:
      return "no";
    case MixedPrecision::kFp16:
      return "fp16";
    case MixedPrecision::kBf16:
      return "bf16";
  }
  return "no";
}

const Origin& ClusterConfig::origin(std::string_view key) const {
  static const Origin kDefaultOrigin{};
  auto it = origins.find(key);
  return it == origins.end() ? kDefaultOrigin : it->second;
}

std::string default_text(const KeySpec& key) {
  static const ClusterConfig kDefaults;
  return key.get(kDefaults);
}

std::map<std::string, std::string> worker_settings(const ClusterConfig& cfg) {
  std::map<std::string, std::string> out;
  for (const auto& key : all_keys()) {
    if (key.to_workers) out[env_var_for(key.name)] = key.get(cfg);
  }
  return out;
}

std::optional<std::string> set_by_key(std::string_view var) {
  for (const auto& key : all_keys()) {
    if (!key.to_workers) continue;
    std::string own = env_var_for(key.name);
    const char* hf = contract::hf_alias(own);
    if (var != own && (hf == nullptr || var != hf)) continue;
    std::string_view flag = key.flags.substr(0, key.flags.find(','));
    if (flag.size() == 2) flag = key.flags.substr(3, key.flags.find(',', 3) - 3);  // past "-x,"
    return std::string(var) + " comes from the launch configuration; use " + std::string(flag) +
           " (or the config key " + std::string(key.name) + ") instead";
  }
  return std::nullopt;
}

const KeySpec* find_key(std::string_view name) {
  for (const auto& k : all_keys()) {
    if (k.name == name) return &k;
  }
  return nullptr;
}

std::string nearest_key(std::string_view unknown) {
  std::string norm = lower(unknown);
  std::replace(norm.begin(), norm.end(), '-', '_');
  const KeySpec* best = nullptr;
  size_t best_distance = SIZE_MAX;
  for (const auto& k : all_keys()) {
    size_t d = edit_distance(norm, k.name);
    if (d < best_distance) {
      best_distance = d;
      best = &k;
    }
  }
  // Why a bound: 'compute_environment' is no typo of 'stop_timeout'; suggest only real neighbours.
  if (best == nullptr || best_distance > std::max<size_t>(3, norm.size() / 3)) return {};
  return std::string(best->name);
}

std::string unknown_key_message(std::string_view key) {
  std::string near = key.size() > 64 ? "" : nearest_key(key);
  if (!near.empty()) return "unknown key " + quoted(key) + " (did you mean '" + near + "'?)";
  std::string all;
  for (const auto& k : all_keys()) all += (all.empty() ? "" : ", ") + std::string(k.name);
  return "unknown key " + quoted(key) + " (valid keys: " + all + ")";
}

std::string env_var_for(std::string_view key) {
  std::string out = "ACCEL_";
  for (char c : key) out += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

Status set_value(ClusterConfig& cfg, std::string_view key, std::string_view text, Origin origin) {
  const KeySpec* spec = find_key(key);
  if (spec == nullptr) {
    return Status::error(origin.where + ": " + unknown_key_message(key));
  }
  if (Status s = spec->set(cfg, text); !s) {
    return Status::error(origin.where + ": " + std::string(key) + ": " + s.message());
  }
  cfg.origins[std::string(key)] = std::move(origin);
  return Status::ok();
}

Status validate(const ClusterConfig& cfg) {
  if (cfg.machine_rank >= cfg.nodes.max) {
    return Status::error(where_key(cfg, "machine_rank") + ": " + std::to_string(cfg.machine_rank) +
                         " is not below the number of nodes (" + std::to_string(cfg.nodes.max) +
                         "); machine ranks run from 0 to nodes - 1");
  }
  if (cfg.checkpoint_interval > 0 && cfg.checkpoint_dir.empty() && cfg.project_dir.empty()) {
    return Status::error(where_key(cfg, "checkpoint_interval") + ": " +
                         std::to_string(cfg.checkpoint_interval) +
                         " needs checkpoint_dir or project_dir (where to save)");
  }

  return Status::ok();
}

}  // namespace accel::config

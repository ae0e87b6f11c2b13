// YAML, environment and flag sources of ClusterConfig (yaml-cpp for the file).
#include "agent/config/config_loader.h"

#include <sys/stat.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "agent/config/hf_config.h"

extern char** environ;  // NOLINT: POSIX

namespace accel::config {
namespace {

std::string at(const std::string& name, const YAML::Mark& mark) {
  if (mark.is_null()) return name;
  return name + ":" + std::to_string(mark.line + 1) + ":" + std::to_string(mark.column + 1);
}

std::string_view node_kind(const YAML::Node& n) {
  switch (n.Type()) {
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Map:
      return "a mapping";
    case YAML::NodeType::Null:
      return "nothing";
    default:
      return "a scalar";
  }
}

Status load_root(ClusterConfig& cfg, const YAML::Node& root, const std::string& name,
                 std::vector<std::string>* warnings) {
  if (!root || root.IsNull()) return Status::ok();  // an empty file: all defaults
  if (is_hf_config(root)) {
    std::vector<std::string> ignored;
    Status s = load_hf_root(cfg, root, name, ignored);
    if (warnings != nullptr) warnings->insert(warnings->end(), ignored.begin(), ignored.end());
    return s;
  }
  if (!root.IsMap()) {
    return Status::error(at(name, root.Mark()) +
                         ": expected a mapping of keys to values at the "
                         "top level, got " +
                         std::string(node_kind(root)));
  }
  for (const auto& item : root) {
    const YAML::Node& key_node = item.first;
    const YAML::Node& value = item.second;
    if (!key_node.IsScalar()) {
      return Status::error(at(name, key_node.Mark()) + ": expected a key name, got " +
                           std::string(node_kind(key_node)));
    }
    const std::string key = key_node.Scalar();
    const KeySpec* spec = find_key(key);
    if (spec == nullptr) {
      return Status::error(at(name, key_node.Mark()) + ": " + unknown_key_message(key));
    }
    if (!value.IsScalar()) {
      YAML::Mark mark = value.IsNull() ? key_node.Mark() : value.Mark();
      return Status::error(at(name, mark) + ": " + key + ": expected " +
                           std::string(spec->accepts) + ", got " + std::string(node_kind(value)));
    }
    if (Status s = set_value(cfg, key, value.Scalar(), {Source::kFile, at(name, value.Mark())});
        !s) {
      return s;
    }
  }
  return Status::ok();
}

bool is_regular_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

}  // namespace

std::string yaml_scalar(const std::string& v) {
  bool plain = !v.empty() && v.find_first_of(":#'\"{}[],&*!|>%@`\n") == std::string::npos &&
               v.front() != ' ' && v.back() != ' ' && v.front() != '-';
  if (plain) return v;
  std::string out = "\"";
  for (char c : v) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

std::string default_config_path(const EnvMap& env) {
  auto get = [&](std::string_view k) -> std::string {
    auto it = env.find(k);
    return it == env.end() ? std::string() : it->second;
  };
  if (auto home = get("ACCEL_HOME"); !home.empty()) return home + "/config.yaml";
  if (auto xdg = get("XDG_CONFIG_HOME"); !xdg.empty()) return xdg + "/accel/config.yaml";
  if (auto home = get("HOME"); !home.empty()) return home + "/.config/accel/config.yaml";
  return {};
}

Status load_yaml_text(ClusterConfig& cfg, const std::string& text, const std::string& name,
                      std::vector<std::string>* warnings) {
  if (text.size() > kMaxConfigFileBytes) {
    return Status::error(name + ": the config is " + std::to_string(text.size()) +
                         " bytes; the most accepted is " + std::to_string(kMaxConfigFileBytes));
  }
  try {
    return load_root(cfg, YAML::Load(text), name, warnings);
  } catch (const YAML::Exception& e) {
    return Status::error(at(name, e.mark) + ": not valid YAML: " + e.msg);
  }
}

Status load_yaml_file(ClusterConfig& cfg, const std::string& path,
                      std::vector<std::string>* warnings) {
  // Why a bound: yaml-cpp holds a whole document in memory many times over (a 48 MB file took
  // 2.9 GB); a config file is a few dozen lines.
  std::error_code ec;
  auto size = std::filesystem::file_size(path, ec);
  if (!ec && size > kMaxConfigFileBytes) {
    return Status::error(path + ": the config file is " + std::to_string(size) +
                         " bytes; the most accepted is " + std::to_string(kMaxConfigFileBytes) +
                         " (is it the right file?)");
  }
  std::ifstream in(path);
  if (!in) return Status::error(path + ": cannot read the config file");
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad()) return Status::error(path + ": error while reading the config file");
  return load_yaml_text(cfg, text.str(), path, warnings);
}

Result<ResolvedConfig> resolve_config(const ConfigSources& sources) {
  ResolvedConfig out;
  out.default_path = default_config_path(sources.env);

  auto env_config = sources.env.find("ACCEL_CONFIG_FILE");
  if (sources.config_file) {
    out.file = *sources.config_file;
    out.file_reason = "--config";
  } else if (env_config != sources.env.end() && !env_config->second.empty()) {
    out.file = env_config->second;
    out.file_reason = "ACCEL_CONFIG_FILE";
  } else if (!out.default_path.empty() && is_regular_file(out.default_path)) {
    out.file = out.default_path;
    out.file_reason = "default location";
  } else if (std::string hf = hf_default_config_path(sources.env);
             !hf.empty() && is_regular_file(hf)) {
    // Why: an HF Accelerate user's machine already says how it runs jobs.
    out.file = hf;
    out.file_reason = "HF Accelerate's default location";
  }
  if (!out.file.empty()) {
    if (!is_regular_file(out.file)) {
      return Status::error(out.file + ": config file (from " + out.file_reason +
                           ") does not exist or is not a regular file");
    }
    if (Status s = load_yaml_file(out.config, out.file, &out.warnings); !s) return s;
  }

  auto slurm = read_slurm(sources.env, sources.slurm, sources.resolve_host);
  if (!slurm) return slurm.status();
  out.slurm = slurm->active;
  for (const auto& v : slurm->values) {
    if (Status s = set_value(out.config, v.key, v.value, {Source::kSlurm, v.where}); !s) return s;
  }

  for (const auto& key : all_keys()) {
    std::string var = env_var_for(key.name);
    auto it = sources.env.find(var);
    if (it == sources.env.end() || it->second.empty()) continue;
    if (Status s = set_value(out.config, key.name, it->second,
                             {Source::kEnv, "environment variable " + var});
        !s) {
      return s;
    }
  }

  for (const auto& f : sources.flags) {
    if (Status s = set_value(out.config, f.key, f.value, {Source::kFlag, "flag " + f.flag}); !s) {
      return s;
    }
  }

  // Why: a Slurm step's CPUs are the launcher's to share; without this every worker would start
  // a thread per CPU of the whole machine, or (several processes) one thread each.
  if (slurm->cpus && out.config.origin("num_cpu_threads_per_process").source == Source::kDefault) {
    int threads = std::max(1, *slurm->cpus / std::max(1, out.config.num_processes));
    std::string where = "Slurm " + slurm->cpus_where + " / " +
                        std::to_string(out.config.num_processes) + " process(es)";
    if (Status s = set_value(out.config, "num_cpu_threads_per_process", std::to_string(threads),
                             {Source::kSlurm, where});
        !s) {
      return s;
    }
  }

  if (Status s = validate(out.config); !s) return s;
  return out;
}

std::string render_config(const ResolvedConfig& resolved) {
  std::ostringstream out;
  out << "# accel resolved configuration; precedence, highest first: flag > ACCEL_* environment"
      << (resolved.slurm ? " > Slurm" : "") << " > config file > default\n";
  if (!resolved.file.empty()) {
    out << "# config file: " << resolved.file << " (" << resolved.file_reason << ")\n";
  } else {
    out << "# config file: none (default location " +
               (resolved.default_path.empty() ? std::string("unknown") : resolved.default_path) +
               " does not exist)\n";
  }
  for (const auto& w : resolved.warnings) out << "# warning: " << w << "\n";
  size_t width = 0;
  std::vector<std::pair<std::string, std::string>> lines;
  for (const auto& key : all_keys()) {
    std::string line = std::string(key.name) + ": " + yaml_scalar(key.get(resolved.config));
    const Origin& o = resolved.config.origin(key.name);
    std::string from = o.source == Source::kDefault ? "default" : o.where;
    width = std::max(width, line.size());
    lines.emplace_back(std::move(line), std::move(from));
  }
  for (const auto& [line, from] : lines) {
    out << line << std::string(width - line.size() + 2, ' ') << "# " << from << "\n";
  }
  return out.str();
}

EnvMap environment_snapshot() {
  EnvMap env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string_view kv(*e);
    auto eq = kv.find('=');
    if (eq == std::string_view::npos) continue;
    env.emplace(std::string(kv.substr(0, eq)), std::string(kv.substr(eq + 1)));
  }
  return env;
}

}  // namespace accel::config

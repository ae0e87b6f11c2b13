// HF Accelerate config keys -> ClusterConfig.
#include "agent/config/hf_config.h"

#include <yaml-cpp/yaml.h>

#include <cctype>
#include <map>
#include <optional>

namespace accel::config {
namespace {

std::string at(const std::string& name, const YAML::Mark& mark) {
  if (mark.is_null()) return name;
  return name + ":" + std::to_string(mark.line + 1) + ":" + std::to_string(mark.column + 1);
}

// HF keys accel has no use for, and why (the warning's second half).
const std::map<std::string, std::string, std::less<>>& ignored_keys() {
  static const std::map<std::string, std::string, std::less<>> kIgnored = {
      {"gpu_ids",
       "accel gives the workers every GPU CUDA_VISIBLE_DEVICES shows; set that variable instead"},
      {"same_network", "accel's nodes always meet at main_process_ip"},
      {"rdzv_backend", "accel's own coordinator is the rendezvous"},
      {"main_training_function", "it names the function notebook_launcher calls"},
      {"downcast_bf16", "TPU only"},
      {"enable_cpu_affinity", "accel does not pin workers to cores"},
      {"tpu_env", "TPU only"},
      {"tpu_use_cluster", "TPU only"},
      {"tpu_use_sudo", "TPU only"},
      {"tpu_name", "TPU only"},
      {"tpu_zone", "TPU only"},
      {"commands", "TPU pod commands"},
      {"command_file", "TPU pod commands"},
      {"ipex_config", "Intel Extension for PyTorch is not used by accel"},
      {"mpirun_config", "accel starts workers itself, not through mpirun"},
      {"dynamo_config", "accel-launch does not wrap models in torch.compile"},
      {"use_mps_device", "accel runs on CPUs and CUDA GPUs"},
      {"fp8_config", "fp8 is not one of accel's precisions"},
  };
  return kIgnored;
}

// An ignored key at the value HF's `accelerate config` writes when the feature is not used
// (null, false, 'no', [], {}, a section of such values, or the key's own default): it changes
// nothing, so it is ignored without a word.
bool at_hf_default(const std::string& key, const YAML::Node& value) {
  if (!value || value.IsNull()) return true;
  if (value.IsSequence()) return value.size() == 0;
  if (value.IsMap()) {
    for (const auto& item : value) {
      if (!at_hf_default(item.first.as<std::string>(""), item.second)) return false;
    }
    return true;
  }
  std::string v = value.Scalar();
  for (auto& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  // Keys whose default is a value of its own (same_network: false asks for something).
  static const std::map<std::string, std::string, std::less<>> kDefaults = {
      {"gpu_ids", "all"},
      {"same_network", "true"},
      {"rdzv_backend", "static"},
      {"main_training_function", "main"},
  };
  if (auto it = kDefaults.find(key); it != kDefaults.end()) return it->second == v;
  return v.empty() || v == "false" || v == "no" || v == "none" || v == "null" || v == "~";
}

// Sections of features accel does not have: a non-empty one is an error.
const std::map<std::string, std::string, std::less<>>& refused_sections() {
  static const std::map<std::string, std::string, std::less<>> kRefused = {
      {"deepspeed_config", "DeepSpeed"},
      {"fsdp_config", "FSDP"},
      {"megatron_lm_config", "Megatron-LM"},
  };
  return kRefused;
}

bool empty_section(const YAML::Node& n) {
  return !n || n.IsNull() || ((n.IsMap() || n.IsSequence()) && n.size() == 0);
}

}  // namespace

bool is_hf_config(const YAML::Node& root) {
  return root && root.IsMap() && (root["compute_environment"] || root["distributed_type"]);
}

Status load_hf_root(ClusterConfig& cfg, const YAML::Node& root, const std::string& name,
                    std::vector<std::string>& warnings) {
  const std::string hf_note =
      " (an HF Accelerate config file; accel runs data-parallel jobs on CPUs and CUDA GPUs, see "
      "docs/configuration.md)";
  std::optional<long long> total_processes;  // HF counts processes in the whole job
  std::string total_where;
  bool cpu_type = false;
  for (const auto& item : root) {
    const YAML::Node& key_node = item.first;
    const YAML::Node& value = item.second;
    if (!key_node.IsScalar()) {
      return Status::error(at(name, key_node.Mark()) + ": expected a key name");
    }
    const std::string key = key_node.Scalar();
    const std::string where = at(name, value.IsNull() ? key_node.Mark() : value.Mark());
    auto scalar = [&]() -> Result<std::string> {
      if (!value.IsScalar()) {
        return Status::error(where + ": " + key + ": expected a single value");
      }
      return value.Scalar();
    };
    if (auto it = refused_sections().find(key); it != refused_sections().end()) {
      if (empty_section(value)) continue;
      return Status::error(at(name, key_node.Mark()) + ": " + key + ": " + it->second +
                           " is not supported by accel" + hf_note);
    }
    if (auto it = ignored_keys().find(key); it != ignored_keys().end()) {
      if (!at_hf_default(key, value))
        warnings.push_back(where + ": " + key + " is ignored: " + it->second);
      continue;
    }
    if (key == "compute_environment") {
      auto v = scalar();
      if (!v) return v.status();
      if (*v != "LOCAL_MACHINE") {
        return Status::error(where + ": compute_environment " + *v +
                             " is not supported by accel: only LOCAL_MACHINE (your own machines "
                             "or a cluster's)" +
                             hf_note);
      }
      continue;
    }
    if (key == "distributed_type") {
      auto v = scalar();
      if (!v) return v.status();
      if (*v == "MULTI_CPU") {
        cpu_type = true;
      } else if (*v != "NO" && *v != "MULTI_GPU") {
        return Status::error(where + ": distributed_type " + *v +
                             " is not supported by accel: NO, MULTI_CPU and MULTI_GPU are" +
                             hf_note);
      }
      continue;
    }
    if (key == "num_machines") {
      auto v = scalar();
      if (!v) return v.status();
      if (Status s = set_value(cfg, "nodes", *v, {Source::kFile, where}); !s) {
        return Status::error(where + ": num_machines: expected an integer from 1 to 100000, got '" +
                             *v + "'");
      }
      continue;
    }
    if (key == "num_processes") {
      auto v = scalar();
      if (!v) return v.status();
      try {
        size_t used = 0;
        long long n = std::stoll(*v, &used);
        if (used != v->size() || n < 1) throw std::invalid_argument("n");
        total_processes = n;
        total_where = where;
      } catch (const std::exception&) {
        return Status::error(where + ": num_processes: expected an integer >= 1, got '" + *v + "'");
      }
      continue;
    }
    if (find_key(key) == nullptr) {
      warnings.push_back(at(name, key_node.Mark()) + ": " + key +
                         " is ignored: not a key accel knows in HF Accelerate config files");
      continue;
    }
    // A key both use the same way (machine_rank, main_process_ip, main_process_port,
    // mixed_precision, use_cpu, debug), or one of accel's own.
    if (!value.IsScalar()) {
      return Status::error(where + ": " + key + ": expected " +
                           std::string(find_key(key)->accepts));
    }
    if (Status s = set_value(cfg, key, value.Scalar(), {Source::kFile, where}); !s) return s;
  }
  if (cpu_type && cfg.origin("use_cpu").source == Source::kDefault) {
    cfg.use_cpu = true;
    cfg.origins["use_cpu"] = {Source::kFile, name + " (distributed_type MULTI_CPU)"};
  }
  if (total_processes) {
    long long nodes = cfg.nodes.max;
    if (*total_processes % nodes != 0) {
      return Status::error(total_where + ": num_processes " + std::to_string(*total_processes) +
                           " is not a multiple of num_machines " + std::to_string(nodes) +
                           ": HF counts processes in the whole job, accel per machine");
    }
    std::string per_node = std::to_string(*total_processes / nodes);
    Origin origin{Source::kFile, total_where + " (HF num_processes " +
                                     std::to_string(*total_processes) + " over " +
                                     std::to_string(nodes) + " machine" + (nodes == 1 ? "" : "s") +
                                     ")"};
    if (Status s = set_value(cfg, "num_processes", per_node, origin); !s) return s;
  }
  return Status::ok();
}

std::string hf_default_config_path(const std::map<std::string, std::string, std::less<>>& env) {
  auto get = [&](std::string_view k) -> std::string {
    auto it = env.find(k);
    return it == env.end() ? std::string() : it->second;
  };
  std::string home;
  if (auto hf = get("HF_HOME"); !hf.empty()) {
    home = hf;
  } else if (auto xdg = get("XDG_CACHE_HOME"); !xdg.empty()) {
    home = xdg + "/huggingface";
  } else if (auto h = get("HOME"); !h.empty()) {
    home = h + "/.cache/huggingface";
  } else {
    return {};
  }
  return home + "/accelerate/default_config.yaml";
}

}  // namespace accel::config

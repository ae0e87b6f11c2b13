// HF Accelerate's config files (what `accelerate config` writes to
// ~/.cache/huggingface/accelerate/default_config.yaml), read as accel configuration: each HF key
// maps onto accel's key, or is ignored with a one-line warning that says why, or (DeepSpeed,
// FSDP, Megatron-LM, TPU) is refused with an error that names what is not supported.
#pragma once

#include <string>
#include <vector>

#include "agent/common/status.h"
#include "agent/config/cluster_config.h"

namespace YAML {
class Node;
}  // namespace YAML

namespace accel::config {

// True when the file's top-level mapping has HF's marker keys (compute_environment or
// distributed_type).
bool is_hf_config(const YAML::Node& root);

// Applies an HF config's keys to `cfg` (accel's own keys in it apply as usual). `name` stands for
// the file in messages; `warnings` receives the ignored keys, one line each.
Status load_hf_root(ClusterConfig& cfg, const YAML::Node& root, const std::string& name,
                    std::vector<std::string>& warnings);

// HF Accelerate's default config file: $HF_HOME/accelerate/default_config.yaml, else
// $XDG_CACHE_HOME/huggingface/accelerate/..., else ~/.cache/huggingface/accelerate/...; empty
// when none of those variables is set.
std::string hf_default_config_path(const std::map<std::string, std::string, std::less<>>& env);

}  // namespace accel::config

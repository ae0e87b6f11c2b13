// Slurm as a configuration source for accel-launch: inside a job step started with one task per
// node (`srun --ntasks-per-node=1 accel-launch ...`), the step's variables say how many nodes
// take part, which one this is, where the first one is, and the job's id. Precedence, highest
// first: flag > ACCEL_* environment > Slurm > config file > default.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "agent/common/status.h"
#include "agent/config/cluster_config.h"

namespace accel::config {

using EnvMap = std::map<std::string, std::string, std::less<>>;

// kAuto: used when SLURM_JOB_ID is set; kOn (--slurm): required; kOff (--no-slurm): ignored.
enum class SlurmUse { kAuto, kOn, kOff };

// Host name -> an address other nodes can reach it at (getaddrinfo; tests pass their own).
using HostResolver = std::function<Result<std::string>(const std::string& host)>;
Result<std::string> resolve_host_address(const std::string& host);

struct SlurmValue {
  std::string key;    // a config key
  std::string value;  // as text
  std::string where;  // "Slurm SLURM_NNODES=2"
};

struct SlurmSettings {
  bool active = false;
  std::vector<SlurmValue> values;
  // CPUs this launcher may use (SLURM_CPUS_PER_TASK, else SLURM_CPUS_ON_NODE): split between
  // the node's processes as their thread count unless something else set it.
  std::optional<int> cpus;
  std::string cpus_where;
};

// What the Slurm variables in `env` set. Errors say what is wrong and how to start accel-launch
// instead: outside a job step of a multi-node allocation (only this node would take part), or
// several tasks per node (each would start every worker).
Result<SlurmSettings> read_slurm(const EnvMap& env, SlurmUse use, const HostResolver& resolve);

}  // namespace accel::config

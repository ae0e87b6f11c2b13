// Fuzz target: Slurm's host lists and per-node counts as libaccel and accel-launch read them
// (contract/slurm.h), and the Slurm configuration source over variables built from the input.
// Input: NUL-separated values for SLURM_JOB_NODELIST/STEP_NODELIST, SLURM_STEP_TASKS_PER_NODE,
// SLURM_STEP_NUM_NODES, SLURM_STEP_NUM_TASKS, SLURM_NODEID, SLURM_GPUS_ON_NODE, SLURM_CPUS_ON_NODE.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "agent/config/slurm_source.h"
#include "contract/slurm.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> parts;
  size_t start = 0;
  while (start <= text.size() && parts.size() < 8) {
    size_t nul = text.find('\0', start);
    if (nul == std::string_view::npos) nul = text.size();
    parts.emplace_back(text.substr(start, nul - start));
    start = nul + 1;
  }
  parts.resize(8);

  auto hosts = accel::contract::expand_hostlist(parts[0]);
  if (hosts.ok()) {
    if (hosts.items.empty() || hosts.items.size() > accel::contract::kMaxSlurmHosts)
      __builtin_trap();
    for (const auto& h : hosts.items) {
      if (h.size() > accel::contract::kMaxSlurmHostName) __builtin_trap();
    }
  } else if (!hosts.items.empty()) {
    __builtin_trap();  // an error leaves no half list behind
  }
  auto counts = accel::contract::expand_per_node_counts(parts[1]);
  if (counts.ok() && counts.items.size() > accel::contract::kMaxSlurmHosts) __builtin_trap();
  (void)accel::contract::slurm_port_for_job(parts[2], accel::contract::kSlurmMasterPortBase);

  accel::config::EnvMap env{{"SLURM_JOB_ID", "42"},
                            {"SLURM_STEP_ID", "0"},
                            {"SLURM_STEP_NODELIST", parts[0]},
                            {"SLURM_STEP_TASKS_PER_NODE", parts[1]},
                            {"SLURM_STEP_NUM_NODES", parts[2]},
                            {"SLURM_STEP_NUM_TASKS", parts[3]},
                            {"SLURM_NODEID", parts[4]},
                            {"SLURM_GPUS_ON_NODE", parts[5]},
                            {"SLURM_CPUS_ON_NODE", parts[6]}};
  auto resolve = [](const std::string& host) -> accel::Result<std::string> {
    if (host.empty()) return accel::Status::error("empty host");
    return std::string("10.0.0.1");
  };
  (void)accel::config::read_slurm(env, accel::config::SlurmUse::kAuto, resolve);
  return 0;
}

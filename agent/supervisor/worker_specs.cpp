// Builds a node's worker specs from a GroupPlan.
#include "agent/supervisor/worker_specs.h"

#include <filesystem>

#include "agent/supervisor/hang_monitor.h"
#include "contract/worker_contract.h"

namespace accel::supervisor {

std::string error_file_path(const std::string& error_dir, int rank) {
  return error_dir + "/rank_" + std::to_string(rank) + ".error.json";
}

std::vector<WorkerSpec> make_worker_specs(const GroupPlan& plan) {
  std::vector<WorkerSpec> specs;
  specs.reserve(static_cast<size_t>(plan.local_world_size));
  std::error_code ec;
  for (int local = 0; local < plan.local_world_size; ++local) {
    int rank = plan.rank_offset + local;
    WorkerIdentity id{.rank = rank,
                      .local_rank = local,
                      .local_world_size = plan.local_world_size,
                      .world_size = plan.world_size,
                      .group_rank = plan.node_rank,
                      .group_world_size = plan.num_nodes};
    std::string error_file;
    if (!plan.error_dir.empty()) {
      error_file = error_file_path(plan.error_dir, rank);
      std::filesystem::remove(error_file, ec);
    }
    WorkerSpec spec;
    spec.rank = rank;
    spec.local_rank = local;
    spec.argv = plan.argv;
    spec.env = build_worker_env(plan.base_env, id, plan.env, error_file);
    spec.env.erase(contract::kProgressFile);  // Why: an inherited one would be another job's page
    if (!plan.progress_dir.empty()) {
      std::string page = page_file_path(plan.progress_dir, rank);
      if (create_page_file(page)) spec.env[contract::kProgressFile] = page;
    }
    spec.working_dir = plan.working_dir;
    spec.prefix = plan.host.empty() ? "[rank " + std::to_string(rank) + "] "
                                    : "[" + plan.host + ":" + std::to_string(rank) + "] ";
    if (!plan.log_dir.empty()) {
      spec.log_path = plan.log_dir + "/rank_" + std::to_string(rank) + ".log";
      spec.stdout_to_console = (plan.tee & 1) != 0;
      spec.stderr_to_console = (plan.tee & 2) != 0;
    }
    specs.push_back(std::move(spec));
  }
  return specs;
}

}  // namespace accel::supervisor

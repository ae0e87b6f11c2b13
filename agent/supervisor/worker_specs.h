// The specs of one node's workers for one attempt: ranks, environment, log and error files.
// Shared by the local job loop (accel-launch, one node) and the node agent (many nodes).
#pragma once

#include <string>
#include <vector>

#include "agent/supervisor/worker_env.h"
#include "agent/supervisor/worker_group.h"

namespace accel::supervisor {

struct GroupPlan {
  std::vector<std::string> argv;
  int local_world_size = 1;
  int rank_offset = 0;  // global rank of local rank 0
  int world_size = 1;
  int node_rank = 0;
  int num_nodes = 1;
  JobEnv env;  // job_id, master, restart count, runtime settings
  EnvMap base_env;
  std::string working_dir;
  std::string log_dir;  // this attempt's folder for rank_<r>.log; empty: console only
  int tee = 3;
  std::string error_dir;  // this attempt's folder for rank_<r>.error.json; empty: none
  // this attempt's folder for rank_<r>.progress (hang detection); empty: none
  std::string progress_dir;
  std::string host;  // non-empty: console prefix "[host:rank] ", else "[rank r] "
};

// Why the files are removed first: a file left by an earlier run must not pass for this one's.
std::vector<WorkerSpec> make_worker_specs(const GroupPlan& plan);

// "<dir>/rank_<r>.error.json"
std::string error_file_path(const std::string& error_dir, int rank);

}  // namespace accel::supervisor

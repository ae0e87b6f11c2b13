// Mode 1: this machine alone. The job goes through the same CoordinatorCore, node agent and
// attempt runner as a cluster job, with the coordinator in this process (LocalCoordinator): no
// gRPC, no socket but the job's rendezvous store.
#pragma once

#include <string>

#include "agent/common/job_spec.h"
#include "agent/config/cluster_config.h"
#include "agent/supervisor/worker_env.h"

namespace accel::launcher {

struct LocalLaunch {
  config::ClusterConfig cfg;
  JobSpec spec;            // config::make_job_spec
  supervisor::EnvMap env;  // the launcher's environment, inherited by the workers
  std::string job_id;      // never empty
};

// Runs the job to its end and returns its exit code (the root cause's, 128 + a signal that
// stopped it, or 1 when it could not run).
int run_local(const LocalLaunch& launch);

}  // namespace accel::launcher

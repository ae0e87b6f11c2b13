// The multi-node launch modes of accel-launch (docs/operations.md):
//   mode 2: every node runs `accel-launch --nodes N --machine-rank K ...`; machine rank 0 also
//           hosts the coordinator at main_process_ip:coordinator_port;
//   mode 3: `accel-launch --coordinator HOST:PORT ...` submits to standing agents, streams the
//           workers' output with [host:rank] prefixes and exits with the job's code.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "accel/v1/coordinator.pb.h"
#include "agent/common/job_spec.h"
#include "agent/config/cluster_config.h"
#include "agent/node/control_plane_config.h"
#include "agent/supervisor/worker_env.h"

namespace accel::launcher {

struct ClusterLaunch {
  config::ClusterConfig cfg;
  JobSpec spec;            // config::make_job_spec
  supervisor::EnvMap env;  // the launcher's environment
  std::string job_id;      // empty: the coordinator names it (mode 3)
};

// The job as the coordinator sees it.
v1::JobSpec job_spec_proto(const ClusterLaunch& launch, bool forward_logs);

// Mode 3 takes its stop signals with sigwait on a thread of its own: they must be blocked in
// every thread, so before anything starts one (gRPC's initialization does). Idempotent.
void block_submit_signals();
int run_submit(const ClusterLaunch& launch);      // mode 3
int run_multi_node(const ClusterLaunch& launch);  // mode 2

}  // namespace accel::launcher

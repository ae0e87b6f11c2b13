// The multi-node launch modes of accel-launch (DESIGN §1):
//   mode 2: every node runs `accel-launch --nodes N --machine-rank K ...`; machine rank 0 also
//           hosts the coordinator at main_process_ip:coordinator_port;
//   mode 3: `accel-launch --coordinator HOST:PORT ...` submits to standing agents, streams the
//           workers' output with [host:rank] prefixes and exits with the job's code.
// And what accel-agent and accel status share with them: the job spec, the node agent's
// options, the token and TLS settings.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "accel/v1/coordinator.pb.h"
#include "agent/config/cluster_config.h"
#include "agent/coordinator/coordinator_server.h"
#include "agent/node/node_agent.h"
#include "agent/rpc/coordinator_client.h"
#include "agent/supervisor/worker_env.h"

namespace accel::launcher {

struct ClusterLaunch {
  config::ClusterConfig cfg;
  std::vector<std::string> argv;  // resolved worker command line
  supervisor::EnvMap env;         // the launcher's environment
  std::string job_id;             // empty: the coordinator names it (mode 3)
  std::string checkpoint_dir;     // absolute, or empty
  std::vector<std::pair<std::string, std::string>> worker_env;  // --env
};

// The job as the coordinator sees it.
v1::JobSpec make_job_spec(const ClusterLaunch& launch, bool forward_logs);

struct ControlPlaneAuth {
  std::string token;
  rpc::TlsFiles tls;
};
// The token and TLS files of the config, read now: an error names the key, where it was set
// and the file.
Result<ControlPlaneAuth> control_plane_auth(const config::ClusterConfig& cfg,
                                            const supervisor::EnvMap& env);
// A coordinator serving at `listen` with the config's lease.
coordinator::ServerOptions server_options(const config::ClusterConfig& cfg,
                                          const std::string& listen, const ControlPlaneAuth& auth);
Result<std::shared_ptr<rpc::CoordinatorClient>> connect(const config::ClusterConfig& cfg,
                                                        const supervisor::EnvMap& env,
                                                        const std::string& target);

// Options of this node's agent; `target` is the coordinator it talks to.
node::NodeAgentOptions make_agent_options(const config::ClusterConfig& cfg,
                                          const supervisor::EnvMap& env, const std::string& target);

int run_submit(const ClusterLaunch& launch);      // mode 3
int run_multi_node(const ClusterLaunch& launch);  // mode 2

}  // namespace accel::launcher

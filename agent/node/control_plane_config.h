// From the resolved configuration to the control plane's endpoints: the token and TLS files, a
// served coordinator's options, a coordinator client, this node's agent options. accel-launch
// (modes 2 and 3), accel-agent and `accel status` all build theirs here.
#pragma once

#include <memory>
#include <string>

#include "agent/common/status.h"
#include "agent/config/cluster_config.h"
#include "agent/coordinator/coordinator_server.h"
#include "agent/node/node_agent.h"
#include "agent/rpc/coordinator_client.h"
#include "agent/rpc/rpc_security.h"
#include "agent/supervisor/worker_env.h"

namespace accel::node {

struct ControlPlaneAuth {
  std::string token;
  rpc::TlsFiles tls;
};
// The token and TLS files of the config, read now: an error names the key, where it was set
// and the file.
Result<ControlPlaneAuth> control_plane_auth(const config::ClusterConfig& cfg,
                                            const supervisor::EnvMap& env);
// A coordinator serving at `listen` with the config's lease and retention.
coordinator::ServerOptions server_options(const config::ClusterConfig& cfg,
                                          const std::string& listen, const ControlPlaneAuth& auth);
Result<std::shared_ptr<rpc::CoordinatorClient>> connect(const config::ClusterConfig& cfg,
                                                        const supervisor::EnvMap& env,
                                                        const std::string& target);

// Options of this node's agent; `target` is the coordinator it talks to.
NodeAgentOptions make_agent_options(const config::ClusterConfig& cfg, const supervisor::EnvMap& env,
                                    const std::string& target);

}  // namespace accel::node

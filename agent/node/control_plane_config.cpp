// Configuration -> control-plane endpoint options.
#include "agent/node/control_plane_config.h"

#include <algorithm>

namespace accel::node {

using namespace std::chrono_literals;

Result<ControlPlaneAuth> control_plane_auth(const config::ClusterConfig& cfg,
                                            const supervisor::EnvMap& env) {
  // Why the origin: "tls_ca /etc/x.pem: cannot read it" alone does not say which file or flag set
  // it.
  auto located = [&cfg](const std::string& message) {
    std::string key = message.substr(0, message.find(' '));
    const auto& where = cfg.origin(key).where;
    return Status::error(where.empty() ? message : where + ": " + message);
  };
  auto it = env.find("ACCEL_TOKEN");
  auto token = rpc::load_token(cfg.token_file, it == env.end() ? nullptr : it->second.c_str());
  if (!token) return located(token.message());
  ControlPlaneAuth auth{*token, {.cert = cfg.tls_cert, .key = cfg.tls_key, .ca = cfg.tls_ca}};
  // Read the PEM files now, so a bad one is an error before anything starts.
  if (auto server = rpc::server_credentials(auth.tls, auth.token); !server)
    return located(server.message());
  if (auto client = rpc::channel_credentials(auth.tls, auth.token); !client)
    return located(client.message());
  return auth;
}

coordinator::ServerOptions server_options(const config::ClusterConfig& cfg,
                                          const std::string& listen, const ControlPlaneAuth& auth) {
  coordinator::ServerOptions so;
  so.listen_address = listen;
  so.token = auth.token;
  so.tls = auth.tls;
  so.core.lease = cfg.lease_timeout;
  so.core.retention = cfg.retention;
  so.core.max_nodes = static_cast<std::size_t>(cfg.coordinator_max_nodes);
  so.core.max_jobs = static_cast<std::size_t>(cfg.coordinator_max_jobs);
  // Why a third of the lease: a live node's syncs then arrive at least twice within it (room for
  // one failed call and its retry), and an idle cluster's heartbeats cost a third of what 1 Hz
  // costs at the default lease. The cap keeps the workers' progress the coordinator holds (for
  // desync reports) at most 10 s old.
  so.core.sync_wait = std::min<std::chrono::milliseconds>(10s, cfg.lease_timeout / 3);
  return so;
}

Result<std::shared_ptr<rpc::CoordinatorClient>> connect(const config::ClusterConfig& cfg,
                                                        const supervisor::EnvMap& env,
                                                        const std::string& target) {
  auto auth = control_plane_auth(cfg, env);
  if (!auth) return auth.status();
  return rpc::CoordinatorClient::create(target, auth->token, auth->tls);
}

NodeAgentOptions make_agent_options(const config::ClusterConfig& cfg, const supervisor::EnvMap& env,
                                    const std::string& target) {
  NodeAgentOptions o;
  o.hostname = local_hostname();
  o.node_id = cfg.node_id.empty() ? default_node_id(o.hostname) : cfg.node_id;
  o.address = cfg.node_address.empty() ? route_address_to(target) : cfg.node_address;
  o.base_env = env;
  o.base_env.erase("ACCEL_TOKEN");  // Why: workers need no control-plane secret
  o.group.stop_timeout = cfg.stop_timeout;
  o.lease_fallback = cfg.lease_timeout;
  return o;
}

}  // namespace accel::node

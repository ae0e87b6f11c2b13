// The Slurm source (slurm_source.h). Variable names and formats as Slurm 22.05 writes them.
#include "agent/config/slurm_source.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <array>
#include <charconv>

#include "contract/slurm.h"

namespace accel::config {
namespace {

std::optional<std::string> get(const EnvMap& env, std::string_view name) {
  auto it = env.find(name);
  if (it == env.end() || it->second.empty()) return std::nullopt;
  return it->second;
}

std::optional<long> number(const std::string& text) {
  long v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return v;
}

Result<long> integer_var(const EnvMap& env, const char* name, long min) {
  auto text = get(env, name);
  if (!text) return Status::error(std::string("Slurm: ") + name + " is not set");
  auto v = number(*text);
  if (!v || *v < min) {
    return Status::error(std::string("Slurm: ") + name + "=\"" + *text +
                         "\": expected an integer >= " + std::to_string(min));
  }
  return *v;
}

std::string var_text(const char* name, const std::string& value) {
  return std::string(name) + "=" + value;
}

}  // namespace

Result<std::string> resolve_host_address(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
  if (rc != 0) return Status::error("cannot resolve " + host + ": " + ::gai_strerror(rc));
  std::string ipv4;
  std::string ipv6;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    std::array<char, INET6_ADDRSTRLEN> text{};
    if (a->ai_family == AF_INET && ipv4.empty()) {
      auto* sin = reinterpret_cast<sockaddr_in*>(a->ai_addr);  // NOLINT: the sockets API
      if (::inet_ntop(AF_INET, &sin->sin_addr, text.data(), text.size())) ipv4 = text.data();
    } else if (a->ai_family == AF_INET6 && ipv6.empty()) {
      auto* sin6 = reinterpret_cast<sockaddr_in6*>(a->ai_addr);  // NOLINT: the sockets API
      if (::inet_ntop(AF_INET6, &sin6->sin6_addr, text.data(), text.size())) ipv6 = text.data();
    }
  }
  ::freeaddrinfo(found);
  // Why IPv4 first: gRPC and gloo both reach an IPv4 address on every cluster seen so far.
  if (!ipv4.empty()) return ipv4;
  if (!ipv6.empty()) return ipv6;
  return Status::error("cannot resolve " + host + ": no IPv4 or IPv6 address");
}

Result<SlurmSettings> read_slurm(const EnvMap& env, SlurmUse use, const HostResolver& resolve) {
  SlurmSettings out;
  if (use == SlurmUse::kOff) return out;
  auto job_id = get(env, "SLURM_JOB_ID");
  if (!job_id) job_id = get(env, "SLURM_JOBID");
  if (!job_id) {
    if (use == SlurmUse::kOn) {
      return Status::error(
          "--slurm: not inside a Slurm allocation (SLURM_JOB_ID is not set); run accel-launch "
          "under sbatch/srun, or drop --slurm");
    }
    return out;
  }
  out.active = true;
  const std::string job = "Slurm SLURM_JOB_ID=" + *job_id;
  out.values.push_back({"job_id", "slurm-" + *job_id, job});
  out.values.push_back(
      {"coordinator_port",
       std::to_string(contract::slurm_port_for_job(*job_id, contract::kSlurmCoordinatorPortBase)),
       job + " (a port per job)"});

  const bool in_step = get(env, "SLURM_STEP_ID").has_value();
  const char* nodes_var =
      in_step && get(env, "SLURM_STEP_NUM_NODES") ? "SLURM_STEP_NUM_NODES" : "SLURM_NNODES";
  long nodes = 1;
  if (get(env, nodes_var)) {
    auto n = integer_var(env, nodes_var, 1);
    if (!n) return n.status();
    nodes = *n;
  }
  if (!in_step) {
    if (nodes > 1) {
      return Status::error(
          "Slurm: accel-launch is running in the batch script of job " + *job_id + " on " +
          std::to_string(nodes) + " nodes (" + nodes_var + "=" + std::to_string(nodes) +
          "), not in a job step, so only this node would take part. Start one accel-launch per "
          "node: srun --ntasks=" +
          std::to_string(nodes) +
          " --ntasks-per-node=1 accel-launch ...; or pass --no-slurm to run on this node alone");
    }
  } else {
    const char* tasks_var =
        get(env, "SLURM_STEP_NUM_TASKS") ? "SLURM_STEP_NUM_TASKS" : "SLURM_NTASKS";
    if (get(env, tasks_var)) {
      auto tasks = integer_var(env, tasks_var, 1);
      if (!tasks) return tasks.status();
      if (*tasks != nodes) {
        return Status::error(
            "Slurm: srun started " + std::to_string(*tasks) + " tasks on " + std::to_string(nodes) +
            " node(s) (" + tasks_var + "=" + std::to_string(*tasks) + ", " + nodes_var + "=" +
            std::to_string(nodes) +
            "); accel-launch starts the workers itself and wants one task per node: srun "
            "--ntasks=" +
            std::to_string(nodes) +
            " --ntasks-per-node=1 accel-launch ... (or let srun start every rank without "
            "accel-launch: srun -n N ./train)");
      }
    }
    auto node_id = integer_var(env, "SLURM_NODEID", 0);
    if (!node_id) return node_id.status();
    if (*node_id >= nodes) {
      return Status::error("Slurm: SLURM_NODEID=" + std::to_string(*node_id) + " but " + nodes_var +
                           "=" + std::to_string(nodes));
    }
    out.values.push_back(
        {"nodes", std::to_string(nodes), "Slurm " + var_text(nodes_var, std::to_string(nodes))});
    out.values.push_back({"machine_rank", std::to_string(*node_id),
                          "Slurm " + var_text("SLURM_NODEID", std::to_string(*node_id))});
    const char* list_var = get(env, "SLURM_STEP_NODELIST")  ? "SLURM_STEP_NODELIST"
                           : get(env, "SLURM_JOB_NODELIST") ? "SLURM_JOB_NODELIST"
                                                            : "SLURM_NODELIST";
    auto list = get(env, list_var);
    if (!list) return Status::error(std::string("Slurm: ") + list_var + " is not set");
    auto hosts = contract::expand_hostlist(*list);
    if (!hosts.ok()) {
      return Status::error(std::string("Slurm: ") + list_var + "=\"" + *list +
                           "\": not a host list: " + hosts.error);
    }
    if (static_cast<long>(hosts.items.size()) != nodes) {
      return Status::error(std::string("Slurm: ") + list_var + "=\"" + *list + "\" names " +
                           std::to_string(hosts.items.size()) + " node(s) but " + nodes_var + "=" +
                           std::to_string(nodes));
    }
    const std::string& first = hosts.items.front();
    auto address = resolve(first);
    if (!address) {
      return Status::error("Slurm: the job's first node " + first + " (from " + list_var +
                           ") hosts the rendezvous, but " + address.message());
    }
    out.values.push_back({"main_process_ip", *address,
                          "Slurm " + std::string(list_var) + " (first node " + first + ")"});
  }
  if (auto gpus = get(env, "SLURM_GPUS_ON_NODE")) {
    auto n = number(*gpus);
    if (!n || *n < 0) {
      return Status::error("Slurm: SLURM_GPUS_ON_NODE=\"" + *gpus + "\": expected an integer >= 0");
    }
    if (*n > 0) {
      out.values.push_back(
          {"num_processes", std::to_string(*n), "Slurm " + var_text("SLURM_GPUS_ON_NODE", *gpus)});
    }
  }
  for (const char* var : {"SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE"}) {
    auto text = get(env, var);
    if (!text) continue;
    auto n = number(*text);
    if (!n || *n < 1 || *n > (1 << 20)) continue;  // informative only: a bad value is not ours
    out.cpus = static_cast<int>(*n);
    out.cpus_where = var_text(var, *text);
    break;
  }
  return out;
}

}  // namespace accel::config

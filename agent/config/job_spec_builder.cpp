// ClusterConfig -> JobSpec.
#include "agent/config/job_spec_builder.h"

#include <pwd.h>
#include <unistd.h>

#include <filesystem>

namespace accel::config {
namespace {

namespace fs = std::filesystem;

std::string user_at_host() {
  const char* user = std::getenv("USER");
  std::string name = user ? user : "";
  if (name.empty()) {
    passwd pw{};
    passwd* found = nullptr;
    char buf[1024];
    if (::getpwuid_r(::getuid(), &pw, buf, sizeof buf, &found) == 0 && found) name = found->pw_name;
  }
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  return (name.empty() ? "uid " + std::to_string(::getuid()) : name) + "@" +
         (host[0] ? host : "localhost");
}

Result<std::string> absolute(const ClusterConfig& cfg, std::string_view key,
                             const std::string& path) {
  if (path.empty()) return path;
  std::error_code ec;
  fs::path abs = fs::absolute(path, ec);
  if (ec) {
    return Status::error(cfg.origin(key).where + ": " + std::string(key) + ": cannot make '" +
                         path + "' absolute: " + ec.message());
  }
  return abs.lexically_normal().string();
}

}  // namespace

Result<JobSpec> make_job_spec(const ClusterConfig& cfg, std::vector<std::string> argv,
                              const std::vector<std::pair<std::string, std::string>>& extra_env) {
  JobSpec spec;
  spec.argv = std::move(argv);
  std::error_code ec;
  spec.working_dir = fs::current_path(ec).string();
  spec.processes_per_node = cfg.num_processes;
  spec.min_nodes = cfg.nodes.min;
  spec.max_nodes = cfg.nodes.max;
  spec.max_restarts = cfg.max_restarts;
  spec.join_timeout = cfg.join_timeout;
  spec.last_call = cfg.last_call;
  spec.stop_timeout = cfg.stop_timeout;
  spec.heartbeat_timeout = cfg.heartbeat_timeout;
  spec.hang_timeout = cfg.hang_timeout;
  spec.network_timeout = cfg.network_timeout;
  spec.straggler_threshold = cfg.straggler_threshold;
  spec.straggler_window = cfg.straggler_window;
  spec.stall_timeout = cfg.stall_timeout;
  spec.master_port = cfg.main_process_port;
  ClusterConfig absolute_cfg = cfg;
  auto checkpoint_dir = absolute(cfg, "checkpoint_dir", cfg.checkpoint_dir);
  if (!checkpoint_dir) return checkpoint_dir.status();
  absolute_cfg.checkpoint_dir = *checkpoint_dir;
  auto project_dir = absolute(cfg, "project_dir", cfg.project_dir);
  if (!project_dir) return project_dir.status();
  absolute_cfg.project_dir = *project_dir;
  spec.worker_settings = worker_settings(absolute_cfg);
  for (const auto& [k, v] : extra_env) spec.extra_env[k] = v;
  spec.omp_num_threads = cfg.num_cpu_threads_per_process;
  auto log_dir = absolute(cfg, "log_dir", cfg.log_dir);
  if (!log_dir) return log_dir.status();
  spec.log_dir = *log_dir;
  spec.tee = cfg.tee;
  spec.submitted_by = user_at_host();
  return spec;
}

}  // namespace accel::config

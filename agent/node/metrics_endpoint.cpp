// The listener's routes and the process metrics.
#include "agent/node/metrics_endpoint.h"

#include <dirent.h>
#include <unistd.h>

#include <fstream>

#include "agent/common/token_file.h"
#include "agent/metrics/proc_stat.h"

namespace accel::node {

using metrics::Type;

namespace {

constexpr int kPageRefreshSeconds = 5;

}  // namespace

void write_process_metrics(metrics::Exposition& out) {
  auto self = metrics::read_proc_stat(::getpid()).value_or(metrics::ProcStat{});
  out.single("process_resident_memory_bytes", Type::kGauge, "Resident memory size in bytes.",
             self.resident_bytes);
  out.single("process_cpu_seconds_total", Type::kCounter,
             "Total user and system CPU time spent in seconds.", self.cpu_seconds);
  // Why once: the boot time and the process's start do not change.
  static const double started = [&self] {
    double boot = 0;
    std::ifstream proc_stat("/proc/stat");
    for (std::string line; std::getline(proc_stat, line);) {
      if (line.rfind("btime ", 0) == 0) boot = std::stod(line.substr(6));
    }
    return boot + self.start_after_boot;
  }();
  out.single("process_start_time_seconds", Type::kGauge,
             "Start time of the process since unix epoch in seconds.", started);
  double fds = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d) != nullptr) ++fds;
    ::closedir(d);
    fds -= 3;  // ".", ".." and the directory's own descriptor
  }
  out.single("process_open_fds", Type::kGauge, "Number of open file descriptors.", fds);
}

namespace {
Status located(const config::ClusterConfig& cfg, const std::string& key,
               const std::string& message) {
  const auto& where = cfg.origin(key).where;
  return Status::error((where.empty() ? key : where) + ": " + message);
}
}  // namespace

Result<std::string> metrics_token(const config::ClusterConfig& cfg) {
  if (cfg.metrics_token_file.empty()) return std::string();
  auto token = read_token_file("metrics_token_file", cfg.metrics_token_file);
  if (!token) return located(cfg, "metrics_token_file", token.message());
  return *token;
}

Result<std::unique_ptr<metrics::HttpServer>> serve_metrics(boost::asio::io_context& io,
                                                           const config::ClusterConfig& cfg,
                                                           MetricsSources sources,
                                                           std::optional<std::string> token) {
  if (cfg.metrics_address.empty()) return std::unique_ptr<metrics::HttpServer>();
  metrics::HttpServerOptions options;
  options.address = cfg.metrics_address;
  if (!token) {
    auto read = metrics_token(cfg);
    if (!read) return read.status();
    token = *read;
  }
  options.token = *token;
  auto handler = [sources = std::move(sources)](const metrics::HttpRequest& req) {
    metrics::HttpResponse r;
    if (req.path == "/metrics") {
      metrics::Exposition out;
      if (sources.write) sources.write(out);
      write_process_metrics(out);
      r.content_type = "text/plain; version=0.0.4; charset=utf-8";
      r.body = out.take();
    } else if (req.path == "/" && sources.page) {
      r.content_type = "text/html; charset=utf-8";
      r.body = sources.page(kPageRefreshSeconds);
    } else {
      r.status = 404;
      r.body = "not found: this server has /metrics and /\n";
    }
    return r;
  };
  auto server = metrics::HttpServer::start(io, std::move(options), std::move(handler));
  if (!server) return located(cfg, "metrics_address", server.message());
  return std::move(*server);
}

}  // namespace accel::node

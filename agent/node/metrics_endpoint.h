// The /metrics and status page listener of a process (accel-agent, accel-launch), from its
// configuration: metrics_address (off when empty) and metrics_token_file. What it serves comes
// from the parts the process hosts (a coordinator, a node agent, both).
#pragma once

#include <boost/asio/io_context.hpp>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "agent/common/status.h"
#include "agent/config/cluster_config.h"
#include "agent/metrics/exposition.h"
#include "agent/metrics/http_server.h"

namespace accel::node {

struct MetricsSources {
  std::function<void(metrics::Exposition&)> write;  // every metric of the parts hosted here
  std::function<std::string(int refresh_s)> page;   // the status page
};

// The bearer token of cfg.metrics_token_file (empty when none is set); the error names the key's
// origin and the file. accel-agent reads it before it drops its supplementary groups.
Result<std::string> metrics_token(const config::ClusterConfig& cfg);

// Serves cfg.metrics_address on `io` (null when it is empty), with `token` when given, else the
// one metrics_token() reads. The error names the key's origin (the flag or file that set it) and
// the problem: a port in use, an unreadable token file.
Result<std::unique_ptr<metrics::HttpServer>> serve_metrics(
    boost::asio::io_context& io, const config::ClusterConfig& cfg, MetricsSources sources,
    std::optional<std::string> token = std::nullopt);

// The process's own figures under Prometheus' standard names: process_resident_memory_bytes,
// process_cpu_seconds_total, process_open_fds, process_start_time_seconds.
void write_process_metrics(metrics::Exposition& out);

}  // namespace accel::node

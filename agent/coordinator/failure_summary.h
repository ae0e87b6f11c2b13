// What people read about failures: one failure in a line, a failed job's summary table, and the
// exit code a failure stands for. Pure functions of the failures (the coordinator's and the
// launchers' output).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "accel/v1/coordinator.pb.h"

namespace accel::coordinator {

namespace pb = ::accel::v1;

// The failure table of a job's last failed round (root cause first, marked) and the root
// causes of earlier rounds; what launchers print when a job fails.
// `program`: the job's argv[0] (the Python interpreter for a .py script), for the hints.
std::string format_failure_summary(const std::string& job_id,
                                   const std::vector<pb::Failure>& failures, int64_t last_round,
                                   std::optional<size_t> root, const std::string& program = {});
// "rank 3 on node-a (pid 812): SIGKILL (signal 9)", "node node-b lost: ...",
// "network: h1 cannot reach h2 (10.0.0.2) since 13:50:13.007 (for 10.2 s)"
std::string describe_failure(const pb::Failure& f);
// The shell's convention: exit code, or 128 + signal; 1 for a lost node, a hang, a network failure.
int32_t failure_status_code(const pb::Failure& f);
// The failure's kind as a metric label: exit, signal, hang, node_lost, spawn, network.
std::string failure_cause(const pb::Failure& f);

}  // namespace accel::coordinator

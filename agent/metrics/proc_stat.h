// A process's figures from /proc/<pid>/stat: what the metrics report of accel's own processes
// and of the workers.
#pragma once

#include <sys/types.h>

#include <optional>

namespace accel::metrics {

struct ProcStat {
  double cpu_seconds = 0;       // user + system
  double resident_bytes = 0;    // RSS
  double start_after_boot = 0;  // seconds after the machine booted
};

// nullopt when the process is gone (or /proc is not there).
std::optional<ProcStat> read_proc_stat(pid_t pid);

}  // namespace accel::metrics

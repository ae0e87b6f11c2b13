// The one place a resolved configuration becomes the job every launch mode runs.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "agent/common/job_spec.h"
#include "agent/common/status.h"
#include "agent/config/cluster_config.h"

namespace accel::config {

// `argv` is the resolved worker command line; `extra_env` the --env variables. Folders become
// absolute here (workers may change directory; every rank, node and restart must agree on them);
// an error names the key and where it was set.
Result<JobSpec> make_job_spec(const ClusterConfig& cfg, std::vector<std::string> argv,
                              const std::vector<std::pair<std::string, std::string>>& extra_env);

}  // namespace accel::config

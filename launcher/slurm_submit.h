// accel-launch --slurm-submit / --slurm-script: from a login node, write the batch script that
// runs this same launch on a Slurm allocation (one accel-launch per node under srun, which reads
// the allocation itself) and submit it with sbatch.
#pragma once

#include <string>
#include <vector>

#include "agent/config/cluster_config.h"
#include "launcher/launch_cli.h"

namespace accel::launcher {

// Exit code of a job stopped by SIGUSR1 (Slurm's --signal=USR1@...): 128 + 10. The batch script
// requeues itself on it, so a preempted or time-limited job goes on from its checkpoint.
inline constexpr int kStoppedByUsr1 = 138;

struct SubmitScript {
  std::string accel_launch;  // absolute path of the accel-launch to run on the nodes
  std::string workdir;       // the folder the job runs in (where it was submitted from)
  std::string job_name;
};

// The script's text: #SBATCH lines (nodes, one task per node, CPUs for the workers, USR1 60 s
// before the time limit, requeue, output file), then srun accel-launch with `cmd.resubmit`
// and the program, then a requeue when the launch stopped on SIGUSR1.
std::string sbatch_script(const LaunchCommand& cmd, const config::ClusterConfig& cfg,
                          const std::vector<std::string>& program_argv, const SubmitScript& where);

// Writes the script (--slurm-script FILE, else ./accel-<job name>.sbatch) and, for
// --slurm-submit, runs `sbatch FILE`, passing its output through. Returns the exit code.
int slurm_submit(const LaunchCommand& cmd, const config::ClusterConfig& cfg,
                 const std::vector<std::string>& program_argv);

// `s` quoted for a POSIX shell (plain when it is safe as it is).
std::string shell_quote(const std::string& s);

}  // namespace accel::launcher

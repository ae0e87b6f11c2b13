// "Save a checkpoint, then stop": SIGUSR1, as Slurm sends it before a time limit or a preemption
// (`#SBATCH --signal=USR1@60`) and accel-launch passes it on. The handler only records the
// signal; the ranks agree on it at the next step boundary (one small all-reduce per step, only
// while a checkpoint folder is set), save there and exit with 128 + SIGUSR1.
#pragma once

namespace accel::stop_request {

// Installs the handler once per process, unless the program has a SIGUSR1 handler of its own
// (then it is left alone and this returns false).
bool arm();
// The signal received since arm(), or 0.
int pending();

}  // namespace accel::stop_request

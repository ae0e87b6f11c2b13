#pragma once

// accel-launch's own exit codes: the ones it returns when it, not a worker, ends the job.
// A job that ran returns its root-cause worker's code (or 128 + signal); docs/launch.md has the
// table, and tests/integration/launcher_test.cpp checks every row of it.

namespace accel::launcher {

// A bad flag, configuration value (a missing token included), or no PROGRAM.
inline constexpr int kExitUsage = 2;
// The workers could not be started: exec failed, the log folder or the store's port.
inline constexpr int kExitStartFailed = 1;
// The control plane failed: the coordinator could not be reached, refused our token, gave up
// on this node or lost the job. As `env` and `timeout` use 125 for their own failures.
inline constexpr int kExitControlPlane = 125;
// accel-launch --coordinator stopped following a job whose end it could not learn (the
// coordinator did not answer for follow_timeout): the job may still be running.
inline constexpr int kExitStillRunning = 124;
// The program, script or Python interpreter cannot be found.
inline constexpr int kExitNotFound = 127;

}  // namespace accel::launcher

// The names workers leave in /dev/shm. libaccel's rank 0 of a node names a shared-memory segment
// accel-<its pid>-... (contract::kShmSegmentPrefix) only until every local rank has mapped it;
// a worker killed in that window leaves the name behind. Whoever reaps a worker removes its
// names; these functions are the ways to do so when nobody did.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace accel::supervisor {

// Removes the names of `worker`, a reaped worker (its pid is free: nothing can still be setting
// them up). This user's plain files only, never through a link.
void remove_shm_names_of(pid_t worker);

// Removes the names of processes that are gone and that are at least a minute old: those of
// workers nobody reaped (their launcher or agent was SIGKILLed with them).
void sweep_dead_shm_names();

// The file in an attempt's folder that lists its workers' pids: an agent started after one that
// was SIGKILLed (whose workers died with it, unreaped) reads it to remove their names at once,
// not a minute later.
inline constexpr char kWorkersFile[] = "workers";

// Writes `pids` to <folder>/workers (a best effort: without it, the minute-old sweep remains).
void record_workers(const std::string& folder, const std::vector<pid_t>& pids);

// Removes the names of the workers <folder>/workers lists, once each is gone (a zombie counts:
// it can create nothing). Waits up to `wait_ms` in all for workers still exiting (a SIGKILL from
// their dead agent is on its way); one still alive then (its pid taken by another process)
// keeps its names for the sweep. Returns how many names went.
int remove_shm_names_of_recorded_workers(const std::string& folder, int wait_ms = 1000);

}  // namespace accel::supervisor

// The state folder's round folders, shared by agents: <state_dir>/<job>/attempt_<n>/ holds a
// round's error files and progress pages. Several agents may share a state folder (the default
// one is per node id, and two Slurm jobs on one machine each start an agent of the same id); a
// shared flock() on a job's folder says an agent still uses it, so an agent that starts removes
// only what agents that are gone left there.
#pragma once

#include <string>

namespace accel::node {

// Creates `error_dir` and returns a descriptor of its parent (the job's folder) holding a shared
// flock(), or -1 when that cannot be had (the round runs anyway).
int create_and_lock_job_folder(const std::string& error_dir);

// Removes the job folders in `state_dir` shaped like ours (<job>/attempt_<n>/ only) that no
// running agent holds; returns how many.
int remove_unused_job_folders(const std::string& state_dir);

}  // namespace accel::node

// JobSpec: one job as every launch mode runs it. config::make_job_spec builds it from the
// resolved configuration, in one place for every mode; the control plane carries it 1:1 as
// v1::JobSpec (rpc/job_spec_proto.h); supervisor::Attempt runs one node's share of it. Its
// members have no defaults of their own: every default is the configuration's.
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace accel {

struct JobSpec {
  std::vector<std::string> argv;  // the workers' command line, resolved (argv[0] a path)
  std::string working_dir;        // empty: the agent's own
  int processes_per_node = 0;
  int min_nodes = 0;
  int max_nodes = 0;
  int max_restarts = 0;  // whole-group restarts, counted once for the whole job
  std::chrono::milliseconds join_timeout{0};
  std::chrono::milliseconds last_call{0};
  std::chrono::milliseconds stop_timeout{0};  // SIGTERM -> SIGKILL grace
  std::chrono::milliseconds heartbeat_timeout{0};
  std::chrono::milliseconds hang_timeout{0};  // a collective in flight this long: hung; 0 off
  // A node that cannot reach another of the round this long: a network failure; 0 off.
  std::chrono::milliseconds network_timeout{0};
  // Straggler reports: a rank whose compute per step is this many times the median of the others'
  // for straggler_window (0: off); a rank without a step for stall_timeout (0: off).
  double straggler_threshold = 0;
  std::chrono::milliseconds straggler_window{0};
  std::chrono::milliseconds stall_timeout{0};
  bool forward_logs = false;  // send the workers' output to the coordinator
  int master_port = 0;        // 0: chosen per attempt
  // The settings every worker receives from the configuration (config::worker_settings):
  // variable -> value, "" unsets the variable.
  std::map<std::string, std::string> worker_settings;
  std::map<std::string, std::string> extra_env;  // --env, set after the contract's variables
  int omp_num_threads = 0;   // 0: 1 when a node runs several workers, else inherited
  std::string log_dir;       // absolute; each node writes <log_dir>/<job>/attempt_<k>/rank_<r>.log
  int tee = 0;               // with log_dir: 1 stdout, 2 stderr, 3 both still on the console
  std::string submitted_by;  // "user@host"
};

}  // namespace accel

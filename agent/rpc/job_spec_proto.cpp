// The JobSpec mapping.
#include "agent/rpc/job_spec_proto.h"

namespace accel::rpc {

using std::chrono::milliseconds;

v1::JobSpec to_proto(const JobSpec& spec) {
  v1::JobSpec p;
  for (const auto& a : spec.argv) p.add_argv(a);
  p.set_working_dir(spec.working_dir);
  p.set_processes_per_node(spec.processes_per_node);
  p.set_min_nodes(spec.min_nodes);
  p.set_max_nodes(spec.max_nodes);
  p.set_max_restarts(spec.max_restarts);
  p.set_join_timeout_ms(spec.join_timeout.count());
  p.set_last_call_ms(spec.last_call.count());
  p.set_stop_timeout_ms(spec.stop_timeout.count());
  p.set_heartbeat_timeout_ms(spec.heartbeat_timeout.count());
  p.set_hang_collective_timeout_ms(spec.hang_timeout.count());
  p.set_network_timeout_ms(spec.network_timeout.count());
  p.set_straggler_threshold(spec.straggler_threshold);
  p.set_straggler_window_ms(spec.straggler_window.count());
  p.set_stall_timeout_ms(spec.stall_timeout.count());
  p.set_forward_logs(spec.forward_logs);
  p.set_master_port(spec.master_port);
  for (const auto& [k, v] : spec.worker_settings) (*p.mutable_worker_settings())[k] = v;
  for (const auto& [k, v] : spec.extra_env) (*p.mutable_extra_env())[k] = v;
  p.set_omp_num_threads(spec.omp_num_threads);
  p.set_log_dir(spec.log_dir);
  p.set_tee(spec.tee);
  p.set_submitted_by(spec.submitted_by);
  return p;
}

JobSpec from_proto(const v1::JobSpec& p) {
  JobSpec spec;
  spec.argv.assign(p.argv().begin(), p.argv().end());
  spec.working_dir = p.working_dir();
  spec.processes_per_node = p.processes_per_node();
  spec.min_nodes = p.min_nodes();
  spec.max_nodes = p.max_nodes();
  spec.max_restarts = p.max_restarts();
  spec.join_timeout = milliseconds(p.join_timeout_ms());
  spec.last_call = milliseconds(p.last_call_ms());
  spec.stop_timeout = milliseconds(p.stop_timeout_ms());
  spec.heartbeat_timeout = milliseconds(p.heartbeat_timeout_ms());
  spec.hang_timeout = milliseconds(p.hang_collective_timeout_ms());
  spec.network_timeout = milliseconds(p.network_timeout_ms());
  spec.straggler_threshold = p.straggler_threshold();
  spec.straggler_window = milliseconds(p.straggler_window_ms());
  spec.stall_timeout = milliseconds(p.stall_timeout_ms());
  spec.forward_logs = p.forward_logs();
  spec.master_port = p.master_port();
  spec.worker_settings.insert(p.worker_settings().begin(), p.worker_settings().end());
  spec.extra_env.insert(p.extra_env().begin(), p.extra_env().end());
  spec.omp_num_threads = p.omp_num_threads();
  spec.log_dir = p.log_dir();
  spec.tee = p.tee();
  spec.submitted_by = p.submitted_by();
  return spec;
}

}  // namespace accel::rpc

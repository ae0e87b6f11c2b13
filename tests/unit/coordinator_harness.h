// The CoordinatorCore test harness: one core on a FakeClock, driven with plain protobuf
// messages as agents and launchers send them (shared by the coordinator's unit test files).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "agent/coordinator/coordinator_core.h"

namespace accel::coordinator {
namespace {

using std::chrono::milliseconds;
using Ins = pb::Instruction;
using Rep = pb::ReportGroupRequest;

constexpr milliseconds kLease{10'000};

pb::JobSpec make_spec(int min_nodes, int max_nodes, int ppn = 2) {
  pb::JobSpec s;
  s.add_argv("/usr/bin/python3");
  s.add_argv("train.py");
  s.set_processes_per_node(ppn);
  s.set_min_nodes(min_nodes);
  s.set_max_nodes(max_nodes);
  s.set_max_restarts(0);
  s.set_join_timeout_ms(60'000);
  s.set_last_call_ms(1'000);
  s.set_stop_timeout_ms(5'000);
  return s;
}

CoordinatorOptions default_options() {
  CoordinatorOptions o;
  o.lease = kLease;
  o.sync_wait = milliseconds(2'000);
  o.coordinator_id = "coord-test";
  o.verify_reused_instructions = true;  // every reused instruction is rebuilt and compared
  return o;
}

std::string host_of(const std::string& id) { return "host-" + id; }
std::string addr_of(const std::string& id) { return id + ".cluster.internal"; }

pb::Failure exit_failure(int rank, int exit_code, int signal, int64_t time_ms,
                         const std::string& msg = "") {
  pb::Failure f;
  f.set_kind(pb::Failure::KIND_EXIT);
  f.set_rank(rank);
  f.set_local_rank(rank);
  f.set_pid(1000 + rank);
  f.set_exit_code(exit_code);
  f.set_signal(signal);
  f.set_time_unix_ms(time_ms);
  f.set_message(msg);
  return f;
}

struct Harness {
  explicit Harness(CoordinatorOptions o = default_options()) : core(clock, std::move(o)) {}

  FakeClock clock;
  CoordinatorCore core;

  static pb::RegisterNodeRequest node_req(const std::string& id, int machine_rank = -1,
                                          const std::string& only_job = "") {
    pb::RegisterNodeRequest r;
    r.set_node_id(id);
    r.set_hostname(host_of(id));
    r.set_address(addr_of(id));
    r.set_machine_rank(machine_rank);
    r.set_only_job_id(only_job);
    return r;
  }

  RpcStatus add_node(const std::string& id, int machine_rank = -1,
                     const std::string& only_job = "") {
    pb::RegisterNodeResponse resp;
    held.erase(id);  // a registering agent forgets the instruction it held
    return core.register_node(node_req(id, machine_rank, only_job), &resp);
  }

  RpcStatus register_req(const pb::RegisterNodeRequest& req) {
    pb::RegisterNodeResponse resp;
    held.erase(req.node_id());
    return core.register_node(req, &resp);
  }

  // What each node holds, as an agent does: its syncs ask for unchanged instructions to be left
  // out, so every test also runs the path that reuses them (checked by
  // verify_reused_instructions).
  std::map<std::string, pb::SyncResponse> held;
  // The store port each node holds, sent with its syncs as an agent does (none: 0).
  std::map<std::string, int32_t> store_port;

  RpcStatus submit(const std::string& job_id, const pb::JobSpec& spec) {
    pb::SubmitJobRequest req;
    req.set_job_id(job_id);
    *req.mutable_spec() = spec;
    pb::SubmitJobResponse resp;
    return core.submit_job(req, &resp);
  }

  // Sync (renews the lease); a failed sync is a test failure.
  pb::SyncResponse sync_resp(const std::string& id) {
    pb::SyncRequest req;
    req.set_node_id(id);
    if (auto port = store_port.find(id); port != store_port.end()) req.set_store_port(port->second);
    auto it = held.find(id);
    if (it != held.end()) {
      req.set_known_version(it->second.version());
      req.set_omit_unchanged(true);
    }
    pb::SyncResponse resp;
    RpcStatus st = core.sync(req, &resp);
    EXPECT_TRUE(st.is_ok()) << "sync " << id << ": " << st.message;
    if (!st.is_ok()) return resp;
    if (resp.unchanged()) {
      EXPECT_TRUE(it != held.end() && it->second.version() == resp.version())
          << "sync " << id << " left out version " << resp.version() << ", which it does not hold";
      EXPECT_FALSE(resp.has_instruction());
      return it == held.end() ? resp : it->second;
    }
    held[id] = resp;
    return resp;
  }
  Ins ins(const std::string& id) { return sync_resp(id).instruction(); }

  RpcStatus sync_status(const std::string& id) {
    pb::SyncRequest req;
    req.set_node_id(id);
    pb::SyncResponse resp;
    return core.sync(req, &resp);
  }

  RpcStatus join(const std::string& id, const std::string& job, int64_t round, int32_t port = 0) {
    pb::JoinRoundRequest req;
    req.set_node_id(id);
    req.set_job_id(job);
    req.set_round(round);
    req.set_master_port(port);
    return core.join_round(req);
  }

  RpcStatus report(const std::string& id, const std::string& job, int64_t round, Rep::Event event,
                   const std::vector<pb::Failure>& failures = {}) {
    Rep req;
    req.set_node_id(id);
    req.set_job_id(job);
    req.set_round(round);
    req.set_event(event);
    for (const auto& f : failures) *req.add_failures() = f;
    return core.report_group(req);
  }

  pb::GetStatusResponse status() const {
    pb::GetStatusResponse resp;
    core.get_status(&resp);
    return resp;
  }

  std::optional<pb::JobStatus> job(const std::string& id) const {
    auto st = status();
    for (const auto& j : st.jobs()) {
      if (j.job_id() == id) return j;
    }
    return std::nullopt;
  }

  std::optional<pb::NodeStatus> node(const std::string& id) const {
    auto st = status();
    for (const auto& n : st.nodes()) {
      if (n.node_id() == id) return n;
    }
    return std::nullopt;
  }

  pb::WatchJobResponse watch(const std::string& job, uint64_t after) {
    pb::WatchJobRequest req;
    req.set_job_id(job);
    req.set_after_seq(after);
    pb::WatchJobResponse resp;
    RpcStatus st = core.watch_job(req, &resp);
    EXPECT_TRUE(st.is_ok()) << st.message;
    return resp;
  }

  // Every node syncs, sees JOIN for `job`, and joins with its port (in the given order).
  void join_all(const std::string& job, const std::vector<std::string>& ids,
                const std::vector<int32_t>& ports = {}) {
    for (size_t i = 0; i < ids.size(); ++i) {
      Ins in = ins(ids[i]);
      ASSERT_EQ(in.action(), Ins::ACTION_JOIN) << ids[i];
      ASSERT_EQ(in.job_id(), job);
      RpcStatus st = join(ids[i], job, in.round(), i < ports.size() ? ports[i] : 0);
      ASSERT_TRUE(st.is_ok()) << ids[i] << ": " << st.message;
    }
  }

  // Registers `ids`, submits `job` with `spec` and has every node join; the round closes at max.
  void start_job(const std::string& job, const pb::JobSpec& spec,
                 const std::vector<std::string>& ids, const std::vector<int32_t>& ports = {}) {
    for (const auto& id : ids) ASSERT_TRUE(add_node(id).is_ok()) << id;
    ASSERT_TRUE(submit(job, spec).is_ok());
    join_all(job, ids, ports);
    ASSERT_EQ(core.job_state(job), pb::JOB_STATE_RUNNING);
  }
};

}  // namespace
}  // namespace accel::coordinator

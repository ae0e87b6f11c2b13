// What the coordinator tells each node (its instruction) and when a sync may leave it out.
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "agent/coordinator/coordinator_core.h"
#include "agent/coordinator/request_limits.h"

namespace accel::coordinator {
namespace {

// Why deterministic: map fields (JobSpec.extra_env) serialize in hash order, and protobuf seeds
// each map's hash randomly, so two copies of one instruction can give different bytes.
std::string stable_bytes(const google::protobuf::MessageLite& m) {
  std::string out;
  {
    google::protobuf::io::StringOutputStream stream(&out);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    m.SerializeToCodedStream(&coded);
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------- instructions

void CoordinatorCore::add_peers(const Job& job, int rank, pb::Assignment* a) const {
  const int n = static_cast<int>(job.members.size());
  // Why neighbours and not everyone: each node probes a bounded number of peers however large
  // the job; a partition anywhere separates some pair of ring neighbours. Node rank 0 hosts the
  // store every worker needs.
  std::vector<int> ranks = {0};
  for (int d = 1; d <= limits::kProbeNeighbours && d < n; ++d) {
    ranks.push_back((rank + d) % n);
    ranks.push_back((rank - d + n) % n);
  }
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  for (int r : ranks) {
    if (r == rank) continue;
    const std::string& id = job.members[static_cast<size_t>(r)];
    auto it = nodes_.find(id);
    if (it == nodes_.end() || it->second.info.probe_port() == 0) continue;
    auto* p = a->add_peers();
    p->set_node_rank(r);
    p->set_node_id(id);
    p->set_hostname(it->second.info.hostname());
    p->set_address(it->second.info.address());
    p->set_probe_port(it->second.info.probe_port());
  }
}

pb::Instruction CoordinatorCore::instruction_for(const std::string& node_id,
                                                 const Node& node) const {
  pb::Instruction ins;
  ins.set_action(pb::Instruction::ACTION_IDLE);
  if (!node.last_job_id.empty()) {
    auto it = jobs_.find(node.last_job_id);
    if (it != jobs_.end() && terminal(it->second)) {
      auto* out = ins.mutable_last_job();
      out->set_job_id(it->first);
      out->set_state(it->second.state);
      out->set_exit_code(it->second.exit_code);
      out->set_summary(it->second.summary);
    }
  }
  if (node.lost) return ins;
  if (!node.job_id.empty()) {
    auto it = jobs_.find(node.job_id);
    if (it != jobs_.end() && !terminal(it->second)) {
      const Job& job = it->second;
      if (job.state == pb::JOB_STATE_RUNNING) {
        if (const int rank = job.rank_of(node_id); rank >= 0) {
          ins.set_action(pb::Instruction::ACTION_RUN);
          ins.set_job_id(job.id);
          ins.set_round(job.round);
          *ins.mutable_spec() = job.spec;
          auto* a = ins.mutable_assignment();
          int ppn = job.spec.processes_per_node();
          a->set_node_rank(rank);
          a->set_num_nodes(static_cast<int>(job.members.size()));
          a->set_rank_offset(rank * ppn);
          a->set_world_size(static_cast<int>(job.members.size()) * ppn);
          a->set_master_addr(job.master_addr);
          a->set_master_port(job.master_port);
          a->set_restart_count(job.restart_count);
          if (job.spec.network_timeout_ms() > 0) add_peers(job, rank, a);
          return ins;
        }
      } else if (job.state == pb::JOB_STATE_RENDEZVOUS && node.joined_round == job.round &&
                 job.joined_ids.contains(node_id)) {
        // Why nothing new: the coordinator joined it (it has no workers and holds its store
        // port); its next answer is RUN when the round closes.
        if (node.auto_joined) return ins;
        // Why JOIN again and not WAIT: the same bytes as the JOIN it answered, so a join does
        // not make a new version every joined node must be sent (16k answers in a rendezvous of
        // 16k nodes); the node knows it joined from JoinRound's answer, and a retried join of
        // the same round is answered ok.
        ins.set_action(pb::Instruction::ACTION_JOIN);
        ins.set_job_id(job.id);
        ins.set_round(job.round);
        *ins.mutable_spec() = job.spec;
        return ins;
      }
    }
  }
  // The oldest job with an open round this node may join.
  if (const Job* best = round_to_join(node)) {
    ins.set_action(pb::Instruction::ACTION_JOIN);
    ins.set_job_id(best->id);
    ins.set_round(best->round);
    *ins.mutable_spec() = best->spec;
  }
  return ins;
}

void CoordinatorCore::fill_sync(const std::string& node_id, Node& node, pb::SyncResponse* resp,
                                uint64_t omit_if_version) {
  resp->set_progress_wait_ms(progress_wait().count());
  // Why the epoch: at 16k nodes, building and serializing every heartbeat's instruction (a
  // running job's spec and peers) was most of the coordinator's CPU; in a steady state nothing
  // changes, and the node already holds what it would be sent.
  if (node.version != 0 && node.sent_epoch == change_epoch_ && omit_if_version == node.version) {
    if (options_.verify_reused_instructions &&
        stable_bytes(instruction_for(node_id, node)) != node.sent) {
      std::fprintf(stderr, "coordinator: node %s's instruction changed without node_changed()\n",
                   node_id.c_str());
      std::abort();
    }
    resp->set_version(node.version);
    resp->set_unchanged(true);
    return;
  }
  pb::Instruction ins = instruction_for(node_id, node);
  std::string bytes = stable_bytes(ins);
  if (bytes != node.sent || node.version == 0) {
    node.sent = std::move(bytes);
    ++node.version;
  }
  node.sent_epoch = change_epoch_;
  resp->set_version(node.version);
  if (!ins.last_job().job_id().empty()) node.told_job_id = ins.last_job().job_id();
  if (omit_if_version == node.version) {
    resp->set_unchanged(true);
    return;
  }
  if (ins.action() == pb::Instruction::ACTION_RUN) {
    resp->set_next_sync_within_ms(int64_t{ins.assignment().num_nodes()} * 1000 /
                                  kRunAnswersPerSecond);
  }
  *resp->mutable_instruction() = std::move(ins);
}

}  // namespace accel::coordinator

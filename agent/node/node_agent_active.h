// NodeAgent::Active, the round a node agent runs, shared by node_agent.cpp and the files that
// split it by concept (node_agent_metrics.cpp). Not part of NodeAgent's interface.
#pragma once

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "agent/node/node_agent.h"
#include "agent/node/peer_probe.h"
#include "agent/supervisor/attempt.h"

namespace accel::node {

// One job round's local workers.
struct NodeAgent::Active {
  uint64_t generation = 0;
  std::string job_id;
  int64_t round = 0;
  pb::JobSpec spec;
  pb::Assignment assignment;
  // Node rank 0 only: the round's rendezvous store (declared before attempt: it outlives the
  // workers).
  std::unique_ptr<store::StoreServer> store;
  std::unique_ptr<supervisor::Attempt> attempt;  // null once its workers are stopped
  // Probes of the round's peers (network_timeout on, other nodes); before the workers start,
  // `pending` is the instruction that starts them once every peer answered.
  std::unique_ptr<PeerWatch> peers;
  std::optional<pb::Instruction> pending;
  std::chrono::steady_clock::time_point waiting_since{};
  std::chrono::steady_clock::time_point last_wait_line{};
  bool network_reported = false;
  std::string error_dir;     // <state_dir>/<job>/attempt_<round>: error files, progress pages
  int job_folder_lock = -1;  // <state_dir>/<job>, flock()ed shared while this round lives
  bool all_succeeded = false;
  bool keep_folder = false;  // the round folder is also the user's log folder

  [[nodiscard]] bool running() const { return attempt && attempt->running() > 0; }

  Active() = default;
  Active(const Active&) = delete;
  Active& operator=(const Active&) = delete;
  // Why: a standing agent runs job after job; each round's folder is read while its workers
  // exit and is garbage once the round is over (the job's folder too, once empty).
  ~Active() {
    attempt.reset();
    if (!error_dir.empty() && !keep_folder) {
      std::error_code ec;
      std::filesystem::remove_all(error_dir, ec);
      std::filesystem::remove(std::filesystem::path(error_dir).parent_path(),
                              ec);  // only when empty
    }
    if (job_folder_lock >= 0) ::close(job_folder_lock);
  }
};

}  // namespace accel::node

// The job-wide choice of backend (see backend_choice.h).
#include "runtime/backend_choice.h"

#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "accel/error.h"

namespace accel::detail {
namespace {

constexpr char kPrefix[] = "accel/backend/";

std::string count(int64_t n, const char* one, const char* many) {
  return std::to_string(n) + " " + (n == 1 ? one : many);
}

}  // namespace

BackendTally tally_backend_votes(c10d::Store& store, int world, const BackendVote& mine,
                                 std::chrono::milliseconds timeout) {
  const std::string p = kPrefix;
  // Invariant: every add of a vote happens before this rank's "voted" add, so the rank whose
  // "voted" add reaches `world` publishes "done" after every vote is in.
  if (mine.cuda) {
    if (store.add(p + "gpu/" + mine.gpu, 1) > 1) store.add(p + "shared", 1);
  } else {
    store.add(p + "cpu", 1);
  }
  if (mine.asked != "auto") store.add(p + "asked-" + mine.asked, 1);
  if (store.add(p + "voted", 1) == world) store.set(p + "done", std::vector<uint8_t>{1});
  store.wait({p + "done"}, timeout);
  BackendTally t;
  t.world = world;
  t.cpu = store.add(p + "cpu", 0);
  t.shared_gpu = store.add(p + "shared", 0);
  t.asked_nccl = store.add(p + "asked-nccl", 0);
  t.asked_gloo = store.add(p + "asked-gloo", 0);
  return t;
}

BackendChoice choose_backend(const BackendTally& t, const std::string& why_cpu) {
  if (t.cpu > 0 && t.cpu < t.world) {
    throw ConfigError("accel: " + std::to_string(t.cpu) + " of " + std::to_string(t.world) +
                      " ranks train on the CPU and the others on a GPU; one process group cannot "
                      "mix them: give every machine GPUs, or run every rank with --cpu "
                      "(ACCEL_USE_CPU=1)");
  }
  if (t.asked_nccl > 0 && t.asked_gloo > 0) {
    throw ConfigError("accel: the ranks disagree on ACCEL_BACKEND (" +
                      count(t.asked_nccl, "asks", "ask") + " for nccl, " +
                      std::to_string(t.asked_gloo) + " for gloo); set the same value everywhere");
  }
  const bool cuda = t.cpu == 0;
  if (t.asked_nccl > 0 && !cuda) {
    throw ConfigError(
        "accel: ACCEL_BACKEND=nccl needs a GPU, but this process trains on the CPU (" + why_cpu +
        "); leave ACCEL_BACKEND unset or set it to gloo");
  }
  if (t.asked_nccl > 0 && t.shared_gpu > 0) {
    throw ConfigError(
        "accel: ACCEL_BACKEND=nccl, but " + count(t.shared_gpu, "rank shares", "ranks share") +
        " a GPU with another rank; NCCL needs a GPU of its own for each rank (it refuses a "
        "duplicate GPU). Start at most one process per visible GPU, or leave ACCEL_BACKEND unset: "
        "ranks that share a GPU then run their collectives through gloo");
  }
  BackendChoice choice;
  choice.nccl = cuda && t.asked_gloo == 0 && t.shared_gpu == 0;
  if (cuda && t.asked_gloo == 0 && t.shared_gpu > 0) {
    choice.note = count(t.shared_gpu, "rank shares", "ranks share") + " a GPU with another rank (" +
                  std::to_string(t.world) +
                  " ranks in all): NCCL needs a GPU per rank, so the collectives run through "
                  "gloo, copying through host memory";
  }
  return choice;
}

std::string gpu_identity(int index) {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  std::string id = std::to_string(index);
  if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES"); visible && *visible) {
    std::vector<std::string> ids(1);
    for (const char* c = visible; *c; ++c) {
      if (*c == ',') {
        ids.emplace_back();
      } else {
        ids.back() += *c;
      }
    }
    if (index >= 0 && static_cast<std::size_t>(index) < ids.size())
      id = ids[static_cast<std::size_t>(index)];
  }
  return std::string(host) + "/" + id;
}

}  // namespace accel::detail

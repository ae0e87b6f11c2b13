// The job-wide choice of NCCL or gloo: the votes through a store, and the choice from the totals
// (a GPU machine is not needed: the choice is arithmetic on what the ranks report).
#include "runtime/backend_choice.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <vector>

#include "accel/error.h"

namespace accel::detail {
namespace {

using namespace std::chrono_literals;

// Each vote from its own thread, as ranks would, through one store; every rank's tally.
std::vector<BackendTally> vote(const std::vector<BackendVote>& votes) {
  c10d::HashStore store;
  std::vector<BackendTally> tallies(votes.size());
  std::vector<std::thread> ranks;
  for (std::size_t r = 0; r < votes.size(); ++r) {
    ranks.emplace_back([&, r] {
      tallies[r] = tally_backend_votes(store, static_cast<int>(votes.size()), votes[r], 10s);
    });
  }
  for (auto& t : ranks) t.join();
  return tallies;
}

std::string refusal(const BackendTally& t) {
  try {
    choose_backend(t, "--cpu / ACCEL_USE_CPU is set");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "no error";
}

TEST(BackendChoice, EveryRankGetsTheSameTotals) {
  // Two ranks bound to GPUs 0 and 1 of host a (CUDA_VISIBLE_DEVICES per rank, as Slurm's
  // --gpu-bind does), two more sharing GPU 0 of host b, one asking for gloo.
  auto t = vote({{.cuda = true, .gpu = "a/0"},
                 {.cuda = true, .gpu = "a/1"},
                 {.cuda = true, .gpu = "b/0"},
                 {.cuda = true, .gpu = "b/0", .asked = "gloo"}});
  for (const auto& each : t) {
    EXPECT_EQ(each.world, 4);
    EXPECT_EQ(each.cpu, 0);
    EXPECT_EQ(each.shared_gpu, 1);
    EXPECT_EQ(each.asked_gloo, 1);
    EXPECT_EQ(each.asked_nccl, 0);
  }
}

TEST(BackendChoice, NcclOnlyWhenEveryRankHasAGpuOfItsOwn) {
  // One GPU per rank, each rank seeing only its own (every one is "device 0" of its process).
  auto own = vote({{.cuda = true, .gpu = "a/GPU-1"}, {.cuda = true, .gpu = "a/GPU-2"}})[0];
  EXPECT_TRUE(choose_backend(own, "").nccl);
  EXPECT_TRUE(choose_backend(own, "").note.empty());

  auto shared = vote({{.cuda = true, .gpu = "a/0"}, {.cuda = true, .gpu = "a/0"}})[0];
  auto choice = choose_backend(shared, "");
  EXPECT_FALSE(choice.nccl);
  EXPECT_EQ(choice.note,
            "1 rank shares a GPU with another rank (2 ranks in all): NCCL needs a GPU per rank, so "
            "the collectives run through gloo, copying through host memory");

  auto asked_gloo = vote({{.cuda = true, .gpu = "a/0", .asked = "gloo"},
                          {.cuda = true, .gpu = "a/1", .asked = "gloo"}})[0];
  EXPECT_FALSE(choose_backend(asked_gloo, "").nccl);
  EXPECT_TRUE(choose_backend(asked_gloo, "").note.empty());

  auto cpu = vote({{}, {}, {}})[0];
  EXPECT_FALSE(choose_backend(cpu, "").nccl);
}

TEST(BackendChoice, WhatCannotWorkIsRefusedWithWhatToChange) {
  EXPECT_EQ(refusal(vote({{.cuda = true, .gpu = "a/0"}, {}, {}})[0]),
            "accel: 2 of 3 ranks train on the CPU and the others on a GPU; one process group "
            "cannot mix them: give every machine GPUs, or run every rank with --cpu "
            "(ACCEL_USE_CPU=1)");
  EXPECT_EQ(refusal(vote({{.cuda = true, .gpu = "a/0", .asked = "nccl"},
                          {.cuda = true, .gpu = "a/1", .asked = "gloo"},
                          {.cuda = true, .gpu = "a/2", .asked = "gloo"}})[0]),
            "accel: the ranks disagree on ACCEL_BACKEND (1 asks for nccl, 2 for gloo); set the "
            "same value everywhere");
  EXPECT_EQ(refusal(vote({{.cuda = false, .gpu = "", .asked = "nccl"},
                          {.cuda = false, .gpu = "", .asked = "nccl"}})[0]),
            "accel: ACCEL_BACKEND=nccl needs a GPU, but this process trains on the CPU (--cpu / "
            "ACCEL_USE_CPU is set); leave ACCEL_BACKEND unset or set it to gloo");
  EXPECT_EQ(refusal(vote({{.cuda = true, .gpu = "a/0", .asked = "nccl"},
                          {.cuda = true, .gpu = "a/0", .asked = "nccl"}})[0]),
            "accel: ACCEL_BACKEND=nccl, but 1 rank shares a GPU with another rank; NCCL needs a "
            "GPU of its own for each rank (it refuses a duplicate GPU). Start at most one process "
            "per visible GPU, or leave ACCEL_BACKEND unset: ranks that share a GPU then run their "
            "collectives through gloo");
}

TEST(BackendChoice, ARankThatNeverVotesIsATimeoutNotAHang) {
  c10d::HashStore store;
  auto start = std::chrono::steady_clock::now();
  EXPECT_ANY_THROW(tally_backend_votes(store, 2, {}, 200ms));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

TEST(BackendChoice, TheGpuIsNamedAsCudaVisibleDevicesNamesIt) {
  const char* before = std::getenv("CUDA_VISIBLE_DEVICES");
  std::string saved = before ? before : "";
  ::unsetenv("CUDA_VISIBLE_DEVICES");
  auto plain = gpu_identity(1);
  EXPECT_EQ(plain.substr(plain.rfind('/')), "/1");
  ::setenv("CUDA_VISIBLE_DEVICES", "3,GPU-abc", 1);
  auto named = gpu_identity(1);
  EXPECT_EQ(named.substr(named.rfind('/')), "/GPU-abc");
  EXPECT_EQ(named.substr(0, named.rfind('/')), plain.substr(0, plain.rfind('/')));  // the host
  auto beyond = gpu_identity(5);
  EXPECT_EQ(beyond.substr(beyond.rfind('/')), "/5");
  if (before) {
    ::setenv("CUDA_VISIBLE_DEVICES", saved.c_str(), 1);
  } else {
    ::unsetenv("CUDA_VISIBLE_DEVICES");
  }
}

}  // namespace
}  // namespace accel::detail

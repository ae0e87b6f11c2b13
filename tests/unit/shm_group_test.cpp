// ShmGroup on one process: what a shared block is when /dev/shm cannot hold it (null, and a reason
// that names /dev/shm, so Comm keeps the buckets private), and where tensors in a block lie. The
// collectives between processes are tested in tests/integration (runtime_worker collectives:
// exact answers on 2 and 3 processes and on 2 machines of 2).
#include "runtime/shm_group.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

namespace accel {
namespace {

struct OneRank {
  c10::intrusive_ptr<c10d::HashStore> store = c10::make_intrusive<c10d::HashStore>();
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
  std::unique_ptr<ShmGroup> shm;
  OneRank() {
    auto opts = c10d::ProcessGroupGloo::Options::create();
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, 0, 1, opts);
    std::string why;
    shm = ShmGroup::create(*store, *gloo, 0, 1, std::chrono::seconds(10), &why);
  }
};

TEST(ShmGroup, ABlockLargerThanDevShmIsRefusedWithTheReason) {
  OneRank one;
  ASSERT_NE(one.shm, nullptr) << "this machine has no usable /dev/shm";
  std::string why;
  // 2^50 bytes: no /dev/shm holds that; posix_fallocate refuses it before anything is used.
  auto block = one.shm->share(std::size_t{1} << 50, {"share", 0, 0}, &why);
  EXPECT_EQ(block, nullptr);
  EXPECT_NE(why.find("in /dev/shm"), std::string::npos) << why;
  // The group still works after the refusal: the next block and collectives go on.
  why.clear();
  auto ok = one.shm->share(4096, {"share", 1, 4096}, &why);
  ASSERT_NE(ok, nullptr) << why;
  auto t = torch::from_blob(one.shm->my_part(*ok), {1024}, torch::kFloat);
  EXPECT_EQ(t.abs().sum().item<float>(), 0.0f) << "a new block is zeroed";
  t.fill_(3.0f);
  EXPECT_EQ(one.shm->peer_data(t, 0), t.data_ptr()) << "rank 0's part is this rank's own";
  EXPECT_EQ(one.shm->peer_data(torch::zeros({4}), 0), nullptr) << "private memory";
  one.shm->allreduce(t, c10d::ReduceOp::SUM, {"allreduce", 2, 4096}, nullptr, 0.5);
  EXPECT_TRUE(torch::equal(t, torch::full({1024}, 1.5f))) << "one rank: the sum, scaled";
}

// One rank: every path returns its input (the split one above 256 KiB, out of place; fp16).
TEST(ShmGroup, OnOneRankThePrivatePathsReturnTheInput) {
  OneRank one;
  ASSERT_NE(one.shm, nullptr);
  EXPECT_TRUE(ShmGroup::can_reduce(torch::zeros({2}, torch::kBFloat16)));
  EXPECT_TRUE(ShmGroup::can_reduce(torch::zeros({2}, torch::kHalf)));
  EXPECT_FALSE(ShmGroup::can_reduce(torch::zeros({2}, torch::kBool)));
  // A private tensor larger than the split threshold, out of place: the result is the input.
  auto in = torch::randn({300000});
  auto out = torch::empty_like(in);
  one.shm->allreduce(out, c10d::ReduceOp::SUM, {"allreduce", 0, 1200000}, &in);
  EXPECT_TRUE(torch::equal(in, out));
  auto h = torch::full({5000}, 0.1, torch::kHalf);
  one.shm->allreduce(h, c10d::ReduceOp::MAX, {"allreduce", 1, 10000});
  EXPECT_TRUE(torch::equal(h, torch::full({5000}, 0.1, torch::kHalf)));
}

}  // namespace
}  // namespace accel

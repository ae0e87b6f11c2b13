// ShmGroup on one process: what a shared block is when /dev/shm cannot hold it (null, and a reason
// that names /dev/shm, so Comm keeps the buckets private), and where tensors in a block lie; and
// the posted all-reduce between two ranks run as threads, each with its own mapping (the
// ranks arriving at different times, more posts in flight than the ring holds, a rank in another
// collective). The collectives between processes are tested in tests/integration (runtime_worker
// collectives: exact answers on 2 and 3 processes and on 2 machines of 2).
#include "runtime/shm_group.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <vector>

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

// Two ranks as two threads of this process, each with its own gloo group and its own mapping of
// the segment: runs `body(rank, shm)` on both and returns what each threw ("" for nothing).
std::vector<std::string> on_two_ranks(std::chrono::milliseconds timeout,
                                      const std::function<void(int, ShmGroup&)>& body) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        auto opts = c10d::ProcessGroupGloo::Options::create();
        opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
        auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, 2, opts);
        std::string why;
        auto shm = ShmGroup::create(*store, *gloo, rank, 2, timeout, &why);
        if (!shm) throw std::runtime_error("no shared memory: " + why);
        body(rank, *shm);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(rank)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

// Each rank's data: the same seed on every run, another per rank.
torch::Tensor rank_data(int rank, int64_t n, int salt) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 * rank + salt));
  return torch::randn({n}, gen);
}

// A late rank (rank 1 sleeps, then writes its data, before each post) does not change the bits:
// three posted all-reduces of a block's tensors (2.8 MB in 11 chunks, a plain sum, so that a
// chunk summed twice or before the late rank's data is there shows; 4 KB averaged; one left
// outstanding until a barrier finishes it) equal the synchronous in-place all-reduce of the same
// data and the sums computed here.
TEST(ShmGroup, APostedAllReduceGivesTheSynchronousBitsWhicheverRankComesFirst) {
  constexpr int64_t kBig = 700001, kSmall = 1000, kLast = 70000;
  std::vector<std::vector<torch::Tensor>> posted(2), synchronous(2);
  auto errors = on_two_ranks(std::chrono::seconds(30), [&](int rank, ShmGroup& shm) {
    const std::size_t bytes = (kBig + kSmall + kLast) * 4 + 128;
    std::string why;
    auto block = shm.share(bytes, {"share", 0, bytes}, &why);
    if (!block) throw std::runtime_error(why);
    auto all = torch::from_blob(shm.my_part(*block), {kBig + kSmall + kLast}, torch::kFloat);
    std::vector<torch::Tensor> parts{all.narrow(0, 0, kBig), all.narrow(0, kBig, kSmall),
                                     all.narrow(0, kBig + kSmall, kLast)};
    auto fill = [&] {
      for (std::size_t i = 0; i < parts.size(); ++i)
        parts[i].copy_(rank_data(rank, parts[i].numel(), static_cast<int>(i)));
    };
    const double scale[] = {1.0, 0.5, 0.5};
    if (rank == 0) fill();
    uint64_t seq = 1, last = 0;
    for (std::size_t i = 0; i < parts.size(); ++i) {
      if (rank == 1) {
        std::this_thread::sleep_for(std::chrono::milliseconds(30));
        parts[i].copy_(rank_data(rank, parts[i].numel(), static_cast<int>(i)));
      }
      const uint64_t b = static_cast<uint64_t>(parts[i].numel()) * 4;
      auto ticket = shm.post(parts[i], c10d::ReduceOp::SUM, {"allreduce", seq++, b}, scale[i]);
      if (!ticket) throw std::runtime_error("a tensor in a shared block was not posted");
      if (i == 1) shm.finish(*ticket);  // the first two; the third waits for the barrier
      last = *ticket;
    }
    shm.barrier({"barrier", seq++, 0});
    shm.finish(last);  // finished already: nothing to do
    for (auto& t : parts) posted[static_cast<std::size_t>(rank)].push_back(t.clone());
    fill();
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const uint64_t b = static_cast<uint64_t>(parts[i].numel()) * 4;
      shm.allreduce(parts[i], c10d::ReduceOp::SUM, {"allreduce", seq++, b}, nullptr, scale[i]);
      synchronous[static_cast<std::size_t>(rank)].push_back(parts[i].clone());
    }
    auto priv = torch::zeros({10});
    if (shm.post(priv, c10d::ReduceOp::SUM, {"allreduce", seq++, 40}))
      throw std::runtime_error("a private tensor was posted");
  });
  ASSERT_EQ(errors, std::vector<std::string>(2, ""));
  for (std::size_t i = 0; i < 3; ++i) {
    auto expected = (rank_data(0, posted[0][i].numel(), static_cast<int>(i)) +
                     rank_data(1, posted[0][i].numel(), static_cast<int>(i))) *
                    (i == 0 ? 1.0 : 0.5);
    EXPECT_TRUE(torch::equal(posted[0][i], expected)) << "tensor " << i;
    EXPECT_TRUE(torch::equal(posted[1][i], expected)) << "tensor " << i;
    EXPECT_TRUE(torch::equal(posted[0][i], synchronous[0][i])) << "tensor " << i;
    EXPECT_TRUE(torch::equal(posted[1][i], synchronous[1][i])) << "tensor " << i;
  }
}

// 150 posts outstanding on each rank, more than the ring of records and counters holds: the
// oldest are finished as new ones are posted, and every result is right.
TEST(ShmGroup, MorePostsThanTheRingHoldsFinishInOrder) {
  constexpr int kPosts = 150, kEach = 100;
  std::vector<torch::Tensor> results(2);
  auto errors = on_two_ranks(std::chrono::seconds(30), [&](int rank, ShmGroup& shm) {
    std::string why;
    auto block = shm.share(kPosts * kEach * 8, {"share", 0, kPosts * kEach * 8}, &why);
    if (!block) throw std::runtime_error(why);
    auto all = torch::from_blob(shm.my_part(*block), {kPosts * kEach}, torch::kLong);
    all.copy_(torch::arange(kPosts * kEach, torch::kLong) * (rank + 1));
    uint64_t last = 0;
    for (int i = 0; i < kPosts; ++i) {
      auto t = all.narrow(0, i * kEach, kEach);
      if (rank == 1 && i % 40 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      auto ticket =
          shm.post(t, c10d::ReduceOp::SUM, {"allreduce", static_cast<uint64_t>(i + 1), 800});
      if (!ticket) throw std::runtime_error("a tensor in a shared block was not posted");
      last = *ticket;
    }
    shm.finish(last);
    results[static_cast<std::size_t>(rank)] = all.clone();
  });
  ASSERT_EQ(errors, std::vector<std::string>(2, ""));
  auto expected = torch::arange(kPosts * kEach, torch::kLong) * 3;
  EXPECT_TRUE(torch::equal(results[0], expected));
  EXPECT_TRUE(torch::equal(results[1], expected));
}

// One rank posts an all-reduce while the other waits in a barrier: both fail at once (not at the
// 60 s timeout), each naming the other's collective and its own.
TEST(ShmGroup, APostAgainstAnotherCollectiveFailsAtOnceNamingBoth) {
  const auto start = std::chrono::steady_clock::now();
  auto errors = on_two_ranks(std::chrono::seconds(60), [&](int rank, ShmGroup& shm) {
    std::string why;
    auto block = shm.share(4096, {"share", 0, 4096}, &why);
    if (!block) throw std::runtime_error(why);
    auto t = torch::from_blob(shm.my_part(*block), {1024}, torch::kFloat);
    if (rank == 0) {
      auto ticket = shm.post(t, c10d::ReduceOp::SUM, {"allreduce", 1, 4096});
      if (!ticket) throw std::runtime_error("a tensor in a shared block was not posted");
      shm.finish(*ticket);
    } else {
      shm.barrier({"barrier", 1, 0});
    }
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  EXPECT_NE(errors[0].find("mismatched collectives: rank 1 called barrier #1"), std::string::npos)
      << errors[0];
  EXPECT_NE(errors[0].find("while this rank called allreduce #1 (4096 bytes)"), std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("mismatched collectives: rank 0 called allreduce #1 (4096 bytes)"),
            std::string::npos)
      << errors[1];
  EXPECT_NE(errors[1].find("while this rank called barrier #1"), std::string::npos) << errors[1];
}

// A rank that never posts: the first finish fails at the timeout, naming it; the next finish, a
// post and a barrier then fail at once with that cause, instead of waiting out the timeout each.
TEST(ShmGroup, AfterAPostFailsEveryLaterCallFailsAtOnceWithItsCause) {
  std::vector<std::string> later;
  std::chrono::steady_clock::duration after{};
  auto errors = on_two_ranks(std::chrono::milliseconds(500), [&](int rank, ShmGroup& shm) {
    std::string why;
    auto block = shm.share(8192, {"share", 0, 8192}, &why);
    if (!block) throw std::runtime_error(why);
    if (rank == 1) {  // stays, mapped and silent, past rank 0's timeout
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      return;
    }
    auto all = torch::from_blob(shm.my_part(*block), {2048}, torch::kFloat);
    auto low = all.narrow(0, 0, 1024), high = all.narrow(0, 1024, 1024);
    auto first = shm.post(low, c10d::ReduceOp::SUM, {"allreduce", 1, 4096});
    auto second = shm.post(high, c10d::ReduceOp::SUM, {"allreduce", 2, 4096});
    if (!first || !second) throw std::runtime_error("a tensor in a shared block was not posted");
    try {
      shm.finish(*first);
      later.push_back("the first finish returned");
    } catch (const std::exception& e) {
      later.push_back(e.what());
    }
    const auto start = std::chrono::steady_clock::now();
    for (auto call : {0, 1, 2}) {
      try {
        if (call == 0) shm.finish(*second);
        if (call == 1) shm.post(low, c10d::ReduceOp::SUM, {"allreduce", 3, 4096});
        if (call == 2) shm.barrier({"barrier", 4, 0});
        later.push_back("call " + std::to_string(call) + " returned");
      } catch (const std::exception& e) {
        later.push_back(e.what());
      }
    }
    after = std::chrono::steady_clock::now() - start;
  });
  ASSERT_EQ(errors, std::vector<std::string>(2, ""));
  ASSERT_EQ(later.size(), 4u);
  EXPECT_EQ(
      later[0],
      "allreduce #1 (4096 bytes): local rank 1 did not reach this collective in shared memory");
  for (std::size_t i = 1; i < 4; ++i) {
    EXPECT_EQ(later[i], "an earlier all-reduce in shared memory failed: " + later[0]) << i;
  }
  EXPECT_LT(after, std::chrono::milliseconds(250)) << "the later calls waited";
}

}  // namespace
}  // namespace accel

// Kept large blocks for CPU tensors: which kept block serves an allocation, what bounds the kept
// memory, when blocks go back to the kernel; and libtorch's tensors through the installed
// allocator, which fault their pages in once instead of at every step.
#include "runtime/large_blocks.h"

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace accel {
namespace {

using large_blocks::Cache;
using large_blocks::kGranule;
using large_blocks::Stats;

constexpr std::size_t kMiB = std::size_t{1} << 20;

// Blocks that are distinct addresses of no memory (nothing is written to them), a clock the test
// moves, maps that fail when told to, and what was mapped and unmapped. Thread-safe, as the cache
// maps and unmaps outside its lock.
class FakePages final : public large_blocks::Pages {
 public:
  void* map(std::size_t bytes) override {
    std::lock_guard<std::mutex> lock(m_);
    if (fail_maps > 0) {
      --fail_maps;
      return nullptr;
    }
    auto token = std::make_unique<char>();
    void* p = token.get();
    tokens_.push_back(std::move(token));
    mapped[p] = bytes;
    return p;
  }
  void unmap(void* data, std::size_t bytes) override {
    std::lock_guard<std::mutex> lock(m_);
    auto it = mapped.find(data);
    ASSERT_NE(it, mapped.end()) << "unmapped a block never mapped";
    EXPECT_EQ(it->second, bytes) << "unmapped with another size than it was mapped with";
    mapped.erase(it);
    ++unmaps;
  }
  large_blocks::Clock::time_point now() const override { return clock; }

  std::map<void*, std::size_t> mapped;  // what is mapped now
  int unmaps = 0;
  int fail_maps = 0;
  large_blocks::Clock::time_point clock{};

 private:
  std::mutex m_;
  std::vector<std::unique_ptr<char>> tokens_;
};

struct Taken {
  void* data;
  std::size_t size;
};

Taken take(Cache& cache, std::size_t bytes) {
  Taken t{nullptr, 0};
  t.data = cache.take(bytes, &t.size);
  return t;
}

// Two blocks of `bytes` taken, then freed, the first first: both kept.
std::pair<Taken, Taken> two_kept(Cache& cache, std::size_t bytes) {
  auto a = take(cache, bytes);
  auto b = take(cache, bytes);
  EXPECT_TRUE(cache.give_back(a.data));
  EXPECT_TRUE(cache.give_back(b.data));
  return {a, b};
}

TEST(LargeBlocks, AFreedBlockServesTheNextAllocationOfItsSize) {
  FakePages pages;
  Cache cache(pages);
  auto a = take(cache, 40 * kMiB);
  ASSERT_NE(a.data, nullptr);
  EXPECT_EQ(a.size, 40 * kMiB);
  EXPECT_TRUE(cache.give_back(a.data));
  auto b = take(cache, 40 * kMiB);
  EXPECT_EQ(b.data, a.data);
  EXPECT_EQ(pages.mapped.size(), 1u);
  EXPECT_EQ(pages.unmaps, 0);
  const Stats s = cache.stats();
  EXPECT_EQ(s.made, 1u);
  EXPECT_EQ(s.reused, 1u);
  EXPECT_EQ(s.live_bytes, 40 * kMiB);
  EXPECT_EQ(s.kept_bytes, 0u);
}

TEST(LargeBlocks, OnlyALiveBlockOfTheCacheIsTakenBack) {
  FakePages pages;
  Cache cache(pages);
  auto a = take(cache, 40 * kMiB);
  int elsewhere = 0;
  EXPECT_FALSE(cache.give_back(&elsewhere));
  EXPECT_TRUE(cache.give_back(a.data));
  EXPECT_FALSE(cache.give_back(a.data));  // kept now, not live
  EXPECT_EQ(cache.stats().kept_bytes, 40 * kMiB);
  EXPECT_EQ(cache.stats().live_bytes, 0u);
}

TEST(LargeBlocks, SizesRoundUpAndAKeptBlockServesOnlyWhatWastesAQuarterAtMost) {
  FakePages pages;
  Cache cache(pages);
  auto odd = take(cache, 33 * kMiB + 1);
  EXPECT_EQ(odd.size, 34 * kMiB);
  auto mid = take(cache, 40 * kMiB);
  auto big = take(cache, 128 * kMiB);
  for (auto t : {odd, mid, big}) EXPECT_TRUE(cache.give_back(t.data));
  // 36 MiB: the 40 fits (4 MiB wasted, at most 9 allowed), the 34 is too small, the 128 wastes
  // too much; the smallest that fits wins.
  auto a = take(cache, 36 * kMiB);
  EXPECT_EQ(a.data, mid.data);
  EXPECT_EQ(a.size, 40 * kMiB);
  // 34 MiB, exactly a kept block's size.
  auto b = take(cache, 34 * kMiB);
  EXPECT_EQ(b.data, odd.data);
  // 64 MiB: nothing kept fits (the 128 would waste half), so a new block.
  auto c = take(cache, 64 * kMiB);
  EXPECT_NE(c.data, big.data);
  EXPECT_EQ(c.size, 64 * kMiB);
  EXPECT_EQ(cache.stats().made, 4u);
  EXPECT_EQ(cache.stats().reused, 2u);
}

TEST(LargeBlocks, OfEqualBlocksTheMostRecentlyFreedServes) {
  FakePages pages;
  Cache cache(pages);
  auto [a, b] = two_kept(cache, 48 * kMiB);
  EXPECT_EQ(take(cache, 48 * kMiB).data, b.data);
  EXPECT_EQ(take(cache, 48 * kMiB).data, a.data);
}

TEST(LargeBlocks, KeptAndLiveBlocksStayWithinTheMostLiveAtOnce) {
  FakePages pages;
  Cache cache(pages);
  auto a = take(cache, 64 * kMiB);
  auto b = take(cache, 64 * kMiB);
  EXPECT_EQ(cache.stats().peak_live_bytes, 128 * kMiB);
  EXPECT_TRUE(cache.give_back(a.data));
  EXPECT_TRUE(cache.give_back(b.data));
  EXPECT_EQ(cache.stats().kept_bytes, 128 * kMiB);
  // 36 MiB fits neither (a 64 would waste 28): with a new 36, 164 MiB would be held against a
  // peak of 128, so the oldest kept block (a) goes back to the kernel and b stays.
  auto c = take(cache, 36 * kMiB);
  EXPECT_EQ(pages.unmaps, 1);
  EXPECT_FALSE(pages.mapped.contains(a.data));
  EXPECT_TRUE(pages.mapped.contains(b.data));
  Stats s = cache.stats();
  EXPECT_EQ(s.live_bytes, 36 * kMiB);
  EXPECT_EQ(s.kept_bytes, 64 * kMiB);
  EXPECT_LE(s.live_bytes + s.kept_bytes, s.peak_live_bytes);
  EXPECT_EQ(s.handed_back, 1u);
  // Beyond the peak, nothing kept is left: 200 MiB live is the new peak.
  auto d = take(cache, 164 * kMiB);
  s = cache.stats();
  EXPECT_EQ(s.kept_bytes, 0u);
  EXPECT_EQ(s.live_bytes, 200 * kMiB);
  EXPECT_EQ(s.peak_live_bytes, 200 * kMiB);
  EXPECT_EQ(pages.mapped.size(), 2u);
  for (auto t : {c, d}) EXPECT_TRUE(cache.give_back(t.data));
}

TEST(LargeBlocks, ABlockKeptForTheIdleLimitWithoutReuseGoesBack) {
  using std::chrono::seconds;
  FakePages pages;
  Cache cache(pages);
  auto a = take(cache, 40 * kMiB);
  auto b = take(cache, 64 * kMiB);
  auto c = take(cache, 100 * kMiB);
  EXPECT_TRUE(cache.give_back(a.data));
  pages.clock += large_blocks::kIdleLimit - seconds(1);
  EXPECT_TRUE(cache.give_back(c.data));
  cache.release_idle();  // a kept for less than the limit
  EXPECT_EQ(pages.unmaps, 0);
  // c reused and freed again: its wait starts again. Blocks made or reused meanwhile do not keep
  // a, which no later tensor fits.
  auto again = take(cache, 100 * kMiB);
  EXPECT_EQ(again.data, c.data);
  EXPECT_TRUE(cache.give_back(again.data));
  pages.clock += seconds(1);
  cache.release_idle();
  EXPECT_EQ(pages.unmaps, 1);
  EXPECT_FALSE(pages.mapped.contains(a.data));
  EXPECT_EQ(cache.stats().kept_bytes, 100 * kMiB);
  EXPECT_EQ(cache.stats().handed_back, 1u);
  EXPECT_TRUE(cache.give_back(b.data));  // live for a whole limit: its wait starts now
  pages.clock += large_blocks::kIdleLimit - seconds(1);
  cache.release_idle();  // c kept for the limit, b for 1 s less
  EXPECT_EQ(pages.unmaps, 2);
  EXPECT_TRUE(pages.mapped.contains(b.data));
  pages.clock += seconds(1);
  cache.release_idle();
  EXPECT_EQ(pages.unmaps, 3);
  EXPECT_EQ(cache.stats().kept_bytes, 0u);
  EXPECT_TRUE(pages.mapped.empty());
}

TEST(LargeBlocks, WhenMemoryIsShortKeptBlocksGoBackBeforeTheAllocationFails) {
  FakePages pages;
  Cache cache(pages);
  (void)two_kept(cache, 64 * kMiB);
  // The bound hands a back (36 + 128 > 128); the first map fails, so b goes back too, and the
  // second map gives the block.
  pages.fail_maps = 1;
  auto c = take(cache, 36 * kMiB);
  ASSERT_NE(c.data, nullptr);
  EXPECT_EQ(pages.unmaps, 2);
  EXPECT_EQ(pages.mapped.size(), 1u);
  EXPECT_EQ(cache.stats().kept_bytes, 0u);
  // No memory at all: nullptr, and nothing counted live for it.
  pages.fail_maps = 2;
  auto d = take(cache, 40 * kMiB);
  EXPECT_EQ(d.data, nullptr);
  EXPECT_EQ(cache.stats().live_bytes, 36 * kMiB);
  EXPECT_TRUE(cache.give_back(c.data));
}

TEST(LargeBlocks, ThreadsTakingAndGivingBackKeepTheCountsTrue) {
  FakePages pages;
  Cache cache(pages);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&cache, t] {
      std::mt19937 rng(static_cast<unsigned>(t));
      std::vector<Taken> held;
      for (int i = 0; i < 2000; ++i) {
        if (held.size() < 3 && rng() % 2 == 0) {
          held.push_back(take(cache, (32 + rng() % 64) * kMiB));
          ASSERT_NE(held.back().data, nullptr);
        } else if (!held.empty()) {
          EXPECT_TRUE(cache.give_back(held.back().data));
          held.pop_back();
        }
      }
      for (auto h : held) EXPECT_TRUE(cache.give_back(h.data));
    });
  }
  for (auto& t : threads) t.join();
  const Stats s = cache.stats();
  EXPECT_EQ(s.live_bytes, 0u);
  std::size_t mapped = 0;
  for (const auto& [p, bytes] : pages.mapped) mapped += bytes;
  EXPECT_EQ(s.kept_bytes, mapped);
  EXPECT_LE(s.kept_bytes, s.peak_live_bytes);
  EXPECT_EQ(s.made, pages.mapped.size() + static_cast<std::size_t>(pages.unmaps));
  EXPECT_EQ(s.handed_back, static_cast<std::uint64_t>(pages.unmaps));
  EXPECT_GT(s.reused, 0u);
}

// Through libtorch: a tensor of 40 MiB freed and made again gets the same block, whose pages were
// faulted in once; small tensors go to libtorch's own allocator.
TEST(LargeBlocks, LibtorchsLargeTensorsReuseTheirBlocks) {
  const auto& outcome = large_blocks::keep_large_blocks();
  if (!outcome.applied) GTEST_SKIP() << large_blocks::describe(outcome);
  const Stats before = large_blocks::installed_stats();
  auto make = [] {
    auto t = torch::empty({40 * static_cast<int64_t>(kMiB)}, torch::kUInt8);
    std::memset(t.data_ptr(), 1, 40 * kMiB);
    return t;
  };
  auto first = make();
  void* where = first.data_ptr();
  first.reset();
  rusage r0{}, r1{};
  ::getrusage(RUSAGE_SELF, &r0);
  auto second = make();
  ::getrusage(RUSAGE_SELF, &r1);
  EXPECT_EQ(second.data_ptr(), where);
  // 10,240 pages of 4 KiB if the block were new; a few for anything else the process touched.
  EXPECT_LT(r1.ru_minflt - r0.ru_minflt, 500);
  const Stats after = large_blocks::installed_stats();
  EXPECT_GE(after.reused, before.reused + 1);
  auto small = torch::ones({1024});
  EXPECT_EQ(large_blocks::installed_stats().live_bytes, after.live_bytes);
  EXPECT_EQ(small.sum().item<float>(), 1024.0f);
}

// Some kernels (oneDNN's, under bf16 autocast) allocate raw pointers through libtorch's CPU
// allocator and free them through its raw deleter alone: one function for large and small.
TEST(LargeBlocks, RawPointersOfEitherSizeGoBackThroughTheRawDeleter) {
  const auto& outcome = large_blocks::keep_large_blocks();
  if (!outcome.applied) GTEST_SKIP() << large_blocks::describe(outcome);
  c10::Allocator* allocator = c10::GetCPUAllocator();
  ASSERT_NE(allocator->raw_deleter(), nullptr);
  const Stats before = large_blocks::installed_stats();
  void* large = allocator->raw_allocate(40 * kMiB);
  void* small = allocator->raw_allocate(4096);
  std::memset(large, 1, 40 * kMiB);
  std::memset(small, 1, 4096);
  EXPECT_EQ(large_blocks::installed_stats().live_bytes, before.live_bytes + 40 * kMiB);
  allocator->raw_deallocate(small);
  allocator->raw_deallocate(large);
  const Stats after = large_blocks::installed_stats();
  EXPECT_EQ(after.live_bytes, before.live_bytes);
  EXPECT_GE(after.kept_bytes, 40 * kMiB);  // kept for the next large tensor
}

// A process that forks while another thread makes and frees large tensors: its child makes one
// too, which hangs if the child inherits the cache's lock held by a thread it does not have.
TEST(LargeBlocks, AChildForkedWhileAnotherThreadAllocatesCanAllocate) {
  const auto& outcome = large_blocks::keep_large_blocks();
  if (!outcome.applied) GTEST_SKIP() << large_blocks::describe(outcome);
  // Why first, on this thread: the first call of an op sets up what it dispatches to once, and a
  // fork during that in another thread would hang the child for a reason not this test's.
  (void)torch::empty({40 * static_cast<int64_t>(kMiB)}, torch::kUInt8);
  std::atomic<bool> stop{false};
  std::thread churn([&stop] {
    while (!stop.load()) (void)torch::empty({40 * static_cast<int64_t>(kMiB)}, torch::kUInt8);
  });
  int hung = 0, failed = 0;
  for (int i = 0; i < 20; ++i) {
    const pid_t child = ::fork();
    if (child == 0) {
      auto t = torch::empty({40 * static_cast<int64_t>(kMiB)}, torch::kUInt8);
      ::_exit(t.defined() ? 0 : 1);
    }
    if (child < 0) {
      ADD_FAILURE() << "fork failed: " << std::strerror(errno);
      break;
    }
    int status = 0;
    pid_t done = 0;
    for (int waited = 0; waited < 500 && done == 0; ++waited) {
      done = ::waitpid(child, &status, WNOHANG);
      if (done == 0) ::usleep(10000);
    }
    if (done == 0) {
      ++hung;
      ::kill(child, SIGKILL);
      ::waitpid(child, &status, 0);
    } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      ++failed;
    }
  }
  stop = true;
  churn.join();
  EXPECT_EQ(hung, 0) << "children that did not end within 5 s";
  EXPECT_EQ(failed, 0);
}

TEST(LargeBlocks, AnAllocationNoMemoryCanHoldSaysHowMuch) {
  const auto& outcome = large_blocks::keep_large_blocks();
  if (!outcome.applied) GTEST_SKIP() << large_blocks::describe(outcome);
  try {
    (void)torch::empty({int64_t{1} << 50}, torch::kUInt8);
    FAIL() << "an allocation of 1 PiB succeeded";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("accel: not enough memory: you tried to allocate "
                                         "1125899906842624 bytes"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace accel

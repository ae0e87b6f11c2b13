// SnapshotCopies: what a background save copies, into which buffers, and when a step may go on.
#include "runtime/checkpoint_snapshot.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <torch/torch.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

namespace accel::ckpt {
namespace {

using namespace std::chrono_literals;

// wait() returns only once copy() has made every copy, and the buffers then hold the values the
// live tensors had when copied (a strided view included), not whatever came after.
TEST(SnapshotCopies, WaitReturnsOnlyOnceTheWriterHasCopied) {
  SnapshotCopies copies;
  auto weight = torch::arange(12, torch::kFloat).reshape({3, 4});
  auto strided = torch::arange(20, torch::kDouble).reshape({4, 5}).t();  // not contiguous
  copies.begin();
  auto a = copies.defer(weight);
  auto b = copies.defer(strided);
  EXPECT_TRUE(a.is_contiguous());
  EXPECT_EQ(a.scalar_type(), torch::kFloat);
  EXPECT_EQ(b.sizes(), strided.sizes());
  copies.start();
  std::atomic<bool> copied{false};
  std::thread writer([&] {
    std::this_thread::sleep_for(50ms);
    copies.copy();
    copied = true;
  });
  copies.wait();
  // Why not EXPECT_TRUE(copied) alone: the flag is set just after copy() returns; the values are
  // what wait() promises.
  EXPECT_TRUE(torch::equal(a, weight));
  EXPECT_TRUE(torch::equal(b, strided));
  writer.join();
  EXPECT_TRUE(copied);
  weight.add_(1);  // the live tensor is the program's again: the copy keeps the old values
  EXPECT_FALSE(torch::equal(a, weight));
  copies.wait();  // nothing pending: at once
}

// hold(): a writer that reads the live state itself (an in-memory snapshot) queues nothing, yet
// the step must wait until it says it is done (copy()) or gives up (abandon()); and the buffers
// an earlier background save kept stay kept.
TEST(SnapshotCopies, HoldBlocksTheStepWithNothingQueuedUntilTheWriterIsDone) {
  SnapshotCopies copies;
  auto x = torch::ones({64});
  copies.begin();
  auto kept = copies.defer(x);
  copies.start();
  copies.copy();
  const void* kept_at = kept.data_ptr();
  kept = torch::Tensor();  // the program does not hold it: reusable
  for (bool give_up : {false, true}) {
    copies.begin();
    copies.hold();
    std::atomic<bool> done{false};
    std::thread writer([&] {
      std::this_thread::sleep_for(50ms);
      done = true;
      give_up ? copies.abandon() : copies.copy();
    });
    copies.wait();
    EXPECT_TRUE(done) << "the step went on before the writer was done";
    writer.join();
  }
  copies.begin();
  EXPECT_EQ(copies.defer(x).data_ptr(), kept_at) << "hold() dropped the kept buffers";
  copies.start();
  copies.copy();
}

// The second save copies into the first one's buffers (already mapped), unless the program still
// holds one (then a fresh one), or the shape or dtype changed.
TEST(SnapshotCopies, BuffersAreReusedFromOneSaveToTheNext) {
  SnapshotCopies copies;
  auto x = torch::ones({256});
  auto y = torch::ones({16});
  auto save = [&](const torch::Tensor& first, const torch::Tensor& second) {
    copies.begin();
    auto a = copies.defer(first);
    auto b = copies.defer(second);
    copies.start();
    copies.copy();
    copies.wait();
    return std::pair{a.data_ptr(), b.data_ptr()};
  };
  auto [a1, b1] = save(x, y);
  auto [a2, b2] = save(x, y);
  EXPECT_EQ(a1, a2);
  EXPECT_EQ(b1, b2);
  copies.begin();
  auto held = copies.defer(x);  // the program keeps this one
  copies.start();
  copies.copy();
  // Why no address comparison for the new shape: a freed buffer's memory may come back.
  copies.begin();
  auto a3 = copies.defer(x);
  auto b3 = copies.defer(torch::ones({17}));
  copies.start();
  copies.copy();
  EXPECT_NE(a3.data_ptr(), held.data_ptr());
  EXPECT_EQ(b3.numel(), 17);
  EXPECT_TRUE(torch::equal(b3, torch::ones({17})));
  EXPECT_TRUE(torch::equal(held, x));
}

// A save that fails before its writer starts lets a step go on at once.
// How many of the pages of `t`'s memory are resident (mincore), and how many it spans.
std::pair<std::size_t, std::size_t> resident_pages(const torch::Tensor& t) {
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  auto start = reinterpret_cast<std::uintptr_t>(t.data_ptr()) / page * page;
  auto end = reinterpret_cast<std::uintptr_t>(t.data_ptr()) + t.nbytes();
  std::vector<unsigned char> in((end - start + page - 1) / page);
  if (::mincore(reinterpret_cast<void*>(start), end - start, in.data()) != 0) return {0, in.size()};
  std::size_t n = 0;
  for (unsigned char c : in) n += c & 1;
  return {n, in.size()};
}

// prefault(): the buffers a save of these tensors would use are made and their pages touched on
// a thread of its own (a background save's first copy then goes into memory already mapped);
// the next save reuses exactly those buffers, and its copy is not overwritten by the touching.
TEST(SnapshotCopies, PrefaultTouchesTheBuffersTheFirstSaveThenCopiesInto) {
  SnapshotCopies copies;
  auto live = torch::arange(16 << 20, torch::kFloat);  // 64 MiB: its own mapping, untouched
  copies.begin();
  auto buffer = copies.defer(live);
  const void* at = buffer.data_ptr();
  ASSERT_LT(resident_pages(buffer).first, resident_pages(buffer).second / 2)
      << "a new buffer's pages are not touched yet";
  copies.prefault();
  EXPECT_TRUE(copies.has_buffers());
  auto deadline = std::chrono::steady_clock::now() + 20s;
  while (resident_pages(buffer).first < resident_pages(buffer).second &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(5ms);
  EXPECT_EQ(resident_pages(buffer).first, resident_pages(buffer).second)
      << "prefault() touched every page of the buffer";
  buffer = torch::Tensor();  // the program does not hold it: reusable
  copies.begin();
  auto again = copies.defer(live);
  EXPECT_EQ(again.data_ptr(), at) << "the first save copies into the prefaulted buffer";
  copies.start();
  copies.copy();
  copies.wait();
  EXPECT_TRUE(torch::equal(again, live));
  copies.release();
  EXPECT_FALSE(copies.has_buffers());
}

// A save right after prefault() whose tensors no longer fit the buffers (another shape, fewer
// tensors) drops them while the thread may still be touching them: the thread keeps their memory
// alive itself, and the save's own copies are right.
TEST(SnapshotCopies, ASaveThatDropsPrefaultedBuffersWhileTheyAreTouchedIsSafe) {
  for (int round = 0; round < 3; ++round) {
    SnapshotCopies copies;
    copies.begin();
    (void)copies.defer(torch::zeros({8 << 20}));  // 32 MiB each
    (void)copies.defer(torch::zeros({8 << 20}));
    copies.prefault();
    copies.begin();  // at once: the touching has most of its pages still to go
    auto other = torch::arange(1000, torch::kFloat);
    auto copy = copies.defer(other);
    copies.start();  // drops the second buffer; the first was replaced in defer()
    copies.copy();
    copies.wait();
    EXPECT_TRUE(torch::equal(copy, other));
    copies.release();
  }
}

// A save that fails before its writer starts lets a step go on at once.
TEST(SnapshotCopies, AnAbandonedSaveDoesNotBlockTheStep) {
  SnapshotCopies copies;
  copies.begin();
  copies.defer(torch::ones({4}));
  copies.start();
  copies.abandon();
  copies.wait();
  copies.release();
  SUCCEED();
}

// A copy that throws (here from the test hook) still lets the step go on.
TEST(SnapshotCopies, ACopyThatThrowsStillReleasesTheStep) {
  SnapshotCopies copies;
  copies.begin();
  copies.defer(torch::ones({4}));
  copies.start();
  set_copy_hook_for_testing([] { throw std::runtime_error("no memory"); });
  std::thread writer([&] { EXPECT_THROW(copies.copy(), std::runtime_error); });
  copies.wait();
  writer.join();
  set_copy_hook_for_testing(nullptr);
}

}  // namespace
}  // namespace accel::ckpt

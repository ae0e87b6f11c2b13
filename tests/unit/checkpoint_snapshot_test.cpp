// SnapshotCopies: what a background save copies, into which buffers, and when a step may go on.
#include "runtime/checkpoint_snapshot.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <thread>

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

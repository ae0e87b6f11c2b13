// SnapshotCopies: what a background save copies, into which memory laid out as which file, and
// when a step may go on.
#include "runtime/checkpoint_snapshot.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <torch/torch.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <future>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "runtime/yielding.h"

namespace accel::ckpt {
namespace {

using namespace std::chrono_literals;

// A file defer_file() laid out, read back as a reader of the format reads it (its tensors are
// views of the file's bytes), after checking that the file's data starts on a page.
safetensors::Decoded read_back(const safetensors::Encoded& file) {
  auto parts = file.parts();
  std::string_view bytes = parts.back();
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(bytes.data()) % 4096, 0u)
      << "the file is page-aligned";
  uint64_t header = 0;
  std::memcpy(&header, bytes.data(), 8);
  EXPECT_EQ((8 + header) % 4096, 0u) << "the tensors' bytes start on a page";
  EXPECT_EQ(file.size(), bytes.size());
  return safetensors::decode(bytes, "test", safetensors::Memory::kBorrow);
}

// A file of one tensor, copied later.
safetensors::Encoded later(SnapshotCopies& copies, const torch::Tensor& live) {
  return copies.defer_file({{"t", live}}, {true}, {}, "test");
}

const void* address(const safetensors::Encoded& file) { return file.parts().back().data(); }

// wait() returns only once copy() has made every copy; the file then holds the values the live
// tensors had when copied (a strided view included), not whatever came after, and the tensors
// copied at once hold the values they had then.
TEST(SnapshotCopies, WaitReturnsOnlyOnceTheWriterHasCopied) {
  SnapshotCopies copies;
  auto weight = torch::arange(12, torch::kFloat).reshape({3, 4});
  auto strided = torch::arange(20, torch::kDouble).reshape({4, 5}).t();  // not contiguous
  auto now = torch::arange(3, torch::kLong);
  // Copied now too: strided, at a place aligned for its dtype, and after 3 bf16 values (6 bytes,
  // so the floats' place in the file is not aligned for them).
  auto half = torch::ones({3}, torch::kBFloat16);
  auto strided_now = torch::arange(6, torch::kFloat).reshape({2, 3}).t();
  // And a 0-dim tensor (an optimizer's step count) and an empty one, each way.
  auto step = torch::tensor(int64_t{5});
  auto empty = torch::zeros({0, 3});
  copies.begin();
  auto file = copies.defer_file({{"w", weight},
                                 {"s", strided},
                                 {"n", now},
                                 {"a", strided_now},
                                 {"h", half},
                                 {"u", strided_now},
                                 {"step_later", step},
                                 {"step_now", step},
                                 {"empty_later", empty},
                                 {"empty_now", empty}},
                                {true, true, false, false, false, false, true, false, true, false},
                                {{"format", "pt"}}, "test");
  now.add_(10);  // copied already: the file keeps 0, 1, 2
  strided_now.add_(10);
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
  auto decoded = read_back(file);
  ASSERT_EQ(decoded.tensors.size(), 10u);
  EXPECT_EQ(decoded.metadata, (std::map<std::string, std::string>{{"format", "pt"}}));
  EXPECT_EQ(decoded.tensors[0].first, "w");
  EXPECT_TRUE(torch::equal(decoded.tensors[0].second, weight));
  EXPECT_TRUE(torch::equal(decoded.tensors[1].second, strided));
  EXPECT_TRUE(torch::equal(decoded.tensors[2].second, torch::arange(3, torch::kLong)));
  const auto old_strided = torch::arange(6, torch::kFloat).reshape({2, 3}).t();
  EXPECT_TRUE(torch::equal(decoded.tensors[3].second, old_strided));
  EXPECT_TRUE(torch::equal(decoded.tensors[4].second, half));
  EXPECT_EQ(decoded.tensors[5].first, "u");
  EXPECT_TRUE(torch::equal(decoded.tensors[5].second, old_strided));
  // Zero-byte tensors share their offset with the next: by name, not by place.
  std::map<std::string, torch::Tensor> by_name(decoded.tensors.begin(), decoded.tensors.end());
  for (const char* name : {"step_later", "step_now"}) {
    EXPECT_EQ(by_name.at(name).dim(), 0) << name;
    EXPECT_EQ(by_name.at(name).item<int64_t>(), 5) << name;
  }
  for (const char* name : {"empty_later", "empty_now"})
    EXPECT_EQ(by_name.at(name).sizes(), empty.sizes()) << name;
  writer.join();
  EXPECT_TRUE(copied);
  weight.add_(1);  // the live tensor is the program's again: the copy keeps the old values
  EXPECT_FALSE(torch::equal(read_back(file).tensors[0].second, weight));
  copies.wait();  // nothing pending: at once
  EXPECT_THROW(copies.defer_file({{"t", weight}}, {}, {}, "test"), std::invalid_argument);
}

// hold(): a writer that reads the live state itself (an in-memory snapshot) queues nothing, yet
// the step must wait until it says it is done (copy()) or gives up (abandon()); and the blocks
// an earlier background save kept stay kept.
TEST(SnapshotCopies, HoldBlocksTheStepWithNothingQueuedUntilTheWriterIsDone) {
  SnapshotCopies copies;
  auto x = torch::ones({64});
  copies.begin();
  auto kept = later(copies, x);
  copies.start();
  copies.copy();
  const void* kept_at = address(kept);
  kept = safetensors::Encoded();  // the program does not hold it: reusable
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
  EXPECT_EQ(address(later(copies, x)), kept_at) << "hold() dropped the kept blocks";
  copies.start();
  copies.copy();
}

// The second save copies into the first one's blocks (already mapped), also when its header grew
// (a longer learning rate in the metadata), unless the program still holds the file (then a
// fresh block), or the file no longer fits.
TEST(SnapshotCopies, BlocksAreReusedFromOneSaveToTheNext) {
  SnapshotCopies copies;
  auto x = torch::ones({256});
  auto y = torch::ones({16});
  auto save = [&](const torch::Tensor& first, const torch::Tensor& second,
                  const std::string& lr = "0.001") {
    copies.begin();
    auto a = copies.defer_file({{"x", first}}, {true}, {{"lr", lr}}, "test");
    auto b = later(copies, second);
    copies.start();
    copies.copy();
    copies.wait();
    return std::pair{a, b};
  };
  const void* a1 = nullptr;
  const void* b1 = nullptr;
  {
    auto [a, b] = save(x, y);
    a1 = address(a);
    b1 = address(b);
  }
  {
    // A learning rate just long enough to push the header onto a second page.
    std::string lr = "0.001";
    while (safetensors::encode_header({{"x", x}}, {{"lr", lr}}, "test", 4096).size() == 4096)
      lr += '9';
    auto [a, b] = save(x, y, lr);
    EXPECT_EQ(address(a), a1) << "a header grown by up to a page needs no new block";
    EXPECT_EQ(address(b), b1);
    EXPECT_EQ(read_back(a).metadata.at("lr"), lr);
    EXPECT_TRUE(torch::equal(read_back(a).tensors[0].second, x));
  }
  auto [held, unused] = save(x, y);  // the program keeps the first file
  // Why no address comparison for the larger file: a freed block's memory may come back.
  auto [a3, b3] = save(x, torch::ones({100000}));
  EXPECT_NE(address(a3), address(held));
  EXPECT_TRUE(torch::equal(read_back(b3).tensors[0].second, torch::ones({100000})));
  EXPECT_TRUE(torch::equal(read_back(held).tensors[0].second, x));
}

// How many of the pages of a file's memory are resident (mincore), and how many it spans.
std::pair<std::size_t, std::size_t> resident_pages(const safetensors::Encoded& file) {
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  auto start = reinterpret_cast<std::uintptr_t>(address(file)) / page * page;
  auto end = reinterpret_cast<std::uintptr_t>(address(file)) + file.size();
  std::vector<unsigned char> in((end - start + page - 1) / page);
  if (::mincore(reinterpret_cast<void*>(start), end - start, in.data()) != 0) return {0, in.size()};
  std::size_t n = 0;
  for (unsigned char c : in) n += c & 1;
  return {n, in.size()};
}

// prefault(): the blocks a save of these tensors would use are made and their pages touched on a
// thread of its own (a background save's first copy then goes into memory already mapped); the
// next save reuses exactly those blocks, and its copy is not overwritten by the touching.
TEST(SnapshotCopies, PrefaultTouchesTheBlocksTheFirstSaveThenCopiesInto) {
  SnapshotCopies copies;
  auto live = torch::arange(16 << 20, torch::kFloat);  // 64 MiB: its own mapping, untouched
  copies.begin();
  auto file = later(copies, live);
  const void* at = address(file);
  ASSERT_LT(resident_pages(file).first, resident_pages(file).second / 2)
      << "a new block's pages are not touched yet";
  copies.prefault();
  EXPECT_TRUE(copies.has_blocks());
  auto deadline = std::chrono::steady_clock::now() + 20s;
  while (resident_pages(file).first < resident_pages(file).second &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(5ms);
  EXPECT_EQ(resident_pages(file).first, resident_pages(file).second)
      << "prefault() touched every page of the block";
  file = safetensors::Encoded();  // the program does not hold it: reusable
  copies.begin();
  auto again = later(copies, live);
  EXPECT_EQ(address(again), at) << "the first save copies into the prefaulted block";
  copies.start();
  copies.copy();
  copies.wait();
  EXPECT_TRUE(torch::equal(read_back(again).tensors[0].second, live));
  copies.release();
  EXPECT_FALSE(copies.has_blocks());
}

// A save right after prefault() whose files no longer fit the blocks (a larger one, fewer files)
// drops them while the thread may still be touching them: the thread keeps their memory alive
// itself, and neither the save's header, written at once, nor its copies are overwritten.
TEST(SnapshotCopies, ASaveThatDropsPrefaultedBlocksWhileTheyAreTouchedIsSafe) {
  for (int round = 0; round < 3; ++round) {
    SnapshotCopies copies;
    copies.begin();
    (void)later(copies, torch::zeros({8 << 20}));  // 32 MiB each
    (void)later(copies, torch::zeros({8 << 20}));
    copies.prefault();
    copies.begin();  // at once: the touching has most of its pages still to go
    auto other = torch::arange(9 << 20, torch::kFloat);
    auto file = later(copies, other);
    copies.start();  // drops the second block; the first was replaced in defer_file()
    copies.copy();
    copies.wait();
    EXPECT_TRUE(torch::equal(read_back(file).tensors[0].second, other));
    copies.release();
  }
}

// A save into a block the touching thread is still touching: its header (written at once) and
// its copies survive the touching.
TEST(SnapshotCopies, ASaveIntoABlockStillBeingTouchedKeepsItsBytes) {
  for (int round = 0; round < 3; ++round) {
    SnapshotCopies copies;
    auto live = torch::arange(16 << 20, torch::kFloat);
    copies.begin();
    (void)copies.defer_file({{"a", live}, {"b", torch::ones({3})}}, {true, false}, {}, "test");
    copies.prefault();
    copies.begin();
    auto file =
        copies.defer_file({{"a", live}, {"b", torch::full({3}, 7.0)}}, {true, false}, {}, "test");
    copies.start();
    copies.copy();
    copies.wait();
    auto decoded = read_back(file);
    ASSERT_EQ(decoded.tensors.size(), 2u);
    EXPECT_TRUE(torch::equal(decoded.tensors[0].second, live));
    EXPECT_TRUE(torch::equal(decoded.tensors[1].second, torch::full({3}, 7.0)));
    copies.release();
  }
}

// A save right after prefault() copies beside its touching rather than after it (on a VM that
// shadows page tables the touching takes about 0.9 s for 300 MB): here the touching has not
// begun, and the copy still ends, with every byte in place.
TEST(SnapshotCopies, ASaveDoesNotWaitForPrefaultsTouching) {
  SnapshotCopies copies;
  auto a = torch::arange(4 << 20, torch::kFloat), b = torch::arange(3 << 20, torch::kFloat) * 2;
  copies.begin();
  (void)copies.defer_file({{"a", a}, {"b", b}}, {true, true}, {}, "test");
  std::promise<void> go;
  {
    set_touch_hook_for_testing([touch = go.get_future().share()] { touch.wait(); });
    struct Unset {
      ~Unset() { set_touch_hook_for_testing(nullptr); }
    } unset;
    copies.prefault();
  }
  std::future<void> copying;  // Why before release_touching: a failing copy ends once it is let go
  struct Go {
    std::promise<void>* go;
    void now() {
      if (go) go->set_value();
      go = nullptr;
    }
    ~Go() { now(); }  // also when an assertion returns early
  } release_touching{&go};
  copies.begin();
  auto file = copies.defer_file({{"a", a}, {"b", b}}, {true, true}, {}, "test");
  copies.start();
  copying = std::async(std::launch::async, [&copies] { copies.copy(); });
  ASSERT_EQ(copying.wait_for(20s), std::future_status::ready)
      << "the copy waited for prefault()'s touching";
  copying.get();
  copies.wait();
  auto decoded = read_back(file);
  ASSERT_EQ(decoded.tensors.size(), 2u);
  EXPECT_TRUE(torch::equal(decoded.tensors[0].second, a));
  EXPECT_TRUE(torch::equal(decoded.tensors[1].second, b));
  // The touching then goes over every page the copy wrote, and changes none of it.
  release_touching.now();
  copies.release();  // waits for the touching; `file` keeps its block
  decoded = read_back(file);
  ASSERT_EQ(decoded.tensors.size(), 2u);
  EXPECT_TRUE(torch::equal(decoded.tensors[0].second, a));
  EXPECT_TRUE(torch::equal(decoded.tensors[1].second, b));
}

// A save that fails before its writer starts lets a step go on at once.
TEST(SnapshotCopies, AnAbandonedSaveDoesNotBlockTheStep) {
  SnapshotCopies copies;
  copies.begin();
  (void)later(copies, torch::ones({4}));
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
  (void)later(copies, torch::ones({4}));
  copies.start();
  set_copy_hook_for_testing([] { throw std::runtime_error("no memory"); });
  std::thread writer([&] { EXPECT_THROW(copies.copy(), std::runtime_error); });
  copies.wait();
  writer.join();
  set_copy_hook_for_testing(nullptr);
}

// A background save's thread where training fills the CPUs works in pieces of kYieldBytes that
// cover the range once, in order; any other thread (a save training waits for) in one piece.
TEST(YieldingPieces, CoverTheRangeInOrderAndOnlyASavesThreadSplitsIt) {
  auto pieces = [](std::size_t n) {
    std::vector<std::pair<std::size_t, std::size_t>> seen;
    in_yielding_pieces(n, [&](std::size_t at, std::size_t len) { seen.emplace_back(at, len); });
    return seen;
  };
  const std::size_t n = 3 * kYieldBytes + 5;
  EXPECT_EQ(pieces(n), (std::vector<std::pair<std::size_t, std::size_t>>{{0, n}}));
  EXPECT_TRUE(pieces(0).empty());
  std::vector<std::pair<std::size_t, std::size_t>> on_save_thread;
  std::thread([&] {
    yields_between_pieces = true;
    on_save_thread = pieces(n);
  }).join();
  EXPECT_EQ(on_save_thread,
            (std::vector<std::pair<std::size_t, std::size_t>>{{0, kYieldBytes},
                                                              {kYieldBytes, kYieldBytes},
                                                              {2 * kYieldBytes, kYieldBytes},
                                                              {3 * kYieldBytes, 5}}));
  EXPECT_FALSE(yields_between_pieces);  // the switch is the thread's own
}

}  // namespace
}  // namespace accel::ckpt

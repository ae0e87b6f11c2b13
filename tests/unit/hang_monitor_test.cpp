// The hang rule over progress-page snapshots (no processes, no files).
#include "agent/supervisor/hang_monitor.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "contract/progress_page.h"

namespace accel::supervisor {
namespace {

constexpr std::uint64_t kSec = 1'000'000'000ull;

PageView page(int rank, std::uint64_t started, std::uint64_t heartbeat_s) {
  PageView p;
  p.rank = rank;
  p.valid = true;
  p.started = started;
  p.heartbeat_ns = heartbeat_s * kSec;
  return p;
}

PageView::Op op(std::uint64_t seq, const char* name, std::uint64_t start_s, std::uint64_t end_s) {
  return {seq, name, 64, start_s * kSec, end_s * kSec};
}

HangOptions opts(int heartbeat_s, int collective_s) {
  HangOptions o;
  o.heartbeat_timeout = std::chrono::seconds(heartbeat_s);
  o.collective_timeout = std::chrono::seconds(collective_s);
  return o;
}

TEST(HangRule, CollectiveTooLongNamesTheRankThatIsBehind) {
  auto r0 = page(0, 814, 100);
  r0.in_flight = op(813, "allreduce", 100, 0);
  auto r1 = page(1, 813, 99);
  r1.last_finished = op(812, "allreduce", 98, 99);
  auto r2 = page(2, 814, 100);
  r2.in_flight = op(813, "allreduce", 100, 0);
  auto hang = detect_hang({r0, r1, r2}, 131 * kSec, opts(0, 30), "node-a");
  ASSERT_TRUE(hang);
  EXPECT_EQ(hang->rank, 1);
  EXPECT_EQ(hang->reason,
            "rank 1 is outside any collective; its last was allreduce #812, finished 32.0 s ago; "
            "ranks 0,2 wait in allreduce #813");
  EXPECT_NE(hang->report.find("rank 0 has been in allreduce #813 for 31.0 s (hang_timeout 30.0 s)"),
            std::string::npos)
      << hang->report;
  EXPECT_NE(hang->report.find(
                "  rank 1: outside any collective; last allreduce #812 finished 32.0 s ago; last "
                "heartbeat 32.0 s ago   <- lagging"),
            std::string::npos)
      << hang->report;
}

TEST(HangRule, NothingBeforeTheTimeouts) {
  auto r0 = page(0, 5, 100);
  r0.in_flight = op(4, "barrier", 100, 0);
  EXPECT_FALSE(detect_hang({r0}, 129 * kSec, opts(10, 30), "n"));  // 29 s in a collective: not yet
  auto r1 = page(1, 5, 100);
  EXPECT_FALSE(detect_hang({r1}, 109 * kSec, opts(10, 0), "n"));  // 9 s without a heartbeat
  PageView never;  // a worker that never opened its page (not libaccel) is never flagged
  never.rank = 2;
  EXPECT_FALSE(detect_hang({never}, 10'000 * kSec, opts(1, 1), "n"));
}

TEST(HangRule, HeartbeatCatchesACpuHangButNotALongCollective) {
  auto busy = page(0, 3, 100);
  busy.last_finished = op(2, "broadcast", 99, 100);
  auto hang = detect_hang({busy}, 111 * kSec, opts(10, 0), "n");
  ASSERT_TRUE(hang);
  EXPECT_EQ(hang->rank, 0);
  EXPECT_NE(hang->report.find("rank 0 has shown no progress for 11.0 s outside any collective"),
            std::string::npos);
  // In a collective for 11 s with heartbeat_timeout 10 s and hang_timeout off: not a hang.
  auto waiting = page(0, 4, 100);
  waiting.in_flight = op(3, "allreduce", 100, 0);
  EXPECT_FALSE(detect_hang({waiting}, 111 * kSec, opts(10, 0), "n"));
}

}  // namespace
}  // namespace accel::supervisor

namespace accel::supervisor {
namespace {

// A progress page's name planted as a link to another file (the victim's): the page is made
// anew in its place; the file the link pointed to keeps its bytes (it used to be truncated to
// 4096 zero bytes).
TEST(ProgressPageFile, APlantedLinkIsReplacedNotTruncatedThrough) {
  std::string dir = ::testing::TempDir() + "/page_link_" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  const std::string victim = dir + "/precious.txt";
  std::ofstream(victim) << "the victim's file";
  const std::string page = page_file_path(dir, 0);
  std::filesystem::create_symlink(victim, page);
  ASSERT_TRUE(create_page_file(page));
  std::ifstream in(victim);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(text, "the victim's file");
  EXPECT_FALSE(std::filesystem::is_symlink(page));
  EXPECT_EQ(std::filesystem::file_size(page), progress::kFileBytes);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace accel::supervisor

// LineSink: whole, prefixed lines out of arbitrary chunks.
#include "agent/supervisor/line_sink.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

namespace accel::supervisor {
namespace {

// A temp file standing in for the console or the log.
class Capture {
 public:
  Capture() : file_(std::tmpfile()) {}
  ~Capture() { std::fclose(file_); }
  int fd() const { return ::fileno(file_); }
  std::string text() const {
    std::string out;
    ::lseek(fd(), 0, SEEK_SET);
    char buf[4096];
    ssize_t n;
    while ((n = ::read(fd(), buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
    return out;
  }

 private:
  std::FILE* file_;
};

TEST(LineSink, JoinsChunksIntoPrefixedLines) {
  Capture console, log;
  LineSink sink(
      {.prefix = "[rank 1] ", .console_fd = console.fd(), .log_fd = log.fd(), .keep_last = 2});
  sink.feed("hel");
  EXPECT_EQ(console.text(), "");  // no partial line is ever written
  sink.feed("lo\nwor");
  sink.feed("ld\r\n\nlast");
  sink.finish();
  EXPECT_EQ(console.text(), "[rank 1] hello\n[rank 1] world\n[rank 1] \n[rank 1] last\n");
  EXPECT_EQ(log.text(), "hello\nworld\n\nlast\n");
  EXPECT_EQ(sink.lines_written(), 4u);
  ASSERT_EQ(sink.last_lines().size(), 2u);
  EXPECT_EQ(sink.last_lines()[0], "");
  EXPECT_EQ(sink.last_lines()[1], "last");
}

TEST(LineSink, CutsOverlongLines) {
  Capture console;
  LineSink sink({.prefix = "> ", .console_fd = console.fd(), .max_line = 4});
  sink.feed("abcdefghij\n");
  EXPECT_EQ(console.text(), "> abcd\n> efgh\n> ij\n");
}

// A log file that cannot be written (here /dev/full: ENOSPC) is reported once, with the file and
// the error; the console copy goes on, and so does a second stream sharing the file.
TEST(LineSink, AFullLogFileIsReportedOnceAndTheConsoleGoesOn) {
  Capture console;
  int full = ::open("/dev/full", O_WRONLY | O_CLOEXEC);
  ASSERT_GE(full, 0);
  std::vector<std::string> problems;
  auto failed = std::make_shared<bool>(false);
  auto options = [&] {
    LineSink::Options o{.prefix = "[r0] ", .console_fd = console.fd(), .log_fd = full};
    o.log_path = "/dev/full";
    o.on_log_error = [&](const std::string& p) { problems.push_back(p); };
    o.log_failed = failed;
    return o;
  };
  LineSink out(options()), err(options());
  for (int i = 0; i < 100; ++i) {
    out.feed("out " + std::to_string(i) + "\n");
    err.feed("err " + std::to_string(i) + "\n");
  }
  ::close(full);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_NE(problems[0].find("cannot write the log file /dev/full: No space left on device"),
            std::string::npos)
      << problems[0];
  EXPECT_NE(problems[0].find("from line 1 on"), std::string::npos) << problems[0];
  auto text = console.text();
  EXPECT_NE(text.find("[r0] out 99\n"), std::string::npos);
  EXPECT_NE(text.find("[r0] err 99\n"), std::string::npos);
}

TEST(LineSink, NoConsoleNoLog) {
  LineSink sink({.prefix = "", .keep_last = 1});
  sink.feed("a\nb\n");
  EXPECT_EQ(sink.last_lines().back(), "b");
}

}  // namespace
}  // namespace accel::supervisor

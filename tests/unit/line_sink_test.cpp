// LineSink: whole, prefixed lines out of arbitrary chunks.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>

#include "agent/supervisor/line_sink.h"

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
  LineSink sink({.prefix = "[rank 1] ", .console_fd = console.fd(), .log_fd = log.fd(), .keep_last = 2});
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

TEST(LineSink, NoConsoleNoLog) {
  LineSink sink({.prefix = "", .keep_last = 1});
  sink.feed("a\nb\n");
  EXPECT_EQ(sink.last_lines().back(), "b");
}

}  // namespace
}  // namespace accel::supervisor

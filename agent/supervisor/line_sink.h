// LineSink turns one worker stream (stdout or stderr) into whole lines: each complete line is
// written with its prefix to the console in one write(2), so lines of different workers never
// interleave mid-line, and unprefixed to the rank's log file. It keeps the last lines for the
// failure summary. Not thread-safe: owned by the WorkerGroup's io_context thread.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

namespace accel::supervisor {

class LineSink {
 public:
  struct Options {
    std::string prefix;           // "[rank 3] "
    int console_fd = -1;          // -1: not echoed to the console
    int log_fd = -1;              // -1: no log file (not owned)
    size_t keep_last = 0;         // lines kept for last_lines()
    size_t max_line = 64 * 1024;  // a longer line without '\n' is cut and emitted in pieces
    std::function<void(std::string_view line)> on_line{};  // also handed every line (forwarding)
    std::string log_path{};  // for the message when writing the log file fails
    // Told once when a write to the log file fails (ENOSPC, EIO): the file and the error. Later
    // lines go to the console only. Streams sharing a log file share `log_failed`, so the file is
    // reported once.
    std::function<void(const std::string& problem)> on_log_error{};
    std::shared_ptr<bool> log_failed = std::make_shared<bool>(false);
  };

  explicit LineSink(Options options);

  // Appends bytes as read from the pipe; writes every line they complete.
  void feed(std::string_view bytes);
  // End of stream: a final line without '\n' is written as if it had one.
  void finish();

  [[nodiscard]] const std::deque<std::string>& last_lines() const { return last_; }
  [[nodiscard]] size_t lines_written() const { return lines_; }

 private:
  void emit(std::string_view line);
  void flush_batches();

  Options options_;
  std::string partial_;        // bytes after the last '\n'
  std::string console_batch_;  // prefixed lines not yet written
  std::string log_batch_;
  std::deque<std::string> last_;
  size_t lines_ = 0;
};

// write(2) all of `data`, retrying on EINTR and short writes. Returns false on error (EPIPE...).
bool write_all(int fd, std::string_view data);

}  // namespace accel::supervisor

// Line assembly and prefixed console/log output for worker streams.
#include "agent/supervisor/line_sink.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace accel::supervisor {

bool write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

namespace {
size_t lines_in_batch(const std::string& batch) {
  return static_cast<size_t>(std::count(batch.begin(), batch.end(), '\n'));
}
}  // namespace

LineSink::LineSink(Options options) : options_(std::move(options)) {}

void LineSink::feed(std::string_view bytes) {
  while (!bytes.empty()) {
    auto nl = bytes.find('\n');
    if (nl == std::string_view::npos) {
      partial_.append(bytes);
      while (partial_.size() >= options_.max_line) {
        emit(std::string_view(partial_).substr(0, options_.max_line));
        partial_.erase(0, options_.max_line);
      }
      break;
    }
    if (partial_.empty()) {
      emit(bytes.substr(0, nl));
    } else {
      partial_.append(bytes.substr(0, nl));
      emit(partial_);
      partial_.clear();
    }
    bytes.remove_prefix(nl + 1);
  }
  flush_batches();
}

void LineSink::finish() {
  if (!partial_.empty()) {
    emit(partial_);
    partial_.clear();
  }
  flush_batches();
}

void LineSink::emit(std::string_view line) {
  while (line.size() > options_.max_line) {
    emit(line.substr(0, options_.max_line));
    line.remove_prefix(options_.max_line);
  }
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  ++lines_;
  if (options_.console_fd >= 0) {
    console_batch_.append(options_.prefix);
    console_batch_.append(line);
    console_batch_.push_back('\n');
  }
  if (options_.log_fd >= 0) {
    log_batch_.append(line);
    log_batch_.push_back('\n');
  }
  if (options_.on_line) options_.on_line(line);
  if (options_.keep_last > 0) {
    if (last_.size() == options_.keep_last) last_.pop_front();
    last_.emplace_back(line);
  }
}

void LineSink::flush_batches() {
  // Why one write per batch: a write of whole lines is never split by another writer of ours.
  if (!console_batch_.empty()) {
    write_all(options_.console_fd, console_batch_);
    console_batch_.clear();
  }
  if (!log_batch_.empty() && !*options_.log_failed) {
    if (!write_all(options_.log_fd, log_batch_)) {
      int err = errno;
      *options_.log_failed = true;
      if (options_.on_log_error) {
        options_.on_log_error("cannot write the log file " + options_.log_path + ": " +
                              std::strerror(err) + "; from line " +
                              std::to_string(lines_ - lines_in_batch(log_batch_) + 1) +
                              " on, this output is on the console only");
      }
    }
  }
  log_batch_.clear();
}

}  // namespace accel::supervisor

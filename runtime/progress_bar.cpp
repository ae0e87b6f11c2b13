// The progress display (progress_bar.h).
#include "runtime/progress_bar.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>

#include "accel/data.h"

namespace accel {

namespace {

std::string clock_text(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  auto s = static_cast<long long>(seconds + 0.5);
  char out[32];
  if (s >= 3600)
    std::snprintf(out, sizeof out, "%lld:%02lld:%02lld", s / 3600, s / 60 % 60, s % 60);
  else
    std::snprintf(out, sizeof out, "%lld:%02lld", s / 60, s % 60);
  return out;
}

}  // namespace

ProgressBar::ProgressBar(int fd, bool terminal, std::chrono::milliseconds line_interval)
    : fd_(fd), terminal_(terminal), line_interval_(line_interval) {}

std::string ProgressBar::render(const std::string& label, std::size_t done, std::size_t total,
                                double rate, const std::map<std::string, double>& values,
                                bool with_bar) {
  const bool known = total != SIZE_MAX && total > 0;
  char buffer[64];
  std::string out = label + "  " + std::to_string(done);
  if (known) out += "/" + std::to_string(total);
  if (known && with_bar) {
    constexpr int kWidth = 20;
    int filled = static_cast<int>(kWidth * static_cast<double>(done) / static_cast<double>(total));
    if (filled > kWidth) filled = kWidth;
    out += " [" + std::string(static_cast<std::size_t>(filled), '=') +
           (filled < kWidth ? ">" : "") +
           std::string(static_cast<std::size_t>(kWidth - filled - (filled < kWidth ? 1 : 0)), ' ') +
           "]";
  }
  if (known) {
    std::snprintf(buffer, sizeof buffer, " %3d%%",
                  static_cast<int>(100.0 * static_cast<double>(done) / static_cast<double>(total)));
    out += buffer;
  } else {
    out += " batches";
  }
  if (rate > 0) {
    std::snprintf(buffer, sizeof buffer, "  %.3g it/s", rate);
    out += buffer;
    if (known && done < total)
      out += "  ETA " + clock_text(static_cast<double>(total - done) / rate);
  }
  for (const auto& [name, v] : values) {
    std::snprintf(buffer, sizeof buffer, "%.5g", v);
    out += "  " + name + " " + buffer;
  }
  return out;
}

void ProgressBar::update(const std::string& label, const PassProgress& p,
                         const std::map<std::string, double>& values) {
  auto now = std::chrono::steady_clock::now();
  if (label != label_ || p.handed_out < start_done_) {
    label_ = label;
    pass_start_ = last_draw_ = now;
    start_done_ = p.handed_out > 0 ? p.handed_out - 1 : 0;
    if (!terminal_) return;  // a line only once an interval has gone by
  }
  double seconds = std::chrono::duration<double>(now - pass_start_).count();
  // Why 50 ms: a rate over the first microseconds of a pass would read millions per second.
  double rate = seconds >= 0.05 ? static_cast<double>(p.handed_out - start_done_) / seconds : 0;
  if (terminal_) {
    if (!p.finished && now - last_draw_ < std::chrono::milliseconds(100) && drawn_) return;
    last_draw_ = now;
    write("\r" + render(label, p.handed_out, p.total, rate, values, true) + "\033[K" +
          (p.finished ? "\n" : ""));
    drawn_ = !p.finished;
    if (p.finished) label_.clear();
    return;
  }
  if (p.finished) {
    label_.clear();
    return;
  }
  if (now - last_draw_ < line_interval_) return;
  last_draw_ = now;
  write("accel: " + render(label, p.handed_out, p.total, rate, values, false) + "\n");
}

void ProgressBar::write(const std::string& text) {
  [[maybe_unused]] auto n = ::write(fd_, text.data(), text.size());
}

}  // namespace accel

// The main process's progress display for prepared loaders: on a terminal a bar redrawn in
// place (at most 10 times a second) with the rate, the time left and the last logged values; on
// a pipe or file (as under accel-launch) a plain line every 30 seconds, so short runs stay quiet
// and long ones show they are alive. Thread: the training thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

namespace accel {

struct PassProgress;  // accel/data.h

class ProgressBar {
 public:
  // `terminal`: redraw in place; otherwise plain lines every `line_interval`.
  ProgressBar(int fd, bool terminal, std::chrono::milliseconds line_interval);
  // A loader's pass moved on; `label` names it ("epoch 2", "loader 1 epoch 0").
  void update(const std::string& label, const PassProgress& p,
              const std::map<std::string, double>& values);

  // The text of one display: "epoch 2  37/120 [=====>    ]  31%  12.3 it/s  ETA 0:07  loss 1.2345"
  // (no bar or total for a stream). Public for tests.
  static std::string render(const std::string& label, std::size_t done, std::size_t total,
                            double rate, const std::map<std::string, double>& values,
                            bool with_bar);

 private:
  void write(const std::string& text);
  int fd_;
  bool terminal_;
  std::chrono::milliseconds line_interval_;
  std::string label_;  // the pass being shown
  std::chrono::steady_clock::time_point pass_start_, last_draw_;
  std::size_t start_done_ = 0;  // batches handed out when the pass started (a resumed pass)
  bool drawn_ = false;          // a bar is on the terminal's current line
};

}  // namespace accel

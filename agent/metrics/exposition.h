// The Prometheus text exposition format (version 0.0.4): what a /metrics answer is made of.
// Each part of accel writes its metrics into an Exposition when scraped, from the state it keeps
// anyway; nothing is counted twice and nothing runs between scrapes.
//
// Names follow Prometheus' conventions: an accel_ prefix, base units (_seconds, _bytes), _total
// for counters; label values are escaped here, so node names and job ids may hold anything.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace accel::metrics {

using Labels = std::vector<std::pair<std::string, std::string>>;

enum class Type { kCounter, kGauge, kHistogram };

class Exposition {
 public:
  // Starts a family: its # HELP and # TYPE lines. Every sample of a family must follow its
  // family() call, and a family may be started only once per exposition.
  void family(std::string_view name, Type type, std::string_view help);
  // One sample: `name` is the family's, or with a histogram's _bucket/_sum/_count suffix.
  void sample(std::string_view name, const Labels& labels, double value);
  void sample(std::string_view name, double value) { sample(name, {}, value); }
  // A family with a single unlabelled sample.
  void single(std::string_view name, Type type, std::string_view help, double value);

  [[nodiscard]] const std::string& text() const { return text_; }
  [[nodiscard]] std::string take() { return std::move(text_); }

 private:
  std::string text_;
  std::vector<std::string> families_;
};

// `value` as a label value: backslash, double quote and newline escaped.
std::string escape_label_value(std::string_view value);
// A sample value as the format writes it: integers without a fraction, +Inf, -Inf, NaN.
std::string format_value(double value);

// A histogram of durations in seconds with fixed buckets. Thread: not thread-safe.
class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  // Buckets from 100 us to 10 s (RPC and request handling).
  static Histogram latency();
  void observe(double seconds);
  // Writes the _bucket, _sum and _count samples (the family must have been started).
  void write(Exposition& out, std::string_view name, const Labels& labels) const;
  [[nodiscard]] std::uint64_t count() const { return count_; }

 private:
  std::vector<double> bounds_;
  std::vector<std::uint64_t> counts_;  // per bucket, not cumulative
  std::uint64_t count_ = 0;
  double sum_ = 0;
};

}  // namespace accel::metrics

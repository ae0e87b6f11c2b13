// The text format's writer.
#include "agent/metrics/exposition.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdio>

namespace accel::metrics {

std::string escape_label_value(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string format_value(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  char buf[32];
  if (value == std::floor(value) && std::fabs(value) < 1e15) {
    std::snprintf(buf, sizeof buf, "%.0f", value);
  } else {
    std::snprintf(buf, sizeof buf, "%.15g", value);
  }
  return buf;
}

namespace {

std::string_view type_name(Type t) {
  switch (t) {
    case Type::kCounter:
      return "counter";
    case Type::kGauge:
      return "gauge";
    case Type::kHistogram:
      return "histogram";
  }
  return "untyped";
}

// HELP text escapes only backslash and newline.
std::string escape_help(std::string_view help) {
  std::string out;
  for (char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

void Exposition::family(std::string_view name, Type type, std::string_view help) {
  // Why an assert and not a check: the names are the program's constants, not input.
  assert(std::find(families_.begin(), families_.end(), name) == families_.end());
  families_.emplace_back(name);
  text_ += "# HELP ";
  text_ += name;
  text_ += ' ';
  text_ += escape_help(help);
  text_ += "\n# TYPE ";
  text_ += name;
  text_ += ' ';
  text_ += type_name(type);
  text_ += '\n';
}

void Exposition::sample(std::string_view name, const Labels& labels, double value) {
  text_ += name;
  if (!labels.empty()) {
    text_ += '{';
    bool first = true;
    for (const auto& [k, v] : labels) {
      if (!first) text_ += ',';
      first = false;
      text_ += k;
      text_ += "=\"";
      text_ += escape_label_value(v);
      text_ += '"';
    }
    text_ += '}';
  }
  text_ += ' ';
  text_ += format_value(value);
  text_ += '\n';
}

void Exposition::single(std::string_view name, Type type, std::string_view help, double value) {
  family(name, type, help);
  sample(name, value);
}

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)), counts_(bounds_.size() + 1, 0) {}

Histogram Histogram::latency() {
  return Histogram({0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                    0.5, 1, 2.5, 5, 10});
}

void Histogram::observe(double seconds) {
  auto at = std::lower_bound(bounds_.begin(), bounds_.end(), seconds);
  ++counts_[static_cast<size_t>(at - bounds_.begin())];
  ++count_;
  sum_ += seconds;
}

void Histogram::write(Exposition& out, std::string_view name, const Labels& labels) const {
  std::string bucket = std::string(name) + "_bucket";
  std::uint64_t cumulative = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cumulative += counts_[i];
    Labels with = labels;
    with.emplace_back("le", i < bounds_.size() ? format_value(bounds_[i]) : "+Inf");
    out.sample(bucket, with, static_cast<double>(cumulative));
  }
  out.sample(std::string(name) + "_sum", labels, sum_);
  out.sample(std::string(name) + "_count", labels, static_cast<double>(count_));
}

}  // namespace accel::metrics

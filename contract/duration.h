// Durations as text ("30m", "90s", "500ms", "2h", "1.5s", a plain number of seconds): the one
// grammar of config keys, flags, ACCEL_* variables and what the launcher passes to workers, so
// the launcher and libaccel cannot read the same text differently. Header-only, standard library
// only (both the control plane and the runtime include it).
#pragma once

#include <charconv>
#include <chrono>
#include <cmath>
#include <optional>
#include <string>
#include <string_view>

namespace accel::contract {

// The milliseconds `text` means, or nullopt when it is not a duration (negative, unknown unit,
// above 10^12 ms). Surrounding spaces are ignored; units are case-insensitive.
inline std::optional<std::chrono::milliseconds> parse_duration(std::string_view text) {
  auto space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  while (!text.empty() && space(text.front())) text.remove_prefix(1);
  while (!text.empty() && space(text.back())) text.remove_suffix(1);
  size_t unit_at = text.find_first_not_of("0123456789.+");
  std::string_view number = text.substr(0, unit_at);
  if (!number.empty() && number.front() == '+') number.remove_prefix(1);
  std::string unit;
  if (unit_at != std::string_view::npos) {
    for (char c : text.substr(unit_at)) {
      if (!space(c)) unit += static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
    }
  }
  double value = 0;
  auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), value);
  if (number.empty() || ec != std::errc() || end != number.data() + number.size() ||
      !std::isfinite(value) || value < 0) {
    return std::nullopt;
  }
  double ms_per_unit = 0;
  if (unit.empty() || unit == "s") {
    ms_per_unit = 1000;
  } else if (unit == "ms") {
    ms_per_unit = 1;
  } else if (unit == "m" || unit == "min") {
    ms_per_unit = 60'000;
  } else if (unit == "h") {
    ms_per_unit = 3'600'000;
  } else {
    return std::nullopt;
  }
  double ms = value * ms_per_unit;
  if (ms > 1e12) return std::nullopt;
  return std::chrono::milliseconds(static_cast<long long>(std::llround(ms)));
}

// The shortest exact text: "30m", "90s", "1500ms", "0s".
inline std::string format_duration(std::chrono::milliseconds d) {
  long long ms = d.count();
  if (ms % 3'600'000 == 0 && ms != 0) return std::to_string(ms / 3'600'000) + "h";
  if (ms % 60'000 == 0 && ms != 0) return std::to_string(ms / 60'000) + "m";
  if (ms % 1000 == 0) return std::to_string(ms / 1000) + "s";
  return std::to_string(ms) + "ms";
}

}  // namespace accel::contract

// Typed reads of environment variables for the runtime.
#include "runtime/env.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>

#include "accel/error.h"

namespace accel::env {
namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

[[noreturn]] void bad(const std::string& name, const std::string& value,
                      const std::string& expected) {
  throw ConfigError("accel: environment variable " + name + "=\"" + value + "\": expected " +
                    expected);
}

}  // namespace

std::optional<std::string> first_of(std::initializer_list<const char*> names, std::string* which) {
  for (const char* name : names) {
    const char* value = std::getenv(name);
    if (value != nullptr && *value != '\0') {
      if (which != nullptr) *which = name;
      return std::string(value);
    }
  }
  return std::nullopt;
}

long integer(std::initializer_list<const char*> names, long fallback, long min, long max) {
  std::string name;
  auto value = first_of(names, &name);
  if (!value) return fallback;
  errno = 0;
  char* end = nullptr;
  long parsed = std::strtol(value->c_str(), &end, 10);
  if (errno != 0 || end == value->c_str() || *end != '\0' || parsed < min || parsed > max) {
    bad(name, *value, "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]");
  }
  return parsed;
}

bool boolean(std::initializer_list<const char*> names, bool fallback) {
  std::string name;
  auto value = first_of(names, &name);
  if (!value) return fallback;
  std::string v = lower(*value);
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "off") return false;
  bad(name, *value, "true or false");
}

std::chrono::milliseconds parse_duration(const std::string& text, const std::string& what) {
  errno = 0;
  char* end = nullptr;
  double number = std::strtod(text.c_str(), &end);
  std::string unit = lower(std::string(end));
  double ms = 0;
  if (unit.empty() || unit == "s")
    ms = number * 1e3;
  else if (unit == "ms")
    ms = number;
  else if (unit == "m" || unit == "min")
    ms = number * 60e3;
  else if (unit == "h")
    ms = number * 3600e3;
  else
    ms = -1;
  if (errno != 0 || end == text.c_str() || !(ms > 0) || ms > 1e12) {
    throw ConfigError(
        "accel: " + what + "=\"" + text +
        "\": expected a positive duration such as 30m, 90s, 500ms or a number of seconds");
  }
  return std::chrono::milliseconds(static_cast<long long>(ms));
}

std::chrono::milliseconds duration(std::initializer_list<const char*> names,
                                   std::chrono::milliseconds fallback) {
  std::string name;
  auto value = first_of(names, &name);
  if (!value) return fallback;
  return parse_duration(*value, "environment variable " + name);
}

}  // namespace accel::env

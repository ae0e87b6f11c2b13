// Reads the worker environment (DESIGN §4) with errors that name the variable and its value.
#pragma once

#include <chrono>
#include <optional>
#include <string>

namespace accel::env {

// The value of the first of `names` that is set (and non-empty), or nullopt.
std::optional<std::string> first_of(std::initializer_list<const char*> names,
                                    std::string* which = nullptr);

// An integer in [min, max]; ConfigError naming the variable otherwise. `fallback` when unset.
long integer(std::initializer_list<const char*> names, long fallback, long min, long max);

// true/false/1/0/yes/no/on/off (any case); ConfigError otherwise.
bool boolean(std::initializer_list<const char*> names, bool fallback);

// "30m", "90s", "500ms", "2h", or a plain number of seconds; ConfigError otherwise.
std::chrono::milliseconds duration(std::initializer_list<const char*> names,
                                   std::chrono::milliseconds fallback);

// Parses a duration as above; `what` names the source in the error.
std::chrono::milliseconds parse_duration(const std::string& text, const std::string& what);

}  // namespace accel::env

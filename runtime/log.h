// libaccel's own messages to stderr ("accel: ..."), filtered by ACCEL_LOG_LEVEL (the launch
// configuration's log_level).
#pragma once

#include <string>

#include "runtime/env.h"

namespace accel::log {

[[nodiscard]] bool enabled(env::LogLevel level);
// Writes "accel: <text>\n" (with "warning: " / "error: " for those levels) in one write, when
// `level` is at or above the configured one.
void write(env::LogLevel level, const std::string& text);

inline void debug(const std::string& text) { write(env::LogLevel::kDebug, text); }
inline void info(const std::string& text) { write(env::LogLevel::kInfo, text); }
inline void warning(const std::string& text) { write(env::LogLevel::kWarning, text); }

}  // namespace accel::log

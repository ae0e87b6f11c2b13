// Level-filtered stderr messages.
#include "runtime/log.h"

#include <unistd.h>

namespace accel::log {

bool enabled(env::LogLevel level) {
  env::LogLevel configured = env::LogLevel::kInfo;
  try {
    configured = env::worker_env().log_level;
  } catch (...) {  // Why: a bad environment is reported by whoever needs it; a message still goes
  }
  return level >= configured;
}

void write(env::LogLevel level, const std::string& text) {
  if (!enabled(level)) return;
  std::string line = "accel: ";
  if (level == env::LogLevel::kWarning) line += "warning: ";
  if (level == env::LogLevel::kError) line += "error: ";
  line += text;
  line += '\n';
  // One write: lines of ranks sharing a console stay whole.
  [[maybe_unused]] auto n = ::write(STDERR_FILENO, line.data(), line.size());
}

}  // namespace accel::log

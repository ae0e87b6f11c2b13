// accel::get_logger: HF Accelerate's get_logger in C++. Named loggers (spdlog underneath) that by
// default write only on the main process, so a message is not repeated once per rank, at the
// level ACCEL_LOG_LEVEL (accel-launch --log-level) sets.
// Thread: any; each message is one write to stderr.
#pragma once

#include <memory>
#include <optional>
#include <string>

namespace accel {

enum class LogLevel { kDebug, kInfo, kWarning, kError };

class Logger {
 public:
  // `main_process_only`: write on the main process (RANK 0) only; false: on every process.
  void debug(const std::string& message, bool main_process_only = true) const;
  void info(const std::string& message, bool main_process_only = true) const;
  void warning(const std::string& message, bool main_process_only = true) const;
  void error(const std::string& message, bool main_process_only = true) const;
  void log(LogLevel level, const std::string& message, bool main_process_only = true) const;
  const std::string& name() const;
  LogLevel level() const;
  void set_level(LogLevel level);

 private:
  struct Impl;
  friend Logger get_logger(const std::string& name, std::optional<LogLevel> level);
  explicit Logger(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

// A logger named `name`, writing "[2026-11-26 10:00:00.123] [name] [info] message" lines to
// stderr at `level` and above (unset: ACCEL_LOG_LEVEL, else info). Loggers of one name share
// their level.
Logger get_logger(const std::string& name, std::optional<LogLevel> level = std::nullopt);

}  // namespace accel

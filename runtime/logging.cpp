// accel::get_logger (accel/logging.h): spdlog loggers with a main-process filter.
#include "accel/logging.h"

#include <atomic>
#include <map>
#include <mutex>

#include "runtime/env.h"

#ifdef ACCEL_WITH_SPDLOG
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>
#else
#include <unistd.h>

#include <chrono>
#include <ctime>
#endif

namespace accel {

namespace {

// Why a cast: accel::LogLevel is the public face of the environment's levels, in the same order.
static_assert(static_cast<int>(LogLevel::kDebug) == static_cast<int>(env::LogLevel::kDebug) &&
              static_cast<int>(LogLevel::kInfo) == static_cast<int>(env::LogLevel::kInfo) &&
              static_cast<int>(LogLevel::kWarning) == static_cast<int>(env::LogLevel::kWarning) &&
              static_cast<int>(LogLevel::kError) == static_cast<int>(env::LogLevel::kError));

LogLevel configured_level() {
  try {
    return static_cast<LogLevel>(env::worker_env().log_level);
  } catch (...) {  // Why: a bad environment is reported by the Accelerator; a logger still logs
    return LogLevel::kInfo;
  }
}

bool is_main_process() {
  try {
    return env::worker_env().rank == 0;
  } catch (...) {
    return true;
  }
}

[[maybe_unused]] const char* level_name(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return "debug";
    case LogLevel::kWarning:
      return "warning";
    case LogLevel::kError:
      return "error";
    default:
      return "info";
  }
}

}  // namespace

struct Logger::Impl {
  std::string name;
  std::atomic<LogLevel> level;
#ifdef ACCEL_WITH_SPDLOG
  std::shared_ptr<spdlog::logger> logger;
#endif
};

namespace {
std::mutex g_mutex;  // the registry and every logger's level
}  // namespace

Logger get_logger(const std::string& name, std::optional<LogLevel> level) {
  static std::map<std::string, std::shared_ptr<Logger::Impl>> registry;
  std::lock_guard<std::mutex> lock(g_mutex);
  auto& impl = registry[name];
  if (!impl) {
    impl = std::make_shared<Logger::Impl>();
    impl->name = name;
    impl->level = configured_level();
#ifdef ACCEL_WITH_SPDLOG
    // Why not spdlog's registry: a user's own spdlog logger of the same name must not clash.
    impl->logger =
        std::make_shared<spdlog::logger>(name, std::make_shared<spdlog::sinks::stderr_sink_mt>());
    impl->logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%n] [%l] %v");
    impl->logger->set_level(spdlog::level::trace);  // Logger::log filters
#endif
  }
  if (level) impl->level = *level;
  return Logger(impl);
}

void Logger::log(LogLevel level, const std::string& message, bool main_process_only) const {
  if (level < impl_->level) return;
  if (main_process_only && !is_main_process()) return;
#ifdef ACCEL_WITH_SPDLOG
  static constexpr spdlog::level::level_enum kLevels[] = {spdlog::level::debug, spdlog::level::info,
                                                          spdlog::level::warn, spdlog::level::err};
  impl_->logger->log(kLevels[static_cast<int>(level)], message);
  impl_->logger->flush();
#else
  auto now = std::chrono::system_clock::now();
  std::time_t t = std::chrono::system_clock::to_time_t(now);
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()) % 1000;
  std::tm tm{};
  localtime_r(&t, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y-%m-%d %H:%M:%S", &tm);
  char millis[8];
  std::snprintf(millis, sizeof millis, ".%03d", static_cast<int>(ms.count()));
  std::string line = std::string("[") + stamp + millis + "] [" + impl_->name + "] [" +
                     level_name(level) + "] " + message + "\n";
  [[maybe_unused]] auto n = ::write(STDERR_FILENO, line.data(), line.size());
#endif
}

void Logger::debug(const std::string& m, bool main_only) const {
  log(LogLevel::kDebug, m, main_only);
}
void Logger::info(const std::string& m, bool main_only) const {
  log(LogLevel::kInfo, m, main_only);
}
void Logger::warning(const std::string& m, bool main_only) const {
  log(LogLevel::kWarning, m, main_only);
}
void Logger::error(const std::string& m, bool main_only) const {
  log(LogLevel::kError, m, main_only);
}
const std::string& Logger::name() const { return impl_->name; }
LogLevel Logger::level() const { return impl_->level; }
void Logger::set_level(LogLevel level) {
  std::lock_guard<std::mutex> lock(g_mutex);
  impl_->level = level;
}

}  // namespace accel

// The systemd notify protocol for accel-agent under `Type=notify` (libsystemd's sd_notify):
// READY=1 once the agent is registered, STATUS= with what it is doing, WATCHDOG=1 from its event
// loop (so systemd restarts a wedged agent with WatchdogSec=), STOPPING=1 on shutdown. Without
// NOTIFY_SOCKET (not started by systemd) every call does nothing.
#pragma once

#include <chrono>
#include <optional>
#include <string>

namespace accel {

class SystemdNotifier {
 public:
  // Reads NOTIFY_SOCKET and WATCHDOG_USEC/WATCHDOG_PID once.
  SystemdNotifier();

  [[nodiscard]] bool enabled() const { return enabled_; }
  // How often to send WATCHDOG=1 (half of WatchdogSec=); nullopt when no watchdog is asked for.
  [[nodiscard]] std::optional<std::chrono::milliseconds> watchdog_interval() const {
    return watchdog_interval_;
  }

  void ready(const std::string& status);
  // Sends STATUS= only when it differs from the last one sent.
  void status(const std::string& status);
  void watchdog();
  void stopping(const std::string& status);

  // The variables a service's children must not inherit (a worker writing to the agent's
  // notify socket would be taken for the agent).
  static constexpr const char* kVariables[] = {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"};

 private:
  void send(const std::string& text);
  bool enabled_ = false;
  bool ready_sent_ = false;
  std::optional<std::chrono::milliseconds> watchdog_interval_;
  std::string last_status_;
};

}  // namespace accel

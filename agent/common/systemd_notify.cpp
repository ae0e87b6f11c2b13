// sd_notify: a datagram to $NOTIFY_SOCKET, formatted and sent by libsystemd.
#include "agent/common/systemd_notify.h"

#include <systemd/sd-daemon.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

namespace accel {

SystemdNotifier::SystemdNotifier() {
  const char* socket = std::getenv("NOTIFY_SOCKET");
  enabled_ = socket != nullptr && *socket != '\0';
  uint64_t usec = 0;
  if (enabled_ && sd_watchdog_enabled(0, &usec) > 0 && usec > 0) {
    watchdog_interval_ = std::chrono::milliseconds(std::max<uint64_t>(usec / 2000, 1));
  }
}

void SystemdNotifier::send(const std::string& text) {
  if (enabled_) (void)sd_notify(0, text.c_str());
}

void SystemdNotifier::ready(const std::string& status) {
  if (ready_sent_) return;
  ready_sent_ = true;
  last_status_ = status;
  send("READY=1\nSTATUS=" + status);
}

void SystemdNotifier::status(const std::string& status) {
  if (status == last_status_) return;
  last_status_ = status;
  send("STATUS=" + status);
}

void SystemdNotifier::watchdog() {
  if (watchdog_interval_) send("WATCHDOG=1");
}

void SystemdNotifier::stopping(const std::string& status) {
  last_status_ = status;
  send("STOPPING=1\nSTATUS=" + status);
}

}  // namespace accel

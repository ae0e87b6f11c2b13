// Picks a TCP port that is free on this host right now, for MASTER_PORT when the user asked for 0.
#pragma once

#include <string>

#include "agent/common/status.h"

namespace accel {

// Binds port 0 on `host` (an IPv4 or IPv6 literal, or "localhost") and returns the port the
// kernel chose. Why SO_REUSEADDR is left off: the port must be bindable by a worker's TCPStore
// right after we close it. The port can still be taken between this call and the worker's bind;
// callers that can retry should (the coordinator does).
Result<int> pick_free_port(const std::string& host = "127.0.0.1");

}  // namespace accel

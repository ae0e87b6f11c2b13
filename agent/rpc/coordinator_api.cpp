// Call statuses as text.
#include "agent/rpc/coordinator_api.h"

namespace accel::rpc {

std::string describe(const CallStatus& status) {
  static const char* kNames[] = {"OK",
                                 "CANCELLED",
                                 "UNKNOWN",
                                 "INVALID_ARGUMENT",
                                 "DEADLINE_EXCEEDED",
                                 "NOT_FOUND",
                                 "ALREADY_EXISTS",
                                 "PERMISSION_DENIED",
                                 "RESOURCE_EXHAUSTED",
                                 "FAILED_PRECONDITION",
                                 "ABORTED",
                                 "OUT_OF_RANGE",
                                 "UNIMPLEMENTED",
                                 "INTERNAL",
                                 "UNAVAILABLE",
                                 "DATA_LOSS",
                                 "UNAUTHENTICATED"};
  int code = static_cast<int>(status.code);
  std::string name = code >= 0 && code <= 16 ? kNames[code] : std::to_string(code);
  return name + ": " + status.message;
}

}  // namespace accel::rpc

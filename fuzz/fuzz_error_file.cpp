// Fuzz target: the error file a worker writes (the worker runs the user's code: any bytes).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "agent/supervisor/error_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto e = accel::supervisor::parse_error_file(
      std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
  if (e.message.empty()) __builtin_trap();  // the contract: there is always a message
  return 0;
}

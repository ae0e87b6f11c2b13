// Fuzz target: progress pages (written by workers: any bytes) and the hang rule over them. The
// input is split into pages of the file's size; the first 8 bytes pick the clock.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <vector>

#include "agent/supervisor/hang_monitor.h"
#include "contract/progress_page.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace accel;
  if (size < 8) return 0;
  std::uint64_t now = 0;
  std::memcpy(&now, data, 8);
  std::string_view rest(reinterpret_cast<const char*>(data) + 8, size - 8);
  std::vector<supervisor::PageView> views;
  for (int rank = 0; !rest.empty() && rank < 8; ++rank) {
    auto take = std::min(rest.size(), progress::kFileBytes);
    views.push_back(supervisor::parse_page(rest.substr(0, take), rank));
    rest.remove_prefix(take);
  }
  supervisor::HangOptions options;
  options.collective_timeout = std::chrono::milliseconds(1000);
  options.heartbeat_timeout = std::chrono::milliseconds(2000);
  (void)supervisor::detect_hang(views, now, options, "fuzz-host");
  return 0;
}

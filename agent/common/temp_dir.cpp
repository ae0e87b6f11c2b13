// Temporary folders for the launcher and the agent.
#include "agent/common/temp_dir.h"

#include <cstdlib>
#include <vector>

namespace accel {

std::string temp_root() {
  const char* tmp = std::getenv("TMPDIR");
  return tmp && *tmp ? tmp : "/tmp";
}

std::string make_temp_dir(const std::string& prefix) {
  std::string pattern = temp_root() + "/" + prefix + "XXXXXX";
  std::vector<char> buf(pattern.begin(), pattern.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) return {};
  return buf.data();
}

}  // namespace accel

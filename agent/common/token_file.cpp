// Reading a token file.
#include "agent/common/token_file.h"

#include <fstream>

namespace accel {

Result<std::string> read_token_file(const std::string& key, const std::string& path) {
  const std::string where = key + " " + path;
  std::ifstream in(path);
  if (!in) return Status::error(where + ": cannot read it");
  std::string token;
  std::getline(in, token);
  while (!token.empty() && (token.back() == '\r' || token.back() == ' ')) token.pop_back();
  if (token.empty()) return Status::error(where + " is empty");
  if (token.find_first_of("\n\t ") != std::string::npos)
    return Status::error(where + ": the token must be one word without spaces");
  return token;
}

}  // namespace accel

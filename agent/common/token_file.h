// A secret kept in a file: its first line, one word. The control plane's token_file and the
// metrics' metrics_token_file read it the same way.
#pragma once

#include <string>

#include "agent/common/status.h"

namespace accel {

// The first line of `path` without trailing spaces or CR. Errors start with `key` and the path:
// "token_file /etc/accel/token: cannot read it", "... is empty", "...: the token must be one
// word without spaces".
Result<std::string> read_token_file(const std::string& key, const std::string& path);

}  // namespace accel

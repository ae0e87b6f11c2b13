// The process's open-file limit. A daemon that serves connections raises its soft limit to the
// hard one at start-up (as nginx and systemd services do), so a connection flood meets the
// connection limits first, not EMFILE.
#pragma once

#include <cstdint>

namespace accel {

struct FileLimit {
  std::uint64_t before = 0;  // the soft limit found
  std::uint64_t now = 0;     // the soft limit in force (the hard limit unless that failed)
};

// Sets RLIMIT_NOFILE's soft limit to its hard limit; never lowers it.
FileLimit raise_file_limit();

}  // namespace accel

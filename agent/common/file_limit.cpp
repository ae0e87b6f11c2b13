// raise_file_limit: soft RLIMIT_NOFILE up to the hard limit.
#include "agent/common/file_limit.h"

#include <sys/resource.h>

namespace accel {

FileLimit raise_file_limit() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return {};
  FileLimit out{lim.rlim_cur, lim.rlim_cur};
  if (lim.rlim_cur >= lim.rlim_max) return out;
  rlimit raised{lim.rlim_max, lim.rlim_max};
  if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) out.now = lim.rlim_max;
  return out;
}

}  // namespace accel

// /proc/<pid>/stat, parsed.
#include "agent/metrics/proc_stat.h"

#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>

namespace accel::metrics {

std::optional<ProcStat> read_proc_stat(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) return std::nullopt;
  // Why from the last ')': the command name (field 2) may hold spaces and parentheses.
  auto close = stat.rfind(')');
  if (close == std::string::npos || close + 2 > stat.size()) return std::nullopt;
  std::istringstream fields(stat.substr(close + 2));
  std::string f;
  double utime = 0, stime = 0, start = 0, rss_pages = 0;
  // Fields from 3 (state): utime 14, stime 15, starttime 22, rss 24.
  for (int i = 3; i <= 24 && fields >> f; ++i) {
    double v = std::strtod(f.c_str(), nullptr);
    if (i == 14) utime = v;
    if (i == 15) stime = v;
    if (i == 22) start = v;
    if (i == 24) rss_pages = v;
  }
  static const double ticks = static_cast<double>(::sysconf(_SC_CLK_TCK));
  static const double page = static_cast<double>(::sysconf(_SC_PAGESIZE));
  return ProcStat{(utime + stime) / ticks, rss_pages * page, start / ticks};
}

}  // namespace accel::metrics

// Removing what workers left in /dev/shm (shm_names.h).
#include "agent/supervisor/shm_names.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "contract/worker_contract.h"

namespace accel::supervisor {

namespace {

// Removes this user's names accel-<pid>-... in /dev/shm for which `doomed(pid, st)` holds:
// plain files only, never through a link. Returns how many went.
template <class F>
int remove_shm_names(F doomed) {
  const std::size_t prefix = std::strlen(contract::kShmSegmentPrefix);
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return 0;
  int removed = 0;
  while (const dirent* e = ::readdir(dir)) {
    if (std::strncmp(e->d_name, contract::kShmSegmentPrefix, prefix) != 0) continue;
    const char* digits = e->d_name + prefix;
    char* end = nullptr;
    errno = 0;
    long pid = std::strtol(digits, &end, 10);
    if (end == digits || *end != '-' || errno != 0 || pid <= 0 || pid > INT32_MAX) continue;
    struct stat st {};
    if (::fstatat(::dirfd(dir), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (S_ISREG(st.st_mode) && st.st_uid == ::geteuid() && doomed(static_cast<pid_t>(pid), st) &&
        ::unlinkat(::dirfd(dir), e->d_name, 0) == 0) {
      ++removed;
    }
  }
  ::closedir(dir);
  return removed;
}

// Whether `pid` is gone or a zombie (which runs no code).
bool gone_or_zombie(pid_t pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  auto close = text.rfind(')');
  if (close == std::string::npos) return !stat.is_open();  // went between the two looks
  return close + 2 < text.size() && (text[close + 2] == 'Z' || text[close + 2] == 'X');
}

}  // namespace

void remove_shm_names_of(pid_t worker) {
  remove_shm_names([worker](pid_t pid, const struct stat&) { return pid == worker; });
}

// Why the age: a process of another pid namespace sharing /dev/shm (containers with --ipc=host)
// is "gone" seen from here; its names live for a moment only (unlinked once every rank has
// mapped them), so an old one is not in use.
void sweep_dead_shm_names() {
  constexpr time_t kMinAgeSeconds = 60;
  const time_t now = ::time(nullptr);
  remove_shm_names([now](pid_t pid, const struct stat& st) {
    return now - st.st_mtime >= kMinAgeSeconds && ::kill(pid, 0) != 0 && errno == ESRCH;
  });
}

void record_workers(const std::string& folder, const std::vector<pid_t>& pids) {
  if (folder.empty() || pids.empty()) return;
  std::ofstream out(folder + "/" + kWorkersFile, std::ios::trunc);
  for (pid_t p : pids) out << p << '\n';
}

int remove_shm_names_of_recorded_workers(const std::string& folder, int wait_ms) {
  // Why O_NOFOLLOW and a size bound: the folder is ours, but a planted link or a huge file must
  // not make the agent read someone else's file or stall its start.
  int fd = ::open((folder + "/" + kWorkersFile).c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return 0;
  char buf[4096];
  ssize_t n = ::read(fd, buf, sizeof(buf));
  ::close(fd);
  if (n <= 0) return 0;
  std::istringstream in(std::string(buf, static_cast<std::size_t>(n)));
  std::set<pid_t> pids;
  for (std::string word; in >> word;) {  // anything but a pid is skipped
    char* end = nullptr;
    errno = 0;
    long p = std::strtol(word.c_str(), &end, 10);
    if (*end == '\0' && errno == 0 && p > 0 && p <= INT32_MAX) pids.insert(static_cast<pid_t>(p));
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_ms);
  std::set<pid_t> gone;
  for (;;) {
    for (pid_t p : pids) {
      if (gone_or_zombie(p)) gone.insert(p);
    }
    if (gone.size() == pids.size() || std::chrono::steady_clock::now() >= until) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return remove_shm_names([&gone](pid_t pid, const struct stat&) { return gone.contains(pid); });
}

}  // namespace accel::supervisor

// The folder of a job's in-memory snapshots on this node (snapshot_folder.h).
#include "agent/node/snapshot_folder.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "contract/worker_contract.h"

namespace accel::node {

namespace fs = std::filesystem;

namespace {

constexpr char kShm[] = "/dev/shm";
constexpr char kPrefix[] = "accel-snapshots-";

}  // namespace

bool wants_snapshots(const std::map<std::string, std::string>& worker_settings) {
  auto it = worker_settings.find(contract::kSnapshotInterval);
  if (it == worker_settings.end()) return false;
  char* end = nullptr;
  long n = std::strtol(it->second.c_str(), &end, 10);
  return end != it->second.c_str() && *end == '\0' && n > 0;
}

std::unique_ptr<SnapshotFolder> SnapshotFolder::create(const std::string& job_id,
                                                       std::string& why) {
  // Why a few tries: another agent's sweep may take a folder made a moment ago, before its lock.
  for (int attempt = 0; attempt < 3; ++attempt) {
    std::string path = std::string(kShm) + "/" + kPrefix + "XXXXXX";
    // Why mkdtemp: a name nobody can guess or make first (/dev/shm is everyone's), mode 0700.
    if (::mkdtemp(path.data()) == nullptr) {
      why = std::string("cannot make a folder in ") + kShm + " (" + std::strerror(errno) + ")";
      return nullptr;
    }
    int lock = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (lock >= 0 && ::flock(lock, LOCK_EX | LOCK_NB) == 0) {
      return std::unique_ptr<SnapshotFolder>(new SnapshotFolder(path, job_id, lock));
    }
    why = "cannot lock " + path + " (" + std::strerror(errno) + ")";
    if (lock >= 0) ::close(lock);
    std::error_code ec;
    fs::remove(path, ec);
  }
  return nullptr;
}

SnapshotFolder::~SnapshotFolder() {
  std::error_code ec;
  fs::remove_all(path_, ec);  // Why before the unlock: no sweeper may take it half removed
  if (lock_ >= 0) ::close(lock_);
}

int SnapshotFolder::remove_unheld() {
  DIR* dir = ::opendir(kShm);
  if (dir == nullptr) return 0;
  int removed = 0;
  while (const dirent* e = ::readdir(dir)) {
    if (std::strncmp(e->d_name, kPrefix, std::strlen(kPrefix)) != 0) continue;
    struct stat st {};
    // Why these checks: /dev/shm is shared; only our own folders (never a link, never another
    // user's) are ours to remove.
    if (::fstatat(::dirfd(dir), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISDIR(st.st_mode) ||
        st.st_uid != ::geteuid()) {
      continue;
    }
    int fd = ::openat(::dirfd(dir), e->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) continue;
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) {  // nobody holds it: its agent is gone
      std::error_code ec;
      fs::remove_all(fs::path(kShm) / e->d_name, ec);
      if (!ec) ++removed;
    }
    ::close(fd);
  }
  ::closedir(dir);
  return removed;
}

}  // namespace accel::node

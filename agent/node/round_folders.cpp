// Round folders in the state folder, and the locks that say which are in use (round_folders.h).
#include "agent/node/round_folders.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <filesystem>
#include <thread>

#include "agent/supervisor/shm_names.h"

namespace accel::node {

namespace fs = std::filesystem;

namespace {

// Whether `fd` is the file at `path` now (it was not removed, or replaced, since it was opened).
bool same_file(int fd, const fs::path& path) {
  struct stat opened = {};
  struct stat now = {};
  return ::fstat(fd, &opened) == 0 && ::lstat(path.c_str(), &now) == 0 &&
         opened.st_ino == now.st_ino && opened.st_dev == now.st_dev;
}

}  // namespace

// Creates `error_dir` and returns a descriptor of its parent (the job's folder) holding a shared
// flock(), or -1 when that cannot be had (the round runs anyway). Why: several agents may share a
// state folder (the default one is per node id, and two Slurm jobs on one machine each start an
// agent of the same id), and an agent that starts removes what agents that are gone left there
// (remove_unused_job_folders); the lock tells it which job folders are still in use. A starting
// agent holds its exclusive lock only while it removes a folder, so waiting for the shared one is
// short (waited for 0.2 s at a time); a folder it removed before we locked it is made again.
int create_and_lock_job_folder(const std::string& error_dir) {
  const fs::path job = fs::path(error_dir).parent_path();
  for (int attempt = 0; attempt < 5; ++attempt) {
    std::error_code ec;
    fs::create_directories(error_dir, ec);
    if (ec) return -1;
    int fd = ::open(job.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) continue;
    int rc = ::flock(fd, LOCK_SH | LOCK_NB);
    for (int wait = 0; rc != 0 && errno == EWOULDBLOCK && wait < 20; ++wait) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));  // bounded: see above
      rc = ::flock(fd, LOCK_SH | LOCK_NB);
    }
    const int lock_errno = errno;
    if (rc == 0 && same_file(fd, job) && fs::is_directory(error_dir, ec)) return fd;
    ::close(fd);
    // No locks on this file system: nothing to wait for (and no agent can tell ours apart).
    if (rc != 0 && lock_errno != EWOULDBLOCK) return -1;
  }
  return -1;
}

// Whether no agent holds `job` (a job folder in the state folder): its exclusive lock is free.
// Returns a descriptor holding that lock (close it after removing the folder), or -1.
static int lock_if_unused(const fs::path& job) {
  int fd = ::open(job.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return -1;
  // Why the identity check: the folder we opened may have been removed by its agent and made
  // again (and locked) by a new round since.
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0 || !same_file(fd, job)) {
    ::close(fd);
    return -1;
  }
  return fd;
}

int remove_unused_job_folders(const std::string& state_dir) {
  std::error_code ec;
  int removed = 0;
  for (const auto& job : fs::directory_iterator(state_dir, ec)) {
    std::error_code ec2;
    // Why symlink_status: a link planted here must not lead the sweep into someone's folders.
    if (!fs::is_directory(job.symlink_status(ec2))) continue;
    bool ours = true;
    for (const auto& round : fs::directory_iterator(job.path(), ec2)) {
      auto name = round.path().filename().string();
      ours = ours && fs::is_directory(round.symlink_status(ec2)) && name.rfind("attempt_", 0) == 0;
    }
    if (!ours || ec2) continue;
    int lock = lock_if_unused(job.path());
    if (lock < 0) continue;  // another agent's round, running now
    // Its workers died with their agent, unreaped: what they had in /dev/shm goes too.
    for (const auto& round : fs::directory_iterator(job.path(), ec2)) {
      supervisor::remove_shm_names_of_recorded_workers(round.path().string());
    }
    fs::remove_all(job.path(), ec2);
    ::close(lock);
    ++removed;
  }
  return removed;
}

}  // namespace accel::node

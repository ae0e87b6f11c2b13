// Temporary folders for the launcher and the agent.
#include "agent/common/temp_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <system_error>
#include <utility>
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

namespace {

constexpr const char* kOwnerFile = ".owner";

// Removes the accel-* folders of temp_root() owned by this user whose owner file nobody holds.
int remove_abandoned() {
  namespace fs = std::filesystem;
  int removed = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(temp_root(), ec)) {
    const std::string name = entry.path().filename().string();
    struct stat st {};
    if (name.rfind("accel-", 0) != 0 || ::lstat(entry.path().c_str(), &st) != 0 ||
        !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid())
      continue;
    int fd = ::open((entry.path() / kOwnerFile).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) continue;  // not ours, or one being made (its owner file is renamed in locked)
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) {
      std::error_code ignored;
      fs::remove_all(entry.path(), ignored);
      ++removed;
    }
    ::close(fd);
  }
  return removed;
}

}  // namespace

OwnedTempDir::OwnedTempDir(const std::string& prefix) {
  removed_ = remove_abandoned();
  std::string dir = make_temp_dir(prefix);
  if (dir.empty()) return;
  // Why under another name first: a sweeper must never find an owner file not yet locked.
  const std::string making = dir + "/.owner.making";
  int fd = ::open(making.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0 || ::flock(fd, LOCK_EX) != 0 ||
      ::rename(making.c_str(), (dir + "/" + kOwnerFile).c_str()) != 0) {
    int saved = errno;
    if (fd >= 0) ::close(fd);
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
    errno = saved;
    return;
  }
  path_ = std::move(dir);
  lock_fd_ = fd;
}

OwnedTempDir::OwnedTempDir(OwnedTempDir&& other) noexcept
    : path_(std::exchange(other.path_, {})),
      lock_fd_(std::exchange(other.lock_fd_, -1)),
      removed_(other.removed_) {}

OwnedTempDir& OwnedTempDir::operator=(OwnedTempDir&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::exchange(other.path_, {});
    lock_fd_ = std::exchange(other.lock_fd_, -1);
    removed_ = other.removed_;
  }
  return *this;
}

OwnedTempDir::~OwnedTempDir() { release(); }

void OwnedTempDir::release() {
  if (!path_.empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
    path_.clear();
  }
  if (lock_fd_ >= 0) ::close(lock_fd_);
  lock_fd_ = -1;
}

}  // namespace accel

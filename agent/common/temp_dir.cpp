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

// What an owner file says: the machine it was made on. Why: a $TMPDIR shared between machines
// (NFS with local locks) would let one machine's launcher take the lock of another's live one.
std::string this_host() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "?";
  return name;
}

// Removes the accel-* folders of temp_root() owned by this user, made on this machine, whose
// owner file nobody holds.
void remove_abandoned() {
  namespace fs = std::filesystem;
  const std::string owner_text = "host " + this_host() + "\n";
  std::error_code ec;
  fs::directory_iterator it(temp_root(), ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    const fs::path folder = it->path();
    struct stat st = {};
    if (folder.filename().string().rfind("accel-", 0) != 0 || ::lstat(folder.c_str(), &st) != 0 ||
        !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid())
      continue;
    int fd = ::open((folder / kOwnerFile).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) continue;  // not ours, or one being made (its owner file is renamed in locked)
    char text[300] = {};
    struct stat locked = {};
    // Why the link count: an owner that removed its folder and then let go is not abandoned.
    if (::pread(fd, text, sizeof text - 1, 0) >= 0 && owner_text == text &&
        ::flock(fd, LOCK_EX | LOCK_NB) == 0 && ::fstat(fd, &locked) == 0 && locked.st_nlink > 0) {
      std::error_code ignored;
      fs::remove_all(folder, ignored);
    }
    ::close(fd);
  }
}

}  // namespace

OwnedTempDir::OwnedTempDir(const std::string& prefix) {
  remove_abandoned();
  std::string dir = make_temp_dir(prefix);
  if (dir.empty()) return;
  path_ = std::move(dir);
  // Why under another name first: a sweeper must never find an owner file not yet locked.
  // Without a lock (a file system without flock) the folder is kept, unswept: a killed owner's
  // then stays, as it always did.
  const std::string making = path_ + "/.owner.making";
  const std::string text = "host " + this_host() + "\n";
  int fd = ::open(making.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd >= 0 && ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) &&
      ::flock(fd, LOCK_EX) == 0 &&
      ::rename(making.c_str(), (path_ + "/" + kOwnerFile).c_str()) == 0) {
    lock_fd_ = fd;
    return;
  }
  if (fd >= 0) ::close(fd);
  ::unlink(making.c_str());
}

OwnedTempDir::OwnedTempDir(OwnedTempDir&& other) noexcept
    : path_(std::exchange(other.path_, {})), lock_fd_(std::exchange(other.lock_fd_, -1)) {}

OwnedTempDir& OwnedTempDir::operator=(OwnedTempDir&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::exchange(other.path_, {});
    lock_fd_ = std::exchange(other.lock_fd_, -1);
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

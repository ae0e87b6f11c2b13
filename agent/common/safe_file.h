// Files created beside a path the user named, in a folder another user may be able to write to
// (a shared project folder, /tmp): never through a link planted there, never into a file that
// already exists. Header-only: the launcher's tools and the config commands both use it.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <system_error>

namespace accel {

// Creates "<path>.tmp-<16 random hex digits>" (O_CREAT | O_EXCL | O_NOFOLLOW, `mode`) and returns
// its descriptor, its name in `temp`; -1 with errno set when none could be made.
inline int create_temp_beside(const std::string& path, mode_t mode, std::string& temp) {
  std::random_device rd;
  for (int attempt = 0; attempt < 16; ++attempt) {
    char suffix[24];
    std::snprintf(suffix, sizeof suffix, ".tmp-%08x%08x", rd(), rd());
    temp = path + suffix;
    int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
    if (fd >= 0 || errno != EEXIST) return fd;
  }
  return -1;
}

// Creates `path` anew (O_CREAT | O_EXCL | O_NOFOLLOW, `mode`): a file or link already there is
// removed first (the link itself, never what it points to); one that cannot be removed (another
// user's, in a sticky folder) fails with EEXIST instead of being written through.
inline int create_fresh(const std::string& path, mode_t mode) {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) return -1;
  return ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
}

// Makes `dir` a folder only this user can change: creates it (its parents as needed) with mode
// 0700, or accepts an existing one that is a folder owned by this user and not writable by group
// or others; a symbolic link is accepted only with `follow_link` (a path the user named; never
// for a default in a shared folder such as /tmp, where anyone may plant one). Returns why not, or
// "" when it is fine.
inline std::string make_private_dir(const std::string& dir, bool follow_link) {
  std::filesystem::path p(dir);
  std::error_code ec;
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    return std::string("cannot create it: ") + std::strerror(errno);
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) return std::string("cannot read it: ") + std::strerror(errno);
  if (S_ISLNK(st.st_mode)) {
    if (!follow_link) return "it is a symbolic link (someone else may have planted it); remove it";
    if (::stat(dir.c_str(), &st) != 0)
      return std::string("cannot read it: ") + std::strerror(errno);
  }
  if (!S_ISDIR(st.st_mode)) return "it is not a folder";
  if (st.st_uid != ::geteuid())
    return "it belongs to user id " + std::to_string(st.st_uid) + ", not to this user (" +
           std::to_string(::geteuid()) + "); another user may control what is in it";
  if ((st.st_mode & 022) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return std::string("it is writable by group or others (mode ") + mode +
           "); chmod go-w it, or remove it";
  }
  return "";
}

}  // namespace accel

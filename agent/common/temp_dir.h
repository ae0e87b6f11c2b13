// Private temporary folders ($TMPDIR, else /tmp) for files no log_dir keeps: the workers' error
// files and progress pages.
#pragma once

#include <string>

namespace accel {

// $TMPDIR when set and non-empty, else "/tmp".
std::string temp_root();
// Creates <temp_root>/<prefix>XXXXXX (mkdtemp: mode 0700) and returns its path; empty on
// failure, with errno saying why.
std::string make_temp_dir(const std::string& prefix);

// A private temporary folder that a killed owner does not leave behind for long: the folder holds
// an flock()ed file, <path>/.owner, for as long as this object (or the process) lives; the kernel
// lets go of it however the process ends. Before it makes its own, it removes every folder of
// temp_root() named accel-* owned by this user whose .owner (which names the machine that made
// it) was made on this machine and no process holds: what a launcher SIGKILLed before it could
// remove its folder left. On a file system without flock() the folder is made without .owner and
// never swept. Moving it keeps the lock.
class OwnedTempDir {
 public:
  OwnedTempDir() = default;
  // <temp_root>/<prefix>XXXXXX; path() is empty on failure, with errno saying why.
  explicit OwnedTempDir(const std::string& prefix);
  OwnedTempDir(OwnedTempDir&& other) noexcept;
  OwnedTempDir& operator=(OwnedTempDir&& other) noexcept;
  ~OwnedTempDir();  // removes the folder and lets go of the lock
  [[nodiscard]] const std::string& path() const { return path_; }

 private:
  void release();
  std::string path_;
  int lock_fd_ = -1;
};

}  // namespace accel

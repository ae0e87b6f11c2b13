// Checkpoint file I/O through the CheckpointFs seam: durable, checksummed whole-file writes.
#include "runtime/checkpoint_io.h"

#include <fcntl.h>
#include <ftw.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <system_error>
#include <utility>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "accel/error.h"

namespace accel::ckpt {

namespace {

// write_stream starts the write-back of every this many bytes as they are written.
constexpr off_t kWriteBackBytes = off_t{8} << 20;

[[noreturn]] void fail(const fs::path& path, const std::string& what) {
  throw CheckpointError("accel: checkpoint: " + path.string() + ": " + what);
}

[[noreturn]] void fail(const fs::path& path, const std::string& what, int err) {
  fail(path, what + ": " + std::generic_category().message(err));
}

// Closes a descriptor on every path out.
struct Fd {
  int fd;
  explicit Fd(int f) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

std::atomic<CheckpointFs*> g_override{nullptr};

// Opens `path` for reading only if it is a regular file: not through a symbolic link
// (O_NOFOLLOW), and never waiting on a FIFO or a device (O_NONBLOCK, then fstat).
int open_regular(const fs::path& path) {
  Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK)};
  if (f.fd < 0) {
    if (errno == ELOOP)
      fail(path, "is a symbolic link; checkpoint files must be regular files inside the folder");
    fail(path, "cannot open", errno);
  }
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) fail(path, "cannot stat", errno);
  if (!S_ISREG(st.st_mode)) {
    fail(
        path,
        "is not a regular file (a FIFO, device or folder); checkpoint files must be regular files");
  }
  return std::exchange(f.fd, -1);
}

}  // namespace

uint64_t checksum(std::string_view bytes) { return XXH64(bytes.data(), bytes.size(), 0); }

std::string to_hex(uint64_t value) {
  static const char* kDigits = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, value >>= 4)
    out[static_cast<std::size_t>(i)] = kDigits[value & 0xf];
  return out;
}

WrittenFile CheckpointFs::write_stream(const fs::path& path,
                                       const std::function<void(const Sink&)>& produce) {
  Fd f{::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
  if (f.fd < 0) fail(path, "cannot create", errno);
  XXH64_state_t state;
  XXH64_reset(&state, 0);
  WrittenFile out;
  off_t flushed = 0;  // bytes whose write-back has been started
  auto sink = [&](std::string_view part) {
    XXH64_update(&state, part.data(), part.size());
    const char* p = part.data();
    std::size_t left = part.size();
    while (left > 0) {
      ssize_t n = ::write(f.fd, p, left);
      if (n < 0) {
        if (errno == EINTR) continue;
        fail(path, "write failed", errno);
      }
      p += n;
      left -= static_cast<std::size_t>(n);
    }
    out.size += part.size();
    // Why: start the disk writing what is written so far while the rest is produced, instead
    // of all of it at the fsync below; the fsync then waits for the tail only. Advice: a file
    // system without it (EINVAL, ENOSYS, ESPIPE) writes back at the fsync as before.
    const auto written = static_cast<off_t>(out.size);
    if (written - flushed >= kWriteBackBytes) {
      (void)::sync_file_range(f.fd, flushed, written - flushed, SYNC_FILE_RANGE_WRITE);
      flushed = written;
    }
  };
  try {
    produce(sink);
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::exception& e) {
    // Why: the producer (a serializer) knows what failed but not which file it was writing.
    fail(path, std::string("cannot produce the contents: ") + e.what());
  }
  if (::fsync(f.fd) != 0) fail(path, "fsync failed", errno);
  int fd = f.fd;
  f.fd = -1;
  if (::close(fd) != 0) fail(path, "close failed", errno);
  out.checksum = XXH64_digest(&state);
  return out;
}

WrittenFile CheckpointFs::write_file(const fs::path& path,
                                     const std::vector<std::string_view>& parts) {
  return write_stream(path, [&](const Sink& sink) {
    for (auto part : parts) sink(part);
  });
}

void CheckpointFs::sync_dir(const fs::path& dir) {
  Fd f{::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (f.fd < 0) fail(dir, "cannot open folder", errno);
  if (::fsync(f.fd) != 0) fail(dir, "fsync of folder failed", errno);
}

void CheckpointFs::rename(const fs::path& from, const fs::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) fail(from, "cannot rename to " + to.string(), errno);
}

bool CheckpointFs::exchange(const fs::path& a, const fs::path& b) {
  if (::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) == 0) return true;
  int err = errno;
  if (err == EINVAL || err == ENOSYS || err == EOPNOTSUPP || err == ENOTSUP) return false;
  fail(a, "cannot exchange with " + b.string(), err);
}

namespace {
int remove_entry(const char* path, const struct stat*, int, struct FTW*) {
  return ::remove(path) == 0 || errno == ENOENT ? 0 : errno;
}
}  // namespace

// Why nftw and not std::filesystem::remove_all: PyTorch's own libtorch builds (pip wheels) export
// a copy of std::filesystem from an older libstdc++; the system libstdc++'s remove_all then
// reached a null function through it and crashed (seen with libtorch 2.11 + CUDA 13 on an H200).
void CheckpointFs::remove_all(const fs::path& path) {
  int rc = ::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS);
  if (rc == -1 && errno == ENOENT) return;
  if (rc != 0) fail(path, "cannot remove", rc == -1 ? errno : rc);
}

void CheckpointFs::create_directories(const fs::path& path) {
  std::error_code ec;
  fs::create_directories(path, ec);
  if (ec) fail(path, "cannot create folder", ec.value());
}

void CheckpointFs::create_directories_durably(const fs::path& path) {
  std::vector<fs::path> created;  // the missing folders, deepest first
  std::error_code ec;
  for (fs::path p = path; !p.empty() && !fs::exists(p, ec); p = p.parent_path()) {
    created.push_back(p);
    if (p == p.parent_path()) break;
  }
  create_directories(path);
  for (auto it = created.rbegin(); it != created.rend(); ++it) {
    sync_dir(it->has_parent_path() ? it->parent_path() : fs::path("."));
  }
}

std::string CheckpointFs::read_file(const fs::path& path) {
  Fd f{open_regular(path)};
  off_t end = ::lseek(f.fd, 0, SEEK_END);
  if (end < 0 || ::lseek(f.fd, 0, SEEK_SET) < 0) fail(path, "cannot seek", errno);
  std::string out(static_cast<std::size_t>(end), '\0');
  std::size_t got = 0;
  while (got < out.size()) {
    ssize_t n = ::read(f.fd, out.data() + got, out.size() - got);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail(path, "read failed", errno);
    }
    if (n == 0) break;  // the file shrank while we read it
    got += static_cast<std::size_t>(n);
  }
  out.resize(got);
  return out;
}

MappedFile CheckpointFs::map_file(const fs::path& path) {
  Fd f{open_regular(path)};
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) fail(path, "cannot stat", errno);
  if (st.st_size == 0) return {};
  // Why MAP_POPULATE: one call maps every page (reading ahead from disk if needed) instead of a
  // page fault per 4 KiB later, which costs more than the copy it replaces on a VM.
  void* data = ::mmap(nullptr, static_cast<std::size_t>(st.st_size), PROT_READ,
                      MAP_PRIVATE | MAP_POPULATE, f.fd, 0);
  if (data == MAP_FAILED) fail(path, "cannot map", errno);
  return {data, static_cast<std::size_t>(st.st_size)};
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    if (data_) ::munmap(data_, size_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(data_, size_);
}

CheckpointFs& checkpoint_fs() {
  static CheckpointFs real;
  CheckpointFs* o = g_override.load();
  return o ? *o : real;
}

void set_checkpoint_fs_for_testing(CheckpointFs* fs) { g_override.store(fs); }

}  // namespace accel::ckpt

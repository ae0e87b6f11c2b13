// Checkpoint file I/O through the CheckpointFs seam: durable, checksummed whole-file writes.
#include "runtime/checkpoint_io.h"

#include <fcntl.h>
#include <ftw.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "accel/error.h"
#include "runtime/yielding.h"

namespace accel::ckpt {

namespace {

// write_stream starts the write-back of every this many bytes as they are written.
constexpr off_t kWriteBackBytes = off_t{8} << 20;
// write_stream hashes and writes a part in pieces of this many bytes (a multiple of the block
// size).
constexpr std::size_t kPiece = std::size_t{8} << 20;

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

// Writes a file with O_DIRECT: the bytes go from two aligned buffers of our own straight to the
// disk, without the kernel copying them into the page cache first (that copy, and the page
// cache's dirty-page throttling, took most of a large save here). While one buffer is being
// written by a thread of its own, the producer fills the other, so serializing and hashing
// overlap the disk. Bytes the producer already has in page-aligned memory, at a page-aligned
// place in the file (a background save's file, laid out in memory as the file), are written from
// that memory, with no copy. A file system that refuses an aligned O_DIRECT write (EINVAL) gets
// the rest through the page cache instead; the tail that is not a whole block always does.
class DirectWriter {
 public:
  DirectWriter(int fd, const fs::path& path) : fd_(fd), path_(path) {}
  DirectWriter(const DirectWriter&) = delete;
  DirectWriter& operator=(const DirectWriter&) = delete;
  ~DirectWriter() {
    if (thread_.joinable()) {
      {
        std::lock_guard<std::mutex> lock(m_);
        stop_ = true;
      }
      cv_.notify_all();
      thread_.join();
    }
  }

  // What append() wrote from the caller's memory may still be being written when it returns:
  // the caller keeps that memory as it is until settle() (or finish()) returns. Nothing that
  // can throw runs here while such a write is in flight, except waiting for it (which throws
  // only once it has ended).
  void append(std::string_view part) {
    if (bufs_[filling_].used == 0 && offset_ % kAlign == 0 &&
        reinterpret_cast<std::uintptr_t>(part.data()) % kAlign == 0 && part.size() >= kAlign) {
      const std::size_t whole = part.size() / kAlign * kAlign;
      hand_over(part.data(), whole);
      borrowed_ = true;
      offset_ += static_cast<off_t>(whole);
      part.remove_prefix(whole);
    }
    while (!part.empty()) {
      Buffer& b = bufs_[filling_];
      if (!b.data) {
        // Why wait first: the allocation may throw, and nothing that throws may run while the
        // thread writes from the caller's memory, which the caller frees as the throw unwinds.
        settle();
        allocate(b);
      }
      std::size_t n = std::min(part.size(), kBufferBytes - b.used);
      std::memcpy(b.data.get() + b.used, part.data(), n);
      b.used += n;
      part.remove_prefix(n);
      if (b.used == kBufferBytes) submit();
    }
  }

  // Returns once nothing is being written from the caller's memory; throws what the write met.
  void settle() {
    if (!borrowed_) return;
    borrowed_ = false;
    wait_idle();
  }

  // Writes what is left; the caller fsyncs.
  void finish() {
    Buffer& b = bufs_[filling_];
    const std::size_t whole = b.used / kAlign * kAlign, tail = b.used - whole;
    if (whole > 0) {
      b.used = whole;
      submit();
    }
    wait_idle();
    if (tail > 0) {
      // Why: O_DIRECT writes whole blocks only; the last partial one goes through the page cache.
      const char* from = whole == 0 ? b.data.get() : bufs_[1 - filling_].data.get() + whole;
      int flags = ::fcntl(fd_, F_GETFL);
      if (flags < 0 || ::fcntl(fd_, F_SETFL, flags & ~O_DIRECT) != 0)
        fail(path_, "cannot leave O_DIRECT", errno);
      try {
        write_all(from, tail, offset_);
      } catch (const std::system_error& e) {
        fail(path_, "write failed", e.code().value());
      }
      offset_ += static_cast<off_t>(tail);
    }
  }

 private:
  static constexpr std::size_t kAlign = 4096;
  static constexpr std::size_t kBufferBytes = std::size_t{8} << 20;
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  struct Buffer {
    std::unique_ptr<char, Free> data;
    std::size_t used = 0;
  };

  // Why lazily: most files of a checkpoint (the manifest, RNG states) are a few KiB, written
  // whole from the first buffer's tail; only a file that fills a buffer gets the second one and
  // the thread (or one written from the producer's memory: the thread, and a buffer for its
  // tail). The pages of a buffer are touched only as far as it is filled.
  void allocate(Buffer& b) {
    void* p = nullptr;
    int err = ::posix_memalign(&p, kAlign, kBufferBytes);
    if (err != 0) fail(path_, "cannot allocate the write buffer", err);
    b.data.reset(static_cast<char*>(p));
  }

  // Hands `n` bytes at `p` to the thread, to be written at offset_, once it has written what it
  // had.
  void hand_over(const char* p, std::size_t n) {
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
    wait_idle();
    {
      std::lock_guard<std::mutex> lock(m_);
      pending_ = Job{p, n, offset_};
    }
    cv_.notify_all();
  }

  // Hands the filled buffer to the thread, once it has written the previous one.
  void submit() {
    hand_over(bufs_[filling_].data.get(), bufs_[filling_].used);
    borrowed_ = false;
    offset_ += static_cast<off_t>(bufs_[filling_].used);
    filling_ = 1 - filling_;
    if (!bufs_[filling_].data) allocate(bufs_[filling_]);
    bufs_[filling_].used = 0;
  }

  void wait_idle() {
    std::unique_lock<std::mutex> lock(m_);
    cv_.wait(lock, [this] { return !pending_; });
    if (error_ != 0) fail(path_, "write failed", error_);
  }

  void run() {
    std::unique_lock<std::mutex> lock(m_);
    for (;;) {
      cv_.wait(lock, [this] { return stop_ || pending_; });
      if (!pending_) return;  // stopped with nothing to write
      const Job job = *pending_;
      lock.unlock();
      int err = 0;
      try {
        write_all(job.p, job.n, job.at);
      } catch (const std::system_error& e) {
        err = e.code().value();
      }
      lock.lock();
      if (err != 0 && error_ == 0) error_ = err;
      pending_.reset();
      cv_.notify_all();
    }
  }

  // pwrite until done; an O_DIRECT write the file system refuses is retried through the page
  // cache (and the rest of the file goes that way too).
  void write_all(const char* p, std::size_t left, off_t at) {
    while (left > 0) {
      ssize_t n = ::pwrite(fd_, p, left, at);
      if (n < 0) {
        const int err = errno;
        if (err == EINTR) continue;
        int flags = ::fcntl(fd_, F_GETFL);
        if (err == EINVAL && flags >= 0 && (flags & O_DIRECT) != 0 &&
            ::fcntl(fd_, F_SETFL, flags & ~O_DIRECT) == 0)
          continue;
        throw std::system_error(err, std::generic_category());
      }
      p += n;
      at += n;
      left -= static_cast<std::size_t>(n);
    }
  }

  int fd_;
  fs::path path_;
  Buffer bufs_[2];
  int filling_ = 0;
  off_t offset_ = 0;  // where the filling buffer starts in the file
  std::thread thread_;
  std::mutex m_;
  std::condition_variable cv_;
  // What the thread writes: a buffer of ours, or the producer's own memory.
  struct Job {
    const char* p;
    std::size_t n;
    off_t at;
  };
  std::optional<Job> pending_;
  bool borrowed_ = false;  // the job handed over last was the caller's memory (writer's side)
  bool stop_ = false;
  int error_ = 0;
};

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

namespace {

// Writes all of `part` to `fd` (buffered I/O), retrying short writes and EINTR.
void write_all(int fd, std::string_view part, const fs::path& path) {
  const char* p = part.data();
  std::size_t left = part.size();
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail(path, "write failed", errno);
    }
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

}  // namespace

WrittenFile CheckpointFs::write_stream(const fs::path& path,
                                       const std::function<void(const Sink&)>& produce) {
  constexpr int kFlags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW;
  Fd f{::open(path.c_str(), kFlags | O_DIRECT, 0644)};
  bool direct = f.fd >= 0;
  // Why: tmpfs (before Linux 6.6) and some FUSE file systems refuse O_DIRECT at open; they get
  // the page cache.
  if (f.fd < 0 && (errno == EINVAL || errno == EOPNOTSUPP || errno == ENOTSUP))
    f.fd = ::open(path.c_str(), kFlags, 0644);
  if (f.fd < 0) fail(path, "cannot create", errno);
  XXH64_state_t state;
  XXH64_reset(&state, 0);
  WrittenFile out;
  std::optional<DirectWriter> writer;  // after `f`: joined before the descriptor closes
  if (direct) writer.emplace(f.fd, path);
  off_t flushed = 0;  // buffered: bytes whose write-back has been started
  // Why in pieces: with O_DIRECT each is hashed while the thread writes the one before (a whole
  // file the writer sends from the producer's memory, in particular); through the page cache,
  // the write-back of each starts while the next is written.
  auto sink = [&](std::string_view part) {
    for (std::size_t at = 0; at < part.size(); at += kPiece) {
      auto piece = part.substr(at, kPiece);
      in_yielding_pieces(piece.size(), [&](std::size_t from, std::size_t len) {
        XXH64_update(&state, piece.data() + from, len);
      });
      out.size += piece.size();
      if (writer) {
        writer->append(piece);
        continue;
      }
      write_all(f.fd, piece, path);
      // Why: start the disk writing what is written so far while the rest is produced, instead
      // of all of it at the fsync below; the fsync then waits for the tail only. Advice: a file
      // system without it (EINVAL, ENOSYS, ESPIPE) writes back at the fsync as before.
      const auto written = static_cast<off_t>(out.size);
      if (written - flushed >= kWriteBackBytes) {
        (void)::sync_file_range(f.fd, flushed, written - flushed, SYNC_FILE_RANGE_WRITE);
        flushed = written;
      }
    }
    // Why: a producer may free or reuse a part once the sink returns (libtorch's archive does).
    if (writer) writer->settle();
  };
  try {
    produce(sink);
    if (writer) writer->finish();
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::exception& e) {
    // Why: the producer (a serializer) knows what failed but not which file it was writing.
    fail(path, std::string("cannot produce the contents: ") + e.what());
  }
  writer.reset();
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

WrittenFile CheckpointFs::write_in_place(const fs::path& path,
                                         const std::function<void(const Sink&)>& produce) {
  Fd f{::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644)};
  if (f.fd < 0) fail(path, "cannot create", errno);
  WrittenFile out;
  auto sink = [&](std::string_view part) {
    write_all(f.fd, part, path);
    out.size += part.size();
  };
  try {
    produce(sink);
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::exception& e) {
    fail(path, std::string("cannot produce the contents: ") + e.what());
  }
  if (::ftruncate(f.fd, static_cast<off_t>(out.size)) != 0) fail(path, "cannot cut to size", errno);
  int fd = f.fd;
  f.fd = -1;
  if (::close(fd) != 0) fail(path, "close failed", errno);
  return out;
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
  // Why no MAP_POPULATE: a read of a file's page cache faults 64 KiB of pages in at a time
  // (the kernel's fault-around), and on a VM whose hypervisor shadows the guest's page tables a
  // populated page still traps at the program's first read: 300 MB in the page cache read
  // through a mapping in 26 ms, 178-600 ms populated first (bench_checkpoint memory). MADV_WILLNEED
  // starts reading the whole file ahead instead (advice: a failure changes nothing but the speed).
  void* data =
      ::mmap(nullptr, static_cast<std::size_t>(st.st_size), PROT_READ, MAP_PRIVATE, f.fd, 0);
  if (data == MAP_FAILED) fail(path, "cannot map", errno);
  (void)::madvise(data, static_cast<std::size_t>(st.st_size), MADV_WILLNEED);
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

// Checkpoint file I/O: whole-file writes that are durable (fsync) and checksummed, atomic folder
// publication (write into a temp folder, fsync, rename), and reads that say what is wrong.
// The OS calls go through one seam, CheckpointFs (LevelDB's Env), that tests wrap to inject
// faults such as a process killed half-way through a save.
// Thread: any; the seam in use is process-wide and set only by tests before a save.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace accel::ckpt {

namespace fs = std::filesystem;

// xxHash64 (seed 0) of `bytes`; the manifest stores it as 16 lowercase hex digits.
uint64_t checksum(std::string_view bytes);
std::string to_hex(uint64_t value);

// What writing one file produced.
struct WrittenFile {
  uint64_t size = 0;
  uint64_t checksum = 0;  // xxHash64 of all the bytes written, in order
};

// A file's bytes, mapped read-only (mmap; pages filled from the page cache at once, no copy).
// Movable; the view is valid while this object lives.
class MappedFile {
 public:
  MappedFile() = default;
  MappedFile(void* data, std::size_t size) : data_(data), size_(size) {}
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();
  std::string_view view() const { return {static_cast<const char*>(data_), size_}; }
  std::size_t size() const { return size_; }

 private:
  void* data_ = nullptr;  // null for an empty file
  std::size_t size_ = 0;
};

// Receives a file's bytes in order, in pieces of any size. The sink is done with a piece when it
// returns (the writer may have sent it to the disk from the caller's memory until then).
using Sink = std::function<void(std::string_view)>;

// The OS seam. Every method throws CheckpointError (accel/error.h) naming the path and the
// OS error on failure.
class CheckpointFs {
 public:
  virtual ~CheckpointFs() = default;
  // Creates or truncates `path`, writes what `produce` passes to its sink, fsyncs, closes.
  // Nothing is buffered in memory: a large file streams from its producer to the kernel.
  virtual WrittenFile write_stream(const fs::path& path,
                                   const std::function<void(const Sink&)>& produce);
  // write_stream of `parts`, one after another.
  WrittenFile write_file(const fs::path& path, const std::vector<std::string_view>& parts);
  // For files in memory (tmpfs: in-memory snapshots): writes into `path` in place, reusing the
  // pages of a file already there (cut to size at the end), with plain write(): no O_DIRECT, no
  // checksum (the result's is 0), no fsync. One copy of every byte, into the file.
  virtual WrittenFile write_in_place(const fs::path& path,
                                     const std::function<void(const Sink&)>& produce);
  // fsync of a directory, so entries created or renamed in it survive a power loss.
  virtual void sync_dir(const fs::path& dir);
  virtual void rename(const fs::path& from, const fs::path& to);
  // Swaps two existing entries in one step (renameat2 RENAME_EXCHANGE): no moment without `b`.
  // False, with nothing changed, when the file system cannot (NFS and some FUSE file systems).
  virtual bool exchange(const fs::path& a, const fs::path& b);
  virtual void remove_all(const fs::path& path);
  virtual void create_directories(const fs::path& path);
  // create_directories, then sync_dir of the parent of every folder it created, so that a new
  // folder's entry survives a power loss too.
  void create_directories_durably(const fs::path& path);
  // The whole file; CheckpointError when it cannot be opened or read.
  virtual std::string read_file(const fs::path& path);
  // The whole file, mapped; CheckpointError when it cannot be opened or mapped.
  virtual MappedFile map_file(const fs::path& path);
};

// The seam in use (the real file system unless a test installed another).
CheckpointFs& checkpoint_fs();
// Installs `fs` (not owned; null restores the real one). For tests only.
void set_checkpoint_fs_for_testing(CheckpointFs* fs);

}  // namespace accel::ckpt

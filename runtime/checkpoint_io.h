// Checkpoint file I/O: whole-file writes that are durable (fsync) and checksummed, atomic folder
// publication (write into a temp folder, fsync, rename), and reads that say what is wrong.
// The OS calls go through one seam, CheckpointFs (LevelDB's Env), that tests wrap to inject
// faults such as a process killed half-way through a save.
// Thread: any; the seam in use is process-wide and set only by tests before a save.
#pragma once

#include <cstdint>
#include <filesystem>
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

// The OS seam. Every method throws CheckpointError (accel/checkpoint.h) naming the path and the
// OS error on failure.
class CheckpointFs {
 public:
  virtual ~CheckpointFs() = default;
  // Creates or truncates `path`, writes `parts` one after another, fsyncs, closes.
  virtual WrittenFile write_file(const fs::path& path, const std::vector<std::string_view>& parts);
  // fsync of a directory, so entries created or renamed in it survive a power loss.
  virtual void sync_dir(const fs::path& dir);
  virtual void rename(const fs::path& from, const fs::path& to);
  // Swaps two existing entries in one step (renameat2 RENAME_EXCHANGE): no moment without `b`.
  virtual void exchange(const fs::path& a, const fs::path& b);
  virtual void remove_all(const fs::path& path);
  virtual void create_directories(const fs::path& path);
  // The whole file; CheckpointError when it cannot be opened or read.
  virtual std::string read_file(const fs::path& path);
};

// The seam in use (the real file system unless a test installed another).
CheckpointFs& checkpoint_fs();
// Installs `fs` (not owned; null restores the real one). For tests only.
void set_checkpoint_fs_for_testing(CheckpointFs* fs);

}  // namespace accel::ckpt

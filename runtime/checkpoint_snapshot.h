// SnapshotCopies: what a background save (SaveStateOptions::async) copies of the live state, and
// when, and into what. save_state lays each safetensors file out as the file itself, in one block
// of page-aligned memory: the header (padded so the data starts on a page), then each tensor's
// bytes. Those of CPU tensors that only an optimizer step changes (parameters, optimizer state)
// are queued; the writer thread copies them in before it writes, while the program's next
// forward and backward run; the next optimizer step waits for them (wait()), usually finished by
// then. The writer then sends the block to the disk as it is (O_DIRECT from this memory: only
// the last partial 4 KiB block, or a file system that refuses O_DIRECT, takes a copy). The
// blocks are kept from one save to the next, so a save after the first copies into memory that
// is already mapped.
#pragma once

#include <torch/types.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/safetensors.h"

namespace accel::ckpt {

class SnapshotCopies {
 public:
  // A save begins: nothing queued, the kept blocks handed out again from the first.
  void begin();
  // The safetensors file of `tensors` (with `metadata`), laid out in a kept block (or a new one
  // when the next is still held, or too small): its one data tensor is the whole file's bytes,
  // starting on a page. The bytes of the CPU tensors for which copy_later[i] holds (those only an
  // optimizer step changes) are filled in by copy(); the others' (GPU tensors included) are
  // copied now. Throws CheckpointError, with `where` (the file) first, for tensors safetensors
  // cannot hold or memory that cannot be had.
  safetensors::Encoded defer_file(const safetensors::NamedTensors& tensors,
                                  const std::vector<bool>& copy_later,
                                  const std::map<std::string, std::string>& metadata,
                                  const std::string& where);
  // The copies queued since the last start() are about to be handed to a writer: wait() blocks
  // until copy() or abandon() runs.
  void start();
  // As start(), for a writer that reads the live state itself (an in-memory snapshot): wait()
  // blocks until copy() or abandon() runs, whatever was queued.
  void hold();
  // On the writer thread: makes the queued copies, then lets wait() return (also on a throw).
  void copy();
  // The writer will not run (it could not start, or the save failed before it): wait() returns.
  void abandon();
  // Blocks until the copies are made. At once when none are pending.
  void wait();
  // Forgets the kept blocks (free_memory()); a file in flight keeps its own until written.
  void release();
  // After begin() and the defer_file() calls a save would make, instead of start(): keeps the
  // blocks and forgets the copies, then maps every page of the blocks on a thread of its own,
  // so that the first background save copies into memory already mapped (on a VM a page fault
  // every 4 KiB made most of that copy's time). copy() runs beside that thread, its tensors last
  // first; release() waits for it to end. It keeps the memory it maps alive by itself, and changes
  // no byte of it.
  void prefault();
  // Whether blocks are kept (a background save ran, or prefault()).
  bool has_blocks() const { return !kept_.empty(); }

  // Memory of our own, page-aligned, which a save hands out as the bytes of one file.
  struct Block;

 private:
  struct Queued {
    torch::Tensor file;  // the file's bytes, as handed out
    std::size_t offset;  // where the tensor's bytes start in it
    // Detached when queued: its sizes stay those the header gives it, whatever the program
    // does to the parameter meanwhile.
    torch::Tensor live;
  };
  std::vector<Queued> queued_;
  std::vector<std::shared_ptr<Block>> kept_;  // the blocks of the last save, file by file
  std::size_t next_ = 0;                      // kept_ index of the next defer_file()
  std::mutex mutex_;
  std::condition_variable done_;
  bool pending_ = false;
  std::future<void> touching_;  // prefault()'s thread, under mutex_
  // Waits for prefault()'s thread, if one runs.
  void join_touching();
};

// Tests: runs on the writer thread at the start of each copy() (empty: nothing). Set it only while
// no background save is in flight.
void set_copy_hook_for_testing(std::function<void()> hook);
// Tests: runs on the thread of each later prefault() before it touches a page (empty: nothing).
// Set it only while no prefault() call runs.
void set_touch_hook_for_testing(std::function<void()> hook);

}  // namespace accel::ckpt

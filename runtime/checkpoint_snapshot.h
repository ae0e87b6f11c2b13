// SnapshotCopies: what a background save (SaveStateOptions::async) copies of the live state, and
// when. save_state queues each CPU tensor that only an optimizer step changes (parameters,
// optimizer state) and gets back the buffer its copy will be in; the writer thread makes the
// copies before it writes, while the program's next forward and backward run; the next optimizer
// step waits for them (wait()), usually finished by then. The buffers are kept from one save to
// the next (same shapes, same order), so a save after the first copies into memory that is
// already mapped.
#pragma once

#include <torch/types.h>

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <future>
#include <mutex>
#include <utility>
#include <vector>

namespace accel::ckpt {

class SnapshotCopies {
 public:
  // A save begins: nothing queued, the kept buffers handed out again from the first.
  void begin();
  // A CPU tensor of `live`'s dtype and shape that holds its values once copy() has run.
  torch::Tensor defer(const torch::Tensor& live);
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
  // Forgets the kept buffers (free_memory()); a copy in flight keeps its own until written.
  void release();
  // After begin() and the defer() calls a save would make, instead of start(): keeps the buffers
  // and forgets the copies, then touches every page of the buffers on a thread of its own, so
  // that the first background save copies into memory already mapped (on a VM a page fault every
  // 4 KiB made most of that copy's time). copy() (with copies queued) and release() wait for
  // the touching to end; the thread keeps the memory it touches alive by itself.
  void prefault();
  // Whether buffers are kept (a background save ran, or prefault()).
  bool has_buffers() const { return !kept_.empty(); }

 private:
  std::vector<std::pair<torch::Tensor, torch::Tensor>> queued_;  // (buffer, live)
  std::vector<torch::Tensor> kept_;  // the buffers of the last save, in the order deferred
  std::size_t next_ = 0;             // kept_ index of the next defer()
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

}  // namespace accel::ckpt

// Lending a CPU from training to a background save. A process that trains alone on a machine
// runs its matrix products on every CPU (OpenBLAS starts a thread per CPU whatever ATen's own
// count, which Debian's libtorch does not pass on to it), and a background save's thread that
// copies and writes beside them takes turns with one of OpenBLAS's threads: each product waits
// for its slower part, so the save costs training several times its own CPU time. While the
// save's thread works, such a process runs OpenBLAS on one thread fewer, and gives it back at
// the first batch or optimizer step after the thread ends.
// Only OpenBLAS's count: changing ATen's (at::set_num_threads) also resizes process-wide pools
// and clears oneDNN's cache. Only a process alone on its machine: among several ranks, the one
// that saves would become the slowest, and every rank waits for it.
#pragma once

#include <atomic>
#include <string>

namespace accel::cpu_loan {

// The threads one process runs a product on: ATen's intra-op threads (the calling thread's
// count) and, where the process has an OpenBLAS that says, OpenBLAS's own.
struct Counts {
  int aten = 1;
  int blas = 0;  // 0: no OpenBLAS that says
  [[nodiscard]] int most() const { return aten > blas ? aten : blas; }
};

// This process's counts, asked on the calling thread.
Counts current();

// The count a process of `local_ranks` on a machine of `cpus` CPUs (each running `threads`)
// would lower its own to, so that the machine's training threads leave one CPU: `cpus` - 1 less
// the other ranks' threads; 0 when nothing is to change (a CPU is left already, or freeing one
// would need fewer than 1 thread).
int lowered_count(int local_ranks, int threads, int cpus);

// One background save's loan. lend() and give_back() run on the thread that trains;
// save_ended() on the save's thread.
class Loan {
 public:
  // Before the save's thread starts: when this process is alone on its machine
  // (`local_ranks` 1) and OpenBLAS's threads fill all `cpus` (and ATen's do not), lowers
  // OpenBLAS's count so that one CPU is left. Returns the machine's training threads from then
  // on (where the save's writer may be placed).
  int lend(int local_ranks, int cpus);
  // The save's thread ends (also when it fails).
  void save_ended() noexcept { ended_.store(true, std::memory_order_release); }
  // At each batch of a prepared loader and each optimizer step: gives the CPU back once the
  // save's thread has ended.
  void give_back_if_ended() {
    if (lent_ && ended_.load(std::memory_order_acquire)) give_back();
  }
  // Gives the CPU back now (the save's thread has been joined, or never started). A count the
  // program itself set meanwhile stays as it set it, unless it set the lowered one.
  void give_back();
  [[nodiscard]] bool lent() const { return lent_; }
  // What the last lend() did, in the words of the debug line that says so; "" when nothing.
  [[nodiscard]] const std::string& said() const { return said_; }

 private:
  std::atomic<bool> ended_{true};
  bool lent_ = false;
  int before_ = 0, lowered_ = 0;  // OpenBLAS's count before the loan and during it
  std::string said_;
};

}  // namespace accel::cpu_loan

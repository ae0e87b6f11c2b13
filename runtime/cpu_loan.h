// Lending a CPU from training to a background save. A process that trains alone on a machine
// runs its matrix products on every CPU (OpenBLAS starts a thread per CPU, whatever ATen's own
// count), and a background save's thread that copies and writes beside it then takes turns with
// one of those threads: every product waits for its slowest part, so the save costs training
// several times its own CPU time (on a 2-vCPU VM, 110-140 ms a save of 300 MB against 20-35 ms
// with the second thread left out while it writes). While the save's thread works, the process
// runs its products on one CPU fewer, and gives the CPU back at the first optimizer step after.
#pragma once

#include <atomic>
#include <string>

namespace accel::cpu_loan {

// The threads one process runs a product on: ATen's intra-op threads and, where the process has
// an OpenBLAS that says, OpenBLAS's own (Debian's libtorch does not pass its count on to it).
struct Counts {
  int aten = 1;
  int blas = 0;  // 0: no OpenBLAS that says
  [[nodiscard]] int most() const { return aten > blas ? aten : blas; }
};

// This process's counts, asked on the calling thread (ATen's count is the thread's own).
Counts current();

// The count a process of `local_ranks` on a machine of `cpus` CPUs (each running `threads`)
// lowers its own to, so that the machine's training threads leave one CPU: `cpus` - 1 less the
// other ranks' threads; 0 when nothing is to change (a CPU is left already, or freeing one would
// need fewer than 1).
int lowered_count(int local_ranks, int threads, int cpus);

// One background save's loan. lend() and give_back() run on the thread that trains (ATen's
// count is that thread's); save_ended() on the save's thread.
class Loan {
 public:
  // Before the save's thread starts: lowers this process's counts when the machine's training
  // threads (`local_ranks` x the process's count) keep all `cpus` busy. Returns the machine's
  // training threads from then on (where the save's writer may be placed).
  int lend(int local_ranks, int cpus);
  // The save's thread ends (also when it fails).
  void save_ended() noexcept { ended_.store(true, std::memory_order_release); }
  // Each optimizer step: gives the CPU back once the save's thread has ended.
  void give_back_if_ended() {
    if (lent_ && ended_.load(std::memory_order_acquire)) give_back();
  }
  // Gives the CPU back now (the save's thread has been joined, or never started). A count the
  // program itself changed meanwhile stays as the program set it.
  void give_back();
  [[nodiscard]] bool lent() const { return lent_; }
  // What the last lend() did, in the words of the debug line that says so; "" when nothing.
  [[nodiscard]] const std::string& said() const { return said_; }

 private:
  std::atomic<bool> ended_{true};
  bool lent_ = false;
  Counts before_, lowered_;
  std::string said_;
};

}  // namespace accel::cpu_loan

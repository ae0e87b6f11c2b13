// Work that a background save's thread does in pieces, giving its CPU back between them.
#pragma once

#include <sched.h>

#include <algorithm>
#include <cstddef>

namespace accel::ckpt {

// Why: a background save's thread shares a CPU with one of training's threads where training
// keeps every CPU busy. OpenBLAS's threads wait for work by calling sched_yield, so the save's
// thread gets that CPU whenever they do, and without yielding itself would keep it until the
// scheduler's next tick (4 ms at HZ=250) while the product that thread's part of waits; a step
// holds many products. A piece of 256 KiB takes tens of microseconds to copy or hash.
inline constexpr std::size_t kYieldBytes = std::size_t{256} << 10;

// Whether this thread yields between pieces: a background save's thread where training keeps
// every CPU busy; never a thread that training waits for (a save in the foreground).
inline thread_local bool yields_between_pieces = false;

// Calls work(at, length) over [0, n): in pieces of kYieldBytes with a yield after each on a
// thread that yields_between_pieces, else at once.
template <class Work>
void in_yielding_pieces(std::size_t n, Work&& work) {
  if (!yields_between_pieces) {
    if (n > 0) work(0, n);
    return;
  }
  for (std::size_t at = 0; at < n; at += kYieldBytes) {
    work(at, std::min(kYieldBytes, n - at));
    ::sched_yield();
  }
}

}  // namespace accel::ckpt

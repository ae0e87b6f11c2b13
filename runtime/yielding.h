// Work that a background save's thread does in pieces, giving its CPU back between them.
#pragma once

#include <sched.h>

#include <algorithm>
#include <cstddef>

namespace accel::ckpt {

// Why: a background save's thread can share a CPU with one of training's threads. OpenBLAS's
// threads wait for work by calling sched_yield, so the save's thread gets that CPU whenever they
// do, and without yielding itself would keep it until the scheduler's next tick (4 ms at
// HZ=250) while the product that thread's part of waits; a step holds many products. A piece of
// 256 KiB takes tens of microseconds to copy or hash.
inline constexpr std::size_t kYieldBytes = std::size_t{256} << 10;

// Calls work(at, length) over [0, n) in pieces of kYieldBytes, yielding the CPU after each
// (sched_yield returns at once where nothing else waits for the CPU).
template <class Work>
void in_yielding_pieces(std::size_t n, Work&& work) {
  for (std::size_t at = 0; at < n; at += kYieldBytes) {
    work(at, std::min(kYieldBytes, n - at));
    ::sched_yield();
  }
}

}  // namespace accel::ckpt

// How many threads a process runs its matrix products on. Debian's libtorch does not pass
// ATen's intra-op thread count on to OpenBLAS, which starts a thread per CPU of its own unless
// OMP_NUM_THREADS or OPENBLAS_NUM_THREADS says otherwise: a process that trains alone on a
// machine keeps every CPU busy in its products even where ATen's count is 1.
#pragma once

namespace accel::product_threads {

struct Counts {
  int aten = 1;  // ATen's intra-op threads (the calling thread's count)
  int blas = 0;  // OpenBLAS's own threads; 0: no OpenBLAS that says
  [[nodiscard]] int most() const { return aten > blas ? aten : blas; }
};

// This process's counts, asked on the calling thread.
Counts current();

}  // namespace accel::product_threads

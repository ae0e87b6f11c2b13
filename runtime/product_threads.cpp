// How many threads a process runs its matrix products on (see product_threads.h).
#include "runtime/product_threads.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

namespace accel::product_threads {

Counts current() {
  // OpenBLAS's count, found in this process without linking it (libtorch loads it through
  // libblas.so.3 where Debian's alternatives point that at OpenBLAS).
  static const auto blas_threads =
      reinterpret_cast<int (*)()>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  Counts c;
  c.aten = at::get_num_threads();
  if (blas_threads != nullptr) c.blas = blas_threads();
  return c;
}

}  // namespace accel::product_threads

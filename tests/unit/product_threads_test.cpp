// How many threads this process runs its products on: ATen's count and OpenBLAS's own, as each
// library says.
#include "runtime/product_threads.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <gtest/gtest.h>

namespace accel {
namespace {

TEST(ProductThreads, CountsAtensThreadsAndOpenBlassOwn) {
  const int aten = at::get_num_threads();
  auto get = reinterpret_cast<int (*)()>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  auto set = reinterpret_cast<void (*)(int)>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  const int blas = get ? get() : 0;
  auto c = product_threads::current();
  EXPECT_EQ(c.aten, aten);
  EXPECT_EQ(c.blas, blas);
  EXPECT_EQ(c.most(), std::max(aten, blas));
  if (!get || !set) GTEST_SKIP() << "no OpenBLAS in this process";
  // OpenBLAS's count is its own: ATen's does not change it (Debian's libtorch).
  set(1);
  EXPECT_EQ(product_threads::current().blas, 1);
  set(blas);
  EXPECT_EQ(product_threads::current().blas, blas);
}

}  // namespace
}  // namespace accel

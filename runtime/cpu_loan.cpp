// Lending a CPU from training to a background save (see cpu_loan.h).
#include "runtime/cpu_loan.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

namespace accel::cpu_loan {

namespace {

// OpenBLAS's thread count, found in this process without linking it (libtorch loads it through
// libblas.so.3 where Debian's alternatives point that at OpenBLAS).
struct Blas {
  int (*get)() = nullptr;
  void (*set)(int) = nullptr;
  Blas() {
    get = reinterpret_cast<int (*)()>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
    set = reinterpret_cast<void (*)(int)>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
    if (get == nullptr || set == nullptr) get = nullptr, set = nullptr;
  }
};

const Blas& blas() {
  static const Blas b;
  return b;
}

}  // namespace

Counts current() {
  Counts c;
  c.aten = at::get_num_threads();
  if (blas().get != nullptr) c.blas = blas().get();
  return c;
}

int lowered_count(int local_ranks, int threads, int cpus) {
  if (local_ranks < 1 || threads < 1 || cpus < 2) return 0;
  if (static_cast<long>(local_ranks) * threads < cpus) return 0;  // a CPU is left already
  const long lowered = static_cast<long>(cpus) - 1 - static_cast<long>(local_ranks - 1) * threads;
  return lowered >= 1 && lowered < threads ? static_cast<int>(lowered) : 0;
}

int Loan::lend(int local_ranks, int cpus) {
  give_back();
  said_.clear();
  const Counts now = current();
  const int ranks = local_ranks < 1 ? 1 : local_ranks;
  const int to = lowered_count(ranks, now.most(), cpus);
  // Why only OpenBLAS, and only where ATen's own threads leave the CPU: see cpu_loan.h.
  if (ranks != 1 || to == 0 || now.blas <= to || now.aten > to) return ranks * now.most();
  // Why recorded first: the count must come back even if what follows throws.
  before_ = now.blas;
  lowered_ = to;
  lent_ = true;
  ended_.store(false, std::memory_order_release);
  blas().set(to);
  lowered_ = blas().get();
  if (lowered_ == before_) {  // this OpenBLAS kept its count
    lent_ = false;
    return ranks * now.most();
  }
  said_ = "background save: OpenBLAS runs on " + std::to_string(lowered_) + " thread" +
          (lowered_ == 1 ? "" : "s") + " instead of " + std::to_string(before_) +
          " while the save's thread works (back at the first batch or step after it ends), " +
          "leaving it one of the " + std::to_string(cpus) +
          " CPUs this process may use; ACCEL_CHECKPOINT_WRITER_CPUS=any turns this off";
  return lowered_ > now.aten ? lowered_ : now.aten;
}

void Loan::give_back() {
  if (!lent_) return;
  lent_ = false;
  // Why compare first: a program that set the count itself meanwhile keeps it.
  if (blas().get != nullptr && blas().get() == lowered_) blas().set(before_);
}

}  // namespace accel::cpu_loan

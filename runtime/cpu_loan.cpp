// Lending a CPU from training to a background save (see cpu_loan.h).
#include "runtime/cpu_loan.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <exception>

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

// Sets ATen's count on this thread; whether it took (a native thread pool refuses once it ran).
bool set_aten(int n) {
  try {
    at::set_num_threads(n);
  } catch (const std::exception&) {
    return false;
  }
  return at::get_num_threads() == n;
}

std::string threads_text(int n) { return std::to_string(n) + (n == 1 ? " thread" : " threads"); }

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
  if (to == 0) return ranks * now.most();
  before_ = now;
  lowered_ = now;
  std::string what;
  if (now.blas > to) {
    blas().set(to);
    lowered_.blas = blas().get();
    if (lowered_.blas != now.blas)
      what = "OpenBLAS's threads " + std::to_string(now.blas) + " -> " + std::to_string(to);
  }
  if (now.aten > to && set_aten(to)) {
    lowered_.aten = to;
    what += (what.empty() ? "" : ", ") + std::string("ATen's intra-op threads ") +
            std::to_string(now.aten) + " -> " + std::to_string(to);
  }
  if (what.empty()) return ranks * now.most();
  lent_ = true;
  ended_.store(false, std::memory_order_release);
  said_ = "background save: " + what + " until its thread ends, so that training (" +
          std::to_string(ranks) + (ranks == 1 ? " process" : " processes") + " x " +
          threads_text(now.most()) + ") leaves it one of the " + std::to_string(cpus) +
          " CPUs this process may use";
  return (ranks - 1) * now.most() + lowered_.most();
}

void Loan::give_back() {
  if (!lent_) return;
  lent_ = false;
  // Why compare first: a program that set a count itself meanwhile keeps it.
  if (lowered_.blas != before_.blas && blas().get != nullptr && blas().get() == lowered_.blas)
    blas().set(before_.blas);
  if (lowered_.aten != before_.aten && at::get_num_threads() == lowered_.aten)
    set_aten(before_.aten);
}

}  // namespace accel::cpu_loan

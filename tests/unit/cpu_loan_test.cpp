// Lending a CPU from training to a background save: the arithmetic, the loan on this process's
// real OpenBLAS, and an Accelerator's background save that borrows one and gives it back at the
// first batch after its thread ends, or at a wait for it.
#include "runtime/cpu_loan.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>

#include "runtime/checkpoint_snapshot.h"
#include "tests/unit/checkpoint_fixtures.h"

namespace accel {
namespace {

using namespace ckpt_testing;  // the shared fixtures
namespace loan = accel::cpu_loan;

TEST(CpuLoan, LowersTheCountOnlyWhereTrainingKeepsEveryCpuBusy) {
  // (ranks on the machine, threads each, CPUs) -> this process's count while a save works.
  EXPECT_EQ(loan::lowered_count(1, 2, 2), 1);  // one process on two CPUs
  EXPECT_EQ(loan::lowered_count(1, 64, 64), 63);
  EXPECT_EQ(loan::lowered_count(1, 4, 2), 1);  // more threads than CPUs
  EXPECT_EQ(loan::lowered_count(2, 2, 4), 1);  // the other rank keeps its two
  EXPECT_EQ(loan::lowered_count(3, 2, 6), 1);
  EXPECT_EQ(loan::lowered_count(1, 1, 2), 0);  // a CPU is left already
  EXPECT_EQ(loan::lowered_count(1, 2, 4), 0);
  EXPECT_EQ(loan::lowered_count(2, 1, 2), 0);  // one thread each: nothing to lower
  EXPECT_EQ(loan::lowered_count(2, 4, 4), 0);  // the other rank alone fills them
  EXPECT_EQ(loan::lowered_count(1, 2, 1), 0);  // one CPU: nothing to leave
  EXPECT_EQ(loan::lowered_count(0, 2, 2), 0);
  EXPECT_EQ(loan::lowered_count(1, 0, 2), 0);
}

// OpenBLAS's own count, through its entry points (nullptr where the process has another BLAS).
struct OpenBlas {
  int (*get)() = reinterpret_cast<int (*)()>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  void (*set)(int) = reinterpret_cast<void (*)(int)>(::dlsym(RTLD_DEFAULT,
                                                             "openblas_set_num_threads"));
};

int allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  return CPU_COUNT(&set);
}

// Puts back this thread's ATen count and OpenBLAS's when a test ends, also when it fails.
struct KeepCounts {
  OpenBlas blas;
  int aten = at::get_num_threads();
  int blas_threads = blas.get ? blas.get() : 0;
  ~KeepCounts() {
    at::set_num_threads(aten);
    if (blas.get) blas.set(blas_threads);
  }
};

// OpenBLAS at `n` threads, where it takes that many (it takes no more than the CPUs it sees).
bool openblas_at(const OpenBlas& blas, int n) {
  if (!blas.get) return false;
  blas.set(n);
  return blas.get() == n;
}

TEST(CpuLoan, OpenBlasRunsOnOneThreadFewerUntilTheSaveEnds) {
  KeepCounts keep;
  const int cpus = allowed_cpus();
  at::set_num_threads(1);
  if (cpus < 2 || !openblas_at(keep.blas, cpus))
    GTEST_SKIP() << "needs OpenBLAS that runs on each of 2 or more CPUs";
  loan::Loan l;
  EXPECT_EQ(l.lend(1, cpus), cpus - 1);
  EXPECT_TRUE(l.lent());
  EXPECT_EQ(keep.blas.get(), cpus - 1);
  EXPECT_EQ(l.said(), "background save: OpenBLAS runs on " + std::to_string(cpus - 1) +
                          (cpus == 2 ? " thread" : " threads") + " instead of " +
                          std::to_string(cpus) +
                          " while the save's thread works (back at the first batch or step after "
                          "it ends), leaving it one of the " +
                          std::to_string(cpus) +
                          " CPUs this process may use; ACCEL_CHECKPOINT_WRITER_CPUS=any turns "
                          "this off");
  l.give_back_if_ended();  // the save still works
  EXPECT_EQ(keep.blas.get(), cpus - 1);
  l.save_ended();
  l.give_back_if_ended();
  EXPECT_FALSE(l.lent());
  EXPECT_EQ(keep.blas.get(), cpus);

  // A count the program sets while the save works (other than the lowered one) is the
  // program's: it stays. Needs a third count below the CPUs.
  if (cpus >= 3) {
    l.lend(1, cpus);
    keep.blas.set(1);
    l.save_ended();
    l.give_back_if_ended();
    EXPECT_EQ(keep.blas.get(), 1);
  }

  // Nothing is lent where training leaves a CPU already, where ATen's own threads fill the CPUs
  // (lowering OpenBLAS's would free none), or for one rank of several on the machine.
  keep.blas.set(1);
  EXPECT_EQ(l.lend(1, cpus), 1);
  EXPECT_FALSE(l.lent());
  EXPECT_EQ(l.said(), "");
  keep.blas.set(cpus);
  at::set_num_threads(cpus);
  if (at::get_num_threads() == cpus) {
    EXPECT_EQ(l.lend(1, cpus), cpus);
    EXPECT_FALSE(l.lent());
    EXPECT_EQ(keep.blas.get(), cpus);
  }
  at::set_num_threads(1);
  EXPECT_EQ(l.lend(2, cpus), 2 * cpus);
  EXPECT_FALSE(l.lent());
  EXPECT_EQ(keep.blas.get(), cpus);
}

// An Accelerator's background save borrows the CPU while its thread copies and writes; the
// first batch of a prepared loader after that thread ended gives it back (no step, no
// wait_for_checkpoint needed), and so does a wait for the save.
TEST(CpuLoan, ABackgroundSaveBorrowsACpuUntilTheNextBatchOrAWait) {
  for (const char* name : {"ACCEL_CHECKPOINT_WRITER_CPUS", "LOCAL_WORLD_SIZE"}) {
    if (std::getenv(name) != nullptr) GTEST_SKIP() << "this test's environment sets " << name;
  }
  KeepCounts keep;
  const int cpus = allowed_cpus();
  at::set_num_threads(1);
  if (cpus < 2 || !openblas_at(keep.blas, cpus))
    GTEST_SKIP() << "needs OpenBLAS that runs on each of 2 or more CPUs";
  TempDir tmp;
  Rig rig;
  rig.step();
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<int> during{0};
  ckpt::set_copy_hook_for_testing([&] {
    during = keep.blas.get();
    released.wait();
  });
  struct ClearHook {
    std::promise<void>& release;
    bool opened = false;
    ~ClearHook() {
      if (!opened) release.set_value();
      ckpt::set_copy_hook_for_testing(nullptr);
    }
  } clear_hook{release};
  rig.acc.save_state(tmp.path() / "a", {.async = true});
  EXPECT_EQ(keep.blas.get(), cpus - 1);
  clear_hook.opened = true;
  release.set_value();
  // Batches until the count comes back: the thread ends soon after its write, and a batch after
  // that gives it back. 30 s only bounds a broken build.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (keep.blas.get() != cpus && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    rig.next_batch();
  }
  EXPECT_EQ(during.load(), cpus - 1);
  EXPECT_EQ(keep.blas.get(), cpus);
  rig.acc.wait_for_checkpoint();
  EXPECT_TRUE(fs::exists(tmp.path() / "a"));

  ckpt::set_copy_hook_for_testing(nullptr);
  rig.acc.save_state(tmp.path() / "b", {.async = true});
  EXPECT_EQ(keep.blas.get(), cpus - 1);
  rig.acc.wait_for_checkpoint();
  EXPECT_EQ(keep.blas.get(), cpus);
  EXPECT_TRUE(fs::exists(tmp.path() / "b"));
}

}  // namespace
}  // namespace accel

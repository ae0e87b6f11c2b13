// OpenBLAS's kernel set: the choice from CPU flags, and switching it in a running process.
#include "runtime/blas_kernels.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "runtime/cpu_precision.h"

namespace accel {
namespace {

using blas_kernels::best_core_for;
using blas_kernels::tier_of_core;
using blas_kernels::upgrade_target;

// /proc/cpuinfo flags (abridged) of the CPUs this was seen on.
const std::vector<std::string> kXeon5thGen = {  // model 207: Debian 12's OpenBLAS says Prescott
    "sse3",     "ssse3",    "fma",      "avx",         "avx2",        "avx512f",    "avx512dq",
    "avx512cd", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16"};
const std::vector<std::string> kSkylakeSp = {
    "sse3", "fma", "avx", "avx2", "avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl"};
const std::vector<std::string> kEpycZen2 = {"sse3", "ssse3", "fma", "avx", "avx2", "sha_ni"};
const std::vector<std::string> kOld = {"sse", "sse2", "sse3", "ssse3"};

TEST(BlasKernels, TheBestKernelsFollowTheCpuFlags) {
  EXPECT_EQ(best_core_for(kXeon5thGen), "Cooperlake");
  EXPECT_EQ(best_core_for(kSkylakeSp), "SkylakeX");
  EXPECT_EQ(best_core_for(kEpycZen2), "Haswell");
  EXPECT_EQ(best_core_for(kOld), "");
  // AVX-512 F alone (an early Xeon Phi) is not what SkylakeX's kernels need.
  EXPECT_EQ(best_core_for({"avx2", "fma", "avx512f"}), "Haswell");
  EXPECT_EQ(tier_of_core("Prescott"), 0);
  EXPECT_EQ(tier_of_core("Sandybridge"), 1);
  EXPECT_EQ(tier_of_core("Haswell"), 2);
  EXPECT_EQ(tier_of_core("Zen"), 2);
  EXPECT_EQ(tier_of_core("SkylakeX"), 3);
  EXPECT_EQ(tier_of_core("Cooperlake"), 3);
  EXPECT_EQ(tier_of_core("SomethingNew"), 0);
}

TEST(BlasKernels, OnlyKernelsOlderThanTheCpuAreUpgradedAndNeverTheUsersChoice) {
  EXPECT_EQ(upgrade_target(nullptr, "Prescott", kXeon5thGen), "Cooperlake");
  EXPECT_EQ(upgrade_target(nullptr, "Haswell", kSkylakeSp), "SkylakeX");
  EXPECT_EQ(upgrade_target(nullptr, "Sandybridge", kEpycZen2), "Haswell");
  // As new as the CPU allows, or newer than what its flags say: kept.
  EXPECT_EQ(upgrade_target(nullptr, "SkylakeX", kXeon5thGen), "");
  EXPECT_EQ(upgrade_target(nullptr, "Zen", kEpycZen2), "");
  EXPECT_EQ(upgrade_target(nullptr, "Prescott", kOld), "");
  // OPENBLAS_CORETYPE set, to anything: the user's.
  EXPECT_EQ(upgrade_target("Prescott", "Prescott", kXeon5thGen), "");
  EXPECT_EQ(upgrade_target("", "Prescott", kXeon5thGen), "");
  // No OpenBLAS in the process.
  EXPECT_EQ(upgrade_target(nullptr, "", kXeon5thGen), "");
}

// Puts back this process's OpenBLAS kernels and OPENBLAS_CORETYPE when a test ends, also when
// an ASSERT ends it early, so that the tests after it run on the kernels the process started with.
class KernelsAsTheyWere {
 public:
  KernelsAsTheyWere() : core_(blas_kernels::current_core()) {
    const char* env = std::getenv("OPENBLAS_CORETYPE");
    if (env != nullptr) env_ = env;
  }
  ~KernelsAsTheyWere() {
    if (!core_.empty()) (void)blas_kernels::set_kernels(core_);
    if (env_) {
      ::setenv("OPENBLAS_CORETYPE", env_->c_str(), 1);
    } else {
      ::unsetenv("OPENBLAS_CORETYPE");
    }
  }
  KernelsAsTheyWere(const KernelsAsTheyWere&) = delete;
  KernelsAsTheyWere& operator=(const KernelsAsTheyWere&) = delete;

 private:
  std::string core_;
  std::optional<std::string> env_;
};

// The switch itself, in this process, on this machine's OpenBLAS: to the generic kernels and
// back, with the same product (to float rounding) on both and bit for bit after coming back.
TEST(BlasKernels, SwitchingKernelsInARunningProcessKeepsMatmulsRightAndComesBack) {
  const std::string before = blas_kernels::current_core();
  if (before.empty() || !blas_kernels::can_switch_kernels())
    GTEST_SKIP() << "no OpenBLAS with switchable kernels in this process";
  const KernelsAsTheyWere restore;
  auto a = torch::arange(64 * 300, torch::kFloat).reshape({64, 300}).remainder(7.0f) - 3.0f;
  auto b = torch::arange(300 * 200, torch::kFloat).reshape({300, 200}).remainder(5.0f) * 0.5f;
  const auto reference = torch::mm(a, b);
  const std::string other = before == "Prescott" ? "Nehalem" : "Prescott";
  ASSERT_TRUE(blas_kernels::set_kernels(other)) << "now " << blas_kernels::current_core();
  EXPECT_STREQ(std::getenv("OPENBLAS_CORETYPE"), other.c_str());
  EXPECT_TRUE(torch::allclose(torch::mm(a, b), reference, 1e-5, 1e-3));
  ASSERT_TRUE(blas_kernels::set_kernels(before));
  EXPECT_TRUE(torch::equal(torch::mm(a, b), reference));
}

// The kernels asked for are kept whatever a timer would say: the choice decides the last bits of
// every product, so it must come out the same in a restarted run on a busy machine as in the
// first. Going to the generic kernels from the CPU's own, several times slower, shows it; a
// kernel set this OpenBLAS lacks is refused and changes nothing.
TEST(BlasKernels, TheKernelsAskedForAreKeptWhateverTheirSpeedAndUnknownOnesChangeNothing) {
  const std::string before = blas_kernels::current_core();
  if (before.empty() || !blas_kernels::can_switch_kernels())
    GTEST_SKIP() << "no OpenBLAS with switchable kernels in this process";
  const KernelsAsTheyWere restore;
  const std::string best = best_core_for(blas_kernels::cpu_flags());
  // From the fastest kernels this CPU runs (when OpenBLAS has them) down to the generic ones.
  if (!best.empty()) (void)blas_kernels::set_kernels(best);
  const std::string fast = blas_kernels::current_core();  // best, unless this OpenBLAS lacks it
  const std::string slow = fast == "Prescott" ? "Nehalem" : "Prescott";
  const auto down = blas_kernels::switch_to(slow);
  EXPECT_EQ(down.from, fast);
  EXPECT_EQ(down.tried, slow);
  EXPECT_EQ(down.to, slow);
  EXPECT_EQ(blas_kernels::current_core(), slow);
  EXPECT_STREQ(std::getenv("OPENBLAS_CORETYPE"), slow.c_str());

  const auto unknown = blas_kernels::switch_to("NoSuchKernels");
  EXPECT_EQ(unknown.tried, "NoSuchKernels");
  EXPECT_FALSE(unknown.switched());
  EXPECT_EQ(blas_kernels::current_core(), slow);
  EXPECT_STREQ(std::getenv("OPENBLAS_CORETYPE"), slow.c_str());
  const std::string line = blas_kernels::describe(unknown, "Some CPU");
  EXPECT_NE(line.find("this OpenBLAS has no NoSuchKernels kernels to switch to"), std::string::npos)
      << line;

  EXPECT_TRUE(blas_kernels::switch_to(before).switched() || before == slow);
  EXPECT_EQ(blas_kernels::current_core(), before);
}

TEST(BlasKernels, TheLineNamesBothKernelsAndTheWayBack) {
  blas_kernels::Outcome up;
  up.from = "Prescott";
  up.tried = up.to = "Cooperlake";
  const std::string line = blas_kernels::describe(up, "Intel(R) Xeon(R) Processor");
  EXPECT_NE(line.find("OpenBLAS ran its Prescott kernels on this CPU (Intel(R) Xeon(R) Processor)"),
            std::string::npos)
      << line;
  EXPECT_NE(line.find("switched it to Cooperlake, the newest this CPU's flags allow"),
            std::string::npos)
      << line;
  EXPECT_NE(line.find("OPENBLAS_CORETYPE=Prescott keeps the old ones"), std::string::npos) << line;
  EXPECT_EQ(blas_kernels::describe(blas_kernels::Outcome{}, "x"), "");
}

// The bf16 check runs inside the Accelerator's constructor: the user's random stream goes on as
// if it had not run.
TEST(CpuPrecision, MeasuringBf16LeavesTheUsersRandomStreamWhereItWas) {
  torch::manual_seed(1234);
  (void)torch::rand({3});
  const auto expected = torch::rand({5});
  torch::manual_seed(1234);
  (void)torch::rand({3});
  (void)cpu_precision::measure_step();
  EXPECT_TRUE(torch::equal(torch::rand({5}), expected));
}

}  // namespace
}  // namespace accel

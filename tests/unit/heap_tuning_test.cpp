// glibc's malloc thresholds fixed for training: whose setting wins, and that a step's large
// tensors stop costing page faults once libaccel fixed them.
#include "runtime/heap_tuning.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <string>

namespace accel {
namespace {

std::string setting_of(const std::map<std::string, std::string>& vars) {
  return heap_tuning::users_setting([&](const char* name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

TEST(HeapTuning, TheUsersOwnMallocSettingIsLeftAlone) {
  EXPECT_EQ(setting_of({}), "");
  EXPECT_EQ(setting_of({{"GLIBC_TUNABLES", "glibc.cpu.hwcaps=-AVX512F"}}), "");
  EXPECT_EQ(setting_of({{"GLIBC_TUNABLES", "glibc.cpu.x=1:glibc.malloc.trim_threshold=0"}}),
            "GLIBC_TUNABLES");
  EXPECT_EQ(setting_of({{"MALLOC_TRIM_THRESHOLD_", "131072"}}), "MALLOC_TRIM_THRESHOLD_");
  EXPECT_EQ(setting_of({{"MALLOC_MMAP_THRESHOLD_", "65536"}}), "MALLOC_MMAP_THRESHOLD_");
  EXPECT_EQ(setting_of({{"MALLOC_ARENA_MAX", "2"}}), "");  // not a threshold
  // Empty is set: glibc reads it as 0 (an empty MALLOC_MMAP_MAX_ turns its mmap off).
  EXPECT_EQ(setting_of({{"MALLOC_TOP_PAD_", ""}}), "MALLOC_TOP_PAD_");
  // What accel-launch gives every worker is libaccel's own setting, in any order, with other
  // tunables beside; one malloc tunable more or changed is the user's.
  const std::string ours = contract::kMallocTunables;
  EXPECT_EQ(setting_of({{"GLIBC_TUNABLES", ours}}), "");
  EXPECT_EQ(setting_of({{"GLIBC_TUNABLES",
                         "glibc.malloc.trim_threshold=1073741824:glibc.cpu.x=1:"
                         "glibc.malloc.mmap_threshold=33554432"}}),
            "");
  EXPECT_EQ(setting_of({{"GLIBC_TUNABLES", ours + ":glibc.malloc.arena_max=2"}}), "GLIBC_TUNABLES");
  EXPECT_EQ(setting_of({{"GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=33554432"}}),
            "GLIBC_TUNABLES");
  EXPECT_EQ(setting_of({{"GLIBC_TUNABLES", ours}, {"MALLOC_TOP_PAD_", "1"}}), "MALLOC_TOP_PAD_");
  // One of ours twice is a user's setting of that one only, not ours.
  EXPECT_EQ(
      setting_of({{"GLIBC_TUNABLES",
                   "glibc.malloc.mmap_threshold=33554432:glibc.malloc.mmap_threshold=33554432"}}),
      "GLIBC_TUNABLES");
  EXPECT_EQ(setting_of({{"GLIBC_TUNABLES", ours + ":"}}), "");  // an empty entry is no tunable
}

// The tunables' text says the same thresholds as the numbers libaccel gives mallopt.
TEST(HeapTuning, TheLaunchersTunablesAreLibaccelsThresholds) {
  EXPECT_EQ(std::string(contract::kMallocTunables),
            "glibc.malloc.mmap_threshold=" + std::to_string(heap_tuning::kMmapThreshold) +
                ":glibc.malloc.trim_threshold=" + std::to_string(heap_tuning::kTrimThreshold));
}

// The probe, run only in a process of its own (below): page faults of 8 "steps" after 2 warm-up
// ones, each step allocating three 12 MiB tensors (a layer's weight gradient and activations,
// say), writing and freeing them, so that 36 MiB lie free at the heap's top after every step.
// ACCEL_TEST_HEAP_PROBE=tuned fixes the thresholds first, as an Accelerator does; =glibc not;
// =tunables not either, run with the GLIBC_TUNABLES that accel-launch gives a worker.
void* volatile sink = nullptr;

TEST(HeapTuningProbe, CountsTheFaultsOfEightSteps) {
  const char* mode = std::getenv("ACCEL_TEST_HEAP_PROBE");
  if (mode == nullptr) {
    GTEST_SKIP() << "run by HeapTuning.AStepsLargeTensors... in a new process";
  }
  if (std::string(mode) == "tuned") {
    ASSERT_TRUE(heap_tuning::keep_freed_memory().applied);
  }
  constexpr std::size_t kBytes = std::size_t{12} << 20;
  auto step = [] {
    void* a = std::malloc(kBytes);
    void* b = std::malloc(kBytes);
    void* c = std::malloc(kBytes);
    for (void* p : {a, b, c}) {
      std::memset(p, 1, kBytes);
      sink = p;  // Why: so that the compiler cannot leave out the allocations
    }
    for (void* p : {c, b, a}) std::free(p);
  };
  step();
  step();
  rusage before{}, after{};
  ::getrusage(RUSAGE_SELF, &before);
  for (int i = 0; i < 8; ++i) step();
  ::getrusage(RUSAGE_SELF, &after);
  std::printf("probe faults=%ld\n", after.ru_minflt - before.ru_minflt);
}

// Why a new process each (this test binary again, running only the probe): the thresholds are
// process-wide and move with what the process freed before, so a process that has run no other
// test starts from the same state every time. -1 when the probe did not report; `output` gets
// what it printed.
long faults_of_steps(const std::string& mode, std::string* output,
                     const std::string& tunables = "") {
  char exe[4096];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) return -1;
  exe[n] = '\0';
  // Why these unset: an allocator setting or a preloaded allocator would change what is counted,
  // and gtest's sharding could leave the probe out.
  const std::string command =
      "env -u GLIBC_TUNABLES -u ACCEL_KEEP_FREED_MEMORY -u MALLOC_MMAP_THRESHOLD_ "
      "-u MALLOC_TRIM_THRESHOLD_ -u MALLOC_TOP_PAD_ -u MALLOC_MMAP_MAX_ -u MALLOC_PERTURB_ "
      "-u LD_PRELOAD -u GTEST_TOTAL_SHARDS -u GTEST_SHARD_INDEX " +
      (tunables.empty() ? "" : "GLIBC_TUNABLES=" + tunables + " ") +
      "ACCEL_TEST_HEAP_PROBE=" + mode + " '" + exe +
      "' --gtest_filter=HeapTuningProbe.CountsTheFaultsOfEightSteps 2>&1";
  FILE* out = ::popen(command.c_str(), "r");
  if (out == nullptr) return -1;
  long faults = -1;
  char line[512];
  while (std::fgets(line, sizeof line, out) != nullptr) {
    *output += line;
    (void)std::sscanf(line, "probe faults=%ld", &faults);
  }
  ::pclose(out);
  return faults;
}

TEST(HeapTuning, AStepsLargeTensorsStopFaultingOnceTheThresholdsAreFixed) {
#if !defined(__GLIBC__) || defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "the thresholds are glibc's malloc's (a sanitizer brings its own allocator)";
#endif
  // Why glibc's own first: it shows the pattern costs faults there. Its mmap threshold moves up
  // to 12 MiB at the first free and its trim threshold to twice that, so the 36 MiB free at the
  // top after every step go back to the kernel down to the last 12 MiB, and the next step faults
  // the rest in again: about 6,100 faults a step with 4 KiB pages (a C program doing the same
  // from glibc's first state counted 48,896 in 8 steps, and 0 with the thresholds fixed); fewer,
  // but still some every step, where transparent huge pages back the heap.
  std::string glibc_output, tuned_output, tunables_output;
  const long untuned = faults_of_steps("glibc", &glibc_output);
  const long tuned = faults_of_steps("tuned", &tuned_output);
  // The same thresholds as accel-launch gives every worker: glibc takes them from its start.
  const long launched = faults_of_steps("tunables", &tunables_output, contract::kMallocTunables);
  ASSERT_GE(untuned, 0) << "the probe did not report:\n" << glibc_output;
  ASSERT_GE(tuned, 0) << "the probe did not report (were the thresholds applied?):\n"
                      << tuned_output;
  EXPECT_GT(untuned, 20 * (tuned + 1))
      << "glibc's own thresholds: " << untuned << " faults, fixed ones: " << tuned;
  EXPECT_LT(tuned, 200) << "faults with the thresholds fixed: " << tuned;
  ASSERT_GE(launched, 0) << "the probe did not report:\n" << tunables_output;
  EXPECT_GT(untuned, 20 * (launched + 1))
      << "glibc's own thresholds: " << untuned << " faults, accel-launch's tunables: " << launched;
  EXPECT_LT(launched, 200) << "faults with accel-launch's tunables: " << launched;
}

}  // namespace
}  // namespace accel

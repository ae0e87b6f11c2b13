// What a first save's copy pays for memory mapped ahead in one way or another. No libaccel.
//
// Maps --mb MB of anonymous memory, prepares it one way (--how), then copies --mb MB of touched
// memory into it --copies times and prints, as one JSON line, how long the preparing took, the
// first copy and the median of the others. A background save copies into such memory; what it
// pays at the first copy is what the step after the first save waits for.
//
//   none      nothing: the first copy faults every page in
//   populate  madvise(MADV_POPULATE_WRITE), as the kernel maps pages for writing
//   store     an atomic "or 0" into every 4 KiB page from this program, as libaccel's
//   populate+store, huge+store (madvise(MADV_HUGEPAGE) first), huge+store2m (one store a 2 MiB)
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

void store(char* data, std::size_t bytes, std::size_t stride) {
  for (std::size_t at = 0; at < bytes; at += stride) {
#if defined(__x86_64__)
    asm volatile("lock orb $0, %0" : "+m"(data[at]));
#else
    (void)__atomic_fetch_or(reinterpret_cast<volatile char*>(data + at), char{0}, __ATOMIC_RELAXED);
#endif
  }
}

int usage() {
  std::fprintf(stderr,
               "usage: bench_first_touch --how none|populate|store|populate+store|huge+store|"
               "huge+store2m [--mb 300] [--copies 5]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string how;
  long mb = 300, copies = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    if (flag == "--how") {
      how = argv[i + 1];
    } else if (flag == "--mb") {
      mb = std::atol(argv[i + 1]);
    } else if (flag == "--copies") {
      copies = std::atol(argv[i + 1]);
    } else {
      return usage();
    }
  }
  if (argc % 2 != 1 || how.empty() || mb < 1 || copies < 1) return usage();
  const std::size_t bytes = static_cast<std::size_t>(mb) << 20;
  std::vector<char> source(bytes, 1);
  void* mapped = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) {
    std::perror("bench_first_touch: mmap");
    return 1;
  }
  char* data = static_cast<char*>(mapped);
  auto began = Clock::now();
  if (how.rfind("huge", 0) == 0 && ::madvise(data, bytes, MADV_HUGEPAGE) != 0)
    std::perror("bench_first_touch: madvise(MADV_HUGEPAGE)");
  if (how.rfind("populate", 0) == 0 && ::madvise(data, bytes, MADV_POPULATE_WRITE) != 0) {
    std::perror("bench_first_touch: madvise(MADV_POPULATE_WRITE)");
    return 1;
  }
  if (how == "store" || how == "populate+store" || how == "huge+store") {
    store(data, bytes, 4096);
  } else if (how == "huge+store2m") {
    store(data, bytes, 2u << 20);
  } else if (how != "none" && how != "populate") {
    return usage();
  }
  const double prepare_ms = ms_since(began);
  std::vector<double> copy_ms;
  for (long i = 0; i < copies; ++i) {
    auto t = Clock::now();
    std::memcpy(data, source.data(), bytes);
    copy_ms.push_back(ms_since(t));
  }
  std::vector<double> later(copy_ms.begin() + 1, copy_ms.end());
  std::sort(later.begin(), later.end());
  std::printf(
      "{\"how\": \"%s\", \"mb\": %ld, \"prepare_ms\": %.1f, \"first_copy_ms\": %.1f, "
      "\"later_copy_ms\": %.1f}\n",
      how.c_str(), mb, prepare_ms, copy_ms[0], later.empty() ? 0.0 : later[later.size() / 2]);
  return 0;
}

// Maps the progress page and writes it with atomic stores.
#include "runtime/progress.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "contract/progress_page.h"
#include "contract/worker_contract.h"
#include "runtime/env.h"

namespace accel::progress {
namespace {

Page* open_page() {
  const env::WorkerEnv& e = env::worker_env();
  if (e.progress_file.empty()) return nullptr;
  const char* path = e.progress_file.c_str();
  int fd = ::open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) {
    std::fprintf(
        stderr,
        "accel: cannot open ACCEL_PROGRESS_FILE %s; hang detection is off for this worker\n", path);
    return nullptr;
  }
  void* mem = MAP_FAILED;
  if (::ftruncate(fd, static_cast<off_t>(kFileBytes)) == 0) {
    mem = ::mmap(nullptr, kFileBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  ::close(fd);
  if (mem == MAP_FAILED) {
    std::fprintf(
        stderr, "accel: cannot map ACCEL_PROGRESS_FILE %s; hang detection is off for this worker\n",
        path);
    return nullptr;
  }
  auto* page = static_cast<Page*>(mem);

  page->version = kVersion;
  page->ring_size = kRingSize;
  page->rank = e.rank;
  page->pid = static_cast<std::int32_t>(::getpid());
  // Why last: a reader sees a page only when complete
  std::memcpy(page->magic, kMagic, sizeof kMagic);
  return page;
}

Page* page() {
  static Page* p = open_page();  // Why a static: one mapping per process, never unmapped
  return p;
}

}  // namespace

void heartbeat() {
  if (Page* p = page()) store(&p->heartbeat_ns, monotonic_ns());
}

void collective_started(std::uint64_t seq, const char* op, std::size_t bytes) {
  Page* p = page();
  if (p == nullptr) return;
  std::uint64_t now = monotonic_ns();
  Entry& e = p->ring[seq % kRingSize];
  store(&e.seq_plus_one, std::uint64_t{0});
  __atomic_thread_fence(__ATOMIC_RELEASE);  // Why: readers must see 0 before any new field
  store(&e.start_ns, now);
  store(&e.end_ns, std::uint64_t{0});
  store(&e.bytes, static_cast<std::uint64_t>(bytes));
  std::strncpy(e.op, op, sizeof e.op - 1);
  store(&e.seq_plus_one, seq + 1);
  store(&p->started, seq + 1);
  store(&p->heartbeat_ns, now);
}

void collective_finished(std::uint64_t seq) {
  Page* p = page();
  if (p == nullptr) return;
  std::uint64_t now = monotonic_ns();
  Entry& e = p->ring[seq % kRingSize];
  if (load(&e.seq_plus_one) == seq + 1) store(&e.end_ns, now);
  store(&p->heartbeat_ns, now);
}

void collective_waited(std::uint64_t ns) {
  if (Page* p = page()) __atomic_fetch_add(&p->stats.collective_wait_ns, ns, __ATOMIC_RELEASE);
}

void step_done(std::uint64_t steps) {
  Page* p = page();
  if (p == nullptr) return;
  std::uint64_t now = monotonic_ns();
  store(&p->stats.steps, steps);
  store(&p->stats.last_step_ns, now);
  store(&p->heartbeat_ns, now);
}

void checkpoint_saved(std::uint64_t bytes, std::uint64_t duration_ns) {
  Page* p = page();
  if (p == nullptr) return;
  store(&p->stats.checkpoint_bytes, bytes);
  store(&p->stats.checkpoint_duration_ns, duration_ns);
  store(&p->stats.checkpoint_ns, monotonic_ns());
}

}  // namespace accel::progress

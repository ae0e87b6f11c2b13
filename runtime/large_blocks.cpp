// Kept large blocks for CPU tensors (see large_blocks.h).
#include "runtime/large_blocks.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <new>
#include <system_error>
#include <thread>
#include <type_traits>

#include "runtime/env.h"

namespace accel::large_blocks {

namespace {

class SystemPages final : public Pages {
 public:
  void* map(std::size_t bytes) override {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? nullptr : p;
  }
  void unmap(void* data, std::size_t bytes) override { ::munmap(data, bytes); }
};

std::size_t rounded(std::size_t bytes) { return (bytes + kGranule - 1) / kGranule * kGranule; }

}  // namespace

Pages& system_pages() {
  // Why never destroyed: the installed cache uses it, and tensors may be freed during exit.
  static auto* pages = new SystemPages;
  return *pages;
}

void Cache::unmap_all(const std::vector<Kept>& blocks) {
  for (const auto& k : blocks) pages_.unmap(k.data, k.size);
}

void* Cache::take(std::size_t bytes, std::size_t* size) {
  const std::size_t need = rounded(std::max<std::size_t>(bytes, 1));
  std::vector<Kept> dropped;
  std::unique_lock<std::mutex> lock(m_);
  // The smallest that fits, the most recently freed among equals (searched newest first).
  auto best = kept_.rend();
  for (auto it = kept_.rbegin(); it != kept_.rend(); ++it) {
    if (it->size >= need && it->size - need <= need / 4 &&
        (best == kept_.rend() || it->size < best->size)) {
      best = it;
    }
  }
  if (best != kept_.rend()) {
    *size = best->size;
    void* data = best->data;
    live_.emplace(data, *size);  // first: if it throws, nothing has changed
    kept_.erase(std::next(best).base());
    stats_.kept_bytes -= *size;
    stats_.live_bytes += *size;
    ++stats_.reused;
    return data;
  }
  // None fits: make room under the bound, then a new block (counted as live while it is made,
  // so that a concurrent take sees it).
  const std::size_t live_after = stats_.live_bytes + need;
  const std::size_t bound = std::max(stats_.peak_live_bytes, live_after);
  dropped.reserve(kept_.size());
  while (!kept_.empty() && live_after + stats_.kept_bytes > bound) {
    dropped.push_back(kept_.front());
    stats_.kept_bytes -= kept_.front().size;
    ++stats_.handed_back;
    kept_.erase(kept_.begin());
  }
  stats_.live_bytes = live_after;
  lock.unlock();
  unmap_all(dropped);
  void* data = pages_.map(need);
  if (data == nullptr) {
    // Why: memory kept for reuse must not make an allocation fail.
    lock.lock();
    dropped.clear();
    dropped.swap(kept_);  // Why a swap: it allocates nothing, where memory is short
    stats_.kept_bytes = 0;
    stats_.handed_back += dropped.size();
    lock.unlock();
    unmap_all(dropped);
    data = pages_.map(need);
  }
  lock.lock();
  if (data != nullptr) {
    try {
      live_.emplace(data, need);
    } catch (...) {
      pages_.unmap(data, need);
      ++stats_.made;
      ++stats_.handed_back;
      data = nullptr;
    }
  }
  if (data == nullptr) {
    stats_.live_bytes -= need;
    return nullptr;
  }
  ++stats_.made;
  // Why the live bytes with this block as they were when it was counted: another thread may have
  // freed blocks since, and the peak is the most live at once.
  stats_.peak_live_bytes = std::max(stats_.peak_live_bytes, live_after);
  *size = need;
  return data;
}

bool Cache::give_back(void* data) noexcept {
  std::unique_lock<std::mutex> lock(m_);
  auto it = live_.find(data);
  if (it == live_.end()) return false;
  const std::size_t size = it->second;
  live_.erase(it);
  stats_.live_bytes -= size;
  try {
    kept_.push_back({data, size, pages_.now()});
    stats_.kept_bytes += size;
  } catch (...) {
    // Why: this runs in a tensor's deleter, which must not throw; the block goes back instead.
    ++stats_.handed_back;
    lock.unlock();
    pages_.unmap(data, size);
  }
  return true;
}

void Cache::release_idle() noexcept {
  std::vector<Kept> dropped;
  try {
    std::lock_guard<std::mutex> lock(m_);
    const auto now = pages_.now();
    // Oldest first: those kept kIdleLimit or more are a prefix.
    auto idle = std::find_if(kept_.begin(), kept_.end(),
                             [&](const Kept& k) { return now - k.freed < kIdleLimit; });
    dropped.assign(kept_.begin(), idle);  // first: if it throws, nothing has changed
    for (const auto& k : dropped) stats_.kept_bytes -= k.size;
    stats_.handed_back += dropped.size();
    kept_.erase(kept_.begin(), idle);
  } catch (...) {
    return;  // no memory for the list: the next round tries again
  }
  unmap_all(dropped);
}

Stats Cache::stats() const {
  std::lock_guard<std::mutex> lock(m_);
  return stats_;
}

namespace {

// The installed cache (null before) and the replaced allocator's deleter, which frees every
// pointer it gave. Never destroyed: tensors freed at exit give their blocks back.
std::atomic<Cache*> g_installed{nullptr};
std::atomic<c10::DeleterFnPtr> g_small_deleter{nullptr};

// Frees a pointer of either allocator: a large block back to the cache, anything else to the
// allocator that gave it. One function for both, as libtorch's raw_deallocate asks (some
// kernels, oneDNN's among them, allocate raw pointers through the CPU allocator).
void free_either(void* data) {
  if (data == nullptr) return;
  Cache* cache = g_installed.load();
  if (cache != nullptr && cache->give_back(data)) return;
  g_small_deleter.load()(data);
}

// Blocks of kLargeBlock bytes and more from the cache, smaller ones from the allocator it
// replaced, as that allocator gives them.
c10::DataPtr allocate_either(c10::Allocator* small, Cache& cache, std::size_t n) {
  if (n < kLargeBlock) return small->allocate(n);
  std::size_t size = 0;
  void* data = cache.take(n, &size);
  TORCH_CHECK_WITH(OutOfMemoryError, data != nullptr,
                   "accel: not enough memory: you tried to allocate ", n, " bytes.");
  return {data, data, &free_either, c10::Device(c10::DeviceType::CPU)};
}

// Whether this libtorch's Allocator::allocate is const (1.13 to 2.2) or not (later releases,
// whose Allocator also asks for copy_data).
constexpr bool kConstAllocate = std::is_same_v<decltype(&c10::Allocator::allocate),
                                               c10::DataPtr (c10::Allocator::*)(std::size_t) const>;

// libtorch's CPU allocator with kept large blocks, in the shape this libtorch's Allocator has.
// Why a partial specialization on `Base`: only the one chosen is compiled against c10::Allocator.
template <bool ConstAllocate, class Base = c10::Allocator>
class KeepingAllocator;

template <class Base>
class KeepingAllocator<true, Base> final : public Base {
 public:
  KeepingAllocator(c10::Allocator* small, Cache& cache) : small_(small), cache_(cache) {}
  c10::DataPtr allocate(std::size_t n) const override { return allocate_either(small_, cache_, n); }
  c10::DeleterFnPtr raw_deleter() const override { return &free_either; }

 private:
  c10::Allocator* small_;
  Cache& cache_;
};

template <class Base>
class KeepingAllocator<false, Base> final : public Base {
 public:
  KeepingAllocator(c10::Allocator* small, Cache& cache) : small_(small), cache_(cache) {}
  c10::DataPtr allocate(std::size_t n) override { return allocate_either(small_, cache_, n); }
  c10::DeleterFnPtr raw_deleter() const override { return &free_either; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count > 0) std::memcpy(dest, src, count);
  }

 private:
  c10::Allocator* small_;
  Cache& cache_;
};

Outcome install() {
  Outcome out;
  if (!env::worker_env().keep_freed_memory) {
    out.why_not = "ACCEL_KEEP_FREED_MEMORY is off";
    return out;
  }
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current != c10::GetDefaultCPUAllocator()) {
    out.why_not = "a CPU allocator other than libtorch's is set";
    return out;
  }
  if (current->raw_deleter() == nullptr) {
    out.why_not = "libtorch's CPU allocator has no raw deleter";
    return out;
  }
  // Why before the switch: from then on a tensor of the new allocator may be freed on any thread.
  g_small_deleter.store(current->raw_deleter());
  auto* cache = new Cache(system_pages());
  // Why a thread: blocks that no later tensor fits would otherwise stay kept (within the bound),
  // and for good in a process that stops making large tensors. Never joined; it holds nothing
  // that exit destroys. Not in a forked child. Where no thread can start, the blocks stay kept.
  try {
    std::thread([cache] {
      ::pthread_setname_np(::pthread_self(), "accel-blocks");
      for (;;) {
        std::this_thread::sleep_for(kIdleLimit / 4);
        cache->release_idle();
      }
    }).detach();
  } catch (const std::system_error&) {
  }
  g_installed.store(cache);
  ::pthread_atfork([] { g_installed.load()->lock_for_fork(); },
                   [] { g_installed.load()->unlock_after_fork(); },
                   [] { g_installed.load()->unlock_after_fork(); });
  static auto* allocator = new KeepingAllocator<kConstAllocate>(current, *cache);
  c10::SetCPUAllocator(allocator);
  out.applied = c10::GetCPUAllocator() == allocator;
  if (!out.applied) out.why_not = "libtorch kept its CPU allocator";
  return out;
}

}  // namespace

const Outcome& keep_large_blocks() {
  static const Outcome outcome = install();
  return outcome;
}

Stats installed_stats() {
  Cache* cache = g_installed.load();
  return cache == nullptr ? Stats{} : cache->stats();
}

std::string describe(const Outcome& outcome) {
  if (outcome.applied) {
    return "CPU tensors of 32 MiB and more reuse blocks freed before instead of new mappings "
           "(ACCEL_KEEP_FREED_MEMORY=0 leaves libtorch's allocator)";
  }
  return "CPU tensors' large blocks not kept: " + outcome.why_not;
}

}  // namespace accel::large_blocks

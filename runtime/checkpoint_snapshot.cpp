// SnapshotCopies (checkpoint_snapshot.h).
#include "runtime/checkpoint_snapshot.h"

#include <sys/mman.h>
#include <torch/torch.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <system_error>

#include "accel/error.h"
#include "runtime/page_touch.h"
#include "runtime/yielding.h"

namespace accel::ckpt {

namespace {

constexpr std::size_t kPage = 4096;

std::function<void()>& copy_hook() {
  static std::function<void()> hook;
  return hook;
}

std::function<void()>& touch_hook() {
  static std::function<void()> hook;
  return hook;
}

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

}  // namespace

struct SnapshotCopies::Block {
  char* data = nullptr;  // the start of the mapping, aligned
  std::size_t capacity = 0;
  // Files of this block a save (or the program, through a tensor it kept) still holds: while
  // any, a save must not write into it.
  std::atomic<int> handed_out{0};

  Block() = default;
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;
  ~Block() {
    if (data) ::munmap(data, capacity);
  }

  static std::shared_ptr<Block> make(std::size_t bytes, const std::string& where) {
    // Why no huge pages (MADV_HUGEPAGE): on a VM, the first touch of huge pages the hypervisor
    // had not backed yet took about 0.9 s for 300 MB, and a first save's step waited 1.0-1.2 s;
    // on another, whose hypervisor shadows the guest's page tables, 0.1-0.8 s the first time
    // (bench_checkpoint memory).
    const std::size_t capacity = round_up(std::max<std::size_t>(bytes, 1), kPage);
    void* p = ::mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      throw CheckpointError(
          where + ": cannot map " + std::to_string(capacity) +
          " bytes for a background save's copy: " + std::generic_category().message(errno));
    }
    auto block = std::make_shared<Block>();
    block->data = static_cast<char*>(p);
    block->capacity = capacity;
    return block;
  }
};

namespace {

// Copies `t` (any device, any layout) into `to`, as a contiguous tensor of its dtype and shape.
void copy_into(char* to, const torch::Tensor& t) {
  const auto n = static_cast<std::size_t>(t.numel()) * t.element_size();
  if (n == 0) return;
  // Why the common cases apart: memcpy for a contiguous CPU tensor (at::copy_ may split a large
  // copy over ATen's intra-op threads, which the training thread is using; the writer thread
  // copies alone); at::copy_ straight into the file for a GPU tensor or a strided one, when the
  // place is aligned for the dtype (safetensors packs tensors with no padding, so a float after
  // an odd count of bf16 values is not); else through a contiguous CPU copy.
  if (t.device().is_cpu() && t.is_contiguous() && !t.is_conj() && !t.is_neg()) {
    const char* from = static_cast<const char*>(t.data_ptr());
    in_yielding_pieces(
        n, [&](std::size_t at, std::size_t len) { std::memcpy(to + at, from + at, len); });
  } else if (reinterpret_cast<std::uintptr_t>(to) % t.element_size() == 0) {
    torch::from_blob(to, t.sizes(), torch::TensorOptions().dtype(t.scalar_type()))
        .copy_(t.detach().resolve_conj().resolve_neg());
  } else {
    auto cpu = t.detach().to(torch::kCPU).resolve_conj().resolve_neg().contiguous();
    std::memcpy(to, cpu.data_ptr(), n);
  }
}

}  // namespace

void set_copy_hook_for_testing(std::function<void()> hook) { copy_hook() = std::move(hook); }

void set_touch_hook_for_testing(std::function<void()> hook) { touch_hook() = std::move(hook); }

void SnapshotCopies::begin() {
  wait();
  queued_.clear();
  next_ = 0;
}

safetensors::Encoded SnapshotCopies::defer_file(const safetensors::NamedTensors& tensors,
                                                const std::vector<bool>& copy_later,
                                                const std::map<std::string, std::string>& metadata,
                                                const std::string& where) {
  if (copy_later.size() != tensors.size())
    throw std::invalid_argument("SnapshotCopies::defer_file: copy_later has " +
                                std::to_string(copy_later.size()) + " entries for " +
                                std::to_string(tensors.size()) + " tensors");
  const std::string header = safetensors::encode_header(tensors, metadata, where, kPage);
  std::size_t bytes = header.size();
  for (const auto& [name, t] : tensors)
    bytes += static_cast<std::size_t>(t.numel()) * t.element_size();
  std::shared_ptr<Block> block;
  if (next_ < kept_.size() && kept_[next_]->handed_out.load() == 0 &&
      kept_[next_]->capacity >= bytes) {
    block = kept_[next_];
  } else {
    // Why a page more: the header changes with the metadata (an optimizer's learning rate), and
    // a header grown past its page would otherwise need a new block at the next save.
    block = Block::make(bytes + kPage, where);
    if (next_ < kept_.size()) {
      kept_[next_] = block;
    } else {
      kept_.push_back(block);
    }
  }
  ++next_;
  torch::Tensor file = torch::from_blob(
      block->data, {static_cast<int64_t>(bytes)}, [block](void*) { --block->handed_out; },
      torch::TensorOptions().dtype(torch::kUInt8));
  ++block->handed_out;
  std::memcpy(block->data, header.data(), header.size());
  std::size_t offset = header.size();
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i].second;
    const auto n = static_cast<std::size_t>(t.numel()) * t.element_size();
    // Why only CPU tensors later: the writer thread copies host memory alone; a GPU tensor's
    // copy would need the training thread's stream.
    if (copy_later[i] && t.device().is_cpu()) {
      queued_.push_back({file, offset, t.detach()});
    } else {
      copy_into(block->data + offset, t);
    }
    offset += n;
  }
  safetensors::Encoded out;
  out.data.push_back(std::move(file));
  return out;
}

void SnapshotCopies::start() {
  kept_.resize(std::min(kept_.size(), next_));  // fewer files than last time
  std::lock_guard lock(mutex_);
  pending_ = !queued_.empty();
}

void SnapshotCopies::hold() {
  std::lock_guard lock(mutex_);
  pending_ = true;
}

void SnapshotCopies::copy() {
  struct Done {
    SnapshotCopies& self;
    ~Done() { self.abandon(); }
  } done{*this};
  if (copy_hook()) copy_hook()();
  // Why not after prefault()'s thread, and the queued tensors last first: a save soon after
  // prefault() would wait for all of its touching (about 0.9 s for 300 MB on a VM whose
  // hypervisor shadows the guest's page tables), which goes through the blocks from their
  // start; this way, in files of several tensors, the two meet in the middle, each mapping the
  // pages the other has not reached, while the step that waits leaves its CPU to them. (Within
  // one tensor the copy goes forward: behind the touching, it maps pages no slower than that.) A
  // page both reach is mapped once, and the touching never changes a byte (touch_for_writing).
  for (auto it = queued_.rbegin(); it != queued_.rend(); ++it)
    copy_into(static_cast<char*>(it->file.data_ptr()) + it->offset, it->live);
  queued_.clear();  // the live tensors are the program's again
}

void SnapshotCopies::abandon() {
  {
    std::lock_guard lock(mutex_);
    pending_ = false;
  }
  done_.notify_all();
}

void SnapshotCopies::wait() {
  std::unique_lock lock(mutex_);
  done_.wait(lock, [this] { return !pending_; });
}

void SnapshotCopies::prefault() {
  kept_.resize(std::min(kept_.size(), next_));
  queued_.clear();
  // Why the blocks, not their files: a file handed out counts as held in defer_file(), which
  // would then make the first save a fresh block; the block itself keeps the memory alive
  // without that, also when a save drops a block that no longer fits while this thread still
  // touches it.
  std::vector<std::shared_ptr<Block>> blocks = kept_;
  std::lock_guard lock(mutex_);
  try {
    touching_ = std::async(std::launch::async, [blocks = std::move(blocks), hook = touch_hook()] {
      if (hook) hook();
      for (const auto& b : blocks) {
        // Why a store from this thread, not MADV_POPULATE_WRITE: on a VM whose hypervisor
        // shadows the guest's page tables, the kernel's populating leaves the first store from
        // user space to each page still trapping; 300 MB populated in about 40 ms were then
        // copied in 0.4-1.0 s instead of 20 ms, while the step waited. A store here pays
        // that trap on this thread (about 0.9 s for 300 MB there; a page fault a page elsewhere).
        // The program may write into these pages meanwhile (a save's header and the tensors it
        // copies at once in defer_file(), copy() on a writer thread): touch_for_writing changes
        // no byte and loses none of theirs.
        for (std::size_t at = 0; at < b->capacity; at += kPage) touch_for_writing(b->data + at);
      }
    });
  } catch (const std::system_error&) {
    // no thread to spare: the first save's copy touches the pages, as without prefault()
  }
}

void SnapshotCopies::join_touching() {
  std::future<void> touching;
  {
    std::lock_guard lock(mutex_);
    touching = std::move(touching_);
  }
  if (touching.valid()) touching.get();
}

void SnapshotCopies::release() {
  wait();
  join_touching();
  kept_.clear();
  queued_.clear();
  next_ = 0;
}

}  // namespace accel::ckpt

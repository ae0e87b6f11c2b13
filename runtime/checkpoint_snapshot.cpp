// SnapshotCopies (checkpoint_snapshot.h).
#include "runtime/checkpoint_snapshot.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <system_error>

namespace accel::ckpt {

namespace {
std::function<void()>& copy_hook() {
  static std::function<void()> hook;
  return hook;
}
}  // namespace

void set_copy_hook_for_testing(std::function<void()> hook) { copy_hook() = std::move(hook); }

void SnapshotCopies::begin() {
  wait();
  queued_.clear();
  next_ = 0;
}

torch::Tensor SnapshotCopies::defer(const torch::Tensor& live) {
  torch::Tensor buffer;
  // Why use_count: a buffer still held by a writer (or by the program, through a tensor it got
  // from a checkpoint) must not be written into; a fresh one is made instead.
  if (next_ < kept_.size() && kept_[next_].use_count() == 1 &&
      kept_[next_].scalar_type() == live.scalar_type() && kept_[next_].sizes() == live.sizes()) {
    buffer = kept_[next_];
  } else {
    buffer = torch::empty(live.sizes(), live.options().device(torch::kCPU).requires_grad(false),
                          torch::MemoryFormat::Contiguous);
    if (next_ < kept_.size()) {
      kept_[next_] = buffer;
    } else {
      kept_.push_back(buffer);
    }
  }
  ++next_;
  queued_.emplace_back(buffer, live.detach());
  return buffer;
}

void SnapshotCopies::start() {
  kept_.resize(std::min(kept_.size(), next_));  // a model or optimizer fewer than last time
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
  // Why: its zeros must not land on a copy. Not for a writer that copies nothing (an in-memory
  // snapshot): the step would wait for the touching.
  if (!queued_.empty()) join_touching();
  if (copy_hook()) copy_hook()();
  for (auto& [buffer, live] : queued_) {
    // Why memcpy for the usual case: at::copy_ may split a large copy over ATen's intra-op
    // threads, which the training thread is using; this thread copies alone. (A buffer has its
    // tensor's dtype and shape, contiguous.)
    if (live.is_contiguous()) {
      std::memcpy(buffer.data_ptr(), live.data_ptr(), live.nbytes());
    } else {
      buffer.copy_(live);
    }
  }
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
  // Why storages, not tensors: a tensor held elsewhere counts as busy in defer(), which would then
  // make the first save a fresh buffer; a storage keeps the memory alive without that, also when
  // a save drops a buffer that no longer fits while this thread still touches it.
  struct Pages {
    c10::Storage storage;
    char* p;
    std::size_t n;
  };
  std::vector<Pages> pages;
  for (const auto& b : kept_)
    pages.push_back({b.storage(), static_cast<char*>(b.data_ptr()), b.nbytes()});
  std::lock_guard lock(mutex_);
  try {
    touching_ = std::async(std::launch::async, [pages = std::move(pages)] {
      constexpr std::size_t kPage = 4096;
      for (const auto& [storage, p, n] : pages) {
        auto* bytes = static_cast<volatile char*>(p);
        for (std::size_t at = 0; at < n; at += kPage) bytes[at] = 0;
        if (n > 0) bytes[n - 1] = 0;  // the last page, when the buffer does not start on one
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

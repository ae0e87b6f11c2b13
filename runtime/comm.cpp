// Collectives with one timeout, sequence numbers and a desync report on failure.
#include "runtime/comm.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include "accel/error.h"
#include "runtime/env.h"
#include "runtime/log.h"
#include "runtime/progress.h"

namespace accel {
namespace {

// Why: after a failure every rank publishes where it is, so the error can say "rank 1 is in
// allreduce #7" instead of only "timed out". Bounded, because the peer may be dead.
constexpr std::chrono::milliseconds kDesyncWait{2000};

std::size_t nbytes(const at::Tensor& t) { return t.numel() * t.element_size(); }

std::string desync_key(int rank) { return "accel/desync/" + std::to_string(rank); }

}  // namespace

std::string format_duration(std::chrono::milliseconds d) {
  std::ostringstream out;
  double s = d.count() / 1000.0;
  if (s >= 120)
    out << s / 60 << " min";
  else
    out << s << " s";
  return out.str();
}

Comm::Comm(int rank, int world_size, std::chrono::milliseconds timeout,
           c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<CollectiveGroup> group,
           std::unique_ptr<ShmGroup> shm, std::unique_ptr<Hierarchy> hierarchy)
    : rank_(rank),
      world_size_(world_size),
      timeout_(timeout),
      store_(std::move(store)),
      group_(std::move(group)),
      shm_(std::move(shm)),
      hier_(std::move(hierarchy)) {
  const auto& we = env::worker_env();
  trace_ = we.trace_collectives;
  auto algorithm =
      we.shm_allreduce == "copy" ? ShmGroup::Algorithm::kCopy : ShmGroup::Algorithm::kSplit;
  if (shm_) shm_->set_algorithm(algorithm);
  if (hier_) hier_->shm->set_algorithm(algorithm);
}

Comm::~Comm() = default;

namespace {
// What else must match between ranks for a shared-memory call: dtype, root, reduce op, and
// whether a sum is averaged (each rank scales the slices it reduces, so ranks that disagree
// would each hold part averaged and part not).
uint64_t detail(const at::Tensor& t, int root, c10d::ReduceOp op, bool average = false) {
  return static_cast<uint64_t>(t.scalar_type()) | static_cast<uint64_t>(root) << 16 |
         static_cast<uint64_t>(average) << 47 | static_cast<uint64_t>(op.op_) << 48;
}

bool shm_reduces(c10d::ReduceOp op) {
  return op == c10d::ReduceOp::SUM || op == c10d::ReduceOp::MAX || op == c10d::ReduceOp::MIN;
}
}  // namespace

Comm::Pending Comm::start(const char* op, std::size_t bytes) {
  Pending p;
  p.op = op;
  p.seq = seq_.fetch_add(1);
  p.bytes = bytes;
  p.started = std::chrono::steady_clock::now();
  progress::collective_started(p.seq, op, bytes);
  if (trace_)
    std::fprintf(stderr, "accel: rank %d %s #%llu %zu bytes\n", rank_, op,
                 static_cast<unsigned long long>(p.seq), bytes);
  return p;
}

std::string Comm::desync_report(const Pending& pending) {
  if (!store_) return "";
  std::ostringstream mine;
  mine << pending.op << " #" << pending.seq;
  std::string text = mine.str();
  try {
    store_->set(desync_key(rank_), std::vector<uint8_t>(text.begin(), text.end()));
  } catch (const std::exception&) {
    return " (the job's store is unreachable, so where the other ranks are is unknown)";
  }
  std::ostringstream out;
  auto deadline = std::chrono::steady_clock::now() + kDesyncWait;
  std::vector<int> silent;
  for (int r = 0; r < world_size_; ++r) {
    if (r == rank_) continue;
    try {
      while (!store_->check({desync_key(r)}) && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      if (store_->check({desync_key(r)})) {
        auto v = store_->get(desync_key(r));
        out << "; rank " << r << " failed in " << std::string(v.begin(), v.end());
      } else {
        silent.push_back(r);
      }
    } catch (const std::exception&) {
      silent.push_back(r);
    }
  }
  if (!silent.empty()) {
    out << "; rank";
    if (silent.size() > 1) out << "s";
    for (std::size_t i = 0; i < silent.size(); ++i) out << (i ? "," : " ") << silent[i];
    out << " did not report (still in another collective, busy, or dead)";
  }
  return out.str();
}

void Comm::fail(const Pending& pending, const std::string& cause) {
  // Why: a failed collective is no longer in flight; a caller that catches the error and goes on
  // must not look hung to the agent.
  progress::collective_finished(pending.seq);
  auto elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - pending.started);
  bool timed_out = elapsed >= timeout_ * 9 / 10;
  std::ostringstream msg;
  msg << "accel: " << pending.op << " #" << pending.seq << " (" << pending.bytes
      << " bytes) on rank " << rank_ << " of " << world_size_;
  if (timed_out) {
    msg << " timed out after " << format_duration(timeout_)
        << " (ACCEL_COLLECTIVE_TIMEOUT): a rank skipped it, called a different collective, or "
           "hangs";
  } else {
    msg << " failed after " << format_duration(elapsed) << ": " << cause;
  }
  msg << desync_report(pending);
  if (timed_out) msg << ". c10d said: " << cause;
  throw CollectiveError(msg.str());
}

// Why no per-call timeout: the group was created with the job's timeout, and setting one per call
// (AllreduceOptions::timeout) makes gloo's small allreduce ~5x slower (2.8 ms vs 0.5 ms for 4 KiB,
// measured with bench/train/bench_collectives).
Comm::Pending Comm::allreduce_async(at::Tensor& tensor, c10d::ReduceOp op, bool average) {
  Pending p = start("allreduce", nbytes(tensor));
  if (!group_) return p;
  if (shm_ && ShmGroup::can_reduce(tensor) && shm_reduces(op)) {
    const double scale = average && ShmGroup::can_scale(tensor) ? 1.0 / world_size_ : 1.0;
    const ShmGroup::Call call{p.op, p.seq, p.bytes, detail(tensor, 0, op, average)};
    // A tensor in a shared block (a gradient bucket) is posted: this rank goes on with its
    // backward, and wait() does its share of the reduction (ShmGroup::post). Any other is
    // reduced now: local shared-memory reduction takes microseconds.
    std::optional<uint64_t> ticket;
    guarded(p, [&] { ticket = shm_->post(tensor, op, call, scale); });
    if (ticket) {
      p.posted = *ticket + 1;
      if (average && scale == 1.0) p.divide = tensor;
      return p;
    }
    guarded(p, [&] {
      shm_->allreduce(tensor, op, call, nullptr, scale);
      if (average && scale == 1.0) tensor.div_(world_size_);
    });
    return p;
  }
  if (hier_ && ShmGroup::can_reduce(tensor) && shm_reduces(op)) {
    // The machine's sum in shared memory, the leaders' sum of those through gloo (in flight
    // until wait()), then the leader's result to its machine's ranks in wait(): every rank ends
    // with the leaders' bits.
    p.detail = detail(tensor, 0, op, average);
    guarded(p, [&] { hier_->shm->allreduce(tensor, op, {p.op, p.seq, p.bytes, p.detail}); });
    if (hier_->leaders) {
      std::vector<at::Tensor> tensors{tensor};
      c10d::AllreduceOptions opts;
      opts.reduceOp = op;
      guarded(p, [&] { p.work = hier_->leaders->allreduce(tensors, opts); });
    }
    p.node_broadcast = tensor;
    if (average) p.divide = tensor;
    return p;
  }
  std::vector<at::Tensor> tensors{tensor};
  if (average) p.divide = tensor;
  c10d::AllreduceOptions opts;
  opts.reduceOp = op;
  guarded(p, [&] { p.work = group_->allreduce(tensors, opts); });
  return p;
}

void Comm::wait(Pending& pending) {
  if (pending.posted != 0) {
    const uint64_t ticket = pending.posted - 1;
    pending.posted = 0;
    guarded(pending, [&] {
      shm_->finish(ticket);
      if (pending.divide.defined()) pending.divide.div_(world_size_);
    });
    pending.divide = at::Tensor();
  }
  if (!pending.work && !pending.node_broadcast.defined()) {
    progress::collective_finished(pending.seq);
    return;
  }
  if (pending.work) {
    auto t0 = progress::monotonic_ns();
    try {
      pending.work->wait();
      progress::collective_waited(progress::monotonic_ns() - t0);
    } catch (const std::exception& e) {
      progress::collective_waited(progress::monotonic_ns() - t0);
      pending.work.reset();
      pending.node_broadcast = at::Tensor();
      fail(pending, e.what());
    }
    pending.work.reset();
  }
  if (pending.node_broadcast.defined()) {
    at::Tensor t = std::move(pending.node_broadcast);
    pending.node_broadcast = at::Tensor();
    guarded(pending, [&] {
      hier_->shm->broadcast(t, 0, {"broadcast", pending.seq, pending.bytes, pending.detail});
    });
  }
  progress::collective_finished(pending.seq);
  if (pending.divide.defined()) {
    pending.divide.div_(world_size_);
    pending.divide = at::Tensor();
  }
}

void Comm::allreduce(at::Tensor& tensor, c10d::ReduceOp op) {
  Pending p = allreduce_async(tensor, op);
  wait(p);
}

at::Tensor Comm::allreduce_copy(const at::Tensor& input, c10d::ReduceOp op) {
  if (world_size_ > 1 && shm_ && ShmGroup::can_reduce(input) && shm_reduces(op)) {
    // Why: out of place through shared memory, the result is written once; a clone would cost a
    // read and a write of the whole tensor more.
    Pending p = start("allreduce", nbytes(input));
    at::Tensor out = at::empty_like(input);
    guarded(p, [&] {
      shm_->allreduce(out, op, {p.op, p.seq, p.bytes, detail(input, 0, op)}, &input);
    });
    wait(p);
    return out;
  }
  at::Tensor out = input.clone();
  allreduce(out, op);
  return out;
}

std::vector<at::Tensor> Comm::shared_zeros(
    const std::vector<std::pair<int64_t, at::TensorOptions>>& buffers, const std::string& what,
    const std::string& instead) {
  ShmGroup* shm = shm_ ? shm_.get() : hier_ ? hier_->shm.get() : nullptr;
  bool cpu = true;
  for (const auto& [numel, options] : buffers) cpu = cpu && options.device().is_cpu();
  std::vector<at::Tensor> out;
  // Why 64-byte alignment: no two buffers share a cache line, and the reduction loops' loads
  // stay aligned.
  std::vector<std::size_t> offsets;
  std::size_t bytes = 0;
  for (const auto& [numel, options] : buffers) {
    offsets.push_back(bytes);
    bytes += (static_cast<std::size_t>(numel) * options.dtype().itemsize() + 63) / 64 * 64;
  }
  std::shared_ptr<ShmGroup::Block> block;
  if (world_size_ > 1 && shm != nullptr && cpu && bytes > 0) {
    Pending p = start("share", bytes);
    std::string why;
    guarded(p, [&] { block = shm->share(bytes, {p.op, p.seq, p.bytes}, &why); });
    wait(p);
    if (!block && rank_ == 0) log::info(what + " stay in private memory (" + why + "): " + instead);
  }
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    const auto& [numel, options] = buffers[i];
    if (!block) {
      out.push_back(at::zeros({numel}, options));
      continue;
    }
    void* where = static_cast<char*>(shm->my_part(*block)) + offsets[i];
    out.push_back(at::from_blob(
        where, {numel}, [block](void*) {}, options));
  }
  return out;
}

at::Tensor Comm::machine_zeros(int64_t numel, const at::TensorOptions& options,
                               const std::string& what, const std::string& instead) {
  if (!shm_ || world_size_ < 2 || !options.device().is_cpu() || numel <= 0) return {};
  const auto world = static_cast<std::size_t>(world_size_);
  const std::size_t item = options.dtype().itemsize();
  const std::size_t share = (static_cast<std::size_t>(numel) + world - 1) / world * item;
  // Why whole pages: the block's parts are then exactly this long and lie back to back, so the
  // buffer runs on from rank 0's part through the others', each reserved by its own rank.
  const std::size_t per_rank = (share + 4095) / 4096 * 4096;
  Pending p = start("share", per_rank);
  std::string why;
  std::shared_ptr<ShmGroup::Block> block;
  guarded(p, [&] { block = shm_->share(per_rank, {p.op, p.seq, p.bytes}, &why); });
  wait(p);
  if (!block) {
    if (rank_ == 0) log::info(what + " stay in private memory (" + why + "): " + instead);
    return {};
  }
  return at::from_blob(
      shm_->part(*block, 0), {numel}, [block](void*) {}, options);
}

namespace {
constexpr std::size_t kTimedFromBytes = 1u << 20;
}  // namespace

std::string Comm::choose_allreduce(at::Tensor& sample) {
  // Why not below kTimedFromBytes: the two ways differ by microseconds there, less than the
  // timing's noise, and the timing would only add to the start.
  const auto bytes = static_cast<std::size_t>(sample.numel()) * sample.element_size();
  if (!shm_ || world_size_ < 2 || allreduce_chosen_ || bytes < kTimedFromBytes ||
      !ShmGroup::can_reduce(sample) || !env::worker_env().shm_allreduce.empty())
    return "";
  allreduce_chosen_ = true;
  const at::Tensor saved = sample.clone();
  const ShmGroup::Algorithm ways[2] = {ShmGroup::Algorithm::kSplit, ShmGroup::Algorithm::kCopy};
  double best[2];
  for (int w = 0; w < 2; ++w) {
    shm_->set_algorithm(ways[w]);
    best[w] = std::numeric_limits<double>::infinity();
    for (int i = 0; i < 4; ++i) {
      barrier();
      const auto t0 = std::chrono::steady_clock::now();
      allreduce(sample, c10d::ReduceOp::SUM);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (i > 0) best[w] = std::min(best[w], s);  // the first pays page faults and cold caches
    }
  }
  // Every rank's own part back; no rank writes into another's after the last all-reduce.
  sample.copy_(saved);
  // The slowest rank's time of each way: the same bits on every rank, so the same choice.
  auto times = at::tensor({best[0], best[1]}, at::kDouble);
  allreduce(times, c10d::ReduceOp::MAX);
  const double split = times[0].item<double>(), copy = times[1].item<double>();
  const bool use_copy = copy < split;
  shm_->set_algorithm(use_copy ? ShmGroup::Algorithm::kCopy : ShmGroup::Algorithm::kSplit);
  char text[128];
  std::snprintf(text, sizeof text, "split %.2f ms, copy %.2f ms: %s", split * 1e3, copy * 1e3,
                use_copy ? "copy" : "split");
  return text;
}

at::Tensor Comm::peer_part(const at::Tensor& t, int rank) {
  if (!shm_ || !t.defined() || !t.device().is_cpu() || !t.is_contiguous()) return {};
  void* p = shm_->peer_data(t, rank);
  if (p == nullptr) return {};
  return at::from_blob(p, t.sizes(), t.options());
}

void Comm::broadcast(at::Tensor& tensor, int root) {
  Pending p = start("broadcast", nbytes(tensor));
  if (!group_) return wait(p);
  if (shm_ && ShmGroup::can_move(tensor)) {
    guarded(p, [&] {
      shm_->broadcast(tensor, root,
                      {p.op, p.seq, p.bytes, detail(tensor, root, c10d::ReduceOp::SUM)});
    });
    return wait(p);
  }
  if (hier_ && ShmGroup::can_move(tensor)) {
    hier_broadcast(tensor, root, p);
    return wait(p);
  }
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  guarded(p, [&] { p.work = group_->broadcast(tensors, opts); });
  wait(p);
}

void Comm::allgather(at::Tensor& output, const at::Tensor& input) {
  Pending p = start("allgather", nbytes(input));
  if (!group_) {
    output.copy_(input);
    return wait(p);
  }
  if (shm_ && ShmGroup::can_move(input) && ShmGroup::can_move(output)) {
    guarded(p, [&] {
      shm_->allgather(output, input, {p.op, p.seq, p.bytes, detail(input, 0, c10d::ReduceOp::SUM)});
    });
    return wait(p);
  }
  if (hier_ && ShmGroup::can_move(input) && ShmGroup::can_move(output)) {
    hier_allgather(output, input, p);
    return wait(p);
  }
  std::vector<std::vector<at::Tensor>> outputs(1);
  const int64_t n = input.dim() == 0 ? 1 : input.size(0);
  for (int r = 0; r < world_size_; ++r) {
    outputs[0].push_back(input.dim() == 0 ? output.select(0, r) : output.narrow(0, r * n, n));
  }
  std::vector<at::Tensor> inputs{input.contiguous()};
  c10d::AllgatherOptions opts;
  guarded(p, [&] { p.work = group_->allgather(outputs, inputs, opts); });
  wait(p);
}

void Comm::barrier() {
  Pending p = start("barrier", 0);
  if (!group_) return wait(p);
  if (shm_) {
    guarded(p, [&] { shm_->barrier({p.op, p.seq, p.bytes}); });
    return wait(p);
  }
  if (hier_) {
    hier_barrier(p);
    return wait(p);
  }
  c10d::BarrierOptions opts;
  guarded(p, [&] { p.work = group_->barrier(opts); });
  wait(p);
}

// --- hierarchical forms ------------------------------------------------------------------------
// Each runs on every rank in the same order: the machines' shared-memory steps are independent of
// each other, and only the leaders take part in the gloo step between them.

void Comm::hier_broadcast(at::Tensor& tensor, int root, const Pending& p) {
  const int root_node = root / hier_->local_world, root_local = root % hier_->local_world;
  const uint64_t d = detail(tensor, root, c10d::ReduceOp::SUM);
  guarded(p, [&] {
    // The root's machine first (its leader then holds the data), the leaders, the other machines.
    if (hier_->node == root_node)
      hier_->shm->broadcast(tensor, root_local, {p.op, p.seq, p.bytes, d});
    if (hier_->leaders) {
      std::vector<at::Tensor> tensors{tensor};
      c10d::BroadcastOptions opts;
      opts.rootRank = root_node;
      hier_->leaders->broadcast(tensors, opts)->wait();
    }
    if (hier_->node != root_node) hier_->shm->broadcast(tensor, 0, {p.op, p.seq, p.bytes, d});
  });
}

void Comm::hier_allgather(at::Tensor& output, const at::Tensor& input, const Pending& p) {
  const int64_t per_rank = input.numel();
  const int local = hier_->local_world;
  const uint64_t d = detail(input, 0, c10d::ReduceOp::SUM);
  // Ranks are numbered machine by machine, so this machine's ranks fill one contiguous block.
  auto flat = output.view({-1});
  auto block = flat.narrow(0, int64_t{hier_->node} * local * per_rank, local * per_rank);
  guarded(p, [&] {
    hier_->shm->allgather(block, input, {p.op, p.seq, p.bytes, d});
    if (hier_->leaders) {
      std::vector<std::vector<at::Tensor>> outputs(1);
      for (int n = 0; n < hier_->nodes; ++n)
        outputs[0].push_back(flat.narrow(0, int64_t{n} * local * per_rank, local * per_rank));
      std::vector<at::Tensor> inputs{block.clone()};
      hier_->leaders->allgather(outputs, inputs, c10d::AllgatherOptions())->wait();
    }
    hier_->shm->broadcast(flat, 0, {p.op, p.seq, p.bytes, d});
  });
}

void Comm::hier_barrier(const Pending& p) {
  guarded(p, [&] {
    hier_->shm->barrier({p.op, p.seq, p.bytes});
    if (hier_->leaders) hier_->leaders->barrier(c10d::BarrierOptions())->wait();
    hier_->shm->barrier({p.op, p.seq, p.bytes});
  });
}

}  // namespace accel

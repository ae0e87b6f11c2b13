// ZeRO stage 1 (zero.h).
#include "runtime/zero.h"

#include <c10/util/Type.h>
#include <sys/mman.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <typeinfo>

#include "accel/error.h"
#include "runtime/fused_optimizer.h"
#include "runtime/optimizer_steps.h"

namespace accel::detail {
namespace {

namespace o = torch::optim;

// The exchange after a step moves the shards in pieces of this many elements: through shared
// memory 1 MiB of float (its memory, two pieces per rank, each rank reading every other's, counts
// against what sharding saves; a piece more costs one barrier, a few microseconds); through the
// all-gather 4 MiB (a gloo call costs about a millisecond).
constexpr int64_t kSharedPieceElements = int64_t{1} << 18;
constexpr int64_t kPieceElements = int64_t{1} << 20;

std::atomic<int64_t> mapped_state_bytes{0};  // map_state()'s blocks, in all optimizers

std::string describe(const torch::Tensor& t) {
  std::string shape;
  for (auto d : t.sizes()) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
  return std::string(c10::toString(t.scalar_type())) + " [" + shape + "] on " + t.device().str();
}

}  // namespace

ZeroOptimizer::ZeroOptimizer(torch::optim::Optimizer& optimizer, std::shared_ptr<State> state)
    : optimizer_(optimizer), state_(std::move(state)) {
  const auto& type = typeid(optimizer);
  const std::string name = c10::demangle(type.name());
  auto refuse = [&](const std::string& why) {
    throw UsageError("accel: ZeRO stage 1 (zero_stage = 1) cannot shard " + name + ": " + why);
  };
  if (type == typeid(o::AdamW)) {
    kind_ = Kind::kAdamW;
  } else if (type == typeid(o::Adam)) {
    kind_ = Kind::kAdam;
  } else if (type == typeid(o::SGD)) {
    kind_ = Kind::kSgd;
  } else {
    refuse("it shards torch::optim::Adam, AdamW and SGD (use zero_stage = 0 for others)");
  }
  torch::ScalarType dtype = torch::kFloat;
  bool first = true;
  for (std::size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    const auto& group = optimizer.param_groups()[g];
    first_of_group_.push_back(params_.size());
    if (kind_ == Kind::kAdamW && static_cast<const o::AdamWOptions&>(group.options()).amsgrad())
      refuse("amsgrad is not supported");
    if (kind_ == Kind::kAdam && static_cast<const o::AdamOptions&>(group.options()).amsgrad())
      refuse("amsgrad is not supported");
    for (const auto& p : group.params()) {
      if (!p.device().is_cpu() || p.layout() != torch::kStrided || !p.is_contiguous() ||
          p.is_inference() ||
          (p.scalar_type() != torch::kFloat && p.scalar_type() != torch::kDouble))
        refuse("parameter " + std::to_string(params_.size()) + " is " + describe(p) +
               "; it needs contiguous CPU float or double parameters");
      if (first) dtype = p.scalar_type();
      if (p.scalar_type() != dtype)
        refuse("its parameters mix " + std::string(c10::toString(dtype)) + " and " +
               c10::toString(p.scalar_type()));
      first = false;
      Param z;
      z.param = p;
      z.group = g;
      z.offset = total_;
      z.numel = p.numel();
      total_ += p.numel();
      params_.push_back(std::move(z));
    }
  }
  options_ = torch::TensorOptions().dtype(dtype);
  const int64_t world = comm().world_size(), rank = comm().rank();
  shard_ = (total_ + world - 1) / world;
  const int64_t mine_begin = rank * shard_, mine_end = std::min(total_, (rank + 1) * shard_);
  for (auto& z : params_) {
    const int64_t n = z.param.numel();
    z.begin = std::clamp<int64_t>(mine_begin - z.offset, 0, n);
    z.end = std::clamp<int64_t>(mine_end - z.offset, 0, n);
    if (z.end < z.begin) z.end = z.begin;
  }
  if (world > 1 && comm().uses_shared_memory()) {
    const int64_t piece = std::max<int64_t>(1, std::min(shard_, kSharedPieceElements));
    auto shared = comm().shared_zeros({{2 * piece, options_}}, "ZeRO's exchange buffers")[0];
    if (comm().peer_part(shared, 0).defined()) exchange_ = shared;
  }
  if (!exchange_.defined()) {
    const int64_t piece = std::max<int64_t>(1, std::min(shard_, kPieceElements));
    send_ = torch::zeros({piece}, options_);
    gathered_ = torch::empty({piece * world}, options_);
  }
  // A state loaded into the optimizer before prepare() (torch::load) is kept, sliced: in the
  // block for the parameters that have one, in copies for the others.
  const bool loaded = !optimizer.state().empty();
  if (loaded) check_loaded("the state " + name + " held when it was prepared");
  map_state([&](const Param& z) { return z.param.requires_grad() && keeps_state(z); });
  if (loaded) adopt_state();
}

bool ZeroOptimizer::keeps_state(const Param& z) const {
  if (kind_ != Kind::kSgd) return true;
  return static_cast<const o::SGDOptions&>(optimizer_.param_groups()[z.group].options())
             .momentum() != 0;
}

// Why in a block of its own, made at prepare(): made at the first step instead, among the freed
// temporaries of the first forward and backward, the slices left holes that the next steps'
// temporaries did not fit, and glibc's heap grew past the unsharded run's, so that sharding
// saved nothing in resident memory. Made before training, apart from the heap, they stay out
// of the temporaries' way.
bool ZeroOptimizer::map_state(const std::function<bool(const Param&)>& needs) {
  const int parts = kind_ == Kind::kSgd ? 1 : 2;
  auto wanted = [&](const Param& z) { return !z.first.defined() && needs(z); };
  int64_t per_part = 0;
  for (const auto& z : params_)
    if (wanted(z)) per_part += z.end - z.begin;
  if (per_part == 0) return true;
  const int64_t elements = parts * per_part;
  const std::size_t bytes = static_cast<std::size_t>(elements) * options_.dtype().itemsize();
  void* mapped = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) return false;
  // Counted before from_blob, whose deleter takes it off again; from_blob failing before it
  // owns the deleter (bad_alloc of its own few bytes) would leave the block mapped and counted.
  mapped_state_bytes += static_cast<int64_t>(bytes);
  auto block = torch::from_blob(
      mapped, {elements},
      [bytes](void* p) {
        ::munmap(p, bytes);
        mapped_state_bytes -= static_cast<int64_t>(bytes);
      },
      options_);
  int64_t at = 0;
  for (auto& z : params_) {
    if (!wanted(z)) continue;
    const int64_t n = z.end - z.begin;
    z.first = block.narrow(0, at, n);
    if (parts == 2) z.second = block.narrow(0, per_part + at, n);
    z.in_block = true;
    at += n;
  }
  return true;
}

torch::Tensor ZeroOptimizer::slice(const torch::Tensor& full, const Param& z) const {
  return full.reshape({-1}).narrow(0, z.begin, z.end - z.begin);
}

void ZeroOptimizer::check_unchanged() const {
  // Why before anything is updated: a refusal halfway would leave the ranks' slices apart.
  const auto& groups = optimizer_.param_groups();
  std::size_t count = 0;
  for (const auto& group : groups) count += group.params().size();
  if (count != params_.size()) {
    throw UsageError("accel: ZeRO: the optimizer has " + std::to_string(count) +
                     " parameters now, " + std::to_string(params_.size()) +
                     " when it was prepared; add parameter groups before prepare()");
  }
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto& z = params_[i];
    const auto& now = groups.at(z.group).params().at(i - first_of_group_.at(z.group));
    if (now.unsafeGetTensorImpl() != z.param.unsafeGetTensorImpl() ||
        now.scalar_type() != options_.dtype().toScalarType() || !now.is_contiguous() ||
        now.numel() != z.numel) {
      throw UsageError("accel: ZeRO: parameter " + std::to_string(i) +
                       " of the optimizer was replaced or changed (now " + describe(now) +
                       ") since prepare()");
    }
    const auto& grad = z.param.grad();
    if (grad.defined() &&
        (grad.scalar_type() != z.param.scalar_type() || grad.sizes() != z.param.sizes() ||
         !grad.device().is_cpu() || grad.is_sparse())) {
      throw UsageError("accel: ZeRO: the gradient of parameter " + std::to_string(i) + " is " +
                       describe(grad) + ", its parameter " + describe(z.param));
    }
  }
  if (!optimizer_.state().empty()) {
    throw UsageError(
        "accel: ZeRO: the optimizer's own state() is not empty: it was stepped through its "
        "original handle; step the object prepare() returned");
  }
}

void ZeroOptimizer::step() {
  check_unchanged();
  torch::NoGradGuard no_grad;
  const auto& groups = optimizer_.param_groups();
  // Parameters with no state memory that step now (frozen at prepare(), an SGD group's momentum
  // set since, slices a load dropped, or a block that could not be mapped then) get theirs in
  // one block too; if it cannot be mapped, each slice gets libtorch's memory below.
  map_state([&](const Param& z) { return z.param.grad().defined() && keeps_state(z); });
  for (std::size_t i = 0; i < params_.size(); ++i) {
    auto& z = params_[i];
    const auto& grad = z.param.grad();
    if (!grad.defined()) continue;  // as libtorch: no step, no state (the same on every rank)
    const int64_t n = z.end - z.begin;
    if (kind_ == Kind::kSgd) {
      const SgdRule rule = sgd_rule(groups[z.group]);
      bool fresh = false;
      if (rule.momentum != 0 && !z.has_state) {
        if (!z.first.defined()) z.first = torch::empty({n}, options_);
        z.has_state = fresh = true;  // fresh: the update writes every element of z.first
      }
      if (n > 0) {
        fused_sgd_update(slice(z.param, z), slice(grad.contiguous(), z),
                         rule.momentum != 0 ? z.first : torch::Tensor(), fresh, rule);
      }
    } else {
      const AdamRule rule = adam_rule(groups[z.group], kind_ == Kind::kAdamW);
      if (!z.has_state) {
        for (auto* t : {&z.first, &z.second}) {
          if (t->defined())
            t->zero_();
          else
            *t = torch::zeros({n}, options_);
        }
        z.has_state = true;
      }
      ++z.step;
      if (n > 0) {
        fused_adam_update(slice(z.param, z), slice(grad.contiguous(), z), z.first, z.second, z.step,
                          rule);
      }
    }
  }
  if (exchange_.defined()) return gather_through_exchange();
  // Every rank's slices to every rank, in pieces of C elements of each shard: piece k of rank r
  // is elements [r*S + k, r*S + k + C) of the sequence. Why pieces: buffers of (world + 1) * C
  // elements instead of a second copy of all the parameters.
  const int64_t world = comm().world_size(), base = comm().rank() * shard_;
  const int64_t piece = send_.numel();
  for (int64_t k = 0; k < shard_; k += piece) {
    const int64_t count = std::min(piece, shard_ - k);
    auto send = send_.narrow(0, 0, count);
    send.zero_();
    copy_sequence(base + k, count, send, /*to_params=*/false);
    auto gathered = gathered_.narrow(0, 0, count * world);
    comm().allgather(gathered, send);
    for (int64_t r = 0; r < world; ++r)
      copy_sequence(r * shard_ + k, count, gathered.narrow(0, r * count, count),
                    /*to_params=*/true);
  }
}

// The same pieces through shared memory: each rank copies its piece into its half of the
// exchange, and after a barrier every other rank copies it from there into its parameters: one
// copy of each slice, instead of four (into the send buffer, into shared memory, out of it, into
// the parameters). A piece's half is written again two pieces later, after the next barrier, by
// when every rank has read it; the last barrier keeps the next step's first piece off a half a
// slower rank still reads.
void ZeroOptimizer::gather_through_exchange() {
  const int world = comm().world_size(), rank = comm().rank();
  const int64_t piece = exchange_.numel() / 2;
  int half = 0;
  for (int64_t k = 0; k < shard_; k += piece, half ^= 1) {
    const int64_t count = std::min(piece, shard_ - k);
    auto mine = exchange_.narrow(0, half * piece, count);
    copy_sequence(int64_t{rank} * shard_ + k, count, mine, /*to_params=*/false);
    comm().barrier();
    for (int r = 0; r < world; ++r) {
      if (r == rank) continue;
      copy_sequence(int64_t{r} * shard_ + k, count, comm().peer_part(mine, r), /*to_params=*/true);
    }
  }
  comm().barrier();
}

void ZeroOptimizer::copy_sequence(int64_t from, int64_t count, const torch::Tensor& buffer,
                                  bool to_params, const std::vector<torch::Tensor>* tensors) {
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto& z = params_[i];
    const int64_t lo = std::max(from, z.offset);
    const int64_t hi = std::min({from + count, z.offset + z.numel, total_});
    if (lo >= hi) continue;
    const auto& whole = tensors ? (*tensors)[i] : z.param;
    if (!whole.defined()) continue;
    // Why: a parameter that had no gradient here did not step (frozen: no gradient on any rank);
    // its elements of another rank's slice are that rank's values, not an update.
    if (to_params && !tensors && !z.param.grad().defined()) continue;
    auto part = whole.view({-1}).narrow(0, lo - z.offset, hi - lo);
    auto there = buffer.narrow(0, lo - from, hi - lo);
    if (to_params)
      part.copy_(there);
    else
      there.copy_(part);
  }
}

void ZeroOptimizer::gather_state(bool install) {
  torch::NoGradGuard no_grad;
  const int64_t world = comm().world_size(), base = comm().rank() * shard_;
  // Adam/AdamW: exp_avg and exp_avg_sq; SGD: the momentum buffer.
  const int parts = kind_ == Kind::kSgd ? 1 : 2;
  // The whole state tensors, on the installing ranks only; filled piece by piece. Why pieces:
  // a whole all-gathered copy on every rank (and a second one to cut it up) would make a save
  // need more memory than the unsharded optimizer, on every rank, just when sharding is why the
  // model fits.
  std::vector<std::vector<torch::Tensor>> whole(static_cast<std::size_t>(parts));
  for (auto& tensors : whole) {
    for (const auto& z : params_) {
      tensors.push_back(install && z.has_state ? torch::empty({z.numel}, options_)
                                               : torch::Tensor());
    }
  }
  // Why divided by world: the gathered piece, world of them, stays within kPieceElements.
  const int64_t piece = std::max<int64_t>(1, std::min(shard_, kPieceElements / world));
  auto send_buffer = torch::empty({piece}, options_);
  auto gathered_buffer = torch::empty({piece * world}, options_);
  for (int k = 0; k < parts; ++k) {
    for (int64_t from = 0; from < shard_; from += piece) {
      const int64_t count = std::min(piece, shard_ - from);
      auto send = send_buffer.narrow(0, 0, count);
      send.zero_();
      for (const auto& z : params_) {
        const auto& mine = k == 0 ? z.first : z.second;
        const int64_t lo = std::max(base + from, z.offset + z.begin);
        const int64_t hi = std::min(base + from + count, z.offset + z.end);
        if (!z.has_state || !mine.defined() || lo >= hi) continue;
        send.narrow(0, lo - base - from, hi - lo)
            .copy_(mine.narrow(0, lo - z.offset - z.begin, hi - lo));
      }
      auto gathered = gathered_buffer.narrow(0, 0, count * world);
      comm().allgather(gathered, send);
      if (!install) continue;
      for (int64_t r = 0; r < world; ++r) {
        copy_sequence(r * shard_ + from, count, gathered.narrow(0, r * count, count),
                      /*to_params=*/true, &whole[static_cast<std::size_t>(k)]);
      }
    }
  }
  if (!install) return;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto& z = params_[i];
    if (!z.has_state) continue;
    auto part = [&](int k) { return whole[static_cast<std::size_t>(k)][i].view(z.param.sizes()); };
    std::unique_ptr<o::OptimizerParamState> state;
    if (kind_ == Kind::kAdamW) {
      auto s = std::make_unique<o::AdamWParamState>();
      s->step(z.step).exp_avg(part(0)).exp_avg_sq(part(1));
      state = std::move(s);
    } else if (kind_ == Kind::kAdam) {
      auto s = std::make_unique<o::AdamParamState>();
      s->step(z.step).exp_avg(part(0)).exp_avg_sq(part(1));
      state = std::move(s);
    } else {
      auto s = std::make_unique<o::SGDParamState>();
      s->momentum_buffer(part(0));
      state = std::move(s);
    }
    optimizer_.state()[state_key(z.param)] = std::move(state);
  }
}

void ZeroOptimizer::clear_installed() { optimizer_.state().clear(); }

void ZeroOptimizer::check_loaded(const std::string& where) const {
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto& z = params_[i];
    auto it = optimizer_.state().find(state_key(z.param));
    if (it == optimizer_.state().end()) continue;
    std::vector<torch::Tensor> tensors;
    if (kind_ == Kind::kAdamW) {
      auto* s = dynamic_cast<const o::AdamWParamState*>(it->second.get());
      if (s) tensors = {s->exp_avg(), s->exp_avg_sq()};
    } else if (kind_ == Kind::kAdam) {
      auto* s = dynamic_cast<const o::AdamParamState*>(it->second.get());
      if (s) tensors = {s->exp_avg(), s->exp_avg_sq()};
    } else {
      auto* s = dynamic_cast<const o::SGDParamState*>(it->second.get());
      if (s) {
        if (!s->momentum_buffer().defined()) continue;
        tensors = {s->momentum_buffer()};
      }
    }
    if (tensors.empty())
      throw CheckpointError(where + ": the state of parameter " + std::to_string(i) +
                            " is not the optimizer's kind of state");
    for (const auto& t : tensors) {
      if (!t.defined() || t.numel() != z.param.numel() ||
          t.scalar_type() != z.param.scalar_type() || !t.device().is_cpu()) {
        throw CheckpointError(where + ": the state of parameter " + std::to_string(i) + " is " +
                              (t.defined() ? describe(t) : std::string("missing")) +
                              ", its parameter " + describe(z.param));
      }
    }
  }
}

void ZeroOptimizer::keep_slice(torch::Tensor& mine, const torch::Tensor& full,
                               const Param& z) const {
  auto part = slice(full.contiguous(), z);
  if (mine.defined())
    mine.copy_(part);  // a view of the block: the slice's own n elements, as `part`
  else
    mine = part.clone();
}

void ZeroOptimizer::adopt_state() {
  torch::NoGradGuard no_grad;
  for (auto& z : params_) {
    z.has_state = false;
    z.step = 0;
    // Why only outside a block: a block's views are its parameter's for good (zeroed or
    // overwritten at its first step); a slice of its own would only hold stale memory.
    if (!z.in_block) z.first = z.second = torch::Tensor();
    auto it = optimizer_.state().find(state_key(z.param));
    if (it == optimizer_.state().end()) continue;
    if (kind_ == Kind::kSgd) {
      const auto& s = static_cast<const o::SGDParamState&>(*it->second);
      if (!s.momentum_buffer().defined()) continue;
      keep_slice(z.first, s.momentum_buffer(), z);
    } else {
      const torch::Tensor* m = nullptr;
      const torch::Tensor* v = nullptr;
      if (kind_ == Kind::kAdamW) {
        const auto& s = static_cast<const o::AdamWParamState&>(*it->second);
        z.step = s.step();
        m = &s.exp_avg();
        v = &s.exp_avg_sq();
      } else {
        const auto& s = static_cast<const o::AdamParamState&>(*it->second);
        z.step = s.step();
        m = &s.exp_avg();
        v = &s.exp_avg_sq();
      }
      keep_slice(z.first, *m, z);
      keep_slice(z.second, *v, z);
    }
    z.has_state = true;
  }
  optimizer_.state().clear();
}

std::string ZeroOptimizer::describe_shard() const {
  const int64_t begin = std::min(total_, comm().rank() * shard_);
  const int64_t end = std::min(total_, begin + shard_);
  return "elements [" + std::to_string(begin) + ", " + std::to_string(end) + ") of " +
         std::to_string(total_) +
         (exchange_.defined() ? "; parameters exchanged through shared memory" : "");
}

int64_t ZeroOptimizer::mapped_bytes() { return mapped_state_bytes.load(); }

int64_t ZeroOptimizer::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& z : params_) {
    for (const auto* t : {&z.first, &z.second})
      if (t->defined()) bytes += t->numel() * static_cast<int64_t>(t->element_size());
  }
  return bytes;
}

}  // namespace accel::detail

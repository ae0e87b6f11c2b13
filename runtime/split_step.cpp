// The optimizer step split between a machine's ranks (split_step.h).
#include "runtime/split_step.h"

#include <torch/csrc/autograd/variable.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <typeinfo>
#include <unordered_set>

#include "runtime/fused_optimizer.h"
#include "runtime/log.h"
#include "runtime/optimizer_steps.h"

namespace accel::detail {
namespace {

namespace o = torch::optim;

// Adam's and AdamW's states have the same fields; `Fn` gets the one the optimizer keeps.
template <class Fn>
void with_adam_state(o::OptimizerParamState* s, bool decoupled, Fn&& fn) {
  if (decoupled)
    fn(dynamic_cast<o::AdamWParamState*>(s));
  else
    fn(dynamic_cast<o::AdamParamState*>(s));
}

}  // namespace

std::unique_ptr<SplitStep> SplitStep::create(torch::optim::Optimizer& optimizer,
                                             std::shared_ptr<State> state,
                                             std::function<bool(const torch::Tensor&)> averaged,
                                             bool any_size) {
  if (!state || state->comm().world_size() < 2 || !state->comm().uses_shared_memory())
    return nullptr;
  // Exact types only: a subclass may have its own step().
  const auto& type = typeid(optimizer);
  Kind kind;
  if (type == typeid(o::AdamW))
    kind = Kind::kAdamW;
  else if (type == typeid(o::Adam))
    kind = Kind::kAdam;
  else if (type == typeid(o::SGD))
    kind = Kind::kSgd;
  else
    return nullptr;
  return std::unique_ptr<SplitStep>(new SplitStep(
      optimizer, std::move(state), kind, std::move(averaged), any_size ? 0 : kMinElements));
}

SplitStep::SplitStep(torch::optim::Optimizer& optimizer, std::shared_ptr<State> state, Kind kind,
                     std::function<bool(const torch::Tensor&)> averaged, int64_t min_elements)
    : optimizer_(optimizer),
      state_(std::move(state)),
      kind_(kind),
      averaged_(std::move(averaged)),
      min_elements_(min_elements) {}

SplitStep::Check SplitStep::check() const {
  // What the fused step takes (options, gradients, state), and below what placing needs besides.
  if (!fused_step_fits(optimizer_)) return kRefuse;
  Check need = kReady;
  std::size_t i = 0;
  std::optional<torch::ScalarType> dtype;
  std::unordered_set<const void*> seen;
  const auto& groups = optimizer_.param_groups();
  for (std::size_t g = 0; g < groups.size(); ++g) {
    // SGD placed without momentum has no home for a momentum buffer.
    if (kind_ == Kind::kSgd && sgd_rule(groups[g]).momentum != 0 && state_home_.empty())
      need = kPlace;
    for (const auto& p : groups[g].params()) {
      // Why refused: a tensor listed twice (added again after prepare()) would be placed twice,
      // and one of its slices written where no rank's parameter lies.
      if (!seen.insert(p.unsafeGetTensorImpl()).second) return kRefuse;
      // Every parameter, with a gradient or not (the fused step looks only at those with one):
      // each moves into the block of one dtype.
      const auto s = p.scalar_type();
      if (!p.device().is_cpu() || p.layout() != torch::kStrided || !p.is_contiguous() ||
          p.is_inference() || (s != torch::kFloat && s != torch::kDouble) ||
          (dtype && *dtype != s) || !averaged_(p))
        return kRefuse;
      dtype = s;
      // Why compared by address: a parameter replaced, resized, retyped or moved out of the
      // block (set_, a load that swaps storage) is placed again, with all the others.
      if (i >= params_.size() || params_[i].impl != p.unsafeGetTensorImpl() ||
          params_[i].group != g || params_[i].numel != p.numel() || !flat_.defined() ||
          flat_.scalar_type() != s ||
          (p.numel() > 0 &&  // an empty tensor's data_ptr() is null
           p.data_ptr() != static_cast<char*>(flat_.data_ptr()) +
                               params_[i].offset * static_cast<int64_t>(flat_.element_size())))
        need = kPlace;
      ++i;
    }
  }
  if (i != params_.size()) need = kPlace;
  return need;
}

bool SplitStep::place() {
  torch::NoGradGuard no_grad;
  unshare();
  std::optional<torch::ScalarType> dtype;
  const auto& groups = optimizer_.param_groups();
  for (std::size_t g = 0; g < groups.size(); ++g) {
    for (const auto& p : groups[g].params()) {
      dtype = p.scalar_type();
      params_.push_back(Param{p.unsafeGetTensorImpl(), g, total_, p.numel()});
      total_ += p.numel();
    }
  }
  if (total_ == 0) return false;
  const auto options = torch::TensorOptions().dtype(*dtype);
  const int world = comm().world_size(), rank = comm().rank();
  const std::string instead = "every process runs the whole optimizer step instead";
  auto flat =
      comm().shared_zeros({{total_, options}}, "the split optimizer step's parameters", instead)[0];
  // Private memory (no room in /dev/shm), on every rank alike: nothing to write into.
  if (!comm().peer_part(flat, 0).defined()) return false;
  // AdamW: exp_avg, exp_avg_sq; SGD: the momentum buffer, if a group has momentum.
  std::size_t states = 2;
  if (kind_ == Kind::kSgd) {
    states = 0;
    for (const auto& group : groups) states = sgd_rule(group).momentum != 0 ? 1 : states;
  }
  std::vector<torch::Tensor> homes;
  for (std::size_t k = 0; k < states; ++k) {
    homes.push_back(
        comm().machine_zeros(total_, options, "the split optimizer step's state buffers", instead));
    if (!homes.back().defined()) return false;  // on every rank alike
  }
  for (int r = 0; r < world; ++r) {
    if (r != rank) peers_.push_back(static_cast<char*>(comm().peer_part(flat, r).data_ptr()));
  }
  state_home_ = std::move(homes);
  std::size_t i = 0;
  for (const auto& group : groups) {
    for (const auto& p : group.params()) {
      const auto& z = params_[i++];
      auto there = flat.narrow(0, z.offset, z.numel);
      there.copy_(p.reshape({-1}));
      // The tensor stays the parameter (the module, the optimizer and autograd hold it); only its
      // memory moves. Why set_data (Python's `p.data = ...`) and not set_: set_ gives the
      // parameter a new gradient accumulator, and the hooks that sync its gradient sit on the old.
      torch::Tensor(p).set_data(there.view(p.sizes()));
    }
  }
  flat_ = flat;
  // Why: no rank may write its updated slice into another's parameters before that rank has
  // copied its parameters in.
  comm().barrier();
  const int64_t shard = (total_ + world - 1) / world;
  mine_begin_ = std::min(total_, rank * shard);
  mine_end_ = std::min(total_, mine_begin_ + shard);
  log::debug("optimizer step split between this machine's " + std::to_string(world) +
             " ranks: this rank updates " + describe());
  return true;
}

torch::Tensor SplitStep::home(int k, const Param& z, const torch::Tensor& param) const {
  return state_home_.at(static_cast<std::size_t>(k))
      .narrow(0, z.offset, z.numel)
      .view(param.sizes());
}

torch::Tensor SplitStep::adopt(const torch::Tensor& held, int k, const Param& z,
                               const torch::Tensor& param, int64_t lo, int64_t hi) const {
  auto at_home = home(k, z, param);
  if (held.defined() && held.data_ptr() == at_home.data_ptr()) return held;
  if (hi > lo) {
    auto part = at_home.view({-1}).narrow(0, lo, hi - lo);
    if (held.defined())
      part.copy_(held.reshape({-1}).narrow(0, lo, hi - lo));
    else
      part.zero_();
  }
  return at_home;
}

void SplitStep::update(const torch::Tensor& param, const Param& z, int64_t lo, int64_t hi) {
  const auto& group = optimizer_.param_groups()[z.group];
  const auto item = static_cast<int64_t>(param.element_size());
  UpdateRange range{lo, hi, [&](int64_t b, int64_t e) {
                      const auto* from = static_cast<const char*>(param.data_ptr()) + b * item;
                      for (char* peer : peers_)
                        std::memcpy(peer + (z.offset + b) * item, from,
                                    static_cast<std::size_t>((e - b) * item));
                    }};
  const auto key = state_key(param);
  auto& states = optimizer_.state();
  auto it = states.find(key);
  if (kind_ == Kind::kSgd) {
    const SgdRule rule = sgd_rule(group);
    torch::Tensor buffer;
    bool first = false;
    if (rule.momentum != 0) {
      auto* s = it == states.end() ? nullptr : static_cast<o::SGDParamState*>(it->second.get());
      if (s == nullptr || !s->momentum_buffer().defined()) {
        // The first step sets the buffer to d_p (libtorch clones it): nothing to zero.
        buffer = home(0, z, param);
        auto fresh = std::make_unique<o::SGDParamState>();
        fresh->momentum_buffer(buffer);
        states.insert_or_assign(key, std::move(fresh));
        first = true;
      } else {
        buffer = adopt(s->momentum_buffer(), 0, z, param, lo, hi);
        s->momentum_buffer(buffer);
      }
    }
    if (hi > lo) fused_sgd_update(param, param.grad(), buffer, first, rule, range);
  } else {
    const bool decoupled = kind_ == Kind::kAdamW;
    const AdamRule rule = adam_rule(group, decoupled);
    if (it == states.end()) {
      std::unique_ptr<o::OptimizerParamState> fresh;
      if (decoupled)
        fresh = std::make_unique<o::AdamWParamState>();
      else
        fresh = std::make_unique<o::AdamParamState>();
      it = states.insert_or_assign(key, std::move(fresh)).first;
      with_adam_state(it->second.get(), decoupled, [&](auto* s) {
        s->step(0);
        s->exp_avg(adopt({}, 0, z, param, lo, hi));
        s->exp_avg_sq(adopt({}, 1, z, param, lo, hi));
      });
    } else {
      with_adam_state(it->second.get(), decoupled, [&](auto* s) {
        s->exp_avg(adopt(s->exp_avg(), 0, z, param, lo, hi));
        s->exp_avg_sq(adopt(s->exp_avg_sq(), 1, z, param, lo, hi));
      });
    }
    with_adam_state(it->second.get(), decoupled, [&](auto* s) {
      s->step(s->step() + 1);
      if (hi > lo)
        fused_adam_update(param, param.grad(), s->exp_avg(), s->exp_avg_sq(), s->step(), rule,
                          range);
    });
  }
  // Why: the other ranks wrote the rest of it (or all of it), which autograd must count as a
  // change, as it counts the fused step's.
  if (hi <= lo) torch::autograd::impl::bump_version(param);
}

bool SplitStep::step() {
  if (off_) return false;
  // The same count on every rank: every rank decides alike without asking the others.
  int64_t elements = 0;
  for (const auto& group : optimizer_.param_groups())
    for (const auto& p : group.params()) elements += p.numel();
  if (elements < min_elements_) {
    // Placed when it was larger (a parameter shrunk since): each rank's whole step needs its own
    // state. No collective needed: the last split step ended with a barrier, and every rank
    // counts the same elements.
    if (!state_home_.empty()) unshare();
    return false;
  }
  // Why a collective first, also when this rank is ready: it is the barrier that keeps every
  // rank's writes out of the others' parameters and state until each has finished with them.
  auto agreed = torch::tensor({static_cast<int>(check())}, torch::kInt);
  comm().allreduce(agreed, c10d::ReduceOp::MAX);
  const int need = agreed.item<int>();
  if (need == kRefuse) {
    unshare();
    return false;
  }
  if (need == kPlace && !place()) {
    unshare();
    off_ = true;
    return false;
  }
  torch::NoGradGuard no_grad;
  const auto& groups = optimizer_.param_groups();
  std::size_t i = 0;
  for (const auto& group : groups) {
    for (const auto& param : group.params()) {
      const auto& z = params_[i++];
      if (!param.grad().defined()) continue;  // as libtorch: no step, no state (every rank alike)
      const int64_t lo = std::clamp<int64_t>(mine_begin_ - z.offset, 0, z.numel);
      const int64_t hi = std::clamp<int64_t>(mine_end_ - z.offset, lo, z.numel);
      update(param, z, lo, hi);
    }
  }
  comm().barrier();
  return true;
}

void SplitStep::unshare() {
  torch::NoGradGuard no_grad;
  auto shared = [&](const torch::Tensor& t) {
    if (!t.defined() || t.numel() == 0) return false;
    const auto* p = static_cast<const char*>(t.data_ptr());
    for (const auto& home : state_home_) {
      const auto* begin = static_cast<const char*>(home.data_ptr());
      if (p >= begin && p < begin + home.numel() * static_cast<int64_t>(home.element_size()))
        return true;
    }
    return false;
  };
  for (auto& [key, held] : optimizer_.state()) {
    if (auto* s = dynamic_cast<o::SGDParamState*>(held.get())) {
      if (shared(s->momentum_buffer())) s->momentum_buffer(s->momentum_buffer().clone());
      continue;
    }
    with_adam_state(held.get(), kind_ == Kind::kAdamW, [&](auto* a) {
      if (a == nullptr) return;
      if (shared(a->exp_avg())) a->exp_avg(a->exp_avg().clone());
      if (shared(a->exp_avg_sq())) a->exp_avg_sq(a->exp_avg_sq().clone());
    });
  }
  // The parameters stay in this rank's part of their block (their own memory); the next split
  // step places them again, with everything else.
  state_home_.clear();
  peers_.clear();
  params_.clear();
  flat_ = torch::Tensor();
  total_ = 0;
}

std::string SplitStep::describe() const {
  if (!flat_.defined()) return "not placed yet";
  return "elements [" + std::to_string(mine_begin_) + ", " + std::to_string(mine_end_) + ") of " +
         std::to_string(total_);
}

}  // namespace accel::detail

// One-pass Adam, AdamW and SGD steps (fused_optimizer.h).
#include "runtime/fused_optimizer.h"

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <typeinfo>
#include <vector>

#include "runtime/optimizer_steps.h"

namespace accel::detail {
namespace {

namespace o = torch::optim;

// Why: below this many elements a thread costs more than it saves (ATen's GRAIN_SIZE).
constexpr int64_t kGrain = 32768;
// Why: an update with a `written` callback goes in pieces of this many elements, so that what the
// callback reads (the piece of the parameter just written: 128 KiB of float) is still in the
// core's own cache, with the piece's gradient and state (4 x 128 KiB in all for Adam).
constexpr int64_t kPiece = 32768;

bool same_layout(const torch::Tensor& t, const torch::Tensor& p) {
  return t.defined() && t.device().is_cpu() && t.layout() == torch::kStrided &&
         t.scalar_type() == p.scalar_type() && t.is_contiguous() && t.sizes() == p.sizes() &&
         !t.is_inference();
}

bool fusable_param(const torch::Tensor& p) {
  if (!p.grad().defined()) return true;  // skipped by the step, as libtorch skips it
  auto s = p.scalar_type();
  return p.device().is_cpu() && p.layout() == torch::kStrided && p.is_contiguous() &&
         !p.is_inference() && (s == torch::kFloat || s == torch::kDouble) &&
         same_layout(p.grad(), p);
}

// The libtorch coefficients of one Adam/AdamW step, in the parameter's dtype where libtorch's
// ops convert their scalar arguments to it.
template <class T>
struct AdamCoeffs {
  T decay;  // AdamW: p *= 1 - lr * weight_decay (before the update)
  T l2;     // Adam: grad + weight_decay * p
  T beta1, one_minus_beta1, beta2, one_minus_beta2;
  T bias2_sqrt;  // sqrt(1 - beta2^step)
  T eps;
  T neg_step_size;  // -lr / (1 - beta1^step)
};

// a * b + c rounded as ATen's elementwise kernels round it: once (a fused multiply-add) where
// ATen runs its AVX2 kernels (CPUs with AVX2 and FMA), twice otherwise.
template <bool kFma>
inline float madd(float a, float b, float c) {
  if constexpr (kFma) return __builtin_fmaf(a, b, c);
  return a * b + c;
}
template <bool kFma>
inline double madd(double a, double b, double c) {
  if constexpr (kFma) return __builtin_fma(a, b, c);
  return a * b + c;
}

// True where ATen 1.13 dispatches its AVX2 kernels, whose add(alpha) and addcmul round with FMA.
// ATEN_CPU_CAPABILITY=default makes ATen run its baseline kernels everywhere; so does this.
bool cpu_has_fma() {
  static const bool has = [] {
    const char* forced = std::getenv("ATEN_CPU_CAPABILITY");
    if (forced != nullptr && std::string(forced) == "default") return false;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return has;
}

// Per element, libtorch 1.13's C++ Adam/AdamW step, each operation rounded as ATen's kernel for
// it rounds (checked against python3-torch 1.13 element by element):
//   AdamW: p.mul_(1 - lr*wd)               Adam: grad = grad.add(p, wd)        fma(wd, p, g)
//   exp_avg.mul_(beta1).add_(grad, 1 - beta1)                   fma(1 - beta1, g, m * beta1)
//   exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)      fma((1 - beta2) * g, g, v * beta2)
//   denom = (exp_avg_sq.sqrt() / sqrt(bias_correction2)).add_(eps)
//   p.addcdiv_(exp_avg, denom, -lr / bias_correction1)          p + (value * m) / denom
template <class T, bool kDecoupled, bool kL2, bool kFma>
inline __attribute__((always_inline)) void adam_body(T* __restrict__ p, const T* __restrict__ g,
                                                     T* __restrict__ m, T* __restrict__ v,
                                                     int64_t begin, int64_t end,
                                                     const AdamCoeffs<T>& c) {
  for (int64_t i = begin; i < end; ++i) {
    T pi = p[i];
    if constexpr (kDecoupled) pi = pi * c.decay;
    T gi = g[i];
    if constexpr (kL2) gi = madd<kFma>(c.l2, pi, gi);
    T mi = madd<kFma>(c.one_minus_beta1, gi, m[i] * c.beta1);
    T vi = madd<kFma>(c.one_minus_beta2 * gi, gi, v[i] * c.beta2);
    T denom = std::sqrt(vi) / c.bias2_sqrt + c.eps;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi + c.neg_step_size * mi / denom;
  }
}

template <class T, bool kFma>
inline __attribute__((always_inline)) void adam_variants(T* p, const T* g, T* m, T* v,
                                                         int64_t begin, int64_t end,
                                                         const AdamCoeffs<T>& c, bool decoupled,
                                                         bool l2) {
  if (decoupled)
    adam_body<T, true, false, kFma>(p, g, m, v, begin, end, c);
  else if (l2)
    adam_body<T, false, true, kFma>(p, g, m, v, begin, end, c);
  else
    adam_body<T, false, false, kFma>(p, g, m, v, begin, end, c);
}

// Why two functions: the FMA one is compiled for AVX2 + FMA (vectorized, one instruction per
// fused multiply-add), the other for the baseline; cpu_has_fma() picks, as ATen picks its kernels.
template <class T>
__attribute__((target("avx2,fma"))) void adam_range_fma(T* p, const T* g, T* m, T* v, int64_t begin,
                                                        int64_t end, const AdamCoeffs<T>& c,
                                                        bool decoupled, bool l2) {
  adam_variants<T, true>(p, g, m, v, begin, end, c, decoupled, l2);
}
template <class T>
void adam_range_plain(T* p, const T* g, T* m, T* v, int64_t begin, int64_t end,
                      const AdamCoeffs<T>& c, bool decoupled, bool l2) {
  adam_variants<T, false>(p, g, m, v, begin, end, c, decoupled, l2);
}

// Runs `body` over the elements `range` names (of `numel`): in one parallel_for, or, with a
// `written` callback, in pieces of kPiece elements, each followed by the callback.
void for_range(int64_t numel, const UpdateRange& range,
               const std::function<void(int64_t, int64_t)>& body) {
  const int64_t begin = std::clamp<int64_t>(range.begin, 0, numel);
  const int64_t end = range.end < 0 ? numel : std::clamp<int64_t>(range.end, begin, numel);
  if (!range.written) {
    at::parallel_for(begin, end, kGrain, body);
    return;
  }
  for (int64_t b = begin; b < end; b += kPiece) {
    const int64_t e = std::min(end, b + kPiece);
    at::parallel_for(b, e, kGrain, body);
    range.written(b, e);
  }
}

template <class T>
void adam_param(const torch::Tensor& param, const torch::Tensor& grad, const torch::Tensor& exp_avg,
                const torch::Tensor& exp_avg_sq, const AdamCoeffs<T>& c, bool decoupled, bool l2,
                const UpdateRange& range) {
  T* p = param.data_ptr<T>();
  const T* g = grad.data_ptr<T>();
  T* m = exp_avg.data_ptr<T>();
  T* v = exp_avg_sq.data_ptr<T>();
  const bool fma = cpu_has_fma();
  for_range(param.numel(), range, [&](int64_t begin, int64_t end) {
    if (fma)
      adam_range_fma<T>(p, g, m, v, begin, end, c, decoupled, l2);
    else
      adam_range_plain<T>(p, g, m, v, begin, end, c, decoupled, l2);
  });
  // Why: written through raw pointers, as in-place ops would write them; autograd must see the
  // change (a graph kept across the step then refuses to run backward, as with libtorch's step).
  for (const auto* t : {&param, &exp_avg, &exp_avg_sq}) torch::autograd::impl::bump_version(*t);
}

template <class State>
bool state_fusable(o::Optimizer& optimizer, const torch::Tensor& p) {
  auto it = optimizer.state().find(state_key(p));
  if (it == optimizer.state().end()) return true;
  auto* s = dynamic_cast<State*>(it->second.get());
  return s != nullptr && same_layout(s->exp_avg(), p) && same_layout(s->exp_avg_sq(), p);
}

// Adam (decoupled = false) and AdamW (true): their options and states have the same fields.
template <class Options, class State>
bool adam_fits(o::Optimizer& optimizer) {
  for (auto& group : optimizer.param_groups()) {
    auto& opts = static_cast<Options&>(group.options());
    if (opts.amsgrad()) return false;
    for (auto& p : group.params()) {
      if (!fusable_param(p) || !state_fusable<State>(optimizer, p)) return false;
    }
  }
  return true;
}

// Adam (decoupled = false) and AdamW (true), once adam_fits said yes.
template <class State>
void adam_step(o::Optimizer& optimizer, bool decoupled) {
  torch::NoGradGuard no_grad;
  for (auto& group : optimizer.param_groups()) {
    const AdamRule rule = adam_rule(group, decoupled);
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      auto key = state_key(p);
      auto it = optimizer.state().find(key);
      if (it == optimizer.state().end()) {
        auto state = std::make_unique<State>();
        state->step(0);
        state->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        state->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        it = optimizer.state().insert_or_assign(key, std::move(state)).first;
      }
      auto& state = static_cast<State&>(*it->second);
      state.step(state.step() + 1);
      fused_adam_update(p, p.grad(), state.exp_avg(), state.exp_avg_sq(), state.step(), rule);
    }
  }
}

// Per element, libtorch 1.13's C++ SGD step (ATen's add with alpha rounds as an FMA, above):
//   d_p = grad (+ weight_decay * p)                                  fma(wd, p, g)
//   momentum: buf = first step ? d_p : buf * momentum + (1 - dampening) * d_p
//             d_p = nesterov ? d_p + momentum * buf : buf
//   p.add_(d_p, -lr)                                                 fma(-lr, d_p, p)
template <class T>
struct SgdCoeffs {
  T weight_decay, momentum, one_minus_dampening, neg_lr;
  bool has_decay, has_momentum, first, nesterov;
};

template <class T, bool kFma>
inline __attribute__((always_inline)) void sgd_body(T* __restrict__ p, const T* __restrict__ g,
                                                    T* __restrict__ buf, int64_t begin, int64_t end,
                                                    const SgdCoeffs<T>& c) {
  for (int64_t i = begin; i < end; ++i) {
    T d = g[i];
    if (c.has_decay) d = madd<kFma>(c.weight_decay, p[i], d);
    if (c.has_momentum) {
      T b = c.first ? d : madd<kFma>(c.one_minus_dampening, d, buf[i] * c.momentum);
      buf[i] = b;
      d = c.nesterov ? madd<kFma>(c.momentum, b, d) : b;
    }
    p[i] = madd<kFma>(c.neg_lr, d, p[i]);
  }
}

template <class T>
__attribute__((target("avx2,fma"))) void sgd_range_fma(T* p, const T* g, T* buf, int64_t begin,
                                                       int64_t end, const SgdCoeffs<T>& c) {
  sgd_body<T, true>(p, g, buf, begin, end, c);
}
template <class T>
void sgd_range_plain(T* p, const T* g, T* buf, int64_t begin, int64_t end, const SgdCoeffs<T>& c) {
  sgd_body<T, false>(p, g, buf, begin, end, c);
}

bool sgd_fits(o::Optimizer& optimizer) {
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (!fusable_param(p)) return false;
      auto it = optimizer.state().find(state_key(p));
      if (it == optimizer.state().end()) continue;
      auto* s = dynamic_cast<o::SGDParamState*>(it->second.get());
      if (s == nullptr || (s->momentum_buffer().defined() && !same_layout(s->momentum_buffer(), p)))
        return false;
    }
  }
  return true;
}

void sgd_step(o::Optimizer& optimizer) {
  torch::NoGradGuard no_grad;
  for (auto& group : optimizer.param_groups()) {
    auto& opts = static_cast<o::SGDOptions&>(group.options());
    const SgdRule rule = sgd_rule(group);
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      torch::Tensor buf;
      bool first = false;
      if (opts.momentum() != 0) {
        auto key = state_key(p);
        auto it = optimizer.state().find(key);
        if (it == optimizer.state().end() ||
            !static_cast<o::SGDParamState&>(*it->second).momentum_buffer().defined()) {
          // libtorch clones d_p: a contiguous buffer of the parameter's shape.
          buf = torch::empty(p.sizes(), p.options());
          auto state = std::make_unique<o::SGDParamState>();
          state->momentum_buffer(buf);
          optimizer.state().insert_or_assign(key, std::move(state));
          first = true;
        } else {
          buf = static_cast<o::SGDParamState&>(*it->second).momentum_buffer();
        }
      }
      fused_sgd_update(p, p.grad(), buf, first, rule);
    }
  }
}

}  // namespace

AdamRule adam_rule(const torch::optim::OptimizerParamGroup& group, bool decoupled) {
  // Adam's and AdamW's options have the same fields; read through the one the group holds.
  auto read = [&](const auto& opts) {
    return AdamRule{opts.lr(),  std::get<0>(opts.betas()), std::get<1>(opts.betas()),
                    opts.eps(), opts.weight_decay(),       decoupled};
  };
  if (decoupled) return read(static_cast<const o::AdamWOptions&>(group.options()));
  return read(static_cast<const o::AdamOptions&>(group.options()));
}

SgdRule sgd_rule(const torch::optim::OptimizerParamGroup& group) {
  const auto& opts = static_cast<const o::SGDOptions&>(group.options());
  return SgdRule{opts.lr(), opts.momentum(), opts.dampening(), opts.weight_decay(),
                 opts.nesterov()};
}

void fused_adam_update(const torch::Tensor& param, const torch::Tensor& grad,
                       const torch::Tensor& exp_avg, const torch::Tensor& exp_avg_sq, int64_t step,
                       const AdamRule& r, const UpdateRange& range) {
  const double bias1 = 1 - std::pow(r.beta1, step);
  const double bias2 = 1 - std::pow(r.beta2, step);
  auto run = [&](auto zero) {
    using T = decltype(zero);
    AdamCoeffs<T> c{};
    c.decay = static_cast<T>(1 - r.lr * r.weight_decay);
    c.l2 = static_cast<T>(r.weight_decay);
    c.beta1 = static_cast<T>(r.beta1);
    c.one_minus_beta1 = static_cast<T>(1 - r.beta1);
    c.beta2 = static_cast<T>(r.beta2);
    c.one_minus_beta2 = static_cast<T>(1 - r.beta2);
    c.bias2_sqrt = static_cast<T>(std::sqrt(bias2));
    c.eps = static_cast<T>(r.eps);
    c.neg_step_size = static_cast<T>(-(r.lr / bias1));
    adam_param<T>(param, grad, exp_avg, exp_avg_sq, c, r.decoupled && r.weight_decay != 0,
                  !r.decoupled && r.weight_decay != 0, range);
  };
  if (param.scalar_type() == torch::kFloat)
    run(float{});
  else
    run(double{});
}

void fused_sgd_update(const torch::Tensor& param, const torch::Tensor& grad,
                      const torch::Tensor& momentum_buffer, bool first, const SgdRule& r,
                      const UpdateRange& range) {
  auto run = [&](auto zero) {
    using T = decltype(zero);
    SgdCoeffs<T> c{};
    c.weight_decay = static_cast<T>(r.weight_decay);
    c.momentum = static_cast<T>(r.momentum);
    c.one_minus_dampening = static_cast<T>(1 - r.dampening);
    c.neg_lr = static_cast<T>(-1 * r.lr);
    c.has_decay = r.weight_decay != 0;
    c.has_momentum = r.momentum != 0;
    c.first = first;
    c.nesterov = r.nesterov;
    T* pp = param.data_ptr<T>();
    const T* g = grad.data_ptr<T>();
    T* b = c.has_momentum ? momentum_buffer.data_ptr<T>() : nullptr;
    const bool fma = cpu_has_fma();
    for_range(param.numel(), range, [&](int64_t begin, int64_t end) {
      if (fma)
        sgd_range_fma<T>(pp, g, b, begin, end, c);
      else
        sgd_range_plain<T>(pp, g, b, begin, end, c);
    });
    torch::autograd::impl::bump_version(param);
    if (c.has_momentum) torch::autograd::impl::bump_version(momentum_buffer);
  };
  if (param.scalar_type() == torch::kFloat)
    run(float{});
  else
    run(double{});
}

bool fused_step_fits(torch::optim::Optimizer& optimizer) {
  // Exact types only: a subclass may have its own step().
  const auto& type = typeid(optimizer);
  if (type == typeid(o::AdamW)) return adam_fits<o::AdamWOptions, o::AdamWParamState>(optimizer);
  if (type == typeid(o::Adam)) return adam_fits<o::AdamOptions, o::AdamParamState>(optimizer);
  if (type == typeid(o::SGD)) return sgd_fits(optimizer);
  return false;
}

bool fused_step(torch::optim::Optimizer& optimizer) {
  if (!fused_step_fits(optimizer)) return false;
  const auto& type = typeid(optimizer);
  if (type == typeid(o::AdamW))
    adam_step<o::AdamWParamState>(optimizer, true);
  else if (type == typeid(o::Adam))
    adam_step<o::AdamParamState>(optimizer, false);
  else
    sgd_step(optimizer);
  return true;
}

}  // namespace accel::detail

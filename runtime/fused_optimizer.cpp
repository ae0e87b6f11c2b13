// One-pass Adam, AdamW and SGD steps (fused_optimizer.h).
#include "runtime/fused_optimizer.h"

#include <ATen/Parallel.h>
#include <c10/util/string_utils.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cmath>
#include <cstdint>
#include <typeinfo>
#include <vector>

namespace accel::detail {
namespace {

namespace o = torch::optim;

// Why: below this many elements a thread costs more than it saves (ATen's GRAIN_SIZE).
constexpr int64_t kGrain = 32768;

std::string key_of(const torch::Tensor& p) { return c10::guts::to_string(p.unsafeGetTensorImpl()); }

bool same_layout(const torch::Tensor& t, const torch::Tensor& p) {
  return t.defined() && t.device().is_cpu() && t.layout() == torch::kStrided &&
         t.scalar_type() == p.scalar_type() && t.is_contiguous() && t.numel() == p.numel();
}

bool fusable_param(const torch::Tensor& p) {
  if (!p.grad().defined()) return true;  // skipped by the step, as libtorch skips it
  auto s = p.scalar_type();
  return p.device().is_cpu() && p.layout() == torch::kStrided && p.is_contiguous() &&
         (s == torch::kFloat || s == torch::kDouble) && same_layout(p.grad(), p);
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

// Per element, libtorch 1.13's C++ Adam/AdamW step:
//   AdamW: p.mul_(1 - lr*wd)               Adam: grad = grad.add(p, wd)
//   exp_avg.mul_(beta1).add_(grad, 1 - beta1)
//   exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)
//   denom = (exp_avg_sq.sqrt() / sqrt(bias_correction2)).add_(eps)
//   p.addcdiv_(exp_avg, denom, -lr / bias_correction1)
template <class T, bool kDecoupled, bool kL2>
void adam_range(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m, T* __restrict__ v,
                int64_t begin, int64_t end, const AdamCoeffs<T>& c) {
  for (int64_t i = begin; i < end; ++i) {
    T pi = p[i];
    if constexpr (kDecoupled) pi = pi * c.decay;
    T gi = g[i];
    if constexpr (kL2) gi = gi + c.l2 * pi;
    T mi = m[i] * c.beta1;
    mi = mi + c.one_minus_beta1 * gi;
    T vi = v[i] * c.beta2;
    vi = vi + c.one_minus_beta2 * gi * gi;
    T denom = std::sqrt(vi) / c.bias2_sqrt + c.eps;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi + c.neg_step_size * (mi / denom);
  }
}

template <class T>
void adam_param(const torch::Tensor& param, torch::Tensor& exp_avg, torch::Tensor& exp_avg_sq,
                const AdamCoeffs<T>& c, bool decoupled, bool l2) {
  T* p = param.data_ptr<T>();
  const T* g = param.grad().data_ptr<T>();
  T* m = exp_avg.data_ptr<T>();
  T* v = exp_avg_sq.data_ptr<T>();
  at::parallel_for(0, param.numel(), kGrain, [&](int64_t begin, int64_t end) {
    if (decoupled)
      adam_range<T, true, false>(p, g, m, v, begin, end, c);
    else if (l2)
      adam_range<T, false, true>(p, g, m, v, begin, end, c);
    else
      adam_range<T, false, false>(p, g, m, v, begin, end, c);
  });
}

struct AdamGroup {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad;
};

template <class State>
bool state_fusable(o::Optimizer& optimizer, const torch::Tensor& p) {
  auto it = optimizer.state().find(key_of(p));
  if (it == optimizer.state().end()) return true;
  auto* s = dynamic_cast<State*>(it->second.get());
  return s != nullptr && same_layout(s->exp_avg(), p) && same_layout(s->exp_avg_sq(), p);
}

// Adam (decoupled = false) and AdamW (true): their options and states have the same fields.
template <class Options, class State>
bool adam_step(o::Optimizer& optimizer, bool decoupled) {
  for (auto& group : optimizer.param_groups()) {
    auto& opts = static_cast<Options&>(group.options());
    if (opts.amsgrad()) return false;
    for (auto& p : group.params()) {
      if (!fusable_param(p) || !state_fusable<State>(optimizer, p)) return false;
    }
  }
  torch::NoGradGuard no_grad;
  for (auto& group : optimizer.param_groups()) {
    auto& opts = static_cast<Options&>(group.options());
    const double lr = opts.lr(), wd = opts.weight_decay(), eps = opts.eps();
    const double beta1 = std::get<0>(opts.betas()), beta2 = std::get<1>(opts.betas());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      auto key = key_of(p);
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
      const double bias1 = 1 - std::pow(beta1, state.step());
      const double bias2 = 1 - std::pow(beta2, state.step());
      auto fill = [&](auto zero) {
        using T = decltype(zero);
        AdamCoeffs<T> c{};
        c.decay = static_cast<T>(1 - lr * wd);
        c.l2 = static_cast<T>(wd);
        c.beta1 = static_cast<T>(beta1);
        c.one_minus_beta1 = static_cast<T>(1 - beta1);
        c.beta2 = static_cast<T>(beta2);
        c.one_minus_beta2 = static_cast<T>(1 - beta2);
        c.bias2_sqrt = static_cast<T>(std::sqrt(bias2));
        c.eps = static_cast<T>(eps);
        c.neg_step_size = static_cast<T>(-(lr / bias1));
        adam_param<T>(p, state.exp_avg(), state.exp_avg_sq(), c, decoupled && wd != 0,
                      !decoupled && wd != 0);
      };
      if (p.scalar_type() == torch::kFloat)
        fill(float{});
      else
        fill(double{});
    }
  }
  return true;
}

// Per element, libtorch 1.13's C++ SGD step:
//   d_p = grad (+ weight_decay * p)
//   momentum: buf = first step ? d_p : buf * momentum + (1 - dampening) * d_p
//             d_p = nesterov ? d_p + momentum * buf : buf
//   p.add_(d_p, -lr)
template <class T>
struct SgdCoeffs {
  T weight_decay, momentum, one_minus_dampening, neg_lr;
  bool has_decay, has_momentum, first, nesterov;
};

template <class T>
void sgd_range(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ buf, int64_t begin,
               int64_t end, const SgdCoeffs<T>& c) {
  for (int64_t i = begin; i < end; ++i) {
    T d = g[i];
    if (c.has_decay) d = d + c.weight_decay * p[i];
    if (c.has_momentum) {
      T b = c.first ? d : buf[i] * c.momentum + c.one_minus_dampening * d;
      buf[i] = b;
      d = c.nesterov ? d + c.momentum * b : b;
    }
    p[i] = p[i] + c.neg_lr * d;
  }
}

bool sgd_step(o::Optimizer& optimizer) {
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (!fusable_param(p)) return false;
      auto it = optimizer.state().find(key_of(p));
      if (it == optimizer.state().end()) continue;
      auto* s = dynamic_cast<o::SGDParamState*>(it->second.get());
      if (s == nullptr || (s->momentum_buffer().defined() && !same_layout(s->momentum_buffer(), p)))
        return false;
    }
  }
  torch::NoGradGuard no_grad;
  for (auto& group : optimizer.param_groups()) {
    auto& opts = static_cast<o::SGDOptions&>(group.options());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      torch::Tensor buf;
      bool first = false;
      if (opts.momentum() != 0) {
        auto key = key_of(p);
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
      auto run = [&](auto zero) {
        using T = decltype(zero);
        SgdCoeffs<T> c{};
        c.weight_decay = static_cast<T>(opts.weight_decay());
        c.momentum = static_cast<T>(opts.momentum());
        c.one_minus_dampening = static_cast<T>(1 - opts.dampening());
        c.neg_lr = static_cast<T>(-1 * opts.lr());
        c.has_decay = opts.weight_decay() != 0;
        c.has_momentum = opts.momentum() != 0;
        c.first = first;
        c.nesterov = opts.nesterov();
        T* pp = p.data_ptr<T>();
        const T* g = p.grad().data_ptr<T>();
        T* b = c.has_momentum ? buf.data_ptr<T>() : nullptr;
        at::parallel_for(0, p.numel(), kGrain, [&](int64_t begin, int64_t end) {
          sgd_range<T>(pp, g, b, begin, end, c);
        });
      };
      if (p.scalar_type() == torch::kFloat)
        run(float{});
      else
        run(double{});
    }
  }
  return true;
}

}  // namespace

bool fused_step(torch::optim::Optimizer& optimizer) {
  // Exact types only: a subclass may have its own step().
  const auto& type = typeid(optimizer);
  if (type == typeid(o::AdamW))
    return adam_step<o::AdamWOptions, o::AdamWParamState>(optimizer, true);
  if (type == typeid(o::Adam))
    return adam_step<o::AdamOptions, o::AdamParamState>(optimizer, false);
  if (type == typeid(o::SGD)) return sgd_step(optimizer);
  return false;
}

}  // namespace accel::detail

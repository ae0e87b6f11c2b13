// An optimizer's state as named tensors (optimizer_tensors.h).
#include "runtime/optimizer_tensors.h"

#include <nlohmann/json.hpp>
#include <type_traits>

#include "accel/error.h"
#include "contract/json_depth.h"
#include "runtime/optimizer_steps.h"

namespace accel::ckpt {

namespace {

namespace o = torch::optim;
using json = nlohmann::json;

const char* type_name(const o::Optimizer& optimizer) {
  const auto& t = typeid(optimizer);
  if (t == typeid(o::Adam)) return "Adam";
  if (t == typeid(o::AdamW)) return "AdamW";
  if (t == typeid(o::SGD)) return "SGD";
  if (t == typeid(o::Adagrad)) return "Adagrad";
  if (t == typeid(o::RMSprop)) return "RMSprop";
  return nullptr;
}

// The parameters in the order libtorch's own save uses: param group by param group.
std::vector<torch::Tensor> parameters(const o::Optimizer& optimizer) {
  std::vector<torch::Tensor> out;
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params()) out.push_back(p);
  return out;
}

using StateMap = std::remove_reference_t<decltype(std::declval<o::Optimizer&>().state())>;

// Calls f(field name, tensor&) for each tensor field of `state` (of the optimizer `type`), and
// returns a pointer to its step count (nullptr: SGD has none).
template <class F>
int64_t* visit(const std::string& type, o::OptimizerParamState& state, F&& f) {
  auto field = [&](const char* name, auto& s, auto getter, auto setter) {
    torch::Tensor t = (s.*getter)();
    f(name, t);
    (s.*setter)(t);
  };
  if (type == "Adam" || type == "AdamW") {
    auto run = [&](auto& s) -> int64_t* {
      using S = std::remove_reference_t<decltype(s)>;
      field("exp_avg", s, static_cast<const torch::Tensor& (S::*)() const>(&S::exp_avg),
            static_cast<S& (S::*)(const torch::Tensor&)>(&S::exp_avg));
      field("exp_avg_sq", s, static_cast<const torch::Tensor& (S::*)() const>(&S::exp_avg_sq),
            static_cast<S& (S::*)(const torch::Tensor&)>(&S::exp_avg_sq));
      field("max_exp_avg_sq", s,
            static_cast<const torch::Tensor& (S::*)() const>(&S::max_exp_avg_sq),
            static_cast<S& (S::*)(const torch::Tensor&)>(&S::max_exp_avg_sq));
      return &s.step();
    };
    if (type == "Adam") return run(dynamic_cast<o::AdamParamState&>(state));
    return run(dynamic_cast<o::AdamWParamState&>(state));
  }
  if (type == "SGD") {
    auto& s = dynamic_cast<o::SGDParamState&>(state);
    using S = o::SGDParamState;
    field("momentum_buffer", s,
          static_cast<const torch::Tensor& (S::*)() const>(&S::momentum_buffer),
          static_cast<S& (S::*)(const torch::Tensor&)>(&S::momentum_buffer));
    return nullptr;
  }
  if (type == "Adagrad") {
    auto& s = dynamic_cast<o::AdagradParamState&>(state);
    using S = o::AdagradParamState;
    field("sum", s, static_cast<const torch::Tensor& (S::*)() const>(&S::sum),
          static_cast<S& (S::*)(const torch::Tensor&)>(&S::sum));
    return &s.step();
  }
  auto& s = dynamic_cast<o::RMSpropParamState&>(state);
  using S = o::RMSpropParamState;
  field("square_avg", s, static_cast<const torch::Tensor& (S::*)() const>(&S::square_avg),
        static_cast<S& (S::*)(const torch::Tensor&)>(&S::square_avg));
  field("momentum_buffer", s, static_cast<const torch::Tensor& (S::*)() const>(&S::momentum_buffer),
        static_cast<S& (S::*)(const torch::Tensor&)>(&S::momentum_buffer));
  field("grad_avg", s, static_cast<const torch::Tensor& (S::*)() const>(&S::grad_avg),
        static_cast<S& (S::*)(const torch::Tensor&)>(&S::grad_avg));
  return &s.step();
}

std::unique_ptr<o::OptimizerParamState> fresh_state(const std::string& type) {
  if (type == "Adam") return std::make_unique<o::AdamParamState>();
  if (type == "AdamW") return std::make_unique<o::AdamWParamState>();
  if (type == "SGD") return std::make_unique<o::SGDParamState>();
  if (type == "Adagrad") return std::make_unique<o::AdagradParamState>();
  return std::make_unique<o::RMSpropParamState>();
}

[[noreturn]] void fail(const std::string& where, const std::string& what) {
  throw CheckpointError("accel: checkpoint " + where + " " + what);
}

}  // namespace

bool has_tensor_state(const o::Optimizer& optimizer) { return type_name(optimizer) != nullptr; }

safetensors::NamedTensors optimizer_tensors(const o::Optimizer& optimizer,
                                            std::map<std::string, std::string>& metadata) {
  const std::string type = type_name(optimizer);
  auto& state = const_cast<o::Optimizer&>(optimizer).state();
  safetensors::NamedTensors out;
  json steps = json::object();
  const auto params = parameters(optimizer);
  for (std::size_t k = 0; k < params.size(); ++k) {
    auto it = state.find(detail::state_key(params[k]));
    if (it == state.end()) continue;
    const std::string prefix = std::to_string(k) + ".";
    int64_t* step = visit(type, *it->second, [&](const char* name, torch::Tensor& t) {
      if (t.defined()) out.emplace_back(prefix + name, t.detach());
    });
    steps[std::to_string(k)] = step != nullptr ? *step : 0;
  }
  metadata["optimizer"] = type;
  metadata["parameters"] = std::to_string(params.size());
  metadata["steps"] = steps.dump();
  return out;
}

void load_optimizer_tensors(o::Optimizer& optimizer, const safetensors::Decoded& decoded,
                            const std::string& where, torch::Device device) {
  const char* mine = type_name(optimizer);
  auto meta = [&](const char* key) -> const std::string& {
    auto it = decoded.metadata.find(key);
    if (it == decoded.metadata.end()) fail(where, std::string("has no \"") + key + "\" metadata");
    return it->second;
  };
  const std::string& type = meta("optimizer");
  if (mine == nullptr || type != mine) {
    fail(where,
         "holds the state of a torch::optim::" + type + ", not of this optimizer (" +
             (mine ? std::string("torch::optim::") + mine : std::string(typeid(optimizer).name())) +
             ")");
  }
  const auto params = parameters(optimizer);
  if (meta("parameters") != std::to_string(params.size())) {
    fail(where, "is for " + meta("parameters") + " parameters, this optimizer has " +
                    std::to_string(params.size()));
  }
  const std::string& steps_text = meta("steps");
  if (auto deep = contract::json_nesting_problem(steps_text); !deep.empty()) fail(where, deep);
  json steps;
  try {
    steps = json::parse(steps_text);
  } catch (const json::exception& e) {
    fail(where, std::string("has unreadable \"steps\" metadata: ") + e.what());
  }
  if (!steps.is_object()) fail(where, "has \"steps\" metadata that is not an object");
  std::map<std::string, const torch::Tensor*> by_name;
  for (const auto& [name, t] : decoded.tensors) by_name[name] = &t;
  // Everything is built and checked before the optimizer's state is touched.
  std::vector<std::pair<StateMap::key_type, std::unique_ptr<o::OptimizerParamState>>> built;
  std::size_t used = 0;
  for (std::size_t k = 0; k < params.size(); ++k) {
    const std::string index = std::to_string(k);
    if (!steps.contains(index)) continue;
    if (!steps[index].is_number_integer()) fail(where, "has a step count that is not an integer");
    auto state = fresh_state(type);
    int64_t* step = visit(type, *state, [&](const char* name, torch::Tensor& t) {
      auto it = by_name.find(index + "." + name);
      if (it == by_name.end()) return;  // an optional field (max_exp_avg_sq, ...) never used
      const torch::Tensor& saved = *it->second;
      if (saved.sizes() != params[k].sizes() || saved.scalar_type() != params[k].scalar_type()) {
        fail(where, "has " + it->first + " of shape " + c10::str(saved.sizes()) + " and dtype " +
                        c10::toString(saved.scalar_type()) + ", but parameter " + index + " is " +
                        c10::str(params[k].sizes()) + " " + c10::toString(params[k].scalar_type()));
      }
      t = saved.to(device, /*non_blocking=*/false, /*copy=*/true);
      ++used;
    });
    if (step != nullptr) *step = steps[index].get<int64_t>();
    built.emplace_back(detail::state_key(params[k]), std::move(state));
  }
  if (used != decoded.tensors.size()) {
    fail(where, "holds " + std::to_string(decoded.tensors.size() - used) +
                    " tensor(s) that are no parameter's state");
  }
  auto& state = optimizer.state();
  state.clear();
  for (auto& [key, value] : built) state[key] = std::move(value);
}

}  // namespace accel::ckpt

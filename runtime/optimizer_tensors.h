// An optimizer's state as named tensors, for checkpoints and snapshots: libtorch's own optimizers
// (Adam, AdamW, SGD, Adagrad, RMSprop, exactly those types) keep plain tensors and step counts,
// which a safetensors file holds without libtorch's archive (a zip whose every record is
// CRC-32'd, the larger part of a save's time). Tensor "<k>.<field>" is the state of the k-th
// parameter over the param groups in order; metadata "optimizer" names the type and "steps"
// gives each state's step count.
#pragma once

#include <torch/optim.h>

#include <map>
#include <string>

#include "runtime/safetensors.h"

namespace accel::ckpt {

// Whether `optimizer` is exactly one of the types above.
bool has_tensor_state(const torch::optim::Optimizer& optimizer);

// Its state: the tensors share the optimizer's (write them before its next step), with metadata.
// Only for has_tensor_state().
safetensors::NamedTensors optimizer_tensors(const torch::optim::Optimizer& optimizer,
                                            std::map<std::string, std::string>& metadata);

// Replaces `optimizer`'s state with what `decoded` holds (copied to `device`). CheckpointError
// naming `where` when the file is for another optimizer type, another parameter count, or a
// tensor's shape differs from its parameter's; `optimizer` is unchanged then.
void load_optimizer_tensors(torch::optim::Optimizer& optimizer, const safetensors::Decoded& decoded,
                            const std::string& where, torch::Device device);

}  // namespace accel::ckpt

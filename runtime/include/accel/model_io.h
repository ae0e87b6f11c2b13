// Loading what Accelerator::save_model writes (HF's save_pretrained with safetensors) back into a
// model: to fine-tune from it, warm-start, or evaluate it.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "accel/prepared_model.h"

namespace accel {

// The names that did not match between a model and the files loaded into it.
struct LoadedKeys {
  std::vector<std::string> missing;     // the model has them, the files do not
  std::vector<std::string> unexpected;  // the files have them, the model does not
};

// Loads safetensors weights into `model`'s parameters and buffers, matched by name. `path` is a
// folder save_model wrote (model.safetensors, or model.safetensors.index.json and its shards),
// or one .safetensors file. Shapes must match; dtypes convert as Tensor::copy_ does; the
// tensors stay on the model's device. strict: a missing or unexpected name is a CheckpointError
// that names them, and nothing is loaded; not strict: the names that match are loaded and the
// others returned. A shape mismatch, an unreadable or damaged file is always a CheckpointError
// naming the file, and leaves the model unchanged. Call it on every process that holds a copy.
LoadedKeys load_model(torch::nn::Module& model, const std::filesystem::path& path,
                      bool strict = true);
template <class M>
LoadedKeys load_model(const std::shared_ptr<M>& model, const std::filesystem::path& path,
                      bool strict = true) {
  return load_model(*model, path, strict);
}
template <class M>
LoadedKeys load_model(const PreparedModel<M>& model, const std::filesystem::path& path,
                      bool strict = true) {
  return load_model(*model, path, strict);
}
template <class C>
LoadedKeys load_model(const torch::nn::ModuleHolder<C>& model, const std::filesystem::path& path,
                      bool strict = true) {
  return load_model(*model.ptr(), path, strict);
}

// HF's load_checkpoint_in_model: load_model, not strict unless asked.
inline LoadedKeys load_checkpoint_in_model(torch::nn::Module& model,
                                           const std::filesystem::path& path, bool strict = false) {
  return load_model(model, path, strict);
}
template <class M>
LoadedKeys load_checkpoint_in_model(const std::shared_ptr<M>& model,
                                    const std::filesystem::path& path, bool strict = false) {
  return load_model(*model, path, strict);
}
template <class M>
LoadedKeys load_checkpoint_in_model(const PreparedModel<M>& model,
                                    const std::filesystem::path& path, bool strict = false) {
  return load_model(*model, path, strict);
}
template <class C>
LoadedKeys load_checkpoint_in_model(const torch::nn::ModuleHolder<C>& model,
                                    const std::filesystem::path& path, bool strict = false) {
  return load_model(*model.ptr(), path, strict);
}

}  // namespace accel

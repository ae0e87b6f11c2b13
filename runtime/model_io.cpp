// load_model: safetensors files (one, or HF's sharded index) into a module, matched by name.
#include "accel/model_io.h"

#include <torch/torch.h>
#include <unistd.h>

#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "accel/accelerator.h"
#include "accel/error.h"
#include "contract/json_depth.h"
#include "runtime/checkpoint_io.h"
#include "runtime/checkpoint_manifest.h"
#include "runtime/safetensors.h"

namespace accel {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

[[noreturn]] void fail(const fs::path& where, const std::string& what) {
  throw CheckpointError("accel: load_model: " + where.string() + " " + what);
}

// The files to read and, for a sharded folder, which file holds each name.
struct Source {
  std::vector<fs::path> files;
  std::map<std::string, std::string> weight_map;  // empty unless sharded
};

Source find_files(const fs::path& path) {
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) return {{path}, {}};
  if (!fs::is_directory(path, ec)) fail(path, "does not exist");
  fs::path index = path / "model.safetensors.index.json";
  if (fs::exists(index, ec)) {
    Source s;
    try {
      const std::string text = ckpt::checkpoint_fs().read_file(index);
      if (auto deep = contract::json_nesting_problem(text); !deep.empty())
        fail(index, deep + "; not a safetensors index");
      json j = json::parse(text);
      std::set<std::string> files;
      for (const auto& [name, file] : j.at("weight_map").items()) {
        auto f = file.get<std::string>();
        if (!ckpt::is_plain_file_name(f)) fail(index, "names a file outside its folder: " + f);
        s.weight_map[name] = f;
        files.insert(f);
      }
      for (const auto& f : files) s.files.push_back(path / f);
    } catch (const json::exception& e) {
      fail(index,
           std::string("is not a safetensors index ({\"weight_map\": {name: file}}): ") + e.what());
    }
    return s;
  }
  if (fs::exists(path / "model.safetensors", ec)) return {{path / "model.safetensors"}, {}};
  fail(path,
       "has neither model.safetensors nor model.safetensors.index.json (a folder "
       "Accelerator::save_model writes)");
}

std::string some(const std::vector<std::string>& names) {
  std::string out;
  for (std::size_t i = 0; i < names.size() && i < 8; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > 8) out += " and " + std::to_string(names.size() - 8) + " more";
  return out;
}

}  // namespace

LoadedKeys load_model(torch::nn::Module& model, const fs::path& path, bool strict) {
  Source source = find_files(path);
  std::vector<ckpt::MappedFile> mapped;  // Why kept: the decoded tensors are views of them
  std::map<std::string, torch::Tensor> saved;
  for (const auto& file : source.files) {
    mapped.push_back(ckpt::checkpoint_fs().map_file(file));
    auto decoded =
        safetensors::decode(mapped.back().view(), file.string(), safetensors::Memory::kBorrow);
    for (auto& [name, tensor] : decoded.tensors) {
      if (!source.weight_map.empty()) {
        auto it = source.weight_map.find(name);
        if (it == source.weight_map.end() || it->second != file.filename().string()) continue;
      }
      if (!saved.emplace(name, tensor).second) fail(file, "holds \"" + name + "\" a second time");
    }
  }
  for (const auto& [name, file] : source.weight_map) {
    if (!saved.contains(name)) {
      fail(path / file, "lacks \"" + name + "\", which model.safetensors.index.json puts there");
    }
  }

  auto live = safetensors::module_tensors(model);
  LoadedKeys keys;
  std::vector<std::string> mismatched;
  std::set<std::string> known;
  for (const auto& [name, tensor] : live) {
    known.insert(name);
    auto it = saved.find(name);
    if (it == saved.end()) {
      keys.missing.push_back(name);
    } else if (it->second.sizes() != tensor.sizes()) {
      std::ostringstream s;
      s << name << " is " << it->second.sizes() << " in the files, " << tensor.sizes()
        << " in the model";
      mismatched.push_back(s.str());
    }
  }
  for (const auto& [name, tensor] : saved) {
    if (!known.contains(name)) keys.unexpected.push_back(name);
  }
  if (!mismatched.empty()) fail(path, "does not fit the model: " + some(mismatched));
  if (strict && (!keys.missing.empty() || !keys.unexpected.empty())) {
    std::string what;
    if (!keys.missing.empty()) what += "missing keys (in the model only): " + some(keys.missing);
    if (!keys.unexpected.empty()) {
      what += std::string(what.empty() ? "" : "; ") +
              "unexpected keys (in the files only): " + some(keys.unexpected);
    }
    fail(path, "does not match the model: " + what +
                   ". Nothing was loaded; load_model(..., strict = false) loads the names that "
                   "match");
  }
  torch::NoGradGuard no_grad;
  for (auto& [name, tensor] : live) {
    auto it = saved.find(name);
    if (it != saved.end()) tensor.copy_(it->second);
  }
  return keys;
}

// --- Accelerator::save / load (HF's save(obj, f), torch.load) -------------------------------

void Accelerator::save_file(const fs::path& path,
                            const std::function<void(const std::string& temp)>& write) {
  if (path.empty() || !path.has_filename()) {
    throw UsageError("accel: save(value, \"" + path.string() + "\"): the path names no file");
  }
  // Why a name with this process's pid beside the target: rename(2) is atomic only within one
  // file system, and no other writer uses the same name.
  const fs::path temp =
      path.parent_path() / ("." + path.filename().string() + ".tmp-" + std::to_string(::getpid()));
  try {
    if (!path.parent_path().empty()) fs::create_directories(path.parent_path());
    write(temp.string());
    fs::rename(temp, path);
  } catch (const c10::Error& e) {
    std::error_code ec;
    fs::remove(temp, ec);
    throw CheckpointError("accel: save to " + path.string() + ": " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::error_code ec;
    fs::remove(temp, ec);
    throw CheckpointError("accel: save to " + path.string() + ": " + e.what());
  }
}

void Accelerator::load_file(const fs::path& path,
                            const std::function<void(const std::string& file)>& read) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) {
    throw CheckpointError("accel: load from " + path.string() + ": " +
                          (fs::exists(path, ec) ? "not a file" : "no such file"));
  }
  try {
    read(path.string());
  } catch (const c10::Error& e) {
    throw CheckpointError("accel: load from " + path.string() +
                          ": it does not hold what is loaded into (" + e.what_without_backtrace() +
                          ")");
  } catch (const std::exception& e) {
    throw CheckpointError("accel: load from " + path.string() +
                          ": it does not hold what is loaded into (" + e.what() + ")");
  }
}

}  // namespace accel

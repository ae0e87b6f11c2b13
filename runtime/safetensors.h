// The safetensors format (huggingface/safetensors): an 8-byte little-endian header length N, N
// bytes of JSON header ({"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
// "__metadata__": {string: string}}), then the tensors' bytes, little-endian, row-major.
// Also HF's sharded layout (model-00001-of-00002.safetensors + model.safetensors.index.json).
// Thread: any; no shared state.
#pragma once

#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace accel::safetensors {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

// A module's parameters then buffers, by qualified name, detached (sharing the module's storage):
// what save_model writes, save_state's model file holds and load_model fills.
NamedTensors module_tensors(const torch::nn::Module& module);

// A file ready to be written: `header` (length prefix + JSON, padded with spaces to a multiple of
// 8 bytes) followed by the bytes of each tensor in `data`, in order. (A background save's file,
// from SnapshotCopies::defer_file, is the whole file in one uint8 tensor, with an empty header.)
struct Encoded {
  std::string header;
  std::vector<torch::Tensor> data;  // contiguous CPU tensors, in file order
  // The byte views to write, header first (valid while this object lives).
  std::vector<std::string_view> parts() const;
  uint64_t size() const;
};

// Encodes `tensors` (any device; copied to CPU when needed) in the given order. Names must be
// unique and non-empty; "__metadata__" is reserved. Throws CheckpointError otherwise, or for a
// dtype safetensors cannot name.
// `where` (the file it is for) starts every error message.
Encoded encode(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata = {},
               const std::string& where = "accel: safetensors");

// The header encode() writes for `tensors`, from their dtypes and shapes alone (nothing is
// copied), with the JSON padded with spaces, as the format allows, so that the tensors' bytes
// start `data_align` bytes-aligned in the file (a multiple of 8; 4096 lets a writer send a file
// laid out in page-aligned memory to the disk with O_DIRECT, no copy). Throws as encode() does;
// std::invalid_argument for another `data_align`.
std::string encode_header(const NamedTensors& tensors,
                          const std::map<std::string, std::string>& metadata = {},
                          const std::string& where = "accel: safetensors", uint64_t data_align = 8);

struct Decoded {
  NamedTensors tensors;  // in data-offset order, on the CPU
  std::map<std::string, std::string> metadata;
};

// Parses a whole file's bytes. `where` (a path) starts every error message. Rejects, with a
// CheckpointError that says what is wrong: fewer than 8 bytes, a header length past the end,
// JSON that does not parse or is not an object, an unknown dtype, a shape/offsets mismatch,
// offsets outside the data or overlapping, or bytes after the last tensor.
// kOwn: each tensor owns a copy of its bytes. kBorrow: tensors whose bytes are aligned for their
// dtype are views of `bytes` (no copy; valid while `bytes` lives; never write to them).
enum class Memory { kOwn, kBorrow };
Decoded decode(std::string_view bytes, const std::string& where, Memory memory = Memory::kOwn);

// "10GB" = 10^10, "10GiB" = 2^30*10, also KB/MB/KiB/MiB and a plain byte count (HF's
// convert_file_size_to_int, except that a lowercase "b" means bytes here, not bits). ConfigError
// for anything else or for 0, naming the setting as `name`.
uint64_t parse_size(const std::string& text, const std::string& name = "size");

// HF's save_pretrained layout in `dir` (created if missing): one "model.safetensors" when
// everything fits in max_shard_bytes, else "model-0000k-of-0000n.safetensors" files (a new shard
// starts when the next tensor would overflow the current one; a tensor larger than the limit
// gets a shard of its own) and "model.safetensors.index.json" = {"metadata": {"total_size": N},
// "weight_map": {name: file}}. Every file carries metadata {"format": "pt"} and is written
// through ckpt::checkpoint_fs() to a temp name, then renamed, so a reader never sees half a file.
// Stale shards of an earlier save with another shard count are removed. Returns the files written.
std::vector<std::string> save_sharded(const NamedTensors& tensors, const std::filesystem::path& dir,
                                      uint64_t max_shard_bytes,
                                      const std::string& prefix = "model");

}  // namespace accel::safetensors

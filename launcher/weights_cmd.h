// `accel estimate-memory PATH` and `accel merge-weights IN OUT`: tools for a save_model folder or
// one .safetensors file that read the safetensors byte format directly, so the `accel` CLI needs
// no libtorch. Each command returns the process exit code: 0; 2 for a bad input or option (the
// message on `err` names the file and what is wrong); 1 for an output that exists (no force) or
// cannot be written.
// Thread: any; no shared state.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "agent/common/status.h"

namespace accel::launcher {

// One tensor as a safetensors header describes it.
struct TensorInfo {
  std::string name;
  std::string dtype;            // safetensors' name: "F32", "BF16", "I64", ...
  std::vector<uint64_t> shape;  // [] is a scalar (one element)
  uint64_t begin = 0;           // data_offsets, from the start of the data section
  uint64_t end = 0;
  uint64_t numel() const;  // product of shape
  uint64_t nbytes() const { return end - begin; }
};

// One file's header, checked against the file's size (its data is never read).
struct SafetensorsHeader {
  std::string path;
  uint64_t data_start = 0;                      // 8 + header length: where tensor bytes begin
  std::map<std::string, std::string> metadata;  // "__metadata__"
  std::vector<TensorInfo> tensors;              // in data-offset order
};

// Reads and checks `path`'s header: the 8-byte length within the file, JSON that parses into an
// object, known dtypes, offsets that hold exactly shape's bytes and tile the data section (no
// overlap, gap, or byte past the end), no name twice. The error names the file and the fault.
Result<SafetensorsHeader> read_safetensors_header(const std::string& path);

// ---- accel estimate-memory -----------------------------------------------------------------

struct EstimateMemoryOptions {
  std::string path;  // a save_model folder, a .safetensors file, or a .safetensors.index.json
  int world_size = 1;
  std::vector<std::string> optimizers = {"adamw", "sgd"};  // subset of these two
  std::vector<std::string> dtypes = {"fp32", "bf16"};      // subset of fp32, bf16, fp16
};

// The training memory of one configuration, in bytes per rank.
struct MemoryRow {
  std::string dtype;      // of weights, gradients and optimizer state alike
  std::string optimizer;  // "adamw": 2 moments per parameter; "sgd": 1 momentum buffer
  bool zero1 = false;     // optimizer state partitioned over world_size ranks (ZeRO stage 1)
  uint64_t weights = 0;
  uint64_t gradients = 0;
  uint64_t optimizer_state = 0;
  uint64_t total = 0;
};

struct MemoryEstimate {
  uint64_t tensors = 0;
  uint64_t parameters = 0;                     // every tensor's element count, summed
  std::map<std::string, uint64_t> disk_bytes;  // tensor bytes on disk, by safetensors dtype
  std::string largest_name;                    // most elements; the first such in file order
  uint64_t largest_numel = 0;
  std::vector<MemoryRow> rows;  // by dtype, then optimizer, then ZeRO-1 no/yes
};

// The arithmetic of estimate_memory, without files. Throws std::invalid_argument for an option
// outside the sets above or world_size < 1 (estimate_memory checks them first).
MemoryEstimate estimate(const std::vector<TensorInfo>& tensors, const EstimateMemoryOptions& o);

// Reads the headers under o.path (never tensor data) and prints the counts and a table of
// estimate()'s rows to `out`; errors start "accel estimate-memory: error: " on `err`.
int estimate_memory(const EstimateMemoryOptions& o, std::ostream& out, std::ostream& err);

// ---- accel merge-weights -------------------------------------------------------------------

struct MergeWeightsOptions {
  std::string input;   // a save_model folder (sharded or not), a .safetensors or index file
  std::string output;  // the merged file; with max_shard_size, a folder
  // Set: write save_model's layout into `output` with shards of at most this many tensor bytes
  // (a tensor larger than that gets a shard of its own).
  std::optional<uint64_t> max_shard_size;
  bool force = false;  // replace an existing output
  // Why an option: bounds the memory a copy uses whatever the shard size; tests set a few bytes
  // to cross chunk boundaries.
  uint64_t copy_chunk_bytes = 4ULL << 20;
};

// Merges (or re-shards) the input's tensors, in the input's order: shard by shard in file-name
// order, then by data offset within each shard, which is the order save_model wrote them. Keeps
// the first shard's "__metadata__". Every file is written under a temp name in its folder,
// fsynced, then renamed into place. Errors start "accel merge-weights: error: " on `err`.
int merge_weights(const MergeWeightsOptions& o, std::ostream& out, std::ostream& err);

// "1000" (bytes), "500MB" and "5GB" (10^6, 10^9, as HF), "64KB", and "2GiB", "10MiB", "8KiB"
// (2^30, 2^20, 2^10); case-insensitive (contract/byte_size.h, as save_model reads them). nullopt
// for anything else, for 0, or for a size past 2^64.
std::optional<uint64_t> parse_size(std::string_view text);

}  // namespace accel::launcher

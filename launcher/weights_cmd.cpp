// accel estimate-memory and accel merge-weights: a torch-free reader of safetensors headers and
// HF's sharded layout, the training-memory arithmetic, and a merger that copies tensor bytes in
// bounded chunks into files published atomically (temp name, fsync, rename).
#include "launcher/weights_cmd.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>

#include "agent/common/safe_file.h"
#include "contract/byte_size.h"
#include "contract/json_depth.h"
#include "contract/quote.h"
#include "contract/safetensors_layout.h"

namespace accel::launcher {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

constexpr const char* kEstimateError = "accel estimate-memory: error: ";
constexpr const char* kMergeError = "accel merge-weights: error: ";
constexpr const char* kMetadataKey = "__metadata__";
// The names save_model (runtime/safetensors.h, save_sharded) gives its files.
constexpr const char* kPrefix = "model";
constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";
// safetensors' own limit (MAX_HEADER_SIZE). Why check it: a damaged length must not size an
// allocation; an index file is held to it too.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// Why exceptions inside this file: the checks nest deep in the parsers. Every public function
// catches these at its boundary and turns them into an exit code or a Result; none leaves here.
struct InputError {  // a bad input file or option: exit code 2
  std::string message;
};
struct OutputError {  // an output that exists or cannot be written: exit code 1
  std::string message;
};

std::string in_quotes(std::string_view s) { return contract::quote_for_message(s); }

[[noreturn]] void bad(const std::string& where, const std::string& what) {
  throw InputError{where + ": " + what};
}

[[noreturn]] void bad(const std::string& where, std::string_view tensor, const std::string& what) {
  bad(where, "tensor " + in_quotes(tensor) + ": " + what);
}

[[noreturn]] void cannot_write(const std::string& path, int error) {
  throw OutputError{"cannot write " + path + ": " + std::strerror(error)};
}

bool ends_with(std::string_view s, std::string_view tail) {
  return s.size() >= tail.size() && s.substr(s.size() - tail.size()) == tail;
}

// ---- dtypes ------------------------------------------------------------------------------------

struct DtypeSize {
  const char* name;
  uint64_t bytes;
};

// Every dtype of the safetensors spec; only element sizes matter here.
constexpr DtypeSize kDtypes[] = {{"F64", 8},     {"F32", 4},     {"F16", 2}, {"BF16", 2},
                                 {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"I64", 8}, {"I32", 4},
                                 {"I16", 2},     {"I8", 1},      {"U64", 8}, {"U32", 4},
                                 {"U16", 2},     {"U8", 1},      {"BOOL", 1}};

uint64_t element_size(std::string_view dtype) {
  for (const auto& d : kDtypes)
    if (dtype == d.name) return d.bytes;
  return 0;
}

std::string known_dtypes() {
  std::string out;
  for (const auto& d : kDtypes) out += (out.empty() ? "" : ", ") + std::string(d.name);
  return out;
}

// ---- reading -----------------------------------------------------------------------------------

// A file open for reading, closed when destroyed.
class InFile {
 public:
  explicit InFile(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0)
      bad(path, errno == ENOENT ? std::string("does not exist")
                                : std::string("cannot open: ") + std::strerror(errno));
    struct stat st {};
    std::string problem;
    if (::fstat(fd_, &st) != 0)
      problem = std::string("cannot stat: ") + std::strerror(errno);
    else if (S_ISDIR(st.st_mode))
      problem = "is a folder, not a file";
    if (!problem.empty()) {
      ::close(fd_);
      bad(path, problem);
    }
    size_ = static_cast<uint64_t>(st.st_size);
  }
  ~InFile() { ::close(fd_); }
  InFile(const InFile&) = delete;
  InFile& operator=(const InFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }

  // Reads exactly `n` bytes at `offset`. Why a short read is an error: the size was checked
  // when the file was opened, so the file shrank while being read.
  void read_at(uint64_t offset, char* buf, uint64_t n) const {
    while (n > 0) {
      ssize_t got = ::pread(fd_, buf, n, static_cast<off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) bad(path_, std::string("cannot read: ") + std::strerror(errno));
      if (got == 0)
        bad(path_, "ends at byte " + std::to_string(offset) + " while being read; it was " +
                       std::to_string(size_) + " bytes when opened");
      buf += got;
      offset += static_cast<uint64_t>(got);
      n -= static_cast<uint64_t>(got);
    }
  }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// A whole small file (an index), at most kMaxHeaderBytes.
std::string read_small_file(const std::string& path) {
  InFile f(path);
  if (f.size() > kMaxHeaderBytes)
    bad(path, "is " + std::to_string(f.size()) + " bytes, too large for an index file");
  std::string text(f.size(), '\0');
  f.read_at(0, text.data(), text.size());
  return text;
}

uint64_t read_u64_le(const char* p) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(p[i]);
  return n;
}

std::string u64_le(uint64_t n) {
  std::string out(8, '\0');
  for (std::size_t i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out;
}

// Parses the header's JSON object. Why the callback: nlohmann keeps one of two equal keys
// silently, and a tensor named twice is a damaged file.
Json parse_header_json(const std::string& text, const std::string& where) {
  std::set<std::string> keys;
  std::string twice;
  auto note_key = [&](int depth, Json::parse_event_t event, Json& parsed) {
    if (event == Json::parse_event_t::key && depth == 1 && twice.empty() &&
        !keys.insert(parsed.get<std::string>()).second)
      twice = parsed.get<std::string>();
    return true;
  };
  if (auto deep = contract::json_nesting_problem(text); !deep.empty())
    bad(where, "header " + deep + "; not a safetensors file");
  Json header;
  try {
    header = Json::parse(text, note_key);
  } catch (const nlohmann::json::exception& e) {
    bad(where, std::string("header is not valid JSON: ") + e.what());
  }
  if (!header.is_object())
    bad(where, std::string("header is not a JSON object but ") + header.type_name());
  if (!twice.empty()) bad(where, twice, "appears twice in the header");
  return header;
}

bool as_u64(const Json& j, uint64_t& out) {
  if (j.is_number_unsigned()) {
    out = j.get<uint64_t>();
    return true;
  }
  if (j.is_number_integer() && j.get<int64_t>() >= 0) {
    out = static_cast<uint64_t>(j.get<int64_t>());
    return true;
  }
  return false;
}

using contract::show_offsets;

std::string show_shape(const std::vector<uint64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? "," : "") + std::to_string(shape[i]);
  return out + "]";
}

// The bytes `t`'s shape and dtype need, or false when that does not fit in 64 bits.
bool needed_bytes(const TensorInfo& t, uint64_t& out) {
  out = element_size(t.dtype);
  for (uint64_t d : t.shape)
    if (__builtin_mul_overflow(out, d, &out)) return false;
  return true;
}

// One header entry, checked against itself: a known dtype, and offsets that hold exactly the
// bytes the shape needs.
TensorInfo parse_entry(const std::string& name, const Json& j, const std::string& where) {
  if (name.empty()) bad(where, "a tensor has an empty name");
  if (!j.is_object() || !j.contains("dtype") || !j.contains("shape") || !j.contains("data_offsets"))
    bad(where, name, "entry must be an object with dtype, shape and data_offsets, not " + j.dump());
  TensorInfo t;
  t.name = name;
  const Json& dtype = j.at("dtype");
  if (!dtype.is_string() || element_size(dtype.get<std::string>()) == 0)
    bad(where, name, "unknown dtype " + dtype.dump() + " (known: " + known_dtypes() + ")");
  t.dtype = dtype.get<std::string>();
  const Json& shape = j.at("shape");
  if (!shape.is_array()) bad(where, name, "shape must be a list, not " + shape.dump());
  for (const auto& d : shape) {
    uint64_t v = 0;
    if (!as_u64(d, v))
      bad(where, name, "shape must hold non-negative integers, not " + shape.dump());
    t.shape.push_back(v);
  }
  const Json& offsets = j.at("data_offsets");
  if (!offsets.is_array() || offsets.size() != 2 || !as_u64(offsets[0], t.begin) ||
      !as_u64(offsets[1], t.end) || t.begin > t.end)
    bad(where, name,
        "data_offsets must be [begin, end] with 0 <= begin <= end, not " + offsets.dump());
  uint64_t need = 0;
  const bool fits = needed_bytes(t, need);
  if (!fits || need != t.nbytes())
    bad(where, name,
        "data_offsets " + show_offsets(t.begin, t.end) + " hold " + std::to_string(t.nbytes()) +
            " bytes but shape " + show_shape(t.shape) + " of " + t.dtype + " needs " +
            (fits ? std::to_string(need) : "more than 2^64"));
  return t;
}

std::map<std::string, std::string> parse_metadata(const Json& j, const std::string& where) {
  if (!j.is_object() ||
      !std::all_of(j.begin(), j.end(), [](const Json& v) { return v.is_string(); }))
    bad(where, "\"__metadata__\" must map strings to strings, not " + j.dump());
  std::map<std::string, std::string> out;
  for (const auto& [key, value] : j.items()) out[key] = value.get<std::string>();
  return out;
}

// Sorts `tensors` by offset. Invariant on return: they tile [0, data_size) with no gap, overlap
// or byte left over, as the safetensors spec requires.
void check_tiling(std::vector<TensorInfo>& tensors, uint64_t data_size, const std::string& where) {
  if (auto problem = contract::check_tiling(tensors, data_size)) {
    if (problem->tensor.empty()) bad(where, problem->what);
    bad(where, problem->tensor, problem->what);
  }
}

SafetensorsHeader read_header(const InFile& f) {
  const std::string& where = f.path();
  if (f.size() < 8)
    bad(where, "file is " + std::to_string(f.size()) +
                   " bytes, too short for the 8-byte header length; not a safetensors file");
  char prefix[8];
  f.read_at(0, prefix, 8);
  const uint64_t n = read_u64_le(prefix);
  if (n > f.size() - 8)
    bad(where, "header length " + std::to_string(n) + " runs past the end of the file (" +
                   std::to_string(f.size()) + " bytes); truncated or not a safetensors file");
  if (n > kMaxHeaderBytes)
    bad(where, "header length " + std::to_string(n) + " is over safetensors' limit of " +
                   std::to_string(kMaxHeaderBytes) + " bytes; not a safetensors file");
  std::string text(n, '\0');
  f.read_at(8, text.data(), n);
  SafetensorsHeader out;
  out.path = where;
  out.data_start = 8 + n;
  const Json header = parse_header_json(text, where);
  for (const auto& [key, value] : header.items()) {
    if (key == kMetadataKey)
      out.metadata = parse_metadata(value, where);
    else
      out.tensors.push_back(parse_entry(key, value, where));
  }
  check_tiling(out.tensors, f.size() - out.data_start, where);
  return out;
}

SafetensorsHeader read_header(const std::string& path) { return read_header(InFile(path)); }

// What a save_model folder (or one file) holds: its shards' headers.
struct Model {
  std::vector<SafetensorsHeader> shards;  // in file-name order: model-00001-of-... first
  std::string index;                      // the index file; empty for a single file
};

// The index's weight_map: tensor name -> shard file name, each a plain name beside the index.
std::map<std::string, std::string> read_weight_map(const std::string& index) {
  Json j;
  const std::string text = read_small_file(index);
  if (auto deep = contract::json_nesting_problem(text); !deep.empty())
    bad(index, deep + "; not a safetensors index");
  try {
    j = Json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    bad(index, std::string("is not valid JSON: ") + e.what());
  }
  if (!j.is_object() || !j.contains("weight_map") || !j.at("weight_map").is_object())
    bad(index, "has no \"weight_map\" object; not a safetensors index");
  std::map<std::string, std::string> out;
  for (const auto& [name, file] : j.at("weight_map").items()) {
    // Why plain names only: a shard outside the model's folder ("../x") is not this model's.
    const std::string shard = file.is_string() ? file.get<std::string>() : "";
    if (shard.empty() || shard == "." || shard == ".." || shard.find('/') != std::string::npos)
      bad(index, "weight_map maps tensor " + in_quotes(name) + " to " + file.dump() +
                     ", not a file name beside the index");
    out[name] = shard;
  }
  return out;
}

// Every tensor in exactly one shard, the one weight_map names for it.
void check_against_index(const Model& m, const std::map<std::string, std::string>& weight_map) {
  std::map<std::string, const SafetensorsHeader*> owner;
  for (const auto& shard : m.shards)
    for (const auto& t : shard.tensors) {
      auto [it, fresh] = owner.emplace(t.name, &shard);
      if (!fresh)
        bad(shard.path, t.name, "is also in " + it->second->path + "; a tensor is in one shard");
    }
  for (const auto& shard : m.shards) {
    const std::string file = fs::path(shard.path).filename().string();
    for (const auto& t : shard.tensors) {
      auto it = weight_map.find(t.name);
      if (it == weight_map.end()) bad(shard.path, t.name, "is not in " + m.index + "'s weight_map");
      if (it->second != file)
        bad(shard.path, t.name, "is in this shard but " + m.index + " maps it to " + it->second);
    }
  }
  const fs::path dir = fs::path(m.index).parent_path();
  for (const auto& [name, file] : weight_map)
    if (!owner.count(name))
      bad((dir / file).string(), name, "is missing; " + m.index + " maps it to this shard");
}

Model read_sharded(const std::string& index) {
  const auto weight_map = read_weight_map(index);
  std::set<std::string> files;
  for (const auto& [name, file] : weight_map) files.insert(file);
  const fs::path dir = fs::path(index).parent_path();
  Model m;
  m.index = index;
  for (const auto& file : files) {
    const std::string path = (dir / file).string();
    std::error_code ec;
    if (!fs::exists(path, ec)) bad(path, "does not exist, but " + index + " lists it as a shard");
  }
  for (const auto& file : files) m.shards.push_back(read_header((dir / file).string()));
  check_against_index(m, weight_map);
  return m;
}

// `input`: a folder (model.safetensors first, as transformers looks, else the index), an index
// file, or one .safetensors file.
Model read_model(const std::string& input) {
  std::error_code ec;
  const fs::file_status st = fs::status(input, ec);
  if (!fs::exists(st)) bad(input, "does not exist");
  if (fs::is_directory(st)) {
    const fs::path dir(input);
    if (fs::exists(dir / kSingleFile, ec)) return {{read_header((dir / kSingleFile).string())}, ""};
    if (fs::exists(dir / kIndexFile, ec)) return read_sharded((dir / kIndexFile).string());
    bad(input, std::string("holds neither ") + kSingleFile + " nor " + kIndexFile +
                   "; not a save_model folder");
  }
  if (ends_with(input, ".index.json")) return read_sharded(input);
  return {{read_header(input)}, ""};
}

// ---- estimate-memory ---------------------------------------------------------------------------

struct TrainDtype {
  const char* name;
  uint64_t bytes;  // per element of weights, gradients and optimizer state
};
constexpr TrainDtype kTrainDtypes[] = {{"fp32", 4}, {"bf16", 2}, {"fp16", 2}};

struct OptimizerKind {
  const char* name;
  uint64_t states;  // buffers per parameter, in the weights' dtype (as torch keeps them)
};
constexpr OptimizerKind kOptimizers[] = {{"adamw", 2}, {"sgd", 1}};

template <class T, std::size_t N>
const T* find_named(const T (&table)[N], const std::string& name) {
  for (const auto& entry : table)
    if (name == entry.name) return &entry;
  return nullptr;
}

template <class T, std::size_t N>
std::string names_of(const T (&table)[N]) {
  std::string out;
  for (const auto& entry : table) out += (out.empty() ? "" : ", ") + std::string(entry.name);
  return out;
}

// What is wrong with `o`'s choices, or "" when nothing is.
std::string option_problem(const EstimateMemoryOptions& o) {
  if (o.world_size < 1) return "world size must be at least 1, not " + std::to_string(o.world_size);
  if (o.optimizers.empty()) return "no optimizer to estimate; choose from " + names_of(kOptimizers);
  if (o.dtypes.empty()) return "no dtype to estimate; choose from " + names_of(kTrainDtypes);
  for (const auto& name : o.optimizers)
    if (!find_named(kOptimizers, name))
      return "unknown optimizer " + in_quotes(name) + "; choose from " + names_of(kOptimizers);
  for (const auto& name : o.dtypes)
    if (!find_named(kTrainDtypes, name))
      return "unknown dtype " + in_quotes(name) + "; choose from " + names_of(kTrainDtypes);
  return "";
}

std::vector<std::string> unique(const std::vector<std::string>& names) {
  std::vector<std::string> out;
  for (const auto& n : names)
    if (std::find(out.begin(), out.end(), n) == out.end()) out.push_back(n);
  return out;
}

MemoryRow memory_row(uint64_t params, const TrainDtype& dtype, const OptimizerKind& opt,
                     int world_size, bool zero1) {
  MemoryRow r;
  r.dtype = dtype.name;
  r.optimizer = opt.name;
  r.zero1 = zero1;
  r.weights = params * dtype.bytes;
  r.gradients = params * dtype.bytes;
  // Why by elements: ZeRO-1 gives each rank a slice of the flattened parameters, the last
  // rounded up, and keeps every state buffer for its slice.
  const auto w = static_cast<uint64_t>(world_size);
  const uint64_t elements = zero1 ? (params + w - 1) / w : params;
  r.optimizer_state = elements * opt.states * dtype.bytes;
  r.total = r.weights + r.gradients + r.optimizer_state;
  return r;
}

// `n` with two decimals in the largest of `units` (each `base` times the last) it reaches.
std::string scaled(uint64_t n, double base, const std::vector<const char*>& units,
                   const char* space) {
  double v = static_cast<double>(n) / base;
  std::size_t u = 0;
  for (; v >= base && u + 1 < units.size(); ++u) v /= base;
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.2f%s%s", v, space, units[u]);
  return buf;
}

std::string human_bytes(uint64_t n) {
  if (n < 1024) return std::to_string(n) + " B";
  return scaled(n, 1024, {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"}, " ");
}

// 1234567 -> "1.23M", 7240000000 -> "7.24B" (HF's style of parameter counts).
std::string human_count(uint64_t n) {
  if (n < 1000) return std::to_string(n);
  return scaled(n, 1000, {"K", "M", "B", "T", "P", "E"}, "");
}

std::string pad(std::string s, std::size_t width) {
  if (s.size() < width) s.append(width - s.size(), ' ');
  return s;
}

std::vector<TensorInfo> all_tensors(const Model& m) {
  std::vector<TensorInfo> out;
  for (const auto& shard : m.shards)
    out.insert(out.end(), shard.tensors.begin(), shard.tensors.end());
  return out;
}

void print_summary(const EstimateMemoryOptions& o, const Model& m, const MemoryEstimate& e,
                   std::ostream& out) {
  out << "accel estimate-memory: " << o.path << "\n";
  out << "  files:       " << m.shards.size() << (m.index.empty() ? "" : " (sharded)") << "\n";
  out << "  tensors:     " << e.tensors << "\n";
  out << "  parameters:  " << human_count(e.parameters) << " (" << e.parameters << ")\n";
  std::string disk;
  for (const auto& [dtype, bytes] : e.disk_bytes)
    disk += (disk.empty() ? "" : ", ") + dtype + " " + human_bytes(bytes) + " (" +
            std::to_string(bytes) + " bytes)";
  out << "  on disk:     " << (disk.empty() ? "no tensor data" : disk) << "\n";
  if (e.tensors == 0)
    out << "  largest:     none\n";
  else
    out << "  largest:     " << in_quotes(e.largest_name) << " with "
        << human_count(e.largest_numel) << " parameters (" << e.largest_numel << ")\n";
}

void print_table(const EstimateMemoryOptions& o, const MemoryEstimate& e, std::ostream& out) {
  out << "Training memory per rank at world size " << o.world_size
      << " (weights, gradients and optimizer state all in the row's dtype):\n";
  out << "  " << pad("dtype", 7) << pad("optimizer", 11) << pad("ZeRO-1", 8) << pad("weights", 13)
      << pad("gradients", 13) << pad("optimizer", 13) << pad("total", 13) << "total bytes\n";
  for (const auto& r : e.rows)
    out << "  " << pad(r.dtype, 7) << pad(r.optimizer, 11) << pad(r.zero1 ? "yes" : "no", 8)
        << pad(human_bytes(r.weights), 13) << pad(human_bytes(r.gradients), 13)
        << pad(human_bytes(r.optimizer_state), 13) << pad(human_bytes(r.total), 13) << r.total
        << "\n";
  out << "NOT included: activations, temporary buffers and the CUDA context; leave room for "
         "them.\n";
}

}  // namespace

uint64_t TensorInfo::numel() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

Result<SafetensorsHeader> read_safetensors_header(const std::string& path) {
  try {
    return read_header(path);
  } catch (const InputError& e) {
    return Status::error(e.message);
  }
}

MemoryEstimate estimate(const std::vector<TensorInfo>& tensors, const EstimateMemoryOptions& o) {
  if (std::string problem = option_problem(o); !problem.empty())
    throw std::invalid_argument(problem);
  MemoryEstimate e;
  e.tensors = tensors.size();
  for (const auto& t : tensors) {
    const uint64_t n = t.numel();
    e.parameters += n;
    e.disk_bytes[t.dtype] += t.nbytes();
    if (e.largest_name.empty() || n > e.largest_numel) {
      e.largest_name = t.name;
      e.largest_numel = n;
    }
  }
  for (const auto& dtype : unique(o.dtypes))
    for (const auto& opt : unique(o.optimizers))
      for (bool zero1 : {false, true})
        if (!zero1 || o.world_size > 1)
          e.rows.push_back(memory_row(e.parameters, *find_named(kTrainDtypes, dtype),
                                      *find_named(kOptimizers, opt), o.world_size, zero1));
  return e;
}

int estimate_memory(const EstimateMemoryOptions& o, std::ostream& out, std::ostream& err) {
  if (std::string problem = option_problem(o); !problem.empty()) {
    err << kEstimateError << problem << "\n";
    return 2;
  }
  try {
    const Model m = read_model(o.path);
    const MemoryEstimate e = estimate(all_tensors(m), o);
    print_summary(o, m, e, out);
    print_table(o, e, out);
    return 0;
  } catch (const InputError& e) {
    err << kEstimateError << e.message << "\n";
    return 2;
  }
}

// ---- merge-weights -----------------------------------------------------------------------------

namespace {

// One tensor to copy: where its bytes are.
struct Piece {
  const SafetensorsHeader* shard;
  const TensorInfo* tensor;
};

std::vector<Piece> pieces_of(const Model& m) {
  std::vector<Piece> out;
  for (const auto& shard : m.shards)
    for (const auto& t : shard.tensors) out.push_back({&shard, &t});
  return out;
}

uint64_t data_bytes(const std::vector<Piece>& pieces) {
  uint64_t n = 0;
  for (const auto& p : pieces) n += p.tensor->nbytes();
  return n;
}

// The length prefix and JSON header of a file holding `pieces` in order, offsets recomputed,
// the JSON padded with spaces to a multiple of 8 bytes as save_model pads it.
std::string encode_header(const std::vector<Piece>& pieces,
                          const std::map<std::string, std::string>& metadata) {
  Json header = Json::object();
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  uint64_t offset = 0;
  for (const auto& p : pieces) {
    const TensorInfo& t = *p.tensor;
    Json entry = Json::object();
    entry["dtype"] = t.dtype;
    entry["shape"] = t.shape;
    entry["data_offsets"] = {offset, offset + t.nbytes()};
    header[t.name] = std::move(entry);
    offset += t.nbytes();
  }
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');
  return u64_le(json.size()) + json;
}

void sync_dir(const fs::path& dir) {
  const std::string path = dir.empty() ? "." : dir.string();
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) cannot_write(path, errno);
  const bool ok = ::fsync(fd) == 0;
  const int error = errno;
  ::close(fd);
  if (!ok) cannot_write(path, error);
}

// A file written as "<final>.tmp" beside its final name: finish() fsyncs and closes it,
// publish() renames it into place. Destroyed unpublished (an error), it removes the temp file.
class StagedFile {
 public:
  explicit StagedFile(fs::path final_path)
      : final_(std::move(final_path)), temp_(final_.string() + ".tmp") {
    // Why fresh: a "<final>.tmp" planted as a link to another file must not be written through.
    fd_ = create_fresh(temp_.string(), 0644);
    if (fd_ < 0) cannot_write(temp_.string(), errno);
  }
  ~StagedFile() {
    if (fd_ >= 0) ::close(fd_);
    std::error_code ignored;
    if (!published_) fs::remove(temp_, ignored);
  }
  StagedFile(const StagedFile&) = delete;
  StagedFile& operator=(const StagedFile&) = delete;

  const fs::path& path() const { return final_; }
  uint64_t size() const { return size_; }

  void write(std::string_view bytes) {
    while (!bytes.empty()) {
      ssize_t put = ::write(fd_, bytes.data(), bytes.size());
      if (put < 0 && errno == EINTR) continue;
      if (put < 0) cannot_write(temp_.string(), errno);
      bytes.remove_prefix(static_cast<std::size_t>(put));
      size_ += static_cast<uint64_t>(put);
    }
  }

  // Copies `n` bytes at `offset` of `in` through `buffer`, a chunk at a time.
  void copy(const InFile& in, uint64_t offset, uint64_t n, std::string& buffer) {
    while (n > 0) {
      const uint64_t chunk = std::min<uint64_t>(n, buffer.size());
      in.read_at(offset, buffer.data(), chunk);
      write(std::string_view(buffer.data(), chunk));
      offset += chunk;
      n -= chunk;
    }
  }

  void finish() {
    if (::fsync(fd_) != 0) cannot_write(temp_.string(), errno);
    const int rc = ::close(fd_);
    fd_ = -1;
    if (rc != 0) cannot_write(temp_.string(), errno);
  }

  void publish() {
    std::error_code ec;
    fs::rename(temp_, final_, ec);
    if (ec)
      throw OutputError{"cannot rename " + temp_.string() + " to " + final_.string() + ": " +
                        ec.message()};
    published_ = true;
  }

 private:
  fs::path final_;
  fs::path temp_;
  int fd_ = -1;
  uint64_t size_ = 0;
  bool published_ = false;
};

// Writes `pieces` into a staged, finished file named `path`.
std::unique_ptr<StagedFile> stage_file(const fs::path& path, const std::vector<Piece>& pieces,
                                       const std::map<std::string, std::string>& metadata,
                                       uint64_t chunk_bytes) {
  auto file = std::make_unique<StagedFile>(path);
  file->write(encode_header(pieces, metadata));
  std::string buffer(std::min(chunk_bytes, std::max<uint64_t>(1, data_bytes(pieces))), '\0');
  std::unique_ptr<InFile> in;
  for (const auto& p : pieces) {
    if (!in || in->path() != p.shard->path) in = std::make_unique<InFile>(p.shard->path);
    file->copy(*in, p.shard->data_start + p.tensor->begin, p.tensor->nbytes(), buffer);
  }
  file->finish();
  return file;
}

std::string count_of(uint64_t n, const std::string& thing) {
  return std::to_string(n) + " " + thing + (n == 1 ? "" : "s");
}

void report(std::ostream& out, const StagedFile& f, std::size_t tensors, uint64_t bytes) {
  out << "accel merge-weights: wrote " << f.path().string() << ": " << count_of(tensors, "tensor")
      << ", " << human_bytes(bytes) << " of tensor data (" << bytes << " bytes), " << f.size()
      << " bytes in all\n";
}

bool same_file(const fs::path& a, const fs::path& b) {
  std::error_code ec;
  return fs::equivalent(a, b, ec);
}

std::vector<std::string> input_files(const Model& m) {
  std::vector<std::string> out;
  for (const auto& shard : m.shards) out.push_back(shard.path);
  if (!m.index.empty()) out.push_back(m.index);
  return out;
}

void merge_into_one(const MergeWeightsOptions& o, const Model& m, std::ostream& out) {
  const fs::path target(o.output);
  std::error_code ec;
  const fs::file_status st = fs::status(target, ec);
  if (fs::is_directory(st))
    bad(o.output,
        "is a folder; merge-weights writes one file there (name a file, or give a "
        "max shard size to write a folder)");
  for (const auto& file : input_files(m))
    if (same_file(file, target)) bad(o.output, "is an input file; write the merge elsewhere");
  if (fs::exists(st) && !o.force)
    throw OutputError{o.output + " exists; it was left as it is (--force replaces it)"};
  const fs::path dir = target.parent_path();
  if (!dir.empty() && !fs::create_directories(dir, ec) && ec)
    throw OutputError{"cannot create folder " + dir.string() + ": " + ec.message()};
  const auto pieces = pieces_of(m);
  const auto metadata =
      m.shards.empty() ? std::map<std::string, std::string>{} : m.shards.front().metadata;
  auto file = stage_file(target, pieces, metadata, o.copy_chunk_bytes);
  file->publish();
  sync_dir(dir);
  report(out, *file, pieces.size(), data_bytes(pieces));
}

// Groups pieces into shards in order (HF's shard_checkpoint, as save_model does): a new shard
// starts when the next tensor would overflow the current one, so a tensor larger than the limit
// gets a shard of its own.
std::vector<std::vector<Piece>> plan_shards(const std::vector<Piece>& pieces, uint64_t max_bytes) {
  std::vector<std::vector<Piece>> shards(1);
  uint64_t current = 0;
  for (const auto& p : pieces) {
    const uint64_t size = p.tensor->nbytes();
    if (!shards.back().empty() && current + size > max_bytes) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(p);
    current += size;
  }
  return shards;
}

std::string shard_name(std::size_t k, std::size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s-%05zu-of-%05zu.safetensors", kPrefix, k, n);
  return buf;
}

// True for a file save_model writes (model.safetensors, the index, model-ddddd-of-ddddd.
// safetensors) or its ".tmp".
bool is_model_file(std::string_view name) {
  if (ends_with(name, ".tmp")) name.remove_suffix(4);
  if (name == kSingleFile || name == kIndexFile) return true;
  const std::string_view head = "model-", tail = ".safetensors";
  if (name.size() != head.size() + 14 + tail.size() || name.substr(0, head.size()) != head ||
      !ends_with(name, tail))
    return false;
  const std::string_view middle = name.substr(head.size(), 14);  // ddddd-of-ddddd
  auto digit = [](char c) { return c >= '0' && c <= '9'; };
  return std::all_of(middle.begin(), middle.begin() + 5, digit) && middle.substr(5, 4) == "-of-" &&
         std::all_of(middle.begin() + 9, middle.end(), digit);
}

std::vector<std::string> model_files_in(const fs::path& dir, bool with_temps) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (is_model_file(name) && (with_temps || !ends_with(name, ".tmp"))) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string index_json(const std::vector<std::vector<Piece>>& shards) {
  nlohmann::json index;  // Why not ordered: keys sorted, as transformers writes it
  uint64_t total = 0;
  index["weight_map"] = nlohmann::json::object();
  for (std::size_t k = 0; k < shards.size(); ++k)
    for (const auto& p : shards[k]) {
      index["weight_map"][p.tensor->name] = shard_name(k + 1, shards.size());
      total += p.tensor->nbytes();
    }
  index["metadata"]["total_size"] = total;
  return index.dump(2) + "\n";
}

void check_shard_output(const MergeWeightsOptions& o, const Model& m, const fs::path& dir) {
  std::error_code ec;
  const fs::file_status st = fs::status(dir, ec);
  if (fs::exists(st) && !fs::is_directory(st))
    bad(o.output, "is a file; with a max shard size the output is a folder");
  if (!fs::exists(st)) return;
  for (const auto& file : input_files(m)) {
    const fs::path p(file);
    if (same_file(p.parent_path().empty() ? "." : p.parent_path(), dir) &&
        is_model_file(p.filename().string()))
      bad(o.output,
          "holds the input " + file + ", which re-sharding would replace; write elsewhere");
  }
  const auto existing = model_files_in(dir, false);
  if (!existing.empty() && !o.force)
    throw OutputError{(dir / existing.front()).string() +
                      " exists; the folder was left as it is (--force replaces its model files)"};
}

// Puts staged files in place. Why this order (as save_model): a loader enters through
// model.safetensors or the index, never through a shard; with the old entry points gone before
// the first shard is renamed and the index renamed last, a reader finds the old model, none, or
// the new one, never old and new shards mixed.
void publish_all(const fs::path& dir, std::vector<std::unique_ptr<StagedFile>>& files) {
  if (files.size() > 1) {
    for (const char* entry : {kSingleFile, kIndexFile}) {
      std::error_code ec;
      fs::remove(dir / entry, ec);
      if (ec) throw OutputError{"cannot remove " + (dir / entry).string() + ": " + ec.message()};
    }
    sync_dir(dir);
  }
  for (auto& f : files) f->publish();
  std::vector<std::string> keep;
  for (const auto& f : files) keep.push_back(f->path().filename().string());
  for (const auto& name : model_files_in(dir, true))
    if (std::find(keep.begin(), keep.end(), name) == keep.end()) {
      std::error_code ec;
      fs::remove(dir / name, ec);  // a stale shard of an earlier save; harmless if it stays
    }
  sync_dir(dir);
}

void merge_into_shards(const MergeWeightsOptions& o, const Model& m, std::ostream& out) {
  const fs::path dir(o.output);
  check_shard_output(o, m, dir);
  std::error_code ec;
  if (!fs::create_directories(dir, ec) && ec)
    throw OutputError{"cannot create folder " + dir.string() + ": " + ec.message()};
  const auto pieces = pieces_of(m);
  const auto shards = plan_shards(pieces, *o.max_shard_size);
  const auto metadata =
      m.shards.empty() ? std::map<std::string, std::string>{} : m.shards.front().metadata;
  const std::size_t n = shards.size();
  std::vector<std::unique_ptr<StagedFile>> files;
  for (std::size_t k = 0; k < n; ++k)
    files.push_back(stage_file(dir / (n == 1 ? kSingleFile : shard_name(k + 1, n)), shards[k],
                               metadata, o.copy_chunk_bytes));
  if (n > 1) {
    files.push_back(std::make_unique<StagedFile>(dir / kIndexFile));
    files.back()->write(index_json(shards));
    files.back()->finish();
  }
  publish_all(dir, files);
  for (std::size_t k = 0; k < n; ++k)
    report(out, *files[k], shards[k].size(), data_bytes(shards[k]));
  if (n > 1)
    out << "accel merge-weights: wrote " << files.back()->path().string() << ": "
        << count_of(n, "shard") << ", " << count_of(pieces.size(), "tensor") << ", "
        << data_bytes(pieces) << " bytes of tensor data\n";
}

}  // namespace

int merge_weights(const MergeWeightsOptions& o, std::ostream& out, std::ostream& err) {
  try {
    if (o.input.empty() || o.output.empty()) throw InputError{"needs an input and an output"};
    if (o.max_shard_size && *o.max_shard_size == 0)
      bad(o.output, "max shard size must be positive");
    if (o.copy_chunk_bytes == 0) bad(o.output, "copy chunk size must be positive");
    const Model m = read_model(o.input);
    if (o.max_shard_size)
      merge_into_shards(o, m, out);
    else
      merge_into_one(o, m, out);
    return 0;
  } catch (const InputError& e) {
    err << kMergeError << e.message << "\n";
    return 2;
  } catch (const OutputError& e) {
    err << kMergeError << e.message << "\n";
    return 1;
  }
}

std::optional<uint64_t> parse_size(std::string_view text) {
  contract::ByteSize size = contract::parse_byte_size(text);
  if (size.problem != nullptr) return std::nullopt;
  return size.bytes;
}

}  // namespace accel::launcher

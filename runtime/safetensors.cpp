// Reads and writes the safetensors format and HF's sharded model layout; every malformed input is a
// CheckpointError (or ConfigError for a size) that names the file, the tensor and what is wrong.
#include "runtime/safetensors.h"

#include <algorithm>
#include <bit>
#include <cctype>
#include <climits>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <tuple>
#include <unordered_set>

#include "accel/error.h"
#include "contract/byte_size.h"
#include "contract/json_depth.h"
#include "contract/quote.h"
#include "contract/safetensors_layout.h"
#include "runtime/checkpoint_io.h"

namespace accel::safetensors {

// Why: tensors are copied to and from the file byte for byte, with no swap.
// Why the macro and not std::endian: this file also builds as C++17 (fuzz/, with clang, whose
// C++20 mode cannot compile libtorch 1.13's headers).
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors is little-endian");

namespace {

bool ends_with(std::string_view s, std::string_view tail) {
  return s.size() >= tail.size() && s.substr(s.size() - tail.size()) == tail;
}
bool starts_with(std::string_view s, std::string_view head) {
  return s.substr(0, head.size()) == head;
}

namespace fs = std::filesystem;
using OrderedJson = nlohmann::ordered_json;

constexpr const char* kMetadataKey = "__metadata__";

struct DtypeInfo {
  torch::Dtype dtype;
  const char* name;
};

constexpr DtypeInfo kDtypes[] = {{torch::kDouble, "F64"}, {torch::kFloat, "F32"},
                                 {torch::kHalf, "F16"},   {torch::kBFloat16, "BF16"},
                                 {torch::kLong, "I64"},   {torch::kInt, "I32"},
                                 {torch::kShort, "I16"},  {torch::kChar, "I8"},
                                 {torch::kByte, "U8"},    {torch::kBool, "BOOL"}};

const DtypeInfo* find_dtype(torch::Dtype dtype) {
  for (const auto& d : kDtypes)
    if (d.dtype == dtype) return &d;
  return nullptr;
}

const DtypeInfo* find_dtype(std::string_view name) {
  for (const auto& d : kDtypes)
    if (name == d.name) return &d;
  return nullptr;
}

std::string in_quotes(std::string_view s) { return contract::quote_for_message(s); }

std::string show_shape(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? "," : "") + std::to_string(shape[i]);
  return out + "]";
}

using contract::show_offsets;

[[noreturn]] void fail(const std::string& where, const std::string& what) {
  throw CheckpointError(where + ": " + what);
}

[[noreturn]] void fail(const std::string& where, std::string_view tensor, const std::string& what) {
  fail(where, "tensor " + in_quotes(tensor) + ": " + what);
}

bool is_utf8(const std::string& s) {
  try {
    (void)OrderedJson(s).dump();
    return true;
  } catch (const nlohmann::json::type_error&) {
    return false;
  }
}

// Names unique, non-empty, UTF-8, not reserved; every tensor dense and of a dtype safetensors
// can name.
void check_tensors(const NamedTensors& tensors, const std::string& where) {
  std::unordered_set<std::string_view> seen;
  for (const auto& [name, t] : tensors) {
    if (name.empty()) fail(where, "a tensor has an empty name");
    if (!is_utf8(name))
      fail(where,
           "tensor name " +
               OrderedJson(name).dump(-1, ' ', false, OrderedJson::error_handler_t::replace) +
               " is not valid UTF-8");
    if (name == kMetadataKey) fail(where, "tensor name \"__metadata__\" is reserved");
    if (!seen.insert(name).second) fail(where, name, "name appears twice");
    if (!t.defined()) fail(where, name, "tensor is undefined");
    if (t.layout() != torch::kStrided)
      fail(where, name, "only dense (strided) tensors can be saved");
    if (!find_dtype(t.scalar_type()))
      fail(where, name,
           std::string("dtype ") + c10::toString(t.scalar_type()) + " has no safetensors name");
  }
}

torch::Tensor to_cpu_contiguous(const torch::Tensor& t) {
  return t.detach().to(torch::kCPU).resolve_conj().resolve_neg().contiguous();
}

std::string length_prefix(uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i)
    out[static_cast<std::size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out;
}

uint64_t read_u64_le(std::string_view bytes) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i)
    n = (n << 8) | static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)]);
  return n;
}

// The length prefix and the JSON, padded with spaces (as the format allows) so that the data
// after it starts at a multiple of `data_align` bytes.
std::string dump_header(const OrderedJson& header, const std::string& where, uint64_t data_align) {
  std::string json;
  try {
    json = header.dump();
  } catch (const nlohmann::json::type_error& e) {
    fail(where, std::string("a metadata string is not valid UTF-8: ") + e.what());
  }
  json.append((data_align - (8 + json.size()) % data_align) % data_align, ' ');
  return length_prefix(json.size()) + json;
}

}  // namespace

std::vector<std::string_view> Encoded::parts() const {
  std::vector<std::string_view> out{header};
  for (const auto& t : data) out.emplace_back(static_cast<const char*>(t.data_ptr()), t.nbytes());
  return out;
}

uint64_t Encoded::size() const {
  uint64_t n = header.size();
  for (const auto& t : data) n += t.nbytes();
  return n;
}

std::string encode_header(const NamedTensors& tensors,
                          const std::map<std::string, std::string>& metadata,
                          const std::string& where, uint64_t data_align) {
  if (data_align == 0 || data_align % 8 != 0)
    throw std::invalid_argument("safetensors::encode_header: data_align " +
                                std::to_string(data_align) + " is not a multiple of 8");
  check_tensors(tensors, where);
  OrderedJson header = OrderedJson::object();
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    const auto bytes = static_cast<uint64_t>(t.numel()) * t.element_size();
    OrderedJson entry = OrderedJson::object();
    entry["dtype"] = find_dtype(t.scalar_type())->name;
    entry["shape"] = t.sizes().vec();
    entry["data_offsets"] = {offset, offset + bytes};
    header[name] = std::move(entry);
    offset += bytes;
  }
  return dump_header(header, where, data_align);
}

Encoded encode(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata,
               const std::string& where) {
  Encoded out;
  out.header = encode_header(tensors, metadata, where);
  for (const auto& [name, t] : tensors) out.data.push_back(to_cpu_contiguous(t));
  return out;
}

namespace {

// One header entry, checked against itself (dtype known, offsets hold exactly shape's bytes).
struct Entry {
  std::string name;
  const DtypeInfo* dtype = nullptr;
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

bool as_u64(const OrderedJson& j, uint64_t& out) {
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

std::vector<int64_t> parse_shape(const OrderedJson& j, const std::string& where,
                                 const std::string& name) {
  const std::string bad = "shape must be a list of non-negative integers, not " + j.dump();
  if (!j.is_array()) fail(where, name, bad);
  std::vector<int64_t> shape;
  for (const auto& d : j) {
    uint64_t v = 0;
    if (!as_u64(d, v) || v > static_cast<uint64_t>(INT64_MAX)) fail(where, name, bad);
    shape.push_back(static_cast<int64_t>(v));
  }
  return shape;
}

void parse_offsets(const OrderedJson& j, const std::string& where, Entry& e) {
  const std::string bad =
      "data_offsets must be [begin, end] with 0 <= begin <= end, not " + j.dump();
  if (!j.is_array() || j.size() != 2 || !as_u64(j[0], e.begin) || !as_u64(j[1], e.end) ||
      e.begin > e.end)
    fail(where, e.name, bad);
}

// numel * element size, or false when it does not fit in 64 bits.
bool byte_count(const Entry& e, uint64_t& out) {
  out = c10::elementSize(e.dtype->dtype);
  for (int64_t d : e.shape)
    if (__builtin_mul_overflow(out, static_cast<uint64_t>(d), &out)) return false;
  return true;
}

Entry parse_entry(const std::string& name, const OrderedJson& j, const std::string& where) {
  Entry e;
  e.name = name;
  if (!j.is_object() || !j.contains("dtype") || !j.contains("shape") || !j.contains("data_offsets"))
    fail(where, name,
         "entry must be an object with dtype, shape and data_offsets, not " + j.dump());
  const auto& dtype = j["dtype"];
  if (dtype.is_string()) e.dtype = find_dtype(dtype.get<std::string>());
  if (!e.dtype)
    fail(where, name,
         "unknown dtype " + dtype.dump() +
             " (accel reads F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL)");
  e.shape = parse_shape(j["shape"], where, name);
  parse_offsets(j["data_offsets"], where, e);
  uint64_t need = 0;
  const bool fits = byte_count(e, need);
  if (!fits || need != e.end - e.begin)
    fail(where, name,
         "data_offsets " + show_offsets(e.begin, e.end) + " hold " +
             std::to_string(e.end - e.begin) + " bytes but shape " + show_shape(e.shape) + " of " +
             e.dtype->name + " needs " + (fits ? std::to_string(need) : "more than 2^64"));
  return e;
}

std::map<std::string, std::string> parse_metadata(const OrderedJson& j, const std::string& where) {
  if (!j.is_object() ||
      !std::all_of(j.begin(), j.end(), [](const auto& v) { return v.is_string(); }))
    fail(where, "\"__metadata__\" must map strings to strings, not " + j.dump());
  std::map<std::string, std::string> out;
  for (const auto& [key, value] : j.items()) out[key] = value.template get<std::string>();
  return out;
}

OrderedJson parse_header(std::string_view bytes, const std::string& where) {
  if (bytes.size() < 8)
    fail(where, "file is " + std::to_string(bytes.size()) +
                    " bytes, too short for the 8-byte header length; not a safetensors file");
  uint64_t n = read_u64_le(bytes);
  if (n > bytes.size() - 8)
    fail(where, "header length " + std::to_string(n) + " runs past the end of the file (" +
                    std::to_string(bytes.size()) + " bytes); truncated or not a safetensors file");
  if (auto deep = contract::json_nesting_problem(bytes.substr(8, n)); !deep.empty())
    fail(where, "header " + deep + "; not a safetensors file");
  OrderedJson header;
  try {
    header = OrderedJson::parse(bytes.substr(8, n));
  } catch (const nlohmann::json::exception& e) {
    // Why the base class: a number out of range (1e999) is out_of_range, not parse_error (found
    // by fuzz/fuzz_safetensors); any of them means a damaged file.
    fail(where, std::string("header is not valid JSON: ") + e.what());
  }
  if (!header.is_object())
    fail(where, "header is not a JSON object but " + std::string(header.type_name()));
  return header;
}

// Invariant on return: entries sorted by offset tile [0, data_size) with no gap or overlap.
void check_tiling(std::vector<Entry>& entries, uint64_t data_size, const std::string& where) {
  if (auto problem = contract::check_tiling(entries, data_size)) {
    if (problem->tensor.empty()) fail(where, problem->what);
    fail(where, problem->tensor, problem->what);
  }
}

torch::Tensor load(const Entry& e, const char* data, const std::string& where, bool borrow) {
  const char* src = data + e.begin;
  std::size_t n = e.end - e.begin;
  if (e.dtype->dtype == torch::kBool &&
      std::any_of(src, src + n, [](char c) { return static_cast<unsigned char>(c) > 1; }))
    fail(where, e.name, "BOOL data holds a byte other than 0 or 1");
  auto options = torch::TensorOptions().dtype(e.dtype->dtype);
  auto item = static_cast<std::size_t>(c10::elementSize(e.dtype->dtype));
  if (borrow && n > 0 && reinterpret_cast<std::uintptr_t>(src) % item == 0) {
    return torch::from_blob(const_cast<char*>(src), e.shape, options);  // read-only by contract
  }
  torch::Tensor t = torch::empty(e.shape, options);
  if (n > 0) std::memcpy(t.data_ptr(), src, n);
  return t;
}

}  // namespace

Decoded decode(std::string_view bytes, const std::string& where, Memory memory) {
  OrderedJson header = parse_header(bytes, where);
  const uint64_t data_start = 8 + read_u64_le(bytes);
  Decoded out;
  std::vector<Entry> entries;
  for (const auto& [name, value] : header.items()) {
    if (name == kMetadataKey)
      out.metadata = parse_metadata(value, where);
    else
      entries.push_back(parse_entry(name, value, where));
  }
  check_tiling(entries, bytes.size() - data_start, where);
  for (const auto& e : entries)
    out.tensors.emplace_back(e.name,
                             load(e, bytes.data() + data_start, where, memory == Memory::kBorrow));
  return out;
}

namespace {

[[noreturn]] void bad_size(const std::string& name, const std::string& text,
                           const std::string& why) {
  throw ConfigError("accel: " + name + " " + in_quotes(text) + " " + why +
                    "; write a byte count or a whole number with KB, MB, GB (10^3) or KiB, MiB, "
                    "GiB (2^10), e.g. \"10GB\"");
}

}  // namespace

uint64_t parse_size(const std::string& text, const std::string& name) {
  contract::ByteSize size = contract::parse_byte_size(text);
  if (size.problem != nullptr) bad_size(name, text, size.problem);
  return size.bytes;
}

namespace {

// Groups tensor indices into shards, in order (HF's shard_checkpoint).
std::vector<std::vector<std::size_t>> plan_shards(const NamedTensors& tensors, uint64_t max_bytes) {
  std::vector<std::vector<std::size_t>> shards(1);
  uint64_t current = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    uint64_t size = tensors[i].second.nbytes();
    if (!shards.back().empty() && current + size > max_bytes) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(i);
    current += size;
  }
  return shards;
}

std::string shard_name(const std::string& prefix, std::size_t k, std::size_t n) {
  auto five = [](std::size_t v) {
    std::string digits = std::to_string(v);
    return std::string(digits.size() < 5 ? 5 - digits.size() : 0, '0') + digits;
  };
  return prefix + "-" + five(k) + "-of-" + five(n) + ".safetensors";
}

// True when `name` is "<prefix>-ddddd-of-ddddd.safetensors".
bool is_shard_name(std::string_view name, const std::string& prefix) {
  const std::string_view tail = ".safetensors";
  if (!starts_with(name, prefix + "-") || !ends_with(name, tail)) return false;
  name = name.substr(prefix.size() + 1, name.size() - prefix.size() - 1 - tail.size());
  auto digits = [](std::string_view s) {
    return s.size() == 5 &&
           std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  return name.size() == 14 && digits(name.substr(0, 5)) && name.substr(5, 4) == "-of-" &&
         digits(name.substr(9));
}

// True when `name` is one of the files save_sharded writes for `prefix`, or its temp file.
bool is_saved_file(std::string_view name, const std::string& prefix) {
  if (ends_with(name, ".tmp")) name.remove_suffix(4);
  return name == prefix + ".safetensors" || name == prefix + ".safetensors.index.json" ||
         is_shard_name(name, prefix);
}

// Removes the files an earlier save for `prefix` left in `dir` that are not in `keep`.
void remove_stale(const fs::path& dir, const std::string& prefix,
                  const std::vector<std::string>& keep) {
  std::vector<fs::path> stale;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    auto name = entry.path().filename().string();
    if (is_saved_file(name, prefix) && std::find(keep.begin(), keep.end(), name) == keep.end()) {
      stale.push_back(entry.path());
    }
  }
  if (ec)
    throw CheckpointError("accel: checkpoint: " + dir.string() + ": cannot list: " + ec.message());
  for (const auto& path : stale) ckpt::checkpoint_fs().remove_all(path);
}

// Writes and fsyncs every file under its temp name (`name`.tmp, through `write(k, temp path)`)
// before any takes its real name; on a failure no temp file outlives it.
void stage(const fs::path& dir, const std::vector<std::string>& names,
           const std::function<void(std::size_t, const fs::path&)>& write) {
  std::size_t k = 0;
  try {
    for (; k < names.size(); ++k) write(k, dir / (names[k] + ".tmp"));
  } catch (...) {
    for (std::size_t i = 0; i <= k && i < names.size(); ++i) {
      try {
        ckpt::checkpoint_fs().remove_all(dir / (names[i] + ".tmp"));
      } catch (const Error&) {  // Why: the write's error is the one worth reporting
      }
    }
    throw;
  }
}

std::string index_json(const NamedTensors& tensors,
                       const std::vector<std::vector<std::size_t>>& shards,
                       const std::string& prefix) {
  nlohmann::json index;  // Why: keys sorted, as transformers writes it (sort_keys=True)
  uint64_t total = 0;
  index["weight_map"] = nlohmann::json::object();
  for (std::size_t k = 0; k < shards.size(); ++k)
    for (std::size_t i : shards[k]) {
      index["weight_map"][tensors[i].first] = shard_name(prefix, k + 1, shards.size());
      total += tensors[i].second.nbytes();
    }
  index["metadata"]["total_size"] = total;
  return index.dump(2) + "\n";
}

}  // namespace

std::vector<std::string> save_sharded(const NamedTensors& tensors, const fs::path& dir,
                                      uint64_t max_shard_bytes, const std::string& prefix) {
  if (max_shard_bytes == 0)
    throw ConfigError("accel: save_sharded into " + dir.string() +
                      ": max_shard_bytes must be positive");
  if (prefix.empty() || prefix.find('/') != std::string::npos)
    throw ConfigError("accel: save_sharded: file prefix " + in_quotes(prefix) +
                      " must be a non-empty file name");
  check_tensors(tensors, (dir / prefix).string());
  ckpt::checkpoint_fs().create_directories_durably(dir);
  const auto shards = plan_shards(tensors, max_shard_bytes);
  const std::size_t n = shards.size();
  std::vector<std::string> written;
  for (std::size_t k = 0; k < n; ++k)
    written.push_back(n == 1 ? prefix + ".safetensors" : shard_name(prefix, k + 1, n));
  if (n > 1) written.push_back(prefix + ".safetensors.index.json");
  auto& cfs = ckpt::checkpoint_fs();
  stage(dir, written, [&](std::size_t k, const fs::path& temp) {
    if (k == n) {
      cfs.write_file(temp, {index_json(tensors, shards, prefix)});
      return;
    }
    NamedTensors part;
    for (std::size_t i : shards[k]) part.push_back(tensors[i]);
    cfs.write_file(temp, encode(part, {{"format", "pt"}}, (dir / written[k]).string()).parts());
  });
  auto put_in_place = [&](const std::string& name) {
    cfs.rename(dir / (name + ".tmp"), dir / name);
  };
  try {
    if (n == 1) {
      put_in_place(written[0]);  // one rename: the old model, then the new one
      remove_stale(dir, prefix, written);
    } else {
      // Why this order: a loader enters a model through model.safetensors or the index, never
      // through a shard. With the old entry points gone before the first shard is renamed and
      // the new index renamed last, a reader finds the old model, no model (an error that says
      // so), or the new one, never old and new shards of one name mixed under an index.
      std::error_code ec;
      for (const auto& entry : {prefix + ".safetensors", prefix + ".safetensors.index.json"}) {
        if (fs::exists(dir / entry, ec)) cfs.remove_all(dir / entry);
      }
      cfs.sync_dir(dir);
      for (const auto& name : written) put_in_place(name);  // the index last
      remove_stale(dir, prefix, written);
    }
  } catch (...) {
    for (const auto& name : written) {
      std::error_code ec;
      // what was not renamed; the first error is the one to report
      fs::remove(dir / (name + ".tmp"), ec);
    }
    throw;
  }
  cfs.sync_dir(dir);
  return written;
}

NamedTensors module_tensors(const torch::nn::Module& module) {
  NamedTensors out;
  for (const auto& p : module.named_parameters(true)) out.emplace_back(p.key(), p.value().detach());
  for (const auto& b : module.named_buffers(true)) out.emplace_back(b.key(), b.value().detach());
  return out;
}

}  // namespace accel::safetensors

// accel estimate-memory and accel merge-weights on small safetensors files written by hand here:
// the memory arithmetic, the printed report, merge and split round trips, the refusal to replace
// an output, and one case per malformed input (exit code 2, a message naming the file).
#include "launcher/weights_cmd.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <sstream>

#include "tests/common/files.h"

namespace accel::launcher {
namespace {

namespace fs = std::filesystem;
using accel::testing::read_file;
using accel::testing::TempDir;
using accel::testing::write_file;

// ---- a tiny safetensors writer, independent of the code under test ------------------------

struct Tensor {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> shape;
  std::string bytes;
};

std::string le64(uint64_t n) {
  std::string out(8, '\0');
  for (std::size_t i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out;
}

std::string floats(std::vector<float> values) {
  std::string out(values.size() * sizeof(float), '\0');
  std::memcpy(out.data(), values.data(), out.size());
  return out;
}

// `n` distinct bytes, so a copy from the wrong offset shows.
std::string pattern(std::size_t n, int seed) {
  std::string out(n, '\0');
  for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<char>((seed * 31 + i * 7) & 0xff);
  return out;
}

// A file with `json` as its header, unpadded, then `data`.
std::string raw_file(const std::string& json, const std::string& data = "") {
  return le64(json.size()) + json + data;
}

// A well-formed file as save_model writes it: metadata first, compact JSON padded with spaces
// to a multiple of 8, tensors in order.
std::string st_file(const std::vector<Tensor>& tensors,
                    const std::string& metadata = R"({"format":"pt"})") {
  std::string json = "{";
  if (!metadata.empty()) json += R"("__metadata__":)" + metadata;
  std::string data;
  for (const auto& t : tensors) {
    std::string shape = "[";
    for (std::size_t i = 0; i < t.shape.size(); ++i)
      shape += (i ? "," : "") + std::to_string(t.shape[i]);
    shape += "]";
    if (json.size() > 1) json += ",";
    json += "\"" + t.name + R"(":{"dtype":")" + t.dtype + R"(","shape":)" + shape +
            R"(,"data_offsets":[)" + std::to_string(data.size()) + "," +
            std::to_string(data.size() + t.bytes.size()) + "]}";
    data += t.bytes;
  }
  json += "}";
  json.append((8 - json.size() % 8) % 8, ' ');
  return raw_file(json, data);
}

// model.safetensors.index.json mapping each name to its file.
std::string index_file(const std::vector<std::pair<std::string, std::string>>& weight_map) {
  std::string json = R"({"metadata": {"total_size": 0}, "weight_map": {)";
  for (std::size_t i = 0; i < weight_map.size(); ++i)
    json += (i ? ", " : "") + ("\"" + weight_map[i].first + "\": \"" + weight_map[i].second + "\"");
  return json + "}}";
}

const char* const kShard1 = "model-00001-of-00002.safetensors";
const char* const kShard2 = "model-00002-of-00002.safetensors";
const char* const kIndex = "model.safetensors.index.json";

// The 2-shard folder most tests start from.
const std::vector<Tensor> kPart1 = {
    {"a", "F32", {2, 2}, floats({1.f, 2.f, 3.f, 4.f})},
    {"b", "BF16", {3}, pattern(6, 1)},
};
const std::vector<Tensor> kPart2 = {
    {"c", "I64", {2}, pattern(16, 2)},
    {"d", "F32", {}, floats({-0.5f})},
};

void write_two_shards(const fs::path& dir) {
  fs::create_directories(dir);
  write_file(dir / kShard1, st_file(kPart1, R"({"format":"pt","note":"first"})"));
  write_file(dir / kShard2, st_file(kPart2, R"({"format":"pt","note":"second"})"));
  write_file(dir / kIndex,
             index_file({{"a", kShard1}, {"b", kShard1}, {"c", kShard2}, {"d", kShard2}}));
}

struct Outcome {
  int rc = -1;
  std::string out;
  std::string err;
};

// Runs `command` (estimate_memory or merge_weights) and keeps what it printed.
template <class Options>
Outcome run(int (*command)(const Options&, std::ostream&, std::ostream&), const Options& o) {
  std::ostringstream out, err;
  Outcome r;
  r.rc = command(o, out, err);
  r.out = out.str();
  r.err = err.str();
  return r;
}

Outcome run_estimate(const EstimateMemoryOptions& o) { return run(estimate_memory, o); }
Outcome run_merge(const MergeWeightsOptions& o) { return run(merge_weights, o); }

// Each tensor's name and bytes, as the file holds them, in file order.
std::vector<std::pair<std::string, std::string>> tensors_in(const fs::path& file) {
  auto header = read_safetensors_header(file.string());
  EXPECT_TRUE(header.is_ok()) << (header.is_ok() ? "" : header.message());
  if (!header.is_ok()) return {};
  const std::string bytes = read_file(file);
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& t : header->tensors)
    out.emplace_back(t.name, bytes.substr(header->data_start + t.begin, t.nbytes()));
  return out;
}

std::vector<std::pair<std::string, std::string>> named_bytes(const std::vector<Tensor>& tensors) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& t : tensors) out.emplace_back(t.name, t.bytes);
  return out;
}

TensorInfo info(std::string name, std::string dtype, std::vector<uint64_t> shape,
                uint64_t element_bytes, uint64_t begin = 0) {
  TensorInfo t{std::move(name), std::move(dtype), std::move(shape), begin, begin};
  t.end = begin + t.numel() * element_bytes;
  return t;
}

const MemoryRow* find_row(const MemoryEstimate& e, const std::string& dtype,
                          const std::string& optimizer, bool zero1) {
  for (const auto& r : e.rows)
    if (r.dtype == dtype && r.optimizer == optimizer && r.zero1 == zero1) return &r;
  return nullptr;
}

// ---- estimate-memory ---------------------------------------------------------------------

TEST(EstimateMemory, CountsParametersExactly) {
  const std::vector<TensorInfo> tensors = {
      info("a", "F32", {3, 4}, 4, 0), info("b", "BF16", {5}, 2, 48), info("c", "F32", {}, 4, 58),
      info("d", "I64", {2, 0}, 8, 62)};
  const MemoryEstimate e = estimate(tensors, {});
  EXPECT_EQ(e.tensors, 4u);
  EXPECT_EQ(e.parameters, 12u + 5u + 1u + 0u);
  EXPECT_EQ(e.disk_bytes.at("F32"), 52u);
  EXPECT_EQ(e.disk_bytes.at("BF16"), 10u);
  EXPECT_EQ(e.disk_bytes.at("I64"), 0u);
  EXPECT_EQ(e.largest_name, "a");
  EXPECT_EQ(e.largest_numel, 12u);
}

TEST(EstimateMemory, AdamWInFp32IsSixteenBytesPerParameter) {
  EstimateMemoryOptions o;
  o.dtypes = {"fp32", "bf16", "fp16"};
  const MemoryEstimate e = estimate({info("w", "F32", {10, 100}, 4)}, o);
  ASSERT_EQ(e.rows.size(), 6u);  // 3 dtypes x 2 optimizers, no ZeRO-1 row at world size 1
  const MemoryRow* adamw = find_row(e, "fp32", "adamw", false);
  ASSERT_NE(adamw, nullptr);
  EXPECT_EQ(adamw->weights, 4000u);
  EXPECT_EQ(adamw->gradients, 4000u);
  EXPECT_EQ(adamw->optimizer_state, 8000u);
  EXPECT_EQ(adamw->total, 16u * 1000u);
  EXPECT_EQ(find_row(e, "bf16", "adamw", false)->total, 8u * 1000u);  // 2 + 2 + 2 * 2
  EXPECT_EQ(find_row(e, "fp32", "sgd", false)->total, 12u * 1000u);   // 4 + 4 + 4
  EXPECT_EQ(find_row(e, "fp16", "sgd", false)->total, 6u * 1000u);    // 2 + 2 + 2
  EXPECT_EQ(e.rows.front().dtype, "fp32");  // by dtype, then optimizer, as given
  EXPECT_EQ(e.rows.front().optimizer, "adamw");
}

TEST(EstimateMemory, ZeroOneDividesOnlyTheOptimizerState) {
  EstimateMemoryOptions o;
  o.world_size = 4;
  const MemoryEstimate e = estimate({info("w", "F32", {1000}, 4)}, o);
  ASSERT_EQ(e.rows.size(), 8u);  // 2 dtypes x 2 optimizers x ZeRO-1 no/yes
  const MemoryRow* plain = find_row(e, "fp32", "adamw", false);
  const MemoryRow* zero1 = find_row(e, "fp32", "adamw", true);
  ASSERT_TRUE(plain && zero1);
  EXPECT_EQ(zero1->weights, plain->weights);
  EXPECT_EQ(zero1->gradients, plain->gradients);
  EXPECT_EQ(zero1->optimizer_state, plain->optimizer_state / 4);
  EXPECT_EQ(zero1->total, 4000u + 4000u + 2000u);
  // A count that does not divide: each rank keeps state for ceil(1001 / 4) = 251 elements.
  const MemoryEstimate odd = estimate({info("w", "F32", {1001}, 4)}, o);
  EXPECT_EQ(find_row(odd, "fp32", "adamw", true)->optimizer_state, 251u * 8u);
  EXPECT_EQ(find_row(odd, "bf16", "sgd", true)->optimizer_state, 251u * 2u);
}

TEST(EstimateMemory, RejectsOptionsOutsideTheSets) {
  TempDir tmp;
  write_file(tmp / "m.safetensors", st_file(kPart1));
  auto with = [&](auto change) {
    EstimateMemoryOptions o;
    o.path = tmp / "m.safetensors";
    change(o);
    return o;
  };
  const std::vector<std::pair<EstimateMemoryOptions, std::string>> cases = {
      {with([](auto& o) { o.world_size = 0; }), "world size must be at least 1, not 0"},
      {with([](auto& o) { o.optimizers = {"adam"}; }), "unknown optimizer \"adam\""},
      {with([](auto& o) { o.dtypes = {"fp8"}; }), "unknown dtype \"fp8\""},
      {with([](auto& o) { o.optimizers.clear(); }), "no optimizer"}};
  for (const auto& [o, fragment] : cases) {
    SCOPED_TRACE(fragment);
    Outcome r = run_estimate(o);
    EXPECT_EQ(r.rc, 2);
    EXPECT_EQ(r.err.rfind("accel estimate-memory: error: ", 0), 0u) << r.err;
    EXPECT_NE(r.err.find(fragment), std::string::npos) << r.err;
    EXPECT_THROW(estimate({}, o), std::invalid_argument);
  }
}

TEST(EstimateMemory, PrintsTheKeyLines) {
  TempDir tmp;
  const std::string path = tmp / "model.safetensors";
  // 1234 * 1000 + 567 = 1234567 parameters.
  write_file(path, st_file({{"embed.weight", "BF16", {1234, 1000}, pattern(2468000, 3)},
                            {"bias", "F32", {567}, pattern(2268, 4)}}));
  EstimateMemoryOptions o;
  o.path = path;
  Outcome r = run_estimate(o);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_NE(r.out.find("accel estimate-memory: " + path + "\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  tensors:     2\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  parameters:  1.23M (1234567)\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  on disk:     BF16 2.35 MiB (2468000 bytes), F32 2.21 KiB (2268 bytes)\n"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("  largest:     \"embed.weight\" with 1.23M parameters (1234000)\n"),
            std::string::npos)
      << r.out;
  // fp32 AdamW: 16 bytes per parameter = 19753072 bytes = 18.84 MiB.
  const std::size_t row = r.out.find("  fp32   adamw      no ");
  ASSERT_NE(row, std::string::npos) << r.out;
  const std::string line = r.out.substr(row, r.out.find('\n', row) - row);
  EXPECT_NE(line.find("18.84 MiB"), std::string::npos) << line;
  EXPECT_EQ(line.substr(line.size() - 9), " 19753072") << line;
  EXPECT_EQ(r.out.find(" yes "), std::string::npos) << "no ZeRO-1 row at world size 1";
  EXPECT_NE(r.out.find("NOT included: activations, temporary buffers and the CUDA context"),
            std::string::npos)
      << r.out;
}

TEST(EstimateMemory, ReadsAShardedFolderOrItsIndex) {
  TempDir tmp;
  write_two_shards(tmp.path() / "ckpt");
  for (const std::string& path : {tmp / "ckpt", tmp / "ckpt/" + std::string(kIndex)}) {
    SCOPED_TRACE(path);
    EstimateMemoryOptions o;
    o.path = path;
    o.world_size = 2;
    Outcome r = run_estimate(o);
    ASSERT_EQ(r.rc, 0) << r.err;
    EXPECT_NE(r.out.find("  files:       2 (sharded)\n"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("  tensors:     4\n"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("  parameters:  10 (10)\n"), std::string::npos) << r.out;  // 4+3+2+1
    EXPECT_NE(r.out.find("  fp32   adamw      yes "), std::string::npos) << r.out;
  }
}

// ---- malformed inputs, shared by both commands ---------------------------------------------

struct BadCase {
  std::string label;
  std::vector<std::pair<std::string, std::string>> files;  // name in the folder -> bytes
  std::string input;                                       // relative to the folder
  std::string named;     // the file the message must name, relative to the folder
  std::string fragment;  // what it must say
};

std::vector<BadCase> bad_cases() {
  const std::string one_f32 = floats({1.f, 2.f});
  const std::string good1 = st_file(kPart1), good2 = st_file(kPart2);
  return {
      {"missing path", {}, "nope.safetensors", "nope.safetensors", "does not exist"},
      {"empty folder", {{"x.txt", "x"}}, "", "", "holds neither model.safetensors"},
      {"truncated header",
       {{"m.safetensors", std::string("\x10\0\0\0\0", 5)}},
       "m.safetensors",
       "m.safetensors",
       "too short for the 8-byte header length"},
      {"header length past the end",
       {{"m.safetensors", le64(100) + "{}"}},
       "m.safetensors",
       "m.safetensors",
       "header length 100 runs past the end of the file (10 bytes)"},
      {"text file",
       {{"m.safetensors", "this is not a safetensors file at all"}},
       "m.safetensors",
       "m.safetensors",
       "runs past the end of the file"},
      {"invalid JSON",
       {{"m.safetensors", raw_file("{not json}")}},
       "m.safetensors",
       "m.safetensors",
       "header is not valid JSON"},
      {"nesting 100,000 levels deep",
       {{"m.safetensors",
         raw_file("{\"t\":" + std::string(100000, '[') + std::string(100000, ']') + "}")}},
       "m.safetensors",
       "m.safetensors",
       "header nests arrays and objects more than 64 levels deep"},
      {"unknown dtype",
       {{"m.safetensors",
         raw_file(R"({"x":{"dtype":"F128","shape":[2],"data_offsets":[0,8]}})", one_f32)}},
       "m.safetensors",
       "m.safetensors",
       "tensor \"x\": unknown dtype \"F128\""},
      {"a terminal escape in a tensor name",
       {{"m.safetensors",
         raw_file(R"({"x\u001b[2J":{"dtype":"F128","shape":[2],"data_offsets":[0,8]}})", one_f32)}},
       "m.safetensors",
       "m.safetensors",
       "tensor \"x\\x1b[2J\": unknown dtype \"F128\""},
      {"offsets past the data",
       {{"m.safetensors",
         raw_file(R"({"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", one_f32)}},
       "m.safetensors",
       "m.safetensors",
       "end past the data section (8 bytes)"},
      {"overlapping offsets",
       {{"m.safetensors", raw_file(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                   R"("y":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                                   floats({1.f, 2.f, 3.f}))}},
       "m.safetensors",
       "m.safetensors",
       "tensor \"y\": data_offsets [4, 12] overlap tensor \"x\" [0, 8]"},
      {"bytes after the last tensor",
       {{"m.safetensors",
         raw_file(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", one_f32)}},
       "m.safetensors",
       "m.safetensors",
       "4 bytes after the last tensor (the tensors cover"},
      {"a gap before a tensor",
       {{"m.safetensors",
         raw_file(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", one_f32)}},
       "m.safetensors",
       "m.safetensors",
       "leave bytes [0, 4] of the data section to no tensor"},
      {"shape and offsets disagree",
       {{"m.safetensors",
         raw_file(R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", one_f32)}},
       "m.safetensors",
       "m.safetensors",
       "shape [3] of F32 needs 12"},
      {"a name twice in one header",
       {{"m.safetensors", raw_file(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                   R"("x":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                                   one_f32)}},
       "m.safetensors",
       "m.safetensors",
       "tensor \"x\": appears twice in the header"},
      {"missing shard",
       {{kShard1, good1}, {kIndex, index_file({{"a", kShard1}, {"b", kShard1}, {"c", kShard2}})}},
       "",
       kShard2,
       "does not exist, but "},
      {"a tensor in two shards",
       {{kShard1, good1},
        {kShard2, st_file({kPart2[0], kPart1[1]})},
        {kIndex, index_file({{"a", kShard1}, {"b", kShard1}, {"c", kShard2}})}},
       "",
       kShard2,
       std::string("tensor \"b\": is also in ")},
      {"weight_map names a tensor its shard lacks",
       {{kShard1, good1},
        {kShard2, good2},
        {kIndex, index_file({{"a", kShard1},
                             {"b", kShard1},
                             {"c", kShard2},
                             {"d", kShard2},
                             {"ghost", kShard2}})}},
       "",
       kShard2,
       "tensor \"ghost\": is missing"},
  };
}

TEST(EstimateMemory, RejectsEachBadInputNamingTheFile) {
  for (const auto& c : bad_cases()) {
    SCOPED_TRACE(c.label);
    TempDir tmp;
    for (const auto& [name, bytes] : c.files) write_file(tmp.path() / name, bytes);
    EstimateMemoryOptions o;
    o.path = c.input.empty() ? tmp.path().string() : tmp / c.input;
    Outcome r = run_estimate(o);
    EXPECT_EQ(r.rc, 2);
    EXPECT_EQ(r.out, "");
    EXPECT_EQ(r.err.rfind("accel estimate-memory: error: ", 0), 0u) << r.err;
    const std::string named = c.named.empty() ? tmp.path().string() : tmp / c.named;
    EXPECT_NE(r.err.find(named + ": "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(c.fragment), std::string::npos) << r.err;
  }
}

TEST(EstimateMemory, HeaderReaderReportsAFailureAsAResult) {
  TempDir tmp;
  write_file(tmp / "m.safetensors", "\x01\x02");
  auto header = read_safetensors_header(tmp / "m.safetensors");
  ASSERT_FALSE(header.is_ok());
  EXPECT_EQ(header.message().rfind(tmp / "m.safetensors" + ": file is 2 bytes", 0), 0u)
      << header.message();
}

// ---- merge-weights ----------------------------------------------------------------------

TEST(MergeWeights, MergesTwoShardsIntoOneFile) {
  TempDir tmp;
  write_two_shards(tmp.path() / "ckpt");
  MergeWeightsOptions o;
  o.input = tmp / "ckpt";
  o.output = tmp / "out/merged.safetensors";  // the folder does not exist yet
  o.copy_chunk_bytes = 5;                     // Why: every tensor crosses a chunk boundary
  Outcome r = run_merge(o);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("wrote " + o.output + ": 4 tensors"), std::string::npos) << r.out;

  auto want = named_bytes(kPart1);
  for (const auto& t : named_bytes(kPart2)) want.push_back(t);
  EXPECT_EQ(tensors_in(o.output), want);  // shard order, then offset order
  auto header = read_safetensors_header(o.output);
  ASSERT_TRUE(header.is_ok()) << header.message();
  EXPECT_EQ(header->metadata,
            (std::map<std::string, std::string>{{"format", "pt"}, {"note", "first"}}));
  EXPECT_EQ((header->data_start - 8) % 8, 0u) << "header padded to a multiple of 8";
  EXPECT_EQ(header->tensors[2].shape, (std::vector<uint64_t>{2}));
  EXPECT_EQ(header->tensors[3].shape, (std::vector<uint64_t>{}));
  EXPECT_FALSE(fs::exists(o.output + ".tmp"));
}

TEST(MergeWeights, SplitThenMergeBackIsByteIdentical) {
  TempDir tmp;
  const std::vector<Tensor> tensors = {
      {"t0", "F32", {6}, pattern(24, 10)},  {"t1", "F32", {10}, pattern(40, 11)},
      {"t2", "F32", {2}, pattern(8, 12)},   {"t3", "F32", {25}, pattern(100, 13)},
      {"t4", "BF16", {8}, pattern(16, 14)}, {"t5", "I64", {2}, pattern(16, 15)}};
  const std::string original = st_file(tensors);
  write_file(tmp / "orig.safetensors", original);

  MergeWeightsOptions split;
  split.input = tmp / "orig.safetensors";
  split.output = tmp / "split";
  split.max_shard_size = 64;
  split.copy_chunk_bytes = 7;
  Outcome r = run_merge(split);
  ASSERT_EQ(r.rc, 0) << r.err;
  // [t0 t1] = 64 bytes; t2 would overflow it; t3 (100 bytes) alone; [t4 t5] = 32 bytes.
  const std::vector<std::vector<std::string>> want_shards = {
      {"t0", "t1"}, {"t2"}, {"t3"}, {"t4", "t5"}};
  for (std::size_t k = 0; k < want_shards.size(); ++k) {
    const std::string name = "model-0000" + std::to_string(k + 1) + "-of-00004.safetensors";
    SCOPED_TRACE(name);
    auto got = tensors_in(tmp.path() / "split" / name);
    std::vector<std::string> names;
    uint64_t bytes = 0;
    for (const auto& [n, b] : got) {
      names.push_back(n);
      bytes += b.size();
    }
    EXPECT_EQ(names, want_shards[k]);
    if (names.size() > 1) {
      EXPECT_LE(bytes, 64u);
    }
  }
  const std::string index = read_file(tmp.path() / "split" / kIndex);
  EXPECT_NE(index.find("\"total_size\": 204"), std::string::npos) << index;
  EXPECT_NE(index.find("\"t3\": \"model-00003-of-00004.safetensors\""), std::string::npos) << index;
  EXPECT_FALSE(fs::exists(tmp.path() / "split/model.safetensors"));

  MergeWeightsOptions merge;
  merge.input = tmp / "split";
  merge.output = tmp / "merged.safetensors";
  r = run_merge(merge);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(tensors_in(merge.output), named_bytes(tensors));
  EXPECT_EQ(read_file(merge.output), original) << "the whole file, header included";
}

TEST(MergeWeights, WritesOneModelFileWhenEverythingFits) {
  TempDir tmp;
  write_two_shards(tmp.path() / "ckpt");
  MergeWeightsOptions o;
  o.input = tmp / "ckpt";
  o.output = tmp / "out";
  o.max_shard_size = parse_size("1GB");
  Outcome r = run_merge(o);
  ASSERT_EQ(r.rc, 0) << r.err;
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(tmp.path() / "out"))
    files.push_back(e.path().filename().string());
  EXPECT_EQ(files, std::vector<std::string>{"model.safetensors"});
  EXPECT_EQ(tensors_in(tmp.path() / "out/model.safetensors").size(), 4u);
}

// A link planted at the temp name ("<out>.tmp" beside the output, in a folder others can write)
// is not written through: the file it points to keeps its bytes, and the merge writes its own.
TEST(MergeWeights, ALinkPlantedAtTheTempNameIsNotWrittenThrough) {
  TempDir tmp;
  write_two_shards(tmp.path() / "ckpt");
  write_file(tmp / "precious.txt", "the victim's file");
  fs::create_directories(tmp.path() / "out");
  fs::create_symlink(tmp.path() / "precious.txt", tmp.path() / "out/model.safetensors.tmp");
  MergeWeightsOptions o;
  o.input = tmp / "ckpt";
  o.output = tmp / "out";
  o.max_shard_size = parse_size("1GB");
  Outcome r = run_merge(o);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(read_file(tmp / "precious.txt"), "the victim's file");
  EXPECT_EQ(tensors_in(tmp.path() / "out/model.safetensors").size(), 4u);
  EXPECT_FALSE(fs::exists(fs::symlink_status(tmp.path() / "out/model.safetensors.tmp")));
}

TEST(MergeWeights, RefusesToReplaceAnOutputWithoutForce) {
  TempDir tmp;
  write_two_shards(tmp.path() / "ckpt");
  write_file(tmp / "out.safetensors", "keep me");
  MergeWeightsOptions o;
  o.input = tmp / "ckpt";
  o.output = tmp / "out.safetensors";
  Outcome r = run_merge(o);
  EXPECT_EQ(r.rc, 1);
  EXPECT_EQ(r.err, "accel merge-weights: error: " + o.output +
                       " exists; it was left as it is (--force replaces it)\n");
  EXPECT_EQ(read_file(o.output), "keep me");
  o.force = true;
  r = run_merge(o);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(tensors_in(o.output).size(), 4u);
}

TEST(MergeWeights, RefusesToReplaceAModelFolderWithoutForce) {
  TempDir tmp;
  write_two_shards(tmp.path() / "ckpt");
  fs::create_directories(tmp.path() / "out");
  write_file(tmp.path() / "out/model.safetensors", "old");
  write_file(tmp.path() / "out/model-00001-of-00009.safetensors", "stale");
  write_file(tmp.path() / "out/README.md", "mine");
  MergeWeightsOptions o;
  o.input = tmp / "ckpt";
  o.output = tmp / "out";
  o.max_shard_size = 30;
  Outcome r = run_merge(o);
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("--force"), std::string::npos) << r.err;
  EXPECT_EQ(read_file(tmp.path() / "out/model.safetensors"), "old");
  o.force = true;
  r = run_merge(o);
  ASSERT_EQ(r.rc, 0) << r.err;
  // a + b = 22 bytes, c would make 38 > 30: two shards; the old entry point and the stale
  // shard are gone.
  EXPECT_FALSE(fs::exists(tmp.path() / "out/model.safetensors"));
  EXPECT_FALSE(fs::exists(tmp.path() / "out/model-00001-of-00009.safetensors"));
  EXPECT_TRUE(fs::exists(tmp.path() / "out" / kIndex));
  EXPECT_EQ(tensors_in(tmp.path() / "out" / kShard1), named_bytes(kPart1));
  EXPECT_EQ(tensors_in(tmp.path() / "out" / kShard2), named_bytes(kPart2));
  EXPECT_EQ(read_file(tmp.path() / "out/README.md"), "mine");
}

TEST(MergeWeights, RefusesToWriteOverItsInput) {
  TempDir tmp;
  write_file(tmp / "m.safetensors", st_file(kPart1));
  MergeWeightsOptions o;
  o.input = tmp / "m.safetensors";
  o.output = tmp / "m.safetensors";
  o.force = true;
  Outcome r = run_merge(o);
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("is an input file"), std::string::npos) << r.err;
  write_two_shards(tmp.path() / "ckpt");
  o.input = o.output = tmp / "ckpt";
  o.max_shard_size = 8;
  r = run_merge(o);
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("re-sharding would replace"), std::string::npos) << r.err;
  EXPECT_EQ(tensors_in(tmp.path() / "ckpt" / kShard1), named_bytes(kPart1));
}

TEST(MergeWeights, RejectsEachBadInputNamingTheFile) {
  for (const auto& c : bad_cases()) {
    SCOPED_TRACE(c.label);
    TempDir tmp;
    for (const auto& [name, bytes] : c.files) write_file(tmp.path() / name, bytes);
    MergeWeightsOptions o;
    o.input = c.input.empty() ? tmp.path().string() : tmp / c.input;
    o.output = tmp / "out.safetensors";
    Outcome r = run_merge(o);
    EXPECT_EQ(r.rc, 2);
    EXPECT_EQ(r.err.rfind("accel merge-weights: error: ", 0), 0u) << r.err;
    const std::string named = c.named.empty() ? tmp.path().string() : tmp / c.named;
    EXPECT_NE(r.err.find(named + ": "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(c.fragment), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(o.output));
    EXPECT_FALSE(fs::exists(o.output + ".tmp"));
  }
}

TEST(WeightsParseSize, AcceptsHfAndBinaryUnits) {
  EXPECT_EQ(parse_size("1000"), 1000u);
  EXPECT_EQ(parse_size("500MB"), 500'000'000u);
  EXPECT_EQ(parse_size("5GB"), 5'000'000'000u);
  EXPECT_EQ(parse_size("64kb"), 64'000u);
  EXPECT_EQ(parse_size("2GiB"), 2ULL << 30);
  EXPECT_EQ(parse_size("10MiB"), 10ULL << 20);
  EXPECT_EQ(parse_size(" 8 KiB "), 8ULL << 10);
  for (const char* bad : {"", "GB", "abc", "5XB", "1000B", "0", "0GB", "-1", "1.5GB", "5 G B",
                          "18446744073709551616", "20000000000GB"}) {
    EXPECT_EQ(parse_size(bad), std::nullopt) << bad;
  }
}

}  // namespace
}  // namespace accel::launcher

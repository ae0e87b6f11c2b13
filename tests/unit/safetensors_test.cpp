// The safetensors codec and HF's sharded layout: bitwise round trips, one test per malformed file
// decode() must reject, parse_size, save_sharded's files, and an independent Python reader.
#include "runtime/safetensors.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "accel/error.h"
#include "runtime/checkpoint_io.h"
#include "tests/common/files.h"
#include "tests/common/paths.h"

namespace accel::safetensors {
namespace {

namespace fs = std::filesystem;

const std::string kWhere = "/x/model.safetensors";

using accel::testing::TempDir;

std::string file_bytes(const Encoded& e) {
  std::string out;
  for (auto part : e.parts()) out += part;
  return out;
}

std::string raw_bytes(const torch::Tensor& t) {
  torch::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.nbytes());
}

std::string read(const fs::path& path) { return ckpt::checkpoint_fs().read_file(path); }

// A file with `json` as its header, unpadded, followed by `data_size` zero bytes.
std::string raw_file(const std::string& json, std::size_t data_size) {
  std::string out(8, '\0');
  for (std::size_t i = 0; i < 8; ++i) out[i] = static_cast<char>((json.size() >> (8 * i)) & 0xff);
  return out + json + std::string(data_size, '\0');
}

::testing::AssertionResult rejects(std::string_view bytes, const std::string& fragment) {
  try {
    decode(bytes, kWhere);
  } catch (const CheckpointError& e) {
    std::string what = e.what();
    if (what.rfind(kWhere + ": ", 0) == 0 && what.find(fragment) != std::string::npos)
      return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "message: " << what << "\nwanted: " << fragment;
  }
  return ::testing::AssertionFailure() << "decode accepted the file";
}

template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

void expect_same(const NamedTensors& got, const NamedTensors& want) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    SCOPED_TRACE(want[i].first);
    EXPECT_EQ(got[i].first, want[i].first);
    EXPECT_EQ(got[i].second.scalar_type(), want[i].second.scalar_type());
    EXPECT_EQ(got[i].second.sizes(), want[i].second.sizes());
    EXPECT_EQ(raw_bytes(got[i].second), raw_bytes(want[i].second));
  }
}

torch::Tensor sample(torch::Dtype dtype, const std::vector<int64_t>& shape) {
  if (dtype == torch::kBool) return torch::randint(0, 2, shape).to(dtype);
  if (dtype == torch::kByte) return torch::randint(0, 256, shape).to(dtype);
  if (torch::isIntegralType(dtype, false)) return torch::randint(-100, 100, shape).to(dtype);
  return torch::randn(shape).to(dtype);
}

// Every dtype: a matrix (with NaN/inf/-0 or extreme values), a 0-dim scalar, a zero-element
// tensor and two non-contiguous views.
TEST(Safetensors, RoundTripsEveryDtypeBitwise) {
  const std::vector<torch::Dtype> dtypes = {
      torch::kDouble, torch::kFloat, torch::kHalf, torch::kBFloat16, torch::kLong,
      torch::kInt,    torch::kShort, torch::kChar, torch::kByte,     torch::kBool};
  NamedTensors in;
  for (auto dtype : dtypes) {
    std::string d = c10::toString(dtype);
    torch::Tensor m = sample(dtype, {3, 5});
    if (torch::isFloatingType(dtype)) {
      m[0][0] = std::numeric_limits<double>::quiet_NaN();
      m[0][1] = -std::numeric_limits<double>::infinity();
      m[0][2] = -0.0;
    } else if (dtype == torch::kLong) {
      m[0][0] = std::numeric_limits<int64_t>::min();
      m[0][1] = std::numeric_limits<int64_t>::max();
    }
    in.emplace_back(d + ".matrix", m);
    in.emplace_back(d + ".scalar", sample(dtype, {}));
    in.emplace_back(d + ".empty", sample(dtype, {0, 4}));
    in.emplace_back(d + ".transposed", m.t());
    in.emplace_back(d + ".strided", sample(dtype, {4, 6}).slice(1, 1, 6, 2));
  }
  ASSERT_FALSE(in[3].second.is_contiguous());
  Decoded out = decode(file_bytes(encode(in)), kWhere);
  expect_same(out.tensors, in);
  EXPECT_TRUE(out.metadata.empty());
  for (const auto& [name, t] : out.tensors) EXPECT_TRUE(t.is_contiguous()) << name;
}

// Found by fuzz/fuzz_safetensors: a header number out of double's range made nlohmann throw
// out_of_range, which escaped decode as another exception than CheckpointError (a damaged file
// must always be a CheckpointError naming it).
TEST(Safetensors, AnOutOfRangeNumberInTheHeaderIsACheckpointError) {
  std::string header = R"({"a": {"dtype": "F32", "shape": [1e999], "data_offsets": [0, 4]}})";
  std::string file(8, '\0');
  uint64_t n = header.size();
  std::memcpy(file.data(), &n, 8);
  file += header + std::string(4, '\0');
  try {
    decode(file, "x.safetensors");
    FAIL() << "decoded a header with 1e999";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("x.safetensors"), std::string::npos) << e.what();
  }
}

TEST(Safetensors, DecodedTensorsOwnTheirMemory) {
  NamedTensors in = {{"w", torch::arange(6, torch::kFloat)}};
  std::string bytes = file_bytes(encode(in));
  Decoded out = decode(bytes, kWhere);
  std::fill(bytes.begin(), bytes.end(), '\xff');
  bytes.clear();
  bytes.shrink_to_fit();
  EXPECT_TRUE(torch::equal(out.tensors[0].second, torch::arange(6, torch::kFloat)));
}

TEST(Safetensors, KeepsTheGivenOrder) {
  NamedTensors in = {{"z", torch::ones({2})}, {"a", torch::zeros({3})}, {"m", torch::ones({1})}};
  Encoded e = encode(in);
  EXPECT_LT(e.header.find("\"z\""), e.header.find("\"a\""));
  EXPECT_LT(e.header.find("\"a\""), e.header.find("\"m\""));
  EXPECT_NE(e.header.find("\"data_offsets\":[8,20]"), std::string::npos) << e.header;
  expect_same(decode(file_bytes(e), kWhere).tensors, in);
}

TEST(Safetensors, MetadataRoundTrips) {
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "ünïcode \"quoted\""}};
  Decoded out = decode(file_bytes(encode({{"w", torch::ones({2})}}, meta)), kWhere);
  EXPECT_EQ(out.metadata, meta);
}

TEST(Safetensors, HeaderIsPaddedWithSpacesToEightBytes) {
  for (std::size_t len = 1; len <= 9; ++len) {
    Encoded e = encode({{std::string(len, 'n'), torch::ones({1})}});
    SCOPED_TRACE(e.header);
    ASSERT_EQ(e.header.size() % 8, 0u);
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(e.header[i]);
    EXPECT_EQ(n, e.header.size() - 8);
    std::size_t brace = e.header.rfind('}');
    EXPECT_EQ(e.header.find_first_not_of(' ', brace + 1), std::string::npos);
    EXPECT_LT(e.header.size() - brace - 1, 8u);
    EXPECT_EQ(e.size(), e.header.size() + 4);
  }
}

// encode_header with a data alignment (what a background save's files use): the same header
// JSON as encode()'s, padded with spaces so the tensors start on a 4096-byte boundary, and a file
// made of it decodes as one made by encode(). Any other alignment than a multiple of 8 is refused.
TEST(Safetensors, TheHeaderCanBePaddedSoTheDataStartsOnAPage) {
  NamedTensors tensors{{"a", torch::arange(5, torch::kFloat)},
                       {"b", torch::ones({2, 3}, torch::kBFloat16)}};
  for (std::size_t names : {std::size_t{1}, std::size_t{300}}) {  // under a page; over one
    SCOPED_TRACE(std::to_string(names) + " extra tensors");
    NamedTensors all = tensors;
    for (std::size_t i = 0; i < names; ++i)
      all.emplace_back("extra." + std::to_string(i), torch::zeros({1}));
    const std::string header = encode_header(all, {{"format", "pt"}}, kWhere, 4096);
    EXPECT_EQ(header.size() % 4096, 0u);
    Encoded plain = encode(all, {{"format", "pt"}}, kWhere);
    std::size_t brace = header.rfind('}');
    EXPECT_EQ(header.substr(8, brace - 7), plain.header.substr(8, plain.header.rfind('}') - 7));
    EXPECT_EQ(header.find_first_not_of(' ', brace + 1), std::string::npos);
    std::string file = header;
    for (const auto& t : plain.data) file += raw_bytes(t);
    Decoded d = decode(file, kWhere);
    ASSERT_EQ(d.tensors.size(), all.size());
    for (std::size_t i = 0; i < all.size(); ++i) {
      EXPECT_EQ(d.tensors[i].first, all[i].first);
      EXPECT_TRUE(torch::equal(d.tensors[i].second, all[i].second));
    }
  }
  for (uint64_t bad : {uint64_t{0}, uint64_t{12}})
    EXPECT_THROW(encode_header(tensors, {}, kWhere, bad), std::invalid_argument);
}

TEST(Safetensors, EncodeRejectsBadNamesAndDtypes) {
  auto one = torch::ones({1});
  EXPECT_NE(error_of([&] { encode({{"", one}}); }).find("empty name"), std::string::npos);
  EXPECT_NE(error_of([&] { encode({{"__metadata__", one}}); }).find("reserved"), std::string::npos);
  EXPECT_NE(error_of([&] {
              encode({{"a", one}, {"a", one}});
            }).find("tensor \"a\": name appears twice"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              encode({{"c", torch::ones({1}, torch::kComplexFloat)}});
            }).find("tensor \"c\": dtype ComplexFloat has no safetensors name"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              encode({{"u", torch::Tensor()}});
            }).find("tensor \"u\": tensor is undefined"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              encode({{"x", one}}, {{"bad", "\xff"}});
            }).find("a metadata string is not valid UTF-8"),
            std::string::npos);
}

std::string two_floats() {
  return file_bytes(encode({{"a", torch::ones({2})}, {"b", torch::ones({2})}}));
}

TEST(SafetensorsDecode, RejectsFewerThanEightBytes) {
  EXPECT_TRUE(rejects("abc", "file is 3 bytes, too short for the 8-byte header length"));
  EXPECT_TRUE(rejects("", "file is 0 bytes"));
}

TEST(SafetensorsDecode, RejectsATruncatedFile) {
  std::string bytes = two_floats();
  EXPECT_TRUE(rejects(bytes.substr(0, bytes.size() - 4),
                      "tensor \"b\": data_offsets [8, 16] end past the data section (12 bytes)"));
  EXPECT_TRUE(rejects(bytes.substr(0, 20), "header length " + std::to_string(bytes.size() - 24) +
                                               " runs past the end of the file (20 bytes)"));
}

TEST(SafetensorsDecode, RejectsACorruptHeaderLength) {
  std::string too_long = two_floats();
  too_long[7] = '\x7f';
  EXPECT_TRUE(rejects(too_long, "runs past the end of the file"));
  std::string too_short = two_floats();
  too_short[0] = static_cast<char>(too_short[0] - 16);
  EXPECT_TRUE(rejects(too_short, "header is not valid JSON"));
}

TEST(SafetensorsDecode, RejectsBadJson) {
  EXPECT_TRUE(rejects(raw_file("{\"a\": ", 0), "header is not valid JSON: "));
  // 100,000 levels (a 200 KB header): refused before parsing, not a stack overflow.
  const std::string deep = "{\"t\":" + std::string(100000, '[') + std::string(100000, ']') + "}";
  EXPECT_TRUE(rejects(raw_file(deep, 0),
                      "header nests arrays and objects more than 64 levels deep; not a "
                      "safetensors file"));
  EXPECT_TRUE(rejects(raw_file("[1, 2]", 0), "header is not a JSON object but array"));
  EXPECT_TRUE(rejects(raw_file("{\"a\": 1}", 0), "tensor \"a\": entry must be an object"));
  EXPECT_TRUE(rejects(raw_file(R"({"__metadata__": {"k": 1}})", 0),
                      "\"__metadata__\" must map strings to strings"));
}

TEST(SafetensorsDecode, RejectsAnUnknownDtype) {
  EXPECT_TRUE(
      rejects(raw_file(R"({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}})", 8),
              "tensor \"w\": unknown dtype \"C64\" (accel reads F64, F32,"));
  EXPECT_TRUE(rejects(raw_file(R"({"w": {"dtype": 3, "shape": [1], "data_offsets": [0, 8]}})", 8),
                      "tensor \"w\": unknown dtype 3"));
}

TEST(SafetensorsDecode, RejectsOffsetsThatDoNotMatchTheShape) {
  EXPECT_TRUE(rejects(
      raw_file(R"({"fc1.weight": {"dtype": "F32", "shape": [2,3], "data_offsets": [0, 12]}})", 12),
      "tensor \"fc1.weight\": data_offsets [0, 12] hold 12 bytes but shape [2,3] of F32 needs 24"));
  EXPECT_TRUE(
      rejects(raw_file(R"({"s": {"dtype": "I64", "shape": [], "data_offsets": [0, 4]}})", 4),
              "data_offsets [0, 4] hold 4 bytes but shape [] of I64 needs 8"));
  EXPECT_TRUE(
      rejects(raw_file(R"({"s": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4),
              "tensor \"s\": shape must be a list of non-negative integers, not [-1]"));
  EXPECT_TRUE(
      rejects(raw_file(R"({"s": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}})", 4),
              "tensor \"s\": data_offsets must be [begin, end] with 0 <= begin <= end"));
  EXPECT_TRUE(rejects(
      raw_file(
          R"({"s": {"dtype": "U8", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})",
          0),
      "needs more than 2^64"));
}

TEST(SafetensorsDecode, RejectsOffsetsPastTheData) {
  EXPECT_TRUE(
      rejects(raw_file(R"({"w": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}})", 16),
              "tensor \"w\": data_offsets [0, 24] end past the data section (16 bytes)"));
}

TEST(SafetensorsDecode, RejectsOverlappingTensors) {
  EXPECT_TRUE(rejects(raw_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                   "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                               12),
                      "tensor \"b\": data_offsets [4, 12] overlap tensor \"a\" [0, 8]"));
}

TEST(SafetensorsDecode, RejectsAGapBetweenTensors) {
  EXPECT_TRUE(rejects(
      raw_file(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                                   "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})",
               12),
      "tensor \"b\": data_offsets [8, 12] leave bytes [4, 8] of the data section to no tensor"));
}

TEST(SafetensorsDecode, RejectsTrailingBytes) {
  EXPECT_TRUE(rejects(two_floats() + "xyz",
                      "3 bytes after the last tensor (the tensors cover 16 of the 19 data bytes)"));
  EXPECT_TRUE(rejects(raw_file("{}", 2), "2 bytes after the last tensor"));
}

TEST(SafetensorsDecode, RejectsBoolBytesOtherThanZeroOrOne) {
  std::string bytes = file_bytes(encode({{"mask", torch::ones({3}, torch::kBool)}}));
  bytes.back() = 2;
  EXPECT_TRUE(rejects(bytes, "tensor \"mask\": BOOL data holds a byte other than 0 or 1"));
}

TEST(SafetensorsDecode, ReturnsTensorsInOffsetOrderAndAcceptsAnEmptyFile) {
  Decoded d = decode(raw_file(R"({"b": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]},
                                  "z": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]},
                                  "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}})",
                              2),
                     kWhere);
  ASSERT_EQ(d.tensors.size(), 3u);
  EXPECT_EQ(d.tensors[0].first, "z");
  EXPECT_EQ(d.tensors[1].first, "a");
  EXPECT_EQ(d.tensors[2].first, "b");
  EXPECT_TRUE(decode(file_bytes(encode({})), kWhere).tensors.empty());
}

TEST(SafetensorsParseSize, AcceptsHfUnits) {
  const std::vector<std::pair<std::string, uint64_t>> table = {
      {"1", 1},
      {"123", 123},
      {"10GB", 10000000000ULL},
      {"10gb", 10000000000ULL},
      {"5MB", 5000000},
      {"1kB", 1000},
      {"10GiB", 10ULL << 30},
      {"3mib", 3ULL << 20},
      {"2KiB", 2048},
      {" 10 GB ", 10000000000ULL},
      {"18446744073709551615", std::numeric_limits<uint64_t>::max()},
  };
  for (const auto& [text, want] : table) EXPECT_EQ(parse_size(text), want) << text;
}

TEST(SafetensorsParseSize, RejectsAnythingElse) {
  for (std::string text : {"", "GB", "0", "0GB", "-1", "1.5GB", "10TB", "10B", "abc", "1e9",
                           "10 G B", "18446744073709551616", "17179869184GiB"}) {
    std::string what = error_of([&] { parse_size(text); });
    EXPECT_NE(what.find("size \"" + text + "\""), std::string::npos) << what;
    EXPECT_THROW(parse_size(text), ConfigError) << text;
  }
}

std::set<std::string> files_in(const fs::path& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

NamedTensors floats(const std::vector<std::pair<std::string, int64_t>>& sizes) {
  NamedTensors out;
  float start = 0;
  for (const auto& [name, n] : sizes) {
    out.emplace_back(name, torch::arange(start, start + static_cast<float>(n)));
    start += static_cast<float>(n);
  }
  return out;
}

TEST(SafetensorsSaveSharded, OneFileWhenEverythingFits) {
  TempDir tmp;
  fs::path dir = tmp.path() / "out";
  NamedTensors in = floats({{"a", 10}, {"b", 15}});
  EXPECT_EQ(save_sharded(in, dir, 100), std::vector<std::string>{"model.safetensors"});
  EXPECT_EQ(files_in(dir), std::set<std::string>{"model.safetensors"});
  Decoded d = decode(read(dir / "model.safetensors"), "model.safetensors");
  expect_same(d.tensors, in);
  EXPECT_EQ(d.metadata, (std::map<std::string, std::string>{{"format", "pt"}}));
}

// Checks dir holds `shards` (tensor names per file, in order) and a matching index.
void expect_shards(const fs::path& dir, const NamedTensors& in,
                   const std::vector<std::vector<std::string>>& shards) {
  const std::size_t n = shards.size();
  auto name = [&](std::size_t k) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", k + 1, n);
    return std::string(buf);
  };
  nlohmann::json index = nlohmann::json::parse(read(dir / "model.safetensors.index.json"));
  uint64_t total = 0;
  std::size_t next = 0;
  for (std::size_t k = 0; k < n; ++k) {
    Decoded d = decode(read(dir / name(k)), name(k));
    EXPECT_EQ(d.metadata.at("format"), "pt");
    ASSERT_EQ(d.tensors.size(), shards[k].size()) << name(k);
    for (std::size_t i = 0; i < shards[k].size(); ++i, ++next) {
      EXPECT_EQ(d.tensors[i].first, shards[k][i]);
      EXPECT_TRUE(torch::equal(d.tensors[i].second, in[next].second)) << shards[k][i];
      EXPECT_EQ(index["weight_map"][shards[k][i]], name(k));
      total += in[next].second.nbytes();
    }
  }
  EXPECT_EQ(index["weight_map"].size(), in.size());
  EXPECT_EQ(index["metadata"]["total_size"], total);
}

TEST(SafetensorsSaveSharded, SplitsWhenTheNextTensorWouldOverflow) {
  TempDir tmp;
  NamedTensors in = floats({{"a", 10}, {"b", 10}, {"c", 10}, {"d", 5}, {"e", 10}});
  auto written = save_sharded(in, tmp.path(), 100);
  EXPECT_EQ(written, (std::vector<std::string>{"model-00001-of-00002.safetensors",
                                               "model-00002-of-00002.safetensors",
                                               "model.safetensors.index.json"}));
  EXPECT_EQ(files_in(tmp.path()), std::set<std::string>(written.begin(), written.end()));
  expect_shards(tmp.path(), in, {{"a", "b"}, {"c", "d", "e"}});
}

TEST(SafetensorsSaveSharded, ATensorLargerThanTheLimitIsAlone) {
  TempDir tmp;
  NamedTensors in = floats({{"a", 10}, {"b", 10}, {"big", 100}, {"c", 10}, {"d", 10}});
  EXPECT_EQ(save_sharded(in, tmp.path(), 100).size(), 4u);
  expect_shards(tmp.path(), in, {{"a", "b"}, {"big"}, {"c", "d"}});
}

TEST(SafetensorsSaveSharded, RemovesStaleFilesOfAnEarlierSave) {
  TempDir tmp;
  const fs::path& dir = tmp.path();
  for (std::string keep : {"optimizer.bin", "model-extra.safetensors", "other.safetensors",
                           "other-00001-of-00002.safetensors"})
    std::ofstream(dir / keep) << "x";
  const std::set<std::string> others = files_in(dir);
  auto with = [&](std::set<std::string> files) {
    files.insert(others.begin(), others.end());
    return files;
  };
  std::ofstream(dir / "model-00002-of-00009.safetensors.tmp") << "crashed save";

  save_sharded(floats({{"a", 10}, {"b", 10}, {"c", 10}}), dir, 40);
  EXPECT_EQ(files_in(dir),
            with({"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                  "model-00003-of-00003.safetensors", "model.safetensors.index.json"}));
  NamedTensors two = floats({{"a", 10}, {"b", 10}, {"c", 5}});
  save_sharded(two, dir, 80);
  EXPECT_EQ(files_in(dir),
            with({"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                  "model.safetensors.index.json"}));
  expect_shards(dir, two, {{"a", "b"}, {"c"}});
  save_sharded(two, dir, 1000);
  EXPECT_EQ(files_in(dir), with({"model.safetensors"}));
  save_sharded(two, dir, 80);
  EXPECT_EQ(files_in(dir),
            with({"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                  "model.safetensors.index.json"}));
}

TEST(SafetensorsSaveSharded, RejectsBadArgumentsBeforeWritingAnything) {
  TempDir tmp;
  fs::path dir = tmp.path() / "out";
  EXPECT_THROW(save_sharded(floats({{"a", 1}}), dir, 0), ConfigError);
  EXPECT_THROW(save_sharded(floats({{"a", 1}}), dir, 100, ""), ConfigError);
  NamedTensors bad_name = {{"a\xff", torch::ones({1})}};
  EXPECT_NE(error_of([&] { save_sharded(bad_name, dir, 100); }).find("is not valid UTF-8"),
            std::string::npos);
  NamedTensors dup = floats({{"a", 1}, {"a", 1}});
  EXPECT_NE(
      error_of([&] { save_sharded(dup, dir, 100); }).find(dir.string() + "/model: tensor \"a\""),
      std::string::npos);
  EXPECT_FALSE(fs::exists(dir));
}

// Records the seam's calls and fails the write of `fail_on` when set.
class RecordingFs : public ckpt::CheckpointFs {
 public:
  std::vector<std::string> calls;
  std::string fail_on;
  ckpt::WrittenFile write_stream(const fs::path& path,
                                 const std::function<void(const ckpt::Sink&)>& produce) override {
    calls.push_back("write " + path.filename().string());
    if (path.filename() == fail_on) {
      CheckpointFs::write_stream(path, [](const ckpt::Sink& sink) { sink("half"); });
      throw CheckpointError("injected failure");
    }
    return CheckpointFs::write_stream(path, produce);
  }
  void rename(const fs::path& from, const fs::path& to) override {
    calls.push_back("rename " + from.filename().string() + " " + to.filename().string());
    CheckpointFs::rename(from, to);
  }
  void sync_dir(const fs::path& dir) override {
    calls.push_back("sync_dir");
    CheckpointFs::sync_dir(dir);
  }
};

struct SeamGuard {
  explicit SeamGuard(ckpt::CheckpointFs* fs) { ckpt::set_checkpoint_fs_for_testing(fs); }
  ~SeamGuard() { ckpt::set_checkpoint_fs_for_testing(nullptr); }
};

// Every file is written (and fsynced) under its temp name before any is renamed; the index is
// renamed last, after the old entry points are gone (synced), and the folder is synced at the end.
TEST(SafetensorsSaveSharded, WritesEveryTempFileThenRenamesTheIndexLastThenSyncsTheFolder) {
  TempDir tmp;
  RecordingFs rec;
  SeamGuard guard(&rec);
  save_sharded(floats({{"a", 10}, {"b", 10}}), tmp.path(), 40);
  EXPECT_EQ(
      rec.calls,
      (std::vector<std::string>{
          "write model-00001-of-00002.safetensors.tmp",
          "write model-00002-of-00002.safetensors.tmp", "write model.safetensors.index.json.tmp",
          "sync_dir",
          "rename model-00001-of-00002.safetensors.tmp model-00001-of-00002.safetensors",
          "rename model-00002-of-00002.safetensors.tmp model-00002-of-00002.safetensors",
          "rename model.safetensors.index.json.tmp model.safetensors.index.json", "sync_dir"}));
}

// A reader must never find the old single file beside the new index: the stale file goes first.
TEST(SafetensorsSaveSharded, AStaleSingleFileIsGoneBeforeTheIndexAppears) {
  TempDir tmp;
  save_sharded(floats({{"a", 10}, {"b", 10}}), tmp.path(), 1000);
  ASSERT_TRUE(fs::exists(tmp.path() / "model.safetensors"));
  struct OrderFs : ckpt::CheckpointFs {
    std::vector<std::string> calls;
    void remove_all(const fs::path& path) override {
      calls.push_back("remove " + path.filename().string());
      CheckpointFs::remove_all(path);
    }
    void rename(const fs::path& from, const fs::path& to) override {
      calls.push_back("rename " + to.filename().string());
      CheckpointFs::rename(from, to);
    }
  } order;
  SeamGuard guard(&order);
  save_sharded(floats({{"a", 10}, {"b", 10}}), tmp.path(), 40);
  auto at = [&](const std::string& call) {
    return std::find(order.calls.begin(), order.calls.end(), call) - order.calls.begin();
  };
  ASSERT_LT(at("remove model.safetensors"), static_cast<std::ptrdiff_t>(order.calls.size()))
      << ::testing::PrintToString(order.calls);
  EXPECT_LT(at("remove model.safetensors"), at("rename model.safetensors.index.json"))
      << ::testing::PrintToString(order.calls);
}

TEST(SafetensorsSaveSharded, AFailedWriteLeavesNoTempFile) {
  TempDir tmp;
  RecordingFs rec;
  rec.fail_on = "model-00002-of-00002.safetensors.tmp";
  SeamGuard guard(&rec);
  EXPECT_THROW(save_sharded(floats({{"a", 10}, {"b", 10}}), tmp.path(), 40), CheckpointError);
  EXPECT_EQ(files_in(tmp.path()), std::set<std::string>{})
      << "nothing is renamed before every file is written";
}

// Runs `command`, returning its exit status and its output (stdout and stderr).
std::pair<int, std::string> run(const std::string& command) {
  FILE* p = ::popen((command + " 2>&1").c_str(), "r");
  if (!p) return {-1, "popen failed"};
  std::string out;
  char buf[4096];
  while (std::size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  int status = ::pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

// The same formulas as expected_model() in read_safetensors.py.
NamedTensors python_model() {
  return {
      {"embed.weight", torch::arange(24, torch::kFloat).reshape({4, 6}) * 0.5 - 3},
      {"layer.0.weight",
       (torch::arange(16, torch::kFloat) * 0.25 - 2).reshape({2, 8}).to(torch::kBFloat16)},
      {"layer.0.bias", torch::arange(6, torch::kFloat) / 4},
      {"step", torch::tensor(int64_t{1} << 40)},
      {"layer.1.index", torch::arange(12, torch::kLong).reshape({3, 4}) * 1000000007 - 5},
      {"empty", torch::zeros({0, 3})},
  };
}

TEST(SafetensorsPython, AnIndependentReaderAgrees) {
  const std::string python = "/usr/bin/python3";
  if (!fs::exists(python)) GTEST_SKIP() << python << " is not installed";
  TempDir tmp;
  ASSERT_EQ(save_sharded(python_model(), tmp.path(), 64).size(), 5u);
  const std::string script =
      std::string(ACCEL_SOURCE_DIR) + "/tests/integration/workers/read_safetensors.py";
  auto [status, out] = run(python + " " + script + " " + tmp.path().string() + " --check");
  EXPECT_EQ(status, 0) << out;
  EXPECT_NE(out.find("checked 6 tensors in 4 files: OK"), std::string::npos) << out;

  // The same model in one file whose header is padded so its data starts on a page, as a
  // background save writes it.
  TempDir one;
  std::vector<std::string> bytes{encode_header(python_model(), {{"format", "pt"}}, kWhere, 4096)};
  for (const auto& [name, t] : python_model()) bytes.push_back(raw_bytes(t));
  ckpt::checkpoint_fs().write_file(one.path() / "model.safetensors",
                                   std::vector<std::string_view>(bytes.begin(), bytes.end()));
  std::tie(status, out) =
      run(python + " " + script + " " + (one.path() / "model.safetensors").string() + " --json");
  ASSERT_EQ(status, 0) << out;
  auto read = nlohmann::json::parse(out);
  EXPECT_EQ(read["metadata"]["format"], "pt");
  ASSERT_EQ(read["tensors"].size(), python_model().size()) << out;
  for (const auto& [name, t] : python_model()) {
    auto flat = t.to(torch::kDouble).flatten();
    std::vector<double> expected(flat.data_ptr<double>(), flat.data_ptr<double>() + flat.numel());
    EXPECT_EQ(read["tensors"][name].get<std::vector<double>>(), expected) << name;
  }

  torch::Tensor wrong = torch::arange(6, torch::kFloat) / 4;
  wrong[5] = 0;
  NamedTensors model = python_model();
  model[2].second = wrong;
  save_sharded(model, tmp.path(), 64);
  std::tie(status, out) = run(python + " " + script + " " + tmp.path().string() + " --check");
  EXPECT_EQ(status, 1) << out;
  EXPECT_NE(out.find("MISMATCH layer.0.bias: values"), std::string::npos) << out;
}

}  // namespace
}  // namespace accel::safetensors

// Models on their own: save_model's sharding, load_model, get_state_dict,
// set_seed, the state pre-hooks, and the checkpoint writer's exact sizes and errors.
#include "tests/unit/checkpoint_fixtures.h"

namespace accel {
namespace {

using namespace ckpt_testing;  // the shared fixtures

// --- save_model -----------------------------------------------------------------------------

TEST(CheckpointSaveModel, OneFileUnderTheLimitShardsWithAnIndexOverIt) {
  TempDir tmp;
  Accelerator acc;
  torch::manual_seed(0);
  // 16x16 float weights are 1024 bytes each: with "1KB" (1000 bytes) every layer gets a shard.
  auto model = torch::nn::Sequential(torch::nn::Linear(16, 16), torch::nn::ReLU(),
                                     torch::nn::Linear(16, 16), torch::nn::Linear(16, 4));
  auto params = model->named_parameters();
  uint64_t total = 0;
  for (const auto& p : params) total += p.value().nbytes();

  auto single = tmp.path() / "single";
  acc.save_model(model.ptr(), single);
  EXPECT_TRUE(fs::exists(single / "model.safetensors"));
  EXPECT_FALSE(fs::exists(single / "model.safetensors.index.json"));
  auto all = decoded(single / "model.safetensors");
  EXPECT_EQ(all.size(), params.size());
  for (const auto& p : params) {
    ASSERT_TRUE(all.count(p.key())) << p.key();
    EXPECT_TRUE(torch::equal(all.at(p.key()), p.value())) << p.key();
  }

  auto sharded = tmp.path() / "sharded";
  acc.save_model(model.ptr(), sharded, {.max_shard_size = "1KB"});
  EXPECT_FALSE(fs::exists(sharded / "model.safetensors"));
  auto index = json::parse(read_file(sharded / "model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);
  const auto& weight_map = index["weight_map"];
  EXPECT_EQ(weight_map.size(), params.size());
  std::set<std::string> files;
  for (const auto& p : params) {
    ASSERT_TRUE(weight_map.contains(p.key())) << p.key() << " is not in the index";
    auto file = weight_map[p.key()].get<std::string>();
    files.insert(file);
    auto shard = decoded(sharded / file);
    ASSERT_TRUE(shard.count(p.key())) << p.key() << " is not in " << file;
    EXPECT_TRUE(torch::equal(shard.at(p.key()), p.value())) << p.key();
  }
  EXPECT_GE(files.size(), 3u);
  for (const auto& file : files) {
    EXPECT_LE(fs::file_size(sharded / file), 1000u + 1024u + 512u)
        << file << ": a shard holds one big tensor at most";
  }
}

// --- load_model, get_state_dict, set_seed, state pre-hooks ---------------------------------

torch::nn::Sequential small_model(int seed, int64_t hidden = 16) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(16, hidden), torch::nn::ReLU(),
                               torch::nn::Linear(hidden, 16), torch::nn::BatchNorm1d(16),
                               torch::nn::Linear(16, 4));
}

std::vector<torch::Tensor> state_tensors(const Accelerator& acc, const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& [name, t] : acc.get_state_dict(m)) out.push_back(t.detach().clone());
  return out;
}

// A model saved by save_model (one file, and sharded under an index) loads back bitwise into a
// fresh model, buffers included.
TEST(LoadModel, ASaveModelFolderLoadsBackBitwiseOneFileOrSharded) {
  TempDir tmp;
  Accelerator acc;
  auto trained = small_model(1);
  trained->forward(torch::randn({8, 16}));  // BatchNorm's running stats move: buffers differ
  auto want = state_tensors(acc, *trained);
  ASSERT_EQ(acc.get_state_dict(*trained).size(),
            trained->named_parameters().size() + trained->named_buffers().size());
  acc.save_model(trained.ptr(), tmp.path() / "one");
  acc.save_model(trained.ptr(), tmp.path() / "sharded", {.max_shard_size = "1KB"});
  ASSERT_TRUE(fs::exists(tmp.path() / "sharded" / "model.safetensors.index.json"));
  for (const auto& path :
       {tmp.path() / "one", tmp.path() / "sharded", tmp.path() / "one" / "model.safetensors"}) {
    SCOPED_TRACE(path.string());
    auto fresh = small_model(2);
    ASSERT_FALSE(torch::equal(state_tensors(acc, *fresh)[0], want[0]));
    auto keys = load_model(fresh.ptr(), path);
    EXPECT_TRUE(keys.missing.empty());
    EXPECT_TRUE(keys.unexpected.empty());
    expect_bitwise(want, state_tensors(acc, *fresh), "loaded");
  }
}

// strict names every missing and unexpected key and loads nothing; not strict loads the names
// that match and returns the others (HF's load_checkpoint_in_model).
TEST(LoadModel, StrictNamesMissingAndUnexpectedKeysNotStrictLoadsTheRest) {
  TempDir tmp;
  Accelerator acc;
  torch::manual_seed(3);
  auto saved = torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::Linear(4, 2));
  acc.save_model(saved.ptr(), tmp.path() / "m");
  torch::manual_seed(4);
  auto other = torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::Linear(4, 2),
                                     torch::nn::Linear(2, 2));
  auto before = state_tensors(acc, *other);
  try {
    load_model(other.ptr(), tmp.path() / "m");
    ADD_FAILURE() << "a missing key loaded in strict mode";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("missing keys (in the model only): 2.weight, 2.bias"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("Nothing was loaded"), std::string::npos) << e.what();
  }
  expect_bitwise(before, state_tensors(acc, *other), "after a refused strict load");
  auto keys = load_checkpoint_in_model(other.ptr(), tmp.path() / "m");
  EXPECT_EQ(keys.missing, (std::vector<std::string>{"2.weight", "2.bias"}));
  EXPECT_TRUE(keys.unexpected.empty());
  EXPECT_TRUE(torch::equal(other[0]->as<torch::nn::Linear>()->weight,
                           saved[0]->as<torch::nn::Linear>()->weight));
  EXPECT_TRUE(torch::equal(other[2]->as<torch::nn::Linear>()->weight, before[4]));

  auto smaller = torch::nn::Sequential(torch::nn::Linear(4, 4));
  try {
    load_model(smaller.ptr(), tmp.path() / "m");
    ADD_FAILURE() << "an unexpected key loaded in strict mode";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("unexpected keys (in the files only): 1.bias, 1.weight"),
              std::string::npos)
        << e.what();
  }
}

// Shapes that differ, a folder without model files, a damaged file: errors that say where, and
// the model is unchanged.
TEST(LoadModel, ShapeMismatchAndDamagedFilesAreErrorsThatChangeNothing) {
  TempDir tmp;
  Accelerator acc;
  acc.save_model(small_model(1, 16).ptr(), tmp.path() / "m");
  auto wider = small_model(2, 32);
  auto before = state_tensors(acc, *wider);
  try {
    load_model(wider.ptr(), tmp.path() / "m", /*strict=*/false);
    ADD_FAILURE() << "a shape mismatch loaded";
  } catch (const CheckpointError& e) {
    EXPECT_NE(
        std::string(e.what()).find("0.weight is [16, 16] in the files, [32, 16] in the model"),
        std::string::npos)
        << e.what();
  }
  expect_bitwise(before, state_tensors(acc, *wider), "after a refused load");

  fs::create_directories(tmp.path() / "empty");
  try {
    load_model(wider.ptr(), tmp.path() / "empty");
    ADD_FAILURE();
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("has neither model.safetensors nor "
                                         "model.safetensors.index.json"),
              std::string::npos)
        << e.what();
  }
  auto bytes = read_file(tmp.path() / "m" / "model.safetensors");
  write_file(tmp.path() / "m" / "model.safetensors", bytes.substr(0, bytes.size() - 5));
  EXPECT_THROW(load_model(small_model(2).ptr(), tmp.path() / "m"), CheckpointError);
}

// set_seed seeds libtorch's generator as manual_seed does, and is the shuffle seed of loaders
// made afterwards without one of their own.
TEST(SetSeed, SeedsLibtorchAndTheDefaultShuffleOfLaterLoaders) {
  set_seed(7);
  auto a = torch::randn({4});
  torch::manual_seed(7);
  EXPECT_TRUE(torch::equal(a, torch::randn({4})));
  ASSERT_EQ(last_seed(), std::optional<uint64_t>(7));

  auto ds = std::make_shared<TensorDataset>(torch::arange(32).unsqueeze(1), torch::arange(32));
  auto order = [](DataLoader& dl) {
    std::vector<int64_t> out;
    for (auto& b : dl)
      for (int64_t i = 0; i < b.target.size(0); ++i) out.push_back(b.target[i].item<int64_t>());
    return out;
  };
  DataLoader implicit(ds, {.batch_size = 4, .shuffle = true});
  DataLoader explicit_seven(ds, {.batch_size = 4, .shuffle = true, .seed = 7});
  DataLoader explicit_zero(ds, {.batch_size = 4, .shuffle = true, .seed = 0});
  EXPECT_EQ(order(implicit), order(explicit_seven));
  EXPECT_NE(order(implicit), order(explicit_zero));
  set_seed(0);
}

// Pre-hooks see the prepared models and the folder, on save_state and load_state; a removed one
// is not called; one that throws stops the save before anything is written.
TEST(StateHooks, SaveAndLoadPreHooksRunFirstAndCanBeRemoved) {
  TempDir tmp;
  Accelerator acc;
  auto model = torch::nn::Linear(3, 1);
  auto opt = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  acc.prepare(model, opt);
  std::vector<std::string> calls;
  auto save = acc.register_save_state_pre_hook(
      [&](const std::vector<torch::nn::Module*>& models, const fs::path& dir) {
        calls.push_back("save " + std::to_string(models.size()) + " " + dir.filename().string());
      });
  acc.register_load_state_pre_hook(
      [&](const std::vector<torch::nn::Module*>& models, const fs::path& dir) {
        EXPECT_EQ(models.at(0), model.ptr().get());
        calls.push_back("load " + dir.filename().string());
      });
  acc.save_state(tmp.path() / "a");
  acc.load_state(tmp.path() / "a");
  save.remove();
  acc.save_state(tmp.path() / "b");
  EXPECT_EQ(calls, (std::vector<std::string>{"save 1 a", "load a"}));
  acc.register_save_state_pre_hook(
      [](const std::vector<torch::nn::Module*>&, const fs::path&) { throw UsageError("not now"); });
  EXPECT_THROW(acc.save_state(tmp.path() / "c"), UsageError);
  EXPECT_FALSE(fs::exists(tmp.path() / "c"));
}

// The folders the write tests write in: one on the disk (O_DIRECT) and, where it can be made, one
// in /dev/shm (tmpfs, which may refuse O_DIRECT: the page-cache path), removed at the end.
struct WriteFolders {
  TempDir tmp;
  fs::path shm = fs::path("/dev/shm") / ("accel-test-" + std::to_string(::getpid()));
  std::vector<fs::path> all{tmp.path()};
  WriteFolders() {
    std::error_code ec;
    if (fs::create_directory(shm, ec)) all.push_back(shm);
  }
  ~WriteFolders() {
    std::error_code ec;
    if (all.size() > 1) fs::remove_all(shm, ec);  // only a folder this test made
  }
};

// write_stream writes large files with O_DIRECT through two aligned buffers and the last partial
// block through the page cache: every size around the block (4 KiB) and buffer (8 MiB) edges,
// fed in parts that do not line up with either, must come back byte for byte, with the checksum
// of what was written. /dev/shm (tmpfs) may refuse O_DIRECT, which takes the page-cache path.
TEST(CheckpointFsWrite, EverySizeAroundTheBlockAndBufferEdgesIsWrittenExactly) {
  WriteFolders folders;
  const std::size_t mib8 = std::size_t{8} << 20;
  std::string all(mib8 * 2 + 5000, '\0');
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<char>((i * 2654435761u) >> 13);
  for (const auto& folder : folders.all) {
    for (std::size_t size : {std::size_t{0}, std::size_t{1}, std::size_t{4095}, std::size_t{4096},
                             std::size_t{4097}, mib8 - 1, mib8, mib8 + 4097, 2 * mib8 + 4999}) {
      SCOPED_TRACE(folder.string() + ", " + std::to_string(size) + " bytes");
      const std::string_view content(all.data(), size);
      auto path = folder / "f.bin";
      auto written = ckpt::CheckpointFs().write_stream(path, [&](const ckpt::Sink& sink) {
        std::size_t at = 0, step = 1;
        while (at < size) {  // parts of 1, 1000003, 1, 1000003, ... bytes
          std::size_t n = std::min(step, size - at);
          sink(content.substr(at, n));
          at += n;
          step = step == 1 ? 1000003 : 1;
        }
      });
      EXPECT_EQ(written.size, size);
      EXPECT_EQ(written.checksum, ckpt::checksum(content));
      EXPECT_EQ(fs::file_size(path), size);
      EXPECT_TRUE(read_file(path) == content) << "the bytes on disk differ";
    }
  }
}

// Bytes that lie in page-aligned memory and fall at a page-aligned place in the file (a
// background save's files, laid out in memory as the file) are written from that memory, not
// copied: sizes around the block and 8 MiB edges, alone, after and before parts that do not line
// up, and two aligned parts in a row, come back byte for byte with the checksum of what was
// written.
TEST(CheckpointFsWrite, PartsInPageAlignedMemoryAreWrittenExactly) {
  WriteFolders folders;
  const std::size_t mib8 = std::size_t{8} << 20, total = 2 * mib8 + 8192;
  void* memory = nullptr;
  ASSERT_EQ(::posix_memalign(&memory, 4096, total), 0);
  std::unique_ptr<char, decltype(&std::free)> owned(static_cast<char*>(memory), &std::free);
  for (std::size_t i = 0; i < total; ++i)
    owned.get()[i] = static_cast<char>((i * 2654435761u) >> 11);
  const std::string_view aligned(owned.get(), total);
  using Parts = std::vector<std::string_view>;
  std::vector<std::pair<std::string, Parts>> cases;
  for (std::size_t size :
       {std::size_t{4096}, std::size_t{4097}, mib8 - 1, mib8, mib8 + 4096, 2 * mib8 + 4999})
    cases.push_back({"alone, " + std::to_string(size), {aligned.substr(0, size)}});
  cases.push_back({"after 3 bytes", {"abc", aligned.substr(0, mib8 + 10)}});
  cases.push_back(
      {"before 3 bytes", {aligned.substr(0, 3 * 4096), "xyz", aligned.substr(0, 5000)}});
  cases.push_back({"two in a row", {aligned.substr(0, 8192), aligned.substr(4096, mib8 + 1)}});
  for (const auto& folder : folders.all) {
    for (const auto& [what, parts] : cases) {
      SCOPED_TRACE(folder.string() + ", " + what);
      std::string expected;
      for (auto part : parts) expected.append(part);
      auto path = folder / "f.bin";
      auto written = ckpt::CheckpointFs().write_file(path, parts);
      EXPECT_EQ(written.size, expected.size());
      EXPECT_EQ(written.checksum, ckpt::checksum(expected));
      EXPECT_TRUE(read_file(path) == expected) << "the bytes on disk differ";
    }
  }
}

// A producer may reuse a part's memory as soon as the sink returns (libtorch's archive does): a
// part written from the producer's memory is on its way to the disk by then. Here each part is
// overwritten right after the sink takes it, and the file holds what was passed, not what came
// after.
TEST(CheckpointFsWrite, APartReusedOnceTheSinkReturnsIsWrittenAsItWasPassed) {
  TempDir tmp;
  // One piece per part: the sink hands it to the writer's thread and returns.
  const std::size_t size = std::size_t{8} << 20;
  void* memory = nullptr;
  ASSERT_EQ(::posix_memalign(&memory, 4096, size), 0);
  std::unique_ptr<char, decltype(&std::free)> owned(static_cast<char*>(memory), &std::free);
  std::string expected;
  auto path = tmp.path() / "reused.bin";
  auto written = ckpt::CheckpointFs().write_stream(path, [&](const ckpt::Sink& sink) {
    for (char fill : {'a', 'b', 'c'}) {
      std::memset(owned.get(), fill, size);
      sink(std::string_view(owned.get(), size));
      expected.append(size, fill);
    }
    std::memset(owned.get(), 'z', size);
    sink("end");
    expected += "end";
  });
  EXPECT_EQ(written.size, expected.size());
  EXPECT_EQ(written.checksum, ckpt::checksum(expected));
  EXPECT_TRUE(read_file(path) == expected)
      << "a part changed after the sink returned reached the disk";
}

// The writer thread's failures reach the caller: a file-size limit just past the first 8 MiB
// buffer makes the second O_DIRECT write short, then refused (EINVAL), then the page-cache retry
// fails with EFBIG: a CheckpointError naming the file and the OS error, with the thread joined.
// A producer that throws while a buffer is being written does not hang either.
TEST(CheckpointFsWrite, AFailedWriteOrProducerIsACheckpointErrorNamingTheFile) {
  TempDir tmp;
  const std::string chunk(std::size_t{1} << 20, 'x');
  auto twenty_mib = [&](const ckpt::Sink& sink) {
    for (int i = 0; i < 20; ++i) sink(chunk);
  };
  {
    struct rlimit old {};
    ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
    auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
    struct rlimit small = old;
    small.rlim_cur = (std::size_t{8} << 20) + 100;
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
    std::string what;
    try {
      ckpt::CheckpointFs().write_stream(tmp.path() / "big.bin", twenty_mib);
    } catch (const CheckpointError& e) {
      what = e.what();
    }
    ::setrlimit(RLIMIT_FSIZE, &old);
    std::signal(SIGXFSZ, old_handler);
    EXPECT_NE(what.find("big.bin"), std::string::npos) << what;
    EXPECT_NE(what.find("File too large"), std::string::npos) << what;
  }
  std::string what;
  try {
    ckpt::CheckpointFs().write_stream(tmp.path() / "half.bin", [&](const ckpt::Sink& sink) {
      for (int i = 0; i < 12; ++i) sink(chunk);  // one buffer handed to the thread, one filling
      throw std::runtime_error("the serializer gave up");
    });
  } catch (const CheckpointError& e) {
    what = e.what();
  }
  EXPECT_NE(what.find("half.bin"), std::string::npos) << what;
  EXPECT_NE(what.find("the serializer gave up"), std::string::npos) << what;
}

}  // namespace
}  // namespace accel

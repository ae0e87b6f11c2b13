// Checkpoints in one process: bitwise save_state/load_state round trips (resuming inside an
// epoch included), the optimizer's safetensors file and the older archive, automatic naming,
// rotation and resume, and the refusal of corrupt or foreign checkpoints.
#include "tests/common/paths.h"
#include "tests/unit/checkpoint_fixtures.h"

namespace accel {
namespace {

using namespace ckpt_testing;  // the shared fixtures

// --- save_state / load_state round trips ----------------------------------------------------

void edit_manifest(const fs::path& dir, const std::function<void(json&)>& edit) {
  auto manifest = json::parse(read_file(dir / "manifest.json"));
  edit(manifest);
  write_file(dir / "manifest.json", manifest.dump(2));
}

TEST(CheckpointRoundTrip, RestoresEverythingBitwiseAndTrainingContinuesIdentically) {
  TempDir tmp;
  Rig original({.init_seed = 1});
  for (int i = 0; i < 5; ++i) original.step();
  auto dir = original.acc.save_state(tmp.path() / "ckpt");
  EXPECT_EQ(dir, tmp.path() / "ckpt");
  auto saved = snapshot(original);
  ASSERT_EQ(saved.exp_avg.size(), 4u) << "AdamW has state for every parameter";
  EXPECT_EQ(saved.loader, (LoaderState{0, 5}));
  EXPECT_EQ(saved.completed_steps, 5);
  auto rand_after_save = torch::rand({8});

  // 2 more batches of epoch 0 (7 batches), then 4 of epoch 1; the scheduler halves every 2 steps.
  constexpr int kMore = 6;
  original.inputs_seen.clear();
  std::vector<double> original_lrs;
  for (int i = 0; i < kMore; ++i) {
    original.step();
    original_lrs.push_back(lr_of(*original.adamw));
  }
  EXPECT_EQ(original.loader().epoch(), 1);

  Rig resumed({.init_seed = 2});
  ASSERT_FALSE(torch::equal(resumed.model->fc1->weight, saved.params[0]))
      << "fresh objects start elsewhere";
  EXPECT_EQ(resumed.acc.load_state(dir), dir);
  expect_same(saved, snapshot(resumed));
  EXPECT_TRUE(torch::equal(torch::rand({8}), rand_after_save))
      << "the RNG does not continue where it was saved";

  std::vector<double> resumed_lrs;
  for (int i = 0; i < kMore; ++i) {
    resumed.step();
    resumed_lrs.push_back(lr_of(*resumed.adamw));
  }
  EXPECT_EQ(resumed_lrs, original_lrs);
  expect_bitwise(original.inputs_seen, resumed.inputs_seen, "batch after resume");
  expect_same(snapshot(original), snapshot(resumed));
}

// libtorch's own optimizers are saved as optimizer.safetensors (a standard file, no CRC-32'd zip);
// a checkpoint written before that keeps an AdamW's state in libtorch's archive, optimizer.bin,
// and still loads, bitwise.
TEST(CheckpointRoundTrip, AnOptimizersStateIsASafetensorsFileAndTheOlderArchiveStillLoads) {
  TempDir tmp;
  Rig original({.init_seed = 1});
  for (int i = 0; i < 4; ++i) original.step();
  auto dir = original.acc.save_state(tmp.path() / "ckpt");
  Snapshot saved = snapshot(original);
  ASSERT_TRUE(fs::exists(dir / "optimizer.safetensors"));
  EXPECT_FALSE(fs::exists(dir / "optimizer.bin"));
  auto decoded = accel::safetensors::decode(read_file(dir / "optimizer.safetensors"), "optimizer");
  EXPECT_EQ(decoded.metadata.at("optimizer"), "AdamW");
  EXPECT_EQ(decoded.tensors.size(), 2 * original.model->parameters().size())
      << "exp_avg and exp_avg_sq of every parameter";

  // The older layout: the same state as libtorch's archive, listed in the manifest instead.
  torch::save(*original.adamw, (dir / "optimizer.bin").string());
  fs::remove(dir / "optimizer.safetensors");
  const std::string archive = read_file(dir / "optimizer.bin");
  edit_manifest(dir, [&](json& m) {
    for (auto& file : m["files"]) {
      if (file["name"] != "optimizer.safetensors") continue;
      file = {{"name", "optimizer.bin"},
              {"size", archive.size()},
              {"xxh64", accel::ckpt::to_hex(accel::ckpt::checksum(archive))}};
    }
  });
  Rig resumed({.init_seed = 2});
  EXPECT_EQ(resumed.acc.load_state(dir), dir);
  expect_same(saved, snapshot(resumed));
}

// Read as a Python user reads it (json + numpy, not accel's decoder): optimizer.safetensors holds
// AdamW's exp_avg and exp_avg_sq of parameter k as "k.exp_avg", "k.exp_avg_sq", the values of
// the live state, with the type and each state's step count in the metadata.
TEST(CheckpointRoundTrip, AnIndependentReaderFindsAdamWsStateInOptimizerSafetensors) {
  const std::string python = "/usr/bin/python3";
  if (!fs::exists(python)) GTEST_SKIP() << python << " is not installed";
  TempDir tmp;
  Rig rig({.init_seed = 1});
  for (int i = 0; i < 4; ++i) rig.step();
  auto dir = rig.acc.save_state(tmp.path() / "ckpt");
  const std::string script =
      std::string(ACCEL_SOURCE_DIR) + "/tests/integration/workers/read_safetensors.py";
  const std::string command =
      python + " " + script + " " + (dir / "optimizer.safetensors").string() + " --json 2>&1";
  std::string out;
  {
    FILE* p = ::popen(command.c_str(), "r");
    ASSERT_NE(p, nullptr);
    char buf[4096];
    while (std::size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
    ASSERT_EQ(::pclose(p), 0) << out;
  }
  const json read = json::parse(out);
  EXPECT_EQ(read["metadata"]["optimizer"], "AdamW");
  const json steps = json::parse(read["metadata"]["steps"].get<std::string>());
  const auto params = rig.adamw->param_groups()[0].params();
  EXPECT_EQ(read["tensors"].size(), 2 * params.size());
  for (std::size_t k = 0; k < params.size(); ++k) {
    SCOPED_TRACE("parameter " + std::to_string(k));
    const auto& state = static_cast<const torch::optim::AdamWParamState&>(
        *rig.adamw->state().at(accel::detail::state_key(params[k])));
    EXPECT_EQ(steps[std::to_string(k)], state.step());
    for (const auto& [field, live] :
         {std::pair{"exp_avg", state.exp_avg()}, std::pair{"exp_avg_sq", state.exp_avg_sq()}}) {
      const auto values =
          read["tensors"][std::to_string(k) + "." + field].get<std::vector<float>>();
      auto flat = live.contiguous().view(-1);
      ASSERT_EQ(values.size(), static_cast<std::size_t>(flat.numel())) << field;
      EXPECT_TRUE(torch::equal(torch::tensor(values), flat)) << field << " differs";
    }
  }
}

// The batches a rig yields next, after `before` training steps, straight or through a checkpoint.
TEST(CheckpointRoundTrip, ResumedLoaderYieldsTheBatchesTheOriginalWouldHaveNext) {
  TempDir tmp;
  for (int before : {0, 1, 4, 6, 7, 8, 13}) {  // 7 = the last batch of epoch 0 was handed out
    SCOPED_TRACE("saved after " + std::to_string(before) + " batches");
    Rig original({.init_seed = 1});
    for (int i = 0; i < before; ++i) original.step();
    auto dir = original.acc.save_state(tmp.path() / ("after_" + std::to_string(before)));
    original.inputs_seen.clear();
    for (int i = 0; i < 9; ++i) original.step();  // crosses at least one epoch boundary

    Rig resumed({.init_seed = 3});
    resumed.acc.load_state(dir);
    EXPECT_EQ(resumed.loader().state(),
              (LoaderState{before / 7, static_cast<uint64_t>(before % 7)}));
    for (int i = 0; i < 9; ++i) resumed.step();
    expect_bitwise(original.inputs_seen, resumed.inputs_seen, "batch");
  }
}

// "Train to max_steps, break, save_state()": the checkpoint resumes at the first batch the loop
// did not take, and so does the loop itself when it goes on; both see what an uninterrupted run
// sees next.
TEST(CheckpointRoundTrip, SaveAfterABreakResumesAtTheNextUnseenBatch) {
  TempDir tmp;
  Rig uninterrupted({.init_seed = 1});
  for (int i = 0; i < 12; ++i) uninterrupted.step();
  const std::vector<torch::Tensor> after_three(uninterrupted.inputs_seen.begin() + 3,
                                               uninterrupted.inputs_seen.end());

  Rig original({.init_seed = 1});
  for (int i = 0; i < 3; ++i) original.step();
  original.break_out();
  EXPECT_EQ(original.loader().state(), (LoaderState{0, 3}));
  auto dir = original.acc.save_state(tmp.path() / "ckpt");
  for (int i = 0; i < 9; ++i) original.step();
  expect_bitwise(uninterrupted.inputs_seen, original.inputs_seen,
                 "batch of the run that broke out and went on");

  Rig resumed({.init_seed = 2});
  resumed.acc.load_state(dir);
  EXPECT_EQ(resumed.loader().state(), (LoaderState{0, 3}));
  for (int i = 0; i < 9; ++i) resumed.step();
  expect_bitwise(after_three, resumed.inputs_seen, "batch after resume");
  expect_same(snapshot(uninterrupted), snapshot(resumed));
}

std::vector<torch::Tensor> one_pass(DataLoader& loader) {
  std::vector<torch::Tensor> out;
  for (auto& batch : loader) out.push_back(batch.input.clone());
  return out;
}

TEST(CheckpointRoundTrip, SkipFirstBatchesYieldsTheRestOfTheSameOrder) {
  DataLoaderOptions options{.batch_size = 3, .shuffle = true, .seed = 7};
  DataLoader reference(fixed_data(), options);
  auto epoch0 = one_pass(reference);
  auto epoch1 = one_pass(reference);
  ASSERT_EQ(epoch0.size(), 7u);
  ASSERT_FALSE(torch::equal(epoch0[0], epoch1[0])) << "epochs are shuffled differently";
  // With prefetch threads too: they must start at the first batch not skipped.
  for (std::size_t workers : {0u, 2u}) {
    for (std::size_t n : {0u, 1u, 4u, 6u, 7u}) {
      SCOPED_TRACE("skip " + std::to_string(n) + ", workers " + std::to_string(workers));
      DataLoaderOptions threaded = options;
      threaded.num_workers = workers;
      auto skipping = DataLoader(fixed_data(), threaded).skip_first_batches(n);
      auto first = one_pass(skipping);
      expect_bitwise(
          std::vector<torch::Tensor>(epoch0.begin() + static_cast<std::ptrdiff_t>(n), epoch0.end()),
          first, "batch");
      expect_bitwise(epoch1, one_pass(skipping), "next-epoch batch");
    }
  }
  Accelerator acc;
  auto prepared = acc.prepare(DataLoader(fixed_data(), options));
  auto skipping = acc.skip_first_batches(prepared, 5);
  expect_bitwise(std::vector<torch::Tensor>(epoch0.begin() + 5, epoch0.end()), one_pass(skipping),
                 "prepared batch");
}

// --- automatic naming, rotation, resume -----------------------------------------------------

// `n` steps of a rig in `project` with no total_limit, each followed by an automatic save
// (checkpoint_0 .. checkpoint_<n-1>); the rig's state after each save.
std::vector<Snapshot> save_automatic_checkpoints(const fs::path& project, int n) {
  Rig rig(project_rig(project, std::nullopt, /*automatic_resume=*/true));
  std::vector<Snapshot> after;
  for (int i = 0; i < n; ++i) {
    rig.step();
    rig.acc.save_state();
    after.push_back(snapshot(rig));
  }
  return after;
}

TEST(CheckpointNaming, AutomaticNamesRotationAndLatest) {
  TempDir tmp;
  auto root = tmp.path() / "checkpoints";
  Rig rig(project_rig(tmp.path(), 2, /*automatic_resume=*/true));
  EXPECT_EQ(rig.acc.latest_checkpoint(), fs::path()) << "nothing saved yet";
  std::vector<fs::path> saved;
  for (int i = 0; i < 3; ++i) {
    rig.step();
    saved.push_back(rig.acc.save_state());
  }
  auto last = snapshot(rig);
  EXPECT_EQ(saved, (std::vector<fs::path>{root / "checkpoint_0", root / "checkpoint_1",
                                          root / "checkpoint_2"}));
  EXPECT_FALSE(fs::exists(root / "checkpoint_0")) << "total_limit 2 keeps the newest two";
  EXPECT_TRUE(fs::exists(root / "checkpoint_1" / "manifest.json"));
  EXPECT_TRUE(fs::exists(root / "checkpoint_2" / "manifest.json"));
  EXPECT_EQ(rig.acc.latest_checkpoint(), root / "checkpoint_2");

  // A crashed save's temp folder (never renamed) and a numbered folder with no manifest.
  fs::create_directories(root / ".checkpoint_5.tmp-123");
  write_file(root / ".checkpoint_5.tmp-123" / "manifest.json",
             read_file(root / "checkpoint_2" / "manifest.json"));
  write_file(root / ".checkpoint_5.tmp-123" / "model.safetensors", "half");
  fs::create_directories(root / "checkpoint_9");
  write_file(root / "checkpoint_9" / "model.safetensors", "half");
  EXPECT_EQ(rig.acc.latest_checkpoint(), root / "checkpoint_2");

  Rig manual(project_rig(tmp.path(), 2, /*automatic_resume=*/false, /*init_seed=*/5));
  EXPECT_EQ(manual.acc.completed_steps(), 0) << "automatic_resume=false must not load";
  EXPECT_EQ(manual.acc.load_state(), root / "checkpoint_2");
  expect_same(last, snapshot(manual));
  fs::remove_all(root / "checkpoint_9");
  EXPECT_EQ(manual.acc.save_state(), root / "checkpoint_3")
      << "the next save follows the loaded one";
  EXPECT_TRUE(fs::exists(root / "checkpoint_2"));
  EXPECT_FALSE(fs::exists(root / "checkpoint_1"));

  // Automatic resume: the first prepare() with a loader loads the newest complete checkpoint.
  Rig automatic(project_rig(tmp.path(), 2, /*automatic_resume=*/true, /*init_seed=*/6));
  expect_same(last, snapshot(automatic));
  EXPECT_EQ(automatic.acc.save_state(), root / "checkpoint_4");
}

// A damaged newest checkpoint must not fail every restart: automatic resume takes the newest
// intact one and says why it skipped the others; with none intact it refuses to start from scratch.
TEST(CheckpointNaming, AutomaticResumeSkipsADamagedNewestCheckpoint) {
  TempDir tmp;
  auto root = tmp.path() / "checkpoints";
  Snapshot at_1 = save_automatic_checkpoints(tmp.path(), 3)[1];
  auto flip = [](const fs::path& file) {
    auto bytes = read_file(file);
    bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x40);
    write_file(file, bytes);
  };
  flip(root / "checkpoint_2" / "optimizer.safetensors");
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  std::optional<Rig> resumed;
  resumed.emplace(
      project_rig(tmp.path(), std::nullopt, /*automatic_resume=*/true, /*init_seed=*/7));
  (void)resumed->loader().epoch();  // training starts: the automatic resume happens here
  auto said = ::testing::internal::GetCapturedStdout() + ::testing::internal::GetCapturedStderr();
  expect_same(at_1, snapshot(*resumed));
  EXPECT_NE(
      said.find("not resuming from " + (root / "checkpoint_2").string() + " because it is damaged"),
      std::string::npos)
      << said;
  EXPECT_NE(said.find((root / "checkpoint_2" / "optimizer.safetensors").string() + " is corrupt"),
            std::string::npos)
      << said;
  EXPECT_NE(said.find("resumed from " + (root / "checkpoint_1").string()), std::string::npos)
      << said;
  EXPECT_EQ(resumed->acc.save_state(), root / "checkpoint_2")
      << "the next save replaces the damaged one";
  EXPECT_NO_THROW(resumed->acc.load_state(root / "checkpoint_2"));
  resumed.reset();

  for (const char* name : {"checkpoint_0", "checkpoint_1", "checkpoint_2"})
    flip(root / name / "model.safetensors");
  ::testing::internal::CaptureStdout();
  expect_checkpoint_error(
      [&] {
        Rig none(project_rig(tmp.path(), std::nullopt, true, 8));
        (void)none.loader().epoch();  // training starts: the automatic resume
      },
      {"none of the 3 checkpoints under " + root.string() + " is intact",
       (root / "checkpoint_2" / "model.safetensors").string() + " is corrupt"});
  ::testing::internal::GetCapturedStdout();
}

TEST(CheckpointNaming, RotationNeverRemovesTheCheckpointJustWritten) {
  TempDir tmp;
  auto root = tmp.path() / "checkpoints";
  fs::create_directories(root / "checkpoint_9");  // an unfinished folder from some other run
  write_file(root / "checkpoint_9" / "model.safetensors", "half");
  Rig rig(project_rig(tmp.path(), 1, /*automatic_resume=*/true));
  rig.step();
  auto saved = rig.acc.save_state();
  EXPECT_EQ(saved, root / "checkpoint_0");
  EXPECT_TRUE(fs::exists(saved / "manifest.json"))
      << "total_limit rotation deleted the checkpoint it had just written "
         "because an incomplete checkpoint_9 counted as newer";
  EXPECT_EQ(rig.acc.latest_checkpoint(), saved);
}

TEST(CheckpointNaming, RotationRemovesAnOlderFolderAKilledRotationHalfDeleted) {
  TempDir tmp;
  auto root = tmp.path() / "checkpoints";
  Rig rig(project_rig(tmp.path(), 2, /*automatic_resume=*/true));
  rig.step();
  rig.acc.save_state();  // checkpoint_0
  // A process killed inside a rotation's remove_all: the manifest is gone, other files remain.
  fs::remove(root / "checkpoint_0" / "manifest.json");
  rig.step();
  rig.acc.save_state();  // checkpoint_1
  EXPECT_FALSE(fs::exists(root / "checkpoint_0"))
      << "a half-deleted older checkpoint stayed forever";
  EXPECT_TRUE(fs::exists(root / "checkpoint_1" / "manifest.json"));
}

// A job killed after a save published its checkpoint but before the rotation (or inside it), that
// then resumes and ends before its next save: the resume enforces total_limit itself.
TEST(CheckpointNaming, AutomaticResumeRemovesCheckpointsAKilledRotationLeftBehind) {
  TempDir tmp;
  auto root = tmp.path() / "checkpoints";
  Snapshot newest = save_automatic_checkpoints(tmp.path(), 4).back();
  fs::remove(root / "checkpoint_0" / "manifest.json");  // killed inside a rotation's remove_all
  Rig resumed(project_rig(tmp.path(), 2, /*automatic_resume=*/true, /*init_seed=*/9));
  (void)resumed.loader().epoch();  // training starts: the automatic resume happens here
  expect_same(newest, snapshot(resumed));
  EXPECT_FALSE(fs::exists(root / "checkpoint_0")) << "the half-removed folder stayed";
  EXPECT_FALSE(fs::exists(root / "checkpoint_1")) << "total_limit 2 keeps the newest two";
  EXPECT_TRUE(fs::exists(root / "checkpoint_2" / "manifest.json"));
  EXPECT_TRUE(fs::exists(root / "checkpoint_3" / "manifest.json"));
}

TEST(CheckpointNaming, SaveStateWithNoFolderNeedsAProject) {
  Rig rig;
  EXPECT_THROW(rig.acc.save_state(), UsageError);
  EXPECT_EQ(rig.acc.latest_checkpoint(), fs::path());
  expect_checkpoint_error([&] { rig.acc.load_state(); }, {"no complete checkpoint"});
}

// --- corrupt and foreign checkpoints --------------------------------------------------------

// A checkpoint of a rig trained 3 steps, in `dir`.
fs::path good_checkpoint(const fs::path& dir, const RigOptions& options = {}) {
  Rig rig(options);
  for (int i = 0; i < 3; ++i) rig.step();
  return rig.acc.save_state(dir);
}

// Loading `dir` into a fresh rig throws a CheckpointError naming every one of `parts`, and leaves
// the rig's model as it was.
void expect_refused(const fs::path& dir, std::initializer_list<std::string> parts) {
  Rig rig({.init_seed = 11});
  auto before = copies(rig.model->parameters());
  expect_checkpoint_error([&] { rig.acc.load_state(dir); }, parts);
  expect_bitwise(before, copies(rig.model->parameters()), "parameter after a refused load");
  EXPECT_EQ(rig.acc.completed_steps(), 0);
}

// A manifest is input like any other: a listed name that leads outside the folder is refused
// before anything is opened, so no foreign file is read, hashed or loaded, even one whose size
// and hash match (here: a copy of the real model file outside the folder).
TEST(CheckpointCorrupt, AManifestNameOutsideTheFolderIsRefusedUnread) {
  TempDir tmp;
  auto dir = good_checkpoint(tmp.path() / "ckpt");
  fs::copy_file(dir / "model.safetensors", tmp.path() / "outside.safetensors");
  for (const std::string& name : std::vector<std::string>{
           "../outside.safetensors", (tmp.path() / "outside.safetensors").string(), "sub/x", "..",
           "."}) {
    SCOPED_TRACE(name);
    auto bad = tmp.path() / "bad";
    fs::remove_all(bad);
    fs::copy(dir, bad);
    edit_manifest(bad, [&](json& m) {
      for (auto& f : m["files"]) {
        if (f["name"] == "model.safetensors") f["name"] = name;
      }
    });
    try {
      Rig rig({.init_seed = 11});
      rig.acc.load_state(bad);
      ADD_FAILURE() << "loaded a checkpoint whose manifest names " << name;
    } catch (const CheckpointError& e) {
      std::string what = e.what();
      EXPECT_NE(what.find((bad / "manifest.json").string()), std::string::npos) << what;
      EXPECT_NE(what.find("plain file names inside its folder"), std::string::npos) << what;
      EXPECT_EQ(what.find("xxh64"), std::string::npos) << "no hash of any file: " << what;
    }
  }
}

// Files are opened without following a symbolic link, and only if they are regular files: a
// link to a copy with the right size and hash is refused, and a FIFO fails at once (it would
// block every rank's open until a writer came).
TEST(CheckpointCorrupt, ASymbolicLinkOrAFifoInTheFolderIsRefused) {
  TempDir tmp;
  auto dir = good_checkpoint(tmp.path() / "ckpt");
  fs::rename(dir / "model.safetensors", tmp.path() / "real.safetensors");
  fs::create_symlink(tmp.path() / "real.safetensors", dir / "model.safetensors");
  expect_refused(dir, {(dir / "model.safetensors").string(), "is a symbolic link"});
  fs::remove(dir / "model.safetensors");
  ASSERT_EQ(::mkfifo((dir / "model.safetensors").c_str(), 0600), 0);
  expect_refused(dir, {(dir / "model.safetensors").string(), "is not a regular file"});
}

TEST(CheckpointCorrupt, TruncatedModelFile) {
  TempDir tmp;
  auto dir = good_checkpoint(tmp.path() / "ckpt");
  fs::resize_file(dir / "model.safetensors", fs::file_size(dir / "model.safetensors") / 2);
  expect_refused(dir, {(dir / "model.safetensors").string(), "truncated"});
}

TEST(CheckpointCorrupt, FlippedByteInOptimizerFile) {
  TempDir tmp;
  auto dir = good_checkpoint(tmp.path() / "ckpt");
  auto bytes = read_file(dir / "optimizer.safetensors");
  ASSERT_GT(bytes.size(), 100u);
  bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x01);
  write_file(dir / "optimizer.safetensors", bytes);
  expect_refused(dir, {(dir / "optimizer.safetensors").string(), "corrupt"});
}

TEST(CheckpointCorrupt, MissingManifest) {
  TempDir tmp;
  auto dir = good_checkpoint(tmp.path() / "ckpt");
  fs::remove(dir / "manifest.json");
  expect_refused(dir, {dir.string(), "no manifest.json"});
  expect_refused(tmp.path() / "nowhere", {(tmp.path() / "nowhere").string(), "not a folder"});
}

TEST(CheckpointCorrupt, ForeignFormat) {
  TempDir tmp;
  auto dir = good_checkpoint(tmp.path() / "ckpt");
  edit_manifest(dir, [](json& m) { m["format"] = "other"; });
  expect_refused(dir, {(dir / "manifest.json").string(), "format"});
}

// A manifest nested 100,000 levels deep (its format_version an array of arrays) is refused
// before it is parsed; it used to overflow the stack, and every restart crashed again.
TEST(CheckpointCorrupt, ADeeplyNestedManifestIsRefused) {
  TempDir tmp;
  auto dir = good_checkpoint(tmp.path() / "ckpt");
  std::string text = read_file(dir / "manifest.json");
  auto at = text.find('{');
  ASSERT_NE(at, std::string::npos);
  text.insert(at + 1,
              R"("format_version": )" + std::string(100000, '[') + std::string(100000, ']') + ", ");
  write_file(dir / "manifest.json", text);
  expect_refused(
      dir, {(dir / "manifest.json").string(), "nests arrays and objects more than 64 levels deep"});
}

TEST(CheckpointCorrupt, WorldSizeIsNotANumber) {
  TempDir tmp;
  auto dir = good_checkpoint(tmp.path() / "ckpt");
  edit_manifest(dir, [](json& m) { m["world_size"] = "two"; });
  expect_refused(dir, {(dir / "manifest.json").string(), "world_size", "\"two\""});
}

TEST(CheckpointCorrupt, ModelOfAnotherShape) {
  TempDir tmp;
  auto dir = good_checkpoint(tmp.path() / "ckpt", {.hidden = 16});
  expect_refused(dir, {(dir / "model.safetensors").string(), "does not match the prepared model",
                       "fc1.weight"});
}

TEST(CheckpointCorrupt, MoreOptimizersThanPrepared) {
  TempDir tmp;
  auto dir = good_checkpoint(tmp.path() / "ckpt", {.extra_optimizer = true});
  expect_refused(dir, {dir.string(), "holds 2 optimizers", "1 are prepared"});
}

// Linear(3, 3) and Linear(3, second_out), initialized from `seed` and prepared. The caller keeps
// them alive: the Accelerator does not own its models.
std::pair<torch::nn::Linear, torch::nn::Linear> prepare_two_models(Accelerator& acc, uint64_t seed,
                                                                   int64_t second_out) {
  torch::manual_seed(seed);
  std::pair<torch::nn::Linear, torch::nn::Linear> models{torch::nn::Linear(3, 3),
                                                         torch::nn::Linear(3, second_out)};
  acc.prepare(models.first, models.second);
  return models;
}

// "Read and check everything first, so a bad file changes nothing" (checkpoint.cpp): a second
// model that does not match must not leave the first one overwritten.
TEST(CheckpointCorrupt, AMismatchInTheSecondModelLeavesTheFirstUnchanged) {
  TempDir tmp;
  auto dir = tmp.path() / "ckpt";
  {
    Accelerator acc;
    auto models = prepare_two_models(acc, 1, 4);
    acc.save_state(dir);
  }
  Accelerator acc;
  auto models = prepare_two_models(acc, 2, 5);
  auto& first = models.first;
  auto before = copies(first->parameters());
  expect_checkpoint_error([&] { acc.load_state(dir); }, {(dir / "model_1.safetensors").string(),
                                                         "does not match the prepared model"});
  expect_bitwise(before, copies(first->parameters()),
                 "first model's parameter after a refused load");
}

// The same promise for an optimizer file that does not fit the prepared optimizer.
TEST(CheckpointCorrupt, AnOptimizerThatDoesNotFitLeavesTheModelUnchanged) {
  TempDir tmp;
  auto dir = tmp.path() / "ckpt";
  {
    Accelerator acc;
    torch::manual_seed(1);
    auto model = torch::nn::Linear(3, 2);
    auto opt = std::make_shared<torch::optim::AdamW>(model->parameters());
    auto o = std::get<1>(acc.prepare(model, opt));
    acc.backward(model->forward(torch::ones({1, 3})).sum());
    o.step();
    acc.save_state(dir);
  }
  Accelerator acc;
  torch::manual_seed(2);
  auto model = torch::nn::Linear(3, 2);
  auto weight_only =
      std::make_shared<torch::optim::AdamW>(std::vector<torch::Tensor>{model->weight});
  acc.prepare(model, weight_only);
  auto before = copies(model->parameters());
  expect_checkpoint_error(
      [&] { acc.load_state(dir); },
      {(dir / "optimizer.safetensors").string(), "is for 2 parameters, this optimizer has 1"});
  expect_bitwise(before, copies(model->parameters()), "parameter after a refused optimizer");
}

// The first optimizer loads, the second does not fit: the first gets its own state back.
TEST(CheckpointCorrupt, AFailedOptimizerLoadRestoresTheOptimizersLoadedBeforeIt) {
  TempDir tmp;
  auto dir = tmp.path() / "ckpt";
  auto train_once = [](Accelerator& acc, torch::nn::Linear& model, PreparedOptimizer& a,
                       PreparedOptimizer& b) {
    acc.backward(model->forward(torch::ones({1, 3})).sum());
    a.step();
    b.step();
  };
  {
    Accelerator acc;
    torch::manual_seed(1);
    auto model = torch::nn::Linear(3, 2);
    auto [m, a, b] = acc.prepare(
        model, std::make_shared<torch::optim::AdamW>(std::vector<torch::Tensor>{model->weight}),
        std::make_shared<torch::optim::AdamW>(std::vector<torch::Tensor>{model->bias}));
    for (int i = 0; i < 3; ++i) train_once(acc, model, a, b);
    acc.save_state(dir);
  }
  Accelerator acc;
  torch::manual_seed(2);
  auto model = torch::nn::Linear(3, 2);
  auto first = std::make_shared<torch::optim::AdamW>(std::vector<torch::Tensor>{model->weight});
  // two tensors, saved with one
  auto second = std::make_shared<torch::optim::AdamW>(model->parameters());
  auto [m, a, b] = acc.prepare(model, first, second);
  train_once(acc, model, a, b);
  auto state_of_first = [&] {
    const auto& s =
        static_cast<const torch::optim::AdamWParamState&>(*first->state().begin()->second);
    return std::vector<torch::Tensor>{s.exp_avg().clone(), s.exp_avg_sq().clone(),
                                      torch::tensor(static_cast<int64_t>(s.step()))};
  };
  ASSERT_EQ(first->state().size(), 1u);
  auto before = state_of_first();
  expect_checkpoint_error([&] { acc.load_state(dir); },
                          {(dir / "optimizer_1.safetensors").string(), "prepared optimizer 1"});
  ASSERT_EQ(first->state().size(), 1u);
  expect_bitwise(before, state_of_first(), "first optimizer's state after a refused load");
}

}  // namespace
}  // namespace accel

// Checkpoints under injected faults: atomic publication when a write, rename or sync fails at
// each step of a save, and background saves (SaveStateOptions::async): the state of their call,
// the wait for their copy, their failures; and a sharded save_model that fails half-way.
#include "tests/unit/checkpoint_fixtures.h"

namespace accel {
namespace {

using namespace ckpt_testing;  // the shared fixtures

// --- atomic publication under injected faults -----------------------------------------------

// The real file system, except that every file write, rename and sync_dir from the `fail_at`-th
// (0-based, counted together) on throws, as a full or failing disk would; a failing write has been
// given half of its first part (which the O_DIRECT writer may still hold in its buffer, not on
// disk). Records the operations it saw.
class FaultyFs : public ckpt::CheckpointFs {
 public:
  // `can_exchange` false: a file system without RENAME_EXCHANGE (NFS), exchange() says so.
  explicit FaultyFs(int64_t fail_at, bool can_exchange = true)
      : fail_at_(fail_at), can_exchange_(can_exchange) {}

  ckpt::WrittenFile write_stream(const fs::path& path,
                                 const std::function<void(const ckpt::Sink&)>& produce) override {
    if (next("write " + path.filename().string())) {
      // The failure comes from inside the producer, as a failing write(2) would.
      CheckpointFs::write_stream(path, [&](const ckpt::Sink& sink) {
        produce([&](std::string_view part) {
          sink(part.substr(0, part.size() / 2));
          throw CheckpointError("accel: checkpoint: " + path.string() + ": injected write failure");
        });
      });
      ADD_FAILURE() << "the injected failure of " << path << " did not reach the caller";
    }
    return CheckpointFs::write_stream(path, produce);
  }
  void rename(const fs::path& from, const fs::path& to) override {
    if (next("rename " + from.filename().string() + " -> " + to.filename().string())) {
      throw CheckpointError("accel: checkpoint: " + from.string() + ": injected rename failure");
    }
    CheckpointFs::rename(from, to);
  }
  bool exchange(const fs::path& a, const fs::path& b) override {
    if (next("exchange " + a.filename().string() + " <-> " + b.filename().string())) {
      throw CheckpointError("accel: checkpoint: " + a.string() + ": injected exchange failure");
    }
    return can_exchange_ && CheckpointFs::exchange(a, b);
  }
  void sync_dir(const fs::path& dir) override {
    if (next("sync " + dir.filename().string())) {
      throw CheckpointError("accel: checkpoint: " + dir.string() + ": injected fsync failure");
    }
    CheckpointFs::sync_dir(dir);
  }

  const std::vector<std::string>& operations() const { return operations_; }

 private:
  bool next(const std::string& what) {
    operations_.push_back(what);
    return static_cast<int64_t>(operations_.size()) - 1 >= fail_at_;
  }

  int64_t fail_at_;
  bool can_exchange_;
  std::vector<std::string> operations_;
};

// Installs a CheckpointFs for the scope; the real one is back even when an assertion throws.
class UseFs {
 public:
  explicit UseFs(ckpt::CheckpointFs* fs) { ckpt::set_checkpoint_fs_for_testing(fs); }
  ~UseFs() { ckpt::set_checkpoint_fs_for_testing(nullptr); }
  UseFs(const UseFs&) = delete;
  UseFs& operator=(const UseFs&) = delete;
};

// The operations of one save_state(`target`) of a rig like `options`'s (after a first save to the
// same place when `overwrite`).
std::vector<std::string> save_operations(const RigOptions& options, const fs::path& target,
                                         bool overwrite, bool can_exchange = true) {
  Rig probe(options);
  probe.step();
  if (overwrite) probe.acc.save_state(target);
  FaultyFs counting(std::numeric_limits<int64_t>::max(), can_exchange);
  UseFs use(&counting);
  probe.acc.save_state(target);
  return counting.operations();
}

std::size_t last_index_of(const std::vector<std::string>& ops, const std::string& prefix) {
  std::size_t found = ops.size();
  for (std::size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].rfind(prefix, 0) == 0) found = i;
  }
  return found;
}

// `ops` come from a probe rig's save, so the folder names in them are the probe's.
std::string describe(const std::vector<std::string>& ops, std::size_t k) {
  return "failing operation " + std::to_string(k) + " of " + std::to_string(ops.size()) +
         " (in the probe: " + (k < ops.size() ? ops[k] : std::string("none")) + ")";
}

TEST(CheckpointAtomicity, AFailedSaveLeavesThePreviousCheckpointIntact) {
  TempDir tmp, probe_dir;
  auto root = tmp.path() / "checkpoints";
  fs::create_directories(probe_dir.path() / "checkpoints");  // as the rig's, made by its first save
  auto ops = save_operations(project_rig(probe_dir.path(), std::nullopt, false), fs::path(), false);
  auto publish = last_index_of(ops, "rename ");
  ASSERT_LT(publish, ops.size()) << "a save renames its temp folder into place";

  Rig rig(project_rig(tmp.path(), std::nullopt, false));
  for (int i = 0; i < 3; ++i) rig.step();
  auto first = rig.acc.save_state();
  ASSERT_EQ(first, root / "checkpoint_0");
  auto first_state = snapshot(rig);
  rig.step();  // a second checkpoint would differ from the first
  auto second_state = snapshot(rig);

  for (std::size_t k = 0; k <= ops.size(); ++k) {
    SCOPED_TRACE(describe(ops, k));
    bool published = k > publish;
    {
      // The last round injects nothing (a save over a published checkpoint_1 has more steps).
      FaultyFs faulty(k < ops.size() ? static_cast<int64_t>(k)
                                     : std::numeric_limits<int64_t>::max());
      UseFs use(&faulty);
      if (k < ops.size()) {
        EXPECT_THROW(rig.acc.save_state(), CheckpointError);
      } else {
        EXPECT_EQ(rig.acc.save_state(), root / "checkpoint_1");
      }
    }
    EXPECT_EQ(fs::exists(root / "checkpoint_1"), published);
    auto expected = published ? root / "checkpoint_1" : first;
    EXPECT_EQ(rig.acc.latest_checkpoint(), expected);
    Rig check(project_rig(tmp.path(), std::nullopt, /*automatic_resume=*/false, /*init_seed=*/9));
    EXPECT_EQ(check.acc.load_state(), expected);
    expect_same(published ? second_state : first_state, snapshot(check));
  }
}

// STYLE.md: "write temp -> fsync -> rename, delete temp on failure".
TEST(CheckpointAtomicity, AFailedSaveRemovesItsTempFolder) {
  TempDir tmp, probe_dir;
  auto root = tmp.path() / "checkpoints";
  fs::create_directories(probe_dir.path() / "checkpoints");  // as the rig's, made by its first save
  auto ops = save_operations(project_rig(probe_dir.path(), std::nullopt, false), fs::path(), false);
  auto publish = last_index_of(ops, "rename ");
  Rig rig(project_rig(tmp.path(), std::nullopt, false));
  rig.step();
  rig.acc.save_state();
  for (std::size_t k = 0; k <= publish; ++k) {
    SCOPED_TRACE(describe(ops, k));
    {
      FaultyFs faulty(static_cast<int64_t>(k));
      UseFs use(&faulty);
      EXPECT_THROW(rig.acc.save_state(), CheckpointError);
    }
    std::vector<std::string> left;
    for (const auto& entry : fs::directory_iterator(root)) {
      auto name = entry.path().filename().string();
      if (name != "checkpoint_0") left.push_back(name);
    }
    EXPECT_TRUE(left.empty()) << "left behind: " << ::testing::PrintToString(left);
  }
}

// --- background saves (SaveStateOptions::async) ----------------------------------------------

// The real file system, except that writing a file waits until open() is called (or the object
// is destroyed, or 60 s pass: a save that waited on its caller would otherwise hang the test).
class GatedFs : public ckpt::CheckpointFs {
 public:
  ~GatedFs() override { open(); }
  void open() {
    if (!opened_flag_.exchange(true)) gate_.set_value();
  }
  ckpt::WrittenFile write_stream(const fs::path& path,
                                 const std::function<void(const ckpt::Sink&)>& produce) override {
    if (opened_.wait_for(std::chrono::seconds(60)) != std::future_status::ready)
      throw std::runtime_error("GatedFs: never opened");
    return CheckpointFs::write_stream(path, produce);
  }

 private:
  std::promise<void> gate_;
  std::shared_future<void> opened_ = gate_.get_future().share();
  std::atomic<bool> opened_flag_{false};
};

// Training goes on while the files are written (the fused optimizer step, the EMA update and the
// counter change the live state in place): the checkpoint holds the state of the save_state call.
void background_save_holds_the_state_of_its_call(bool async_checkpoints) {
  TempDir tmp;
  GatedFs gated;  // the writer writes no file before the training below has changed the state
  UseFs use(&gated);
  RigOptions options{.init_seed = 1};
  options.accelerator.project.async_checkpoints = async_checkpoints;
  Rig rig(options);
  // Why: destroyed first (reverse order) if anything below fails, so the writer the Rig's
  // Accelerator waits for is let through, before the file system it uses goes.
  struct OpenAtExit {
    GatedFs& gate;
    ~OpenAtExit() { gate.open(); }
  } open_at_exit{gated};
  for (int i = 0; i < 5; ++i) rig.step();
  auto saved = snapshot(rig);
  auto dir = rig.acc.save_state(tmp.path() / "ckpt", {.async = true});
  EXPECT_EQ(dir, tmp.path() / "ckpt");
  for (int i = 0; i < 3; ++i) rig.step();
  gated.open();
  rig.acc.wait_for_checkpoint();
  rig.acc.wait_for_checkpoint();  // nothing in flight: returns at once
  Rig resumed({.init_seed = 2});
  resumed.acc.load_state(dir);
  expect_same(saved, snapshot(resumed));
}

// With async_checkpoints on, the buffers the save copies into were made and touched after the
// first step (prefault); the checkpoint is the same.
TEST(CheckpointAsync, ABackgroundSaveHoldsTheStateOfItsCallWhileTrainingGoesOn) {
  for (bool async_checkpoints : {false, true}) {
    SCOPED_TRACE(async_checkpoints ? "async_checkpoints on: prefaulted buffers" : "fresh buffers");
    background_save_holds_the_state_of_its_call(async_checkpoints);
  }
}

// The writer thread copies the weights and AdamW's state while the program's next forward and
// backward run, and the optimizer step waits for those copies. Here the copies are held back
// until well after that step began: the checkpoint still holds the state of the save_state call,
// "seen" included (a buffer the forward changes, copied during the call).
TEST(CheckpointAsync, TheNextStepWaitsForTheBackgroundCopyOfTheWeights) {
  TempDir tmp;
  Rig rig({.init_seed = 1});
  for (int i = 0; i < 3; ++i) rig.step();
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<bool> copy_began{false};
  ckpt::set_copy_hook_for_testing([&] {
    copy_began = true;
    released.wait();
  });
  struct ClearHook {
    std::promise<void>& release;
    bool opened = false;
    ~ClearHook() {
      if (!opened) release.set_value();
      ckpt::set_copy_hook_for_testing(nullptr);
    }
  } clear_hook{release};
  auto saved = snapshot(rig);
  auto dir = rig.acc.save_state(tmp.path() / "ckpt", {.async = true});
  std::thread opener([&] {
    while (!copy_began) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    // Why 200 ms: the step below (a forward, a backward and AdamW on a tiny model) begins long
    // before; it must wait here, or the weights it changes would be copied changed.
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    clear_hook.opened = true;
    release.set_value();
  });
  rig.step();
  opener.join();
  rig.acc.wait_for_checkpoint();
  Rig resumed({.init_seed = 2});
  resumed.acc.load_state(dir);
  expect_same(saved, snapshot(resumed));
}

// A background save that fails at any of its file operations is reported by the next
// wait_for_checkpoint (or save_state, or end_training), and the previous checkpoint still loads.
TEST(CheckpointAsync, AFailedBackgroundSaveIsReportedAndLeavesThePreviousCheckpoint) {
  TempDir tmp, probe_dir;
  auto root = tmp.path() / "checkpoints";
  fs::create_directories(probe_dir.path() / "checkpoints");
  auto ops = save_operations(project_rig(probe_dir.path(), std::nullopt, false), fs::path(), false);
  auto publish = last_index_of(ops, "rename ");
  ASSERT_LT(publish, ops.size());
  Rig rig(project_rig(tmp.path(), std::nullopt, false));
  rig.step();
  auto first = rig.acc.save_state();
  auto first_state = snapshot(rig);
  for (std::size_t k = 0; k <= publish; ++k) {
    SCOPED_TRACE(describe(ops, k));
    FaultyFs faulty(static_cast<int64_t>(k));
    UseFs use(&faulty);
    auto target = rig.acc.save_state({}, {.async = true});
    rig.step();
    if (k % 2 == 0) {
      expect_checkpoint_error([&] { rig.acc.wait_for_checkpoint(); },
                              {"background save of " + target.string(), "intact"});
    } else {
      expect_checkpoint_error([&] { rig.acc.end_training(); },
                              {"background save of " + target.string()});
      rig.acc.wait_for_checkpoint();  // reported once: the collective finds nothing more
    }
    EXPECT_FALSE(fs::exists(target));
    EXPECT_EQ(rig.acc.latest_checkpoint(), first);
  }
  Rig check(project_rig(tmp.path(), std::nullopt, /*automatic_resume=*/false, /*init_seed=*/9));
  EXPECT_EQ(check.acc.load_state(), first);
  expect_same(first_state, snapshot(check));
}

// The automatic saves of ProjectConfiguration::async_checkpoints: each is complete once the next
// one starts, and rotation keeps total_limit of them.
TEST(CheckpointAsync, AutomaticSavesInTheBackgroundRotateAndLoad) {
  TempDir tmp;
  auto options = project_rig(tmp.path(), 2, false);
  options.accelerator.project.save_interval = 2;
  options.accelerator.project.async_checkpoints = true;
  Snapshot at6;
  {
    Rig rig(options);
    for (int i = 0; i < 7; ++i) {
      if (i == 6) at6 = snapshot(rig);  // the automatic save at step 6 happens at the 7th batch
      rig.step();
    }
    rig.acc.wait_for_checkpoint();
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(tmp.path() / "checkpoints"))
      names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    EXPECT_EQ(names, (std::vector<std::string>{"checkpoint_1", "checkpoint_2"}));
  }
  Rig check(project_rig(tmp.path(), std::nullopt, false, 9));
  EXPECT_EQ(check.acc.load_state(), tmp.path() / "checkpoints" / "checkpoint_2");
  expect_same(at6, snapshot(check));
}

// save_state(dir) over an existing checkpoint: at every failure point, `dir` still loads, as the
// old checkpoint until the new one is complete, then as the new one. Also where the file system
// has no RENAME_EXCHANGE (the old folder steps aside while the new one moves in).
TEST(CheckpointAtomicity, OverwritingAFolderKeepsALoadableCheckpointThere) {
  for (bool can_exchange : {true, false}) {
    SCOPED_TRACE(can_exchange ? "with RENAME_EXCHANGE" : "without RENAME_EXCHANGE");
    TempDir tmp, probe_dir;
    auto dir = tmp.path() / "ckpt";
    auto ops = save_operations({}, probe_dir.path() / "ckpt", /*overwrite=*/true, can_exchange);
    // The new folder takes the old one's place: a swap, or its rename after the old one's.
    auto publish = last_index_of(ops, can_exchange ? "exchange .ckpt.tmp-" : "rename .ckpt.tmp-");
    ASSERT_LT(publish, ops.size()) << ::testing::PrintToString(ops);
    if (!can_exchange) {
      ASSERT_EQ(ops[publish - 1].rfind("rename ckpt -> .ckpt.old-", 0), 0u)
          << ::testing::PrintToString(ops);
    }

    Rig rig;
    rig.step();
    rig.acc.save_state(dir);
    auto first_state = snapshot(rig);
    rig.step();
    auto second_state = snapshot(rig);
    for (std::size_t k = 0; k < ops.size(); ++k) {
      SCOPED_TRACE(describe(ops, k));
      {
        FaultyFs faulty(static_cast<int64_t>(k), can_exchange);
        UseFs use(&faulty);
        EXPECT_THROW(rig.acc.save_state(dir), CheckpointError);
      }
      // Without RENAME_EXCHANGE, a failure of the new folder's rename that also fails the old
      // one's rename back (every operation fails from k on) leaves the old folder set aside,
      // complete, for the next save to put back (the next test); nothing else may go missing.
      auto loads_from = dir;
      std::optional<fs::path> aside;
      for (const auto& entry : fs::directory_iterator(tmp.path())) {
        if (entry.path().filename() == "ckpt") continue;
        EXPECT_EQ(entry.path().filename().string().rfind(".ckpt.old-", 0), 0u)
            << "left behind: " << entry.path();
        aside = entry.path();
      }
      if (aside) {
        EXPECT_FALSE(can_exchange);
        EXPECT_EQ(k, publish) << "only the new folder's rename can leave the old one aside";
        EXPECT_FALSE(fs::exists(dir));
        loads_from = *aside;
      }
      Rig check({.init_seed = 9});
      try {
        check.acc.load_state(loads_from);
        expect_same(k > publish ? second_state : first_state, snapshot(check));
      } catch (const CheckpointError& e) {
        ADD_FAILURE() << "the checkpoint no longer loads: " << e.what();
      }
      if (aside) fs::rename(*aside, dir);  // as the next save would, so the next round starts alike
    }
  }
}

// A process killed between the two renames of an overwrite without RENAME_EXCHANGE leaves the
// old checkpoint set aside and no folder at its name; the next save there puts it back first,
// so even a save that then fails leaves it loadable.
TEST(CheckpointAtomicity, AnOverwriteKilledBetweenItsRenamesIsRepairedByTheNextSave) {
  TempDir tmp;
  auto dir = tmp.path() / "ckpt";
  Rig rig;
  rig.step();
  rig.acc.save_state(dir);
  auto first_state = snapshot(rig);
  fs::rename(dir, tmp.path() / ".ckpt.old-12345");  // what the killed overwrite left
  {
    FaultyFs faulty(/*fail_at=*/1, /*can_exchange=*/false);  // the save fails after putting it back
    UseFs use(&faulty);
    EXPECT_THROW(rig.acc.save_state(dir), CheckpointError);
  }
  Rig check({.init_seed = 9});
  check.acc.load_state(dir);
  expect_same(first_state, snapshot(check));
  EXPECT_FALSE(fs::exists(tmp.path() / ".ckpt.old-12345"));
}

// A save that creates its folder fsyncs the parent of every folder it made, so the new folder's
// entry is on disk before the checkpoint is called saved.
TEST(CheckpointAtomicity, ANewFolderIsSyncedIntoItsParent) {
  TempDir tmp;
  auto dir = tmp.path() / "runs" / "a" / "ckpt";
  auto ops = [&] {
    Rig rig;
    rig.step();
    FaultyFs counting(std::numeric_limits<int64_t>::max());
    UseFs use(&counting);
    rig.acc.save_state(dir);
    return counting.operations();
  }();
  ASSERT_GE(ops.size(), 2u);
  // Before anything else: "runs" into tmp, "a" into runs (ckpt itself is renamed into "a").
  EXPECT_EQ(ops[0], "sync " + tmp.path().filename().string()) << ::testing::PrintToString(ops);
  EXPECT_EQ(ops[1], "sync runs") << ::testing::PrintToString(ops);
}

// --- save_model under injected faults -------------------------------------------------------

// What a loader finds in a save_model folder, entering as transformers does (model.safetensors,
// else the index and the shards it names): "none", or which of `models` every tensor matches
// ("0", "1"), or "mixed".
std::string model_found(const fs::path& dir,
                        const std::vector<std::map<std::string, torch::Tensor>>& models) {
  std::map<std::string, torch::Tensor> found;
  if (fs::exists(dir / "model.safetensors")) {
    found = decoded(dir / "model.safetensors");
  } else if (fs::exists(dir / "model.safetensors.index.json")) {
    auto index = json::parse(read_file(dir / "model.safetensors.index.json"));
    for (const auto& [name, file] : index["weight_map"].items())
      found[name] = decoded(dir / file.get<std::string>()).at(name);
  } else {
    return "none";
  }
  for (std::size_t m = 0; m < models.size(); ++m) {
    bool all = found.size() == models[m].size();
    for (const auto& [name, t] : models[m])
      all = all && found.count(name) && torch::equal(found.at(name), t);
    if (all) return std::to_string(m);
  }
  return "mixed";
}

// Re-saving a sharded model (same shard names) that fails at any file operation: a loader finds
// the old model, the new one, or none, never old and new shards under one index.
TEST(CheckpointSaveModel, AFailedResaveNeverMixesOldAndNewShards) {
  TempDir tmp;
  Accelerator acc;
  auto dir = tmp.path() / "model";
  auto make = [](int seed) {
    torch::manual_seed(seed);
    return torch::nn::Sequential(torch::nn::Linear(16, 16), torch::nn::Linear(16, 16),
                                 torch::nn::Linear(16, 4));
  };
  auto old_model = make(1), new_model = make(2);
  std::vector<std::map<std::string, torch::Tensor>> models;
  for (auto* m : {&old_model, &new_model}) {
    std::map<std::string, torch::Tensor> named;
    for (const auto& p : (*m)->named_parameters()) named[p.key()] = p.value().detach().clone();
    models.push_back(named);
  }
  acc.save_model(old_model.ptr(), dir, {.max_shard_size = "1KB"});
  ASSERT_EQ(model_found(dir, models), "0");
  std::vector<std::string> ops;
  {
    TempDir probe;
    acc.save_model(old_model.ptr(), probe.path(), {.max_shard_size = "1KB"});
    FaultyFs counting(std::numeric_limits<int64_t>::max());
    UseFs use(&counting);
    acc.save_model(new_model.ptr(), probe.path(), {.max_shard_size = "1KB"});
    ops = counting.operations();
  }
  ASSERT_GE(std::count_if(ops.begin(), ops.end(),
                          [](const std::string& op) { return op.rfind("rename ", 0) == 0; }),
            3)
      << "several shards: " << ::testing::PrintToString(ops);
  for (std::size_t k = 0; k < ops.size(); ++k) {
    SCOPED_TRACE(describe(ops, k));
    acc.save_model(old_model.ptr(), dir, {.max_shard_size = "1KB"});
    {
      FaultyFs faulty(static_cast<int64_t>(k));
      UseFs use(&faulty);
      EXPECT_THROW(acc.save_model(new_model.ptr(), dir, {.max_shard_size = "1KB"}),
                   CheckpointError);
    }
    EXPECT_NE(model_found(dir, models), "mixed");
    for (const auto& entry : fs::directory_iterator(dir)) {
      EXPECT_NE(entry.path().extension(), ".tmp") << "left behind: " << entry.path();
    }
  }
  acc.save_model(new_model.ptr(), dir, {.max_shard_size = "1KB"});
  EXPECT_EQ(model_found(dir, models), "1");
}

}  // namespace
}  // namespace accel

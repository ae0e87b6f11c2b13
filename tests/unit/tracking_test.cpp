// Structured batches (named fields through datasets, collate, loaders and the collectives'
// nested forms), the experiment trackers (JSONL, CSV, TensorBoard files; a resumed run continues
// them without a duplicated step), and the automatic-resume point that does not depend on the
// order of prepare() and register_for_checkpointing().
#include "runtime/tracking.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "accel/accel.h"
#include "runtime/autocast_compat.h"
#include "runtime/progress_bar.h"
#include "tests/common/files.h"

namespace accel {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using testing::read_file;
using testing::TempDir;
using testing::write_file;

template <class F>
std::string error_of(F&& f) {
  try {
    std::forward<F>(f)();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

// --- structured batches ----------------------------------------------------------------------

std::shared_ptr<TensorDataset> token_data(int64_t rows) {
  auto ids = torch::arange(rows * 3, torch::kLong).reshape({rows, 3});
  return std::make_shared<TensorDataset>(TensorMap{
      {"input_ids", ids}, {"attention_mask", torch::ones_like(ids)}, {"labels", ids + 1}});
}

TEST(Batches, NamedColumnsReachEveryBatchWithTheirRows) {
  for (std::size_t workers : {0u, 2u}) {
    // A collate that forces the per-example path too (get() and default_collate).
    for (bool per_example : {false, true}) {
      DataLoaderOptions options{
          .batch_size = 4, .shuffle = true, .seed = 5, .num_workers = workers};
      if (per_example) options.collate = default_collate;
      DataLoader dl(token_data(10), options);
      std::set<int64_t> seen;
      for (auto& b : dl) {
        EXPECT_FALSE(b.contains("input"));
        ASSERT_TRUE(b.contains("input_ids"));
        EXPECT_TRUE(torch::equal(b["labels"], b["input_ids"] + 1));
        EXPECT_EQ(b["attention_mask"].sizes(), b["input_ids"].sizes());
        EXPECT_EQ(b.size(), b["input_ids"].size(0));
        for (int64_t i = 0; i < b.size(); ++i)
          seen.insert(b["input_ids"][i][0].item<int64_t>() / 3);
        auto names = b.items();
        ASSERT_EQ(names.size(), 3u);
        EXPECT_EQ(names[0].first, "attention_mask");
      }
      EXPECT_EQ(seen.size(), 10u) << "every row once";
    }
  }
}

TEST(Batches, AMissingFieldIsNamedWithTheFieldsThereAre) {
  DataLoader dl(token_data(4), {.batch_size = 2});
  auto pass = dl.begin();  // the pass lives as long as its iterator
  auto& b = *pass;
  EXPECT_EQ(error_of([&] { (void)b["label"]; }),
            "accel: the batch has no field \"label\" (it has attention_mask, input_ids, labels)");
}

TEST(Batches, ColumnsOfDifferentLengthsAreRefused) {
  EXPECT_EQ(error_of([] {
              TensorDataset({{"a", torch::zeros({4, 2})}, {"b", torch::zeros({5})}});
            }),
            "accel: TensorDataset column \"b\" has 5 rows but \"a\" has 4");
}

TEST(Batches, CollateRefusesExamplesWithOtherFields) {
  std::vector<Example> examples(2);
  examples[0].fields["x"] = torch::zeros({2});
  examples[1].fields["y"] = torch::zeros({2});
  EXPECT_EQ(error_of([&] { default_collate(std::move(examples)); }),
            "accel: default_collate: example 1 has the field \"y\", which example 0 does not");
}

TEST(Batches, ToMovesEveryField) {
  DataLoader dl(token_data(4), {.batch_size = 2});
  auto b = (*dl.begin()).to(torch::kCPU);
  EXPECT_EQ(b.items().size(), 3u);
}

TEST(Batches, CollectivesTakeNestedMapsAndVectors) {
  Accelerator acc;  // one process: gather is the identity, reduce too
  std::map<std::string, std::vector<torch::Tensor>> nested{
      {"logits", {torch::ones({2, 3}), torch::zeros({1, 3})}}, {"ids", {torch::arange(4)}}};
  auto gathered = acc.gather(nested);
  ASSERT_EQ(gathered.size(), 2u);
  EXPECT_TRUE(torch::equal(gathered["logits"][0], torch::ones({2, 3})));
  EXPECT_TRUE(torch::equal(gathered["ids"][0], torch::arange(4)));
  auto reduced = acc.reduce(TensorMap{{"loss", torch::tensor(2.0)}}, ReduceOp::kMean);
  EXPECT_EQ(reduced["loss"].item<double>(), 2.0);
  auto padded = acc.pad_across_processes(std::vector<torch::Tensor>{torch::ones({2})});
  EXPECT_TRUE(torch::equal(padded[0], torch::ones({2})));
  DataLoader dl(token_data(4), {.batch_size = 2});
  auto batch = acc.gather_for_metrics(*dl.begin());
  EXPECT_EQ(batch.items().size(), 3u);
  auto sent = acc.broadcast(TensorMap{{"w", torch::full({2}, 3.0)}});
  EXPECT_TRUE(torch::equal(sent["w"], torch::full({2}, 3.0)));
}

// --- trackers ----------------------------------------------------------------------------------

TEST(Trackers, LogWithNamesAreParsedAndUnknownOnesRefused) {
  using tracking::parse_log_with;
  EXPECT_EQ(parse_log_with({"jsonl, TensorBoard"}, "x"),
            (std::vector<std::string>{"tensorboard", "jsonl"}));
  EXPECT_EQ(parse_log_with({"all"}, "x"),
            (std::vector<std::string>{"tensorboard", "jsonl", "csv"}));
  EXPECT_EQ(parse_log_with({"csv", "jsonl,csv"}, "x"), (std::vector<std::string>{"jsonl", "csv"}));
  EXPECT_TRUE(parse_log_with({"", "none"}, "x").empty());
  EXPECT_EQ(error_of([] { parse_log_with({"wandb"}, "ACCEL_LOG_WITH"); }),
            "accel: ACCEL_LOG_WITH=\"wandb\": unknown tracker \"wandb\"; expected tensorboard, "
            "jsonl, csv or all (several separated by commas)");
  EXPECT_EQ(error_of([] { Accelerator acc({.log_with = std::vector<std::string>{"tb"}}); }),
            "accel: option log_with=\"tb\": unknown tracker \"tb\"; expected tensorboard, "
            "jsonl, csv or all (several separated by commas)");
}

TEST(Trackers, WithoutAFolderInitTrackersSaysWhatToSet) {
  Accelerator acc({.log_with = std::vector<std::string>{"jsonl"}});
  EXPECT_NE(error_of([&] { acc.init_trackers("run"); }).find("--project-dir DIR"),
            std::string::npos);
  Accelerator none;  // no trackers: init_trackers and log do nothing, wherever
  none.init_trackers("run");
  none.log({{"loss", 1.0}});
  EXPECT_EQ(none.tracker_dir(), fs::path());
}

std::vector<json> jsonl_records(const fs::path& file) {
  std::vector<json> out;
  std::istringstream in(read_file(file));
  for (std::string line; std::getline(in, line);) out.push_back(json::parse(line));
  return out;
}

std::vector<int64_t> steps_of(const std::vector<json>& records, const std::string& key) {
  std::vector<int64_t> out;
  for (const auto& r : records) {
    if (r.contains(key)) out.push_back(r["step"].get<int64_t>());
  }
  return out;
}

TEST(Trackers, EveryTrackerHoldsEachRecordWhenLogReturns) {
  TempDir tmp;
  AcceleratorOptions options{.log_with = std::vector<std::string>{"all"}};
  options.project.logging_dir = tmp.path().string();
  Accelerator acc(options);
  acc.init_trackers("demo", {{"lr", 0.5}, {"layers", int64_t{2}}, {"name", std::string("x,y")}});
  EXPECT_EQ(acc.tracker_dir(), tmp.path() / "demo");
  acc.log({{"loss", 1.5}, {"acc", 0.25}}, 3);
  acc.log({{"loss", 1.25}});  // step: completed_steps(), 0 here
  // Before end_training: on disk already.
  auto records = jsonl_records(tmp.path() / "demo" / "metrics.jsonl");
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records[0]["step"], 3);
  EXPECT_EQ(records[0]["loss"], 1.5);
  EXPECT_EQ(records[0]["acc"], 0.25);
  EXPECT_EQ(records[1]["step"], 0);
  EXPECT_EQ(read_file(tmp.path() / "demo" / "metrics.csv").substr(0, 26),
            "step,wall_time,name,value\n");
  EXPECT_NE(read_file(tmp.path() / "demo" / "metrics.csv").find(",loss,1.25\n"), std::string::npos);
  auto config = json::parse(read_file(tmp.path() / "demo" / "config.json"));
  EXPECT_EQ(config["lr"], 0.5);
  EXPECT_EQ(config["layers"], 2);
  EXPECT_EQ(config["name"], "x,y");
  int events = 0;
  for (const auto& e : fs::directory_iterator(tmp.path() / "demo")) {
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) {
      ++events;
      EXPECT_GT(fs::file_size(e.path()), 60u);
    }
  }
  EXPECT_EQ(events, 1);
  EXPECT_EQ(error_of([&] {
              acc.log({{"step", 1.0}});
            }),
            "accel: log(): \"step\" cannot be a value's name (step and wall_time are every "
            "record's own)");
  EXPECT_NE(error_of([&] { acc.init_trackers("again"); }).find("already called"),
            std::string::npos);
  acc.end_training();
  acc.log({{"loss", 9.0}});  // after end_training: nothing
  EXPECT_EQ(jsonl_records(tmp.path() / "demo" / "metrics.jsonl").size(), 2u);
}

// A small job that logs its loss every step, with automatic checkpoints in `project`.
struct LoggedRun {
  explicit LoggedRun(const fs::path& project, int64_t save_interval = 0,
                     bool automatic_resume = true)
      : acc([&] {
          AcceleratorOptions o{.log_with = std::vector<std::string>{"jsonl", "csv"}};
          o.project.project_dir = project.string();
          o.project.save_interval = save_interval;
          o.project.automatic_resume = automatic_resume;
          return o;
        }()) {
    torch::manual_seed(3);
    model = torch::nn::Linear(3, 1);
    auto opt =
        std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1));
    DataLoader loader(std::make_shared<TensorDataset>(torch::randn({16, 3}), torch::randn({16, 1})),
                      {.batch_size = 2});
    auto prepared = acc.prepare(model, opt, loader);
    optimizer.emplace(std::get<1>(prepared));
    dl.emplace(std::get<2>(prepared));
    acc.init_trackers("job");
  }
  // Trains until completed_steps() == steps, logging each step.
  void train_to(int64_t steps) {
    for (auto& b : *dl) {
      if (acc.completed_steps() >= steps) break;
      acc.backward(torch::mse_loss(model->forward(b.input), b.target));
      optimizer->step();
      optimizer->zero_grad();
      acc.log({{"loss", static_cast<double>(acc.completed_steps())}});
    }
  }
  Accelerator acc;
  torch::nn::Linear model{nullptr};
  std::optional<PreparedOptimizer> optimizer;
  std::optional<DataLoader> dl;
};

TEST(Trackers, AResumedRunContinuesTheFilesWithoutADuplicatedStep) {
  TempDir tmp;
  {
    LoggedRun first(tmp.path(), /*save_interval=*/3);
    first.train_to(5);  // saved at step 3; steps 4 and 5 are logged after it (then "killed")
  }
  auto file = tmp.path() / "job" / "metrics.jsonl";
  EXPECT_EQ(steps_of(jsonl_records(file), "loss"), (std::vector<int64_t>{1, 2, 3, 4, 5}));
  LoggedRun second(tmp.path(), 3);
  second.train_to(8);
  EXPECT_EQ(steps_of(jsonl_records(file), "loss"), (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8}));
  std::istringstream csv(read_file(tmp.path() / "job" / "metrics.csv"));
  std::vector<std::string> rows;
  for (std::string line; std::getline(csv, line);) rows.push_back(line.substr(0, line.find(',')));
  EXPECT_EQ(rows, (std::vector<std::string>{"step", "1", "2", "3", "4", "5", "6", "7", "8"}));
  EXPECT_FALSE(fs::exists(tmp.path() / "job" / "previous-1"));
}

// HF's order without automatic resume: init_trackers, then load_state by hand, then training.
TEST(Trackers, AnExplicitLoadStateBeforeTrainingContinuesTheFiles) {
  TempDir tmp;
  { LoggedRun(tmp.path(), /*save_interval=*/3).train_to(5); }
  LoggedRun second(tmp.path(), 3, /*automatic_resume=*/false);  // init_trackers ran in there
  second.acc.load_state();                                      // the newest: step 3
  second.train_to(6);
  EXPECT_EQ(steps_of(jsonl_records(tmp.path() / "job" / "metrics.jsonl"), "loss"),
            (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));
  EXPECT_FALSE(fs::exists(tmp.path() / "job" / "previous-1"));
}

TEST(Trackers, AFreshRunMovesAnEarlierRunsFilesAside) {
  TempDir tmp;
  { LoggedRun(tmp.path()).train_to(2); }  // no checkpoint: the next run starts anew
  LoggedRun second(tmp.path());
  second.train_to(1);
  EXPECT_EQ(steps_of(jsonl_records(tmp.path() / "job" / "metrics.jsonl"), "loss"),
            (std::vector<int64_t>{1}));
  EXPECT_EQ(steps_of(jsonl_records(tmp.path() / "job" / "previous-1" / "metrics.jsonl"), "loss"),
            (std::vector<int64_t>{1, 2}));
}

TEST(Trackers, AManifestNamingAnotherFileIsRefused) {
  TempDir tmp;
  fs::path saved;
  {
    LoggedRun run(tmp.path());
    run.train_to(2);
    saved = run.acc.save_state();
  }
  auto manifest = json::parse(read_file(saved / "manifest.json"));
  manifest["trackers"]["files"]["../../model.safetensors"] = 0;
  write_file(saved / "manifest.json", manifest.dump());
  AcceleratorOptions o;
  o.project.project_dir = tmp.path().string();
  o.project.automatic_resume = false;
  Accelerator acc(o);
  auto model = torch::nn::Linear(3, 1);
  auto opt =
      std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1));
  DataLoader loader(std::make_shared<TensorDataset>(torch::randn({16, 3}), torch::randn({16, 1})),
                    {.batch_size = 2});
  acc.prepare(model, opt, loader);
  auto what = error_of([&] { acc.load_state(saved); });
  EXPECT_NE(what.find("\"../../model.safetensors\": expected a tracker file name"),
            std::string::npos)
      << what;
}

// --- the automatic-resume point ----------------------------------------------------------------

// Without a prepared loader the first backward() would be the resume point, after a forward
// pass that used the weights a resume replaces: refused when there is a checkpoint to load.
TEST(ResumePoint, ABackwardBeforeAnyLoaderIsRefusedWhenThereIsACheckpointToLoad) {
  TempDir tmp;
  auto backward_first = [&] {
    AcceleratorOptions o;
    o.project.project_dir = tmp.path().string();
    o.project.automatic_resume = true;
    Accelerator acc(o);
    auto model = torch::nn::Linear(3, 1);
    auto opt =
        std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1));
    auto [m, prepared] = acc.prepare(model, opt);
    acc.backward(m->forward(torch::ones({2, 3})).sum());
    prepared.step();
    acc.save_state();
  };
  backward_first();  // no checkpoint yet: nothing to resume, so fine
  auto what = error_of(backward_first);
  EXPECT_NE(what.find("first backward() came before any prepared DataLoader was iterated"),
            std::string::npos)
      << what;
}

// HF allows preparing an evaluation model mid-training: under automatic resume it is prepared
// but left out of the checkpoints (a restarted run resumes before reaching that prepare()), so
// they still match; another late object is refused, with the fix in the message.
TEST(ResumePoint, ALateModelIsPreparedButNotCheckpointedAndALateOptimizerIsRefused) {
  TempDir tmp;
  auto run = [&] {
    AcceleratorOptions o;
    o.project.project_dir = tmp.path().string();
    o.project.automatic_resume = true;
    Accelerator acc(o);
    DataLoader loader(std::make_shared<TensorDataset>(torch::randn({4, 3}), torch::randn({4, 1})),
                      {.batch_size = 2});
    auto dl = acc.prepare(loader);
    auto model = torch::nn::Linear(3, 1);
    acc.prepare(model);  // before training: checkpointed
    (void)dl.epoch();    // training starts here
    auto eval_model = acc.prepare(torch::nn::Linear(3, 2));
    EXPECT_EQ(eval_model->forward(torch::ones({1, 3})).size(1), 2);
    auto what = error_of([&] {
      acc.prepare(
          std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1)));
    });
    EXPECT_NE(what.find("accel: prepare() of an optimizer after training started"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("automatic_resume = false"), std::string::npos) << what;
    return acc.save_state();
  };
  auto first = run();
  auto manifest = json::parse(read_file(first / "manifest.json"));
  EXPECT_EQ(manifest["contents"]["models"], 1) << manifest.dump();
  auto second = run();  // resumes from the first one: the late model does not break the match
  EXPECT_NE(first, second);
}

// A project_dir set in code alone is HF's: checkpoints go there, and nothing resumes by itself;
// automatic_resume = true (or a folder from the launcher) asks for it.
TEST(ResumePoint, AProjectDirInCodeDoesNotResumeUnlessAsked) {
  TempDir tmp;
  auto steps_after_start = [&](std::optional<bool> automatic_resume) {
    AcceleratorOptions o;
    o.project.project_dir = tmp.path().string();
    o.project.automatic_resume = automatic_resume;
    Accelerator acc(o);
    auto model = torch::nn::Linear(3, 1);
    auto opt =
        std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1));
    DataLoader loader(std::make_shared<TensorDataset>(torch::randn({4, 3}), torch::randn({4, 1})),
                      {.batch_size = 2});
    auto [m, o2, dl] = acc.prepare(model, opt, loader);
    int64_t at_start = -1;
    for (auto& batch : dl) {
      if (at_start < 0) at_start = acc.completed_steps();
      acc.backward(torch::mse_loss(m(batch.input), batch.target));
      o2.step();
      o2.zero_grad();
    }
    acc.save_state();
    return at_start;
  };
  EXPECT_EQ(steps_after_start(std::nullopt), 0);
  EXPECT_EQ(steps_after_start(std::nullopt), 0) << "a project_dir in code alone resumed";
  EXPECT_EQ(steps_after_start(true), 2) << "automatic_resume = true did not resume";
}

// --- progress, logging ---------------------------------------------------------------------------

TEST(ProgressBar, ShowsCountBarRateTimeLeftAndTheLoggedValues) {
  EXPECT_EQ(ProgressBar::render("epoch 1", 30, 120, 10.0, {{"loss", 1.2345}}, true),
            "epoch 1  30/120 [=====>              ]  25%  10 it/s  ETA 0:09  loss 1.2345");
  EXPECT_EQ(ProgressBar::render("epoch 0", 7, SIZE_MAX, 0, {}, false), "epoch 0  7 batches");
  EXPECT_EQ(ProgressBar::render("epoch 2", 4000, 4000, 2.0, {}, false),
            "epoch 2  4000/4000 100%  2 it/s");
}

TEST(ProgressBar, WithoutATerminalItWritesPlainLinesOnlyAfterTheInterval) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  {
    ProgressBar quiet(fds[1], false, std::chrono::hours(1));
    ProgressBar every(fds[1], false, std::chrono::milliseconds(0));
    for (std::size_t i = 1; i <= 3; ++i) {
      quiet.update("epoch 0", {0, i, 3, false}, {});
      every.update("epoch 0", {0, i, 3, false}, {{"loss", 0.5}});
    }
    every.update("epoch 0", {0, 3, 3, true}, {});
  }
  ::close(fds[1]);
  std::string out(4096, '\0');
  out.resize(static_cast<std::size_t>(::read(fds[0], out.data(), out.size())));
  ::close(fds[0]);
  // The first update starts the pass; each later one is past the (zero) interval; the end of a
  // pass adds nothing.
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 2) << out;
  EXPECT_NE(out.find("accel: epoch 0  2/3  66%"), std::string::npos) << out;
  EXPECT_NE(out.find("loss 0.5\n"), std::string::npos) << out;
}

TEST(Logger, WritesNamedLinesAtItsLevelOnTheMainProcess) {
  auto logger = get_logger("unit", LogLevel::kWarning);
  ::testing::internal::CaptureStderr();
  logger.info("not shown");
  logger.warning("shown");
  logger.error("also shown", /*main_process_only=*/false);
  get_logger("unit").debug("the same logger: still warning and above");
  auto said = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(said.find("not shown"), std::string::npos) << said;
  EXPECT_NE(said.find("] [unit] [warning] shown\n"), std::string::npos) << said;
  EXPECT_NE(said.find("] [unit] [error] also shown\n"), std::string::npos) << said;
  EXPECT_EQ(said.find("still warning"), std::string::npos) << said;
  EXPECT_EQ(said[0], '[');
  EXPECT_EQ(get_logger("unit").level(), LogLevel::kWarning);
}

// --- autocast of the forward pass, the original optimizer handle -------------------------------

bool cpu_autocast() { return autocast_compat::is_enabled(c10::DeviceType::CPU); }

// The model's forward computed in bf16 from the current weights, cast anew (no autocast cache),
// as float32: what HF's prepared model(x) returns under bf16.
torch::Tensor bf16_forward(torch::nn::LinearImpl& linear, const torch::Tensor& x) {
  torch::NoGradGuard no_grad;
  return torch::linear(x.to(torch::kBFloat16), linear.weight.to(torch::kBFloat16),
                       linear.bias.to(torch::kBFloat16))
      .to(torch::kFloat);
}

// What runs under autocast is the prepared model's call m(x), as HF's prepared model(x): its
// forward in bf16, its output float32, autocast off again after it. m->forward(x) (the model
// itself), a loader's batch, backward and the step run in float32; with autocast_forward =
// false, m(x) does too.
TEST(Autocast, APreparedModelsCallRunsUnderAutocastWithFloat32Outputs) {
  for (bool on : {true, false}) {
    SCOPED_TRACE(on ? "autocast_forward" : "autocast_forward = false");
    Accelerator acc({.mixed_precision = "bf16", .autocast_forward = on});
    auto model = torch::nn::Linear(3, 2);
    auto opt =
        std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1));
    auto [m, o, dl] = acc.prepare(
        model, opt,
        DataLoader(std::make_shared<TensorDataset>(torch::randn({8, 3}), torch::randn({8, 2})),
                   {.batch_size = 4}));
    int batches = 0;
    for (auto& b : dl) {
      EXPECT_FALSE(cpu_autocast()) << "a batch alone turns nothing on";
      auto out = m(b.input);
      EXPECT_FALSE(cpu_autocast());
      EXPECT_EQ(out.scalar_type(), torch::kFloat);
      auto fp32 = model->forward(b.input);
      EXPECT_EQ(fp32.scalar_type(), torch::kFloat);
      if (on) {
        EXPECT_TRUE(torch::equal(out, bf16_forward(*model, b.input))) << "m(x) ran in bf16";
        EXPECT_FALSE(torch::equal(out, fp32));
      } else {
        EXPECT_TRUE(torch::equal(out, fp32));
      }
      EXPECT_TRUE(torch::equal(m->forward(b.input), fp32)) << "m->forward(x) is the model itself";
      acc.backward(torch::mse_loss(out, b.target));
      o.step();
      o.zero_grad();
      ++batches;
    }
    EXPECT_EQ(batches, 2);
    EXPECT_FALSE(cpu_autocast());
  }
}

// HF's traps, as HF behaves: a second forward of the batch after backward (a GAN step, a second
// loss) runs in bf16 like the first; an unprepared model (a teacher) runs in float32.
TEST(Autocast, ASecondForwardAfterBackwardIsBf16AndAnUnpreparedTeacherFloat32) {
  Accelerator acc({.mixed_precision = "bf16"});
  torch::manual_seed(5);
  auto student = torch::nn::Linear(3, 2);
  auto teacher = torch::nn::Linear(3, 2);
  auto opt =
      std::make_shared<torch::optim::SGD>(student->parameters(), torch::optim::SGDOptions(0.1));
  auto [m, o, dl] = acc.prepare(
      student, opt,
      DataLoader(std::make_shared<TensorDataset>(torch::randn({8, 3}), torch::randn({8, 2})),
                 {.batch_size = 4}));
  for (auto& b : dl) {
    torch::Tensor target;
    {
      torch::NoGradGuard no_grad;
      target = teacher->forward(b.input);
    }
    EXPECT_EQ(target.scalar_type(), torch::kFloat) << "the unprepared teacher";
    {
      torch::NoGradGuard no_grad;
      EXPECT_TRUE(torch::equal(target, torch::linear(b.input, teacher->weight, teacher->bias)));
    }
    acc.backward(torch::mse_loss(m(b.input), target));
    auto again = m(b.input);  // the second forward, after backward
    EXPECT_TRUE(torch::equal(again, bf16_forward(*student, b.input)));
    acc.backward(torch::mse_loss(again, b.target));
    o.step();
    o.zero_grad();
  }
}

// Autocast keeps bf16 copies of the weights while its scope lasts; a forward must never see
// copies older than the last step, whichever backward the program calls: every step's m(x) is
// exactly the forward from the current weights cast anew (gap 0), over steps that moved the
// weights far more than bf16's resolution.
TEST(Autocast, TheForwardNeverRunsOnStaleBf16WeightsWithEitherBackward) {
  for (std::string backward : {"plain", "accel"}) {
    SCOPED_TRACE("backward " + backward);
    Accelerator acc({.mixed_precision = "bf16"});
    torch::manual_seed(3);
    auto x = torch::randn({15 * 8, 16});
    auto y = torch::randn({15 * 8, 8});
    auto linear = torch::nn::Linear(16, 8);
    auto sgd =
        std::make_shared<torch::optim::SGD>(linear->parameters(), torch::optim::SGDOptions(0.5));
    auto [m, o, dl] = acc.prepare(
        linear, sgd, DataLoader(std::make_shared<TensorDataset>(x, y), {.batch_size = 8}));
    auto start = linear->weight.detach().clone();
    double gap = 0;
    int steps = 0;
    for (auto& b : dl) {
      auto out = m(b.input);
      gap =
          std::max(gap, (out.detach() - bf16_forward(*linear, b.input)).abs().max().item<double>());
      auto loss = torch::mse_loss(out, b.target);
      if (backward == "plain")
        loss.backward();
      else
        acc.backward(loss);
      o.step();
      o.zero_grad();
      ++steps;
    }
    EXPECT_EQ(steps, 15);
    EXPECT_EQ(gap, 0.0);
    EXPECT_GT((linear->weight.detach() - start).abs().max().item<double>(), 0.05)
        << "the weights barely moved: a stale copy could not show";
  }
}

// m->forward(x) is the model itself: a program that trains that way under mixed precision is
// told once, at its first backward, that nothing ran under autocast.
TEST(Autocast, AForwardThatNeverRanUnderAutocastIsToldOnce) {
  Accelerator acc({.mixed_precision = "bf16"});
  auto model = torch::nn::Linear(3, 1);
  auto m = acc.prepare(model);
  auto x = torch::randn({4, 3});
  ::testing::internal::CaptureStderr();
  acc.backward(m->forward(x).sum());
  acc.backward(m->forward(x).sum());
  std::string said = ::testing::internal::GetCapturedStderr();
  const std::string warning =
      "but no forward pass has run under autocast: call the prepared model "
      "as m(x)";
  auto first = said.find(warning);
  EXPECT_NE(first, std::string::npos) << said;
  EXPECT_EQ(said.find(warning, first + 1), std::string::npos) << "told twice:\n" << said;
  Accelerator other({.mixed_precision = "bf16"});
  auto n = other.prepare(torch::nn::Linear(3, 1));
  ::testing::internal::CaptureStderr();
  other.backward(n(x).sum());
  said = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(said.find(warning), std::string::npos) << said;
}

// A program's own acc.autocast() scope around two forward passes and backwards (a GAN step):
// the scope decides, the first backward does not end it.
TEST(Autocast, TheProgramsOwnScopeDecides) {
  Accelerator acc({.mixed_precision = "bf16"});
  auto model = torch::nn::Linear(3, 1);
  auto [m, dl] = acc.prepare(
      model, DataLoader(std::make_shared<TensorDataset>(torch::randn({4, 3}), torch::randn({4, 1})),
                        {.batch_size = 4}));
  for (auto& b : dl) {
    auto cast = acc.autocast();
    acc.backward(m->forward(b.input).to(torch::kFloat).sum());
    EXPECT_EQ(m->forward(b.input).scalar_type(), torch::kBFloat16) << "the second forward";
  }
  EXPECT_FALSE(cpu_autocast());
}

TEST(OptimizerHandle, SteppingTheOriginalOptimizerIsAnErrorNamingTheFix) {
  Accelerator acc;
  auto model = torch::nn::Linear(3, 1);
  auto adamw = std::make_shared<torch::optim::AdamW>(model->parameters());
  auto [m, o, dl] = acc.prepare(
      model, adamw,
      DataLoader(std::make_shared<TensorDataset>(torch::randn({8, 3}), torch::randn({8, 1})),
                 {.batch_size = 2}));
  std::string what;
  int steps = 0;
  try {
    for (auto& b : dl) {
      acc.backward(torch::mse_loss(m->forward(b.input), b.target));
      if (steps < 1) {
        o.step();  // through the prepared optimizer: fine
      } else {
        adamw->step();  // the original handle
      }
      o.zero_grad();
      ++steps;
    }
  } catch (const UsageError& e) {
    what = e.what();
  }
  EXPECT_EQ(steps, 2) << "noticed at the next backward()";
  EXPECT_NE(what.find("accel: prepared optimizer 0 (torch::optim::AdamW) was stepped through its "
                      "original handle: it has taken 2 steps, 1 more than went through the "
                      "prepared optimizer"),
            std::string::npos)
      << what;
}

}  // namespace
}  // namespace accel

namespace accel {
namespace {

// --- what an HF port calls: get_tracker, save/load, the folders, module holders ---------------

TEST(HfNames, GetTrackerWritesToThatTrackerAloneAndNamesTheOnesThatAreOn) {
  TempDir tmp;
  AcceleratorOptions o{.log_with = {"jsonl", "csv"}};
  o.project.logging_dir = tmp.path().string();
  Accelerator acc(o);
  EXPECT_EQ(acc.logging_dir(), tmp.path());
  EXPECT_TRUE(acc.project_dir().empty());
  acc.init_trackers("run");
  auto jsonl = acc.get_tracker("jsonl");
  jsonl.log({{"only_jsonl", 1.5}}, 7);
  acc.log({{"both", 2.0}}, 8);
  EXPECT_EQ(jsonl.file(), tmp.path() / "run" / "metrics.jsonl");
  auto lines = read_file(tmp.path() / "run" / "metrics.jsonl");
  EXPECT_NE(lines.find("\"only_jsonl\":1.5"), std::string::npos) << lines;
  EXPECT_NE(lines.find("\"both\":2.0"), std::string::npos) << lines;
  auto csv = read_file(tmp.path() / "run" / "metrics.csv");
  EXPECT_EQ(csv.find("only_jsonl"), std::string::npos) << csv;
  EXPECT_NE(csv.find("both"), std::string::npos) << csv;
  EXPECT_EQ(error_of([&] { acc.get_tracker("tensorboard"); }),
            "accel: get_tracker(\"tensorboard\"): not a tracker of this run (on: jsonl, csv)");
}

TEST(HfNames, LogWithTakesOneStringAListOrAll) {
  TempDir tmp;
  for (TrackerNames names : {TrackerNames("csv,jsonl"), TrackerNames{"csv", "jsonl"}}) {
    AcceleratorOptions o{.log_with = names};
    o.project.logging_dir = tmp.path().string();
    Accelerator acc(o);
    EXPECT_NO_THROW(acc.get_tracker("csv"));
    EXPECT_NO_THROW(acc.get_tracker("jsonl"));
  }
  Accelerator none({.log_with = "none"});
  EXPECT_NE(error_of([&] { none.get_tracker("csv"); }).find("none is on"), std::string::npos);
}

TEST(HfNames, SaveWritesWholeFilesAndLoadReadsThemBackIntoAnyModelHandle) {
  TempDir tmp;
  Accelerator acc;
  auto model = torch::nn::Linear(3, 2);
  auto m = acc.prepare(model);
  acc.save(m, tmp.path() / "sub" / "model.pt");
  acc.save(torch::arange(5), tmp.path() / "t.pt");
  auto fresh = torch::nn::Linear(3, 2);
  acc.load(fresh, tmp.path() / "sub" / "model.pt");
  EXPECT_TRUE(fresh->weight.equal(model->weight));
  torch::Tensor t;
  acc.load(t, tmp.path() / "t.pt");
  EXPECT_TRUE(t.equal(torch::arange(5)));
  for (const auto& e : fs::directory_iterator(tmp.path() / "sub"))
    EXPECT_EQ(e.path().filename(), "model.pt") << "a temporary file was left";
  EXPECT_EQ(error_of([&] { acc.load(t, tmp.path() / "missing.pt"); }),
            "accel: load from " + (tmp.path() / "missing.pt").string() + ": no such file");
  write_file(tmp.path() / "junk.pt", "not a torch file");
  auto what = error_of([&] { acc.load(fresh, tmp.path() / "junk.pt"); });
  EXPECT_EQ(what.rfind("accel: load from " + (tmp.path() / "junk.pt").string() +
                           ": it does not hold what is loaded into (",
                       0),
            0u)
      << what;
  EXPECT_TRUE(fresh->weight.equal(model->weight)) << "a failed load changed the model";

  // save_model, get_state_dict and load_model take the holder, the pointer and the prepared model.
  acc.save_model(model, tmp.path() / "st");
  acc.save_model(m, tmp.path() / "st2");
  acc.save_model(model.ptr(), tmp.path() / "st3");
  EXPECT_EQ(acc.get_state_dict(model).size(), 2u);
  EXPECT_EQ(acc.get_state_dict(m).size(), 2u);
  auto other = torch::nn::Linear(3, 2);
  load_model(other, tmp.path() / "st2");
  EXPECT_TRUE(other->weight.equal(model->weight));
  EXPECT_TRUE(load_checkpoint_in_model(other, tmp.path() / "st").missing.empty());
}

}  // namespace
}  // namespace accel

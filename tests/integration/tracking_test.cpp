// Experiment tracking end to end: train_lm on dict batches under accel-launch -n 2 --log-with
// tensorboard,jsonl, a worker killed after a checkpoint, the automatic resume; then the event
// file read back by an independent reader (tests/tracking/read_tfevents.py: its own CRC-32C,
// Python's protobuf) must hold the JSONL's losses, every step exactly once in both.
#include <gtest/gtest.h>
#include <signal.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tests/integration/harness.h"

namespace accel::testing {
namespace {

using json = nlohmann::json;

std::vector<json> json_lines(const std::string& text) {
  std::vector<json> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) out.push_back(json::parse(line));
  }
  return out;
}

// The highest step of a "loss" record in `file` so far (0: none yet).
int64_t last_logged_step(const fs::path& file) {
  std::ifstream in(file);
  int64_t last = 0;
  for (std::string line; std::getline(in, line);) {
    auto j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("loss")) last = std::max(last, j["step"].get<int64_t>());
  }
  return last;
}

std::string command_output(const std::string& command, int* status) {
  std::string out;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return out;
  char buffer[4096];
  for (std::size_t n; (n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0;) out.append(buffer, n);
  *status = ::pclose(pipe);
  return out;
}

TEST(Tracking, TrainLmLogsToTensorBoardAndJsonlAndAResumedRunLogsEveryStepOnce) {
  TempDir dir;
  const fs::path project = dir.path() / "project";
  const fs::path run = project / "train_lm";
  Launched job(dir,
               {"-n",
                "2",
                "--max-restarts",
                "1",
                "--project-dir",
                project.string(),
                "--checkpoint-interval",
                "4",
                "--log-with",
                "tensorboard,jsonl",
                "--",
                TRAIN_LM_BIN,
                "--sentences",
                "300",
                "--epochs",
                "2",
                "--dim",
                "32",
                "--block",
                "32",
                "--sample-chars",
                "0"},
               {{"OMP_NUM_THREADS", "1"}});
  // Killed once steps past the first checkpoint (step 4) are logged: the resumed run must drop
  // them and log them again.
  ASSERT_TRUE(wait_until([&] { return last_logged_step(run / "metrics.jsonl") >= 6; }, 60s))
      << "train_lm logged no step 6";
  auto workers = children_of(job.pid());
  ASSERT_EQ(workers.size(), 2u) << "the job ended before it could be killed";
  ::kill(workers[1], SIGKILL);
  auto r = job.wait(180s);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  ASSERT_NE(r.out.find("accel: resumed from"), std::string::npos) << r.out;

  auto jsonl = json_lines(read_file(run / "metrics.jsonl"));
  std::map<int64_t, double> loss;
  int64_t expected_step = 1;
  int epochs = 0;
  for (const auto& j : jsonl) {
    if (j.contains("epoch_loss")) ++epochs;
    if (!j.contains("loss")) continue;
    ASSERT_EQ(j["step"].get<int64_t>(), expected_step) << "a step is duplicated or missing";
    loss[expected_step++] = j["loss"].get<double>();
  }
  EXPECT_GE(loss.size(), 30u);
  EXPECT_GE(epochs, 1);
  EXPECT_LE(epochs, 2);

  std::vector<fs::path> events;
  for (const auto& e : fs::directory_iterator(run)) {
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0)
      events.push_back(e.path());
  }
  ASSERT_EQ(events.size(), 1u) << "one event file, continued after the resume";
  int status = -1;
  const std::string src = ACCEL_SOURCE_DIR;
  auto read = command_output("/usr/bin/python3 " + src + "/tests/tracking/read_tfevents.py " + src +
                                 "/runtime/tensorboard/event.proto '" + events[0].string() + "'",
                             &status);
  ASSERT_EQ(status, 0) << read;
  std::map<int64_t, double> tb_loss;
  for (const auto& j : json_lines(read)) {
    if (j["tag"] != "loss") continue;
    auto step = j["step"].get<int64_t>();
    EXPECT_EQ(tb_loss.count(step), 0u) << "step " << step << " twice in the event file";
    tb_loss[step] = j["value"].get<double>();
  }
  ASSERT_EQ(tb_loss.size(), loss.size());
  for (const auto& [step, value] : loss) {
    ASSERT_EQ(tb_loss.count(step), 1u) << "step " << step << " missing from the event file";
    EXPECT_EQ(static_cast<float>(tb_loss[step]), static_cast<float>(value)) << "step " << step;
  }
}

}  // namespace
}  // namespace accel::testing

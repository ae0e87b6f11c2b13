// One job path: each configuration key declared once (flags, default, worker variable), the one
// ClusterConfig -> JobSpec function, and the JobSpec <-> proto mapping.
#include "agent/common/job_spec.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/reflection.h>
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "agent/config/config_loader.h"
#include "agent/config/job_spec_builder.h"
#include "agent/config/key_flags.h"
#include "agent/coordinator/request_limits.h"
#include "agent/rpc/job_spec_proto.h"
#include "tests/common/paths.h"

namespace accel::config {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;

std::vector<FlagValue> parse_flags(unsigned tool, std::vector<std::string> args) {
  CLI::App app;
  KeyFlags keys(app, tool);
  std::vector<std::string> reversed(args.rbegin(), args.rend());
  app.parse(reversed);
  return keys.typed();
}

TEST(KeyTable, EveryKeyIsComplete) {
  std::set<std::string> spellings;
  for (const KeySpec& key : all_keys()) {
    SCOPED_TRACE(std::string(key.name));
    EXPECT_FALSE(key.accepts.empty());
    EXPECT_FALSE(key.help.empty());
    // The default must be a value the key accepts (it is what --print-config writes).
    ClusterConfig cfg;
    EXPECT_TRUE(key.set(cfg, default_text(key))) << default_text(key);
    EXPECT_EQ(key.get(cfg), default_text(key));
    if (key.tools == kFileOnly) continue;
    ASSERT_FALSE(key.flags.empty());
    // The first long flag is the key's own name, dashed: --num-processes for num_processes.
    std::string dashed(key.name);
    std::replace(dashed.begin(), dashed.end(), '_', '-');
    std::string flags(key.flags);
    EXPECT_NE(("," + flags + ",").find(",--" + dashed + ","), std::string::npos) << flags;
    for (size_t at = 0; at < flags.size();) {
      size_t comma = flags.find(',', at);
      std::string one = flags.substr(at, comma - at);
      EXPECT_TRUE(spellings.insert(one).second) << one << " is spelled by two keys";
      at = comma == std::string::npos ? flags.size() : comma + 1;
    }
    // A key without a value name is a switch: it must be a true/false key.
    if (key.metavar.empty()) {
      EXPECT_EQ(key.accepts, "true or false");
    }
  }
}

// The backticked words of a Markdown table cell: "`a`, `b`" -> {a, b}.
std::vector<std::string> backticked(const std::string& cell) {
  std::vector<std::string> out;
  for (size_t at = 0; (at = cell.find('`', at)) != std::string::npos;) {
    size_t end = cell.find('`', at + 1);
    if (end == std::string::npos) break;
    out.push_back(cell.substr(at + 1, end - at - 1));
    at = end + 1;
  }
  return out;
}

// docs/configuration.md's key table is checked against the key table it documents: a row per
// key, and in each row the default, the environment variable and the flags the code has (the
// prose columns are the page's own). A key added, renamed or given another default or flag
// without its row fails here, with the row's expected cells.
TEST(KeyTable, TheConfigurationPageRowsMatchTheKeyTable) {
  std::ifstream in(std::string(ACCEL_SOURCE_DIR) + "/docs/configuration.md");
  ASSERT_TRUE(in) << "docs/configuration.md";
  std::map<std::string, std::vector<std::string>> rows;  // key -> cells
  bool in_keys = false;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("## ", 0) == 0) in_keys = line == "## Keys";
    if (!in_keys || line.rfind("| `", 0) != 0) continue;
    std::vector<std::string> cells;
    for (size_t at = 1, bar; (bar = line.find(" |", at)) != std::string::npos; at = bar + 2) {
      cells.push_back(line.substr(at + 1, bar - at - 1));
    }
    for (const auto& key : backticked(cells.at(0))) rows[key] = cells;
  }
  const ClusterConfig defaults;
  std::set<std::string> documented;
  for (const KeySpec& key : all_keys()) {
    const std::string name(key.name);
    auto row = rows.find(name);
    if (row == rows.end()) {
      ADD_FAILURE() << name << " has no row in docs/configuration.md's Keys table";
      continue;
    }
    documented.insert(name);
    const auto& cells = row->second;
    ASSERT_EQ(cells.size(), 6u) << name << ": key | accepts | default | meaning | env | flag";
    if (backticked(cells[0]).size() > 1) continue;  // tls_cert, tls_key, tls_ca share a row
    std::string value = key.get(defaults);
    if (!value.empty()) {
      EXPECT_EQ(cells[2], "`" + value + "`") << name << "'s default";
    }
    EXPECT_EQ(backticked(cells[4]), std::vector<std::string>{env_var_for(name)}) << name;
    std::vector<std::string> flags;
    std::string spelled(key.flags);
    for (size_t at = 0; at <= spelled.size() && !spelled.empty();) {
      size_t comma = spelled.find(',', at);
      if (comma == std::string::npos) comma = spelled.size();
      flags.push_back(spelled.substr(at, comma - at));
      at = comma + 1;
    }
    auto shown = backticked(cells[5]);
    for (auto& f : shown) {
      if (f.rfind("accel-agent ", 0) == 0) f = f.substr(12);  // "accel-agent --retention"
    }
    EXPECT_EQ(shown, flags) << name << "'s flags";
  }
  for (const auto& [key, cells] : rows) {
    EXPECT_TRUE(documented.contains(key) || find_key(key) != nullptr)
        << key << " is in docs/configuration.md but is not a key";
  }
}

TEST(KeyTable, EachToolOffersItsKeysAsFlags) {
  auto typed = parse_flags(kLaunchFlag, {"-n", "3", "--cpu=false", "--log-level", "debug"});
  ASSERT_EQ(typed.size(), 3u);
  EXPECT_EQ(typed[0].key, "num_processes");
  EXPECT_EQ(typed[0].value, "3");
  EXPECT_EQ(typed[0].flag, "--num-processes");
  EXPECT_EQ(typed[1].key, "use_cpu");
  EXPECT_EQ(typed[1].value, "false");
  EXPECT_EQ(typed[2].key, "log_level");
  EXPECT_EQ(typed[2].value, "debug");

  auto agent = parse_flags(kAgentFlag, {"--retention", "2h", "--coordinator", "h:1", "-q"});
  ASSERT_EQ(agent.size(), 3u);  // in table order
  EXPECT_EQ(agent[0].key, "quiet");
  EXPECT_EQ(agent[0].value, "true");
  EXPECT_EQ(agent[1].key, "coordinator");
  EXPECT_EQ(agent[2].key, "retention");
  EXPECT_THROW(parse_flags(kAgentFlag, {"--num-processes", "2"}), CLI::ParseError);
  EXPECT_THROW(parse_flags(kStatusFlag, {"--retention", "1h"}), CLI::ParseError);
  EXPECT_EQ(parse_flags(kStatusFlag, {"--tls-ca", "ca.pem"}).at(0).key, "tls_ca");
}

TEST(KeyTable, HelpShowsTheDefaultFromTheConfigModel) {
  CLI::App app;
  KeyFlags keys(app, kLaunchFlag);
  std::string help = app.help();
  EXPECT_NE(help.find("Default: 30m."), std::string::npos) << help;  // collective_timeout
  EXPECT_NE(help.find("--log-level LEVEL"), std::string::npos) << help;
}

TEST(KeyTable, WorkerSettingsComeFromTheKeysMarkedForWorkers) {
  ClusterConfig cfg;
  ASSERT_TRUE(set_value(cfg, "mixed_precision", "bf16", {}));
  ASSERT_TRUE(set_value(cfg, "collective_timeout", "90s", {}));
  ASSERT_TRUE(set_value(cfg, "log_level", "warn", {}));
  std::map<std::string, std::string> expected = {{"ACCEL_MIXED_PRECISION", "bf16"},
                                                 {"ACCEL_GRADIENT_ACCUMULATION_STEPS", "1"},
                                                 {"ACCEL_USE_CPU", "false"},
                                                 {"ACCEL_DEBUG", "false"},
                                                 {"ACCEL_LOG_LEVEL", "warning"},
                                                 {"ACCEL_COLLECTIVE_TIMEOUT", "90s"},
                                                 {"ACCEL_CHECKPOINT_DIR", ""},
                                                 {"ACCEL_CHECKPOINT_INTERVAL", "0"},
                                                 {"ACCEL_ASYNC_CHECKPOINTS", "false"},
                                                 {"ACCEL_SNAPSHOT_INTERVAL", "0"},
                                                 {"ACCEL_ZERO_STAGE", "0"},
                                                 {"ACCEL_RESUME", "auto"},
                                                 {"ACCEL_PROJECT_DIR", ""},
                                                 {"ACCEL_LOG_WITH", ""}};
  EXPECT_EQ(worker_settings(cfg), expected);
  ASSERT_TRUE(set_value(cfg, "log_with", " JSONL, tensorboard ", {}));
  EXPECT_EQ(worker_settings(cfg)["ACCEL_LOG_WITH"], "jsonl,tensorboard");
  auto bad = set_value(cfg, "log_with", "jsonl,wandb", {});
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.message().find("unknown tracker 'wandb'; expected tensorboard, jsonl, csv or all"),
            std::string::npos)
      << bad.message();
}

TEST(KeyTable, EnvCannotSetWhatAKeySets) {
  EXPECT_EQ(set_by_key("ACCEL_MIXED_PRECISION").value_or(""),
            "ACCEL_MIXED_PRECISION comes from the launch configuration; use --mixed-precision (or "
            "the config key mixed_precision) instead");
  EXPECT_EQ(set_by_key("ACCELERATE_DEBUG_MODE").value_or(""),
            "ACCELERATE_DEBUG_MODE comes from the launch configuration; use --debug (or the "
            "config key debug) instead");
  EXPECT_FALSE(set_by_key("ACCEL_CHECKPOINT_TOTAL_LIMIT"));  // no key: the user's to set
  EXPECT_FALSE(set_by_key("ACCEL_NUM_PROCESSES"));           // the launcher's, not a worker's
}

TEST(JobSpecBuilder, OneFunctionForEveryMode) {
  ClusterConfig cfg;
  ASSERT_TRUE(set_value(cfg, "nodes", "2:4", {}));
  ASSERT_TRUE(set_value(cfg, "num_processes", "3", {}));
  ASSERT_TRUE(set_value(cfg, "checkpoint_dir", "ck/../ck2", {}));
  ASSERT_TRUE(set_value(cfg, "log_dir", "logs", {}));
  ASSERT_TRUE(set_value(cfg, "hang_timeout", "0", {}));
  auto spec = make_job_spec(cfg, {"/bin/true", "--x"}, {{"FOO", "1"}});
  ASSERT_TRUE(spec) << spec.message();
  EXPECT_EQ(spec->argv, (std::vector<std::string>{"/bin/true", "--x"}));
  EXPECT_EQ(spec->processes_per_node, 3);
  EXPECT_EQ(spec->min_nodes, 2);
  EXPECT_EQ(spec->max_nodes, 4);
  EXPECT_EQ(spec->join_timeout, cfg.join_timeout);
  EXPECT_EQ(spec->stop_timeout, milliseconds(10'000));
  EXPECT_EQ(spec->hang_timeout, milliseconds(0));
  EXPECT_EQ(spec->tee, 3);
  EXPECT_EQ(spec->extra_env.at("FOO"), "1");
  std::string cwd = fs::current_path().string();
  EXPECT_EQ(spec->working_dir, cwd);
  // Folders absolute: every rank, node and restart must agree on them.
  EXPECT_EQ(spec->worker_settings.at("ACCEL_CHECKPOINT_DIR"), cwd + "/ck2");
  EXPECT_EQ(spec->log_dir, cwd + "/logs");
  EXPECT_NE(spec->submitted_by.find('@'), std::string::npos);
}

TEST(JobSpecProto, EveryFieldIsMappedBothWays) {
  JobSpec spec;
  spec.argv = {"/bin/prog", "a"};
  spec.working_dir = "/w";
  spec.processes_per_node = 2;
  spec.min_nodes = 1;
  spec.max_nodes = 3;
  spec.max_restarts = 4;
  spec.join_timeout = milliseconds(5);
  spec.last_call = milliseconds(6);
  spec.stop_timeout = milliseconds(7);
  spec.heartbeat_timeout = milliseconds(8);
  spec.hang_timeout = milliseconds(9);
  spec.network_timeout = milliseconds(10);
  spec.straggler_threshold = 2.5;
  spec.straggler_window = milliseconds(11);
  spec.stall_timeout = milliseconds(12);
  spec.forward_logs = true;
  spec.master_port = 29500;
  spec.worker_settings = {{"ACCEL_MIXED_PRECISION", "bf16"}};
  spec.extra_env = {{"FOO", "bar"}};
  spec.omp_num_threads = 5;
  spec.log_dir = "/logs";
  spec.tee = 2;
  spec.submitted_by = "me@here";
  v1::JobSpec p = rpc::to_proto(spec);
  // Every field of the message is filled: a field added to the proto and not to the mapping
  // fails here.
  const auto* desc = p.GetDescriptor();
  const auto* refl = p.GetReflection();
  for (int i = 0; i < desc->field_count(); ++i) {
    const auto* field = desc->field(i);
    bool set = field->is_repeated() ? refl->FieldSize(p, field) > 0 : refl->HasField(p, field);
    EXPECT_TRUE(set) << field->name() << " is not mapped from JobSpec";
  }
  JobSpec back = rpc::from_proto(p);
  EXPECT_EQ(rpc::to_proto(back).SerializeAsString(), p.SerializeAsString());
  EXPECT_EQ(back.worker_settings, spec.worker_settings);
  EXPECT_EQ(back.hang_timeout, spec.hang_timeout);
  EXPECT_EQ(back.network_timeout, spec.network_timeout);
}

TEST(JobSpecProto, TheCoordinatorTakesOnlyAccelWorkerSettings) {
  ClusterConfig cfg;
  auto spec = make_job_spec(cfg, {"/bin/true"}, {});
  ASSERT_TRUE(spec);
  v1::JobSpec p = rpc::to_proto(*spec);
  EXPECT_EQ(coordinator::limits::check(p), "");
  (*p.mutable_worker_settings())["RANK"] = "0";
  EXPECT_EQ(coordinator::limits::check(p), "worker setting 'RANK' is not an ACCEL_* variable name");
  p.mutable_worker_settings()->erase("RANK");
  p.set_tee(4);
  EXPECT_EQ(coordinator::limits::check(p), "tee must be 0..3, got 4");
}

}  // namespace
}  // namespace accel::config

// ClusterConfig: YAML parsing, every bad-input message, precedence by presence, rendering.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "agent/config/config_loader.h"
#include "tests/common/paths.h"

namespace accel::config {
namespace {

std::string load_error(const std::string& yaml) {
  ClusterConfig cfg;
  Status s = load_yaml_text(cfg, yaml, "cluster.yaml");
  EXPECT_FALSE(s.is_ok()) << "accepted: " << yaml;
  return s.message();
}

TEST(ConfigYaml, ReadsEveryKindOfValue) {
  ClusterConfig cfg;
  ASSERT_TRUE(load_yaml_text(cfg, R"(
num_processes: 4
nodes: "2:3"
machine_rank: 1
main_process_ip: 10.1.2.3
main_process_port: 29501
max_restarts: 3
log_dir: /tmp/logs
tee: 2
mixed_precision: bf16
gradient_accumulation_steps: 8
use_cpu: yes
debug: true
stop_timeout: 1500ms
num_cpu_threads_per_process: 2
job_id: my-job.1
quiet: false
checkpoint_dir: ck/run 1
checkpoint_interval: 50
)",
                             "cluster.yaml")
                  .is_ok());
  EXPECT_EQ(cfg.num_processes, 4);
  EXPECT_EQ(cfg.nodes, (NodeRange{2, 3}));
  EXPECT_EQ(cfg.machine_rank, 1);
  EXPECT_EQ(cfg.main_process_ip, "10.1.2.3");
  EXPECT_EQ(cfg.main_process_port, 29501);
  EXPECT_EQ(cfg.max_restarts, 3);
  EXPECT_EQ(cfg.log_dir, "/tmp/logs");
  EXPECT_EQ(cfg.tee, 2);
  EXPECT_EQ(cfg.mixed_precision, MixedPrecision::kBf16);
  EXPECT_EQ(cfg.gradient_accumulation_steps, 8);
  EXPECT_TRUE(cfg.use_cpu);
  EXPECT_TRUE(cfg.debug);
  EXPECT_EQ(cfg.stop_timeout, std::chrono::milliseconds(1500));
  EXPECT_EQ(cfg.num_cpu_threads_per_process, 2);
  EXPECT_EQ(cfg.job_id, "my-job.1");
  EXPECT_FALSE(cfg.quiet);
  EXPECT_EQ(cfg.checkpoint_dir, "ck/run 1");  // kept relative here; the launcher makes it absolute
  EXPECT_EQ(cfg.checkpoint_interval, 50);
  EXPECT_EQ(cfg.origin("checkpoint_interval").where, "cluster.yaml:19:22");
  EXPECT_EQ(cfg.origin("num_processes").source, Source::kFile);
  EXPECT_EQ(cfg.origin("num_processes").where, "cluster.yaml:2:16");
  EXPECT_EQ(cfg.origin("quiet").source, Source::kFile);
}

TEST(ConfigYaml, EmptyFileMeansDefaults) {
  ClusterConfig cfg;
  ASSERT_TRUE(load_yaml_text(cfg, "", "empty.yaml").is_ok());
  ASSERT_TRUE(load_yaml_text(cfg, "# only a comment\n", "c.yaml").is_ok());
  EXPECT_EQ(cfg.num_processes, 1);
  EXPECT_EQ(cfg.main_process_port, 0);
  EXPECT_EQ(cfg.origin("num_processes").source, Source::kDefault);
  EXPECT_EQ(cfg.checkpoint_dir, "");
  EXPECT_EQ(cfg.checkpoint_interval, 0);
  EXPECT_TRUE(validate(cfg).is_ok());
}

TEST(ConfigYaml, NegativeProcessCount) {
  EXPECT_EQ(load_error("num_processes: -3\n"),
            "cluster.yaml:1:16: num_processes: expected an integer from 1 to 4096, or auto, gpu or "
            "cpu, got '-3'");
}

TEST(ConfigYaml, InvertedNodeRange) {
  EXPECT_EQ(load_error("num_processes: 2\nnodes: \"4:2\"\n"),
            "cluster.yaml:2:8: nodes: minimum 4 is larger than maximum 2 in '4:2' (write MIN:MAX)");
}

TEST(ConfigYaml, PortOutOfRange) {
  EXPECT_EQ(
      load_error("main_process_port: 70000\n"),
      "cluster.yaml:1:20: main_process_port: expected an integer from 0 to 65535, got '70000'");
}

TEST(ConfigYaml, UnknownKeySuggestsNearest) {
  EXPECT_EQ(load_error("num_processes: 2\nnum_proceses: 4\n"),
            "cluster.yaml:2:1: unknown key 'num_proceses' (did you mean 'num_processes'?)");
  EXPECT_EQ(load_error("max-restarts: 4\n"),
            "cluster.yaml:1:1: unknown key 'max-restarts' (did you mean 'max_restarts'?)");
  // Nothing near: list the valid keys instead of a silly guess.
  std::string far = load_error("telemetry_endpoint: http://x\n");
  EXPECT_EQ(far.rfind("cluster.yaml:1:1: unknown key 'telemetry_endpoint' (valid keys: "
                      "num_processes, nodes, ",
                      0),
            0u)
      << far;
}

TEST(ConfigYaml, WrongTypes) {
  EXPECT_EQ(load_error("num_processes: two\n"),
            "cluster.yaml:1:16: num_processes: expected an integer from 1 to 4096, or auto, gpu or "
            "cpu, got 'two'");
  EXPECT_EQ(load_error("num_processes: 2.5\n"),
            "cluster.yaml:1:16: num_processes: expected an integer from 1 to 4096, or auto, gpu or "
            "cpu, got '2.5'");
  EXPECT_EQ(load_error("num_processes: [1, 2]\n"),
            "cluster.yaml:1:16: num_processes: expected an integer from 1 to 4096, or auto, gpu or "
            "cpu, got a list");
  EXPECT_EQ(load_error("use_cpu: maybe\n"),
            "cluster.yaml:1:10: use_cpu: expected true or false, got 'maybe'");
  EXPECT_EQ(load_error("mixed_precision: fp8\n"),
            "cluster.yaml:1:18: mixed_precision: expected one of no, fp16, bf16, got 'fp8'");
  EXPECT_EQ(
      load_error("collective_timeout: 0s\n"),
      "cluster.yaml:1:21: collective_timeout: expected a positive duration such as 10s, 500ms "
      "or 2m, got '0s'");
  EXPECT_EQ(load_error("stop_timeout: soon\n"),
            "cluster.yaml:1:15: stop_timeout: expected a positive duration such as 10s, 500ms or "
            "2m, got 'soon'");
  EXPECT_EQ(load_error("nodes: two\n"),
            "cluster.yaml:1:8: nodes: expected a node count N or a range MIN:MAX such as \"2:4\", "
            "got 'two'");
  EXPECT_EQ(load_error("max_restarts:\n"),
            "cluster.yaml:1:1: max_restarts: expected an integer >= 0, got nothing");
  EXPECT_EQ(load_error("checkpoint_interval: -5\n"),
            "cluster.yaml:1:22: checkpoint_interval: expected an integer >= 0, got '-5'");
  EXPECT_EQ(load_error("checkpoint_interval: 2.5\n"),
            "cluster.yaml:1:22: checkpoint_interval: expected an integer >= 0, got '2.5'");
  EXPECT_EQ(load_error("checkpoint_interval: often\n"),
            "cluster.yaml:1:22: checkpoint_interval: expected an integer >= 0, got 'often'");
  EXPECT_EQ(load_error("job_id: ../etc\n"),
            "cluster.yaml:1:9: job_id: expected 1-64 characters of [A-Za-z0-9._-] not starting "
            "with '.', got '../etc'");
}

TEST(ConfigYaml, StructuralErrors) {
  EXPECT_EQ(load_error("- 1\n- 2\n"),
            "cluster.yaml:1:1: expected a mapping of keys to values at the top level, got a list");
  std::string syntax = load_error("num_processes: [1, 2\n");
  EXPECT_EQ(syntax.rfind("cluster.yaml:", 0), 0u) << syntax;
  EXPECT_NE(syntax.find("not valid YAML"), std::string::npos) << syntax;
}

TEST(ConfigYaml, CrossKeyValidation) {
  ClusterConfig cfg;
  ASSERT_TRUE(load_yaml_text(cfg, "nodes: 2\nmachine_rank: 2\n", "c.yaml").is_ok());
  Status s = validate(cfg);
  EXPECT_EQ(s.message(),
            "c.yaml:2:15: machine_rank: 2 is not below the number of nodes (2); machine ranks "
            "run from 0 to nodes - 1");
}

TEST(ConfigYaml, CheckpointIntervalNeedsCheckpointDir) {
  ClusterConfig cfg;
  ASSERT_TRUE(load_yaml_text(cfg, "checkpoint_interval: 50\n", "c.yaml").is_ok());
  EXPECT_EQ(
      validate(cfg).message(),
      "c.yaml:1:22: checkpoint_interval: 50 needs checkpoint_dir or project_dir (where to save)");
  ASSERT_TRUE(load_yaml_text(cfg, "checkpoint_dir: ck\n", "c.yaml").is_ok());
  EXPECT_TRUE(validate(cfg).is_ok());
  // A directory alone is fine: libaccel then saves only when the program calls save_state().
  ClusterConfig dir_only;
  ASSERT_TRUE(load_yaml_text(dir_only, "checkpoint_dir: ck\n", "c.yaml").is_ok());
  EXPECT_TRUE(validate(dir_only).is_ok());
}

TEST(ConfigDuration, ParsesUnits) {
  EXPECT_EQ(parse_duration("10"), std::chrono::milliseconds(10'000));
  EXPECT_EQ(parse_duration("0.5s"), std::chrono::milliseconds(500));
  EXPECT_EQ(parse_duration("250ms"), std::chrono::milliseconds(250));
  EXPECT_EQ(parse_duration("2m"), std::chrono::milliseconds(120'000));
  EXPECT_EQ(parse_duration("1h"), std::chrono::milliseconds(3'600'000));
  EXPECT_FALSE(parse_duration("-1s"));
  EXPECT_FALSE(parse_duration("5 parsecs"));
  EXPECT_FALSE(parse_duration(""));
  EXPECT_EQ(format_duration(std::chrono::milliseconds(1500)), "1500ms");
  EXPECT_EQ(format_duration(std::chrono::milliseconds(120'000)), "2m");
}

class ConfigSourcesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("accel_config_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& text) {
    auto path = dir_ / name;
    std::filesystem::create_directories(path.parent_path());
    std::ofstream(path) << text;
    return path.string();
  }
  std::filesystem::path dir_;
};

TEST_F(ConfigSourcesTest, FlagBeatsEnvBeatsFileBeatsDefault) {
  std::string file = write("c.yaml", "num_processes: 2\nmax_restarts: 5\nmixed_precision: fp16\n");
  ConfigSources src;
  src.config_file = file;
  src.env = {{"ACCEL_NUM_PROCESSES", "3"}, {"ACCEL_MAX_RESTARTS", "6"}};
  src.flags = {{"num_processes", "4", "--num-processes"}};
  auto r = resolve_config(src);
  ASSERT_TRUE(r.is_ok()) << r.message();
  const ClusterConfig& c = r->config;
  EXPECT_EQ(c.num_processes, 4);                        // flag
  EXPECT_EQ(c.max_restarts, 6);                         // env
  EXPECT_EQ(c.mixed_precision, MixedPrecision::kFp16);  // file
  EXPECT_EQ(c.tee, 3);                                  // default
  EXPECT_EQ(c.origin("num_processes").where, "flag --num-processes");
  EXPECT_EQ(c.origin("max_restarts").where, "environment variable ACCEL_MAX_RESTARTS");
  EXPECT_EQ(c.origin("mixed_precision").where, file + ":3:18");
  EXPECT_EQ(c.origin("tee").source, Source::kDefault);
}

TEST_F(ConfigSourcesTest, CheckpointKeysFollowPrecedence) {
  std::string file = write("c.yaml", "checkpoint_dir: file_ck\ncheckpoint_interval: 10\n");
  ConfigSources src;
  src.config_file = file;
  auto r = resolve_config(src);
  ASSERT_TRUE(r.is_ok()) << r.message();
  EXPECT_EQ(r->config.checkpoint_dir, "file_ck");
  EXPECT_EQ(r->config.checkpoint_interval, 10);

  src.env = {{"ACCEL_CHECKPOINT_DIR", "env_ck"}, {"ACCEL_CHECKPOINT_INTERVAL", "20"}};
  r = resolve_config(src);
  ASSERT_TRUE(r.is_ok()) << r.message();
  EXPECT_EQ(r->config.checkpoint_dir, "env_ck");
  EXPECT_EQ(r->config.checkpoint_interval, 20);
  EXPECT_EQ(r->config.origin("checkpoint_dir").where, "environment variable ACCEL_CHECKPOINT_DIR");

  src.flags = {{"checkpoint_dir", "flag_ck", "--checkpoint-dir"},
               {"checkpoint_interval", "0", "--checkpoint-interval"}};
  r = resolve_config(src);
  ASSERT_TRUE(r.is_ok()) << r.message();
  EXPECT_EQ(r->config.checkpoint_dir, "flag_ck");
  EXPECT_EQ(r->config.checkpoint_interval, 0);  // a typed 0 beats the env's 20
  EXPECT_EQ(r->config.origin("checkpoint_interval").where, "flag --checkpoint-interval");
}

TEST_F(ConfigSourcesTest, CheckpointErrorsNameTheirSource) {
  auto resolve_error = [](const ConfigSources& src) {
    auto r = resolve_config(src);
    EXPECT_FALSE(r.is_ok()) << "accepted";
    return r.message();
  };
  ConfigSources src;
  src.env = {{"ACCEL_CHECKPOINT_INTERVAL", "3"}};
  EXPECT_EQ(resolve_error(src),
            "environment variable ACCEL_CHECKPOINT_INTERVAL: checkpoint_interval: 3 needs "
            "checkpoint_dir or project_dir (where to save)");
  src.env = {{"ACCEL_CHECKPOINT_INTERVAL", "-1"}};
  EXPECT_EQ(resolve_error(src),
            "environment variable ACCEL_CHECKPOINT_INTERVAL: checkpoint_interval: expected an "
            "integer >= 0, got '-1'");
  src.env.clear();
  src.flags = {{"checkpoint_interval", "5x", "--checkpoint-interval"}};
  EXPECT_EQ(resolve_error(src),
            "flag --checkpoint-interval: checkpoint_interval: expected an integer >= 0, got '5x'");
  // An empty flag turns a file's checkpoint_dir off, so the file's interval is then an error.
  src.config_file = write("c.yaml", "checkpoint_dir: ck\ncheckpoint_interval: 7\n");
  src.flags = {{"checkpoint_dir", "", "--checkpoint-dir"}};
  EXPECT_EQ(
      resolve_error(src),
      *src.config_file +
          ":2:22: checkpoint_interval: 7 needs checkpoint_dir or project_dir (where to save)");
}

TEST_F(ConfigSourcesTest, AFlagEqualToTheDefaultStillWins) {
  // HF Accelerate's bug: a flag with a non-null default is never taken from the file. Here
  // presence decides: absent, the file wins; typed, the flag wins even at the default value.
  std::string file = write("c.yaml", "max_restarts: 5\n");
  ConfigSources src;
  src.config_file = file;
  src.flags = {{"max_restarts", "0", "--max-restarts"}};
  auto r = resolve_config(src);
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r->config.max_restarts, 0);
  src.flags.clear();
  r = resolve_config(src);
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r->config.max_restarts, 5);
}

TEST_F(ConfigSourcesTest, BadEnvAndFlagValuesNameTheirSource) {
  ConfigSources src;
  src.env = {{"ACCEL_NUM_PROCESSES", "lots"}};
  auto r = resolve_config(src);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.message(),
            "environment variable ACCEL_NUM_PROCESSES: num_processes: expected an integer from 1 "
            "to 4096, or auto, gpu or cpu, got 'lots'");
  src.env.clear();
  src.flags = {{"main_process_port", "70000", "--main-process-port"}};
  r = resolve_config(src);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.message(),
            "flag --main-process-port: main_process_port: expected an integer from 0 to 65535, "
            "got '70000'");
}

TEST_F(ConfigSourcesTest, EmptyEnvVarIsUnset) {
  ConfigSources src;
  src.env = {{"ACCEL_LOG_DIR", ""}};
  auto r = resolve_config(src);
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r->config.origin("log_dir").source, Source::kDefault);
}

TEST_F(ConfigSourcesTest, DefaultLocationOrder) {
  EXPECT_EQ(default_config_path({{"HOME", "/h"}}), "/h/.config/accel/config.yaml");
  EXPECT_EQ(default_config_path({{"HOME", "/h"}, {"XDG_CONFIG_HOME", "/x"}}),
            "/x/accel/config.yaml");
  EXPECT_EQ(default_config_path({{"HOME", "/h"}, {"XDG_CONFIG_HOME", "/x"}, {"ACCEL_HOME", "/a"}}),
            "/a/config.yaml");
  EXPECT_EQ(default_config_path({}), "");
}

TEST_F(ConfigSourcesTest, ReadsDefaultFileWhenPresent) {
  write("home/.config/accel/config.yaml", "num_processes: 3\n");
  ConfigSources src;
  src.env = {{"HOME", (dir_ / "home").string()}};
  auto r = resolve_config(src);
  ASSERT_TRUE(r.is_ok()) << r.message();
  EXPECT_EQ(r->config.num_processes, 3);
  EXPECT_EQ(r->file_reason, "default location");

  src.env = {{"HOME", (dir_ / "nowhere").string()}};
  r = resolve_config(src);
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r->file, "");
}

TEST_F(ConfigSourcesTest, ExplicitFileMustExist) {
  ConfigSources src;
  src.config_file = (dir_ / "missing.yaml").string();
  auto r = resolve_config(src);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.message(),
            (dir_ / "missing.yaml").string() +
                ": config file (from --config) does not exist or is not a regular file");
  src.config_file.reset();
  src.env = {{"ACCEL_CONFIG_FILE", (dir_ / "gone.yaml").string()}};
  r = resolve_config(src);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.message().find("(from ACCEL_CONFIG_FILE)"), std::string::npos);
}

// A huge config file is refused before yaml-cpp reads it (48 MB once took 2.9 GB and 13 s), and
// an error never echoes a whole huge or binary value.
TEST_F(ConfigSourcesTest, AHugeFileIsRefusedUnreadAndErrorsQuoteAtMost80BytesOfAValue) {
  auto big = dir_ / "big.yaml";
  {
    std::ofstream out(big);
    out << "num_processes: 2\n# " << std::string(kMaxConfigFileBytes, 'x') << "\n";
  }
  ConfigSources src;
  src.config_file = big.string();
  auto r = resolve_config(src);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.message().find(big.string() + ": the config file is "), std::string::npos)
      << r.message();
  EXPECT_NE(r.message().find("the most accepted is 1048576"), std::string::npos) << r.message();

  std::string huge(50'000, 'v');
  auto msg = load_error("main_process_ip: " + huge + "\n");
  EXPECT_LT(msg.size(), 300u) << "echoed the whole value";
  EXPECT_NE(msg.find("(50000 bytes)"), std::string::npos) << msg;
  auto key = load_error(std::string(10'000, 'k') + ": 1\n");
  EXPECT_LT(key.size(), 1200u);
  auto ctrl = load_error("mixed_precision: \"bf\\e[31m16\"\n");
  EXPECT_EQ(ctrl.find('\x1b'), std::string::npos) << "a terminal escape reached the message";
  EXPECT_NE(ctrl.find("\\x1b"), std::string::npos) << ctrl;
}

TEST(ConfigExamples, ShippedClusterYamlLoads) {
  ClusterConfig cfg;
  Status s = load_yaml_file(cfg, std::string(ACCEL_SOURCE_DIR) + "/configs/cluster.yaml");
  ASSERT_TRUE(s.is_ok()) << s.message();
  EXPECT_EQ(cfg.num_processes, 2);
  EXPECT_EQ(cfg.max_restarts, 3);
  EXPECT_EQ(cfg.mixed_precision, MixedPrecision::kNo);
}

TEST_F(ConfigSourcesTest, RenderShowsValuesAndOrigins) {
  std::string file = write("c.yaml", "nodes: 1:1\nlog_dir: /tmp/x y\n");
  ConfigSources src;
  src.config_file = file;
  src.flags = {{"num_processes", "2", "-n"}};
  auto r = resolve_config(src);
  ASSERT_TRUE(r.is_ok()) << r.message();
  std::string text = render_config(*r);
  EXPECT_NE(text.find("num_processes: 2"), std::string::npos) << text;
  EXPECT_NE(text.find("# flag -n"), std::string::npos) << text;
  EXPECT_NE(text.find("log_dir: /tmp/x y"), std::string::npos) << text;
  EXPECT_NE(text.find("# " + file + ":2:10"), std::string::npos) << text;
  EXPECT_NE(text.find("max_restarts: 0"), std::string::npos) << text;
  EXPECT_NE(text.find("checkpoint_dir: \"\""), std::string::npos) << text;
  EXPECT_NE(text.find("checkpoint_interval: 0"), std::string::npos) << text;
  EXPECT_NE(text.find("# default"), std::string::npos) << text;
  // What it prints loads back to the same values.
  ClusterConfig again;
  ASSERT_TRUE(load_yaml_text(again, text, "rendered").is_ok()) << text;
  EXPECT_EQ(again.num_processes, 2);
  EXPECT_EQ(again.log_dir, "/tmp/x y");
}

}  // namespace
}  // namespace accel::config

// How PROGRAM becomes the workers' argv: .py under Python, -m, --no-python, PATH lookup.
#include "launcher/program.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>

namespace accel::launcher {
namespace {

class ProgramTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("accel_program_test_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_ / "bin");
    make_file("bin/python3", true);
    make_file("bin/tool", true);
    make_file("bin/data.txt", false);
    make_file("train.py", false);
    env_ = {{"PATH", (dir_ / "bin").string() + ":/usr/bin"}};
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  void make_file(const std::string& name, bool exec) {
    std::ofstream(dir_ / name) << "#!/bin/sh\n";
    ::chmod((dir_ / name).c_str(), exec ? 0755 : 0644);
  }
  std::string p(const std::string& name) { return (dir_ / name).string(); }
  std::filesystem::path dir_;
  Env env_;
};

TEST_F(ProgramTest, PythonScriptRunsUnderPython3FromPath) {
  auto argv = resolve_command({p("train.py"), {"--lr", "1"}, std::nullopt, false}, env_);
  ASSERT_TRUE(argv.is_ok()) << argv.message();
  EXPECT_EQ(*argv, (std::vector<std::string>{p("bin/python3"), "-u", p("train.py"), "--lr", "1"}));
}

TEST_F(ProgramTest, PythonExecOverrides) {
  env_["PYTHON_EXEC"] = p("bin/tool");
  auto argv = resolve_command({p("train.py"), {}, std::nullopt, false}, env_);
  ASSERT_TRUE(argv.is_ok());
  EXPECT_EQ(argv->front(), p("bin/tool"));
  env_["PYTHON_EXEC"] = "no-such-python";
  argv = resolve_command({p("train.py"), {}, std::nullopt, false}, env_);
  ASSERT_FALSE(argv.is_ok());
  EXPECT_NE(argv.message().find("cannot find the Python interpreter ($PYTHON_EXEC)"),
            std::string::npos)
      << argv.message();
}

TEST_F(ProgramTest, ModuleRunsWithDashM) {
  auto argv = resolve_command({"", {"a"}, std::string("pkg.train"), false}, env_);
  ASSERT_TRUE(argv.is_ok());
  EXPECT_EQ(*argv, (std::vector<std::string>{p("bin/python3"), "-u", "-m", "pkg.train", "a"}));
  EXPECT_FALSE(resolve_command({"", {}, std::string("pkg"), true}, env_).is_ok());
}

TEST_F(ProgramTest, NoPythonRunsAsGiven) {
  make_file("run.py", true);
  auto argv = resolve_command({p("run.py"), {"x"}, std::nullopt, true}, env_);
  ASSERT_TRUE(argv.is_ok());
  EXPECT_EQ(*argv, (std::vector<std::string>{p("run.py"), "x"}));
}

TEST_F(ProgramTest, PathLookupAndErrors) {
  auto tool = resolve_command({"tool", {}, std::nullopt, false}, env_);
  ASSERT_TRUE(tool.is_ok());
  EXPECT_EQ(tool->front(), p("bin/tool"));
  auto data = resolve_command({"data.txt", {}, std::nullopt, false}, env_);
  ASSERT_FALSE(data.is_ok());  // not executable: skipped on PATH
  EXPECT_NE(data.message().find("'data.txt' not found on PATH"), std::string::npos);
  auto direct = resolve_command({p("bin/data.txt"), {}, std::nullopt, false}, env_);
  ASSERT_FALSE(direct.is_ok());
  EXPECT_EQ(
      direct.message(),
      p("bin/data.txt") + ": not executable (chmod +x it, or run it through its interpreter)");
  auto missing_script = resolve_command({p("nope.py"), {}, std::nullopt, false}, env_);
  ASSERT_FALSE(missing_script.is_ok());
  EXPECT_EQ(missing_script.message(), p("nope.py") + ": Python script not found");
  EXPECT_FALSE(resolve_command({"", {}, std::nullopt, false}, env_).is_ok());
}

}  // namespace
}  // namespace accel::launcher

// Where a test finds the programs it runs and the checkout's own files, resolved at run time from
// the place of the running test program. The build passes only paths relative to its bin folder,
// so a test unit compiles to the same command in every checkout and ccache can share it; an
// absolute path in a compile definition made every new clone compile the tests again.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <system_error>

#ifndef ACCEL_SOURCE_FROM_BIN
#error "ACCEL_SOURCE_FROM_BIN (the checkout, relative to the build's bin folder) is not defined"
#endif

namespace accel::testing {

// The folder of the running test program: the build's bin folder, beside every program it makes.
inline const std::filesystem::path& test_bin_dir() {
  static const std::filesystem::path dir = [] {
    std::error_code ec;
    auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (ec) {
      std::fprintf(stderr, "test setup: cannot read /proc/self/exe: %s\n", ec.message().c_str());
      std::abort();
    }
    return self.parent_path();
  }();
  return dir;
}

// `name` in `under`, made absolute; the string lives as long as the process. A missing file is
// left to the test that runs or reads it, which then fails alone with the path in its message.
inline const char* resolved_test_path(const std::filesystem::path& under, const std::string& name) {
  static std::mutex mu;
  static std::map<std::string, std::string> known;
  const std::string key = (under / name).lexically_normal().string();
  std::lock_guard<std::mutex> lock(mu);
  auto it = known.find(key);
  if (it == known.end()) {
    std::error_code ec;
    auto path = std::filesystem::weakly_canonical(key, ec);
    it = known.emplace(key, ec ? key : path.string()).first;
  }
  return it->second.c_str();
}

// A program the build made (its target's name), e.g. built_program("accel-launch").
inline const char* built_program(const std::string& name) {
  return resolved_test_path(test_bin_dir(), name);
}

// The checkout the test program was built from.
inline const char* source_dir() {
  return resolved_test_path(test_bin_dir(), ACCEL_SOURCE_FROM_BIN);
}

}  // namespace accel::testing

// The names the tests have always used for these paths.
#define ACCEL_SOURCE_DIR (::accel::testing::source_dir())
#define ACCEL_LAUNCH_BIN (::accel::testing::built_program("accel-launch"))
#define ACCEL_AGENT_BIN (::accel::testing::built_program("accel-agent"))
#define ACCEL_BIN (::accel::testing::built_program("accel"))
#define CONTROL_WORKER_BIN (::accel::testing::built_program("control_worker"))
#define TRAIN_MLP_BIN (::accel::testing::built_program("train_mlp"))
#define RUNTIME_WORKER_BIN (::accel::testing::built_program("runtime_worker"))
#define STORE_CLIENT_BIN (::accel::testing::built_program("store_client"))
#define TRAIN_CLASSIFIER_BIN (::accel::testing::built_program("train_classifier"))
#define TRAIN_LM_BIN (::accel::testing::built_program("train_lm"))
#define ACCEL_TEST_WORKERS_DIR                                          \
  (::accel::testing::resolved_test_path(::accel::testing::source_dir(), \
                                        "tests/integration/workers"))

// Turns what the user typed after the options into the workers' command line, with the habits
// of torchrun and HF Accelerate: a PROGRAM ending in .py runs under Python, -m MODULE runs a
// module, --no-python runs PROGRAM as given.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "agent/common/status.h"

namespace accel::launcher {

struct ProgramSpec {
  std::string program;  // empty when module is set
  std::vector<std::string> args;
  std::optional<std::string> module;  // -m MODULE
  bool no_python = false;
};

using Env = std::map<std::string, std::string, std::less<>>;

// Finds `name` on env's PATH (or checks it, when it contains '/'). The error says which.
Result<std::string> find_executable(const std::string& name, const Env& env);

// The full argv: [python3 -u script.py args...], [python3 -u -m module args...] or
// [/abs/program args...]. Python is $PYTHON_EXEC, else python3 on PATH.
Result<std::vector<std::string>> resolve_command(const ProgramSpec& spec, const Env& env);

}  // namespace accel::launcher

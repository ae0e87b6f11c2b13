// Hints for failures whose cause the stderr tail names but the user may not recognize.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace accel {

// For a worker's last stderr lines, a hint (one or more lines, no trailing newline) that says
// what the failure most likely is and what to do, or nullopt. `program`: the worker's argv[0]
// (the interpreter of a Python script), when known.
std::optional<std::string> exit_hint(const std::vector<std::string>& stderr_tail,
                                     const std::string& program = {});

}  // namespace accel

// `accel test [ACCEL-LAUNCH OPTIONS]`: checks an installation before a long job. It runs
// accel-check (the program beside accel) through the real accel-launch with the options given
// (-n 2, --nodes ..., --config ...), and prints a PASS/FAIL table: the worker environment, the
// collectives against their expected values, a few training steps against one process on the
// global batch, a checkpoint round trip, and a forced worker failure that must be restarted.
#pragma once

#include <string>
#include <vector>

namespace accel::launcher {

struct TestOptions {
  std::vector<std::string> launch_args;  // passed to accel-launch before the fixed settings
  bool verbose = false;                  // show the launcher's and workers' output as it comes
  // Makes the last rank send a wrong value in the collectives check (checks accel test itself).
  bool inject_collective_fault = false;
};

// Returns 0 when every check passed, 1 when one failed, 2 when the test could not start.
int run_test(const TestOptions& options);

}  // namespace accel::launcher

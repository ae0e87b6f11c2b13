// `accel config` with no subcommand: the interactive wizard. It asks only the questions that
// apply, checks each answer with the key table's own parser (a wrong answer is asked again),
// shows the YAML and writes it atomically, asking before it replaces a file. Run again on an
// existing file, that file's values are the defaults.
//
// Without a terminal on stdin it reads one answer per line (an empty line takes the default)
// and stops at the first wrong answer or at the end of input, writing nothing: a script can
// pipe answers in, and a batch job with no input never waits.
#pragma once

#include <iosfwd>
#include <optional>
#include <string>

#include "agent/config/config_loader.h"

namespace accel::launcher {

struct WizardOptions {
  std::optional<std::string> path;  // --config-file; default: the default location
  bool interactive = true;          // stdin is a terminal: re-ask wrong answers
};

// Returns the exit code: 0 written (or nothing to do), 1 a file could not be written, 2 input
// ended or was wrong (without a terminal).
int config_wizard(const config::EnvMap& env, const WizardOptions& options, std::istream& in,
                  std::ostream& out);

}  // namespace accel::launcher

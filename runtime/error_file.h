// The worker's side of the error-file contract (docs/worker-environment.md): an uncaught exception
// or a fatal signal writes {"message","type","stack","time","rank"} to ACCEL_ERROR_FILE
// (or TORCHELASTIC_ERROR_FILE), which the launcher shows in its failure summary.
#pragma once

#include <string>

namespace accel {

// Installs, once per process, a std::terminate handler (an uncaught exception prints its message,
// writes the error file if there is one and exits 1) and, with an error file, fatal-signal
// handlers that record the signal; later calls do nothing.
void install_error_handlers();

// Writes the error file now (used by the terminate handler; exposed for tests).
void write_error_file(const std::string& path, const std::string& message, const std::string& type,
                      const std::string& stack);

}  // namespace accel

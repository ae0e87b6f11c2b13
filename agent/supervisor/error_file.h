// Reads the error file a worker writes when it dies of an error (ACCEL_ERROR_FILE, also
// exported as TORCHELASTIC_ERROR_FILE so Python's @record writes the same file).
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace accel::supervisor {

struct WorkerError {
  std::string message;  // "ValueError: loss is NaN"
  std::string stack;    // traceback or native stack, may be empty
};

// Accepts accel's runtime format {"message": "...", "type": "...", "stack": "..."} and
// torchelastic's {"message": {"message": "...", "extraInfo": {"py_callstack": "..."}}}.
// Returns nothing when the file is absent; a file that is not such JSON yields a message
// saying so, so a corrupt report is visible rather than silently dropped.
std::optional<WorkerError> read_error_file(const std::string& path);
// The same for the file's text (`path` only names it in messages).
WorkerError parse_error_file(std::string_view text, const std::string& path);

}  // namespace accel::supervisor

// Typed errors thrown by libaccel. Each message says what went wrong, where, and what to do.
#pragma once

#include <stdexcept>
#include <string>

namespace accel {

// Base of every error libaccel throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A worker-environment variable or an option has an impossible value (RANK=abc, ...).
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A collective failed or timed out; the message names the collective and its sequence number.
class CollectiveError : public Error {
 public:
  using Error::Error;
};

// A data set, batch or data-loader option is unusable (split_batches with bs % n != 0, ...).
class DataError : public Error {
 public:
  using Error::Error;
};

// An API used in a way that cannot work (no_sync on a model that was never prepared, ...).
class UsageError : public Error {
 public:
  using Error::Error;
};

// A checkpoint or model file cannot be written, or is missing, truncated, corrupt or not
// accel's; the message names the file and what is wrong with it.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

}  // namespace accel

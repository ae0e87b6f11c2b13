// HF Accelerate's (`accelerate launch`) and torchrun's launch flags that are not accel-launch's
// own spellings of a config key. Each one is mapped where it means something here, ignored with
// a warning where it only tunes something accel does not have to tune, or refused with the
// reason where it asks for a feature accel does not have. docs/launch.md has the table.
#pragma once

#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "agent/config/config_loader.h"

namespace CLI {
class App;
class Option;
}  // namespace CLI

namespace accel::launcher {

class ForeignFlags {
 public:
  // Adds the flags to `app`, hidden from --help (docs/launch.md lists them).
  explicit ForeignFlags(CLI::App& app);

  // Before parsing, on the launcher's options (long names already with '-'): the first flag of
  // a feature accel does not have, as an error message; empty when there is none.
  static std::string refused(const std::vector<std::string>& options);

  // After parsing: adds the typed flags' meaning to `flags` (config keys) and `worker_env`, and
  // a warning per ignored flag. `options` are the launcher's options as typed. Returns an error
  // message, or empty.
  std::string apply(const std::vector<std::string>& options, std::vector<config::FlagValue>& flags,
                    std::vector<std::pair<std::string, std::string>>& worker_env,
                    std::vector<std::string>& warnings) const;

 private:
  struct Entry {
    std::string name;  // "--gpu-ids"
    CLI::Option* option = nullptr;
    std::string value;
    bool on = false;
  };
  const Entry& entry(const std::string& name) const;
  std::deque<Entry> entries_;  // stable addresses: CLI11 writes into them
};

}  // namespace accel::launcher

// The command-line flags of the configuration keys, built from the key table (KeySpec::flags,
// metavar, help, default), so accel-launch, accel-agent and `accel status` spell, explain and
// map them the same way.
#pragma once

#include <deque>
#include <string>
#include <vector>

#include "agent/config/cluster_config.h"
#include "agent/config/config_loader.h"

namespace CLI {
class App;
class Option;
}  // namespace CLI

namespace accel::config {

class KeyFlags {
 public:
  // Adds an option for every key whose `tools` include `tool` (a KeyTool bit), in table order:
  // `--key VALUE`, or a switch (`--cpu`, `--cpu=false`) for true/false keys.
  KeyFlags(CLI::App& app, unsigned tool);

  // After parsing: the keys the user typed, with the spelling used in messages ("--nodes").
  [[nodiscard]] std::vector<FlagValue> typed() const;

 private:
  struct Entry {
    const KeySpec* key = nullptr;
    CLI::Option* option = nullptr;
    std::string value;
    bool on = false;  // switches
  };
  std::deque<Entry> entries_;  // stable addresses: CLI11 writes into them
};

}  // namespace accel::config

// Key table -> CLI11 options.
#include "agent/config/key_flags.h"

#include <CLI/CLI.hpp>

namespace accel::config {

KeyFlags::KeyFlags(CLI::App& app, unsigned tool) {
  for (const KeySpec& key : all_keys()) {
    if ((key.tools & tool) == 0 || key.flags.empty()) continue;
    Entry& e = entries_.emplace_back();
    e.key = &key;
    std::string names(key.flags);
    std::string help(key.help);
    if (key.metavar.empty()) {
      e.option = app.add_flag(names, e.on, help);
      continue;
    }
    std::string def = default_text(key);
    if (!def.empty()) help += " Default: " + def + ".";
    e.option = app.add_option(names, e.value, help)
                   ->type_name(std::string(key.metavar))
                   ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  }
}

std::vector<FlagValue> KeyFlags::typed() const {
  std::vector<FlagValue> out;
  for (const Entry& e : entries_) {
    if (e.option->count() == 0) continue;
    std::string value = e.key->metavar.empty() ? (e.on ? "true" : "false") : e.value;
    out.push_back({std::string(e.key->name), value, "--" + e.option->get_lnames().front()});
  }
  return out;
}

}  // namespace accel::config

// The words an on/off worker variable (ACCEL_KEEP_FREED_MEMORY, ACCEL_USE_CPU, ...) may hold, read
// the same way by libaccel and by the launchers that read one for a worker.
#pragma once

#include <optional>
#include <string_view>

namespace accel::contract {

// 1, true, yes or on: true; 0, false, no or off: false; in any case. nullopt for anything else
// (spaces included).
inline std::optional<bool> switch_value(std::string_view text) {
  auto is = [text](std::string_view word) {
    if (text.size() != word.size()) return false;
    for (std::size_t i = 0; i < text.size(); ++i) {
      const char c = text[i];
      if ((c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c) != word[i]) return false;
    }
    return true;
  };
  if (is("1") || is("true") || is("yes") || is("on")) return true;
  if (is("0") || is("false") || is("no") || is("off")) return false;
  return std::nullopt;
}

}  // namespace accel::contract

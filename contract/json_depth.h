// The nesting depth of JSON text, bounded before it is parsed. nlohmann's parser keeps its own
// stack, but what it builds is walked recursively (dump(), comparisons, the messages that quote
// a value), so a few hundred KB of "[[[[" in a file someone else can write (a safetensors
// header, an index, a checkpoint manifest) would overflow the stack instead of failing.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace accel::contract {

// Deeper than any file accel reads needs (a safetensors header nests 3 levels, a manifest 4).
inline constexpr int kMaxJsonDepth = 64;

// True when `text` nests arrays and objects deeper than `limit`. Brackets inside strings do not
// count; the text need not be valid JSON (the parser judges that afterwards).
inline bool json_nesting_exceeds(std::string_view text, int limit = kMaxJsonDepth) {
  int depth = 0;
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\')
        ++i;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit) return true;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return false;
}

// What to say of `text` when it nests too deep ("nests arrays and objects more than 64 levels
// deep"), or "" when it does not.
inline std::string json_nesting_problem(std::string_view text) {
  if (!json_nesting_exceeds(text)) return "";
  return "nests arrays and objects more than " + std::to_string(kMaxJsonDepth) + " levels deep";
}

}  // namespace accel::contract

// Names from files (tensor names in a safetensors header) quoted for error messages: a name is
// bytes someone else may have chosen, and a terminal would act on the escape sequences in it.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>

namespace accel::contract {

// `text` in double quotes, with control characters (ESC included), DEL, '"' and '\' written as
// \xNN and at most 200 bytes of it (then "..."). UTF-8 letters pass as they are.
inline std::string quote_for_message(std::string_view text) {
  std::string out = "\"";
  for (std::size_t i = 0; i < text.size() && i < 200; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c < 0x20 || c == 0x7f || c == '"' || c == '\\') {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (text.size() > 200) out += "...";
  return out + "\"";
}

}  // namespace accel::contract

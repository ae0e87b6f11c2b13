// Worker error-file parsing (nlohmann-json).
#include "agent/supervisor/error_file.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>

namespace accel::supervisor {

std::optional<WorkerError> read_error_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  // Why a bound: the worker writes this file; a huge one must not cost the agent its memory.
  std::string text(kMaxErrorFileBytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  if (text.size() > kMaxErrorFileBytes) return WorkerError{"(error file " + path + " is larger than 1 MiB)", ""};
  return parse_error_file(text, path);
}

WorkerError parse_error_file(std::string_view text, const std::string& path) {
  auto doc = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object() || !doc.contains("message")) {
    return WorkerError{"(unreadable error file " + path + ")", ""};
  }
  WorkerError out;
  const auto& m = doc["message"];
  if (m.is_string()) {
    out.message = m.get<std::string>();
    if (doc.contains("type") && doc["type"].is_string() &&
        out.message.rfind(doc["type"].get<std::string>(), 0) != 0) {
      out.message = doc["type"].get<std::string>() + ": " + out.message;
    }
    if (doc.contains("stack") && doc["stack"].is_string()) out.stack = doc["stack"];
  } else if (m.is_object()) {
    if (m.contains("message") && m["message"].is_string()) out.message = m["message"];
    if (m.contains("extraInfo") && m["extraInfo"].is_object()) {
      const auto& extra = m["extraInfo"];
      if (extra.contains("py_callstack") && extra["py_callstack"].is_string()) {
        out.stack = extra["py_callstack"];
      }
    }
  }
  if (out.message.empty()) out.message = "(error file " + path + " has no message)";
  return out;
}

}  // namespace accel::supervisor

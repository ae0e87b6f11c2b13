// Worker error-file parsing (nlohmann-json).
#include "agent/supervisor/error_file.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "contract/json_depth.h"
#include "contract/worker_contract.h"

namespace accel::supervisor {

namespace ef = contract::error_file;

std::optional<WorkerError> read_error_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  // Why a bound: the worker writes this file; a huge one must not cost the agent its memory.
  std::string text(ef::kMaxBytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  if (text.size() > ef::kMaxBytes)
    return WorkerError{"(error file " + path + " is larger than 1 MiB)", ""};
  return parse_error_file(text, path);
}

WorkerError parse_error_file(std::string_view text, const std::string& path) {
  if (contract::json_nesting_exceeds(text))
    return WorkerError{"(unreadable error file " + path + ")", ""};
  auto doc = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object() || !doc.contains(ef::kMessage)) {
    return WorkerError{"(unreadable error file " + path + ")", ""};
  }
  WorkerError out;
  const auto& m = doc[ef::kMessage];
  if (m.is_string()) {
    out.message = m.get<std::string>();
    if (doc.contains(ef::kType) && doc[ef::kType].is_string() &&
        out.message.rfind(doc[ef::kType].get<std::string>(), 0) != 0) {
      out.message = doc[ef::kType].get<std::string>() + ": " + out.message;
    }
    if (doc.contains(ef::kStack) && doc[ef::kStack].is_string()) out.stack = doc[ef::kStack];
  } else if (m.is_object()) {
    if (m.contains(ef::kMessage) && m[ef::kMessage].is_string()) out.message = m[ef::kMessage];
    if (m.contains(ef::kExtraInfo) && m[ef::kExtraInfo].is_object()) {
      const auto& extra = m[ef::kExtraInfo];
      if (extra.contains(ef::kPyCallstack) && extra[ef::kPyCallstack].is_string()) {
        out.stack = extra[ef::kPyCallstack];
      }
    }
  }
  if (out.message.empty()) out.message = "(error file " + path + " has no message)";
  return out;
}

}  // namespace accel::supervisor

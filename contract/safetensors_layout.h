// The safetensors layout rule both readers of the format enforce: libaccel's loader
// (runtime/safetensors.cpp) and the torch-free `accel estimate-memory` / `merge-weights`
// (launcher/weights_cmd.cpp). Header-only, standard library only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

namespace accel::contract {

inline std::string show_offsets(uint64_t begin, uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
}

// What is wrong with a header's layout: the tensor it is about ("" for the file as a whole).
struct LayoutProblem {
  std::string tensor;
  std::string what;
};

// Sorts `entries` (anything with `name`, `begin`, `end`: their data_offsets) by offset and
// checks that they tile [0, data_size): no tensor past the data, no overlap, no gap, no byte
// left over, as the safetensors format requires. Returns the first problem.
template <class Entry>
std::optional<LayoutProblem> check_tiling(std::vector<Entry>& entries, uint64_t data_size) {
  for (const auto& e : entries) {
    if (e.end > data_size) {
      return LayoutProblem{e.name, "data_offsets " + show_offsets(e.begin, e.end) +
                                       " end past the data section (" + std::to_string(data_size) +
                                       " bytes); the file is truncated or corrupt"};
    }
  }
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  uint64_t covered = 0;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    if (e.begin < covered) {
      const Entry& prev = entries[i - 1];
      return LayoutProblem{e.name, "data_offsets " + show_offsets(e.begin, e.end) +
                                       " overlap tensor \"" + std::string(prev.name) + "\" " +
                                       show_offsets(prev.begin, prev.end)};
    }
    if (e.begin > covered) {
      return LayoutProblem{e.name, "data_offsets " + show_offsets(e.begin, e.end) +
                                       " leave bytes " + show_offsets(covered, e.begin) +
                                       " of the data section to no tensor"};
    }
    covered = e.end;
  }
  if (covered != data_size) {
    return LayoutProblem{"", std::to_string(data_size - covered) +
                                 " bytes after the last tensor (the tensors cover " +
                                 std::to_string(covered) + " of the " + std::to_string(data_size) +
                                 " data bytes)"};
  }
  return std::nullopt;
}

}  // namespace accel::contract

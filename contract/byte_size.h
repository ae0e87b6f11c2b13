// Sizes as HF's max_shard_size writes them: "10GB", "500MB", "2GiB", a plain byte count.
// Decimal units (KB, MB, GB) are powers of 1000 as in HF; KiB, MiB, GiB powers of 1024; case and
// surrounding spaces do not matter. libaccel's save_model and `accel merge-weights` read them.
// Header-only, standard library only.
#pragma once

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <string>
#include <string_view>

namespace accel::contract {

struct ByteSize {
  uint64_t bytes = 0;
  const char* problem = nullptr;  // "is not a size", "does not fit in 64 bits", "is zero"
};

inline ByteSize parse_byte_size(std::string_view text) {
  struct Unit {
    const char* suffix;
    uint64_t factor;
  };
  // Longest suffixes first, so "GIB" is not read as "B"-less "GI".
  static constexpr Unit kUnits[] = {{"GIB", 1ULL << 30},
                                    {"MIB", 1ULL << 20},
                                    {"KIB", 1ULL << 10},
                                    {"GB", 1000000000},
                                    {"MB", 1000000},
                                    {"KB", 1000},
                                    {"", 1}};
  auto space = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
  std::string upper;
  for (char c : text) upper += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  while (!upper.empty() && space(upper.back())) upper.pop_back();
  const Unit* unit = std::find_if(std::begin(kUnits), std::end(kUnits), [&](const Unit& u) {
    size_t n = std::strlen(u.suffix);
    return upper.size() >= n && upper.compare(upper.size() - n, n, u.suffix) == 0;
  });
  std::string_view digits(upper);
  digits.remove_suffix(std::strlen(unit->suffix));
  while (!digits.empty() && space(digits.front())) digits.remove_prefix(1);
  while (!digits.empty() && space(digits.back())) digits.remove_suffix(1);
  if (digits.empty() ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return {0, "is not a size"};
  }
  uint64_t value = 0;
  for (char c : digits) {
    if (__builtin_mul_overflow(value, 10, &value) ||
        __builtin_add_overflow(value, static_cast<uint64_t>(c - '0'), &value)) {
      return {0, "does not fit in 64 bits"};
    }
  }
  if (__builtin_mul_overflow(value, unit->factor, &value)) return {0, "does not fit in 64 bits"};
  if (value == 0) return {0, "is zero"};
  return {value, nullptr};
}

}  // namespace accel::contract

// What Slurm writes into a job step's environment, read the way Slurm writes it: host lists
// ("gpu[01-04,07],login1", "rack[1-2]-n[01-02]") and task counts per node ("2(x3),1").
// accel-launch reads them to fill a multi-node job; libaccel reads them when `srun` starts
// every rank itself. Header-only, standard library only.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace accel::contract {

// A job's node list is at most this many names; a longer expansion is refused, not allocated.
inline constexpr std::size_t kMaxSlurmHosts = 1u << 16;
inline constexpr std::size_t kMaxSlurmHostName = 255;

struct SlurmList {
  std::vector<std::string> items;
  std::string error;  // empty when the text parsed; else what is wrong, without the variable name
  [[nodiscard]] bool ok() const { return error.empty(); }
};

namespace slurm_detail {

// Calls part(text between commas) for each comma-separated part, empty ones included; stops and
// returns false as soon as part() does.
template <class F>
bool each_comma_part(std::string_view text, F&& part) {
  std::size_t start = 0;
  for (;;) {
    std::size_t comma = text.find(',', start);
    if (!part(text.substr(
            start, comma == std::string_view::npos ? std::string_view::npos : comma - start))) {
      return false;
    }
    if (comma == std::string_view::npos) return true;
    start = comma + 1;
  }
}

// `text` for a message: at most 80 characters of it (a hostile list may be megabytes).
inline std::string quoted(std::string_view text) {
  return "'" + std::string(text.substr(0, 80)) + (text.size() > 80 ? "...'" : "'");
}

inline bool parse_uint(std::string_view s, uint64_t& out) {
  if (s.empty() || s.size() > 18) return false;
  out = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    out = out * 10 + static_cast<uint64_t>(c - '0');
  }
  return true;
}

// The numbers of one bracket's body "01-04,07", as text with the lower bound's width.
inline bool expand_ranges(std::string_view body, std::vector<std::string>& out, std::size_t limit,
                          std::string& error) {
  if (body.empty()) {
    error = "empty brackets []";
    return false;
  }
  return each_comma_part(body, [&](std::string_view part) {
    std::size_t dash = part.find('-');
    std::string_view lo_text = part.substr(0, dash);
    std::string_view hi_text = dash == std::string_view::npos ? lo_text : part.substr(dash + 1);
    uint64_t lo = 0;
    uint64_t hi = 0;
    if (!parse_uint(lo_text, lo) || !parse_uint(hi_text, hi)) {
      error = quoted(part) + " is not a number or a range such as 1-4";
      return false;
    }
    if (hi < lo) {
      error = "range " + quoted(part) + " ends below its start";
      return false;
    }
    if (hi - lo >= limit || out.size() + (hi - lo + 1) > limit) {
      error = "expands to more than " + std::to_string(limit) + " names";
      return false;
    }
    for (uint64_t n = lo; n <= hi; ++n) {
      std::string digits = std::to_string(n);
      if (digits.size() < lo_text.size()) digits.insert(0, lo_text.size() - digits.size(), '0');
      out.push_back(std::move(digits));
    }
    return true;
  });
}

// One host expression: literal text and bracket groups, each group multiplying the names.
// Why the length is checked before each piece is added: a long name times many numbers would
// otherwise be built in full (gigabytes) before it could be refused.
inline bool expand_one(std::string_view expr, std::vector<std::string>& out, std::string& error) {
  std::vector<std::string> names{std::string()};
  std::size_t longest = 0;  // of the names so far
  auto too_long = [&] {
    error = "a host name longer than " + std::to_string(kMaxSlurmHostName) + " characters in " +
            quoted(expr);
    return false;
  };
  std::size_t i = 0;
  while (i < expr.size()) {
    char c = expr[i];
    if (c == ']') {
      error = "']' without '[' in " + quoted(expr);
      return false;
    }
    if (c != '[') {
      std::size_t next = expr.find_first_of("[]", i);
      std::string_view text =
          expr.substr(i, next == std::string_view::npos ? expr.size() - i : next - i);
      if (longest + text.size() > kMaxSlurmHostName) return too_long();
      for (auto& n : names) n += text;
      longest += text.size();
      i += text.size();
      continue;
    }
    std::size_t close = expr.find(']', i + 1);
    std::size_t nested = expr.find('[', i + 1);
    if (close == std::string_view::npos) {
      error = "'[' without ']' in " + quoted(expr);
      return false;
    }
    if (nested < close) {
      error = "brackets inside brackets in " + quoted(expr);
      return false;
    }
    std::vector<std::string> numbers;
    std::size_t room = kMaxSlurmHosts - out.size();
    if (!expand_ranges(expr.substr(i + 1, close - i - 1), numbers, room, error)) {
      error += " in " + quoted(expr);
      return false;
    }
    if (numbers.size() > room / names.size()) {
      error = quoted(expr) + " expands to more than " + std::to_string(kMaxSlurmHosts) + " names";
      return false;
    }
    std::size_t widest = 0;
    for (const auto& num : numbers) widest = std::max(widest, num.size());
    if (longest + widest > kMaxSlurmHostName) return too_long();
    longest += widest;
    std::vector<std::string> product;
    product.reserve(names.size() * numbers.size());
    for (const auto& n : names) {
      for (const auto& num : numbers) product.push_back(n + num);
    }
    names = std::move(product);
    i = close + 1;
  }
  for (auto& n : names) out.push_back(std::move(n));
  return true;
}

}  // namespace slurm_detail

// "gpu[01-04,07],login1" -> gpu01 gpu02 gpu03 gpu04 gpu07 login1, in Slurm's order (several
// bracket groups: the first varies slowest; numbers keep the lower bound's zero padding; empty
// items between commas are skipped, as Slurm does). Refused: unbalanced or nested brackets,
// a range that is not numeric or ends below its start, more than kMaxSlurmHosts names.
inline SlurmList expand_hostlist(std::string_view text) {
  SlurmList result;
  int depth = 0;
  std::size_t start = 0;
  for (std::size_t i = 0; i <= text.size(); ++i) {
    char c = i < text.size() ? text[i] : ',';
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (i < text.size() && (c != ',' || depth > 0)) continue;
    std::string_view expr = text.substr(start, i - start);
    start = i + 1;
    if (expr.empty()) continue;
    for (char ch : expr) {
      if (ch == ' ' || ch == '\t' || ch == '\n' || ch == '\0') {
        result.error = "a space or control character in " + slurm_detail::quoted(expr);
        result.items.clear();
        return result;
      }
    }
    if (!slurm_detail::expand_one(expr, result.items, result.error)) {
      result.items.clear();
      return result;
    }
  }
  if (result.ok() && result.items.empty()) result.error = "no host names";
  return result;
}

// "2(x3),1" -> 2 2 2 1 (SLURM_TASKS_PER_NODE, SLURM_STEP_TASKS_PER_NODE, SLURM_JOB_CPUS_PER_NODE).
inline SlurmList expand_per_node_counts(std::string_view text) {
  SlurmList result;
  bool ok = slurm_detail::each_comma_part(text, [&](std::string_view part) {
    std::string_view count_text = part;
    uint64_t repeat = 1;
    if (std::size_t paren = part.find('('); paren != std::string_view::npos) {
      count_text = part.substr(0, paren);
      std::string_view rest = part.substr(paren);
      if (rest.size() < 4 || rest.substr(0, 2) != "(x" || rest.back() != ')' ||
          !slurm_detail::parse_uint(rest.substr(2, rest.size() - 3), repeat) || repeat == 0) {
        result.error = slurm_detail::quoted(part) + " is not N or N(xM)";
        return false;
      }
    }
    uint64_t count = 0;
    if (!slurm_detail::parse_uint(count_text, count) || count > (1u << 20)) {
      result.error = slurm_detail::quoted(part) + " is not N or N(xM)";
      return false;
    }
    if (repeat > kMaxSlurmHosts - result.items.size()) {
      result.error = "more than " + std::to_string(kMaxSlurmHosts) + " nodes";
      return false;
    }
    result.items.insert(result.items.end(), repeat, std::to_string(count));
    return true;
  });
  if (!ok) result.items.clear();
  return result;
}

// The rendezvous port a Slurm job's ranks agree on without talking: derived from the job id so
// two jobs sharing a first node do not collide. `base` + id mod 8000.
inline int slurm_port_for_job(std::string_view job_id, int base) {
  uint64_t id = 0;
  for (char c : job_id) {
    if (c < '0' || c > '9') break;  // array and het jobs: "123_4", "123+0" use the leading id
    id = (id * 10 + static_cast<uint64_t>(c - '0')) % 8000;
  }
  return base + static_cast<int>(id);
}

// The ports: libaccel's MASTER_PORT when srun starts every rank, and accel-launch's coordinator.
inline constexpr int kSlurmMasterPortBase = 12000;
inline constexpr int kSlurmCoordinatorPortBase = 20000;

}  // namespace accel::contract

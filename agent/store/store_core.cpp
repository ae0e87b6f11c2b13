// The TCPStore protocol and state, byte for byte as c10d's server answers (see store_core.h).
#include "agent/store/store_core.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstring>
#include <utility>

namespace accel::store {

namespace {

constexpr std::uint32_t kValidationMagic = 0x3C85F7CE;
constexpr std::uint8_t kReady = 0, kNotReady = 1;            // CHECK
constexpr std::uint8_t kStopWaiting = 0, kWaitCanceled = 1;  // WAIT, CANCEL_WAIT

template <class T>
void append_le(std::string& out, T v) {
  char bytes[sizeof(T)];
  // Why memcpy: x86-64 and aarch64 are little-endian, as torch assumes
  std::memcpy(bytes, &v, sizeof(T));
  out.append(bytes, sizeof(T));
}
void append_bytes(std::string& out, std::string_view b) {
  append_le<std::uint64_t>(out, b.size());
  out.append(b);
}

std::string shown(std::string_view key) {
  std::string s;
  for (char c : key.substr(0, 80)) s += std::isprint(static_cast<unsigned char>(c)) ? c : '?';
  if (key.size() > 80) s += "...";
  return "'" + s + "'";
}

}  // namespace

// Reads fields from the front of a request; `ok()` turns false when the bytes run out (then
// `wanted` is how many the request needs at least) or a field breaks a limit (then `error`).
struct StoreCore::Reader {
  Reader(std::string_view bytes, const StoreLimits& l) : in(bytes), limits(l) {}
  std::string_view in;
  const StoreLimits& limits;
  size_t pos = 0;
  size_t wanted = 0;
  std::string error;

  [[nodiscard]] bool ok() const { return wanted == 0 && error.empty(); }
  bool need(size_t n) {
    if (!ok()) return false;
    if (in.size() - pos < n) {
      wanted = pos + n;
      return false;
    }
    return true;
  }
  template <class T>
  T number() {
    T v{};
    if (!need(sizeof(T))) return v;
    std::memcpy(&v, in.data() + pos, sizeof(T));
    pos += sizeof(T);
    return v;
  }
  std::string bytes(size_t limit, const char* what) {
    auto n = number<std::uint64_t>();
    if (!ok()) return {};
    if (n > limit) {
      error = std::string(what) + " of " + std::to_string(n) + " bytes is over the limit of " +
              std::to_string(limit);
      return {};
    }
    if (!need(n)) return {};
    std::string s(in.substr(pos, n));
    pos += n;
    return s;
  }
  std::string key() { return bytes(limits.max_key_bytes, "a key"); }
  std::string value() { return bytes(limits.max_value_bytes, "a value"); }
  size_t count() {
    auto n = number<std::uint64_t>();
    if (ok() && n > limits.max_keys_per_request) {
      error = "a request naming " + std::to_string(n) + " keys is over the limit of " +
              std::to_string(limits.max_keys_per_request);
    }
    return ok() ? n : 0;
  }
  // A count, then that many keys (WAIT, CHECK, MULTI_GET).
  std::vector<std::string> keys() {
    std::vector<std::string> out(count());
    for (auto& k : out) {
      if (!ok()) break;
      k = key();
    }
    return out;
  }
};

StoreCore::StoreCore(StoreLimits limits) : limits_(limits) {}

StoreCore::ConnId StoreCore::open() {
  ConnId id = next_id_++;
  conns_.emplace(id, Conn{});
  return id;
}

void StoreCore::close(ConnId conn) {
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    std::erase(it->second, conn);
    it = it->second.empty() ? waiting_.erase(it) : std::next(it);
  }
  conns_.erase(conn);
  std::erase(ready_, conn);
}

void StoreCore::clear() {
  data_.clear();
  waiting_.clear();
  stored_bytes_ = 0;
  for (auto& [id, c] : conns_) c.awaited = 0;
}

std::vector<StoreCore::ConnId> StoreCore::take_ready() { return std::exchange(ready_, {}); }

std::string StoreCore::take_output(ConnId conn) {
  auto it = conns_.find(conn);
  return it == conns_.end() ? std::string() : std::exchange(it->second.out, {});
}

std::optional<std::string> StoreCore::value(const std::string& key) const {
  auto it = data_.find(key);
  if (it == data_.end()) return std::nullopt;
  return it->second;
}

Dialect StoreCore::dialect(ConnId conn) const {
  auto it = conns_.find(conn);
  return it == conns_.end() ? Dialect::kUnknown : it->second.dialect;
}

size_t StoreCore::bytes_wanted(ConnId conn) const {
  auto it = conns_.find(conn);
  return it == conns_.end() ? 1 : it->second.wanted;
}

void StoreCore::reply(ConnId id, Conn& conn, std::string_view bytes) {
  if (conn.out.empty()) ready_.push_back(id);
  conn.out.append(bytes);
}

StoreCore::Op StoreCore::decode(Dialect d, std::uint8_t b) {
  static constexpr Op kLegacy[] = {Op::kSet,       Op::kCompareSet, Op::kGet,      Op::kAdd,
                                   Op::kCheck,     Op::kWait,       Op::kNumKeys,  Op::kWatch,
                                   Op::kDelete,    Op::kAppend,     Op::kMultiGet, Op::kMultiSet,
                                   Op::kCancelWait};
  static constexpr Op kValidated[] = {
      Op::kValidate,   Op::kSet,     Op::kCompareSet, Op::kGet,    Op::kAdd,      Op::kCheck,
      Op::kWait,       Op::kNumKeys, Op::kDelete,     Op::kAppend, Op::kMultiGet, Op::kMultiSet,
      Op::kCancelWait, Op::kPing,    Op::kQueue,      Op::kQueue,  Op::kQueue};
  if (d == Dialect::kLegacy) return b < std::size(kLegacy) ? kLegacy[b] : Op::kUnknown;
  return b < std::size(kValidated) ? kValidated[b] : Op::kUnknown;
}

bool StoreCore::fits(size_t key_bytes, size_t old_value_bytes, size_t new_value_bytes, bool new_key,
                     std::string& error) const {
  if (new_key && data_.size() >= limits_.max_keys) {
    error = "the store holds " + std::to_string(data_.size()) + " keys, its limit";
    return false;
  }
  size_t after = stored_bytes_ - old_value_bytes + new_value_bytes + (new_key ? key_bytes : 0);
  if (after > limits_.max_total_bytes) {
    error = "the store would hold " + std::to_string(after) + " bytes, over its limit of " +
            std::to_string(limits_.max_total_bytes);
    return false;
  }
  return true;
}

bool StoreCore::append_value(std::string& out, const std::string& key, const char* op,
                             std::string& error) const {
  auto pos = data_.find(key);
  if (pos == data_.end()) {
    error = std::string(op) + " of " + shown(key) + ", which is not set (clients WAIT first)";
    return false;
  }
  append_bytes(out, pos->second);
  return true;
}

void StoreCore::put(const std::string& key, std::string value) {
  auto [it, inserted] = data_.try_emplace(key);
  stored_bytes_ += value.size() + (inserted ? key.size() : 0);
  stored_bytes_ -= it->second.size();
  it->second = std::move(value);
}

bool StoreCore::erase(const std::string& key) {
  auto it = data_.find(key);
  if (it == data_.end()) return false;
  stored_bytes_ -= key.size() + it->second.size();
  data_.erase(it);
  return true;
}

void StoreCore::wake(const std::string& key) {
  auto it = waiting_.find(key);
  if (it == waiting_.end()) return;
  std::vector<ConnId> waiters = std::move(it->second);
  waiting_.erase(it);
  const char stop = static_cast<char>(kStopWaiting);
  for (ConnId w : waiters) {
    auto c = conns_.find(w);
    if (c == conns_.end() || c->second.awaited == 0) continue;
    if (--c->second.awaited == 0) reply(w, c->second, std::string_view(&stop, 1));
  }
}

std::optional<std::string> StoreCore::feed(ConnId id, std::string& in) {
  auto it = conns_.find(id);
  if (it == conns_.end()) return std::string("unknown connection");
  Conn& conn = it->second;
  size_t done = 0;
  std::string error;
  while (done < in.size()) {
    size_t used = serve_one(id, conn, std::string_view(in).substr(done), error);
    if (!error.empty()) {
      in.erase(0, done);
      return error;
    }
    if (used == 0) break;
    done += used;
  }
  in.erase(0, done);
  conn.wanted = std::max(conn.wanted, in.size() + (in.empty() ? 1 : 0));
  return std::nullopt;
}

size_t StoreCore::serve_one(ConnId id, Conn& conn, std::string_view in, std::string& error) {
  Reader r(in, limits_);
  auto incomplete = [&]() -> size_t {
    conn.wanted = r.wanted;
    return 0;
  };
  if (conn.dialect == Dialect::kUnknown) {
    // Why 5 bytes: legacy SET is also op 0, followed by a u64 key length whose low half would
    // have to be the magic (a 1 GB key, over any limit).
    if (in[0] == 0) {
      if (in.size() < 5) {
        conn.wanted = 5;
        return 0;
      }
      std::uint32_t magic = 0;
      std::memcpy(&magic, in.data() + 1, 4);
      conn.dialect = magic == kValidationMagic ? Dialect::kValidated : Dialect::kLegacy;
    } else {
      conn.dialect = Dialect::kLegacy;
    }
  }
  const auto code = r.number<std::uint8_t>();
  const Op op = decode(conn.dialect, code);
  std::string out;
  switch (op) {
    case Op::kValidate: {
      auto magic = r.number<std::uint32_t>();
      if (!r.ok()) break;
      if (magic != kValidationMagic)
        error = "the validation magic number is wrong (not a TCPStore client?)";
      break;
    }
    case Op::kPing: {
      auto nonce = r.number<std::uint32_t>();
      if (r.ok()) append_le(out, nonce);
      break;
    }
    case Op::kSet:
    case Op::kAppend: {
      std::string key = r.key();
      std::string value = r.value();
      if (!r.ok()) break;
      auto old = data_.find(key);
      bool new_key = old == data_.end();
      size_t old_size = new_key ? 0 : old->second.size();
      if (op == Op::kAppend && !new_key) {
        if (old_size + value.size() > limits_.max_value_bytes) {
          error = "appending to " + shown(key) + " makes a value over the limit of " +
                  std::to_string(limits_.max_value_bytes) + " bytes";
          break;
        }
        value.insert(0, old->second);
      }
      if (!fits(key.size(), old_size, value.size(), new_key, error)) break;
      put(key, std::move(value));
      wake(key);
      break;
    }
    case Op::kCompareSet: {
      std::string key = r.key();
      std::string expected = r.value();
      std::string desired = r.value();
      if (!r.ok()) break;
      auto pos = data_.find(key);
      if (pos == data_.end()) {
        // As c10d: a missing key is created only when the expected value is empty; otherwise the
        // expected value is returned (as if it were stored).
        if (expected.empty()) {
          if (!fits(key.size(), 0, desired.size(), true, error)) break;
          put(key, desired);
          append_bytes(out, desired);
        } else {
          append_bytes(out, expected);
        }
      } else {
        if (pos->second == expected) {
          if (!fits(key.size(), pos->second.size(), desired.size(), false, error)) break;
          put(key, std::move(desired));
        }
        append_bytes(out, data_.at(key));
      }
      break;
    }
    case Op::kGet: {
      std::string key = r.key();
      if (!r.ok()) break;
      append_value(out, key, "GET", error);
      break;
    }
    case Op::kAdd: {
      std::string key = r.key();
      auto delta = r.number<std::int64_t>();
      if (!r.ok()) break;
      std::int64_t sum = delta;
      auto pos = data_.find(key);
      if (pos != data_.end()) {
        // As c10d's std::stoll: leading blanks skipped, trailing bytes ignored.
        const std::string& v = pos->second;
        size_t b = 0;
        while (b < v.size() && std::isspace(static_cast<unsigned char>(v[b]))) ++b;
        if (b < v.size() && v[b] == '+') ++b;
        std::int64_t current = 0;
        auto [ptr, ec] = std::from_chars(v.data() + b, v.data() + v.size(), current);
        if (ec != std::errc()) {
          error = "ADD to " + shown(key) + ", whose value is not a number";
          break;
        }
        if (__builtin_add_overflow(current, delta, &sum)) {
          error = "ADD to " + shown(key) + " overflows a 64-bit integer";
          break;
        }
      }
      std::string text = std::to_string(sum);
      if (!fits(key.size(), pos == data_.end() ? 0 : pos->second.size(), text.size(),
                pos == data_.end(), error)) {
        break;
      }
      put(key, std::move(text));
      append_le<std::int64_t>(out, sum);
      wake(key);
      break;
    }
    case Op::kCheck:
    case Op::kWait: {
      std::vector<std::string> keys = r.keys();
      if (!r.ok()) break;
      std::vector<std::string> missing;
      for (auto& k : keys) {
        if (!data_.contains(k)) missing.push_back(std::move(k));
      }
      if (op == Op::kCheck) {
        append_le<std::uint8_t>(out, missing.empty() ? kReady : kNotReady);
      } else if (missing.empty()) {
        append_le<std::uint8_t>(out, kStopWaiting);
      } else {
        // Why no dedup: c10d counts each named key once per naming, and so does its client.
        for (auto& k : missing) waiting_[k].push_back(id);
        conn.awaited = missing.size();
      }
      break;
    }
    case Op::kCancelWait: {
      for (auto w = waiting_.begin(); w != waiting_.end();) {
        std::erase(w->second, id);
        w = w->second.empty() ? waiting_.erase(w) : std::next(w);
      }
      conn.awaited = 0;
      append_le<std::uint8_t>(out, kWaitCanceled);
      break;
    }
    case Op::kNumKeys:
      append_le<std::int64_t>(out, static_cast<std::int64_t>(data_.size()));
      break;
    case Op::kDelete: {
      std::string key = r.key();
      if (!r.ok()) break;
      append_le<std::int64_t>(out, erase(key) ? 1 : 0);
      break;
    }
    case Op::kMultiGet: {
      std::vector<std::string> keys = r.keys();
      if (!r.ok()) break;
      for (const auto& k : keys) {
        if (!append_value(out, k, "MULTI_GET", error)) break;
      }
      break;
    }
    case Op::kMultiSet: {
      size_t n = r.count();
      std::vector<std::pair<std::string, std::string>> kvs;
      for (size_t i = 0; i < n && r.ok(); ++i) {
        std::string k = r.key();
        std::string v = r.value();
        kvs.emplace_back(std::move(k), std::move(v));
      }
      if (!r.ok()) break;
      for (auto& [k, v] : kvs) {
        auto old = data_.find(k);
        bool new_key = old == data_.end();
        if (!fits(k.size(), new_key ? 0 : old->second.size(), v.size(), new_key, error)) break;
        put(k, std::move(v));
        wake(k);
      }
      break;
    }
    case Op::kWatch:
      error = "WATCH_KEY (torch 1.13's watchKey) is not supported by accel's store";
      break;
    case Op::kQueue:
      error = "the queue operations (op " + std::to_string(code) +
              ") are not supported by accel's store";
      break;
    case Op::kUnknown:
      error = "unknown request type " + std::to_string(code) +
              " (not a TCPStore client, or a newer protocol)";
      break;
  }
  if (!r.error.empty() && error.empty()) error = r.error;
  if (!error.empty()) return 0;
  if (r.wanted != 0) return incomplete();
  if (!out.empty()) reply(id, conn, out);
  conn.wanted = 1;
  return r.pos;
}

}  // namespace accel::store

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
  Reader(std::string_view bytes, const StoreLimits& l, size_t request_budget)
      : in(bytes), limits(l), budget(request_budget) {}
  std::string_view in;
  const StoreLimits& limits;
  size_t budget;  // bytes this request may take in all (what the store's limit leaves)
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
    // Why before the bytes arrive: an unfinished request is buffered until it is whole; its
    // declared sizes must fit what the store may still hold, or a client could make the server
    // buffer without bound.
    if (pos + n > budget) {
      error = "a request of at least " + std::to_string(pos + n) +
              " bytes: with it the store would be over its limit of " +
              std::to_string(limits.max_total_bytes) +
              " bytes (keys, values and unfinished requests together)";
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
};

StoreCore::StoreCore(StoreLimits limits) : limits_(limits) {}

StoreCore::ConnId StoreCore::open() {
  ConnId id = next_id_++;
  conns_.emplace(id, Conn{});
  return id;
}

void StoreCore::close(ConnId conn) {
  auto it = conns_.find(conn);
  if (it != conns_.end()) {
    drop_waits(conn, it->second);
    reserve(it->second, 0);
    conns_.erase(it);
  }
  std::erase(ready_, conn);
}

void StoreCore::drop_waits(ConnId id, Conn& conn) {
  // Why only its own keys: scanning every waiting key on each close or CANCEL_WAIT made a
  // million waits cost seconds per call.
  for (const auto& key : conn.waits) {
    auto w = waiting_.find(key);
    if (w == waiting_.end()) continue;
    auto& ids = w->second;
    const auto gone = std::remove(ids.begin(), ids.end(), id);
    waits_ -= static_cast<size_t>(ids.end() - gone);
    ids.erase(gone, ids.end());
    if (w->second.empty()) waiting_.erase(w);
  }
  conn.waits.clear();
  conn.awaited = 0;
}

void StoreCore::reserve(Conn& conn, size_t bytes) {
  reserved_bytes_ = reserved_bytes_ - conn.reserved + bytes;
  conn.reserved = bytes;
}

void StoreCore::clear() {
  data_.clear();
  waiting_.clear();
  stored_bytes_ = 0;
  waits_ = 0;
  reserved_bytes_ = 0;
  for (auto& [id, c] : conns_) {
    c.awaited = 0;
    c.waits.clear();
    c.partial = {};
    c.reserved = 0;
  }
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
  auto waiters = std::move(it->second);
  waiting_.erase(it);
  waits_ -= waiters.size();
  const char stop = static_cast<char>(kStopWaiting);
  for (ConnId w : waiters) {
    auto c = conns_.find(w);
    if (c == conns_.end() || c->second.awaited == 0) continue;
    if (--c->second.awaited == 0) {
      c->second.waits.clear();
      reply(w, c->second, std::string_view(&stop, 1));
    }
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

// Reads the count and then the keys (with values: key-value pairs) of a multi-key request into
// `p`, going on from where an earlier call stopped. True when every key has been read; false when
// the bytes ran out (r.wanted) or a field broke a limit (r.error).
bool StoreCore::read_multi(Reader& r, Partial& p, bool with_values) {
  if (p.pos == 0) {
    p.count = r.count();
    if (!r.ok()) return false;
    p.keys.reserve(p.count);
    if (with_values) p.values.reserve(p.count);
    p.pos = r.pos;
  } else {
    r.pos = p.pos;
  }
  while (p.keys.size() < p.count) {
    std::string k = r.key();
    std::string v;
    if (with_values) v = r.value();
    if (!r.ok()) {
      // Why the rest counts: each key still to come is at least its 8-byte length (and a value's):
      // asking for that much saves reading the request again for every few bytes that arrive.
      if (r.wanted != 0) r.wanted += (p.count - p.keys.size() - 1) * (with_values ? 16 : 8);
      return false;
    }
    p.keys.push_back(std::move(k));
    if (with_values) p.values.push_back(std::move(v));
    p.pos = r.pos;
  }
  return true;
}

size_t StoreCore::serve_one(ConnId id, Conn& conn, std::string_view in, std::string& error) {
  const size_t others = reserved_bytes_ - conn.reserved;
  const size_t used = stored_bytes_ + others;
  Reader r(in, limits_, limits_.max_total_bytes > used ? limits_.max_total_bytes - used : 0);
  auto incomplete = [&]() -> size_t {
    conn.wanted = r.wanted;
    reserve(conn, r.wanted);
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
        const bool plus = b < v.size() && v[b] == '+';
        if (plus) ++b;
        std::int64_t current = 0;
        auto [ptr, ec] = std::from_chars(v.data() + b, v.data() + v.size(), current);
        if (ec != std::errc() || (plus && v[b] == '-')) {  // "+-5": std::stoll refuses it too
          error = "ADD to " + shown(key) + ", whose value is not a number";
          break;
        }
        // As c10d's server (two's complement): past the largest int64 it wraps around.
        sum = static_cast<std::int64_t>(static_cast<std::uint64_t>(current) +
                                        static_cast<std::uint64_t>(delta));
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
      if (!read_multi(r, conn.partial, false)) break;
      std::vector<std::string> keys = std::move(conn.partial.keys);
      std::vector<std::string> missing;
      for (auto& k : keys) {
        if (!data_.contains(k)) missing.push_back(std::move(k));
      }
      if (op == Op::kCheck) {
        append_le<std::uint8_t>(out, missing.empty() ? kReady : kNotReady);
      } else if (missing.empty()) {
        append_le<std::uint8_t>(out, kStopWaiting);
      } else {
        if (waits_ + missing.size() > limits_.max_waits) {
          error = "WAIT for " + std::to_string(missing.size()) + " keys while " +
                  std::to_string(waits_) + " are awaited, over the limit of " +
                  std::to_string(limits_.max_waits);
          break;
        }
        drop_waits(id, conn);  // a client waits for one request at a time
        // Why no dedup: c10d counts each named key once per naming, and so does its client.
        for (auto& k : missing) waiting_[k].push_back(id);
        waits_ += missing.size();
        conn.awaited = missing.size();
        conn.waits = std::move(missing);
      }
      break;
    }
    case Op::kCancelWait: {
      drop_waits(id, conn);
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
      if (!read_multi(r, conn.partial, false)) break;
      std::vector<std::string> keys = std::move(conn.partial.keys);
      for (const auto& k : keys) {
        if (!append_value(out, k, "MULTI_GET", error)) break;
      }
      break;
    }
    case Op::kMultiSet: {
      if (!read_multi(r, conn.partial, true)) break;
      auto& keys = conn.partial.keys;
      auto& values = conn.partial.values;
      for (size_t i = 0; i < keys.size(); ++i) {
        auto old = data_.find(keys[i]);
        bool new_key = old == data_.end();
        if (!fits(keys[i].size(), new_key ? 0 : old->second.size(), values[i].size(), new_key,
                  error))
          break;
        put(keys[i], std::move(values[i]));
        wake(keys[i]);
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
  if (!error.empty()) {
    conn.partial = {};
    return 0;
  }
  if (r.wanted != 0) return incomplete();
  conn.partial = {};
  reserve(conn, 0);
  if (!out.empty()) reply(id, conn, out);
  conn.wanted = 1;
  return r.pos;
}

}  // namespace accel::store

// StoreCore: the key-value state and the wire protocol of c10d's TCPStore server, without
// sockets. The launcher (local mode) and the node agent of node rank 0 (cluster mode) serve it
// to the workers, which are all clients (TORCHELASTIC_USE_AGENT_STORE=True), as under torchrun.
//
// Why our own server and not c10d's: the control plane links no libtorch, and a store held by
// the launcher is bound before any worker starts (no pick-then-release port race), outlives every
// rank of an attempt (no rank loses the store because rank 0 exited first), is emptied between
// attempts, and is bounded (key, value, request and total sizes) where c10d's is not.
//
// Two framings are understood, told apart by a connection's first bytes:
//  * legacy (torch 1.13, and releases before the validation request): [op u8][args]; ops SET 0,
//  COMPARE_SET 1, GET 2, ADD 3, CHECK 4,
//    WAIT 5, GETNUMKEYS 6, WATCH_KEY 7, DELETE_KEY 8, APPEND 9, MULTI_GET 10, MULTI_SET 11,
//    CANCEL_WAIT 12;
//  * validated (newer torch, as read from PyTorch's source): the first request is VALIDATE 0 with
//  the magic 0x3C85F7CE; ops
//    SET 1 ... CANCEL_WAIT 12 (WATCH_KEY gone), PING 13 (echoes a u32 nonce).
// Strings and byte vectors are a u64 length then the bytes; numbers little-endian.
// WATCH_KEY (torch 1.13's C++-only watchKey) and the queue ops are refused: the connection is
// closed with a message that says so.
//
// Thread: not thread-safe; StoreServer drives it from one io_context thread.
#pragma once

#include <absl/container/flat_hash_map.h>
#include <absl/container/inlined_vector.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace accel::store {

struct StoreLimits {
  // 64 KiB of the program's key, plus the prefixes clients add ("/", PrefixStore's "name/").
  size_t max_key_bytes = 64 * 1024 + 1024;
  size_t max_value_bytes = 64 * 1024 * 1024;
  size_t max_keys_per_request = 16 * 1024;  // WAIT, CHECK, MULTI_GET, MULTI_SET
  // Keys plus values held, plus the requests buffered unfinished on every connection.
  size_t max_total_bytes = 1024UL * 1024 * 1024;
  size_t max_keys = 1024 * 1024;
  size_t max_waits = 1024 * 1024;  // keys named by pending WAITs, all connections together
};

enum class Dialect { kUnknown, kLegacy, kValidated };

class StoreCore {
 public:
  using ConnId = std::uint64_t;

  explicit StoreCore(StoreLimits limits = {});

  ConnId open();
  // Consumes every complete request at the front of `in` and erases it from `in`; a partial
  // request stays for the next call. Replies (to this or to waiting connections) are queued for
  // take_output. Returns why the connection must be closed, or nullopt.
  std::optional<std::string> feed(ConnId conn, std::string& in);
  // Forgets the connection and whatever it was waiting for.
  void close(ConnId conn);
  // Connections with queued replies since the last call; then take_output(conn) for each.
  std::vector<ConnId> take_ready();
  std::string take_output(ConnId conn);
  // Drops every key and wait (connections stay known; the server closes them).
  void clear();

  [[nodiscard]] size_t num_keys() const { return data_.size(); }
  [[nodiscard]] size_t stored_bytes() const { return stored_bytes_; }
  [[nodiscard]] std::optional<std::string> value(const std::string& key) const;
  [[nodiscard]] Dialect dialect(ConnId conn) const;
  // How many bytes `in` must hold before feed can make progress again (a hint, >= in.size()).
  [[nodiscard]] size_t bytes_wanted(ConnId conn) const;

 private:
  // A multi-key request (CHECK, WAIT, MULTI_GET, MULTI_SET) read in part: the fields read so far
  // and where they end, so that the next bytes continue it instead of reading it from the start
  // again (linear, not quadratic, in the request's size).
  struct Partial {
    size_t pos = 0;  // 0: none
    size_t count = 0;
    std::vector<std::string> keys, values;
  };
  struct Conn {
    Dialect dialect = Dialect::kUnknown;
    size_t awaited = 0;   // keys of a pending WAIT not yet set
    size_t wanted = 1;    // bytes the front request needs, as far as known
    size_t reserved = 0;  // of max_total_bytes: what this connection's unfinished request holds
    std::vector<std::string> waits;  // the keys its pending WAIT named (index into waiting_)
    Partial partial;
    std::string out;
  };
  enum class Op {
    kSet,
    kCompareSet,
    kGet,
    kAdd,
    kCheck,
    kWait,
    kNumKeys,
    kWatch,
    kDelete,
    kAppend,
    kMultiGet,
    kMultiSet,
    kCancelWait,
    kValidate,
    kPing,
    kQueue,
    kUnknown
  };
  struct Reader;

  static bool read_multi(Reader& r, Partial& p, bool with_values);
  // One request from `in` at offset 0: the bytes it took, 0 when incomplete.
  size_t serve_one(ConnId id, Conn& conn, std::string_view in, std::string& error);
  static Op decode(Dialect d, std::uint8_t byte);
  // Appends the value of `key` as a reply; false (and `error`) when it is not set.
  bool append_value(std::string& out, const std::string& key, const char* op,
                    std::string& error) const;
  void put(const std::string& key, std::string value);
  bool erase(const std::string& key);
  void wake(const std::string& key);
  void reply(ConnId id, Conn& conn, std::string_view bytes);
  // Forgets the keys `conn` waits for (CANCEL_WAIT, close).
  void drop_waits(ConnId id, Conn& conn);
  // Sets what `conn`'s unfinished request holds of the store's bytes.
  void reserve(Conn& conn, size_t bytes);
  [[nodiscard]] bool fits(size_t key_bytes, size_t old_value_bytes, size_t new_value_bytes,
                          bool new_key, std::string& error) const;

  StoreLimits limits_;
  ConnId next_id_ = 1;
  std::unordered_map<ConnId, Conn> conns_;
  std::unordered_map<std::string, std::string> data_;
  // key -> connections waiting. Why a flat table (Abseil's, as gRPC uses): a million pending
  // waits cost ~1 s of the store's one loop in node-based std::unordered_map (a cache miss per
  // node, a node and a vector allocated per key) and about a third of that here.
  absl::flat_hash_map<std::string, absl::InlinedVector<ConnId, 1>> waiting_;
  std::vector<ConnId> ready_;
  size_t stored_bytes_ = 0;
  size_t reserved_bytes_ = 0;  // sum of Conn::reserved
  size_t waits_ = 0;           // sum of Conn::waits' sizes
};

}  // namespace accel::store

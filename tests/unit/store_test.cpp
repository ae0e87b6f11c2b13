// StoreCore, byte for byte: the requests torch's TCPStore clients send and the replies they
// expect. The legacy frames below were captured from Debian's torch 1.13 client.
#include <gtest/gtest.h>

#include <cstring>

#include "agent/store/store_core.h"

namespace accel::store {
namespace {

std::string u8(std::uint8_t v) { return std::string(1, static_cast<char>(v)); }
template <class T>
std::string le(T v) {
  std::string s(sizeof(T), '\0');
  std::memcpy(s.data(), &v, sizeof(T));
  return s;
}
std::string str(std::string_view s) { return le<std::uint64_t>(s.size()) + std::string(s); }
std::string validate() { return u8(0) + le<std::uint32_t>(0x3C85F7CE); }

class StoreCoreTest : public ::testing::Test {
 protected:
  // Feeds `bytes` to `conn` and returns what it got back (every connection's output is drained;
  // other connections' replies are kept in `others`).
  std::string send(StoreCore::ConnId conn, const std::string& bytes) {
    std::string in = bytes;
    error = core.feed(conn, in);
    leftover = in;
    std::string mine;
    for (auto id : core.take_ready()) {
      std::string out = core.take_output(id);
      if (id == conn) {
        mine += out;
      } else {
        others[id] += out;
      }
    }
    return mine;
  }

  StoreCore core;
  std::optional<std::string> error;
  std::string leftover;
  std::map<StoreCore::ConnId, std::string> others;
};

TEST_F(StoreCoreTest, Torch113FramesAsCaptured) {
  auto c = core.open();
  // TCPStore(world_size=2) client: ADD "init/" 1 -> i64 1
  EXPECT_EQ(send(c, u8(3) + str("init/") + le<std::int64_t>(1)), le<std::int64_t>(1));
  EXPECT_EQ(core.dialect(c), Dialect::kLegacy);
  // set("k", "v1"): no reply
  EXPECT_EQ(send(c, u8(0) + str("/k") + str("v1")), "");
  // get("k") = WAIT ["/k"] then GET "/k"
  EXPECT_EQ(send(c, u8(5) + le<std::uint64_t>(1) + str("/k")), u8(0));
  EXPECT_EQ(send(c, u8(2) + str("/k")), str("v1"));
  // add("n", 5)
  EXPECT_EQ(send(c, u8(3) + str("/n") + le<std::int64_t>(5)), le<std::int64_t>(5));
  // compare_set("k", "v1", "v2") -> "v2"
  EXPECT_EQ(send(c, u8(1) + str("/k") + str("v1") + str("v2")), str("v2"));
  // num_keys, delete_key
  EXPECT_EQ(send(c, u8(6)), le<std::int64_t>(3));
  EXPECT_EQ(send(c, u8(8) + str("/n")), le<std::int64_t>(1));
  EXPECT_EQ(send(c, u8(8) + str("/n")), le<std::int64_t>(0));
  // check: 0 ready, 1 not
  EXPECT_EQ(send(c, u8(4) + le<std::uint64_t>(1) + str("/k")), u8(0));
  EXPECT_EQ(send(c, u8(4) + le<std::uint64_t>(2) + str("/k") + str("/zz")), u8(1));
  EXPECT_FALSE(error);
}

TEST_F(StoreCoreTest, ValidatedDialectNumbersOpsFromOneAndAnswersPing) {
  auto c = core.open();
  EXPECT_EQ(send(c, validate()), "");
  EXPECT_EQ(core.dialect(c), Dialect::kValidated);
  EXPECT_EQ(send(c, u8(13) + le<std::uint32_t>(4242)), le<std::uint32_t>(4242));
  EXPECT_EQ(send(c, u8(1) + str("a") + str("x")), "");                       // SET
  EXPECT_EQ(send(c, u8(3) + str("a")), str("x"));                            // GET
  EXPECT_EQ(send(c, u8(9) + str("a") + str("yz")), "");                      // APPEND
  EXPECT_EQ(send(c, u8(10) + le<std::uint64_t>(1) + str("a")), str("xyz"));  // MULTI_GET
  EXPECT_EQ(send(c, u8(11) + le<std::uint64_t>(2) + str("b") + str("1") + str("c") + str("2")), "");
  EXPECT_EQ(send(c, u8(7)), le<std::int64_t>(3));                                     // GETNUMKEYS
  EXPECT_EQ(send(c, u8(4) + str("b") + le<std::int64_t>(-3)), le<std::int64_t>(-2));  // ADD
  EXPECT_EQ(send(c, u8(8) + str("c")), le<std::int64_t>(1));                          // DELETE_KEY
  EXPECT_FALSE(error);
}

TEST_F(StoreCoreTest, WaitRepliesWhenTheLastKeyIsSetAndCancelWaitAnswers) {
  auto waiter = core.open();
  auto setter = core.open();
  EXPECT_EQ(send(waiter, u8(5) + le<std::uint64_t>(2) + str("a") + str("b")), "");  // waits
  EXPECT_EQ(send(setter, u8(0) + str("a") + str("1")), "");
  EXPECT_TRUE(others.empty());
  EXPECT_EQ(send(setter, u8(3) + str("b") + le<std::int64_t>(1)), le<std::int64_t>(1));
  EXPECT_EQ(others[waiter], u8(0));  // STOP_WAITING once both are set
  others.clear();

  EXPECT_EQ(send(waiter, u8(5) + le<std::uint64_t>(1) + str("never")), "");
  EXPECT_EQ(send(waiter, u8(12)), u8(1));  // CANCEL_WAIT -> WAIT_CANCELED
  EXPECT_EQ(send(setter, u8(0) + str("never") + str("x")), "");
  EXPECT_TRUE(others.empty());  // nobody waits any more
}

TEST_F(StoreCoreTest, CompareSetFollowsC10d) {
  auto c = core.open();
  // Missing key, empty expected: created.
  EXPECT_EQ(send(c, u8(1) + str("k") + str("") + str("new")), str("new"));
  // Wrong expected: the stored value comes back, unchanged.
  EXPECT_EQ(send(c, u8(1) + str("k") + str("old") + str("x")), str("new"));
  // Missing key, non-empty expected: the expected value comes back, nothing is stored.
  EXPECT_EQ(send(c, u8(1) + str("m") + str("e") + str("x")), str("e"));
  EXPECT_FALSE(core.value("m"));
}

TEST_F(StoreCoreTest, RequestsSplitAnywhereAreServedWhole) {
  auto c = core.open();
  std::string all = validate() + u8(1) + str("key") + str("value") + u8(3) + str("key");
  std::string got;
  std::string in;
  for (char byte : all) {
    in += byte;
    if (in.size() < core.bytes_wanted(c)) continue;
    error = core.feed(c, in);
    ASSERT_FALSE(error) << *error;
    for (auto id : core.take_ready()) got += core.take_output(id);
  }
  EXPECT_TRUE(in.empty());
  EXPECT_EQ(got, str("value"));
}

TEST_F(StoreCoreTest, BadRequestsCloseTheConnectionWithAReason) {
  struct Case {
    std::string bytes;
    std::string says;
  };
  StoreLimits small;
  small.max_key_bytes = 8;
  small.max_value_bytes = 16;
  small.max_keys_per_request = 4;
  small.max_total_bytes = 40;
  const std::vector<Case> cases = {
      {u8(2) + str("missing"), "not set"},
      {u8(7) + str("k"), "WATCH_KEY"},
      {u8(200), "unknown request type 200"},
      {u8(0) + str("123456789") + str("v"), "a key of 9 bytes is over the limit of 8"},
      {u8(0) + str("k") + le<std::uint64_t>(1ULL << 40), "a value of 1099511627776 bytes"},
      {u8(5) + le<std::uint64_t>(5), "naming 5 keys"},
      {u8(0) + str("n") + str("abc") + u8(3) + str("n") + le<std::int64_t>(1), "not a number"},
      {u8(0) + str("n") + str("+-5") + u8(3) + str("n") + le<std::int64_t>(1), "not a number"},
      {u8(0) + str("a") + str("0123456789abcdef") + u8(0) + str("b") + str("0123456789abcdef") +
           u8(0) + str("c") + str("0123456789abcdef"),
       "over its limit of 40"},
      {validate() + u8(15) + str("q"), "queue operations"},
      {u8(0) + le<std::uint32_t>(0x3C85F7CE) + u8(0) + le<std::uint32_t>(1), "validation magic"},
  };
  for (const auto& tc : cases) {
    StoreCore fresh(small);
    auto c = fresh.open();
    std::string in = tc.bytes;
    auto err = fresh.feed(c, in);
    ASSERT_TRUE(err) << tc.says;
    EXPECT_NE(err->find(tc.says), std::string::npos) << *err;
  }
}

TEST_F(StoreCoreTest, ClearForgetsKeysWaitsAndBytes) {
  auto a = core.open();
  send(a, u8(0) + str("k") + str("v"));
  send(a, u8(5) + le<std::uint64_t>(1) + str("w"));
  EXPECT_EQ(core.num_keys(), 1U);
  EXPECT_GT(core.stored_bytes(), 0U);
  core.clear();
  EXPECT_EQ(core.num_keys(), 0U);
  EXPECT_EQ(core.stored_bytes(), 0U);
  auto b = core.open();
  send(b, u8(0) + str("w") + str("x"));
  EXPECT_TRUE(others.empty());  // the old wait is gone
}

TEST_F(StoreCoreTest, StoredBytesFollowSetsAppendsAndDeletes) {
  auto c = core.open();
  send(c, u8(0) + str("ab") + str("123"));
  EXPECT_EQ(core.stored_bytes(), 5U);
  send(c, u8(0) + str("ab") + str("1"));
  EXPECT_EQ(core.stored_bytes(), 3U);
  auto d = core.open();
  send(d, validate() + u8(9) + str("ab") + str("23"));
  EXPECT_EQ(core.stored_bytes(), 5U);
  EXPECT_EQ(*core.value("ab"), "123");
  send(d, u8(8) + str("ab"));
  EXPECT_EQ(core.stored_bytes(), 0U);
}

// As c10d's server: ADD past the largest int64 wraps around (two's complement).
TEST_F(StoreCoreTest, AddWrapsAroundAsC10dDoes) {
  auto c = core.open();
  EXPECT_EQ(send(c, u8(3) + str("n") + le<std::int64_t>(INT64_MAX)), le<std::int64_t>(INT64_MAX));
  EXPECT_EQ(send(c, u8(3) + str("n") + le<std::int64_t>(1)), le<std::int64_t>(INT64_MIN));
  EXPECT_FALSE(error);
}

// The sizes an unfinished request declares count against the store's limit while it is buffered,
// on every connection together: a client cannot make the server hold more than the limit by never
// finishing a request (1.34 GB of one MULTI_SET used to be buffered).
TEST_F(StoreCoreTest, UnfinishedRequestsCountAgainstTheLimit) {
  StoreLimits small;
  small.max_value_bytes = 600;
  small.max_total_bytes = 1000;
  StoreCore bounded(small);
  auto a = bounded.open();
  auto b = bounded.open();
  // A: MULTI_SET of 2 pairs, the first value's 600 bytes announced but not sent.
  std::string in_a = u8(11) + le<std::uint64_t>(2) + str("k") + le<std::uint64_t>(600);
  EXPECT_FALSE(bounded.feed(a, in_a));
  EXPECT_GE(bounded.bytes_wanted(a), in_a.size() + 600);
  // B: a SET announcing 500 bytes does not fit beside A's.
  const std::string set_b = u8(0) + str("j") + le<std::uint64_t>(500);
  std::string in_b = set_b;
  auto err = bounded.feed(b, in_b);
  ASSERT_TRUE(err);
  EXPECT_NE(err->find("over its limit of 1000 bytes"), std::string::npos) << *err;
  // Once A is gone, it does.
  bounded.close(a);
  auto c = bounded.open();
  std::string in_c = set_b;
  EXPECT_FALSE(bounded.feed(c, in_c));
  in_c += std::string(500, 'x');
  EXPECT_FALSE(bounded.feed(c, in_c));
  EXPECT_EQ(bounded.value("j")->size(), 500U);
}

// A multi-key request arriving in small pieces is read on from where it stopped, and asks for at
// least 8 bytes per key still to come: 10,000 keys sent 64 bytes at a time are read in a few
// dozen passes, not once per piece (which re-read the request from its start every time).
TEST_F(StoreCoreTest, AMultiKeyRequestInPiecesIsReadOnce) {
  auto c = core.open();
  std::string request = u8(10) + le<std::uint64_t>(10000);
  std::string reply;
  for (int i = 0; i < 10000; ++i) {
    std::string key = "key" + std::to_string(i);
    send(c, u8(0) + str(key) + str(std::to_string(i)));
    request += str(key);
    reply += str(std::to_string(i));
  }
  std::string in, got;
  int passes = 0;
  for (size_t at = 0; at < request.size(); at += 64) {
    in += request.substr(at, 64);
    if (in.size() < core.bytes_wanted(c)) continue;
    ++passes;
    error = core.feed(c, in);
    ASSERT_FALSE(error) << *error;
    for (auto id : core.take_ready()) got += core.take_output(id);
  }
  EXPECT_TRUE(in.empty());
  EXPECT_EQ(got, reply);
  EXPECT_LT(passes, 60) << "of " << request.size() / 64 << " pieces";
}

// Keys named by pending WAITs are bounded across connections; a connection's close or
// CANCEL_WAIT frees only its own.
TEST_F(StoreCoreTest, WaitsAreBoundedAndCloseFreesItsOwn) {
  StoreLimits small;
  small.max_waits = 4;
  StoreCore bounded(small);
  auto wait = [](std::vector<std::string> keys) {
    std::string r = u8(5) + le<std::uint64_t>(keys.size());
    for (const auto& k : keys) r += str(k);
    return r;
  };
  auto a = bounded.open();
  auto b = bounded.open();
  std::string in = wait({"x", "y", "z"});
  EXPECT_FALSE(bounded.feed(a, in));
  in = wait({"p", "q"});
  auto err = bounded.feed(b, in);
  ASSERT_TRUE(err);
  EXPECT_NE(err->find("over the limit of 4"), std::string::npos) << *err;
  bounded.close(a);
  auto c = bounded.open();
  in = wait({"p", "q"});
  EXPECT_FALSE(bounded.feed(c, in));
  in = u8(12);  // CANCEL_WAIT
  EXPECT_FALSE(bounded.feed(c, in));
  auto d = bounded.open();
  in = wait({"r", "s", "t", "u"});
  EXPECT_FALSE(bounded.feed(d, in));
  in = u8(0) + str("r") + str("1") + u8(0) + str("s") + str("1") + u8(0) + str("t") + str("1") +
       u8(0) + str("u") + str("1");
  EXPECT_FALSE(bounded.feed(c, in));
  bounded.take_ready();
  EXPECT_EQ(bounded.take_output(d), u8(0)) << "the wait ends when its last key is set";
}

}  // namespace
}  // namespace accel::store

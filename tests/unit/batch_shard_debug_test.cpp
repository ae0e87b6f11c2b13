// The sharding arithmetic under libstdc++'s debug mode (-D_GLIBCXX_DEBUG, set for this target
// only, with its own copy of batch_shard.cpp): container misuse that happens to work in a normal
// build, such as inserting a vector's own range into itself, aborts here. Cases whose tail
// padding must cycle the first samples more than once, with HF Accelerate's results.
#include <cstdio>
#include <string>
#include <vector>

#include "runtime/batch_shard.h"

namespace {

std::string text(const accel::IndexBatches& batches) {
  std::string out;
  for (const auto& b : batches) {
    out += "[";
    for (std::size_t i = 0; i < b.size(); ++i) out += (i ? "," : "") + std::to_string(b[i]);
    out += "]";
  }
  return out;
}

int failures = 0;

void expect(const std::string& what, const accel::IndexBatches& got, const std::string& want) {
  if (text(got) == want) return;
  std::fprintf(stderr, "FAILED %s: got %s, want %s\n", what.c_str(), text(got).c_str(),
               want.c_str());
  ++failures;
}

}  // namespace

int main() {
  const std::vector<int64_t> three{0, 1, 2};
  // 3 samples, batch 4 per process, 2 processes: one short global batch, padded from the start.
  accel::ShardSpec spec{.batch_size = 4, .num_processes = 2, .process_index = 0};
  expect("round robin rank 0", accel::shard_batches(three, spec), "[0,1,2,0]");
  spec.process_index = 1;
  expect("round robin rank 1", accel::shard_batches(three, spec), "[1,2,0,1]");
  // The same with split_batches: a global batch of 4 split into 2 pieces.
  spec = {.batch_size = 4, .num_processes = 2, .process_index = 0, .split_batches = true};
  expect("split rank 0", accel::shard_batches(three, spec), "[0,1]");
  spec.process_index = 1;
  expect("split rank 1", accel::shard_batches(three, spec), "[2,0]");
  // One sample, batch 8 per process, 3 processes: the padding repeats it 24 times.
  spec = {.batch_size = 8, .num_processes = 3, .process_index = 2};
  expect("one sample rank 2", accel::shard_batches({5}, spec), "[5,5,5,5,5,5,5,5]");
  std::printf("%d passed, %d failed\n", 5 - failures, failures);
  return failures == 0 ? 0 : 1;
}

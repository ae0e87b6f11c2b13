// BatchSamplerShard / IterableDatasetShard index arithmetic (ported semantics, not code).
#include "runtime/batch_shard.h"

#include <string>

#include "accel/error.h"

namespace accel {
namespace {

// Appends copies of `v` to itself until it holds at least `n` elements. Why a copy per round:
// inserting a vector's own range into it is undefined behaviour (the insert may reallocate).
void repeat_until(std::vector<int64_t>& v, std::size_t n) {
  while (!v.empty() && v.size() < n) {
    const std::vector<int64_t> copy = v;
    v.insert(v.end(), copy.begin(), copy.end());
  }
}

void check(const ShardSpec& spec) {
  if (spec.batch_size == 0) throw DataError("accel: batch_size must be at least 1");
  if (spec.num_processes == 0 || spec.process_index >= spec.num_processes) {
    throw DataError("accel: process_index " + std::to_string(spec.process_index) +
                    " is not below num_processes " + std::to_string(spec.num_processes));
  }
  if (spec.split_batches && spec.batch_size % spec.num_processes != 0) {
    throw DataError(
        "accel: split_batches needs a batch size that divides evenly between the processes, but " +
        std::to_string(spec.batch_size) + " % " + std::to_string(spec.num_processes) + " != 0");
  }
}

std::vector<int64_t> slice(const std::vector<int64_t>& v, std::size_t begin, std::size_t end) {
  if (begin >= v.size()) return {};
  return {v.begin() + static_cast<std::ptrdiff_t>(begin),
          v.begin() + static_cast<std::ptrdiff_t>(std::min(end, v.size()))};
}

// Split mode: every global batch is cut into num_processes pieces; rank r takes piece r.
IndexBatches split_mode(const IndexBatches& batches, const ShardSpec& spec) {
  const std::size_t piece = spec.batch_size / spec.num_processes;
  const std::size_t lo = piece * spec.process_index, hi = lo + piece;
  IndexBatches out;
  for (const auto& b : batches) {
    if (b.size() == spec.batch_size) out.push_back(slice(b, lo, hi));
  }
  if (spec.drop_last || batches.empty() || batches.back().size() == spec.batch_size) return out;
  std::vector<int64_t> last = batches.back();
  if (!spec.even_batches) {
    if (last.size() > lo) out.push_back(slice(last, lo, hi));
    return out;
  }
  std::vector<int64_t> initial = batches.front();
  repeat_until(initial, spec.batch_size);
  last.insert(last.end(), initial.begin(), initial.end());
  out.push_back(slice(last, lo, hi));
  return out;
}

// No split: global batch i goes to rank i % n, a round at a time; the tail is padded by cycling
// the first n batches' indices (even_batches) so every rank gets the same number of full batches.
IndexBatches round_robin_mode(const IndexBatches& batches, const ShardSpec& spec) {
  const std::size_t n = spec.num_processes, rank = spec.process_index, bs = spec.batch_size;
  IndexBatches out;
  std::vector<int64_t> initial, to_yield, batch;
  std::size_t idx = 0;
  for (idx = 0; idx < batches.size(); ++idx) {
    batch = batches[idx];
    if (!spec.drop_last && idx < n) initial.insert(initial.end(), batch.begin(), batch.end());
    if (idx % n == rank) to_yield = batch;
    if (idx % n == n - 1 && batch.size() == bs) {
      out.push_back(to_yield);
      to_yield.clear();
    }
  }
  if (spec.drop_last || initial.empty()) return out;
  idx = batches.size() - 1;  // the index of `batch`, the last one seen
  if (!spec.even_batches) {
    if (!to_yield.empty()) out.push_back(to_yield);
    return out;
  }
  if (to_yield.size() == bs) out.push_back(to_yield);
  repeat_until(initial, n * bs);
  if (batch.size() == bs) {
    batch.clear();
    ++idx;
  }
  std::size_t cycle = 0;
  while (idx % n != 0 || !batch.empty()) {
    std::size_t end = cycle + bs - batch.size();
    auto fill = slice(initial, cycle, end);
    batch.insert(batch.end(), fill.begin(), fill.end());
    if (idx % n == rank) out.push_back(batch);
    cycle = end;
    batch.clear();
    ++idx;
  }
  return out;
}

}  // namespace

IndexBatches make_batches(const std::vector<int64_t>& order, std::size_t batch_size,
                          bool drop_last) {
  if (batch_size == 0) throw DataError("accel: batch_size must be at least 1");
  IndexBatches out;
  for (std::size_t i = 0; i < order.size(); i += batch_size) {
    if (drop_last && i + batch_size > order.size()) break;
    out.push_back(slice(order, i, i + batch_size));
  }
  return out;
}

IndexBatches shard_batches(const std::vector<int64_t>& order, const ShardSpec& spec) {
  check(spec);
  IndexBatches batches = make_batches(order, spec.batch_size, spec.drop_last);
  if (spec.num_processes == 1) return batches;
  return spec.split_batches ? split_mode(batches, spec) : round_robin_mode(batches, spec);
}

int64_t shard_remainder(std::size_t dataset_size, const ShardSpec& spec) {
  check(spec);
  if (spec.drop_last || !spec.even_batches || spec.num_processes == 1) return -1;
  std::size_t global = spec.split_batches ? spec.batch_size : spec.batch_size * spec.num_processes;
  return static_cast<int64_t>(dataset_size % global);
}

StreamSlice stream_slice(const ShardSpec& spec) {
  check(spec);
  std::size_t global = spec.split_batches ? spec.batch_size : spec.batch_size * spec.num_processes;
  std::size_t piece = spec.split_batches ? spec.batch_size / spec.num_processes : spec.batch_size;
  return {global, piece * spec.process_index, piece * (spec.process_index + 1)};
}

}  // namespace accel

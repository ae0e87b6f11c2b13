// Which dataset indices each rank gets: HF Accelerate's BatchSamplerShard and IterableDatasetShard
// semantics (reference/accelerate.md §5), as pure functions so every row of the table is a test.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace accel {

struct ShardSpec {
  std::size_t batch_size = 1;  // per process, or the global batch when split_batches
  bool drop_last = false;
  std::size_t num_processes = 1;
  std::size_t process_index = 0;
  bool split_batches = false;  // batch_size is global and is split into num_processes pieces
  bool even_batches = true;    // pad the tail by cycling the first samples so all ranks match
};

using IndexBatches = std::vector<std::vector<int64_t>>;

// Cuts `order` (a permutation of the dataset) into batches of spec.batch_size (the last may be
// short unless drop_last), i.e. torch's BatchSampler.
IndexBatches make_batches(const std::vector<int64_t>& order, std::size_t batch_size,
                          bool drop_last);

// The batches rank spec.process_index yields in one epoch over `order`. Throws DataError when
// split_batches and batch_size % num_processes != 0. With one process: make_batches.
IndexBatches shard_batches(const std::vector<int64_t>& order, const ShardSpec& spec);

// The samples that really exist in the last global batch, for gather_for_metrics: -1 when no
// sample is duplicated (drop_last, even_batches=false, or one process), else len % global batch.
int64_t shard_remainder(std::size_t dataset_size, const ShardSpec& spec);

// Streams: buffers of num_processes*batch_size examples (batch_size when split); this rank takes
// its slice. Used by the iterable loader, one buffer at a time.
struct StreamSlice {
  std::size_t buffer_size;  // examples read per global batch
  std::size_t begin, end;   // this rank's slice of a buffer
};
StreamSlice stream_slice(const ShardSpec& spec);

}  // namespace accel

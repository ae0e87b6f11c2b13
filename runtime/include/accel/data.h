// Data sets and the DataLoader: batching, seeded shuffling, collation, background prefetch, and
// (through Accelerator::prepare) sharding between processes with HF Accelerate's semantics.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "accel/gradient_state.h"

namespace accel {

// Named tensors: a sample's or a batch's fields beyond input/target (input_ids,
// attention_mask, labels, ...), and the nested form the collectives accept.
using TensorMap = std::map<std::string, torch::Tensor>;

// One sample: `input` and `target` (either may be undefined: language-model inputs, unlabeled
// data) and any named fields. Every sample of a data set has the same fields.
struct Example {
  torch::Tensor input;
  torch::Tensor target;
  TensorMap fields{};
};

// A collated batch: each of input, target and the fields stacked along a new dim 0.
struct Batch {
  torch::Tensor input;
  torch::Tensor target;
  TensorMap fields{};
  // "input", "target" or a field's name; DataError naming the fields there are when absent.
  const torch::Tensor& operator[](const std::string& name) const;
  bool contains(const std::string& name) const;
  // Every defined tensor by name ("input", "target", then the fields in name order).
  std::vector<std::pair<std::string, torch::Tensor>> items() const;
  // Samples: dim 0 of the first defined tensor.
  int64_t size() const;
  Batch to(torch::Device device, bool non_blocking = false) const;
};

// Random access. Thread: get() is called from the loader's prefetch threads at once; make it
// thread-safe (reading tensors is).
class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual std::size_t size() const = 0;
  virtual Example get(std::size_t index) const = 0;
  // Optional fast path: a whole batch at once (used when the loader has no custom collate).
  // The default returns nullopt and the loader calls get() per index, then collates.
  virtual std::optional<Batch> get_batch(const std::vector<int64_t>& indices) const {
    (void)indices;
    return std::nullopt;
  }
};

// Rows of `inputs` (and `targets`) along dim 0, or of named columns (HF's
// Dataset.with_format("torch")): TensorDataset({{"input_ids", ids}, {"labels", labels}}) yields
// examples (and batches) whose fields are those names. Every column has the same rows.
class TensorDataset : public Dataset {
 public:
  explicit TensorDataset(torch::Tensor inputs, torch::Tensor targets = {});
  explicit TensorDataset(TensorMap columns);
  std::size_t size() const override;
  Example get(std::size_t index) const override;
  std::optional<Batch> get_batch(const std::vector<int64_t>& indices) const override;

 private:
  torch::Tensor inputs_, targets_;
  TensorMap columns_;
  int64_t rows_ = 0;
};

// Yields examples one at a time until it returns nullopt.
using ExampleStream = std::function<std::optional<Example>()>;

// A stream with no random access (a file read line by line, a generator). Every rank reads the
// whole stream and keeps its slice of each global batch (HF's IterableDatasetShard).
class IterableDataset {
 public:
  virtual ~IterableDataset() = default;
  // A fresh pass; `epoch` lets a stream reshuffle its shards per epoch.
  virtual ExampleStream stream(int64_t epoch) const = 0;
};

using Collate = std::function<Batch(std::vector<Example>&&)>;
// Stacks inputs, targets and each field (every example must have the same ones).
Batch default_collate(std::vector<Example>&& examples);

struct DataLoaderOptions {
  std::size_t batch_size = 1;  // per process (global when the Accelerator splits batches)
  bool shuffle = false;
  // Epoch e shuffles with seed + e: every rank draws one order. Unset: the last set_seed()'s
  // seed when the loader is constructed, else 0.
  std::optional<uint64_t> seed{};
  bool drop_last = false;
  std::size_t num_workers = 0;  // background threads that build batches; 0: the iterating thread
  std::size_t prefetch_factor = 2;  // batches in flight per worker
  Collate collate{};                // empty: default_collate
};

// Where a pass stands, for progress displays.
struct PassProgress {
  int64_t epoch = 0;
  std::size_t handed_out = 0;  // batches of this pass handed out so far (skipped ones included)
  std::size_t total = 0;       // batches in the pass; SIZE_MAX for a stream
  bool finished = false;       // the pass has ended (every batch handed out, or left early)
};

// Callbacks of a prepared loader (Accelerator::prepare sets them).
struct LoaderHooks {
  // Runs in the calling thread before begin(), epoch() and state() answer (the Accelerator's
  // automatic resume happens there, the first time).
  std::function<void()> on_first_use{};
  // Runs in the iterating thread before each batch is handed out and once at the end of each
  // pass: the previous batch's step is done by then (periodic checkpoints are saved there).
  std::function<void()> on_step_boundary{};
  // Runs in the iterating thread after each batch is handed out and when the pass ends.
  std::function<void(const PassProgress&)> on_progress{};
};

// How a prepared loader is cut between processes (Accelerator::prepare fills this in).
struct ShardOptions {
  std::size_t num_processes = 1;
  std::size_t process_index = 0;
  bool split_batches = false;
  bool even_batches = true;
  torch::Device device{torch::kCPU};
  bool non_blocking = false;
};

// Where a loader stands between passes, for checkpoints: the next pass shuffles with `epoch` and
// starts after its first `batches` batches.
struct LoaderState {
  int64_t epoch = 0;
  uint64_t batches = 0;
  bool operator==(const LoaderState&) const = default;
};

// A handle: copies share one loader. Iterate with range-for; one pass at a time.
class DataLoader {
  struct Impl;
  class Pass;

 public:
  DataLoader(std::shared_ptr<const Dataset> dataset, DataLoaderOptions options);
  DataLoader(std::shared_ptr<const IterableDataset> dataset, DataLoaderOptions options);

  // A new loader over the same data set that yields this rank's share, reports its position
  // to `gradient_state` (may be null) and calls `hooks`.
  DataLoader shard(const ShardOptions& shard,
                   std::shared_ptr<GradientState> gradient_state = nullptr,
                   LoaderHooks hooks = {}) const;

  class Iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    Iterator() = default;
    Batch& operator*() const;
    Batch* operator->() const { return &**this; }
    Iterator& operator++();
    void operator++(int) { ++*this; }
    bool operator==(std::default_sentinel_t) const;

   private:
    friend class DataLoader;
    explicit Iterator(std::shared_ptr<Pass> pass) : pass_(std::move(pass)) {}
    std::shared_ptr<Pass> pass_;
  };

  // Starts a pass over epoch epoch() at state().batches (and advances epoch() when the pass ends).
  Iterator begin();
  std::default_sentinel_t end() const { return {}; }

  // Batches this rank yields per epoch; throws DataError for an iterable data set.
  std::size_t size() const;
  // The epoch the next pass uses for shuffling (HF: set_epoch / iteration). Another epoch than
  // the current one also drops a pending skip (a resumed or abandoned position in the old one).
  void set_epoch(int64_t epoch);
  int64_t epoch() const;
  // A new loader over the same data whose first pass skips its first `n` batches (HF's
  // skip_first_batches): the order is the same, the skipped batches are never built.
  DataLoader skip_first_batches(std::size_t n) const;
  // The position after the batches handed out so far: inside a pass, the batches taken (the last
  // one counts as consumed); a finished pass is the next epoch at batch 0. A pass left early (a
  // break) keeps its place: the next pass starts at the first batch not handed out, so a loop
  // that breaks at max_steps and then saves resumes exactly where it stopped. set_epoch() to
  // another epoch, or load_state({epoch, 0}), starts at that epoch's first batch.
  LoaderState state() const;
  // The next pass uses state.epoch and skips state.batches batches. UsageError during a pass.
  void load_state(const LoaderState& state);
  // Samples in a map-style data set; nullopt for an IterableDataset.
  std::optional<std::size_t> dataset_size() const;
  bool end_of_dataloader() const;
  int64_t remainder() const;
  std::size_t batch_size() const;        // per process
  std::size_t total_batch_size() const;  // over all processes
  const DataLoaderOptions& options() const;
  const ShardOptions& shard_options() const;

 private:
  explicit DataLoader(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

}  // namespace accel

// DataLoader: epochs of batches from a Dataset or IterableDataset, sharded per ShardOptions, built
// ahead by background threads, always one batch ahead so end_of_dataloader is known in time.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>

#include "accel/data.h"
#include "accel/error.h"
#include "accel/seed.h"
#include "runtime/batch_shard.h"
#include "runtime/progress.h"

namespace accel {

namespace {

// "input, target, attention_mask" for messages.
std::string field_names(const Batch& b) {
  std::string out;
  for (const auto& [name, t] : b.items()) out += (out.empty() ? "" : ", ") + name;
  return out.empty() ? "none" : out;
}

}  // namespace

const torch::Tensor& Batch::operator[](const std::string& name) const {
  if (name == "input" && input.defined()) return input;
  if (name == "target" && target.defined()) return target;
  auto it = fields.find(name);
  if (it == fields.end() || !it->second.defined()) {
    throw DataError("accel: the batch has no field \"" + name + "\" (it has " + field_names(*this) +
                    ")");
  }
  return it->second;
}

bool Batch::contains(const std::string& name) const {
  if (name == "input") return input.defined();
  if (name == "target") return target.defined();
  auto it = fields.find(name);
  return it != fields.end() && it->second.defined();
}

std::vector<std::pair<std::string, torch::Tensor>> Batch::items() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  if (input.defined()) out.emplace_back("input", input);
  if (target.defined()) out.emplace_back("target", target);
  for (const auto& [name, t] : fields) {
    if (t.defined()) out.emplace_back(name, t);
  }
  return out;
}

int64_t Batch::size() const {
  for (const auto& [name, t] : items()) {
    if (t.dim() > 0) return t.size(0);
  }
  return 0;
}

Batch Batch::to(torch::Device device, bool non_blocking) const {
  Batch out;
  if (input.defined()) out.input = input.to(device, non_blocking);
  if (target.defined()) out.target = target.to(device, non_blocking);
  for (const auto& [name, t] : fields)
    out.fields[name] = t.defined() ? t.to(device, non_blocking) : t;
  return out;
}

TensorDataset::TensorDataset(torch::Tensor inputs, torch::Tensor targets)
    : inputs_(std::move(inputs)), targets_(std::move(targets)) {
  if (!inputs_.defined() || inputs_.dim() == 0)
    throw DataError("accel: TensorDataset needs inputs with a dim 0");
  if (targets_.defined() && (targets_.dim() == 0 || targets_.size(0) != inputs_.size(0))) {
    throw DataError("accel: TensorDataset inputs have " + std::to_string(inputs_.size(0)) +
                    " rows but targets have " +
                    (targets_.dim() == 0 ? std::string("none") : std::to_string(targets_.size(0))));
  }
  rows_ = inputs_.size(0);
}

TensorDataset::TensorDataset(TensorMap columns) : columns_(std::move(columns)) {
  if (columns_.empty()) throw DataError("accel: TensorDataset needs at least one column");
  std::string first;
  for (const auto& [name, t] : columns_) {
    if (!t.defined() || t.dim() == 0) {
      throw DataError("accel: TensorDataset column \"" + name + "\" needs a dim 0");
    }
    if (first.empty()) {
      first = name;
      rows_ = t.size(0);
    } else if (t.size(0) != rows_) {
      throw DataError("accel: TensorDataset column \"" + name + "\" has " +
                      std::to_string(t.size(0)) + " rows but \"" + first + "\" has " +
                      std::to_string(rows_));
    }
  }
}

std::size_t TensorDataset::size() const { return static_cast<std::size_t>(rows_); }

Example TensorDataset::get(std::size_t index) const {
  auto i = static_cast<int64_t>(index);
  Example e;
  if (inputs_.defined()) e.input = inputs_[i];
  if (targets_.defined()) e.target = targets_[i];
  for (const auto& [name, t] : columns_) e.fields[name] = t[i];
  return e;
}

std::optional<Batch> TensorDataset::get_batch(const std::vector<int64_t>& indices) const {
  auto index = torch::tensor(indices, torch::kLong);
  Batch b;
  if (inputs_.defined()) b.input = inputs_.index_select(0, index);
  if (targets_.defined()) b.target = targets_.index_select(0, index);
  for (const auto& [name, t] : columns_) b.fields[name] = t.index_select(0, index);
  return b;
}

Batch default_collate(std::vector<Example>&& examples) {
  if (examples.empty()) throw DataError("accel: default_collate got an empty batch");
  std::vector<torch::Tensor> inputs, targets;
  std::map<std::string, std::vector<torch::Tensor>> fields;
  inputs.reserve(examples.size());
  // Example 0's shape of fields, read before its tensors move out.
  const bool has_input = examples.front().input.defined();
  const bool has_target = examples.front().target.defined();
  const std::size_t field_count = examples.front().fields.size();
  auto describe = [](bool input, bool target, std::size_t n) {
    return std::string("input ") + (input ? "set" : "unset") + ", target " +
           (target ? "set" : "unset") + ", " + std::to_string(n) + " named fields";
  };
  for (std::size_t i = 0; i < examples.size(); ++i) {
    auto& e = examples[i];
    if (e.input.defined() != has_input || e.target.defined() != has_target ||
        e.fields.size() != field_count) {
      throw DataError("accel: default_collate: example " + std::to_string(i) +
                      " of the batch has other fields than example 0 (" +
                      describe(e.input.defined(), e.target.defined(), e.fields.size()) +
                      "; example 0: " + describe(has_input, has_target, field_count) + ")");
    }
    if (e.input.defined()) inputs.push_back(std::move(e.input));
    if (e.target.defined()) targets.push_back(std::move(e.target));
    for (auto& [name, t] : e.fields) {
      if (i > 0 && !fields.count(name)) {
        throw DataError("accel: default_collate: example " + std::to_string(i) +
                        " has the field \"" + name + "\", which example 0 does not");
      }
      fields[name].push_back(std::move(t));
    }
  }
  if (inputs.empty() && fields.empty()) {
    throw DataError("accel: default_collate: the examples have neither an input nor fields");
  }
  Batch b;
  try {
    if (!inputs.empty()) b.input = torch::stack(inputs);
    if (!targets.empty()) b.target = torch::stack(targets);
    for (auto& [name, ts] : fields) b.fields[name] = torch::stack(ts);
  } catch (const c10::Error& e) {
    throw DataError(std::string("accel: default_collate cannot stack the batch's samples (give "
                                "them one shape, or pass a collate that pads): ") +
                    e.what_without_backtrace());
  }
  return b;
}

struct DataLoader::Impl {
  std::shared_ptr<const Dataset> map_dataset;
  std::shared_ptr<const IterableDataset> stream_dataset;
  DataLoaderOptions options;
  ShardOptions shard;
  std::shared_ptr<GradientState> gradient_state;
  int64_t epoch = 0;
  std::shared_ptr<LoaderPosition> position = std::make_shared<LoaderPosition>();
  LoaderHooks hooks;
  std::size_t skip = 0;        // batches the next pass skips (resume, skip_first_batches)
  bool in_pass = false;        // a pass is between its first and its last batch
  std::size_t handed_out = 0;  // batches of the current pass handed out, skipped ones included
  std::size_t pass_total = SIZE_MAX;  // batches in the current pass (SIZE_MAX: a stream)

  // A new loader's state over the same data, configuration and position between passes; it
  // shares no pass or position with this one.
  std::shared_ptr<Impl> fresh_copy() const {
    auto copy = std::make_shared<Impl>();
    copy->map_dataset = map_dataset;
    copy->stream_dataset = stream_dataset;
    copy->options = options;
    copy->shard = shard;
    copy->gradient_state = gradient_state;
    copy->hooks = hooks;
    copy->epoch = epoch;
    copy->skip = skip;
    return copy;
  }

  ShardSpec spec() const {
    return {options.batch_size,  options.drop_last,   shard.num_processes,
            shard.process_index, shard.split_batches, shard.even_batches};
  }
  Batch collate(std::vector<Example>&& examples) const {
    return place(options.collate ? options.collate(std::move(examples))
                                 : default_collate(std::move(examples)));
  }
  Batch place(Batch b) const {
    return shard.device.is_cpu() ? b : b.to(shard.device, shard.non_blocking);
  }
};

// One pass over the data. Produces batches in order, in the caller's thread or in workers.
// Invariant: `current` is the batch handed out; `ahead` the next one (or none at the end).
class DataLoader::Pass {
 public:
  explicit Pass(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {
    impl_->position->end_of_dataloader = false;
    if (impl_->map_dataset) {
      std::size_t n = impl_->map_dataset->size();
      std::vector<int64_t> order(n);
      if (impl_->options.shuffle) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(*impl_->options.seed +
                                                            static_cast<uint64_t>(impl_->epoch));
        auto perm = torch::randperm(static_cast<int64_t>(n), gen, torch::kLong);
        auto acc = perm.accessor<int64_t, 1>();
        for (std::size_t i = 0; i < n; ++i) order[i] = acc[static_cast<int64_t>(i)];
      } else {
        for (std::size_t i = 0; i < n; ++i) order[i] = static_cast<int64_t>(i);
      }
      batches_ = shard_batches(order, impl_->spec());
      impl_->position->remainder = shard_remainder(n, impl_->spec());
      // Why both: the prefetch threads build from next_ and the consumer waits on taken_;
      // a skipped prefix is neither built nor waited for.
      next_ = taken_ = std::min(impl_->skip, total());
      impl_->pass_total = total();
    } else {
      stream_ = impl_->stream_dataset->stream(impl_->epoch);
      slice_ = stream_slice(impl_->spec());
      impl_->position->remainder = -1;
      impl_->pass_total = SIZE_MAX;
    }
    impl_->position->even_batches = impl_->shard.even_batches;
    if (impl_->gradient_state) impl_->gradient_state->push_loader(impl_->position);
    impl_->in_pass = true;
    impl_->handed_out = next_;
    try {
      skip_stream_batches();
      impl_->skip = 0;
      start_workers();
      ahead_ = produce_next();
      advance();
    } catch (...) {
      // Why: ~Pass does not run for a constructor that throws; threads must not outlive it,
      // and the gradient state must not keep pointing at this pass.
      stop_workers();
      finish();
      throw;
    }
  }

  ~Pass() {
    stop_workers();
    finish();
  }

  bool done() const { return !current_; }
  Batch& current() { return *current_; }

  void advance() {
    progress::heartbeat();
    if (impl_->hooks.on_step_boundary) impl_->hooks.on_step_boundary();
    current_ = std::move(ahead_);
    ahead_.reset();
    if (!current_) {
      finish();
      return;
    }
    ++impl_->handed_out;
    ahead_ = produce_next();
    impl_->position->end_of_dataloader = !ahead_;
    // Why: a stream learns how many real samples its last buffer had only when it gets there.
    if (!ahead_ && impl_->stream_dataset) impl_->position->remainder = tail_remainder_;
    // Last: the next batch is built by then (the progress display shows it as handed out).
    if (impl_->hooks.on_progress)
      impl_->hooks.on_progress({impl_->epoch, impl_->handed_out, impl_->pass_total, false});
  }

 private:
  void finish() {
    if (finished_) return;
    finished_ = true;
    impl_->in_pass = false;
    if (impl_->hooks.on_progress) {
      try {
        impl_->hooks.on_progress({impl_->epoch, impl_->handed_out, impl_->pass_total, true});
      } catch (...) {  // Why: a display must not turn a pass's end (or its unwinding) into an error
      }
    }
    if (impl_->gradient_state) impl_->gradient_state->pop_loader(impl_->position.get());
    if (consumed_all_ && !ahead_) {
      // Every batch was handed out (a break on the last one counts): the epoch is done.
      ++impl_->epoch;
      impl_->skip = 0;
    } else if (impl_->handed_out > impl_->skip) {
      // Left early (a break, an exception): the next pass, and a checkpoint taken now, start at
      // the first batch not handed out, as a resumed run would.
      impl_->skip = impl_->handed_out;
    }
  }

  // A stream cannot jump: the batches to skip are read and dropped (before any worker starts).
  void skip_stream_batches() {
    if (!impl_->stream_dataset) return;
    for (std::size_t i = 0; i < impl_->skip; ++i) {
      if (!build_stream()) {
        consumed_all_ = true;
        break;
      }
      ++impl_->handed_out;
    }
  }

  // Map-style batch k, built from its indices.
  Batch build(std::size_t k) const {
    if (!impl_->options.collate) {
      if (auto fast = impl_->map_dataset->get_batch(batches_[k]))
        return impl_->place(std::move(*fast));
    }
    std::vector<Example> examples;
    examples.reserve(batches_[k].size());
    for (int64_t i : batches_[k])
      examples.push_back(impl_->map_dataset->get(static_cast<std::size_t>(i)));
    return impl_->collate(std::move(examples));
  }

  // Next stream batch: read one global buffer, keep this rank's slice; pad the short tail.
  std::optional<Batch> build_stream() {
    if (stream_done_) return std::nullopt;
    std::vector<Example> buffer;
    while (buffer.size() < slice_.buffer_size) {
      auto e = stream_();
      if (!e) break;
      buffer.push_back(std::move(*e));
    }
    if (buffer.size() < slice_.buffer_size) {
      stream_done_ = true;
      if (buffer.empty() || impl_->options.drop_last) return std::nullopt;
      if (impl_->shard.num_processes == 1) return impl_->collate(std::move(buffer));
      tail_remainder_ = static_cast<int64_t>(buffer.size());
      if (first_buffer_.empty()) first_buffer_ = buffer;
      std::size_t i = 0;
      while (buffer.size() < slice_.buffer_size)
        buffer.push_back(first_buffer_[i++ % first_buffer_.size()]);
    } else if (first_buffer_.empty() && !impl_->options.drop_last) {
      first_buffer_ = buffer;
    }
    std::vector<Example> mine(buffer.begin() + static_cast<std::ptrdiff_t>(slice_.begin),
                              buffer.begin() + static_cast<std::ptrdiff_t>(slice_.end));
    return impl_->collate(std::move(mine));
  }

  std::size_t total() const { return batches_.size(); }

  std::optional<Batch> produce_next() {
    std::optional<Batch> out;
    if (workers_.empty()) {
      if (impl_->map_dataset) {
        if (next_ < total()) out = build(next_++);
      } else {
        out = build_stream();
      }
    } else {
      out = take_from_workers();
    }
    if (!out) consumed_all_ = true;
    return out;
  }

  // --- background prefetch -------------------------------------------------------------------
  // Map-style: workers claim batch numbers in order and may finish out of order; the consumer
  // takes them in order. Streams: one worker reads ahead. At most `window_` batches are built
  // and not yet taken.
  void start_workers() {
    std::size_t n = impl_->options.num_workers;
    if (n == 0) return;
    if (!impl_->map_dataset) n = 1;
    window_ = std::max<std::size_t>(
        1, impl_->options.num_workers * std::max<std::size_t>(1, impl_->options.prefetch_factor));
    for (std::size_t i = 0; i < n; ++i) workers_.emplace_back([this] { worker_loop(); });
  }

  void stop_workers() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  void worker_loop() {
    for (;;) {
      std::size_t k;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || (next_ < taken_ + window_ && !exhausted_); });
        if (stopping_ || exhausted_) return;
        if (impl_->map_dataset && next_ >= total()) {
          exhausted_ = true;
          cv_.notify_all();
          return;
        }
        k = next_++;
      }
      std::optional<Batch> batch;
      std::exception_ptr error;
      try {
        batch = impl_->map_dataset ? std::optional<Batch>(build(k)) : build_stream();
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard lock(mu_);
      if (error)
        ready_[k] = Slot{std::nullopt, error};
      else if (batch)
        ready_[k] = Slot{std::move(batch), nullptr};
      else
        exhausted_ = true;
      if (!error && !batch && !impl_->map_dataset) end_at_ = k;
      cv_.notify_all();
    }
  }

  std::optional<Batch> take_from_workers() {
    std::unique_lock lock(mu_);
    std::size_t k = taken_;
    cv_.wait(lock,
             [&] { return ready_.count(k) || (impl_->map_dataset ? k >= total() : end_at_ <= k); });
    auto it = ready_.find(k);
    if (it == ready_.end()) return std::nullopt;
    Slot slot = std::move(it->second);
    ready_.erase(it);
    ++taken_;
    cv_.notify_all();
    if (slot.error) std::rethrow_exception(slot.error);
    return std::move(slot.batch);
  }

  struct Slot {
    std::optional<Batch> batch;
    std::exception_ptr error;
  };

  std::shared_ptr<Impl> impl_;
  IndexBatches batches_;
  ExampleStream stream_;
  StreamSlice slice_{};
  std::vector<Example> first_buffer_;
  bool stream_done_ = false;
  int64_t tail_remainder_ = -1;  // written by whoever builds stream batches, read after the end
  std::optional<Batch> current_, ahead_;
  bool finished_ = false;
  bool consumed_all_ = false;

  std::mutex mu_;  // guards next_, taken_, ready_, exhausted_, end_at_, stopping_
  std::condition_variable cv_;
  std::vector<std::thread> workers_;
  std::size_t next_ = 0, taken_ = 0, window_ = 1;
  std::size_t end_at_ = SIZE_MAX;
  std::map<std::size_t, Slot> ready_;
  bool exhausted_ = false, stopping_ = false;
};

DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset, DataLoaderOptions options)
    : impl_(std::make_shared<Impl>()) {
  if (!dataset) throw DataError("accel: DataLoader got a null dataset");
  if (options.batch_size == 0) throw DataError("accel: DataLoader batch_size must be at least 1");
  impl_->map_dataset = std::move(dataset);
  if (!options.seed) options.seed = last_seed().value_or(0);
  impl_->options = std::move(options);
}

DataLoader::DataLoader(std::shared_ptr<const IterableDataset> dataset, DataLoaderOptions options)
    : impl_(std::make_shared<Impl>()) {
  if (!dataset) throw DataError("accel: DataLoader got a null dataset");
  if (options.batch_size == 0) throw DataError("accel: DataLoader batch_size must be at least 1");
  if (options.shuffle) {
    throw DataError(
        "accel: shuffle=true needs random access; an IterableDataset shuffles its own stream per "
        "epoch");
  }
  impl_->stream_dataset = std::move(dataset);
  if (!options.seed) options.seed = last_seed().value_or(0);
  impl_->options = std::move(options);
}

DataLoader DataLoader::shard(const ShardOptions& shard,
                             std::shared_ptr<GradientState> gradient_state,
                             LoaderHooks hooks) const {
  auto impl = impl_->fresh_copy();
  impl->shard = shard;
  impl->gradient_state = std::move(gradient_state);
  impl->hooks = std::move(hooks);
  stream_slice(impl->spec());  // validates split_batches divisibility now, not at the first batch
  return DataLoader(std::move(impl));
}

DataLoader DataLoader::skip_first_batches(std::size_t n) const {
  auto impl = impl_->fresh_copy();
  impl->skip = n;
  return DataLoader(std::move(impl));
}

LoaderState DataLoader::state() const {
  if (impl_->hooks.on_first_use) impl_->hooks.on_first_use();
  if (!impl_->in_pass) return {impl_->epoch, impl_->skip};
  if (impl_->handed_out >= impl_->pass_total) return {impl_->epoch + 1, 0};
  return {impl_->epoch, impl_->handed_out};
}

void DataLoader::load_state(const LoaderState& state) {
  if (impl_->in_pass) {
    throw UsageError(
        "accel: DataLoader::load_state during a pass over the loader; load before the loop starts");
  }
  impl_->epoch = state.epoch;
  impl_->skip = static_cast<std::size_t>(state.batches);
}

std::optional<std::size_t> DataLoader::dataset_size() const {
  if (!impl_->map_dataset) return std::nullopt;
  return impl_->map_dataset->size();
}

DataLoader::Iterator DataLoader::begin() {
  if (impl_->hooks.on_first_use) impl_->hooks.on_first_use();
  return Iterator(std::make_shared<Pass>(impl_));
}

Batch& DataLoader::Iterator::operator*() const { return pass_->current(); }

DataLoader::Iterator& DataLoader::Iterator::operator++() {
  pass_->advance();
  return *this;
}

bool DataLoader::Iterator::operator==(std::default_sentinel_t) const {
  return !pass_ || pass_->done();
}

std::size_t DataLoader::size() const {
  if (!impl_->map_dataset) throw DataError("accel: an IterableDataset has no length");
  std::vector<int64_t> order(impl_->map_dataset->size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  return shard_batches(order, impl_->spec()).size();
}

void DataLoader::set_epoch(int64_t epoch) {
  // Why only on a change: set_epoch(e) at the top of each epoch must not undo a resume into e.
  if (epoch != impl_->epoch) impl_->skip = 0;
  impl_->epoch = epoch;
}
int64_t DataLoader::epoch() const {
  if (impl_->hooks.on_first_use) impl_->hooks.on_first_use();
  return impl_->epoch;
}
bool DataLoader::end_of_dataloader() const { return impl_->position->end_of_dataloader; }
int64_t DataLoader::remainder() const { return impl_->position->remainder; }
std::size_t DataLoader::batch_size() const {
  return impl_->shard.split_batches ? impl_->options.batch_size / impl_->shard.num_processes
                                    : impl_->options.batch_size;
}
std::size_t DataLoader::total_batch_size() const {
  return impl_->shard.split_batches ? impl_->options.batch_size
                                    : impl_->options.batch_size * impl_->shard.num_processes;
}
const DataLoaderOptions& DataLoader::options() const { return impl_->options; }
const ShardOptions& DataLoader::shard_options() const { return impl_->shard; }

}  // namespace accel

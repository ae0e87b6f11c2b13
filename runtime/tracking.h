// Experiment trackers of the main process (Accelerator::init_trackers / log): TensorBoard event
// files written natively (TFRecord framing, masked CRC-32C, TensorBoard's Event/Summary
// messages), JSON lines and CSV. Each tracker appends to one file, one write per record, so a
// killed run keeps what it logged; a checkpoint records every file's size and a resumed run cuts
// the files back to it before appending, so no step is logged twice.
// Thread: one thread (the training thread of the main process).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "runtime/progress_bar.h"

namespace accel::tracking {

// The trackers a log_with value names, in a fixed order ("tensorboard", "jsonl", "csv"): items
// may hold several names separated by commas, "all", or nothing. ConfigError naming `where` and
// the value for anything else.
std::vector<std::string> parse_log_with(const std::vector<std::string>& items,
                                        const std::string& where);

// metrics.jsonl, metrics.csv, config.json, events.out.tfevents.*: the files a tracker writes.
bool is_tracker_file(const std::string& name);

// UsageError for a name a record cannot have: empty, "step" or "wall_time".
void check_value_names(const std::map<std::string, double>& values);

// True when this build can write TensorBoard files (libaccel was built with protobuf).
bool tensorboard_available();

// What a checkpoint records: the run's name and each tracker file's size at the save.
struct Position {
  std::string run;
  std::map<std::string, uint64_t> files;  // plain file names in the run's folder -> bytes
};

class Trackers {
 public:
  // `kinds` from parse_log_with; files go to `dir` (logging_dir/run). `config_json` is written
  // to dir/config.json when the files are opened.
  Trackers(std::vector<std::string> kinds, std::filesystem::path dir, std::string run,
           std::string config_json);
  ~Trackers();
  Trackers(const Trackers&) = delete;
  Trackers& operator=(const Trackers&) = delete;

  // Creates the folder and opens the files. With `resume` of this run whose files are all there
  // and at least as long, they are cut back to its sizes and appended to; otherwise the run
  // starts anew and files an earlier run left in the folder move to dir/previous-<n>/. Returns
  // what was done, for the log. CheckpointError when the folder cannot be written.
  std::string open(const std::optional<Position>& resume);
  bool is_open() const { return open_; }
  // One record per tracker (write(2) each). UsageError for the reserved names step/wall_time.
  // `only`: the one tracker kind to write (Accelerator::get_tracker); empty: all of them.
  void log(const std::vector<std::pair<std::string, double>>& values, int64_t step,
           double wall_time, const std::string& only = {});
  // The file tracker `kind` writes; empty before open() or when it is not on.
  std::filesystem::path file_of(const std::string& kind) const;
  Position position() const;
  const std::filesystem::path& dir() const { return dir_; }
  const std::string& run() const { return run_; }
  void close();

 private:
  struct File;
  std::vector<std::string> kinds_;
  std::filesystem::path dir_;
  std::string run_;
  std::string config_json_;
  bool open_ = false;
  std::vector<std::unique_ptr<File>> files_;  // one per kind, in kinds_ order
};

}  // namespace accel::tracking

namespace accel::detail {

// The Accelerator's tracker state.
struct Tracking {
  struct Record {
    std::vector<std::pair<std::string, double>> values;
    int64_t step;
    double wall_time;
    std::string only;  // one tracker kind (get_tracker), or empty for all
  };
  std::vector<std::string> kinds;                // from log_with / ACCEL_LOG_WITH
  bool initialized = false;                      // init_trackers ran (on any process)
  std::filesystem::path dir;                     // logging_dir/project_name
  std::unique_ptr<tracking::Trackers> trackers;  // main process, after init_trackers
  std::vector<Record> pending;  // logged before the trackers could open (resume undecided)
  std::optional<tracking::Position> resume;   // from the checkpoint loaded last
  std::unique_ptr<ProgressBar> bar;           // main process, unless turned off
  std::map<std::string, double> last_values;  // the last log()'s, for the bar
};

}  // namespace accel::detail

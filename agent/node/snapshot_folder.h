// A job's in-memory snapshots on this node (accel-launch --snapshot-interval): a private folder
// in /dev/shm that the node's workers write their snapshots into (ACCEL_SNAPSHOT_DIR). It must
// outlive the workers (a restarted group resumes from it), so the agent (or the local launcher)
// owns it: made when the job's first round starts on this node, removed when the job is over
// here or the agent exits. The owner holds an exclusive flock() on it; a folder nobody holds (its
// agent was SIGKILLed) is removed by the next agent or launcher of the same user that starts.
#pragma once

#include <map>
#include <memory>
#include <string>

namespace accel::node {

// Whether a job's worker settings ask for snapshots (ACCEL_SNAPSHOT_INTERVAL above 0).
bool wants_snapshots(const std::map<std::string, std::string>& worker_settings);

class SnapshotFolder {
 public:
  // Makes /dev/shm/accel-snapshots-XXXXXX (mode 0700) for `job_id` and locks it; null with
  // `why` set when it cannot (no /dev/shm, or full).
  static std::unique_ptr<SnapshotFolder> create(const std::string& job_id, std::string& why);
  // Removes this user's snapshot folders in /dev/shm that no process holds; returns how many.
  static int remove_unheld();

  ~SnapshotFolder();  // removes the folder, then lets go of it
  SnapshotFolder(const SnapshotFolder&) = delete;
  SnapshotFolder& operator=(const SnapshotFolder&) = delete;

  const std::string& path() const { return path_; }
  const std::string& job_id() const { return job_id_; }

 private:
  SnapshotFolder(std::string path, std::string job_id, int lock)
      : path_(std::move(path)), job_id_(std::move(job_id)), lock_(lock) {}
  std::string path_;
  std::string job_id_;
  int lock_ = -1;
};

}  // namespace accel::node

// ClusterConfig: the one configuration model shared by accel-launch and accel-agent, and the
// table of its keys (name, type, default, doc). Values come from five sources; the highest
// present one wins, key by key: a typed flag > an ACCEL_* environment variable > a Slurm job
// step's variables > the config file > the default (docs/configuration.md).
#pragma once

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "agent/common/defaults.h"
#include "agent/common/status.h"
#include "contract/duration.h"
#include "contract/worker_contract.h"

namespace accel::config {

enum class Source { kDefault, kFile, kSlurm, kEnv, kFlag };
std::string_view source_name(Source s);

// Where a value came from: "cluster.yaml:3:16", "ACCEL_NUM_PROCESSES", "--num-processes".
struct Origin {
  Source source = Source::kDefault;
  std::string where;
};

enum class MixedPrecision { kNo, kFp16, kBf16 };
std::string_view to_string(MixedPrecision m);

// `nodes: "2"` or `nodes: "2:4"` (elastic: at least 2, at most 4 nodes).
struct NodeRange {
  int min = 1;
  int max = 1;
  bool operator==(const NodeRange&) const = default;
};

struct ClusterConfig {
  int num_processes = 1;  // worker processes on this node
  NodeRange nodes;        // how many nodes take part
  int machine_rank = 0;   // this node's rank (multi-node, HF style)
  std::string main_process_ip = "127.0.0.1";
  int main_process_port = 0;  // MASTER_PORT; 0 = pick a free one per attempt
  int max_restarts = 0;       // whole-group restarts after a failure
  std::string log_dir;        // empty: no log files
  int tee = 3;                // with log_dir: which streams still go to the console
  MixedPrecision mixed_precision = MixedPrecision::kNo;
  int gradient_accumulation_steps = 1;
  bool use_cpu = false;
  bool debug = false;
  std::string log_level = "info";  // the workers' libaccel log level (ACCEL_LOG_LEVEL)
  std::chrono::milliseconds stop_timeout{defaults::kStopTimeout};  // SIGTERM -> SIGKILL grace
  // every collective (ACCEL_COLLECTIVE_TIMEOUT)
  std::chrono::milliseconds collective_timeout{contract::kDefaultCollectiveTimeout};
  std::string checkpoint_dir;      // empty: no checkpoints (ACCEL_CHECKPOINT_DIR, made absolute)
  int checkpoint_interval = 0;     // optimizer steps per checkpoint; 0 = only save_state()
  bool async_checkpoints = false;  // the automatic saves write in the background
  int snapshot_interval = 0;       // optimizer steps per snapshot in memory; 0 = none
  int zero_stage = 0;              // 1: the workers shard their optimizers' state (ZeRO-1)
  bool resume_force = false;       // resume: force (even from another run's checkpoint) / auto
  // The run's folder: trackers' files, and checkpoints when checkpoint_dir is empty
  // (ACCEL_PROJECT_DIR, made absolute).
  std::string project_dir;
  std::string log_with;  // trackers: tensorboard,jsonl,csv or all; empty: none (ACCEL_LOG_WITH)
  int num_cpu_threads_per_process = 0;  // OMP_NUM_THREADS; 0 = 1 when >1 process, else inherit
  std::string job_id;                   // empty: generated at launch
  bool quiet = false;
  // Control plane (docs/operations.md).
  std::string coordinator;       // HOST:PORT of a standing coordinator (mode 3); empty: none
  int coordinator_port = 29400;  // mode 2: machine rank 0 serves at main_process_ip:this
  std::string token_file;        // shared secret; empty: $ACCEL_TOKEN
  std::string tls_cert;          // PEM files for gRPC TLS; empty: plaintext
  std::string tls_key;
  std::string tls_ca;
  std::string node_id;       // empty: <hostname>-<pid>-<random>
  std::string node_address;  // MASTER_ADDR when this node is rank 0; empty: found
  std::chrono::milliseconds lease_timeout{defaults::kLease};  // a node silent this long is lost
  // served coordinator: ended jobs, lost nodes kept
  std::chrono::milliseconds retention{3'600'000};
  int coordinator_max_nodes = 8192;  // served coordinator: nodes kept, live and lost
  int coordinator_max_jobs = 1024;   // served coordinator: jobs kept, running and ended
  std::chrono::milliseconds join_timeout{300'000};  // a round without min nodes fails the job
  std::chrono::milliseconds last_call{30'000};      // with min nodes, wait this long for more
  std::chrono::milliseconds hang_timeout{600'000};  // a collective in flight this long: hang; 0 off
  std::chrono::milliseconds network_timeout{
      10'000};  // a peer unreachable this long: failure; 0 off
  // no progress outside collectives: hang; 0 off
  std::chrono::milliseconds heartbeat_timeout{1'800'000};
  double straggler_threshold = 2.0;                    // compute per step vs the median; 0 off
  std::chrono::milliseconds straggler_window{60'000};  // slow this long before it is reported
  std::chrono::milliseconds stall_timeout{300'000};    // no step this long: reported; 0 off
  // Metrics and the status page (docs/operations.md): "PORT", "HOST:PORT"; empty: not served.
  std::string metrics_address;
  std::string metrics_token_file;  // a bearer token every request must carry; empty: none
  // accel-launch --coordinator: keep following a job this long without an answer; 0: forever
  std::chrono::milliseconds follow_timeout{1'800'000};

  // Keyed by config key; a key absent here still has its default.
  std::map<std::string, Origin, std::less<>> origins;

  [[nodiscard]] const Origin& origin(std::string_view key) const;
};

// The command lines that offer a key as a flag (a bit set).
enum KeyTool : unsigned { kFileOnly = 0, kLaunchFlag = 1, kAgentFlag = 2, kStatusFlag = 4 };

// One configuration key, declared once: its name, what it accepts, its help, how to read and
// write it as text, its flags, and whether the workers receive it. Its default is the value of
// a default-constructed ClusterConfig; its environment variable is env_var_for(name).
struct KeySpec {
  std::string_view name;
  std::string_view accepts;  // "an integer >= 1", "one of no, fp16, bf16", ...
  std::string_view help;     // one or two sentences: --help, docs, the config wizard
  // Parses `text` into `cfg`. Returns an error message without location ("expected ..., got ...").
  Status (*set)(ClusterConfig& cfg, std::string_view text);
  std::string (*get)(const ClusterConfig& cfg);
  // Command-line spellings ("-n,--num-processes,--nproc-per-node") and the value's name in --help
  // ("N"). An empty metavar makes a switch: --cpu, --cpu=false.
  std::string_view flags = {};
  std::string_view metavar = {};
  unsigned tools = kFileOnly;
  // Every worker receives it as env_var_for(name) (ACCEL_MIXED_PRECISION=bf16), as get() writes
  // it: the runtime reads the same variable a user may set by hand. An empty value unsets it.
  bool to_workers = false;
};

const std::vector<KeySpec>& all_keys();
const KeySpec* find_key(std::string_view name);
// The valid key closest to `unknown` by edit distance (also matching '-' for '_'); empty when
// no key is close enough to be a likely typo.
std::string nearest_key(std::string_view unknown);
// "unknown key 'x' (did you mean 'y'?)", or the list of valid keys when none is near.
std::string unknown_key_message(std::string_view key);
// ACCEL_ + the key in upper case: num_processes -> ACCEL_NUM_PROCESSES.
std::string env_var_for(std::string_view key);

// Sets `key` from text and records its origin. The error message names `where`, the key and
// the problem; for an unknown key it suggests the nearest valid one.
Status set_value(ClusterConfig& cfg, std::string_view key, std::string_view text, Origin origin);

// Checks that need several keys at once (machine_rank < nodes.max; checkpoint_interval > 0
// needs a checkpoint_dir).
Status validate(const ClusterConfig& cfg);

// The text of the key's default ("1", "30m", "" when empty).
std::string default_text(const KeySpec& key);

// The settings every worker receives, from the keys marked to_workers: variable -> value ("" =
// unset it).
std::map<std::string, std::string> worker_settings(const ClusterConfig& cfg);

// Why `--env VAR=...` cannot set `var` because a key sets it for the workers (naming the flag
// or key to use), or nullopt. Also covers HF Accelerate's spelling of the same variable.
std::optional<std::string> set_by_key(std::string_view var);

using contract::format_duration;
using contract::parse_duration;

}  // namespace accel::config

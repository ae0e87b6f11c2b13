// The worker environment, parsed once.
#include "runtime/env.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <initializer_list>
#include <map>

#include "accel/error.h"
#include "contract/duration.h"
#include "contract/slurm.h"
#include "contract/switch_value.h"
#include "contract/worker_contract.h"
#include "runtime/writer_placement.h"

namespace accel::env {
namespace {

namespace c = contract;

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char ch) { return std::tolower(ch); });
  return s;
}

[[noreturn]] void bad(const std::string& name, const std::string& value,
                      const std::string& expected) {
  throw ConfigError("accel: environment variable " + name + "=\"" + value + "\": expected " +
                    expected);
}

// Typed reads through a lookup; the first of `names` that is set wins (accel's, then HF's).
class Reader {
 public:
  explicit Reader(const Lookup& lookup) : lookup_(lookup) {}

  std::optional<std::string> text(std::initializer_list<const char*> names,
                                  std::string* which = nullptr) const {
    for (const char* name : names) {
      auto value = lookup_(name);
      if (value && !value->empty()) {
        if (which != nullptr) *which = name;
        return value;
      }
    }
    return std::nullopt;
  }

  std::optional<long> integer(std::initializer_list<const char*> names, long min, long max) const {
    std::string name;
    auto value = text(names, &name);
    if (!value) return std::nullopt;
    errno = 0;
    char* end = nullptr;
    long parsed = std::strtol(value->c_str(), &end, 10);
    if (errno != 0 || end == value->c_str() || *end != '\0' || parsed < min || parsed > max) {
      bad(name, *value, "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]");
    }
    return parsed;
  }

  bool boolean(std::initializer_list<const char*> names, bool fallback) const {
    std::string name;
    auto value = text(names, &name);
    if (!value) return fallback;
    if (auto on = contract::switch_value(*value)) return *on;
    bad(name, *value, "true or false");
  }

 private:
  const Lookup& lookup_;
};

// A rank started by `srun` without a launcher (`srun -N2 -n4 ./train`): Slurm's step variables
// stand in for torchrun's, as in Lightning and HF Accelerate. Only inside a job step
// (SLURM_STEP_ID): a batch script's own SLURM_NTASKS describes the whole allocation, not this
// process. Returns the torchrun variables to use; empty when this is not such a rank.
std::map<std::string, std::string> slurm_rank_variables(const Lookup& lookup) {
  std::map<std::string, std::string> out;
  auto get = [&](const char* name) { return lookup(name); };
  if (get(c::kRank) || get(c::kWorldSize) || !get("SLURM_STEP_ID") || !get("SLURM_PROCID")) {
    return out;
  }
  const char* tasks_var = get("SLURM_STEP_NUM_TASKS") ? "SLURM_STEP_NUM_TASKS" : "SLURM_NTASKS";
  auto tasks = get(tasks_var);
  if (!tasks) return out;
  auto require = [&](const char* name) {
    auto v = get(name);
    if (!v) {
      throw ConfigError(std::string("accel: started by srun (SLURM_STEP_ID is set) but ") + name +
                        " is not set; start the program with accel-launch, or set RANK, "
                        "WORLD_SIZE, MASTER_ADDR and MASTER_PORT yourself");
    }
    return *v;
  };
  out[c::kWorldSize] = *tasks;
  out[c::kRank] = require("SLURM_PROCID");
  out[c::kLocalRank] = require("SLURM_LOCALID");
  out[c::kGroupRank] = require("SLURM_NODEID");
  const char* per_node_var =
      get("SLURM_STEP_TASKS_PER_NODE") ? "SLURM_STEP_TASKS_PER_NODE" : "SLURM_TASKS_PER_NODE";
  if (auto per_node = get(per_node_var)) {
    auto counts = contract::expand_per_node_counts(*per_node);
    if (!counts.ok()) bad(per_node_var, *per_node, "N or N(xM), comma-separated: " + counts.error);
    long node = std::strtol(out[c::kGroupRank].c_str(), nullptr, 10);
    if (node >= 0 && static_cast<size_t>(node) < counts.items.size()) {
      out[c::kLocalWorldSize] = counts.items[static_cast<size_t>(node)];
    }
  }
  if (!get(c::kMasterAddr)) {
    const char* list_var =
        get("SLURM_STEP_NODELIST") ? "SLURM_STEP_NODELIST" : "SLURM_JOB_NODELIST";
    auto list = require(list_var);
    auto hosts = contract::expand_hostlist(list);
    if (!hosts.ok()) bad(list_var, list, "a Slurm host list such as n[01-04]: " + hosts.error);
    out[c::kMasterAddr] = hosts.items.front();
  }
  if (!get(c::kMasterPort)) {
    out[c::kMasterPort] = std::to_string(
        contract::slurm_port_for_job(require("SLURM_JOB_ID"), contract::kSlurmMasterPortBase));
  }
  return out;
}

}  // namespace

std::chrono::milliseconds parse_duration(const std::string& text, const std::string& what) {
  auto ms = contract::parse_duration(text);  // the launcher's grammar, so both read text alike
  if (!ms || ms->count() <= 0) {
    throw ConfigError(
        "accel: " + what + "=\"" + text +
        "\": expected a positive duration such as 30m, 90s, 500ms or a number of seconds");
  }
  return *ms;
}

WorkerEnv read_worker_env(const Lookup& outer) {
  auto slurm = slurm_rank_variables(outer);
  Lookup lookup = outer;
  if (!slurm.empty()) {
    lookup = [&outer, &slurm](const char* name) -> std::optional<std::string> {
      if (auto it = slurm.find(name); it != slurm.end()) return it->second;
      return outer(name);
    };
  }
  Reader r(lookup);
  WorkerEnv e;
  e.from_slurm = !slurm.empty();
  e.world_size = static_cast<int>(r.integer({c::kWorldSize}, 1, 1 << 20).value_or(1));
  e.rank = static_cast<int>(r.integer({c::kRank}, 0, e.world_size - 1).value_or(0));
  e.local_world_size =
      static_cast<int>(r.integer({c::kLocalWorldSize}, 1, e.world_size).value_or(e.world_size));
  e.local_rank = static_cast<int>(
      r.integer({c::kLocalRank}, 0, e.local_world_size - 1).value_or(e.rank % e.local_world_size));
  e.group_rank = static_cast<int>(
      r.integer({c::kGroupRank}, 0, e.world_size - 1).value_or(e.rank / e.local_world_size));
  e.master_addr = r.text({c::kMasterAddr});
  if (auto port = r.integer({c::kMasterPort}, 1, 65535)) e.master_port = static_cast<int>(*port);
  e.agent_store = r.text({c::kUseAgentStore}).value_or("") == c::kAgentStoreOn;
  e.restart_count = r.text({c::kRestartCount}).value_or("0");

  e.mixed_precision =
      r.text({c::kMixedPrecision, c::kHfMixedPrecision}, &e.mixed_precision_variable);
  if (auto steps =
          r.integer({c::kGradientAccumulationSteps, c::kHfGradientAccumulationSteps}, 1, 1 << 20)) {
    e.gradient_accumulation_steps = static_cast<int>(*steps);
  }
  e.use_cpu = r.boolean({c::kUseCpu, c::kHfUseCpu}, false);
  e.debug = r.boolean({c::kDebug, c::kHfDebugMode}, false);
  e.collective_timeout = c::kDefaultCollectiveTimeout;
  if (auto t = r.text({c::kCollectiveTimeout})) {
    std::string what = "environment variable ";
    what += c::kCollectiveTimeout;
    e.collective_timeout = parse_duration(*t, what);
  }
  e.checkpoint_dir = r.text({c::kCheckpointDir});
  e.project_dir = r.text({c::kProjectDir});
  e.log_with = r.text({c::kLogWith});
  e.checkpoint_total_limit = r.integer({c::kCheckpointTotalLimit}, 1, 1L << 40);
  e.checkpoint_interval = r.integer({c::kCheckpointInterval}, 0, 1L << 40).value_or(0);
  e.async_checkpoints = r.boolean({c::kAsyncCheckpoints}, false);
  e.snapshot_interval = r.integer({c::kSnapshotInterval}, 0, 1L << 40).value_or(0);
  e.snapshot_dir = r.text({c::kSnapshotDir});
  e.zero_stage = static_cast<int>(r.integer({c::kZeroStage}, 0, 1).value_or(0));
  if (auto progress = r.text({c::kProgress})) {
    std::string v = lower(*progress);
    if (v == "on" || v == "1" || v == "true") {
      e.progress = true;
    } else if (v == "off" || v == "0" || v == "false") {
      e.progress = false;
    } else {
      bad(c::kProgress, *progress, "on or off");
    }
  }
  if (auto resume = r.text({c::kResume})) {
    std::string v = lower(*resume);
    if (v != "auto" && v != "force") bad(c::kResume, *resume, "auto or force");
    e.resume_force = v == "force";
  }
  if (auto level = r.text({c::kLogLevel})) {
    std::string v = lower(*level);
    if (v == "debug") {
      e.log_level = LogLevel::kDebug;
    } else if (v == "info") {
      e.log_level = LogLevel::kInfo;
    } else if (v == "warning" || v == "warn") {
      e.log_level = LogLevel::kWarning;
    } else if (v == "error") {
      e.log_level = LogLevel::kError;
    } else {
      bad(c::kLogLevel, *level, "one of debug, info, warning, error");
    }
  }

  e.progress_file = r.text({c::kProgressFile}).value_or("");
  e.shm_collectives = r.boolean({c::kShmCollectives}, true);
  if (auto backend = r.text({c::kBackend})) {
    e.backend = lower(*backend);
    if (e.backend != "auto" && e.backend != "nccl" && e.backend != "gloo")
      bad(c::kBackend, *backend, "auto, nccl or gloo");
  }
  e.group_of_one = r.boolean({c::kGroupOfOne}, false);
  auto trace = r.text({c::kTraceCollectives});
  e.trace_collectives = trace && *trace != "0";
  if (auto algorithm = r.text({c::kShmAllreduce})) {
    if (*algorithm != "split" && *algorithm != "copy")
      bad(c::kShmAllreduce, *algorithm, "split or copy");
    e.shm_allreduce = *algorithm;
  }
  if (auto split = r.text({c::kSplitOptimizerStep})) {
    if (*split != "auto" && *split != "1" && *split != "0")
      bad(c::kSplitOptimizerStep, *split, "auto, 1 or 0");
    e.split_optimizer_step = *split;
  }
  e.keep_freed_memory = r.boolean({c::kKeepFreedMemory}, true);
  if (auto cpus = r.text({c::kCheckpointWriterCpus})) {
    if (!writer_placement::valid_setting(*cpus))
      bad(c::kCheckpointWriterCpus, *cpus, writer_placement::kSettingExpected);
    e.checkpoint_writer_cpus = *cpus;
  }
  e.gloo_socket_ifname = r.text({"GLOO_SOCKET_IFNAME"});
  return e;
}

std::optional<std::string> process_variable(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::nullopt : std::optional<std::string>(v);
}

const WorkerEnv& worker_env() {
  static const WorkerEnv kParsed = read_worker_env(process_variable);
  return kParsed;
}

}  // namespace accel::env

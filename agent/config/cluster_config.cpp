// The key table of ClusterConfig and the text parsers behind it.
#include "agent/config/cluster_config.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstdio>

#include "agent/common/hardware.h"

namespace accel::config {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

// A value for an error message: at most 80 bytes of it, control characters escaped, so a huge
// or binary value cannot flood the terminal.
std::string quoted(std::string_view s) {
  constexpr size_t kShown = 80;
  std::string out = "'";
  for (unsigned char c : s.substr(0, kShown)) {
    if (c < 0x20 || c == 0x7f) {
      char buf[5];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  out += "'";
  if (s.size() > kShown) out += " (" + std::to_string(s.size()) + " bytes)";
  return out;
}

std::optional<long long> parse_integer(std::string_view text) {
  text = trim(text);
  if (!text.empty() && text.front() == '+') text.remove_prefix(1);
  long long v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return v;
}

std::optional<bool> parse_bool(std::string_view text) {
  std::string t = lower(trim(text));
  if (t == "true" || t == "yes" || t == "on" || t == "1") return true;
  if (t == "false" || t == "no" || t == "off" || t == "0") return false;
  return std::nullopt;
}

template <auto Member, long long Min, long long Max>
Status set_int(ClusterConfig& cfg, std::string_view text) {
  auto v = parse_integer(text);
  if (!v || *v < Min || *v > Max) {
    std::string range =
        Max == INT_MAX ? "an integer >= " + std::to_string(Min)
                       : "an integer from " + std::to_string(Min) + " to " + std::to_string(Max);
    return Status::error("expected " + range + ", got " + quoted(trim(text)));
  }
  cfg.*Member = static_cast<int>(*v);
  return Status::ok();
}

// num_processes: a count, or torchrun's words for "what this machine has": auto (one per GPU,
// else one per CPU core), gpu, cpu. Resolved where the value is read, so a config file with
// `num_processes: auto` fits each node it is read on.
Status set_num_processes(ClusterConfig& cfg, std::string_view text) {
  std::string word = lower(trim(text));
  int gpus = word == "auto" || word == "gpu" ? hardware::visible_gpus() : 0;
  if (word == "gpu" && gpus == 0) {
    return Status::error(
        "'gpu' means one worker per GPU, and no NVIDIA GPU is visible here (no driver in "
        "/proc/driver/nvidia, or CUDA_VISIBLE_DEVICES hides them); give a number");
  }
  if (word == "gpu" || (word == "auto" && gpus > 0)) {
    cfg.num_processes = gpus;
    return Status::ok();
  }
  if (word == "auto" || word == "cpu") {
    cfg.num_processes = hardware::usable_cpus();
    return Status::ok();
  }
  auto v = parse_integer(text);
  if (!v || *v < 1 || *v > 4096) {
    return Status::error("expected an integer from 1 to 4096, or auto, gpu or cpu, got " +
                         quoted(trim(text)));
  }
  cfg.num_processes = static_cast<int>(*v);
  return Status::ok();
}

template <auto Member>
std::string get_int(const ClusterConfig& cfg) {
  return std::to_string(cfg.*Member);
}

template <auto Member>
Status set_bool(ClusterConfig& cfg, std::string_view text) {
  auto v = parse_bool(text);
  if (!v) return Status::error("expected true or false, got " + quoted(trim(text)));
  cfg.*Member = *v;
  return Status::ok();
}

template <auto Member>
std::string get_bool(const ClusterConfig& cfg) {
  return cfg.*Member ? "true" : "false";
}

template <auto Member>
std::string get_string(const ClusterConfig& cfg) {
  return cfg.*Member;
}

template <auto Member>
Status set_string(ClusterConfig& cfg, std::string_view text) {
  cfg.*Member = std::string(trim(text));
  return Status::ok();
}

template <auto Member>
Status set_positive_duration(ClusterConfig& cfg, std::string_view text) {
  auto d = parse_duration(text);
  if (!d || d->count() <= 0) {
    return Status::error("expected a positive duration such as 10s, 500ms or 2m, got " +
                         quoted(trim(text)));
  }
  cfg.*Member = *d;
  return Status::ok();
}

template <auto Member>
Status set_duration(ClusterConfig& cfg, std::string_view text) {
  auto d = parse_duration(text);
  if (!d)
    return Status::error("expected a duration such as 30s, 500ms or 0, got " + quoted(trim(text)));
  cfg.*Member = *d;
  return Status::ok();
}

template <auto Member>
std::string get_duration(const ClusterConfig& cfg) {
  return format_duration(cfg.*Member);
}

Status set_coordinator(ClusterConfig& cfg, std::string_view text) {
  std::string t(trim(text));
  auto colon = t.rfind(':');
  auto port = colon == std::string::npos ? std::nullopt : parse_integer(t.substr(colon + 1));
  if (!t.empty() && (colon == 0 || !port || *port < 1 || *port > 65535)) {
    return Status::error("expected HOST:PORT such as 10.0.0.1:29400, got " + quoted(t));
  }
  cfg.coordinator = t;
  return Status::ok();
}

Status set_nodes(ClusterConfig& cfg, std::string_view text) {
  std::string_view t = trim(text);
  auto colon = t.find(':');
  auto lo = parse_integer(t.substr(0, colon));
  auto hi = colon == std::string_view::npos ? lo : parse_integer(t.substr(colon + 1));
  if (!lo || !hi) {
    return Status::error("expected a node count N or a range MIN:MAX such as \"2:4\", got " +
                         quoted(t));
  }
  if (*lo < 1 || *hi > 100000) {
    return Status::error("node counts must be from 1 to 100000, got " + quoted(t));
  }
  if (*lo > *hi) {
    return Status::error("minimum " + std::to_string(*lo) + " is larger than maximum " +
                         std::to_string(*hi) + " in " + quoted(t) + " (write MIN:MAX)");
  }
  cfg.nodes = {static_cast<int>(*lo), static_cast<int>(*hi)};
  return Status::ok();
}

std::string get_nodes(const ClusterConfig& cfg) {
  if (cfg.nodes.min == cfg.nodes.max) return std::to_string(cfg.nodes.min);
  return std::to_string(cfg.nodes.min) + ":" + std::to_string(cfg.nodes.max);
}

Status set_mixed_precision(ClusterConfig& cfg, std::string_view text) {
  std::string t = lower(trim(text));
  if (t == "no" || t == "none" || t == "fp32") {
    cfg.mixed_precision = MixedPrecision::kNo;
  } else if (t == "fp16") {
    cfg.mixed_precision = MixedPrecision::kFp16;
  } else if (t == "bf16") {
    cfg.mixed_precision = MixedPrecision::kBf16;
  } else {
    return Status::error("expected one of no, fp16, bf16, got " + quoted(trim(text)));
  }
  return Status::ok();
}

std::string get_mixed_precision(const ClusterConfig& cfg) {
  return std::string(to_string(cfg.mixed_precision));
}

Status set_resume(ClusterConfig& cfg, std::string_view text) {
  std::string t = lower(trim(text));
  if (t != "auto" && t != "force") {
    return Status::error("expected auto or force, got " + quoted(trim(text)));
  }
  cfg.resume_force = t == "force";
  return Status::ok();
}

std::string get_resume(const ClusterConfig& cfg) { return cfg.resume_force ? "force" : "auto"; }

Status set_host(ClusterConfig& cfg, std::string_view text) {
  std::string_view t = trim(text);
  if (t.empty() || t.size() > 255 ||
      std::any_of(t.begin(), t.end(), [](unsigned char c) { return c <= 0x20 || c >= 0x7f; })) {
    return Status::error("expected a host name or IP address (1-255 printable characters), got " +
                         quoted(text));
  }
  cfg.main_process_ip = std::string(t);
  return Status::ok();
}

Status set_log_dir(ClusterConfig& cfg, std::string_view text) {
  cfg.log_dir = std::string(trim(text));
  return Status::ok();
}

Status set_checkpoint_dir(ClusterConfig& cfg, std::string_view text) {
  cfg.checkpoint_dir = std::string(trim(text));
  return Status::ok();
}

Status set_project_dir(ClusterConfig& cfg, std::string_view text) {
  cfg.project_dir = std::string(trim(text));
  return Status::ok();
}

// Why checked here too: a misspelt tracker should fail at launch, not in every worker.
Status set_log_with(ClusterConfig& cfg, std::string_view text) {
  std::string all = lower(trim(text));
  std::string out;
  std::size_t start = 0;
  while (start <= all.size()) {
    std::size_t end = all.find(',', start);
    if (end == std::string::npos) end = all.size();
    std::string name(trim(std::string_view(all).substr(start, end - start)));
    if (!name.empty() && name != "none") {
      if (name != "tensorboard" && name != "jsonl" && name != "csv" && name != "all") {
        return Status::error("unknown tracker " + quoted(name) +
                             "; expected tensorboard, jsonl, csv or all (several separated by "
                             "commas), got " +
                             quoted(trim(text)));
      }
      out += (out.empty() ? "" : ",") + name;
    }
    start = end + 1;
  }
  cfg.log_with = out;
  return Status::ok();
}

Status set_job_id(ClusterConfig& cfg, std::string_view text) {
  std::string_view t = trim(text);
  bool ok = t.empty() || (t.size() <= 64 && t.front() != '.' &&
                          std::all_of(t.begin(), t.end(), [](unsigned char c) {
                            return std::isalnum(c) || c == '-' || c == '_' || c == '.';
                          }));  // empty: generated at launch
  if (!ok) {
    return Status::error("expected 1-64 characters of [A-Za-z0-9._-] not starting with '.', got " +
                         quoted(t));
  }
  cfg.job_id = std::string(t);
  return Status::ok();
}

Status set_log_level(ClusterConfig& cfg, std::string_view text) {
  std::string t = lower(trim(text));
  if (t == "warn") t = "warning";
  if (t != "debug" && t != "info" && t != "warning" && t != "error") {
    return Status::error("expected one of debug, info, warning, error, got " + quoted(trim(text)));
  }
  cfg.log_level = t;
  return Status::ok();
}

// "c.yaml:2:15: machine_rank", or just the key when it has its default.
std::string where_key(const ClusterConfig& cfg, std::string_view key) {
  const Origin& o = cfg.origin(key);
  return o.where.empty() ? std::string(key) : o.where + ": " + std::string(key);
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

}  // namespace

std::string_view source_name(Source s) {
  switch (s) {
    case Source::kDefault:
      return "default";
    case Source::kFile:
      return "file";
    case Source::kSlurm:
      return "slurm";
    case Source::kEnv:
      return "env";
    case Source::kFlag:
      return "flag";
  }
  return "?";
}

std::string_view to_string(MixedPrecision m) {
  switch (m) {
    case MixedPrecision::kNo:
      return "no";
    case MixedPrecision::kFp16:
      return "fp16";
    case MixedPrecision::kBf16:
      return "bf16";
  }
  return "no";
}

const Origin& ClusterConfig::origin(std::string_view key) const {
  static const Origin kDefaultOrigin{};
  auto it = origins.find(key);
  return it == origins.end() ? kDefaultOrigin : it->second;
}

const std::vector<KeySpec>& all_keys() {
  using C = ClusterConfig;
  constexpr unsigned kLaunch = kLaunchFlag;
  constexpr unsigned kEveryNode = kLaunchFlag | kAgentFlag;
  constexpr unsigned kClient = kLaunchFlag | kAgentFlag | kStatusFlag;
  static const std::vector<KeySpec> kKeys = {
      {.name = "num_processes",
       .accepts = "an integer from 1 to 4096, or auto, gpu or cpu",
       .help = "Worker processes to start on this node (torchrun's --nproc-per-node): a count, "
               "or gpu (one per visible GPU), cpu (one per usable core), auto (gpu if there are "
               "GPUs, else cpu).",
       .set = set_num_processes,
       .get = get_int<&C::num_processes>,
       .flags = "-n,--num-processes,--nproc-per-node",
       .metavar = "N",
       .tools = kLaunch},
      {.name = "nodes",
       .accepts = "N or MIN:MAX",
       .help = "Nodes in the job: a count, or an elastic range MIN:MAX.",
       .set = set_nodes,
       .get = get_nodes,
       .flags = "--nodes,--nnodes",
       .metavar = "N|MIN:MAX",
       .tools = kLaunch},
      {.name = "machine_rank",
       .accepts = "an integer from 0 to 99999",
       .help = "This node's rank when every node runs accel-launch.",
       .set = set_int<&C::machine_rank, 0, 99999>,
       .get = get_int<&C::machine_rank>,
       .flags = "--machine-rank,--node-rank",
       .metavar = "K",
       .tools = kLaunch},
      {.name = "main_process_ip",
       .accepts = "a host name or IP address",
       .help = "MASTER_ADDR: where the job's rendezvous store listens (multi-node: machine rank "
               "0's address).",
       .set = set_host,
       .get = get_string<&C::main_process_ip>,
       .flags = "--main-process-ip,--master-addr",
       .metavar = "HOST",
       .tools = kLaunch},
      {.name = "main_process_port",
       .accepts = "an integer from 0 to 65535",
       .help = "MASTER_PORT; 0 picks a free port.",
       .set = set_int<&C::main_process_port, 0, 65535>,
       .get = get_int<&C::main_process_port>,
       .flags = "--main-process-port,--master-port",
       .metavar = "PORT",
       .tools = kLaunch},
      {.name = "max_restarts",
       .accepts = "an integer >= 0",
       .help = "Restart the whole worker group up to N times after a failure.",
       .set = set_int<&C::max_restarts, 0, INT_MAX>,
       .get = get_int<&C::max_restarts>,
       .flags = "--max-restarts",
       .metavar = "N",
       .tools = kLaunch},
      {.name = "log_dir",
       .accepts = "a directory",
       .help = "Also write each rank's output to <log_dir>/<job_id>/attempt_<k>/rank_<r>.log; "
               "empty: console only.",
       .set = set_log_dir,
       .get = get_string<&C::log_dir>,
       .flags = "--log-dir",
       .metavar = "DIR",
       .tools = kLaunch},
      {.name = "tee",
       .accepts = "an integer from 0 to 3",
       .help = "With log_dir: streams still shown on the console (0 none, 1 stdout, 2 stderr, 3 "
               "both).",
       .set = set_int<&C::tee, 0, 3>,
       .get = get_int<&C::tee>,
       .flags = "--tee",
       .metavar = "0-3",
       .tools = kLaunch},
      {.name = "mixed_precision",
       .accepts = "one of no, fp16, bf16",
       .help = "Mixed-precision mode of the workers' Accelerator.",
       .set = set_mixed_precision,
       .get = get_mixed_precision,
       .flags = "--mixed-precision",
       .metavar = "MODE",
       .tools = kLaunch,
       .to_workers = true},
      {.name = "gradient_accumulation_steps",
       .accepts = "an integer >= 1",
       .help = "Micro-batches per optimizer step.",
       .set = set_int<&C::gradient_accumulation_steps, 1, INT_MAX>,
       .get = get_int<&C::gradient_accumulation_steps>,
       .flags = "--gradient-accumulation-steps",
       .metavar = "N",
       .tools = kLaunch,
       .to_workers = true},
      {.name = "use_cpu",
       .accepts = "true or false",
       .help = "Train on CPU even where a GPU is present.",
       .set = set_bool<&C::use_cpu>,
       .get = get_bool<&C::use_cpu>,
       .flags = "--cpu,--use-cpu",
       .tools = kLaunch,
       .to_workers = true},
      {.name = "debug",
       .accepts = "true or false",
       .help = "Debug mode of the workers (ACCELERATE_DEBUG_MODE): checks that every rank calls "
               "the same collectives.",
       .set = set_bool<&C::debug>,
       .get = get_bool<&C::debug>,
       .flags = "--debug",
       .tools = kLaunch,
       .to_workers = true},
      {.name = "log_level",
       .accepts = "one of debug, info, warning, error",
       .help = "What the workers' libaccel logs: debug adds each rendezvous and checkpoint step; "
               "warning and error keep only problems.",
       .set = set_log_level,
       .get = get_string<&C::log_level>,
       .flags = "--log-level",
       .metavar = "LEVEL",
       .tools = kLaunch,
       .to_workers = true},
      {.name = "stop_timeout",
       .accepts = "a duration such as 10s or 500ms",
       .help = "Grace between SIGTERM and SIGKILL when a worker group is stopped.",
       .set = set_positive_duration<&C::stop_timeout>,
       .get = get_duration<&C::stop_timeout>,
       .flags = "--stop-timeout",
       .metavar = "DURATION",
       .tools = kEveryNode},
      {.name = "collective_timeout",
       .accepts = "a duration such as 30m or 90s",
       .help = "Bound on every collective and on the rendezvous store in the workers.",
       .set = set_positive_duration<&C::collective_timeout>,
       .get = get_duration<&C::collective_timeout>,
       .flags = "--collective-timeout",
       .metavar = "DURATION",
       .tools = kLaunch,
       .to_workers = true},
      {.name = "checkpoint_dir",
       .accepts = "a directory",
       .help = "Folder where libaccel saves checkpoints and from which a restarted group resumes "
               "by itself; empty: none.",
       .set = set_checkpoint_dir,
       .get = get_string<&C::checkpoint_dir>,
       .flags = "--checkpoint-dir",
       .metavar = "DIR",
       .tools = kLaunch,
       .to_workers = true},
      {.name = "checkpoint_interval",
       .accepts = "an integer >= 0",
       .help = "Save a checkpoint every N optimizer steps; 0: only when the program calls "
               "save_state().",
       .set = set_int<&C::checkpoint_interval, 0, INT_MAX>,
       .get = get_int<&C::checkpoint_interval>,
       .flags = "--checkpoint-interval",
       .metavar = "N",
       .tools = kLaunch,
       .to_workers = true},
      {.name = "zero_stage",
       .accepts = "0 or 1",
       .help = "1: ZeRO stage 1, each process keeps the optimizer state of a slice of the "
               "parameters (Adam, AdamW or SGD on CPU); the results are those of 0, bitwise.",
       .set = set_int<&C::zero_stage, 0, 1>,
       .get = get_int<&C::zero_stage>,
       .flags = "--zero-stage",
       .metavar = "N",
       .tools = kLaunch,
       .to_workers = true},
      {.name = "async_checkpoints",
       .accepts = "true or false",
       .help = "The automatic saves copy the state to memory and write it in the background "
               "while training goes on (costs a copy of the model and optimizer state in "
               "memory).",
       .set = set_bool<&C::async_checkpoints>,
       .get = get_bool<&C::async_checkpoints>,
       .flags = "--async-checkpoints",
       .tools = kLaunch,
       .to_workers = true},
      {.name = "resume",
       .accepts = "auto or force",
       .help = "With checkpoint_dir: auto resumes from the newest checkpoint only if the same run "
               "saved it (dataset sizes, model parameters, optimizers) and refuses another run's, "
               "naming what differs; force resumes from it anyway.",
       .set = set_resume,
       .get = get_resume,
       .flags = "--resume",
       .metavar = "auto|force",
       .tools = kLaunch,
       .to_workers = true},
      {.name = "project_dir",
       .accepts = "a directory",
       .help = "The run's folder: experiment trackers write to DIR/<run name>, and checkpoints "
               "go to DIR/checkpoints unless checkpoint_dir is set; empty: none.",
       .set = set_project_dir,
       .get = get_string<&C::project_dir>,
       .flags = "--project-dir",
       .metavar = "DIR",
       .tools = kLaunch,
       .to_workers = true},
      {.name = "log_with",
       .accepts = "tensorboard, jsonl, csv or all, several separated by commas",
       .help = "Experiment trackers the program's init_trackers()/log() write to (main process "
               "only), under project_dir (or checkpoint_dir); empty: none.",
       .set = set_log_with,
       .get = get_string<&C::log_with>,
       .flags = "--log-with",
       .metavar = "TRACKERS",
       .tools = kLaunch,
       .to_workers = true},
      {.name = "num_cpu_threads_per_process",
       .accepts = "an integer from 0 to 4096",
       .help = "OMP_NUM_THREADS of each worker; 0: 1 when a node runs several workers.",
       .set = set_int<&C::num_cpu_threads_per_process, 0, 4096>,
       .get = get_int<&C::num_cpu_threads_per_process>,
       .flags = "--num-cpu-threads-per-process",
       .metavar = "N",
       .tools = kLaunch},
      {.name = "job_id",
       .accepts = "1-64 characters of [A-Za-z0-9._-]",
       .help = "Names the job (TORCHELASTIC_RUN_ID, ACCEL_JOB_ID, log folder); empty: generated.",
       .set = set_job_id,
       .get = get_string<&C::job_id>,
       .flags = "--job-id,--run-id,--rdzv-id",
       .metavar = "ID",
       .tools = kLaunch},
      {.name = "quiet",
       .accepts = "true or false",
       .help = "Only warnings, errors and the failure summary from the launcher or agent.",
       .set = set_bool<&C::quiet>,
       .get = get_bool<&C::quiet>,
       .flags = "-q,--quiet",
       .tools = kEveryNode},
      {.name = "coordinator",
       .accepts = "HOST:PORT",
       .help = "A standing coordinator: accel-launch submits the job there and streams its "
               "output, accel-agent registers there.",
       .set = set_coordinator,
       .get = get_string<&C::coordinator>,
       .flags = "--coordinator",
       .metavar = "HOST:PORT",
       .tools = kClient},
      {.name = "coordinator_port",
       .accepts = "an integer from 0 to 65535",
       .help = "Multi-node (every node runs accel-launch): machine rank 0 serves the coordinator "
               "at main_process_ip:coordinator_port.",
       .set = set_int<&C::coordinator_port, 0, 65535>,
       .get = get_int<&C::coordinator_port>,
       .flags = "--coordinator-port,--rdzv-port",
       .metavar = "PORT",
       .tools = kLaunch},
      {.name = "token_file",
       .accepts = "a file",
       .help = "File whose first line is the control plane's shared token; empty: $ACCEL_TOKEN.",
       .set = set_string<&C::token_file>,
       .get = get_string<&C::token_file>,
       .flags = "--token-file",
       .metavar = "FILE",
       .tools = kClient},
      {.name = "tls_cert",
       .accepts = "a PEM file",
       .help = "TLS certificate of this endpoint (a coordinator's, or a client's for mutual TLS).",
       .set = set_string<&C::tls_cert>,
       .get = get_string<&C::tls_cert>,
       .flags = "--tls-cert",
       .metavar = "FILE",
       .tools = kClient},
      {.name = "tls_key",
       .accepts = "a PEM file",
       .help = "Private key of tls_cert.",
       .set = set_string<&C::tls_key>,
       .get = get_string<&C::tls_key>,
       .flags = "--tls-key",
       .metavar = "FILE",
       .tools = kClient},
      {.name = "tls_ca",
       .accepts = "a PEM file",
       .help = "CA that signs the peers' certificates; clients use TLS when it is set.",
       .set = set_string<&C::tls_ca>,
       .get = get_string<&C::tls_ca>,
       .flags = "--tls-ca",
       .metavar = "FILE",
       .tools = kClient},
      {.name = "node_id",
       .accepts = "1-128 characters of [A-Za-z0-9._:-]",
       .help = "This node's id at the coordinator; empty: <hostname>-<pid>-<random>.",
       .set = set_string<&C::node_id>,
       .get = get_string<&C::node_id>,
       .flags = "--node-id",
       .metavar = "ID",
       .tools = kEveryNode},
      {.name = "node_address",
       .accepts = "a host name or IP address",
       .help = "Where other nodes reach this one (MASTER_ADDR when it is node rank 0); empty: "
               "the address that routes to the coordinator.",
       .set = set_string<&C::node_address>,
       .get = get_string<&C::node_address>,
       .flags = "--node-address,--local-addr",
       .metavar = "HOST",
       .tools = kEveryNode},
      {.name = "lease_timeout",
       .accepts = "a duration such as 10s",
       .help = "A node whose agent has not been heard from for this long is lost; the others go "
               "on without it.",
       .set = set_positive_duration<&C::lease_timeout>,
       .get = get_duration<&C::lease_timeout>,
       .flags = "--lease-timeout",
       .metavar = "DURATION",
       .tools = kEveryNode},
      {.name = "retention",
       .accepts = "a duration such as 1h",
       .help = "A served coordinator forgets an ended job or a lost node this long after it "
               "ended or was lost.",
       .set = set_positive_duration<&C::retention>,
       .get = get_duration<&C::retention>,
       .flags = "--retention",
       .metavar = "DURATION",
       .tools = kAgentFlag},
      {.name = "coordinator_max_nodes",
       .accepts = "an integer from 1 to 1000000",
       .help = "A served coordinator keeps this many nodes, live and lost (about 25 KiB each "
               "while connected); then it forgets the oldest lost one, or refuses a new node "
               "when none is lost.",
       .set = set_int<&C::coordinator_max_nodes, 1, 1'000'000>,
       .get = get_int<&C::coordinator_max_nodes>,
       .flags = "--coordinator-max-nodes",
       .metavar = "N",
       .tools = kAgentFlag},
      {.name = "coordinator_max_jobs",
       .accepts = "an integer from 1 to 100000",
       .help = "A served coordinator keeps this many jobs, running and ended; then it forgets "
               "the oldest ended one, or refuses a new job when none has ended.",
       .set = set_int<&C::coordinator_max_jobs, 1, 100'000>,
       .get = get_int<&C::coordinator_max_jobs>,
       .flags = "--coordinator-max-jobs",
       .metavar = "N",
       .tools = kAgentFlag},
      {.name = "join_timeout",
       .accepts = "a duration such as 5m",
       .help = "A rendezvous round that has not reached the minimum number of nodes by then "
               "fails the job.",
       .set = set_positive_duration<&C::join_timeout>,
       .get = get_duration<&C::join_timeout>,
       .flags = "--join-timeout",
       .metavar = "DURATION",
       .tools = kLaunch},
      {.name = "last_call",
       .accepts = "a duration such as 30s or 0",
       .help = "Elastic jobs: once the minimum number of nodes joined, wait this long for more.",
       .set = set_duration<&C::last_call>,
       .get = get_duration<&C::last_call>,
       .flags = "--last-call",
       .metavar = "DURATION",
       .tools = kLaunch},
      {.name = "hang_timeout",
       .accepts = "a duration such as 10m, or 0 (off)",
       .help = "Stop the group when a worker's collective has been in flight this long, and say "
               "which rank lags.",
       .set = set_duration<&C::hang_timeout>,
       .get = get_duration<&C::hang_timeout>,
       .flags = "--hang-timeout",
       .metavar = "DURATION",
       .tools = kLaunch},
      {.name = "network_timeout",
       .accepts = "a duration such as 10s, or 0 (off)",
       .help = "Multi-node jobs: a node that cannot reach another node of the job for this long "
               "reports a network failure naming both and stops its workers (not counted against "
               "max_restarts); a new round starts once the nodes reach each other.",
       .set = set_duration<&C::network_timeout>,
       .get = get_duration<&C::network_timeout>,
       .flags = "--network-timeout",
       .metavar = "DURATION",
       .tools = kLaunch},
      {.name = "heartbeat_timeout",
       .accepts = "a duration such as 30m, or 0 (off)",
       .help = "Stop the group when a libaccel worker shows no progress (no batch, no "
               "collective) for this long outside any collective.",
       .set = set_duration<&C::heartbeat_timeout>,
       .get = get_duration<&C::heartbeat_timeout>,
       .flags = "--heartbeat-timeout",
       .metavar = "DURATION",
       .tools = kLaunch},
      {.name = "follow_timeout",
       .accepts = "a duration such as 30m, or 0 (forever)",
       .help = "accel-launch --coordinator: how long to keep following a job while the "
               "coordinator does not answer; then exit 124 (the job may still be running).",
       .set = set_duration<&C::follow_timeout>,
       .get = get_duration<&C::follow_timeout>,
       .flags = "--follow-timeout",
       .metavar = "DURATION",
       .tools = kLaunch},
  };
  return kKeys;
}

std::string default_text(const KeySpec& key) {
  static const ClusterConfig kDefaults;
  return key.get(kDefaults);
}

std::map<std::string, std::string> worker_settings(const ClusterConfig& cfg) {
  std::map<std::string, std::string> out;
  for (const auto& key : all_keys()) {
    if (key.to_workers) out[env_var_for(key.name)] = key.get(cfg);
  }
  return out;
}

std::optional<std::string> set_by_key(std::string_view var) {
  for (const auto& key : all_keys()) {
    if (!key.to_workers) continue;
    std::string own = env_var_for(key.name);
    const char* hf = contract::hf_alias(own);
    if (var != own && (hf == nullptr || var != hf)) continue;
    std::string_view flag = key.flags.substr(0, key.flags.find(','));
    if (flag.size() == 2) flag = key.flags.substr(3, key.flags.find(',', 3) - 3);  // past "-x,"
    return std::string(var) + " comes from the launch configuration; use " + std::string(flag) +
           " (or the config key " + std::string(key.name) + ") instead";
  }
  return std::nullopt;
}

const KeySpec* find_key(std::string_view name) {
  for (const auto& k : all_keys()) {
    if (k.name == name) return &k;
  }
  return nullptr;
}

std::string nearest_key(std::string_view unknown) {
  std::string norm = lower(unknown);
  std::replace(norm.begin(), norm.end(), '-', '_');
  const KeySpec* best = nullptr;
  size_t best_distance = SIZE_MAX;
  for (const auto& k : all_keys()) {
    size_t d = edit_distance(norm, k.name);
    if (d < best_distance) {
      best_distance = d;
      best = &k;
    }
  }
  // Why a bound: 'compute_environment' is no typo of 'stop_timeout'; suggest only real neighbours.
  if (best == nullptr || best_distance > std::max<size_t>(3, norm.size() / 3)) return {};
  return std::string(best->name);
}

std::string unknown_key_message(std::string_view key) {
  std::string near = key.size() > 64 ? "" : nearest_key(key);
  if (!near.empty()) return "unknown key " + quoted(key) + " (did you mean '" + near + "'?)";
  std::string all;
  for (const auto& k : all_keys()) all += (all.empty() ? "" : ", ") + std::string(k.name);
  return "unknown key " + quoted(key) + " (valid keys: " + all + ")";
}

std::string env_var_for(std::string_view key) {
  std::string out = "ACCEL_";
  for (char c : key) out += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

Status set_value(ClusterConfig& cfg, std::string_view key, std::string_view text, Origin origin) {
  const KeySpec* spec = find_key(key);
  if (spec == nullptr) {
    return Status::error(origin.where + ": " + unknown_key_message(key));
  }
  if (Status s = spec->set(cfg, text); !s) {
    return Status::error(origin.where + ": " + std::string(key) + ": " + s.message());
  }
  cfg.origins[std::string(key)] = std::move(origin);
  return Status::ok();
}

Status validate(const ClusterConfig& cfg) {
  if (cfg.machine_rank >= cfg.nodes.max) {
    return Status::error(where_key(cfg, "machine_rank") + ": " + std::to_string(cfg.machine_rank) +
                         " is not below the number of nodes (" + std::to_string(cfg.nodes.max) +
                         "); machine ranks run from 0 to nodes - 1");
  }
  if (cfg.checkpoint_interval > 0 && cfg.checkpoint_dir.empty() && cfg.project_dir.empty()) {
    return Status::error(where_key(cfg, "checkpoint_interval") + ": " +
                         std::to_string(cfg.checkpoint_interval) +
                         " needs checkpoint_dir or project_dir (where to save)");
  }

  return Status::ok();
}

}  // namespace accel::config

// The key table of ClusterConfig and the text parsers behind it.
#include "agent/config/cluster_config.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstdio>

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

Status set_collective_timeout(ClusterConfig& cfg, std::string_view text) {
  auto d = parse_duration(text);
  if (!d || d->count() <= 0) {
    return Status::error("expected a positive duration such as 30m, 90s or 500ms, got " +
                         quoted(trim(text)));
  }
  cfg.collective_timeout = *d;
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

std::optional<std::chrono::milliseconds> parse_duration(std::string_view text) {
  text = trim(text);
  size_t unit_at = text.find_first_not_of("0123456789.+");
  std::string_view number = text.substr(0, unit_at);
  std::string unit = unit_at == std::string_view::npos ? "s" : lower(trim(text.substr(unit_at)));
  double value = 0;
  auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), value);
  if (number.empty() || ec != std::errc() || end != number.data() + number.size() ||
      !std::isfinite(value) || value < 0) {
    return std::nullopt;
  }
  double ms_per_unit = 0;
  if (unit == "ms")
    ms_per_unit = 1;
  else if (unit == "s")
    ms_per_unit = 1000;
  else if (unit == "m" || unit == "min")
    ms_per_unit = 60'000;
  else if (unit == "h")
    ms_per_unit = 3'600'000;
  else
    return std::nullopt;
  double ms = value * ms_per_unit;
  if (ms > 1e12) return std::nullopt;
  return std::chrono::milliseconds(static_cast<long long>(std::llround(ms)));
}

std::string format_duration(std::chrono::milliseconds d) {
  long long ms = d.count();
  if (ms % 3'600'000 == 0 && ms != 0) return std::to_string(ms / 3'600'000) + "h";
  if (ms % 60'000 == 0 && ms != 0) return std::to_string(ms / 60'000) + "m";
  if (ms % 1000 == 0) return std::to_string(ms / 1000) + "s";
  return std::to_string(ms) + "ms";
}

const std::vector<KeySpec>& all_keys() {
  using C = ClusterConfig;
  static const std::vector<KeySpec> kKeys = {
      {"num_processes", "an integer from 1 to 4096",
       "Worker processes to start on this node (torchrun's --nproc-per-node).",
       set_int<&C::num_processes, 1, 4096>, get_int<&C::num_processes>},
      {"nodes", "N or MIN:MAX", "How many nodes take part: a fixed count, or an elastic range.",
       set_nodes, get_nodes},
      {"machine_rank", "an integer from 0 to 99999",
       "This node's rank when every node runs accel-launch.", set_int<&C::machine_rank, 0, 99999>,
       get_int<&C::machine_rank>},
      {"main_process_ip", "a host name or IP address",
       "MASTER_ADDR: where rank 0 listens for the process group's store.", set_host,
       get_string<&C::main_process_ip>},
      {"main_process_port", "an integer from 0 to 65535",
       "MASTER_PORT; 0 picks a free port for every attempt.",
       set_int<&C::main_process_port, 0, 65535>, get_int<&C::main_process_port>},
      {"max_restarts", "an integer >= 0",
       "How many times the whole worker group is restarted after a failure.",
       set_int<&C::max_restarts, 0, INT_MAX>, get_int<&C::max_restarts>},
      {"log_dir", "a directory",
       "Also write each rank's output to <log_dir>/<job_id>/attempt_<k>/rank_<r>.log.", set_log_dir,
       get_string<&C::log_dir>},
      {"tee", "an integer from 0 to 3",
       "With log_dir: streams still echoed to the console (1 stdout, 2 stderr, 3 both, 0 none).",
       set_int<&C::tee, 0, 3>, get_int<&C::tee>},
      {"mixed_precision", "one of no, fp16, bf16", "Mixed-precision mode passed to the runtime.",
       set_mixed_precision, get_mixed_precision},
      {"gradient_accumulation_steps", "an integer >= 1",
       "Micro-batches per optimizer step, passed to the runtime.",
       set_int<&C::gradient_accumulation_steps, 1, INT_MAX>,
       get_int<&C::gradient_accumulation_steps>},
      {"use_cpu", "true or false", "Train on CPU even where a GPU is present.",
       set_bool<&C::use_cpu>, get_bool<&C::use_cpu>},
      {"debug", "true or false", "Sets ACCELERATE_DEBUG_MODE for the workers.", set_bool<&C::debug>,
       get_bool<&C::debug>},
      {"stop_timeout", "a duration such as 10s or 500ms",
       "Grace between SIGTERM and SIGKILL when a worker group is stopped.",
       set_positive_duration<&C::stop_timeout>, get_duration<&C::stop_timeout>},
      {"collective_timeout", "a duration such as 30m or 90s",
       "Bound on every collective and the rendezvous store in the workers "
       "(ACCEL_COLLECTIVE_TIMEOUT).",
       set_collective_timeout, get_duration<&C::collective_timeout>},
      {"checkpoint_dir", "a directory",
       "Folder where libaccel saves checkpoints (checkpoints/checkpoint_<n> inside it) and from "
       "which a restarted group resumes by itself (ACCEL_CHECKPOINT_DIR); empty: none.",
       set_checkpoint_dir, get_string<&C::checkpoint_dir>},
      {"checkpoint_interval", "an integer >= 0",
       "Save a checkpoint every N optimizer steps; 0 = only when the program calls save_state() "
       "(ACCEL_CHECKPOINT_INTERVAL).",
       set_int<&C::checkpoint_interval, 0, INT_MAX>, get_int<&C::checkpoint_interval>},
      {"num_cpu_threads_per_process", "an integer from 0 to 4096",
       "OMP_NUM_THREADS for each worker; 0 = 1 when a node runs several workers.",
       set_int<&C::num_cpu_threads_per_process, 0, 4096>, get_int<&C::num_cpu_threads_per_process>},
      {"job_id", "1-64 characters of [A-Za-z0-9._-]",
       "Names the job (TORCHELASTIC_RUN_ID, ACCEL_JOB_ID, log folder); generated if unset.",
       set_job_id, get_string<&C::job_id>},
      {"quiet", "true or false", "Only warnings, errors and the failure summary from the launcher.",
       set_bool<&C::quiet>, get_bool<&C::quiet>},
      {"coordinator", "HOST:PORT",
       "A standing coordinator: accel-launch submits the job there, accel-agent registers there.",
       set_coordinator, get_string<&C::coordinator>},
      {"coordinator_port", "an integer from 0 to 65535",
       "Multi-node (every node runs accel-launch): machine rank 0 serves the coordinator at "
       "main_process_ip:coordinator_port.",
       set_int<&C::coordinator_port, 0, 65535>, get_int<&C::coordinator_port>},
      {"token_file", "a file",
       "File whose first line is the control plane's shared token; empty: "
       "$ACCEL_TOKEN.",
       set_string<&C::token_file>, get_string<&C::token_file>},
      {"tls_cert", "a PEM file",
       "TLS certificate of this endpoint (coordinator, or client for mutual TLS).",
       set_string<&C::tls_cert>, get_string<&C::tls_cert>},
      {"tls_key", "a PEM file", "Private key of tls_cert.", set_string<&C::tls_key>,
       get_string<&C::tls_key>},
      {"tls_ca", "a PEM file",
       "CA that signs the peers' certificates; clients use TLS when it is set.",
       set_string<&C::tls_ca>, get_string<&C::tls_ca>},
      {"node_id", "1-128 characters of [A-Za-z0-9._:-]",
       "This node's id at the coordinator; empty: <hostname>-<pid>-<random>.",
       set_string<&C::node_id>, get_string<&C::node_id>},
      {"node_address", "a host name or IP address",
       "Where other nodes reach this one (MASTER_ADDR when it is node rank 0); empty: the "
       "address that routes to the coordinator.",
       set_string<&C::node_address>, get_string<&C::node_address>},
      {"lease_timeout", "a duration such as 10s",
       "A node whose agent has not been heard from for this long is lost; the others go on "
       "without it.",
       set_positive_duration<&C::lease_timeout>, get_duration<&C::lease_timeout>},
      {"retention", "a duration such as 1h",
       "A served coordinator forgets an ended job and a lost node this long after it ended or was "
       "lost (accel status stops listing it).",
       set_positive_duration<&C::retention>, get_duration<&C::retention>},
      {"join_timeout", "a duration such as 5m",
       "A rendezvous round that has not reached the minimum number of nodes by then fails the job.",
       set_positive_duration<&C::join_timeout>, get_duration<&C::join_timeout>},
      {"last_call", "a duration such as 30s or 0",
       "Elastic jobs: once the minimum number of nodes joined, wait this long for more.",
       set_duration<&C::last_call>, get_duration<&C::last_call>},
      {"hang_timeout", "a duration such as 10m, or 0 (off)",
       "The agent stops the group when a worker's collective has been in flight this long, and "
       "prints which rank lags (progress page; docs/operations.md).",
       set_duration<&C::hang_timeout>, get_duration<&C::hang_timeout>},
      {"heartbeat_timeout", "a duration such as 30m, or 0 (off)",
       "The agent stops the group when a libaccel worker shows no progress (no batch, no "
       "collective) for this long outside any collective: a CPU hang.",
       set_duration<&C::heartbeat_timeout>, get_duration<&C::heartbeat_timeout>},
  };
  return kKeys;
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
  if (cfg.checkpoint_interval > 0 && cfg.checkpoint_dir.empty()) {
    return Status::error(where_key(cfg, "checkpoint_interval") + ": " +
                         std::to_string(cfg.checkpoint_interval) +
                         " needs checkpoint_dir (where to save)");
  }
  return Status::ok();
}

}  // namespace accel::config

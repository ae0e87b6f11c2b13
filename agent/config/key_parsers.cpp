// The parsers and writers of the configuration keys' text that are not templates (key_parsers.h).
#include "agent/config/key_parsers.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdio>
#include <cstdlib>

#include "agent/common/hardware.h"

namespace accel::config::detail {

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
Status set_metrics_address(ClusterConfig& cfg, std::string_view text) {
  std::string_view t = trim(text);
  if (t.empty()) {
    cfg.metrics_address.clear();
    return Status::ok();
  }
  auto colon = t.rfind(':');
  std::string_view port = colon == std::string_view::npos ? t : t.substr(colon + 1);
  auto n = parse_integer(port);
  if ((colon != std::string_view::npos && colon == 0) || !n || *n < 0 || *n > 65535) {
    return Status::error(
        "expected PORT or HOST:PORT (a port of 0 to 65535; PORT alone serves "
        "on 127.0.0.1), got " +
        quoted(text));
  }
  cfg.metrics_address = std::string(t);
  return Status::ok();
}

Status set_straggler_threshold(ClusterConfig& cfg, std::string_view text) {
  std::string t(trim(text));
  char* end = nullptr;
  double v = t.empty() ? -1 : std::strtod(t.c_str(), &end);
  if (t.empty() || end != t.c_str() + t.size() || !(v == 0 || (v >= 1 && v <= 1e6))) {
    return Status::error("expected 0 (off) or a number from 1 to 1e6 (such as 2 or 1.5), got " +
                         quoted(text));
  }
  cfg.straggler_threshold = v;
  return Status::ok();
}

std::string get_straggler_threshold(const ClusterConfig& cfg) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", cfg.straggler_threshold);
  return buf;
}

}  // namespace accel::config::detail

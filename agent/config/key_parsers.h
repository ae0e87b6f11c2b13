// How the configuration keys' text is parsed and written: the set/get functions of the key
// table (cluster_config_keys.cpp) and the text helpers behind them, which cluster_config.cpp
// shares. Internal to accel_config.
#pragma once

#include <climits>
#include <optional>
#include <string>
#include <string_view>

#include "agent/config/cluster_config.h"

namespace accel::config::detail {

std::string_view trim(std::string_view s);
std::string lower(std::string_view s);
// A value for an error message: at most 80 bytes of it, control characters escaped, so a huge
// or binary value cannot flood the terminal.
std::string quoted(std::string_view s);
std::optional<long long> parse_integer(std::string_view text);
std::optional<bool> parse_bool(std::string_view text);

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

Status set_num_processes(ClusterConfig& cfg, std::string_view text);
Status set_coordinator(ClusterConfig& cfg, std::string_view text);
Status set_nodes(ClusterConfig& cfg, std::string_view text);
std::string get_nodes(const ClusterConfig& cfg);
Status set_mixed_precision(ClusterConfig& cfg, std::string_view text);
std::string get_mixed_precision(const ClusterConfig& cfg);
Status set_resume(ClusterConfig& cfg, std::string_view text);
std::string get_resume(const ClusterConfig& cfg);
Status set_host(ClusterConfig& cfg, std::string_view text);
Status set_log_dir(ClusterConfig& cfg, std::string_view text);
Status set_checkpoint_dir(ClusterConfig& cfg, std::string_view text);
Status set_project_dir(ClusterConfig& cfg, std::string_view text);
Status set_log_with(ClusterConfig& cfg, std::string_view text);
Status set_job_id(ClusterConfig& cfg, std::string_view text);
Status set_log_level(ClusterConfig& cfg, std::string_view text);
Status set_metrics_address(ClusterConfig& cfg, std::string_view text);
Status set_straggler_threshold(ClusterConfig& cfg, std::string_view text);
std::string get_straggler_threshold(const ClusterConfig& cfg);

}  // namespace accel::config::detail

// HF Accelerate's and torchrun's launch flags -> config keys, worker variables, warnings.
#include "launcher/foreign_flags.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <optional>

#include "agent/common/hardware.h"

namespace accel::launcher {
namespace {

// Flags of features accel does not have: (name or name prefix ending in '-', the feature).
struct Refused {
  const char* name;
  const char* why;
};
constexpr Refused kRefused[] = {
    {"--use-deepspeed", "DeepSpeed"},
    {"--deepspeed-", "DeepSpeed"},
    {"--zero3-", "DeepSpeed's ZeRO"},
    {"--offload-", "DeepSpeed's offloading"},
    {"--gradient-clipping", "DeepSpeed's gradient clipping (call acc.clip_grad_norm_ instead)"},
    {"--use-fsdp", "FSDP"},
    {"--fsdp-", "FSDP"},
    {"--use-megatron-lm", "Megatron-LM"},
    {"--megatron-lm-", "Megatron-LM"},
    {"--tpu", "TPUs"},
    {"--tpu-", "TPUs"},
    {"--main-training-function", "TPUs"},
    {"--downcast-bf16", "TPUs"},
    {"--use-xpu", "Intel XPUs"},
    {"--ipex", "Intel Extension for PyTorch"},
    {"--mpirun-", "mpirun (accel starts the workers itself)"},
    {"--fp8-", "fp8 training"},
    {"--parallelism-config-", "tensor/context parallelism"},
};

// Value-taking flags that only tune something accel does not have: (name, why it is ignored).
struct Ignored {
  const char* name;
  const char* why;
};
constexpr Ignored kIgnoredValues[] = {
    {"--monitor-interval", "accel-launch learns of a worker's exit at once, without polling"},
    {"--start-method", "accel starts every worker as a fresh process"},
    {"--redirects", "give --log-dir DIR (and --tee) to keep the workers' output in files"},
    {"--role", "accel runs one role per job (ROLE_NAME is 'default')"},
    {"--rdzv-conf",
     "accel's rendezvous has its own settings (join_timeout, last_call, lease_timeout)"},
    {"--log-line-prefix-template", "accel-launch prefixes each worker's lines with [rank N]"},
    {"--local-ranks-filter", "every rank's output reaches the console (--log-dir keeps files)"},
};
constexpr Ignored kIgnoredSwitches[] = {
    {"--same-network", "accel's nodes always meet at main_process_ip"},
    {"--enable-cpu-affinity", "accel does not pin workers to cores"},
};
// Mapped: handled in apply().
constexpr const char* kMappedValues[] = {"--num-machines", "--gpu-ids", "--rdzv-endpoint",
                                         "--rdzv-backend", "--dynamo-backend"};
constexpr const char* kMappedSwitches[] = {"--multi-gpu", "--standalone"};

std::string option_name(const std::string& token) { return token.substr(0, token.find('=')); }

bool typed(const std::vector<std::string>& options, const std::string& name) {
  return std::any_of(options.begin(), options.end(),
                     [&](const std::string& o) { return option_name(o) == name; });
}

const config::FlagValue* find_flag(const std::vector<config::FlagValue>& flags,
                                   const std::string& key) {
  const config::FlagValue* found = nullptr;
  for (const auto& f : flags) {
    if (f.key == key) found = &f;  // the last one wins, as when the config resolves them
  }
  return found;
}

std::optional<int> positive(const std::string& text) {
  if (text.empty() || text.size() > 6 ||
      !std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::nullopt;
  }
  int v = std::stoi(text);
  return v > 0 ? std::optional<int>(v) : std::nullopt;
}

}  // namespace

ForeignFlags::ForeignFlags(CLI::App& app) {
  auto add_value = [&](const char* name) {
    Entry& e = entries_.emplace_back();
    e.name = name;
    e.option = app.add_option(name, e.value)
                   ->group("")
                   ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  };
  auto add_switch = [&](const char* name) {
    Entry& e = entries_.emplace_back();
    e.name = name;
    e.option = app.add_flag(name, e.on)->group("");
  };
  for (const auto& f : kIgnoredValues) add_value(f.name);
  for (const char* f : kMappedValues) add_value(f);
  for (const auto& f : kIgnoredSwitches) add_switch(f.name);
  for (const char* f : kMappedSwitches) add_switch(f);
}

const ForeignFlags::Entry& ForeignFlags::entry(const std::string& name) const {
  return *std::find_if(entries_.begin(), entries_.end(),
                       [&](const Entry& e) { return e.name == name; });
}

std::string ForeignFlags::refused(const std::vector<std::string>& options) {
  for (const auto& token : options) {
    if (token.rfind("--", 0) != 0) continue;
    std::string name = option_name(token);
    for (const auto& r : kRefused) {
      std::string_view pattern = r.name;
      bool match = pattern.back() == '-' ? name.rfind(pattern, 0) == 0 : name == pattern;
      if (match) {
        return name + ": not supported: accel does not do " + r.why +
               "; accel-launch runs data-parallel training (docs/launch.md lists what accel does "
               "with each HF Accelerate and torchrun flag)";
      }
    }
  }
  return {};
}

std::string ForeignFlags::apply(const std::vector<std::string>& options,
                                std::vector<config::FlagValue>& flags,
                                std::vector<std::pair<std::string, std::string>>& worker_env,
                                std::vector<std::string>& warnings) const {
  auto given = [&](const char* name) { return entry(name).option->count() > 0; };
  auto value = [&](const char* name) { return entry(name).value; };
  for (const auto& f : kIgnoredValues) {
    if (given(f.name)) warnings.push_back(std::string(f.name) + " is ignored: " + f.why);
  }
  for (const auto& f : kIgnoredSwitches) {
    if (given(f.name)) warnings.push_back(std::string(f.name) + " is ignored: " + f.why);
  }

  if (given("--dynamo-backend")) {
    std::string v = value("--dynamo-backend");
    std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
    if (v != "no") {
      return "--dynamo-backend " + value("--dynamo-backend") +
             ": not supported: accel-launch does not wrap models in torch.compile (call it in "
             "your program; 'no' is accepted)";
    }
  }
  if (given("--rdzv-backend")) {
    std::string v = value("--rdzv-backend");
    if (v != "c10d" && v != "static") {
      return "--rdzv-backend " + v +
             ": not supported: accel's nodes meet at accel's own coordinator; give "
             "--rdzv-endpoint HOST:PORT (or --main-process-ip) instead";
    }
    warnings.push_back("--rdzv-backend " + v +
                       " is ignored: accel's own coordinator is the rendezvous");
  }

  if (given("--standalone")) {
    const auto* nodes = find_flag(flags, "nodes");
    if (nodes != nullptr && nodes->value != "1" && nodes->value != "1:1") {
      return "--standalone runs on this machine alone; it does not go with " + nodes->flag + " " +
             nodes->value;
    }
    flags.push_back({"nodes", "1", "--standalone"});
  }
  if (given("--rdzv-endpoint")) {
    // HOST, HOST:PORT or [IPv6]:PORT; the port is the coordinator's (torchrun's default, 29400,
    // is accel's too).
    std::string ep = value("--rdzv-endpoint");
    std::string host = ep, port;
    if (!ep.empty() && ep.front() == '[') {
      auto close = ep.find(']');
      if (close == std::string::npos) return "--rdzv-endpoint " + ep + ": expected [IPv6]:PORT";
      host = ep.substr(1, close - 1);
      if (close + 1 < ep.size() && ep[close + 1] == ':') port = ep.substr(close + 2);
    } else if (auto colon = ep.rfind(':'); colon != std::string::npos && ep.find(':') == colon) {
      host = ep.substr(0, colon);
      port = ep.substr(colon + 1);
    }
    if (host.empty()) return "--rdzv-endpoint " + ep + ": expected HOST[:PORT]";
    flags.push_back({"main_process_ip", host, "--rdzv-endpoint"});
    if (!port.empty()) flags.push_back({"coordinator_port", port, "--rdzv-endpoint"});
  }
  std::optional<int> machines;
  if (given("--num-machines")) {
    machines = positive(value("--num-machines"));
    if (!machines) {
      return "--num-machines " + value("--num-machines") + ": expected an integer >= 1";
    }
    flags.push_back({"nodes", value("--num-machines"), "--num-machines"});
  }
  // HF's --num_processes counts every machine's processes; accel's -n is per machine. With
  // HF's --num_machines (not torchrun's --nproc-per-node), the count is HF's.
  if (machines && !typed(options, "--nproc-per-node")) {
    for (auto& f : flags) {
      if (f.key != "num_processes") continue;
      auto total = positive(f.value);
      if (!total) continue;  // auto, gpu, cpu: per machine already
      if (*total % *machines != 0) {
        return "--num-processes " + f.value + " is not a multiple of --num-machines " +
               std::to_string(*machines) +
               ": with --num-machines, --num-processes counts every machine's processes (as in "
               "HF Accelerate); give -n per machine with --nodes instead";
      }
      f.value = std::to_string(*total / *machines);
      f.flag = "--num-processes " + std::to_string(*total) + " / --num-machines " +
               std::to_string(*machines);
    }
  }

  int gpu_ids = 0;
  if (given("--gpu-ids")) {
    std::string ids = value("--gpu-ids");
    if (ids.empty() || ids.find_first_of(" \t") != std::string::npos) {
      return "--gpu-ids '" + ids + "': expected all, or a list such as 0,1";
    }
    if (ids != "all") {
      worker_env.emplace_back("CUDA_VISIBLE_DEVICES", ids);
      gpu_ids = static_cast<int>(std::count(ids.begin(), ids.end(), ',')) + 1;
    }
  }
  if (given("--multi-gpu")) {
    const auto* cpu = find_flag(flags, "use_cpu");
    if (cpu != nullptr && cpu->value == "true") return "--multi-gpu does not go with --cpu";
    if (find_flag(flags, "num_processes") == nullptr) {
      int gpus = gpu_ids > 0 ? gpu_ids : hardware::visible_gpus();
      if (gpus == 0) {
        return "--multi-gpu: no NVIDIA GPU is visible here (no driver in /proc/driver/nvidia, or "
               "CUDA_VISIBLE_DEVICES hides them); give -n N to run on CPUs";
      }
      flags.push_back({"num_processes", std::to_string(gpus), "--multi-gpu"});
    }
  }
  return {};
}

}  // namespace accel::launcher

// accel env: a Markdown report for bug reports.
#include "launcher/env_cmd.h"

#include <dlfcn.h>
#include <google/protobuf/stubs/common.h>
#include <grpc/grpc.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "accel_version.h"
#include "agent/common/hardware.h"
#include "agent/supervisor/worker_env.h"
#include "contract/malloc_tuning.h"
#include "contract/worker_contract.h"

namespace accel::launcher {
namespace {

namespace fs = std::filesystem;

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The value of `key` in a "key : value" or KEY=value listing.
std::string field(const std::string& text, const std::string& key, char sep) {
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind(key, 0) != 0) continue;
    auto at = line.find(sep);
    if (at == std::string::npos) continue;
    std::string v = line.substr(at + 1);
    v.erase(0, v.find_first_not_of(" \t\""));
    while (!v.empty() && (v.back() == '"' || v.back() == ' ')) v.pop_back();
    return v;
  }
  return {};
}

std::string gib(double kib) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f GiB", kib / (1024.0 * 1024.0));
  return buf;
}

// The CPU features that decide which kernels libtorch can use for fp32/bf16 training.
std::string cpu_features(const std::string& flags_line) {
  std::string out;
  std::istringstream words(" " + flags_line);
  std::vector<std::string> have;
  std::string w;
  while (words >> w) have.push_back(w);
  for (const char* f : {"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile",
                        "amx_bf16", "amx_int8"}) {
    bool on = std::find(have.begin(), have.end(), f) != have.end();
    out += std::string(out.empty() ? "" : ", ") + f + (on ? " yes" : " no");
  }
  return out;
}

// A library's version through dlopen: present on GPU machines, absent elsewhere; accel itself
// does not link them.
std::string nccl_version() {
  void* lib = ::dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return "not found (libnccl.so.2)";
  using Fn = int (*)(int*);
  auto fn = reinterpret_cast<Fn>(::dlsym(lib, "ncclGetVersion"));
  int v = 0;
  std::string out = "found, version unknown";
  if (fn != nullptr && fn(&v) == 0) {
    // NCCL >= 2.9 encodes X.Y.Z as X*10000 + Y*100 + Z (older: X*1000 + Y*100 + Z).
    int major = v >= 20900 ? v / 10000 : v / 1000;
    int minor = v >= 20900 ? (v / 100) % 100 : (v / 100) % 10;
    out = std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(v % 100) +
          " (libnccl.so.2)";
  }
  ::dlclose(lib);
  return out;
}

std::string cuda_versions() {
  void* lib = nullptr;
  std::string name;
  for (const char* candidate :
       {"libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"}) {
    lib = ::dlopen(candidate, RTLD_NOW | RTLD_LOCAL);
    if (lib != nullptr) {
      name = candidate;
      break;
    }
  }
  if (lib == nullptr) return "runtime not found (libcudart.so)";
  using Fn = int (*)(int*);
  auto runtime = reinterpret_cast<Fn>(::dlsym(lib, "cudaRuntimeGetVersion"));
  auto driver = reinterpret_cast<Fn>(::dlsym(lib, "cudaDriverGetVersion"));
  auto text = [](int v) {
    return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
  };
  int rv = 0, dv = 0;
  std::string out = "runtime ";
  out += runtime != nullptr && runtime(&rv) == 0 ? text(rv) : std::string("unknown");
  out += " (" + name + "), driver supports ";
  out +=
      driver != nullptr && driver(&dv) == 0 && dv > 0 ? text(dv) : std::string("none (no driver)");
  ::dlclose(lib);
  return out;
}

// accel-check --info, with a bound on its time: libtorch's build and its BLAS.
std::string torch_info(const fs::path& check) {
  std::error_code ec;
  if (!fs::exists(check, ec)) {
    return "## libtorch\n\n" + check.string() + " is missing: libtorch's build is unknown\n";
  }
  std::string cmd = "timeout 60 '" + check.string() + "' --info 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return "## libtorch\n\ncannot run " + check.string() + "\n";
  std::string out;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  int status = ::pclose(p);
  if (status != 0)
    out += "\n(accel-check --info ended with status " + std::to_string(status) + ")\n";
  return out;
}

bool secret_name(const std::string& name) {
  for (const char* word : {"TOKEN", "SECRET", "PASSWORD", "KEY", "CREDENTIAL"}) {
    if (name.find(word) != std::string::npos) return true;
  }
  return false;
}

bool reported_variable(const std::string& name) {
  for (const char* prefix : {"ACCEL_", "ACCELERATE_", "TORCHELASTIC_", "TORCH_", "NCCL_", "GLOO_",
                             "SLURM_", "OMP_", "MKL_", "OPENBLAS_", "CUDA_", "HF_", "MALLOC_"}) {
    if (name.rfind(prefix, 0) == 0) return true;
  }
  for (const char* exact :
       {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
        "MASTER_PORT", "LD_LIBRARY_PATH", "TMPDIR", "GLIBC_TUNABLES", "LD_PRELOAD"}) {
    if (name == exact) return true;
  }
  return false;
}

// What libaccel does with a worker's CPU tensors of 32 MiB and more (runtime/large_blocks.h), which
// glibc maps afresh when freed memory of its heap cannot hold them, whatever its thresholds.
// Nothing when ACCEL_KEEP_FREED_MEMORY is invalid: the malloc line says accel-launch refuses it.
std::string workers_large_tensors(const supervisor::EnvMap& env) {
  const std::string size = std::to_string(contract::kMallocMmapThreshold >> 20) + " MiB";
  const auto keep = env.find(contract::kKeepFreedMemory);
  const std::string* value = keep == env.end() ? nullptr : &keep->second;
  const auto keeps = supervisor::keeps_freed_memory(value);
  if (!keeps) return "";
  if (!*keeps) {
    return "each tensor of " + size + " or more mapped afresh and unmapped when freed (" +
           contract::kKeepFreedMemory + "=" + *value + ")";
  }
  return "libaccel's workers reuse the blocks of freed CPU tensors of " + size +
         " or more (a block kept for " + std::to_string(contract::kKeptBlockIdleSeconds) +
         " s without reuse goes back; " + contract::kKeepFreedMemory +
         "=0 maps each afresh); Python workers' are mapped afresh, as glibc does";
}

// What glibc's malloc does in a worker accel-launch starts from this environment (a standing
// agent's workers get the agent's environment instead).
std::string workers_malloc(const supervisor::EnvMap& env) {
  if (auto keep = env.find(contract::kKeepFreedMemory); keep != env.end()) {
    if (auto problem = supervisor::worker_value_problem(contract::kKeepFreedMemory, keep->second)) {
      return std::string("none: accel-launch refuses ") + contract::kKeepFreedMemory + "=\"" +
             keep->second + "\" for its workers: " + *problem;
    }
  }
  supervisor::EnvMap worker = env;
  supervisor::give_malloc_thresholds(worker);
  const auto before = env.find(contract::kGlibcTunables);
  const auto after = worker.find(contract::kGlibcTunables);
  if (after != worker.end() && (before == env.end() || before->second != after->second)) {
    return std::string("accel-launch adds ") + contract::kMallocTunables + " to " +
           contract::kGlibcTunables + " (libaccel's thresholds: allocations below " +
           std::to_string(contract::kMallocMmapThreshold >> 20) + " MiB from the heap, up to " +
           std::to_string(contract::kMallocTrimThreshold >> 30) + " GiB free at its top kept; " +
           contract::kKeepFreedMemory + "=0 leaves glibc's own)";
  }
  auto lookup = [&env](const char* name) -> const std::string* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : &it->second;
  };
  const std::string users = contract::malloc_setting_in(lookup);
  if (!users.empty()) {
    if (before != env.end() && users == contract::kGlibcTunables &&
        contract::is_accels_malloc_setting(before->second))
      return "libaccel's thresholds, already in this environment's " + users;
    return "this environment's " + users + ", left as it is";
  }
  return std::string("glibc's own moving thresholds (") + contract::kKeepFreedMemory + "=" +
         env.at(contract::kKeepFreedMemory) + ")";
}

}  // namespace

int print_env(const config::ConfigSources& sources) {
  std::ostream& out = std::cout;
  out << "## accel\n\n";
  out << "- version: " << ACCEL_VERSION << " (commit " << ACCEL_GIT_COMMIT << ")\n";
  std::error_code ec;
  fs::path self = fs::read_symlink("/proc/self/exe", ec);
  out << "- installed at: " << (ec ? std::string("unknown") : self.parent_path().string()) << "\n";
  out << "- gRPC " << grpc_version_string() << ", protobuf "
      << google::protobuf::internal::VersionString(GOOGLE_PROTOBUF_VERSION) << "\n\n";

  out << "## system\n\n";
  std::string os = field(read_file("/etc/os-release"), "PRETTY_NAME", '=');
  struct utsname u {};
  ::uname(&u);
  out << "- OS: " << (os.empty() ? std::string("unknown") : os) << ", " << u.sysname << " "
      << u.release << " " << u.machine << "\n";
  std::string cpuinfo = read_file("/proc/cpuinfo");
  out << "- CPU: " << field(cpuinfo, "model name", ':') << "\n";
  out << "- CPU features: " << cpu_features(field(cpuinfo, "flags", ':')) << "\n";
  out << "- cores: " << hardware::usable_cpus() << " usable (" << ::sysconf(_SC_NPROCESSORS_ONLN)
      << " online)\n";
  std::string meminfo = read_file("/proc/meminfo");
  auto kib = [&](const char* key) { return std::atof(field(meminfo, key, ':').c_str()); };
  out << "- memory: " << gib(kib("MemTotal")) << " total, " << gib(kib("MemAvailable"))
      << " available\n";
  std::string cgroup_max = read_file("/sys/fs/cgroup/memory.max");
  if (!cgroup_max.empty() && cgroup_max.rfind("max", 0) != 0) {
    out << "- cgroup memory limit: " << gib(std::atof(cgroup_max.c_str()) / 1024.0) << "\n";
  }
  auto gpus = hardware::gpu_descriptions();
  out << "- GPUs: " << (gpus.empty() ? std::string("none (no NVIDIA driver)") : "") << "\n";
  for (const auto& g : gpus) out << "  - " << g << "\n";
  std::string driver = read_file("/proc/driver/nvidia/version");
  if (!driver.empty()) out << "- NVIDIA driver: " << driver.substr(0, driver.find('\n')) << "\n";
  out << "- CUDA: " << cuda_versions() << "\n";
  out << "- NCCL: " << nccl_version() << "\n\n";

  out << torch_info(self.parent_path() / "accel-check") << "\n";

  out << "## configuration\n\n";
  auto resolved = config::resolve_config(sources);
  if (!resolved) {
    out << "error: " << resolved.message() << "\n\n";
  } else {
    out << "```\n" << config::render_config(*resolved) << "```\n\n";
  }

  out << "## environment\n\n```\n";
  int shown = 0;
  for (const auto& [name, value] : sources.env) {
    if (!reported_variable(name)) continue;
    out << name << "=" << (secret_name(name) ? "(set, hidden)" : value) << "\n";
    ++shown;
  }
  if (shown == 0)
    out << "(none of ACCEL_*, torchrun's, NCCL_*, CUDA_*, SLURM_*, OMP_*, MALLOC_* is set)\n";
  out << "```\n\n";
  out << "- workers' malloc: " << workers_malloc(sources.env) << "\n";
  if (auto large = workers_large_tensors(sources.env); !large.empty())
    out << "- workers' large CPU tensors: " << large << "\n";
  return 0;
}

}  // namespace accel::launcher

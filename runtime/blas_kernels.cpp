// OpenBLAS's kernel set: which one runs, and switching it (see blas_kernels.h).
#include "runtime/blas_kernels.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>

namespace accel::blas_kernels {

namespace {

bool has(const std::vector<std::string>& flags, const char* flag) {
  return std::find(flags.begin(), flags.end(), flag) != flags.end();
}

// OpenBLAS's own entry points, found in this process without linking it: libtorch loads it
// through libblas.so.3 where Debian's alternatives point that at OpenBLAS. gotoblas_dynamic_quit
// and gotoblas_dynamic_init are what OpenBLAS runs at unload and load: init picks the kernels
// (OPENBLAS_CORETYPE first, else the CPU's model) unless some are picked, quit forgets them.
// Only DYNAMIC_ARCH builds have them.
struct Entry {
  const char* (*corename)() = nullptr;
  void (*quit)() = nullptr;
  void (*init)() = nullptr;
  Entry() {
    corename = reinterpret_cast<const char* (*)()>(::dlsym(RTLD_DEFAULT, "openblas_get_corename"));
    quit = reinterpret_cast<void (*)()>(::dlsym(RTLD_DEFAULT, "gotoblas_dynamic_quit"));
    init = reinterpret_cast<void (*)()>(::dlsym(RTLD_DEFAULT, "gotoblas_dynamic_init"));
  }
  [[nodiscard]] bool can_switch() const {
    return corename != nullptr && quit != nullptr && init != nullptr;
  }
};

const Entry& entry() {
  static const Entry e;
  return e;
}

}  // namespace

int tier_of_core(const std::string& core) {
  for (const char* name : {"SkylakeX", "Cooperlake", "SapphireRapids"}) {
    if (core == name) return 3;
  }
  for (const char* name : {"Haswell", "Zen", "Excavator"}) {
    if (core == name) return 2;
  }
  for (const char* name : {"Sandybridge", "Bulldozer", "Piledriver", "Steamroller"}) {
    if (core == name) return 1;
  }
  return 0;
}

std::string best_core_for(const std::vector<std::string>& cpu_flags) {
  const bool avx512 = has(cpu_flags, "avx512f") && has(cpu_flags, "avx512cd") &&
                      has(cpu_flags, "avx512bw") && has(cpu_flags, "avx512dq") &&
                      has(cpu_flags, "avx512vl");
  if (avx512) return has(cpu_flags, "avx512_bf16") ? "Cooperlake" : "SkylakeX";
  if (has(cpu_flags, "avx2") && has(cpu_flags, "fma")) return "Haswell";
  return {};
}

std::vector<std::string> cpu_flags() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("flags", 0) != 0) continue;
    auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::istringstream words(line.substr(colon + 1));
    std::vector<std::string> flags;
    for (std::string w; words >> w;) flags.push_back(w);
    return flags;
  }
  return {};
}

std::string current_core() {
  if (entry().corename == nullptr) return {};
  const char* name = entry().corename();
  std::string core = name != nullptr ? name : "";
  while (!core.empty() && core.back() == ' ') core.pop_back();  // OpenBLAS pads some names
  return core;
}

bool can_switch_kernels() { return entry().can_switch(); }

bool set_kernels(const std::string& core) {
  if (!entry().can_switch() || core.empty()) return false;
  ::setenv("OPENBLAS_CORETYPE", core.c_str(), 1);
  entry().quit();
  entry().init();
  return current_core() == core;
}

Outcome switch_to(const std::string& core) {
  Outcome out;
  out.from = current_core();
  if (!entry().can_switch() || out.from.empty() || core.empty() || core == out.from) return out;
  const char* before = std::getenv("OPENBLAS_CORETYPE");
  const std::optional<std::string> old_env =
      before != nullptr ? std::optional<std::string>(before) : std::nullopt;
  out.tried = core;
  if (set_kernels(core)) {
    out.to = core;
    return out;
  }
  // OpenBLAS did not take them (a build without them): the kernels and the variable as they were.
  set_kernels(out.from);
  if (old_env) {
    ::setenv("OPENBLAS_CORETYPE", old_env->c_str(), 1);
  } else {
    ::unsetenv("OPENBLAS_CORETYPE");
  }
  return out;
}

std::string upgrade_target(const char* user_choice, const std::string& now,
                           const std::vector<std::string>& cpu_flags) {
  if (user_choice != nullptr || now.empty()) return {};
  std::string best = best_core_for(cpu_flags);
  if (best.empty() || tier_of_core(best) <= tier_of_core(now)) return {};
  return best;
}

const Outcome& upgrade_if_behind() {
  static Outcome outcome;
  static std::once_flag once;
  std::call_once(once, [] {
    const std::string target =
        upgrade_target(std::getenv("OPENBLAS_CORETYPE"), current_core(), cpu_flags());
    if (!target.empty()) outcome = switch_to(target);
  });
  return outcome;
}

std::string describe(const Outcome& outcome, const std::string& cpu) {
  if (outcome.tried.empty()) return {};
  const std::string on = "this CPU" + (cpu.empty() ? "" : " (" + cpu + ")");
  if (outcome.switched()) {
    return "OpenBLAS ran its " + outcome.from + " kernels on " + on +
           ", made for older CPUs; libaccel switched it to " + outcome.to +
           ", the newest this CPU's flags allow. OPENBLAS_CORETYPE=" + outcome.from +
           " keeps the old ones";
  }
  return "OpenBLAS runs its " + outcome.from + " kernels on " + on + ", made for older CPUs; " +
         "this OpenBLAS has no " + outcome.tried + " kernels to switch to";
}

}  // namespace accel::blas_kernels

// CPU affinity and the NVIDIA driver's /proc entries: no CUDA runtime is loaded, so the
// launcher stays fast and works on machines without one.
#include "agent/common/hardware.h"

#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>

namespace accel::hardware {
namespace {

namespace fs = std::filesystem;

constexpr const char* kDriverGpus = "/proc/driver/nvidia/gpus";

std::vector<fs::path> driver_gpu_dirs() {
  std::vector<fs::path> out;
  std::error_code ec;
  for (fs::directory_iterator it(kDriverGpus, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->is_directory(ec)) out.push_back(it->path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return 1;
}

int visible_gpus() {
  int installed = static_cast<int>(driver_gpu_dirs().size());
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  if (visible == nullptr) return installed;
  // CUDA's rule: the list ends at the first entry that is not a valid device.
  std::string list(visible);
  int count = 0;
  size_t start = 0;
  while (start <= list.size() && !list.empty()) {
    size_t comma = list.find(',', start);
    std::string item =
        list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (item.empty() || item == "-1") break;
    bool numeric =
        std::all_of(item.begin(), item.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (numeric && std::atoi(item.c_str()) >= installed) break;
    ++count;
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return std::min(count, installed);
}

std::vector<std::string> gpu_descriptions() {
  std::vector<std::string> out;
  for (const auto& dir : driver_gpu_dirs()) {
    std::ifstream info(dir / "information");
    std::string line, model;
    while (std::getline(info, line)) {
      if (line.rfind("Model:", 0) == 0) {
        model = line.substr(6);
        model.erase(0, model.find_first_not_of(" \t"));
      }
    }
    out.push_back((model.empty() ? std::string("NVIDIA GPU") : model) + " (" +
                  dir.filename().string() + ")");
  }
  return out;
}

}  // namespace accel::hardware

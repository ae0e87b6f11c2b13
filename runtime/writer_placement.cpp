// Finding the CPUs a disk's interrupts land on, and placing a writer thread there.
#include "runtime/writer_placement.h"

#include <sched.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <system_error>

namespace accel::writer_placement {

namespace fs = std::filesystem;

namespace {

std::string first_line(const fs::path& p) {
  std::ifstream in(p);
  std::string line;
  std::getline(in, line);
  return line;
}

std::size_t entries_in(const fs::path& dir) {
  std::error_code ec;
  std::size_t n = 0;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) ++n;
  return n;
}

// Each interrupt's count so far, summed over the CPUs, from /proc/interrupts.
std::map<int, std::uint64_t> interrupt_counts(const fs::path& proc) {
  std::map<int, std::uint64_t> counts;
  std::ifstream in(proc / "interrupts");
  std::string line;
  std::getline(in, line);  // the header: CPU0 CPU1 ...
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string label;
    fields >> label;
    if (label.empty() || label.back() != ':') continue;
    int irq = 0;
    try {
      std::size_t used = 0;
      irq = std::stoi(label, &used);
      if (used + 1 != label.size()) continue;  // "NMI:", "LOC:"
    } catch (const std::exception&) {
      continue;
    }
    std::uint64_t total = 0;
    for (std::string word; fields >> word;) {
      if (word.find_first_not_of("0123456789") != std::string::npos) break;  // the chip's name
      total += std::stoull(word);
    }
    counts[irq] = total;
  }
  return counts;
}

// The CPUs interrupt `irq` is delivered to: effective_affinity_list where the kernel has it,
// else the affinity asked for.
std::vector<int> irq_cpus(const fs::path& proc, int irq) {
  auto dir = proc / "irq" / std::to_string(irq);
  auto cpus = parse_cpu_list(first_line(dir / "effective_affinity_list"));
  return cpus.empty() ? parse_cpu_list(first_line(dir / "smp_affinity_list")) : cpus;
}

}  // namespace

std::vector<int> parse_cpu_list(const std::string& text) {
  std::vector<int> cpus;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, ',');) {
    part.erase(0, part.find_first_not_of(" \t\n"));
    part.erase(part.find_last_not_of(" \t\n") + 1);
    if (part.empty() || part.find_first_not_of("0123456789-") != std::string::npos) return {};
    auto dash = part.find('-');
    try {
      int lo = std::stoi(part.substr(0, dash));
      int hi = dash == std::string::npos ? lo : std::stoi(part.substr(dash + 1));
      if (lo < 0 || hi < lo || hi >= CPU_SETSIZE) return {};
      for (int c = lo; c <= hi; ++c) cpus.push_back(c);
    } catch (const std::exception&) {
      return {};
    }
  }
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  return cpus;
}

std::string format_cpu_list(const std::vector<int>& cpus) {
  std::string out;
  for (std::size_t i = 0; i < cpus.size();) {
    std::size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(cpus[i]);
    if (j > i) out += '-' + std::to_string(cpus[j]);
    i = j + 1;
  }
  return out;
}

Placement for_directory(const fs::path& dir, const fs::path& sys, const fs::path& proc) {
  std::error_code ec;
  fs::path at = dir;
  while (!fs::exists(at, ec) && at.has_parent_path() && at.parent_path() != at)
    at = at.parent_path();
  struct stat st {};
  if (::stat(at.c_str(), &st) != 0) return {{}, "cannot stat " + at.string()};
  if (::major(st.st_dev) == 0) return {{}, at.string() + " is not on a block device"};
  return for_block_device(
      std::to_string(::major(st.st_dev)) + ":" + std::to_string(::minor(st.st_dev)), sys, proc);
}

Placement for_block_device(const std::string& dev_id, const fs::path& sys, const fs::path& proc) {
  std::error_code ec;
  fs::path block = fs::canonical(sys / "dev" / "block" / dev_id, ec);
  if (ec) return {{}, "no block device " + dev_id + " in " + sys.string()};
  if (fs::exists(block / "partition", ec)) block = block.parent_path();
  const std::string disk = "/dev/" + block.filename().string();
  if (entries_in(block / "slaves") > 0)
    return {{}, disk + " is built from other devices (device mapper, RAID)"};
  if (auto queues = entries_in(block / "mq"); queues > 1)
    return {{},
            disk + " has " + std::to_string(queues) +
                " queues: its writes complete on the CPUs that issue them"};
  const fs::path devices = fs::canonical(sys / "devices", ec);
  fs::path device = fs::canonical(block / "device", ec);
  if (ec) return {{}, disk + " has no device in " + sys.string()};
  while (!fs::exists(device / "msi_irqs", ec)) {
    if (device == devices || !device.has_parent_path() || device.parent_path() == device)
      return {{}, disk + "'s controller has no MSI interrupts to follow"};
    device = device.parent_path();
  }
  std::vector<int> irqs;
  for (fs::directory_iterator it(device / "msi_irqs", ec), end; !ec && it != end;
       it.increment(ec)) {
    try {
      irqs.push_back(std::stoi(it->path().filename().string()));
    } catch (const std::exception&) {
    }
  }
  if (irqs.empty()) return {{}, disk + "'s controller has no MSI interrupts to follow"};
  std::sort(irqs.begin(), irqs.end());
  // Why the busiest: a disk's controller has a configuration interrupt beside its queue's,
  // raised a few times in its life; the queue's is raised for every write.
  auto counts = interrupt_counts(proc);
  int busiest = irqs.front();
  for (int irq : irqs)
    if (counts[irq] > counts[busiest]) busiest = irq;
  if (counts[busiest] == 0) return {{}, disk + " has raised no interrupts yet"};
  auto cpus = irq_cpus(proc, busiest);
  if (cpus.empty())
    return {{}, "no affinity for " + disk + "'s interrupt " + std::to_string(busiest)};
  return {cpus, disk + "'s interrupts (IRQ " + std::to_string(busiest) + ") land on CPU " +
                    format_cpu_list(cpus)};
}

Placement chosen(const char* setting, const fs::path& dir) {
  std::string value = setting == nullptr ? "" : setting;
  if (value.empty() || value == "auto") return for_directory(dir);
  if (value == "any") return {{}, "ACCEL_CHECKPOINT_WRITER_CPUS=any"};
  auto cpus = parse_cpu_list(value);
  if (cpus.empty())
    throw std::invalid_argument("ACCEL_CHECKPOINT_WRITER_CPUS='" + value +
                                "' is not auto, any or a list of CPUs such as 1 or 2-3,6");
  return {cpus, "ACCEL_CHECKPOINT_WRITER_CPUS=" + value};
}

std::vector<int> allowed_cpus() {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  std::vector<int> cpus;
  if (::sched_getaffinity(0, sizeof allowed, &allowed) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  return cpus;
}

namespace {
const char kLeft[] = "background checkpoint writer left where the scheduler puts it: ";
}  // namespace

std::string place_calling_writer(const char* setting, const fs::path& dir, int training_threads) {
  const bool automatic = setting == nullptr || *setting == '\0' || std::string(setting) == "auto";
  try {
    return place_calling_writer(chosen(setting, dir), automatic, training_threads);
  } catch (const std::exception& e) {
    return kLeft + std::string(e.what());
  }
}

std::string place_calling_writer(const Placement& placement, bool automatic, int training_threads) {
  const std::string left = kLeft;
  if (placement.cpus.empty()) return left + placement.why;
  const auto allowed = allowed_cpus();
  if (automatic && training_threads >= static_cast<int>(allowed.size())) {
    return left + placement.why + ", but training keeps every CPU this process may use busy (" +
           std::to_string(training_threads) + " threads, CPU " + format_cpu_list(allowed) + ")";
  }
  if (!run_calling_thread_on(placement.cpus)) {
    return left + placement.why + ", and this process may run on CPU " + format_cpu_list(allowed);
  }
  return "background checkpoint writer runs on CPU " + format_cpu_list(placement.cpus) + ": " +
         placement.why;
}

bool run_calling_thread_on(const std::vector<int>& cpus) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (::sched_getaffinity(0, sizeof allowed, &allowed) != 0) return false;
  cpu_set_t wanted;
  CPU_ZERO(&wanted);
  for (int c : cpus)
    if (c >= 0 && c < CPU_SETSIZE && CPU_ISSET(c, &allowed)) CPU_SET(c, &wanted);
  if (CPU_COUNT(&wanted) == 0 || CPU_EQUAL(&wanted, &allowed)) return false;
  return ::sched_setaffinity(0, sizeof wanted, &wanted) == 0;
}

}  // namespace accel::writer_placement

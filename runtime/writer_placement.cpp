// Finding the CPUs a disk's interrupts land on, and placing a writer thread there.
#include "runtime/writer_placement.h"

#include <sched.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <system_error>

namespace accel::writer_placement {

namespace fs = std::filesystem;

namespace {

const char kLeft[] = "background checkpoint writer left where the scheduler puts it: ";

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

// Each numbered interrupt's count so far, summed over the CPUs, from /proc/interrupts; nullopt
// when it cannot be read (a sandbox's /proc).
std::optional<std::map<int, std::uint64_t>> interrupt_counts(const fs::path& proc) {
  std::ifstream in(proc / "interrupts");
  std::string line;
  if (!std::getline(in, line) || line.find("CPU") == std::string::npos) return std::nullopt;
  std::map<int, std::uint64_t> counts;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string label;
    fields >> label;
    if (label.size() < 2 || label.back() != ':' ||
        label.find_first_not_of("0123456789") != label.size() - 1)
      continue;  // "NMI:", "LOC:"
    std::uint64_t total = 0;
    for (std::string word; fields >> word;) {
      if (word.find_first_not_of("0123456789") != std::string::npos) break;  // the chip's name
      total += std::stoull(word);
    }
    counts[std::stoi(label)] = total;
  }
  return counts;
}

// Whether `dir` in sysfs is a PCI function (its subsystem is the pci bus).
bool is_pci_function(const fs::path& dir) {
  std::error_code ec;
  auto subsystem = fs::read_symlink(dir / "subsystem", ec);
  return !ec && subsystem.filename() == "pci";
}

std::string threads_text(int n) { return std::to_string(n) + (n == 1 ? " thread" : " threads"); }

}  // namespace

std::vector<int> parse_cpu_list(const std::string& text) {
  std::vector<int> cpus;
  std::string trimmed = text;
  trimmed.erase(0, trimmed.find_first_not_of(" \t\n"));
  trimmed.erase(trimmed.find_last_not_of(" \t\n") + 1);
  if (trimmed.empty() || trimmed.back() == ',') return {};
  std::stringstream in(trimmed);
  for (std::string part; std::getline(in, part, ',');) {
    if (part.empty() || part.find_first_not_of("0123456789-") != std::string::npos) return {};
    const auto dash = part.find('-');
    if (dash != std::string::npos && part.find('-', dash + 1) != std::string::npos) return {};
    const std::string lo_text = part.substr(0, dash);
    const std::string hi_text = dash == std::string::npos ? lo_text : part.substr(dash + 1);
    if (lo_text.empty() || hi_text.empty() || lo_text.size() > 5 || hi_text.size() > 5) return {};
    const int lo = std::stoi(lo_text), hi = std::stoi(hi_text);
    if (hi < lo || hi >= CPU_SETSIZE) return {};
    for (int c = lo; c <= hi; ++c) cpus.push_back(c);
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

bool valid_setting(const std::string& value) {
  return value == "auto" || value == "any" || !parse_cpu_list(value).empty();
}

Placement for_directory(const fs::path& dir, const fs::path& sys, const fs::path& proc) {
  std::error_code ec;
  fs::path at = fs::absolute(dir, ec);
  if (ec) at = dir;
  while (!fs::exists(at, ec) && at.has_parent_path() && at.parent_path() != at)
    at = at.parent_path();
  struct stat st {};
  if (::stat(at.c_str(), &st) != 0) return {{}, "cannot stat " + at.string()};
  if (::major(st.st_dev) == 0) {
    return {{},
            at.string() +
                " is on a file system without a single block device under it (tmpfs, overlay, "
                "NFS, btrfs, ZFS)"};
  }
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
  // Why stop at the first PCI function: above it are bridges and root ports, whose own
  // interrupts (hotplug, errors) say nothing about the disk's.
  while (!fs::exists(device / "msi_irqs", ec)) {
    if (is_pci_function(device) || device == devices || !device.has_parent_path() ||
        device.parent_path() == device)
      return {{}, disk + "'s controller has no MSI interrupts to follow"};
    device = device.parent_path();
  }
  std::vector<int> irqs;
  for (fs::directory_iterator it(device / "msi_irqs", ec), end; !ec && it != end;
       it.increment(ec)) {
    const auto name = it->path().filename().string();
    if (!name.empty() && name.size() < 9 &&
        name.find_first_not_of("0123456789") == std::string::npos)
      irqs.push_back(std::stoi(name));
  }
  if (irqs.empty()) return {{}, disk + "'s controller has no MSI interrupts to follow"};
  auto counts = interrupt_counts(proc);
  if (!counts) return {{}, "cannot read " + (proc / "interrupts").string()};
  // Why the busiest, and only a clear one: a virtio disk has a configuration interrupt, raised
  // a few times in its life, beside its queue's, raised for every write. A controller with a
  // vector per port or per CPU has several busy ones, and no one CPU to follow.
  std::sort(irqs.begin(), irqs.end(), [&](int a, int b) {
    return (*counts)[a] > (*counts)[b] || ((*counts)[a] == (*counts)[b] && a < b);
  });
  const int busiest = irqs.front();
  const std::uint64_t most = (*counts)[busiest];
  if (most == 0) return {{}, disk + " has raised no interrupts yet"};
  if (irqs.size() > 1 && (*counts)[irqs[1]] * 10 > most) {
    return {{},
            disk + "'s controller spreads its interrupts over several busy vectors (IRQ " +
                std::to_string(busiest) + ", " + std::to_string(irqs[1]) +
                "): no one CPU to follow"};
  }
  auto cpus = parse_cpu_list(
      first_line(proc / "irq" / std::to_string(busiest) / "effective_affinity_list"));
  if (cpus.empty())
    return {{}, "no effective affinity for " + disk + "'s interrupt " + std::to_string(busiest)};
  return {cpus, disk + "'s interrupts (IRQ " + std::to_string(busiest) + ") land on CPU " +
                    format_cpu_list(cpus)};
}

Placement chosen(const char* setting, const fs::path& dir) {
  std::string value = setting == nullptr ? "" : setting;
  if (value.empty() || value == "auto") return for_directory(dir);
  if (value == "any") return {{}, "ACCEL_CHECKPOINT_WRITER_CPUS=any"};
  if (!valid_setting(value))
    throw std::invalid_argument("ACCEL_CHECKPOINT_WRITER_CPUS='" + value + "' is not " +
                                kSettingExpected);
  return {parse_cpu_list(value), "ACCEL_CHECKPOINT_WRITER_CPUS=" + value};
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

std::vector<int> run_calling_thread_on(const std::vector<int>& cpus) {
  const auto allowed = allowed_cpus();
  std::vector<int> wanted;
  for (int c : cpus)
    if (std::binary_search(allowed.begin(), allowed.end(), c)) wanted.push_back(c);
  std::sort(wanted.begin(), wanted.end());
  wanted.erase(std::unique(wanted.begin(), wanted.end()), wanted.end());
  if (wanted.empty() || wanted == allowed) return {};
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : wanted) CPU_SET(c, &set);
  if (::sched_setaffinity(0, sizeof set, &set) != 0) return {};
  return wanted;
}

Said place_calling_writer(const char* setting, const fs::path& dir, int training_threads) {
  const bool automatic = setting == nullptr || *setting == '\0' || std::string(setting) == "auto";
  try {
    return place_calling_writer(chosen(setting, dir), automatic, training_threads);
  } catch (const std::exception& e) {
    return {kLeft + std::string(e.what()), !automatic};
  }
}

Said place_calling_writer(const Placement& placement, bool automatic, int training_threads) {
  const std::string left = kLeft;
  if (placement.cpus.empty()) return {left + placement.why};
  const auto allowed = allowed_cpus();
  const std::string may = "CPU " + format_cpu_list(allowed);
  if (allowed.empty()) return {left + placement.why + ", but this thread's CPUs cannot be read"};
  if (automatic && training_threads >= static_cast<int>(allowed.size())) {
    return {left + placement.why + ", but training keeps every CPU this process may use busy (" +
            threads_text(training_threads) + ", " + may + ")"};
  }
  const auto moved = run_calling_thread_on(placement.cpus);
  if (moved.empty()) {
    const bool everywhere =
        std::includes(placement.cpus.begin(), placement.cpus.end(), allowed.begin(), allowed.end());
    if (everywhere)
      return {left + placement.why + ", every CPU this process may run on (" + may + ")"};
    return {left + placement.why + ", none of which this process may run on (" + may + ")",
            !automatic};
  }
  std::string line =
      "background checkpoint writer runs on CPU " + format_cpu_list(moved) + ": " + placement.why;
  if (moved == placement.cpus) return {line};
  return {line + " (those of them this process may run on, " + may + ")", !automatic};
}

}  // namespace accel::writer_placement

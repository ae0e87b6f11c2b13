// Where a background checkpoint's writer thread runs: on the CPUs that take the interrupts of
// the disk it writes to. A disk whose controller raises its completions through one interrupt
// (a virtio disk of a VM, most often) wakes a writer elsewhere from that interrupt's CPU, and the
// interrupt and the block layer's completion work take their time from whatever runs there,
// often the training thread. With the writer placed on that CPU, the disk's work stays where the
// writer is and the other CPUs train undisturbed. A disk with a queue per CPU (NVMe, most
// multi-queue devices) completes each write on the CPU that issued it: there is nothing to place.
// No libtorch here: sysfs and procfs only.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace accel::writer_placement {

// The CPUs to run a writer on, and what was found: "/dev/vda's interrupts (IRQ 36) land on CPU
// 1", or why there is no placement ("... has 4 queues: ...").
struct Placement {
  std::vector<int> cpus;  // empty: leave the writer where the scheduler puts it
  std::string why;
};

// "0-2,5" -> {0,1,2,5}; empty for text that is not a CPU list ("1-2-3", "1,", "a").
std::vector<int> parse_cpu_list(const std::string& text);
std::string format_cpu_list(const std::vector<int>& cpus);

// Whether ACCEL_CHECKPOINT_WRITER_CPUS may have this value: auto, any or a CPU list.
bool valid_setting(const std::string& value);
inline constexpr char kSettingExpected[] = "auto, any or a list of CPUs such as 1 or 2-3,6";

// The placement for a writer of files under `dir` (or its nearest existing ancestor), read
// from `sys` (/sys) and `proc` (/proc): the block device holding it, its hardware queues, the
// PCI function that drives it and, of that function's MSI interrupts, the one raised most often
// so far (the data queue's), with the CPUs that interrupt is delivered to. Nothing when several
// of its interrupts are busy (a controller with a vector per port or per CPU).
Placement for_directory(const std::filesystem::path& dir, const std::filesystem::path& sys = "/sys",
                        const std::filesystem::path& proc = "/proc");

// The same for block device `dev_id` ("254:0", major and minor, as in /sys/dev/block).
Placement for_block_device(const std::string& dev_id, const std::filesystem::path& sys = "/sys",
                           const std::filesystem::path& proc = "/proc");

// What ACCEL_CHECKPOINT_WRITER_CPUS asks for: unset or "auto" -> for_directory(dir); "any" ->
// no placement; a CPU list ("1", "2-3") -> those CPUs. Throws std::invalid_argument, naming the
// variable, for anything else.
Placement chosen(const char* setting, const std::filesystem::path& dir);

// The CPUs the calling thread may run on (its affinity mask: taskset, a cgroup's cpuset).
std::vector<int> allowed_cpus();

// Moves the calling thread onto those of `cpus` it may run on; does nothing when that is all of
// them or none. The CPUs it now runs on, or empty when it did not move. Threads it starts later
// inherit the set.
std::vector<int> run_calling_thread_on(const std::vector<int>& cpus);

// What a background save's writer did, in the words of the debug line that says so; `warning`
// when an explicit ACCEL_CHECKPOINT_WRITER_CPUS could not be followed, or only in part.
struct Said {
  std::string line;
  bool warning = false;
};

// Places the calling thread, a background save's writer. `setting`: the value of
// ACCEL_CHECKPOINT_WRITER_CPUS; `dir`: the checkpoint's folder; `training_threads`: how many
// threads this machine's training keeps busy (local ranks x the threads each runs its products
// on: ATen's intra-op threads or OpenBLAS's own, whichever are more). With "auto", the
// writer moves only where training leaves a CPU to spare (fewer training threads than CPUs this
// process may run on): where training needs every CPU, the writer on the interrupts' CPU would
// slow the rank that trains there, and every rank waits for the slowest.
Said place_calling_writer(const char* setting, const std::filesystem::path& dir,
                          int training_threads);
// The same for a placement already found; `automatic`: found for "auto" (not a list given).
Said place_calling_writer(const Placement& placement, bool automatic, int training_threads);

}  // namespace accel::writer_placement

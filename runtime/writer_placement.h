// Where a background checkpoint's writer thread runs: on the CPUs that take the interrupts of
// the disk it writes to. A disk with one queue (a virtio disk, a SATA or SAS controller) raises
// its completions on one CPU; a writer elsewhere is woken from there, and the interrupts and
// the block layer's completion work take their time from whatever runs on that CPU, often the
// training thread. With the writer placed on that CPU, the disk's work stays where the writer
// is and the other CPUs train undisturbed. A disk with a queue per CPU (NVMe, most multi-queue
// devices) completes each write on the CPU that issued it: there is nothing to place.
// No libtorch here: sysfs and procfs only.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace accel::writer_placement {

// The CPUs to run a writer on, and what was found: "/dev/vda's interrupts land on CPU 1", or
// why there is no placement ("not on a block device", "a queue per CPU").
struct Placement {
  std::vector<int> cpus;  // empty: leave the writer where the scheduler puts it
  std::string why;
};

// "0-2,5" -> {0,1,2,5}; empty for text that is not a CPU list.
std::vector<int> parse_cpu_list(const std::string& text);
std::string format_cpu_list(const std::vector<int>& cpus);

// The placement for a writer of files under `dir` (or its nearest existing ancestor), read
// from `sys` (/sys) and `proc` (/proc): the block device holding it, its hardware queues, the
// PCI device above it and, of that device's MSI interrupts, the one raised most often so far
// (the data queue's), with the CPUs that interrupt is delivered to.
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

// Moves the calling thread onto `cpus`, kept to those this thread may run on; does nothing when
// that leaves all of them or none. Whether it moved. Threads it starts later inherit the set.
bool run_calling_thread_on(const std::vector<int>& cpus);

// What a background save's writer does, and the debug line that says so. `setting`: the value
// of ACCEL_CHECKPOINT_WRITER_CPUS; `dir`: the checkpoint's folder; `training_threads`: how many
// threads this machine's training keeps busy (local ranks x intra-op threads). With "auto", the
// writer moves only where training leaves a CPU to spare (fewer training threads than CPUs this
// process may run on): where training needs every CPU, the ranks' writers all on the
// interrupts' CPU would slow the one rank that trains there, and every rank waits for it.
// Moves the calling thread when it says so.
std::string place_calling_writer(const char* setting, const std::filesystem::path& dir,
                                 int training_threads);
// The same for a placement already found; `automatic`: found for "auto" (not a list given).
std::string place_calling_writer(const Placement& placement, bool automatic, int training_threads);

}  // namespace accel::writer_placement

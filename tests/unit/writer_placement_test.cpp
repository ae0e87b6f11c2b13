// Where a background checkpoint's writer runs: the CPUs of a disk's interrupts, read from a
// sysfs and procfs laid out as Linux lays them out for a virtio disk, and the thread placement.
#include "runtime/writer_placement.h"

#include <gtest/gtest.h>
#include <sched.h>

#include <filesystem>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tests/common/files.h"

namespace accel {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;
using testing::write_file;
using writer_placement::Placement;

// /sys and /proc of a VM whose disk vda (254:0, partition vda1 at 254:1) hangs off the virtio
// device of PCI function 0000:00:02.0, whose MSI interrupts are 35 (configuration, raised once)
// and 36 (the request queue), delivered to CPU 1.
class FakeMachine {
 public:
  FakeMachine() {
    auto pci = sys() / "devices/pci0000:00/0000:00:02.0";
    auto vda = pci / "virtio1/block/vda";
    fs::create_directories(vda / "mq/0");
    fs::create_directories(vda / "vda1");
    write_file(vda / "vda1/partition", "1\n");
    fs::create_directories(sys() / "bus/pci");
    fs::create_directory_symlink("../../../bus/pci", pci / "subsystem");
    fs::create_directories(pci / "msi_irqs");
    write_file(pci / "msi_irqs/35", "msix\n");
    write_file(pci / "msi_irqs/36", "msix\n");
    fs::create_directory_symlink("../../../virtio1", vda / "device");
    fs::create_directories(sys() / "dev/block");
    fs::create_directory_symlink("../../devices/pci0000:00/0000:00:02.0/virtio1/block/vda",
                                 sys() / "dev/block/254:0");
    fs::create_directory_symlink("../../devices/pci0000:00/0000:00:02.0/virtio1/block/vda/vda1",
                                 sys() / "dev/block/254:1");
    interrupts(1, 1894439);
    affinity(36, "1\n");
    affinity(35, "0\n");
  }
  fs::path sys() const { return dir_.path() / "sys"; }
  fs::path proc() const { return dir_.path() / "proc"; }
  fs::path vda() const { return sys() / "devices/pci0000:00/0000:00:02.0/virtio1/block/vda"; }
  void interrupts(unsigned long config, unsigned long queue) {
    fs::create_directories(proc());
    write_file(
        proc() / "interrupts",
        "           CPU0       CPU1       \n"
        " 35:          0          " +
            std::to_string(config) +
            "  PCI-MSIX-0000:00:02.0   0-edge      virtio1-config\n"
            " 36:          0    " +
            std::to_string(queue) +
            "  PCI-MSIX-0000:00:02.0   1-edge      virtio1-req.0\n"
            " 38:       4364          0  PCI-MSIX-0000:00:03.0   1-edge      virtio2-input.0\n"
            "NMI:          0          0   Non-maskable interrupts\n"
            "LOC:     812345     734521   Local timer interrupts\n");
  }
  void affinity(int irq, const std::string& cpus) {
    auto d = proc() / "irq" / std::to_string(irq);
    fs::create_directories(d);
    write_file(d / "effective_affinity_list", cpus);
  }
  Placement of(const std::string& dev_id) const {
    return writer_placement::for_block_device(dev_id, sys(), proc());
  }

 private:
  TempDir dir_;
};

TEST(WriterPlacement, CpuListsReadAndWriteAsTheKernelWritesThem) {
  EXPECT_EQ(writer_placement::parse_cpu_list("0-2,5"), (std::vector<int>{0, 1, 2, 5}));
  EXPECT_EQ(writer_placement::parse_cpu_list("1\n"), (std::vector<int>{1}));
  EXPECT_EQ(writer_placement::parse_cpu_list("6,2-3,2"), (std::vector<int>{2, 3, 6}));
  for (const char* bad : {"", "a", "3-1", "1,,2", "-1", "99999", "1-", "1-2-3", "1,", "0--2"})
    EXPECT_TRUE(writer_placement::parse_cpu_list(bad).empty()) << bad;
  EXPECT_EQ(writer_placement::format_cpu_list({0, 1, 2, 5, 7, 8}), "0-2,5,7-8");
  EXPECT_EQ(writer_placement::format_cpu_list({3}), "3");
}

TEST(WriterPlacement, AOneQueueDiskPlacesTheWriterWhereItsBusiestInterruptLands) {
  FakeMachine m;
  auto disk = m.of("254:0");
  EXPECT_EQ(disk.cpus, (std::vector<int>{1}));
  EXPECT_EQ(disk.why, "/dev/vda's interrupts (IRQ 36) land on CPU 1");
  // A folder on a partition follows the disk the partition is on.
  EXPECT_EQ(m.of("254:1").cpus, (std::vector<int>{1}));
  // A folder that does not exist yet, given relative, is placed by the folder it will be in.
  EXPECT_EQ(writer_placement::for_directory("no-such-folder/checkpoint_3").why.rfind("cannot", 0),
            std::string::npos);
  // No effective affinity (a kernel before 4.15): the affinity asked for is usually every CPU,
  // so nothing is placed.
  fs::remove(m.proc() / "irq/36/effective_affinity_list");
  write_file(m.proc() / "irq/36/smp_affinity_list", "0-1\n");
  EXPECT_EQ(m.of("254:0").why, "no effective affinity for /dev/vda's interrupt 36");
}

// No CPUs, and this reason.
void expect_nothing(const Placement& p, const std::string& why) {
  EXPECT_TRUE(p.cpus.empty()) << p.why;
  EXPECT_EQ(p.why, why);
}

TEST(WriterPlacement, NothingIsPlacedWhereTheDiskSaysNothingOrCompletesOnEveryCpu) {
  {
    FakeMachine m;
    fs::create_directories(m.vda() / "mq/1");
    expect_nothing(m.of("254:0"),
                   "/dev/vda has 2 queues: its writes complete on the CPUs that issue them");
  }
  {
    FakeMachine m;
    m.interrupts(0, 0);
    expect_nothing(m.of("254:0"), "/dev/vda has raised no interrupts yet");
  }
  {
    FakeMachine m;
    fs::create_directories(m.vda() / "slaves/sda");
    expect_nothing(m.of("254:0"), "/dev/vda is built from other devices (device mapper, RAID)");
  }
  {
    FakeMachine m;
    fs::remove_all(m.sys() / "devices/pci0000:00/0000:00:02.0/msi_irqs");
    expect_nothing(m.of("254:0"), "/dev/vda's controller has no MSI interrupts to follow");
  }
  {
    // A controller without MSI behind a bridge that has its own: the bridge's say nothing.
    FakeMachine m;
    fs::remove_all(m.sys() / "devices/pci0000:00/0000:00:02.0/msi_irqs");
    fs::create_directories(m.sys() / "devices/pci0000:00/msi_irqs/24");
    expect_nothing(m.of("254:0"), "/dev/vda's controller has no MSI interrupts to follow");
  }
  {
    // A controller with a vector per port or per CPU: several busy ones, no one CPU.
    FakeMachine m;
    m.interrupts(500000, 1894439);
    expect_nothing(m.of("254:0"),
                   "/dev/vda's controller spreads its interrupts over several busy vectors (IRQ "
                   "36, 35): no one CPU to follow");
  }
  {
    FakeMachine m;
    fs::remove(m.proc() / "interrupts");
    expect_nothing(m.of("254:0"), "cannot read " + (m.proc() / "interrupts").string());
  }
  {
    FakeMachine m;
    auto p = m.of("8:0");
    EXPECT_TRUE(p.cpus.empty());
    EXPECT_NE(p.why.find("no block device 8:0"), std::string::npos) << p.why;
  }
  // procfs has no block device under it (tmpfs, overlay and NFS neither).
  expect_nothing(writer_placement::for_directory("/proc/self"),
                 "/proc/self is on a file system without a single block device under it (tmpfs, "
                 "overlay, NFS, btrfs, ZFS)");
}

TEST(WriterPlacement, TheSettingChoosesAutoNoneOrTheCpusItNames) {
  EXPECT_TRUE(writer_placement::chosen("any", "/").cpus.empty());
  EXPECT_EQ(writer_placement::chosen("2-3", "/").cpus, (std::vector<int>{2, 3}));
  const std::string proc_why =
      "/proc is on a file system without a single block device under it (tmpfs, overlay, NFS, "
      "btrfs, ZFS)";
  EXPECT_EQ(writer_placement::chosen(nullptr, "/proc").why, proc_why);
  EXPECT_EQ(writer_placement::chosen("auto", "/proc").why, proc_why);
  EXPECT_TRUE(writer_placement::valid_setting("3,5-6"));
  EXPECT_FALSE(writer_placement::valid_setting("1-2-3"));
  try {
    writer_placement::chosen("fast", "/");
    FAIL() << "no error for a setting that is not a CPU list";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(),
                 "ACCEL_CHECKPOINT_WRITER_CPUS='fast' is not auto, any or a list of CPUs such as 1 "
                 "or 2-3,6");
  }
}

std::vector<int> my_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(::sched_getaffinity(0, sizeof set, &set), 0);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

TEST(WriterPlacement, OnlyTheCallingThreadMovesAndOnlyToCpusItMayUse) {
  const auto all = my_cpus();
  ASSERT_FALSE(all.empty());
  std::thread([&] {
    // All of its CPUs, or none it may use: it stays where it is.
    EXPECT_TRUE(writer_placement::run_calling_thread_on(all).empty());
    EXPECT_TRUE(writer_placement::run_calling_thread_on({CPU_SETSIZE - 1, 100000}).empty());
    EXPECT_EQ(my_cpus(), all);
    if (all.size() < 2) return;  // one CPU: nowhere else to go
    EXPECT_EQ(writer_placement::run_calling_thread_on({all.back(), CPU_SETSIZE - 1}),
              std::vector<int>{all.back()});
    EXPECT_EQ(my_cpus(), std::vector<int>{all.back()});
    std::vector<int> inherited;
    std::thread([&] { inherited = my_cpus(); }).join();
    EXPECT_EQ(inherited, std::vector<int>{all.back()}) << "a thread it starts runs there too";
  }).join();
  EXPECT_EQ(my_cpus(), all) << "the test's own thread did not move";
}

TEST(WriterPlacement, AutoMovesTheWriterOnlyWhereTrainingLeavesACpuToSpare) {
  const auto all = my_cpus();
  FakeMachine m;
  const auto disk = m.of("254:0");
  std::thread([&] {
    // Training on every CPU: the writer stays, and the line says why.
    EXPECT_EQ(writer_placement::place_calling_writer(disk, /*automatic=*/true,
                                                     static_cast<int>(all.size()))
                  .line,
              "background checkpoint writer left where the scheduler puts it: /dev/vda's "
              "interrupts (IRQ 36) land on CPU 1, but training keeps every CPU this process may "
              "use busy (" +
                  std::to_string(all.size()) + (all.size() == 1 ? " thread" : " threads") +
                  ", CPU " + writer_placement::format_cpu_list(all) + ")");
    EXPECT_EQ(my_cpus(), all);
    EXPECT_EQ(
        writer_placement::place_calling_writer({{}, "/proc is not on a block device"}, true, 0)
            .line,
        "background checkpoint writer left where the scheduler puts it: /proc is not on "
        "a block device");
    EXPECT_EQ(writer_placement::place_calling_writer("any", "/", 0).line,
              "background checkpoint writer left where the scheduler puts it: "
              "ACCEL_CHECKPOINT_WRITER_CPUS=any");
    if (all.size() < 2) return;  // one CPU: nowhere else to go
    // A CPU to spare: the writer goes where the interrupts land (here: the last CPU it may use).
    const std::string last = std::to_string(all.back());
    Placement there{{all.back()}, "/dev/vda's interrupts (IRQ 36) land on CPU " + last};
    EXPECT_EQ(writer_placement::place_calling_writer(there, true, 1).line,
              "background checkpoint writer runs on CPU " + last + ": " + there.why);
    EXPECT_EQ(my_cpus(), std::vector<int>{all.back()});
  }).join();
  std::thread([&] {
    // A list the user gave is followed even when training uses every CPU.
    if (all.size() < 2) return;
    const std::string first = std::to_string(all.front());
    auto placed = writer_placement::place_calling_writer(first.c_str(), "/", 1000);
    EXPECT_EQ(placed.line, "background checkpoint writer runs on CPU " + first +
                               ": ACCEL_CHECKPOINT_WRITER_CPUS=" + first);
    EXPECT_FALSE(placed.warning);
    EXPECT_EQ(my_cpus(), std::vector<int>{all.front()});
  }).join();
  std::thread([&] {
    // A list naming CPUs this process may not use: followed where it can be, with a warning.
    const std::string may = writer_placement::format_cpu_list(all);
    auto none = writer_placement::place_calling_writer({{CPU_SETSIZE - 1}, "a list"}, false, 1);
    EXPECT_TRUE(none.warning);
    EXPECT_EQ(none.line,
              "background checkpoint writer left where the scheduler puts it: a list, "
              "none of which this process may run on (CPU " +
                  may + ")");
    EXPECT_EQ(my_cpus(), all);
    if (all.size() < 2) return;
    auto some =
        writer_placement::place_calling_writer({{all.back(), CPU_SETSIZE - 1}, "a list"}, false, 1);
    EXPECT_TRUE(some.warning);
    EXPECT_EQ(some.line, "background checkpoint writer runs on CPU " + std::to_string(all.back()) +
                             ": a list (those of them this process may run on, CPU " + may + ")");
  }).join();
  // A bad setting (the environment check stops a job before this) is said, not thrown.
  auto bad = writer_placement::place_calling_writer("fast", "/", 1);
  EXPECT_TRUE(bad.warning);
  EXPECT_NE(bad.line.find("ACCEL_CHECKPOINT_WRITER_CPUS='fast' is not auto, any or a list"),
            std::string::npos)
      << bad.line;
}

}  // namespace
}  // namespace accel

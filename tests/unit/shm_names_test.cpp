// What workers leave in /dev/shm, removed when their agent died with them (shm_names.h): real
// processes, real names in /dev/shm.
#include "agent/supervisor/shm_names.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>

namespace accel::supervisor {
namespace {

namespace fs = std::filesystem;

// A folder for the workers file, removed at the end.
struct Folder {
  fs::path path = fs::temp_directory_path() / ("shm_names_test_" + std::to_string(::getpid()) +
                                               "_" + std::to_string(std::random_device{}()));
  Folder() { fs::create_directories(path); }
  ~Folder() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// /dev/shm/accel-<pid>-<tag>, made by this test and removed at the end if still there.
struct Name {
  fs::path path;
  Name(pid_t pid, const std::string& tag)
      : path("/dev/shm/accel-" + std::to_string(pid) + "-" + tag + "-" +
             std::to_string(std::random_device{}())) {
    std::ofstream(path) << "x";
  }
  ~Name() {
    std::error_code ec;
    fs::remove(path, ec);
  }
  bool exists() const { return fs::exists(fs::symlink_status(path)); }
};

// A child that sleeps until killed: a worker whose agent is gone.
pid_t sleeper() {
  pid_t pid = ::fork();
  if (pid == 0) {
    ::pause();
    ::_exit(0);
  }
  return pid;
}

TEST(ShmNames, ARecordedWorkerThatIsGoneLosesItsNamesAndOthersKeepTheirs) {
  Folder folder;
  const pid_t dead = sleeper();
  const pid_t alive = sleeper();
  const pid_t unlisted = sleeper();
  Name left(dead, "b1");
  Name in_use(alive, "b1");
  Name not_ours(unlisted, "b1");
  record_workers(folder.path.string(), {dead, alive});
  ::kill(dead, SIGKILL);
  ::waitpid(dead, nullptr, 0);

  EXPECT_EQ(remove_shm_names_of_recorded_workers(folder.path.string(), 50), 1);
  EXPECT_FALSE(left.exists());
  EXPECT_TRUE(in_use.exists()) << "a listed pid still running keeps its names";
  EXPECT_TRUE(not_ours.exists()) << "a pid the file does not list keeps its names";
  for (pid_t p : {alive, unlisted}) {
    ::kill(p, SIGKILL);
    ::waitpid(p, nullptr, 0);
  }
}

// A worker killed a moment before (the SIGKILL its dead agent sent) is waited for; a zombie
// (nobody reaped it) counts as gone.
TEST(ShmNames, AWorkerStillExitingIsWaitedForAndAZombieCountsAsGone) {
  Folder folder;
  const pid_t zombie = sleeper();
  const pid_t exiting = sleeper();
  Name a(zombie, "9");
  Name b(exiting, "b2");
  record_workers(folder.path.string(), {zombie, exiting});
  ::kill(zombie, SIGKILL);  // not reaped until the end: a zombie meanwhile
  std::thread killer([exiting] {
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    ::kill(exiting, SIGKILL);
    ::waitpid(exiting, nullptr, 0);
  });
  EXPECT_EQ(remove_shm_names_of_recorded_workers(folder.path.string(), 5000), 2);
  killer.join();
  EXPECT_FALSE(a.exists());
  EXPECT_FALSE(b.exists());
  ::waitpid(zombie, nullptr, 0);
}

// The workers file is read without following a link, and only its first 4 KiB: a planted file
// cannot lead the agent elsewhere or stall its start. No file, nothing removed; words that are
// not pids are skipped.
TEST(ShmNames, NoFileOrALinkedFileRemovesNothing) {
  Folder folder;
  const pid_t dead = sleeper();
  Name left(dead, "b1");
  ::kill(dead, SIGKILL);
  ::waitpid(dead, nullptr, 0);
  EXPECT_EQ(remove_shm_names_of_recorded_workers(folder.path.string(), 0), 0);
  std::ofstream(folder.path / "elsewhere") << dead << "\n";
  fs::create_symlink(folder.path / "elsewhere", folder.path / kWorkersFile);
  EXPECT_EQ(remove_shm_names_of_recorded_workers(folder.path.string(), 0), 0);
  EXPECT_TRUE(left.exists());
  fs::remove(folder.path / kWorkersFile);
  std::ofstream(folder.path / kWorkersFile) << "garbage -5 0 99999999999 12x\n" << dead << "\n";
  EXPECT_EQ(remove_shm_names_of_recorded_workers(folder.path.string(), 0), 1)
      << "words that are not pids are skipped";
  EXPECT_FALSE(left.exists());
}

}  // namespace
}  // namespace accel::supervisor

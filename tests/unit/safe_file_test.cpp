// Files created beside a user's path where others may plant links (agent/common/safe_file.h).
#include "agent/common/safe_file.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

namespace accel {
namespace {

namespace fs = std::filesystem;

std::string read(const fs::path& p) {
  std::ifstream in(p);
  return {std::istreambuf_iterator<char>(in), {}};
}

struct Dir {
  fs::path path;
  Dir() {
    std::string pattern = ::testing::TempDir() + "/safe_file_XXXXXX";
    path = ::mkdtemp(pattern.data());
  }
  ~Dir() { fs::remove_all(path); }
};

// Each temp name is new (O_EXCL), beside the path, with the mode asked for.
TEST(SafeFile, TempNamesAreFreshBesideThePath) {
  Dir d;
  const std::string path = (d.path / "config.yaml").string();
  std::string a, b;
  int fa = create_temp_beside(path, 0640, a);
  int fb = create_temp_beside(path, 0640, b);
  ASSERT_GE(fa, 0);
  ASSERT_GE(fb, 0);
  ::close(fa);
  ::close(fb);
  EXPECT_NE(a, b);
  EXPECT_EQ(a.rfind(path + ".tmp-", 0), 0u) << a;
  EXPECT_EQ(a.size(), path.size() + 5 + 16) << a;
  struct stat st {};
  ASSERT_EQ(::stat(a.c_str(), &st), 0);
  EXPECT_EQ(
      st.st_mode & 0777, 0640 & ~[] {
        mode_t m = ::umask(0);
        ::umask(m);
        return m;
      }());
}

// A link (or a file) planted at the exact name is removed, never written through; its target
// keeps its bytes.
TEST(SafeFile, AFreshFileReplacesAPlantedLinkWithoutWritingThroughIt) {
  Dir d;
  std::ofstream(d.path / "victim") << "precious";
  const fs::path name = d.path / "out.tmp";
  fs::create_symlink(d.path / "victim", name);
  int fd = create_fresh(name.string(), 0644);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  ASSERT_EQ(::write(fd, "new", 3), 3);
  ::close(fd);
  EXPECT_EQ(read(d.path / "victim"), "precious");
  EXPECT_FALSE(fs::is_symlink(name));
  EXPECT_EQ(read(name), "new");
}

}  // namespace
}  // namespace accel

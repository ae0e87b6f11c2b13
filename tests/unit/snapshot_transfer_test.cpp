// What a node that sends its in-memory snapshot lists, and what a node that receives one accepts.
#include "runtime/snapshot_transfer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace accel::detail {
namespace {

namespace fs = std::filesystem;

struct Folder {
  fs::path path;
  Folder() {
    std::string tmpl = (fs::temp_directory_path() / "accel-transfer-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path = tmpl;
  }
  ~Folder() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

void write(const fs::path& p, const std::string& bytes) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << bytes;
}

using Files = std::vector<std::pair<uint64_t, fs::path>>;

// Every regular file, in subfolders too, with its size; the listing parses back to the same.
TEST(SnapshotTransfer, TheListingNamesEveryFileWithItsSizeAndParsesBack) {
  Folder dir;
  write(dir.path / "manifest.json", "{}");
  write(dir.path / "model.safetensors", std::string(1000, 'w'));
  write(dir.path / "ranks" / "rank_1.bin", "");
  std::string listing = list_snapshot_files(dir.path);
  Files files;
  ASSERT_TRUE(parse_snapshot_listing(listing, &files)) << listing;
  std::sort(files.begin(), files.end(),
            [](const auto& a, const auto& b) { return a.second < b.second; });
  ASSERT_EQ(files.size(), 3u) << listing;
  EXPECT_EQ(files[0], std::make_pair(uint64_t{2}, fs::path("manifest.json")));
  EXPECT_EQ(files[1], std::make_pair(uint64_t{1000}, fs::path("model.safetensors")));
  EXPECT_EQ(files[2], std::make_pair(uint64_t{0}, fs::path("ranks/rank_1.bin")));
}

// A link in the folder is named, not followed: what it points at is not sent.
TEST(SnapshotTransfer, ALinkInTheFolderIsRefusedAndNamed) {
  Folder dir;
  write(dir.path / "manifest.json", "{}");
  fs::create_symlink("/etc/passwd", dir.path / "model.safetensors");
  try {
    list_snapshot_files(dir.path);
    FAIL() << "a link was listed";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("model.safetensors is not a regular file"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(list_snapshot_files(dir.path / "gone"), std::exception);
}

// A receiving node writes only inside its own folder: a path that leaves it, an absolute one,
// an empty one, or a size that is not a number refuses the whole listing.
TEST(SnapshotTransfer, AListingThatLeadsOutOfTheFolderIsRefused) {
  for (const char* bad :
       {"3 ../x\n", "3 a/../../x\n", "3 /etc/passwd\n", "3 \n", "3 .\n", "x manifest.json\n",
        "-1 manifest.json\n", "manifest.json\n", " manifest.json\n", "1234567890123456789 big\n"}) {
    Files files;
    EXPECT_FALSE(parse_snapshot_listing(std::string("2 manifest.json\n") + bad, &files)) << bad;
  }
  Files files;
  EXPECT_TRUE(parse_snapshot_listing("2 manifest.json\n5 a/../model.safetensors\n", &files));
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files[1].second, fs::path("model.safetensors"));
}

}  // namespace
}  // namespace accel::detail

// A node's in-memory snapshot sent to the nodes that lack it (snapshot_transfer.h).
#include "runtime/snapshot_transfer.h"

#include <fcntl.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <utility>
#include <vector>

#include "accel/accelerator.h"
#include "runtime/checkpoint_layout.h"

namespace accel {
namespace {

namespace fs = std::filesystem;

// Why pieces: a state of many GB is never held in memory whole, on any rank.
constexpr uint64_t kPieceBytes = 64u << 20;

struct Fd {
  int fd = -1;
  Fd() = default;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

std::string os_error(const std::string& what, const fs::path& path) {
  return what + " " + path.string() + ": " + std::strerror(errno);
}

bool read_fully(int fd, void* data, uint64_t size, uint64_t offset) {
  auto* p = static_cast<char*>(data);
  while (size > 0) {
    ssize_t n = ::pread(fd, p, size, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= static_cast<uint64_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return true;
}

bool write_fully(int fd, const void* data, uint64_t size) {
  const auto* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::write(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= static_cast<uint64_t>(n);
  }
  return true;
}

}  // namespace

namespace detail {

std::string list_snapshot_files(const fs::path& dir) {
  std::string out;
  if (!fs::is_directory(fs::symlink_status(dir)))
    throw std::runtime_error(dir.string() + " is gone");
  for (auto it = fs::recursive_directory_iterator(dir); it != fs::recursive_directory_iterator();
       ++it) {
    const auto status = it->symlink_status();
    if (fs::is_directory(status)) continue;
    const std::string relative = it->path().lexically_relative(dir).string();
    if (!fs::is_regular_file(status) || relative.find('\n') != std::string::npos)
      throw std::runtime_error(it->path().string() + " is not a regular file");
    out += std::to_string(fs::file_size(it->path())) + " " + relative + "\n";
  }
  return out;
}

bool parse_snapshot_listing(const std::string& listing,
                            std::vector<std::pair<uint64_t, fs::path>>* files) {
  std::istringstream in(listing);
  for (std::string line; std::getline(in, line);) {
    const auto space = line.find(' ');
    if (space == 0 || space == std::string::npos || space + 1 == line.size()) return false;
    const std::string digits = line.substr(0, space);
    if (digits.size() > 18 || !std::all_of(digits.begin(), digits.end(),
                                           [](unsigned char c) { return std::isdigit(c) != 0; }))
      return false;
    fs::path relative = fs::path(line.substr(space + 1)).lexically_normal();
    if (relative.is_absolute() || relative.empty() || relative == "." || *relative.begin() == "..")
      return false;
    files->emplace_back(std::stoull(digits), std::move(relative));
  }
  return true;
}

}  // namespace detail

std::string send_snapshot_to_nodes_lacking_it(Accelerator& acc, const fs::path& folder,
                                              int64_t step, int source) {
  const std::string name = ckpt::kCheckpointPrefix + std::to_string(step);
  const fs::path here = folder / name;
  const bool sending = acc.process_index() == source;
  std::error_code ec;
  const bool receiving =
      acc.is_local_main_process() && !sending && !fs::exists(here / ckpt::kManifest, ec);

  std::string listing;
  if (sending) {
    try {
      listing = "+" + detail::list_snapshot_files(here);
    } catch (const std::exception& e) {
      listing = "-" + std::string(e.what());
    }
  }
  listing = acc.broadcast_object(listing, source);
  const std::string from = "rank " + std::to_string(source) + "'s node";
  if (listing.empty() || listing[0] != '+')
    return from + " could not send it: " + (listing.empty() ? "" : listing.substr(1));
  std::vector<std::pair<uint64_t, fs::path>> files;
  if (!detail::parse_snapshot_listing(listing.substr(1), &files) || files.empty())
    return from + " sent a listing of its files that is not one";

  // This rank's trouble; every rank goes through every piece all the same, so the collectives
  // stay matched, and the ranks agree on the outcome at the end.
  std::string error;
  const fs::path incoming = folder / (".incoming-" + name);
  if (receiving) {
    // Why every ".incoming-": one left by a local main killed in a copy (of any step) would
    // otherwise hold its memory until the job ends; no other copy into this folder runs now.
    std::vector<fs::path> stale;
    for (auto it = fs::directory_iterator(folder, ec); !ec && it != fs::directory_iterator();
         it.increment(ec)) {
      if (it->path().filename().string().rfind(".incoming-", 0) == 0) stale.push_back(it->path());
    }
    for (const auto& path : stale) fs::remove_all(path, ec);
    if (!fs::create_directory(incoming, ec))
      error = "cannot make " + incoming.string() + ": " + ec.message();
  }
  const auto began = std::chrono::steady_clock::now();
  uint64_t bytes = 0;
  for (const auto& [size, relative] : files) {
    Fd in, out;
    if (sending) {
      in.fd = ::open((here / relative).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
      if (in.fd < 0 && error.empty()) error = os_error("cannot open", here / relative);
    }
    if (receiving && error.empty()) {
      const fs::path target = incoming / relative;
      fs::create_directories(target.parent_path(), ec);
      out.fd = ::open(target.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
      if (out.fd < 0) error = os_error("cannot create", target);
    }
    for (uint64_t at = 0; at < size; at += kPieceBytes) {
      const uint64_t n = std::min(kPieceBytes, size - at);
      // Filled by the sender; whatever another rank's holds is overwritten by the broadcast.
      auto piece = torch::empty({static_cast<int64_t>(n)}, torch::kUInt8);
      if (in.fd >= 0 && !read_fully(in.fd, piece.data_ptr(), n, at) && error.empty())
        error = os_error("cannot read", here / relative);
      piece = acc.broadcast(piece.to(acc.device()), source).cpu();
      if (out.fd >= 0 && !write_fully(out.fd, piece.data_ptr(), n)) {
        error = os_error("cannot write", incoming / relative);
        ::close(out.fd);
        out.fd = -1;
      }
    }
    bytes += size;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();

  // Why agree before anything is published: a sender that could not read a file sent filler;
  // a snapshot has no checksums, so a copy published then would pass every later check.
  // One byte first, so that no rank sends an empty object.
  auto agree = [&](const std::string& mine, int* received) {
    auto outcomes = acc.gather_object((receiving ? "r" : "-") + mine);
    for (std::size_t r = 0; r < outcomes.size(); ++r) {
      if (outcomes[r].size() > 1) return "rank " + std::to_string(r) + ": " + outcomes[r].substr(1);
      if (received != nullptr && outcomes[r][0] == 'r') ++*received;
    }
    return std::string();
  };
  int received = 0;
  std::string problem = agree(error, &received);
  if (problem.empty() && receiving) {
    fs::remove_all(here, ec);  // a folder without its manifest: what a killed write left
    fs::rename(incoming, here, ec);
    if (ec)
      error = "cannot rename " + incoming.string() + " to " + here.string() + ": " + ec.message();
  }
  if (receiving && (!problem.empty() || !error.empty())) fs::remove_all(incoming, ec);
  if (problem.empty()) problem = agree(error, nullptr);
  if (!problem.empty()) return problem;
  char size_text[64];
  std::snprintf(size_text, sizeof size_text, "%.1f MB in %.2f s", static_cast<double>(bytes) / 1e6,
                seconds);
  acc.print("accel: the in-memory snapshot of step", step, "came from the memory of", from, "to",
            received, received == 1 ? "node that lacked it" : "nodes that lacked it",
            "(" + std::string(size_text) + ")");
  return "";
}

}  // namespace accel

// A node's in-memory snapshot sent to the nodes that lack it (snapshot_transfer.h).
#include "runtime/snapshot_transfer.h"

#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string_view>
#include <utility>
#include <vector>

#include "accel/accelerator.h"
#include "runtime/checkpoint_io.h"
#include "runtime/checkpoint_layout.h"

namespace accel {
namespace {

namespace fs = std::filesystem;

// Why pieces: a state of many GB is never held in memory whole, on any rank.
constexpr uint64_t kPieceBytes = 64u << 20;

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
    // The sender's file, mapped; the receiver's, written through the same file layer as every
    // snapshot (in place, no checksum). A failure on either side leaves `error` set, and the
    // pieces still go through the broadcasts, so that every rank runs the same collectives.
    ckpt::MappedFile mapped;
    if (sending && error.empty()) {
      try {
        mapped = ckpt::checkpoint_fs().map_file(here / relative);
        if (mapped.size() != size)
          error = (here / relative).string() + " changed size while it was sent";
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
    auto pieces = [&](const ckpt::Sink* sink) {
      for (uint64_t at = 0; at < size; at += kPieceBytes) {
        const uint64_t n = std::min(kPieceBytes, size - at);
        // Filled by the sender; whatever another rank's holds is overwritten by the broadcast.
        auto piece = torch::empty({static_cast<int64_t>(n)}, torch::kUInt8);
        if (sending && error.empty()) std::memcpy(piece.data_ptr(), mapped.view().data() + at, n);
        piece = acc.broadcast(piece.to(acc.device()), source).cpu();
        if (sink == nullptr || !error.empty()) continue;
        try {
          (*sink)(std::string_view(static_cast<const char*>(piece.data_ptr()), n));
        } catch (const std::exception& e) {
          error = e.what();
        }
      }
    };
    bool piped = false;
    if (receiving && error.empty()) {
      const fs::path target = incoming / relative;
      try {
        fs::create_directories(target.parent_path());
        ckpt::checkpoint_fs().write_in_place(target, [&](const ckpt::Sink& sink) {
          piped = true;
          pieces(&sink);
        });
      } catch (const std::exception& e) {
        if (error.empty()) error = e.what();
      }
    }
    if (!piped) pieces(nullptr);
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

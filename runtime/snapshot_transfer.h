// A node's in-memory snapshot sent to the nodes that lack it. Every node's snapshot holds the
// whole state of the job (data parallel: the same weights and optimizer state on every node,
// ZeRO shards gathered, every rank's RNG and loader position), so a node whose agent restarted,
// or that replaced a lost one, can resume from any other node's copy: the files go over the
// job's own process group (c10d broadcast, in pieces), and that node's local main writes them
// into its folder, after which every rank loads from its node's memory as usual.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace accel {
class Accelerator;

// Collective (every rank). Copies checkpoint_<step> from `source`'s node's snapshot folder into
// `folder` (this node's) on each node whose local main lacks it. Returns what went wrong, the
// same text on every rank, or "" when every node now holds it. Throws only when the group fails.
std::string send_snapshot_to_nodes_lacking_it(Accelerator& acc, const std::filesystem::path& folder,
                                              int64_t step, int source);

namespace detail {
// What the sending rank lists: "<size> <path relative to dir>\n" for every file under `dir`.
// Throws naming anything there that is neither a folder nor a regular file (a link is not
// followed).
std::string list_snapshot_files(const std::filesystem::path& dir);
// The files of such a listing, or false when a line is not one: a size that is not a number, or
// a path that is empty, absolute, or leads out of the folder.
bool parse_snapshot_listing(const std::string& listing,
                            std::vector<std::pair<uint64_t, std::filesystem::path>>* files);
}  // namespace detail

}  // namespace accel

// Bounds on what a peer that holds the token can make the coordinator keep. Every field of a
// request is checked (ids, addresses, counts, ranks: refused) or cut (free text: kept, shortened
// with a marker) before anything is stored, so the coordinator's memory has a bound in the number
// of nodes and jobs it keeps (docs/operations.md, "Security and limits"). The numbers are the
// contract; CoordinatorCore applies them.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "accel/v1/coordinator.pb.h"

namespace accel::coordinator::limits {

namespace pb = ::accel::v1;

inline constexpr std::size_t kMaxIdBytes = 128;    // node and job ids: [A-Za-z0-9._:-]
inline constexpr std::size_t kMaxHostBytes = 255;  // hostname, address: printable, no spaces
inline constexpr int kMaxNodesPerJob = 32768;      // max_nodes, num_nodes, machine_rank bound
inline constexpr int kMaxProcessesPerNode = 1024;
inline constexpr std::size_t kMaxSpecBytes = 256u
                                             << 10;     // a job spec (argv, environment) serialized
inline constexpr std::size_t kMaxTextBytes = 8u << 10;  // a failure's message, stack, report: cut
inline constexpr std::size_t kMaxTailLines = 32;        // a failure's stderr tail: the last ones
inline constexpr std::size_t kMaxTailLineBytes = 512;   // one tail line: cut
inline constexpr std::size_t kMaxFailuresPerJob = 512;  // failures kept per job (the earliest)
inline constexpr std::size_t kMaxLineBytes = 64u << 10;  // one log or tail line: cut
inline constexpr std::size_t kMaxLinesPerPush = 10'000;  // one PushLogs call
inline constexpr std::size_t kMaxProgressBytes = 64;     // RankProgress strings ("allreduce #812")
// Defaults of the coordinator_max_nodes and coordinator_max_jobs keys (CoordinatorOptions).
inline constexpr std::size_t kMaxRegisteredNodes = 8192;  // nodes kept, live and lost
inline constexpr std::size_t kMaxJobs = 1024;             // jobs kept, running and ended
// Peers a node probes: this many on each side in node-rank order, and node rank 0.
inline constexpr int kProbeNeighbours = 8;
inline constexpr std::size_t kStatusJobs = 100;        // GetStatus lists the most recent ones
inline constexpr std::size_t kStatusArgvBytes = 1024;  // of each listed job's command line
inline constexpr std::size_t kCutMarkerBytes = 32;     // what cut_text appends at most

// Failures kept per node and round: one per local rank, and one for the node itself.
std::size_t max_failures_per_node_round(const pb::JobSpec& spec);

// An empty string when the request's fields are within bounds, else what is wrong (for
// INVALID_ARGUMENT). The node's own id is checked by the caller.
std::string check(const pb::RegisterNodeRequest& req);
std::string check(const pb::JobSpec& spec);

// Free text cut to its bounds, in place.
void cut(pb::Failure& failure);
void cut(pb::LogLine& line);
void cut(pb::RankProgress& progress);

// `text` cut to `max` bytes (on a UTF-8 boundary) with " ... [N bytes cut]" appended.
std::string cut_text(std::string text, std::size_t max);

// `text` safe to print on a terminal: control characters (C0, DEL, UTF-8 C1) as \xNN; other
// UTF-8 text as it is.
std::string printable(std::string_view text);

}  // namespace accel::coordinator::limits

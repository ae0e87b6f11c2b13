// The worker's side of the progress page (contract/progress_page.h): maps ACCEL_PROGRESS_FILE once
// and records heartbeats and collectives in it. Without the variable every call is a no-op.
// Thread: any; stores are atomic, and the collectives' order is c10d's one order.
#pragma once

#include <cstddef>
#include <cstdint>

namespace accel::progress {

// Marks a sign of life (a batch, a step).
void heartbeat();
// A collective begins / ends; `seq` is Comm's sequence number.
void collective_started(std::uint64_t seq, const char* op, std::size_t bytes);
void collective_finished(std::uint64_t seq);

}  // namespace accel::progress

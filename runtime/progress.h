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
// `ns` more spent blocked waiting for collectives (what tells a slow rank from one that waits for
// a slow peer).
void collective_waited(std::uint64_t ns);
// A synchronizing optimizer step ended; `steps` is the count so far (a resumed run's count).
void step_done(std::uint64_t steps);
// A checkpoint was written completely: its size and how long the save took.
void checkpoint_saved(std::uint64_t bytes, std::uint64_t duration_ns);

}  // namespace accel::progress

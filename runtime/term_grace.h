// SIGTERM while a background save is being written (the agent or launcher stopping a group
// because one of its ranks died, Slurm's preemption): the write is let finish, for up to a few
// seconds, before the process dies of SIGTERM as it would have. So a group stopped because a
// peer was killed still publishes the in-memory snapshot (or checkpoint) it was writing, and a
// restart resumes from it rather than from the one before.
#pragma once

namespace accel::term_grace {

// Installs the handler once per process, unless the program has a SIGTERM handler of its own.
void arm();
// Around each background write (any thread).
void write_started();
void write_ended();

}  // namespace accel::term_grace

// The stop signals of accel's long-running commands (accel-launch, accel-agent), handled one
// way: SIGINT and SIGTERM stop (the first time gracefully, later ones at once: `on_stop` is told
// which time it is), SIGHUP is ignored with a message (a closed terminal must not kill a job).
// Thread: the handlers run on `io`.
#pragma once

#include <boost/asio/io_context.hpp>
#include <functional>
#include <memory>
#include <string>

namespace accel {

class StopSignals {
 public:
  // `on_stop(signal, nth)`: nth is 1 for the first SIGINT/SIGTERM, 2 for the next, ...
  // `on_hup(text)`: told "received SIGHUP: ignored, " + `hup_note`.
  // `usr1_stops`: SIGUSR1 stops too (launchers: Slurm's --signal=USR1@T before a time limit or
  // preemption; the workers get SIGUSR1 and libaccel saves a checkpoint before it stops).
  StopSignals(boost::asio::io_context& io, std::string hup_note,
              std::function<void(const std::string&)> on_hup,
              std::function<void(int signal, int nth)> on_stop, bool usr1_stops = false);
  ~StopSignals();
  // Stops listening (the signals' default actions stay blocked by asio until destruction).
  void cancel();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace accel

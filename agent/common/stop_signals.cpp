// SIGINT/SIGTERM/SIGHUP (and SIGUSR1 for launchers) on an asio signal_set, re-armed after every
// signal.
#include "agent/common/stop_signals.h"

#include <boost/asio/signal_set.hpp>
#include <csignal>

namespace accel {

struct StopSignals::State : std::enable_shared_from_this<StopSignals::State> {
  State(boost::asio::io_context& io, std::string note, std::function<void(const std::string&)> hup,
        std::function<void(int, int)> stop, bool usr1_stops)
      : signals(io, SIGINT, SIGTERM, SIGHUP),
        hup_note(std::move(note)),
        on_hup(std::move(hup)),
        on_stop(std::move(stop)) {
    if (usr1_stops) signals.add(SIGUSR1);
  }

  void arm() {
    signals.async_wait([weak = weak_from_this()](const boost::system::error_code& ec, int sig) {
      auto self = weak.lock();
      if (ec || !self) return;
      if (sig == SIGHUP) {
        if (self->on_hup) self->on_hup("received SIGHUP: ignored, " + self->hup_note);
      } else {
        self->on_stop(sig, ++self->stops);
      }
      self->arm();
    });
  }

  boost::asio::signal_set signals;
  std::string hup_note;
  std::function<void(const std::string&)> on_hup;
  std::function<void(int, int)> on_stop;
  int stops = 0;
};

StopSignals::StopSignals(boost::asio::io_context& io, std::string hup_note,
                         std::function<void(const std::string&)> on_hup,
                         std::function<void(int signal, int nth)> on_stop, bool usr1_stops)
    : state_(std::make_shared<State>(io, std::move(hup_note), std::move(on_hup), std::move(on_stop),
                                     usr1_stops)) {
  state_->arm();
}

StopSignals::~StopSignals() { cancel(); }

void StopSignals::cancel() {
  boost::system::error_code ignored;
  state_->signals.cancel(ignored);
}

}  // namespace accel

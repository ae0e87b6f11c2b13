// Hang detection from the workers' progress pages (contract/progress_page.h): a
// worker whose heartbeat is older than heartbeat_timeout while no collective of it is in
// flight, or a collective in flight longer than collective_timeout, is a hang. The report
// names the lagging rank and the collectives each rank is in ("desync report").
// HangWatch runs the check on an io_context timer; detect_hang is the pure rule (unit-tested).
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "agent/supervisor/step_rates.h"

namespace accel::supervisor {

struct HangOptions {
  std::chrono::milliseconds heartbeat_timeout{0};   // 0: off
  std::chrono::milliseconds collective_timeout{0};  // 0: off
  std::chrono::milliseconds interval{1000};         // how often the pages are read
  bool observe = false;  // read the pages even with both timeouts off (step rates, metrics)
  [[nodiscard]] bool enabled() const {
    return observe || heartbeat_timeout.count() > 0 || collective_timeout.count() > 0;
  }
};

// What one page said at one moment.
struct PageView {
  int rank = 0;
  bool valid = false;  // the worker has opened its page (libaccel is in use)
  std::uint64_t heartbeat_ns = 0;
  std::uint64_t started = 0;  // collectives started
  struct Op {
    std::uint64_t seq = 0;
    std::string op;
    std::uint64_t bytes = 0;
    std::uint64_t start_ns = 0;
    std::uint64_t end_ns = 0;  // 0: in flight
  };
  std::optional<Op> in_flight;      // the oldest collective not finished
  std::optional<Op> last_finished;  // the newest finished one
  // The page's stats (contract/progress_page.h); 0 when the worker has none yet.
  std::uint64_t steps = 0;
  std::uint64_t last_step_ns = 0;
  std::uint64_t collective_wait_ns = 0;
  std::uint64_t checkpoint_ns = 0;
  std::uint64_t checkpoint_bytes = 0;
  std::uint64_t checkpoint_duration_ns = 0;
};

struct Hang {
  int rank = 0;        // the lagging rank
  std::string reason;  // one line
  std::string report;  // the desync report, one line per rank
};

// A progress page's bytes (as read from its file; any bytes at all) as a view; not valid when
// too short or without the magic. Entries being rewritten are skipped.
PageView parse_page(std::string_view bytes, int rank);

std::optional<Hang> detect_hang(const std::vector<PageView>& pages, std::uint64_t now_ns,
                                const HangOptions& options, const std::string& host);

// Creates (or empties) a page file of the right size for a worker about to start.
bool create_page_file(const std::string& path);
// "<dir>/rank_<r>.progress"
std::string page_file_path(const std::string& dir, int rank);

// Thread: the io_context's. Maps the pages read-only on first use; reports at most one hang.
class HangWatch {
 public:
  HangWatch(boost::asio::io_context& io, HangOptions options,
            std::vector<std::pair<int, std::string>> pages, std::string host,
            std::function<void(const Hang&)> on_hang);
  ~HangWatch();
  HangWatch(const HangWatch&) = delete;
  HangWatch& operator=(const HangWatch&) = delete;
  void start();
  // Stops watching `rank` (its worker exited: old heartbeats are not a hang).
  void forget(int rank);
  // The pages as of the last check, and when that was (CLOCK_MONOTONIC ns).
  [[nodiscard]] const std::vector<PageView>& latest() const { return latest_; }
  [[nodiscard]] std::uint64_t latest_ns() const { return latest_ns_; }
  // Each rank's step rate over the last StepRates::kWindow of checks.
  [[nodiscard]] const StepRates& rates() const { return rates_; }

 private:
  struct Mapping;
  void arm();
  void check();

  HangOptions options_;
  std::vector<std::pair<int, std::string>> pages_;
  std::vector<std::unique_ptr<Mapping>> maps_;
  std::string host_;
  std::function<void(const Hang&)> on_hang_;
  boost::asio::steady_timer timer_;
  bool fired_ = false;
  // Why: a queued timer completion may outlive us
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
  std::vector<PageView> latest_;
  std::uint64_t latest_ns_ = 0;
  StepRates rates_;
};

}  // namespace accel::supervisor

// Reading progress pages and deciding what is a hang.
#include "agent/supervisor/hang_monitor.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "agent/common/clock.h"
#include "agent/common/safe_file.h"
#include "contract/progress_page.h"

namespace accel::supervisor {

namespace {

std::string seconds(std::uint64_t ns) { return seconds_text(static_cast<double>(ns) / 1e9); }

std::string name(const PageView::Op& op) { return op.op + " #" + std::to_string(op.seq); }

}  // namespace

PageView parse_page(std::string_view bytes, int rank) {
  PageView v;
  v.rank = rank;
  if (bytes.size() < sizeof(progress::Page)) return v;
  // Why a copy: the bytes may be unaligned (a fuzzer's) or still changing (a live page).
  progress::Page page;
  std::memcpy(&page, bytes.data(), sizeof page);
  if (std::memcmp(page.magic, progress::kMagic, sizeof progress::kMagic) != 0) return v;
  v.valid = true;
  v.heartbeat_ns = progress::load(&page.heartbeat_ns);
  v.started = progress::load(&page.started);
  v.steps = progress::load(&page.stats.steps);
  v.last_step_ns = progress::load(&page.stats.last_step_ns);
  v.collective_wait_ns = progress::load(&page.stats.collective_wait_ns);
  v.checkpoint_ns = progress::load(&page.stats.checkpoint_ns);
  v.checkpoint_bytes = progress::load(&page.stats.checkpoint_bytes);
  v.checkpoint_duration_ns = progress::load(&page.stats.checkpoint_duration_ns);
  for (const auto& slot : page.ring) {
    progress::Entry e{};
    if (!progress::read_entry(slot, e)) continue;
    PageView::Op op{e.seq_plus_one - 1, e.op, e.bytes, e.start_ns, e.end_ns};
    if (e.end_ns == 0) {
      if (!v.in_flight || op.seq < v.in_flight->seq) v.in_flight = op;
    } else if (!v.last_finished || op.seq > v.last_finished->seq) {
      v.last_finished = op;
    }
  }
  return v;
}

std::string page_file_path(const std::string& dir, int rank) {
  return dir + "/rank_" + std::to_string(rank) + ".progress";
}

bool create_page_file(const std::string& path) {
  // Why fresh: a link planted at the page's name must not be truncated through.
  int fd = create_fresh(path, 0600);
  if (fd < 0) return false;
  bool ok = ::ftruncate(fd, static_cast<off_t>(progress::kFileBytes)) == 0;
  ::close(fd);
  return ok;
}

std::optional<Hang> detect_hang(const std::vector<PageView>& pages, std::uint64_t now_ns,
                                const HangOptions& options, const std::string& host) {
  auto ns = [](std::chrono::milliseconds d) {
    return static_cast<std::uint64_t>(d.count()) * 1'000'000ull;
  };
  auto age = [&](std::uint64_t t) { return now_ns > t ? now_ns - t : 0; };
  std::optional<Hang> hang;
  const PageView* culprit = nullptr;
  std::string why;
  // A collective in flight for too long: the lagging rank is the one furthest behind.
  if (options.collective_timeout.count() > 0) {
    for (const auto& p : pages) {
      if (!p.valid || !p.in_flight || age(p.in_flight->start_ns) <= ns(options.collective_timeout))
        continue;
      const PageView* behind = nullptr;
      for (const auto& q : pages) {
        if (q.valid && (!behind || q.started < behind->started)) behind = &q;
      }
      culprit = behind && behind->started < p.started ? behind : &p;
      why = "rank " + std::to_string(p.rank) + " has been in " + name(*p.in_flight) + " for " +
            seconds(age(p.in_flight->start_ns)) + " (hang_timeout " +
            seconds(ns(options.collective_timeout)) + ")";
      break;
    }
  }
  // No sign of life outside any collective (a CPU hang a NCCL watchdog never sees).
  if (!culprit && options.heartbeat_timeout.count() > 0) {
    for (const auto& p : pages) {
      if (!p.valid || p.heartbeat_ns == 0 || p.in_flight) continue;
      if (age(p.heartbeat_ns) <= ns(options.heartbeat_timeout)) continue;
      culprit = &p;
      why = "rank " + std::to_string(p.rank) + " has shown no progress for " +
            seconds(age(p.heartbeat_ns)) + " outside any collective (heartbeat_timeout " +
            seconds(ns(options.heartbeat_timeout)) + ")";
      break;
    }
  }
  if (!culprit) return std::nullopt;
  Hang h;
  h.rank = culprit->rank;
  std::string where = culprit->in_flight ? "is still in " + name(*culprit->in_flight) + " since " +
                                               seconds(age(culprit->in_flight->start_ns))
                      : culprit->last_finished
                          ? "is outside any collective; its last was " +
                                name(*culprit->last_finished) + ", finished " +
                                seconds(age(culprit->last_finished->end_ns)) + " ago"
                          : "has not started any collective";
  h.reason = "rank " + std::to_string(culprit->rank) + " " + where;
  // Who waits where: "ranks 0,2 wait in allreduce #813".
  std::vector<std::pair<std::string, std::vector<int>>> waiting;
  for (const auto& p : pages) {
    if (!p.valid || p.rank == culprit->rank || !p.in_flight) continue;
    std::string n = name(*p.in_flight);
    auto it =
        std::find_if(waiting.begin(), waiting.end(), [&](const auto& w) { return w.first == n; });
    if (it == waiting.end())
      waiting.push_back({n, {p.rank}});
    else
      it->second.push_back(p.rank);
  }
  for (const auto& [op, ranks] : waiting) {
    std::string list;
    for (int r : ranks) list += (list.empty() ? "" : ",") + std::to_string(r);
    h.reason += "; rank" + std::string(ranks.size() > 1 ? "s " : " ") + list +
                (ranks.size() > 1 ? " wait in " : " waits in ") + op;
  }
  h.report = "accel: hang detected on " + host + ": " + why + "\n";
  for (const auto& p : pages) {
    std::string line = "  rank " + std::to_string(p.rank) + ": ";
    if (!p.valid) {
      line += "no progress page (not using libaccel, or not started)";
    } else if (p.in_flight) {
      line += "in " + name(*p.in_flight) + " (" + std::to_string(p.in_flight->bytes) +
              " bytes) for " + seconds(age(p.in_flight->start_ns));
    } else if (p.last_finished) {
      line += "outside any collective; last " + name(*p.last_finished) + " finished " +
              seconds(age(p.last_finished->end_ns)) + " ago";
    } else {
      line += "no collective yet";
    }
    if (p.valid && p.heartbeat_ns != 0)
      line += "; last heartbeat " + seconds(age(p.heartbeat_ns)) + " ago";
    if (p.rank == culprit->rank) {
      // Why two words: a rank alone in a collective on this node may be waiting for a peer
      // elsewhere; only a rank behind the others, or outside any collective, is known to lag.
      bool behind =
          !culprit->in_flight || std::any_of(pages.begin(), pages.end(), [&](const PageView& q) {
            return q.valid && q.started > culprit->started;
          });
      line += behind ? "   <- lagging" : "   <- waiting longest (its peers are elsewhere)";
    }
    h.report += line + "\n";
  }
  hang = std::move(h);
  return hang;
}

// Why pread and not mmap: the worker owns its page file; one that truncates it would make a
// mapped read SIGBUS the agent. A 4 KiB read per worker per interval costs nothing.
struct HangWatch::Mapping {
  int fd = -1;
  ~Mapping() {
    if (fd >= 0) ::close(fd);
  }
  std::string read() const {
    std::string bytes(progress::kFileBytes, '\0');
    ssize_t n = fd < 0 ? -1 : ::pread(fd, bytes.data(), bytes.size(), 0);
    bytes.resize(n < 0 ? 0 : static_cast<size_t>(n));
    return bytes;
  }
};

HangWatch::HangWatch(boost::asio::io_context& io, HangOptions options,
                     std::vector<std::pair<int, std::string>> pages, std::string host,
                     std::function<void(const Hang&)> on_hang)
    : options_(options),
      pages_(std::move(pages)),
      host_(std::move(host)),
      on_hang_(std::move(on_hang)),
      timer_(io) {}

HangWatch::~HangWatch() {
  *alive_ = false;
  timer_.cancel();
}

void HangWatch::forget(int rank) {
  rates_.forget(rank);
  for (size_t i = 0; i < pages_.size(); ++i) {
    if (pages_[i].first != rank) continue;
    pages_.erase(pages_.begin() + static_cast<long>(i));
    if (i < maps_.size()) maps_.erase(maps_.begin() + static_cast<long>(i));
    return;
  }
}

void HangWatch::start() {
  if (options_.enabled()) arm();
}

void HangWatch::arm() {
  timer_.expires_after(options_.interval);
  timer_.async_wait([this, alive = alive_](const boost::system::error_code& ec) {
    if (ec || !*alive) return;
    check();
    arm();
  });
}

void HangWatch::check() {
  if (pages_.empty()) return;
  if (maps_.size() != pages_.size()) {
    maps_.clear();
    for (std::size_t i = 0; i < pages_.size(); ++i) maps_.push_back(std::make_unique<Mapping>());
  }
  // Why again at each check: a page the agent could not open yet must not stay unwatched.
  for (std::size_t i = 0; i < pages_.size(); ++i) {
    if (maps_[i]->fd < 0)
      maps_[i]->fd = ::open(pages_[i].second.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  }
  std::vector<PageView> views;
  for (size_t i = 0; i < pages_.size(); ++i)
    views.push_back(parse_page(maps_[i]->read(), pages_[i].first));
  latest_ = views;
  latest_ns_ = progress::monotonic_ns();
  for (const auto& v : views) {
    if (v.valid) rates_.add(v.rank, latest_ns_, v.steps, v.collective_wait_ns);
  }
  if (fired_) return;
  if (auto hang = detect_hang(views, latest_ns_, options_, host_)) {
    fired_ = true;
    on_hang_(*hang);
  }
}

}  // namespace accel::supervisor

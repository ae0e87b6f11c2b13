// bench_coordinator: N simulated node agents against a real coordinator process over gRPC.
// Each registers, long-polls Sync as a real agent does (the wait the coordinator tells it, the
// instruction it holds left out of unchanged answers), joins the round it is told to, and counts
// itself when told to RUN. Prints one JSON line: registration time, rendezvous time (submit ->
// every agent told RUN), and the coordinator's CPU use and RSS in a steady state, first at the
// agents' own wait (an agent with no workers' progress to report parks its Sync for the idle
// wait the coordinator offers), then with every agent at 1 Hz (wait 1 s).
//   bench_coordinator --target 127.0.0.1:29400 --token T --agents 1024 --coordinator-pid PID
//                     [--channels N] [--steady-s 5] [--network-timeout-ms 10000]
// --channels: connections the agents share (default: 16, and at least one per 512 agents, since
// a connection carries at most 1024 calls at once and every agent's Sync may be parked); the
// job is submitted on a connection of its own.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "agent/rpc/coordinator_client.h"
#include "agent/rpc/rpc_security.h"

namespace {

namespace pb = accel::v1;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Runs functions at given times on one thread (an agent's timer, for the simulated agents).
class Later {
 public:
  Later() : thread_([this] { run(); }) {}
  void at(Clock::time_point t, std::function<void()> f) {
    {
      std::lock_guard lock(mu_);
      due_.emplace(t, std::move(f));
    }
    cv_.notify_one();
  }

 private:
  void run() {
    std::unique_lock lock(mu_);
    for (;;) {
      if (due_.empty()) {
        cv_.wait(lock);
        continue;
      }
      auto first = due_.begin();
      if (Clock::now() < first->first) {
        cv_.wait_until(lock, first->first);
        continue;
      }
      auto f = std::move(first->second);
      due_.erase(first);
      lock.unlock();
      f();
      lock.lock();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::multimap<Clock::time_point, std::function<void()>> due_;
  std::thread thread_;  // never joined: the program ends with _Exit
};

struct Shared {
  Later later;
  std::vector<std::shared_ptr<accel::rpc::CoordinatorClient>> clients;
  std::atomic<int> registered{0};
  std::atomic<int> running{0};
  std::atomic<int> errors{0};
  std::atomic<int> reregistered{0};  // agents declared lost that registered again
  std::atomic<long> syncs{0};
  std::atomic<bool> stop{false};
  std::atomic<long> wait_ms{0};  // the agents' long-poll wait (0 until a registration tells it)
  std::mutex mu;
  Clock::time_point all_running{};
  std::map<std::string, int> error_kinds;  // under mu: each failed call's status, counted

  void failed(const accel::rpc::CallStatus& st) {
    errors++;
    // Why: messages name their node ("node sim-17 was declared lost"); counted by kind.
    std::string kind;
    bool digits = false;
    for (char c : accel::rpc::describe(st)) {
      if (c >= '0' && c <= '9') {
        if (!digits) kind += 'N';
        digits = true;
      } else {
        kind += c;
        digits = false;
      }
    }
    std::lock_guard lock(mu);
    error_kinds[kind]++;
  }
  // "3 x UNAVAILABLE: ...; 1 x ..." of the failed calls so far.
  std::string error_summary() {
    std::lock_guard lock(mu);
    std::string out;
    for (const auto& [what, n] : error_kinds)
      out += (out.empty() ? "" : "; ") + std::to_string(n) + " x " + what;
    return out;
  }
};

struct SimAgent : std::enable_shared_from_this<SimAgent> {
  Shared* s;
  int index;
  std::string id;
  uint64_t known = 0;
  bool joined = false;
  bool ran = false;
  bool was_registered = false;      // counted once, though it registers again after being lost
  std::minstd_rand rng;             // seeded by start()
  long progress_wait_ms = 0;        // told by the coordinator's last answer
  std::atomic<int> last_action{0};  // the action of the last instruction received
  accel::rpc::CoordinatorClient& client() {
    return *s->clients[static_cast<size_t>(index) % s->clients.size()];
  }

  // As an agent: a free node holds a port for a round's store, and says which (never served
  // here); one that was told RUN has used it.
  [[nodiscard]] int store_port() const { return ran ? 0 : 20000 + index % 40000; }

  void start() {
    rng.seed(static_cast<unsigned>(index) + 1);
    pb::RegisterNodeRequest req;
    req.set_node_id(id);
    req.set_hostname("sim");
    req.set_address("127.0.0.1");
    req.set_machine_rank(-1);
    req.set_probe_port(20000 + index % 40000);  // never probed: the agents are simulated
    req.set_store_port(store_port());
    client().register_node(req, 30s,
                           [self = shared_from_this()](const accel::rpc::CallStatus& st,
                                                       pb::RegisterNodeResponse& resp) {
                             if (!st.ok()) {
                               self->s->failed(st);
                               // As an agent: a node lost once registers until it is back (the
                               // first registrations' failures end the run instead).
                               if (self->was_registered) {
                                 self->s->later.at(Clock::now() + 200ms, [self] { self->start(); });
                               }
                               return;
                             }
                             // As an agent with nothing to report: the idle wait when offered.
                             long told = resp.idle_wait_ms() > 0 ? resp.idle_wait_ms()
                                                                 : resp.sync_wait_ms();
                             long none = 0;
                             self->s->wait_ms.compare_exchange_strong(none, told);
                             if (!self->was_registered) self->s->registered++;
                             self->was_registered = true;
                             self->sync();
                           });
  }

  void sync() {
    if (s->stop) return;
    pb::SyncRequest req;
    req.set_node_id(id);
    req.set_known_version(known);
    // As an agent: without workers the idle wait, running (told RUN) the progress wait, each up
    // to a quarter less so that agents answered together spread out. The 1 Hz phase: 1 s.
    long wait = s->wait_ms;
    if (wait != 1000) {
      if (ran && progress_wait_ms > 0) wait = progress_wait_ms;
      wait -= static_cast<long>(rng() % (wait / 4 + 1));
    }
    req.set_wait_ms(wait);
    req.set_omit_unchanged(known != 0);
    req.set_store_port(store_port());
    client().sync(
        req, std::chrono::milliseconds(req.wait_ms()) + 10s,
        [self = shared_from_this()](const accel::rpc::CallStatus& st, pb::SyncResponse& resp) {
          self->s->syncs++;
          if (!st.ok()) {
            self->s->failed(st);
            if (st.code == accel::rpc::CallCode::kNotFound) {
              // Declared lost: as an agent, register again, holding no instruction or round.
              self->s->reregistered++;
              self->known = 0;
              self->joined = false;
              self->s->later.at(Clock::now() + 100ms, [self] { self->start(); });
              return;
            }
            // Why on the timer: sleeping here would hold one of gRPC's few callback threads, and
            // with it every other agent's answers.
            self->s->later.at(Clock::now() + 100ms, [self] { self->sync(); });
            return;
          }
          if (resp.progress_wait_ms() > 0) self->progress_wait_ms = resp.progress_wait_ms();
          if (resp.unchanged()) {  // still what it holds: nothing to do
            self->sync();
            return;
          }
          self->known = resp.version();
          const auto& ins = resp.instruction();
          self->last_action = ins.action();
          if (ins.action() == pb::Instruction::ACTION_JOIN && !self->joined) {
            self->joined = true;
            pb::JoinRoundRequest j;
            j.set_node_id(self->id);
            j.set_job_id(ins.job_id());
            j.set_round(ins.round());
            // As an agent: the join and the next sync go out together.
            self->client().join_round(
                j, 30s, [self](const accel::rpc::CallStatus& js, pb::JoinRoundResponse&) {
                  if (!js.ok()) self->s->failed(js);
                });
            self->sync();
            return;
          }
          if (ins.action() == pb::Instruction::ACTION_RUN && !self->ran) {
            self->ran = true;
            if (++self->s->running == self->s->registered.load()) {
              std::lock_guard lock(self->s->mu);
              self->s->all_running = Clock::now();
            }
          }
          if (resp.next_sync_within_ms() > 0) {  // as an agent: later, within what it was told
            auto delay = std::chrono::milliseconds(
                self->rng() % static_cast<uint64_t>(resp.next_sync_within_ms() + 1));
            self->s->later.at(Clock::now() + delay, [self] { self->sync(); });
            return;
          }
          self->sync();
        });
  }
};

// utime + stime of `pid` in seconds, and its resident set in KiB.
std::pair<double, long> cpu_and_rss(int pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  std::istringstream in(line.substr(line.rfind(')') + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && in >> field; ++i) {
    if (i == 14 || i == 15) ticks += std::stod(field);
  }
  long rss = 0;
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) rss = std::stol(line.substr(6));
  }
  return {ticks / static_cast<double>(::sysconf(_SC_CLK_TCK)), rss};
}

}  // namespace

int main(int argc, char** argv) {
  accel::rpc::prepare_grpc_process();  // as the agents: the same gRPC settings
  std::string target = "127.0.0.1:29400", token;
  int agents = 64, channels = 0, pid = 0, steady_s = 5;
  // As a default job: network_timeout 10s, so every node is told its peers' probe ports.
  long network_timeout_ms = 10'000;
  auto usage = [] {
    std::fprintf(stderr,
                 "usage: bench_coordinator --target HOST:PORT --token T --agents N "
                 "--coordinator-pid PID [--channels N] [--steady-s S] [--network-timeout-ms MS]\n");
    return 2;
  };
  if (argc % 2 == 0) return usage();  // a flag without its value, or --help
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--target")
      target = v;
    else if (k == "--token")
      token = v;
    else if (k == "--agents")
      agents = std::atoi(v.c_str());
    else if (k == "--channels")
      channels = std::atoi(v.c_str());
    else if (k == "--coordinator-pid")
      pid = std::atoi(v.c_str());
    else if (k == "--steady-s")
      steady_s = std::atoi(v.c_str());
    else if (k == "--network-timeout-ms")
      network_timeout_ms = std::atol(v.c_str());
    else
      return usage();
  }
  if (token.empty() || pid <= 0 || agents <= 0) return usage();
  if (channels <= 0) channels = std::max(16, (agents + 511) / 512);
  Shared s;
  auto launcher = accel::rpc::CoordinatorClient::create(target, token, {});
  if (!launcher) {
    std::fprintf(stderr, "%s\n", launcher.message().c_str());
    std::_Exit(1);
  }
  for (int c = 0; c < channels; ++c) {
    auto client = accel::rpc::CoordinatorClient::create(target, token, {});
    if (!client) {
      std::fprintf(stderr, "%s\n", client.message().c_str());
      std::_Exit(1);
    }
    s.clients.push_back(*client);
  }
  auto [cpu0, rss0] = cpu_and_rss(pid);
  auto t0 = Clock::now();
  std::vector<std::shared_ptr<SimAgent>> sims;
  for (int i = 0; i < agents; ++i) {
    auto a = std::make_shared<SimAgent>();
    a->s = &s;
    a->index = i;
    a->id = "sim-" + std::to_string(i);
    sims.push_back(a);
    a->start();
  }
  while (s.registered + s.errors < agents && Clock::now() - t0 < 60s)
    std::this_thread::sleep_for(5ms);
  auto t_registered = Clock::now();
  if (s.registered != agents) {
    std::fprintf(stderr, "only %d of %d agents registered (%d errors: %s)\n", s.registered.load(),
                 agents, s.errors.load(), s.error_summary().c_str());
    std::_Exit(1);
  }
  auto [cpu1, rss1] = cpu_and_rss(pid);
  pb::SubmitJobRequest req;
  auto* spec = req.mutable_spec();
  spec->add_argv("/bin/true");
  spec->set_processes_per_node(1);
  spec->set_min_nodes(agents);
  spec->set_max_nodes(agents);
  spec->set_join_timeout_ms(60'000);
  spec->set_last_call_ms(0);
  spec->set_stop_timeout_ms(1000);
  spec->set_master_port(29500);
  spec->set_network_timeout_ms(network_timeout_ms);
  pb::SubmitJobResponse resp;
  auto t_submit = Clock::now();
  // As accel-launch: a submit the coordinator did not take (UNAVAILABLE) is sent again.
  grpc::Status st;
  int submits = 0;
  for (; submits < 150; ++submits) {
    st = (*launcher)->submit_job(req, &resp, 10s);
    if (st.error_code() != grpc::StatusCode::UNAVAILABLE) break;
    std::this_thread::sleep_for(200ms);
  }
  if (submits > 0) {
    std::fprintf(stderr, "the submit was sent %d times (UNAVAILABLE before)\n", submits + 1);
  }
  if (!st.ok()) {
    std::fprintf(stderr, "submit: %s\n", accel::rpc::describe(st).c_str());
    std::_Exit(1);
  }
  while (s.running < agents && Clock::now() - t_submit < 60s) std::this_thread::sleep_for(1ms);
  if (s.running != agents) {
    std::map<int, int> by_action;
    for (const auto& a : sims) by_action[a->last_action]++;
    std::string last;
    for (auto [action, n] : by_action)
      last += " " + pb::Instruction::Action_Name(action) + ": " + std::to_string(n);
    std::fprintf(stderr, "only %d of %d agents were told to run (%d errors: %s; last told:%s)\n",
                 s.running.load(), agents, s.errors.load(), s.error_summary().c_str(),
                 last.c_str());
    std::_Exit(1);
  }
  Clock::time_point all;
  {
    std::lock_guard lock(s.mu);
    all = s.all_running;
  }
  auto [cpu2, rss2] = cpu_and_rss(pid);
  // For a profile of the rendezvous alone (perf record -k CLOCK_MONOTONIC, perf report --time).
  auto secs = [](Clock::time_point t) {
    return std::chrono::duration<double>(t.time_since_epoch()).count();
  };
  std::fprintf(stderr, "rendezvous from %.6f to %.6f (CLOCK_MONOTONIC seconds)\n", secs(t_submit),
               secs(all));
  // Steady state at the agents' own wait (the progress wait: they run the job), over two of
  // them (every agent was answered RUN at about the same moment, so their polls come in bursts
  // until the jitter spreads them), then with every agent at 1 Hz (after the longest wait, so
  // every long poll is one of the new rate): the coordinator's CPU (% of a core), the syncs per
  // second and its RSS (KiB).
  const long told_wait_ms = s.wait_ms;
  const long agent_wait_ms =
      sims.front()->progress_wait_ms > 0 ? sims.front()->progress_wait_ms : told_wait_ms;
  auto measure = [&](std::chrono::milliseconds window) {
    auto [cpu_a, rss_a] = cpu_and_rss(pid);
    long syncs_a = s.syncs;
    std::this_thread::sleep_for(window);
    auto [cpu_b, rss_b] = cpu_and_rss(pid);
    double window_s = std::chrono::duration<double>(window).count();
    return std::tuple(100.0 * (cpu_b - cpu_a) / window_s,
                      static_cast<double>(s.syncs - syncs_a) / window_s, std::max(rss_a, rss_b));
  };
  auto [own_pct, own_syncs, own_rss] = measure(std::max<std::chrono::milliseconds>(
      std::chrono::milliseconds(2 * agent_wait_ms) + 1s, std::chrono::seconds(steady_s)));
  s.wait_ms = 1000;
  std::this_thread::sleep_for(std::chrono::milliseconds(told_wait_ms + 200));
  auto [hz_pct, hz_syncs, hz_rss] = measure(std::chrono::seconds(steady_s));
  s.stop = true;
  auto ms = [](auto d) { return std::chrono::duration<double, std::milli>(d).count(); };
  std::printf(
      "{\"agents\": %d, \"register_ms\": %.1f, \"rendezvous_ms\": %.1f, \"register_cpu_s\": %.3f, "
      "\"rendezvous_cpu_s\": %.3f, \"agent_wait_ms\": %ld, \"steady_cpu_pct\": %.1f, "
      "\"steady_syncs_per_s\": %.0f, \"cpu_1hz_pct\": %.1f, \"syncs_1hz_per_s\": %.0f, "
      "\"rss_mb\": %.1f, \"errors\": %d}\n",
      agents, ms(t_registered - t0), ms(all - t_submit), cpu1 - cpu0, cpu2 - cpu1, agent_wait_ms,
      own_pct, own_syncs, hz_pct, hz_syncs, static_cast<double>(std::max(own_rss, hz_rss)) / 1024.0,
      s.errors.load());
  if (s.errors > 0) {
    std::fprintf(stderr, "failed calls: %s; agents declared lost that registered again: %d\n",
                 s.error_summary().c_str(), s.reregistered.load());
  }
  (void)rss0;
  (void)rss1;
  (void)rss2;
  std::fflush(stdout);
  std::_Exit(0);  // Why: thousands of long polls are still parked; no need to unwind them
}

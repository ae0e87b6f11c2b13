// Fuzz target: CoordinatorCore fed a sequence of requests decoded from the input, as a peer that
// holds the token could send them, with time moving between them. Ids come from a small set so
// that requests meet each other's state; every other field is the fuzzer's. The invariant checked
// besides "no crash": what the core keeps stays within the documented bound.
#include <fuzzer/FuzzedDataProvider.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "agent/common/clock.h"
#include "agent/coordinator/coordinator_core.h"
#include "agent/coordinator/request_limits.h"
#include "agent/metrics/exposition.h"

namespace {

using namespace accel::coordinator;

std::string id(FuzzedDataProvider& in, const char* prefix) {
  return std::string(prefix) + std::to_string(in.ConsumeIntegralInRange<int>(0, 3));
}

template <class Message>
bool parse(FuzzedDataProvider& in, Message& m) {
  auto bytes = in.ConsumeRandomLengthString(2048);
  return m.ParseFromString(bytes);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  accel::FakeClock clock;
  CoordinatorOptions options;
  options.coordinator_id = "fuzz";
  options.max_event_bytes_per_job = 1u << 20;
  options.verify_reused_instructions = true;  // a reused instruction that went stale aborts
  options.dead_connection_within = std::chrono::milliseconds(5'000);
  CoordinatorCore core(clock, options);
  std::map<std::string, uint64_t> held;  // the instruction version each node was last sent
  for (int step = 0; step < 64 && in.remaining_bytes() > 0; ++step) {
    switch (in.ConsumeIntegralInRange<int>(0, 10)) {
      case 0: {
        pb::RegisterNodeRequest r;
        if (!parse(in, r)) break;
        r.set_node_id(id(in, "n"));
        pb::RegisterNodeResponse resp;
        core.register_node(r, &resp);
        break;
      }
      case 1: {
        pb::SubmitJobRequest r;
        if (!parse(in, r)) break;
        r.set_job_id(id(in, "j"));
        pb::SubmitJobResponse resp;
        core.submit_job(r, &resp);
        break;
      }
      case 2: {
        pb::JoinRoundRequest r;
        if (!parse(in, r)) break;
        r.set_node_id(id(in, "n"));
        r.set_job_id(id(in, "j"));
        core.join_round(r);
        break;
      }
      case 3: {
        pb::ReportGroupRequest r;
        if (!parse(in, r)) break;
        r.set_node_id(id(in, "n"));
        r.set_job_id(id(in, "j"));
        core.report_group(r);
        break;
      }
      case 4: {
        pb::PushLogsRequest r;
        if (!parse(in, r)) break;
        r.set_node_id(id(in, "n"));
        r.set_job_id(id(in, "j"));
        core.push_logs(r);
        break;
      }
      case 5: {
        pb::SyncRequest r;
        if (!parse(in, r)) break;
        r.set_node_id(id(in, "n"));
        if (in.ConsumeBool()) {  // as an agent: the version it holds, unchanged left out
          r.set_known_version(held[r.node_id()]);
          r.set_omit_unchanged(true);
        }
        pb::SyncResponse resp;
        if (core.sync(r, &resp).is_ok()) held[r.node_id()] = resp.version();
        break;
      }
      case 6: {
        pb::WatchJobRequest r;
        r.set_job_id(id(in, "j"));
        r.set_after_seq(in.ConsumeIntegral<uint64_t>());
        pb::WatchJobResponse resp;
        core.watch_job(r, &resp);
        break;
      }
      case 7: {
        pb::CancelJobRequest r;
        r.set_job_id(id(in, "j"));
        r.set_signal(in.ConsumeIntegral<int32_t>());
        core.cancel_job(r);
        break;
      }
      case 9: {  // a Sync parked or ended (answered, cancelled), in any order
        std::string node = id(in, "n");
        if (in.ConsumeBool()) {
          core.poll_started(node);
        } else {
          core.poll_ended(node);
        }
        break;
      }
      case 8:
        clock.advance(std::chrono::milliseconds(in.ConsumeIntegralInRange<int>(0, 120'000)));
        core.tick();
        break;
      default: {
        pb::GetStatusResponse resp;
        core.get_status(&resp);
        (void)core.take_changes();
        // What operators load: any id, host name or message the fuzzer sent must come out
        // escaped (no markup of its own in the page, no line break inside a sample).
        std::string page = core.status_page(5);
        if (page.find("<script") != std::string::npos || page.find("<img") != std::string::npos)
          __builtin_trap();
        accel::metrics::Exposition metrics;
        core.write_metrics(metrics);
        for (size_t at = 0, end; at < metrics.text().size(); at = end + 1) {
          end = metrics.text().find('\n', at);
          std::string line = metrics.text().substr(at, end - at);
          if (line.empty() || (line[0] != '#' && line.rfind("accel_", 0) != 0)) __builtin_trap();
        }
        break;
      }
    }
  }
  // 4 nodes and 4 jobs at most here: far below the bound per node and per job.
  const size_t per_node =
      2 * limits::kMaxHostBytes + 4 * limits::kMaxIdBytes +
      limits::kMaxProcessesPerNode * (2 * (limits::kMaxProgressBytes + 32) + 112) + 4096 +
      limits::kMaxSpecBytes;
  const size_t per_job = limits::kMaxSpecBytes + options.max_event_bytes_per_job + (64u << 10) +
                         limits::kMaxFailuresPerJob * (3 * limits::kMaxTextBytes + 64 * 1024);
  if (core.stored_bytes() > 4 * per_node + 4 * per_job) __builtin_trap();
  return 0;
}

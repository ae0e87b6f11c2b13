// bench_collectives: the cost of Accelerator::gather and ::reduce against calling c10d's
// ProcessGroupGloo directly, 4 KiB .. 64 MiB of float32, in the same processes. Run under
// accel-launch -n 2; the direct calls have the Accelerator's semantics (reduce leaves its input
// and returns a new tensor: clone + allreduce; gather returns one tensor: allgather + cat). Rank 0
// prints one JSON line per (op, size) with median milliseconds.
//
// `bench_collectives allreduce`: the in-place all-reduce the gradient buckets get (libaccel's
// Comm, sum) of 64 KiB .. 64 MiB float32 in private memory and in a shared block
// (Comm::shared_zeros, where the buckets live), next to each rank running memcpy of the same size
// at the same time. Run it once more with ACCEL_SHM_ALLREDUCE=copy for the unsplit algorithm.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "accel/accel.h"
#include "runtime/comm.h"

namespace {

double median_ms(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int allreduce_bench(accel::Accelerator& acc) {
  auto& comm = acc.state().comm();
  auto sync = [&] { comm.barrier(); };
  for (int64_t bytes : {64L << 10, 1L << 20, 16L << 20, 64L << 20}) {
    const int64_t numel = bytes / 4;
    const int iters = bytes <= (1 << 20) ? 100 : bytes <= (16 << 20) ? 20 : 10;
    auto priv = torch::ones({numel});
    auto shared = comm.shared_zeros({{numel, torch::TensorOptions(torch::kFloat)}},
                                    "the benchmark's buffers")[0];
    shared.fill_(1.0f);
    auto src = torch::ones({numel}), dst = torch::empty({numel});
    dst.fill_(0.0f);
    std::vector<double> t_priv, t_shared, t_copy;
    auto time = [&](std::vector<double>& into, auto&& fn) {
      for (int i = 0; i < iters + 2; ++i) {
        sync();
        auto start = std::chrono::steady_clock::now();
        fn();
        auto ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                .count();
        if (i >= 2) into.push_back(ms);
      }
    };
    // Why fill between calls is not needed: sums of ones grow but stay exact well past 2^20.
    time(t_priv, [&] { comm.allreduce(priv, c10d::ReduceOp::SUM); });
    time(t_shared, [&] { comm.allreduce(shared, c10d::ReduceOp::SUM); });
    time(t_copy, [&] { std::memcpy(dst.data_ptr(), src.data_ptr(), static_cast<size_t>(bytes)); });
    time(t_shared, [&] { comm.allreduce(shared, c10d::ReduceOp::SUM); });
    time(t_priv, [&] { comm.allreduce(priv, c10d::ReduceOp::SUM); });
    if (acc.process_index() == 0) {
      std::printf(
          "{\"op\": \"allreduce\", \"bytes\": %lld, \"private_ms\": %.3f, \"shared_ms\": %.3f, "
          "\"memcpy_ms\": %.3f}\n",
          static_cast<long long>(bytes), median_ms(t_priv), median_ms(t_shared), median_ms(t_copy));
      std::fflush(stdout);
    }
  }
  comm.barrier();
  return 0;
}

int main(int argc, char** argv) {
  accel::Accelerator acc;
  if (argc > 1 && std::string(argv[1]) == "allreduce") {
    if (acc.num_processes() < 2) {
      std::fprintf(stderr, "bench_collectives: run it with accel-launch -n 2\n");
      return 2;
    }
    return allreduce_bench(acc);
  }
  if (argc > 1) {
    std::fprintf(stderr, "bench_collectives: unknown mode %s (expected: allreduce)\n", argv[1]);
    return 2;
  }
  const int n = acc.num_processes(), rank = acc.process_index();
  if (n < 2) {
    std::fprintf(stderr, "bench_collectives: run it with accel-launch -n 2\n");
    return 2;
  }
  // A second, plain gloo group on the job's store: what a user calling c10d directly gets.
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(std::atoi(std::getenv("MASTER_PORT")));
  so.isServer = false;
  auto store = c10::make_intrusive<c10d::TCPStore>(std::getenv("MASTER_ADDR"), so);
  auto opts = c10d::ProcessGroupGloo::Options::create();
  opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(
      c10::make_intrusive<c10d::PrefixStore>("bench/direct", store), rank, n, opts);
  auto sync = [&] { gloo->barrier()->wait(); };

  for (int64_t bytes : {4L << 10, 64L << 10, 1L << 20, 16L << 20, 64L << 20}) {
    const int64_t numel = bytes / 4;
    const int iters = bytes <= (1 << 20) ? 60 : bytes <= (16 << 20) ? 12 : 6;
    auto t = torch::randn({numel});
    std::vector<double> direct_gather, accel_gather, direct_reduce, accel_reduce;
    // Each path runs its own loop and synchronizes through its own group before every call.
    auto time = [&](std::vector<double>& into, auto&& barrier, auto&& fn) {
      for (int i = 0; i < iters + 2; ++i) {
        barrier();
        auto start = std::chrono::steady_clock::now();
        fn();
        into.push_back(
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                .count());
      }
    };
    auto accel_sync = [&] { acc.wait_for_everyone(); };
    auto gather_direct = [&] {
      std::vector<std::vector<at::Tensor>> outs(1);
      for (int r = 0; r < n; ++r) outs[0].push_back(torch::empty({numel}));
      std::vector<at::Tensor> ins{t};
      gloo->allgather(outs, ins)->wait();
      auto all = torch::cat(outs[0]);
    };
    auto gather_accel = [&] { auto all = acc.gather(t); };
    // Same semantics as Accelerator::reduce: the input stays, the sum is a new tensor.
    auto reduce_direct = [&] {
      std::vector<at::Tensor> ts{t.clone()};
      gloo->allreduce(ts)->wait();
    };
    auto reduce_accel = [&] { auto sum = acc.reduce(t); };
    // A-B-B-A: whichever path runs first after the other was measured to pay more for waking
    // gloo's threads (up to ~2 ms on a small call); this order gives both the same share.
    time(direct_gather, sync, gather_direct);
    time(accel_gather, accel_sync, gather_accel);
    time(accel_gather, accel_sync, gather_accel);
    time(direct_gather, sync, gather_direct);
    time(direct_reduce, sync, reduce_direct);
    time(accel_reduce, accel_sync, reduce_accel);
    time(accel_reduce, accel_sync, reduce_accel);
    time(direct_reduce, sync, reduce_direct);
    // The first two calls of each loop are warm-up.
    auto drop_warmup = [&](const std::vector<double>& v) {
      std::vector<double> out;
      for (std::size_t i = 0; i < v.size(); ++i)
        if (i % static_cast<std::size_t>(iters + 2) >= 2) out.push_back(v[i]);
      return out;
    };
    if (rank == 0) {
      std::printf("{\"op\": \"gather\", \"bytes\": %lld, \"c10d_ms\": %.3f, \"accel_ms\": %.3f}\n",
                  static_cast<long long>(bytes), median_ms(drop_warmup(direct_gather)),
                  median_ms(drop_warmup(accel_gather)));
      std::printf("{\"op\": \"reduce\", \"bytes\": %lld, \"c10d_ms\": %.3f, \"accel_ms\": %.3f}\n",
                  static_cast<long long>(bytes), median_ms(drop_warmup(direct_reduce)),
                  median_ms(drop_warmup(accel_reduce)));
      std::fflush(stdout);
    }
  }
  acc.wait_for_everyone();
  return 0;
}

// accel::State: the worker environment and the process group built from it.
#include "accel/state.h"

#include <torch/cuda.h>
#include <torch/version.h>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef ACCEL_WITH_NCCL
#include <c10/cuda/CUDAFunctions.h>

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "accel/error.h"
#include "contract/worker_contract.h"
#include "runtime/backend_choice.h"
#include "runtime/comm.h"
#include "runtime/env.h"
#include "runtime/error_file.h"
#include "runtime/log.h"

namespace accel {
namespace {

std::mutex g_state_mu;                // guards g_state
std::weak_ptr<State> g_state;         // the process's State while any Accelerator holds it
std::optional<StateOptions> g_first;  // options of the first creation, to detect disagreement

// The ranks' (machine, local rank, ranks on the machine, shared memory allowed), gathered through
// `group`: a hierarchy needs every machine to have the same number of ranks, numbered machine by
// machine, and every rank to allow shared memory. Every rank gets the same answer (from the same
// data); every rank of a multi-machine CPU job calls it.
// `shm`: this rank may use shared memory (ACCEL_SHM_COLLECTIVES); every rank must.
bool regular_layout(CollectiveGroup& group, int world, int node, int local_rank, int local_world,
                    bool shm) {
  auto mine = torch::tensor(
      {int64_t{node}, int64_t{local_rank}, int64_t{local_world}, int64_t{shm ? 1 : 0}});
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < world; ++r) outputs[0].push_back(torch::empty({4}, torch::kLong));
  std::vector<at::Tensor> inputs{mine};
  group.allgather(outputs, inputs)->wait();
  const int64_t per_node = local_world;
  if (per_node < 2 || world % per_node != 0) return false;
  for (int r = 0; r < world; ++r) {
    auto* v = outputs[0][static_cast<std::size_t>(r)].data_ptr<int64_t>();
    if (v[0] != r / per_node || v[1] != r % per_node || v[2] != per_node || v[3] != 1) return false;
  }
  return true;
}

std::shared_ptr<::gloo::transport::Device> gloo_device(bool single_node) {
  if (const auto& ifname = env::worker_env().gloo_socket_ifname) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(*ifname);
  }
  // Why: all ranks on one machine talk over loopback; hostname resolution may point elsewhere.
  if (single_node) return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

// "accel: rank 2 could not connect to the other 3 rank(s) after 1.5 s (collective_timeout 40s):
// <gloo's error>" and, across machines, what to set when gloo took an address the others cannot
// reach. Why the time taken: gloo's own message names the whole timeout, even for a connection
// refused at once.
std::string connect_failure(const std::string& whom, std::chrono::steady_clock::time_point start,
                            std::chrono::milliseconds timeout, bool several_machines,
                            const char* what) {
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  char after[32];
  std::snprintf(after, sizeof after, "%.1f s", took);
  std::string out = "could not connect to " + whom + " after " + after + " (collective_timeout " +
                    format_duration(timeout) + "): " + what;
  if (several_machines) {
    const auto& ifname = env::worker_env().gloo_socket_ifname;
    out += ifname ? "\nhint: gloo used interface " + *ifname +
                        " (GLOO_SOCKET_IFNAME); check that the other machines reach this one "
                        "there"
                  : "\nhint: gloo chose its interface from the host name (often 127.0.1.1 in "
                    "/etc/hosts, which no other machine reaches); set GLOO_SOCKET_IFNAME to the "
                    "interface the other machines reach (accel-launch sets it on every node)";
  }
  return out;
}

// Why: PyTorch 2.x's ProcessGroupNCCL expects destroy_process_group() (its shutdown()) before
// it is destroyed, and warns otherwise; libtorch 1.x has no shutdown(). (A template, so that a
// libtorch without it compiles the empty branch.)
template <class Group>
std::function<void()> shutdown_of(const c10::intrusive_ptr<Group>& group) {
  if constexpr (requires { group->shutdown(); }) {
    return [group] { group->shutdown(); };
  } else {
    return {};
  }
}

}  // namespace

std::string to_string(DistributedType type) {
  switch (type) {
    case DistributedType::kNo:
      return "NO";
    case DistributedType::kMultiCpu:
      return "MULTI_CPU";
    case DistributedType::kMultiGpu:
      return "MULTI_GPU";
  }
  return "?";
}

std::shared_ptr<State> State::shared(const StateOptions& options) {
  std::lock_guard lock(g_state_mu);
  if (auto existing = g_state.lock()) {
    if ((options.cpu && options.cpu != g_first->cpu) ||
        (options.collective_timeout && options.collective_timeout != g_first->collective_timeout)) {
      throw ConfigError(
          "accel: a second Accelerator asked for different cpu/collective_timeout options than the "
          "first; "
          "all Accelerators of a process share one process group");
    }
    return existing;
  }
  auto state = std::make_shared<State>(options);
  g_state = state;
  g_first = options;
  return state;
}

State::State(const StateOptions& options) {
  install_error_handlers();
  const env::WorkerEnv& we = env::worker_env();
  world_size_ = we.world_size;
  rank_ = we.rank;
  local_world_size_ = we.local_world_size;
  local_rank_ = we.local_rank;
  node_rank_ = we.group_rank;
  debug_ = we.debug;
  cpu_ = options.cpu.value_or(we.use_cpu);
  timeout_ = options.collective_timeout.value_or(we.collective_timeout);

  // Why: this build of libtorch decides the device; a CUDA build with a GPU and no --cpu uses it.
  bool cuda = !cpu_ && torch::cuda::is_available();
  const int gpus = cuda ? static_cast<int>(torch::cuda::device_count()) : 0;
  device_ = cuda ? torch::Device(torch::kCUDA,
                                 static_cast<c10::DeviceIndex>(local_rank_ % std::max(1, gpus)))
                 : torch::Device(torch::kCPU);
  if (world_size_ == 1 && !we.group_of_one) {
    comm_ = std::make_unique<Comm>();
    return;
  }
  distributed_ = true;
  if (world_size_ > 1) type_ = cuda ? DistributedType::kMultiGpu : DistributedType::kMultiCpu;

  const auto& addr = we.master_addr;
  const int port = we.master_port.value_or(-1);
  if ((!addr || port < 0) && world_size_ > 1) {
    throw ConfigError(
        "accel: WORLD_SIZE=" + std::to_string(world_size_) +
        " but MASTER_ADDR/MASTER_PORT are not set; start workers with accel-launch, or set both");
  }
  // TORCHELASTIC_USE_AGENT_STORE=True (accel-launch, accel-agent, torchrun): the launcher serves
  // the store and every rank is a client, under a prefix per attempt (as c10d's env:// does), so
  // nothing a failed attempt left can reach this one. Otherwise rank 0 hosts it; a lone process
  // with ACCEL_GROUP_OF_ONE and no address keeps it in memory.
  const bool agent_store = we.agent_store && addr && port >= 0;
  c10::intrusive_ptr<c10d::Store> store;
  if (!addr || port < 0) {
    store = c10::make_intrusive<c10d::HashStore>();
  } else {
    c10d::TCPStoreOptions store_opts;
    store_opts.port = static_cast<std::uint16_t>(port);
    store_opts.isServer = !agent_store && rank_ == 0;
    store_opts.numWorkers = static_cast<std::size_t>(world_size_);
    store_opts.waitWorkers = false;
    store_opts.timeout = timeout_;
    try {
      store = c10::make_intrusive<c10d::TCPStore>(*addr, store_opts);
    } catch (const std::exception& e) {
      throw CollectiveError("accel: rank " + std::to_string(rank_) + " could not " +
                            (store_opts.isServer ? "start" : "reach") + " the job's store at " +
                            *addr + ":" + std::to_string(port) +
                            (agent_store ? " (served by the launcher)" : "") + " within " +
                            format_duration(timeout_) + ": " + e.what());
    }
  }
  if (agent_store) {
    store = c10::make_intrusive<c10d::PrefixStore>(contract::kRuntimeStorePrefix + we.restart_count,
                                                   store);
  }
  // Why every rank votes before any group exists: a choice made from one machine's view could mix
  // NCCL and gloo ranks (a hang in the first collective), and what cannot work must be refused
  // on every rank alike.
  detail::BackendTally tally;
  try {
    tally = detail::tally_backend_votes(
        *store, world_size_,
        {.cuda = cuda,
         .gpu = cuda ? detail::gpu_identity(device_.index()) : std::string(),
         .asked = we.backend},
        timeout_);
  } catch (const std::exception& e) {
    throw CollectiveError("accel: rank " + std::to_string(rank_) +
                          ": not every rank reported its device and ACCEL_BACKEND within " +
                          format_duration(timeout_) +
                          " (a rank did not start, or stopped): " + e.what());
  }
  const auto choice = detail::choose_backend(
      tally, cpu_ ? "--cpu / ACCEL_USE_CPU is set" : "no CUDA device is visible to this libtorch");
  const bool nccl = choice.nccl;
#ifndef ACCEL_WITH_NCCL
  if (nccl) {
    throw ConfigError(
        "accel: this libaccel was built without NCCL support, but a GPU is visible; run with --cpu "
        "(ACCEL_USE_CPU=1), set ACCEL_BACKEND=gloo, or rebuild against a CUDA libtorch");
  }
#endif
  if (!choice.note.empty() && rank_ == 0) log::info(choice.note);
  c10::intrusive_ptr<CollectiveGroup> group;
  const auto connect_start = std::chrono::steady_clock::now();
  const bool several_machines = local_world_size_ != world_size_;
  try {
    auto pg_store = c10::make_intrusive<c10d::PrefixStore>("accel/pg", store);
#ifdef ACCEL_WITH_NCCL
    // Compiled only against a CUDA libtorch (CMake: CAFFE2_USE_CUDA); gradients and collectives of
    // CUDA tensors go through NCCL, with the same single timeout.
    if (nccl) {
      c10::cuda::set_device(static_cast<c10::DeviceIndex>(device_.index()));
#if TORCH_VERSION_MAJOR < 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 2)
      // The launcher sets only the name PyTorch 2.2 reads; older releases read the old one.
      if (const char* on = std::getenv(contract::kNcclAsyncErrorHandling))
        ::setenv(contract::kNcclAsyncErrorHandlingOld, on, /*overwrite=*/0);
#endif
      auto nccl_opts = c10d::ProcessGroupNCCL::Options::create();
      nccl_opts->timeout = timeout_;
      auto nccl_group =
          c10::make_intrusive<c10d::ProcessGroupNCCL>(pg_store, rank_, world_size_, nccl_opts);
      shutdown_ = shutdown_of(nccl_group);
      group = nccl_group;
      backend_ = "nccl";
    }
#endif
    if (!group) {
      auto gloo_opts = c10d::ProcessGroupGloo::Options::create(timeout_);
      gloo_opts->devices.push_back(gloo_device(local_world_size_ == world_size_));
      group = c10::make_intrusive<c10d::ProcessGroupGloo>(pg_store, rank_, world_size_, gloo_opts);
      backend_ = "gloo";
    }
  } catch (const std::exception& e) {
    throw CollectiveError(
        "accel: rank " + std::to_string(rank_) + " " +
        connect_failure("the other " + std::to_string(world_size_ - 1) + " rank(s)", connect_start,
                        timeout_, several_machines, e.what()));
  }
  std::unique_ptr<ShmGroup> shm;
  std::unique_ptr<Hierarchy> hierarchy;
  // Shared memory between the ranks of one machine; on several machines, shared memory within
  // each and gloo between one leader per machine; gloo alone otherwise.
  // Not with NCCL: its group takes CUDA tensors only, and NCCL has its own intra-node transport.
  if (!cuda && world_size_ > 1 && local_world_size_ == world_size_ && we.shm_collectives) {
    std::string why;
    shm = ShmGroup::create(*store, *group, rank_, world_size_, timeout_, &why);
    if (!shm && rank_ == 0)
      log::info("shared-memory collectives are off (" + why + "); using gloo");
  } else if (!cuda && local_world_size_ != world_size_ &&
             regular_layout(*group, world_size_, node_rank_, local_rank_, local_world_size_,
                            we.shm_collectives)) {
    std::string why;
    // Why the global group: create() agrees on the outcome with an all-reduce, and every machine
    // must fall back together, or the collectives would take different paths.
    auto node_store =
        c10::make_intrusive<c10d::PrefixStore>("accel/node" + std::to_string(node_rank_), store);
    auto node_shm =
        ShmGroup::create(*node_store, *group, local_rank_, local_world_size_, timeout_, &why);
    if (node_shm) {
      hierarchy = std::make_unique<Hierarchy>();
      hierarchy->node = node_rank_;
      hierarchy->nodes = world_size_ / local_world_size_;
      hierarchy->local_rank = local_rank_;
      hierarchy->local_world = local_world_size_;
      hierarchy->shm = std::move(node_shm);
      if (local_rank_ == 0) {
        try {
          auto leaders_opts = c10d::ProcessGroupGloo::Options::create(timeout_);
          leaders_opts->devices.push_back(gloo_device(false));
          hierarchy->leaders = c10::make_intrusive<c10d::ProcessGroupGloo>(
              c10::make_intrusive<c10d::PrefixStore>("accel/pg-leaders", store), node_rank_,
              hierarchy->nodes, leaders_opts);
        } catch (const std::exception& e) {
          throw CollectiveError("accel: rank " + std::to_string(rank_) + " " +
                                connect_failure("the other machines' leaders", connect_start,
                                                timeout_, true, e.what()));
        }
      }
    } else if (rank_ == 0) {
      log::info("shared-memory collectives are off (" + why + "); using gloo");
    }
  }
  if (shm) backend_ = "shared memory";
  if (hierarchy) backend_ = "shared memory + gloo";
  log::debug("rank " + std::to_string(rank_) + " of " + std::to_string(world_size_) +
             ": process group up (store " +
             (addr && port >= 0 ? *addr + ":" + std::to_string(port) : std::string("in memory")) +
             (agent_store ? " served by the launcher, attempt " + we.restart_count : "") + ", " +
             (shm         ? "shared-memory collectives"
              : hierarchy ? "hierarchical collectives: shared memory within each of " +
                                std::to_string(world_size_ / local_world_size_) +
                                " machines, gloo between their leaders"
                          : backend_) +
             ")");
  comm_ = std::make_unique<Comm>(rank_, world_size_, timeout_, store, group, std::move(shm),
                                 std::move(hierarchy));
}

State::~State() {
  if (shutdown_) {
    try {
      shutdown_();
    } catch (const std::exception& e) {
      log::warning(std::string("the process group did not shut down cleanly: ") + e.what());
    }
  }
}

}  // namespace accel

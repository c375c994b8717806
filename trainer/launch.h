// Processes: spawning local ranks (fork/exec of this binary with the torchrun
// variables set), stop requests from SIGINT/SIGTERM, and the thin layer over
// fusetrain::dist the training loop talks to (a world of one needs no group).
#pragma once

#include "models.h"

#include <fusetrain/dist/comm_hooks.h>
#include <fusetrain/dist/ddp.h>
#include <fusetrain/dist/process_group.h>
#include <fusetrain/dist/shared_memory.h>

#include <ATen/ATen.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace fusetrain::trainer {

/// This host's part of a run: `nproc` ranks here, on host `node_rank` of
/// `nnodes`. Host 0's launcher hosts the rendezvous store on
/// master_addr:master_port (bound to that address only; port 0: one the
/// kernel picks, which only a single host can use).
struct LaunchSpec {
  int nproc = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
};

/// Runs this executable with `args` (argv without argv[0]) as this host's
/// ranks of `spec`, with torchrun's variables set (RANK = node_rank x nproc +
/// LOCAL_RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
/// MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE), all in one new
/// process group that dies with this process. When a rank fails the others
/// are killed at once and its exit code is returned; Ctrl-C is forwarded to
/// the ranks (they save a checkpoint and stop), a second Ctrl-C kills them.
int spawn_local_ranks(const std::vector<std::string>& args, const LaunchSpec& spec);

/// SIGINT and SIGTERM set the stop flag instead of killing the process; a
/// second SIGINT exits at once.
void install_stop_handlers();
bool stop_requested();

/// CPUs this process may run on (its affinity mask).
int available_cores();

/// How many of those CPUs other work keeps busy: their busy share over
/// `window` from /proc/stat, summed (this process sleeps meanwhile); -1 where
/// it cannot be read.
double busy_cores(std::chrono::milliseconds window);
/// The warning for `ranks` processes of `threads` intra-op threads each on a
/// machine where `busy` of the cores are taken by other work ("" when they
/// fit): a busy machine runs fewer threads faster (two threads on a busy
/// 2-core box ran 3.8x slower than one), so it names --threads.
std::string thread_load_warning(int threads, int ranks, double busy);
/// The environment variable through which the launcher passes busy_cores,
/// measured before it starts the ranks, to them.
inline constexpr const char* kBusyCoresEnv = "FUSETRAIN_BUSY_CORES";

/// The data-parallel world of this process.
class Distributed {
 public:
  /// A world of one: every collective is a no-op.
  Distributed();
  /// Joins the group of `env` (gloo on CPU, NCCL on CUDA) with `timeout` on
  /// the rendezvous and on every collective; `shared_memory`: CPU ranks on
  /// one host allreduce through shared memory (Note [Shared-memory allreduce]).
  Distributed(const dist::Environment& env, c10::DeviceType device_type,
              std::chrono::milliseconds timeout, bool shared_memory = true);
  // Out of line: c10d::ProcessGroup is complete only in launch.cpp.
  ~Distributed();
  Distributed(const Distributed&) = delete;
  Distributed& operator=(const Distributed&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int local_rank() const { return local_rank_; }
  bool is_distributed() const { return world_size_ > 1; }
  /// The group's CPU allreduces go through shared memory.
  bool shared_memory() const { return shared_memory_; }
  const c10::intrusive_ptr<c10d::ProcessGroup>& group() const { return group_; }

  /// In place, across ranks.
  void allreduce_sum_(const at::Tensor& t) const;
  void allreduce_max_(const at::Tensor& t) const;
  /// Overwrites `tensors` with rank 0's values.
  void broadcast_(const std::vector<at::Tensor>& tensors) const;
  void barrier() const;
  /// Every rank's `text`, in rank order.
  std::vector<std::string> allgather_text(const std::string& text) const;
  /// Rank 0's `text` on every rank.
  std::string broadcast_text(const std::string& text) const;

  /// Each rank's address for gloo (as allgather_text learnt it in
  /// learn_peer_addresses), to name the ranks behind a failed connection.
  void learn_peer_addresses();
  /// `what` (an exception's message) with the lost peer named when it shows
  /// one of the peers' addresses, and what the failure means.
  std::string explain_failure(const std::string& what) const;

 private:
  int rank_ = 0;
  int world_size_ = 1;
  int local_rank_ = 0;
  std::chrono::milliseconds timeout_{0};
  /// Where the group's collectives take their tensors (NCCL: this rank's GPU).
  at::Device device_{at::kCPU};
  bool shared_memory_ = false;
  std::string own_address_;
  std::vector<std::string> peer_addresses_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
};

/// The model as the training step sees it: DistributedDataParallel when the
/// world has several ranks, the plain model otherwise.
class ParallelModel {
 public:
  /// `comm_hook`: a name comm_hook_from_name knows ("none": DDP's allreduce).
  ParallelModel(Model model, const Distributed& world, dist::DDPOptions options,
                const std::string& comm_hook = "none", int64_t powersgd_rank = 1,
                int64_t powersgd_start_iter = 1000);
  ~ParallelModel();
  at::Tensor forward(const at::Tensor& x);
  /// The training loss (ModelImpl::forward(x, targets, label_smoothing)),
  /// through DDP's forward when there is one.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& targets, double label_smoothing);
  /// While the returned guard lives, backward only accumulates local
  /// gradients (gradient accumulation); null for a world of one.
  std::shared_ptr<void> no_sync();
  /// While the returned guard lives, the current stream is DDP's side stream
  /// (Note [DDP and CUDA graphs] in fusetrain/dist/ddp.h), ordered after the
  /// work queued before on the caller's stream, which in turn waits for it
  /// when the guard ends. Null without DDP on a device.
  std::shared_ptr<void> on_ddp_stream();
  /// DDP's reducer (null for a world of one).
  dist::Reducer* reducer() const;

 private:
  Model model_;
  std::unique_ptr<dist::DistributedDataParallel<Model>> ddp_;
};

}  // namespace fusetrain::trainer

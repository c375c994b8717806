// Synchronous data parallelism for LibTorch and Python: DistributedDataParallel
// over any c10d process group (gloo on CPUs, NCCL on GPUs).
//
// Note [Bucketed gradient reduction]
// Parameters are grouped into buckets (about 1 MB first, then bucket_cap_mb,
// in reverse parameter order: roughly the order autograd produces gradients).
// A post-hook on each parameter's gradient accumulator copies the gradient
// into its bucket, divided by the world size in the same pass (cast to
// comm_dtype when set). When a bucket's last gradient arrives its allreduce
// starts, overlapping the rest of the backward pass; buckets are launched
// strictly in index order on every rank, so all ranks issue the same
// collective sequence. A callback queued on the autograd engine waits for the
// buckets at the end of backward and writes the averaged gradients back to
// param.grad (or makes param.grad a view of the bucket with
// gradient_as_bucket_view). With a GradScaler the allreduce carries any
// inf/NaN to every rank, so all ranks skip the same steps with no extra
// collective.
//
// Reverse parameter order is only a guess at the order gradients arrive in
// (a module registered before it is used, a tied or shared weight, a branch
// taken late all break it, and a bucket then waits for its slowest member).
// So, as torch's reducer does, the first synchronised backward records the
// order the gradients actually became ready in, rank 0's order is broadcast,
// and the buckets are rebuilt once in that order with the same caps (not with
// find_unused_parameters, whose order changes between iterations).
//
// Note [DDP and CUDA graphs]
// Autograd runs each node on the stream that was current when the node was
// made; for a parameter's AccumulateGrad node (which also runs the reducer's
// hooks) that is when the reducer first asks for it. Made while the legacy
// default stream is current, the accumulators and hooks would run on it
// during a capture, and CUDA refuses work on the legacy stream while another
// stream captures. So the reducer makes the accumulators of device
// parameters while a side stream of its own is current (torch's recipe:
// construct DDP inside a side-stream context). Eager steps on any stream stay
// correct (autograd orders the streams with events); running warm-up,
// capture and replay under `Reducer::stream()` saves those cross-stream
// waits. An accumulator that already existed (a backward ran before DDP was
// constructed) keeps its stream; the reducer warns when that is the legacy
// default stream.
//
// Note [Aligned bucket offsets]
// Each parameter starts at a multiple of kBucketAlignmentBytes into its flat
// bucket (compute_bucket_offsets; the buckets are allocated aligned), so the
// views the optimizers step through (param.grad with gradient_as_bucket_view,
// ZeRO's gradient pieces, parameters_as_bucket_view) are 16-byte aligned
// wherever the parameters' own storage would be: the fused CUDA optimizers
// take their vector loads only when every array of a chunk is. The gaps
// between parameters (fewer than 16 bytes each: at most 3 float32, 7
// bfloat16 elements) are zeroed wherever the reducer or ZeRO allocates a
// bucket, and no gradient, parameter or shard view covers them: the
// allreduce adds zeros there, and the gradients, norms, clipping and updates
// are those of the unpadded layout. The bucket
// caps still count the parameters' own bytes (the assignment is unchanged:
// a bucket passes its cap by at most the padding), and a communication hook
// gets the padded buffer, with each parameter's offset in GradBucket. The
// alignment is in the parameters' dtype: a comm_dtype buffer of smaller
// elements is aligned to less, but its slots are copied, never viewed.
//
// Note [Communication hooks]
// A hook decides how a bucket is reduced, with torch's contract
// (c10d::CommHookInterface, torch.distributed's register_comm_hook): when a
// bucket is ready its hook gets a c10d::GradBucket over the bucket's flat
// buffer, which then holds the rank's local gradients, not divided by the
// world size (the hook averages), and returns a future of the reduced flat
// tensor. Buckets are handed to the hook strictly in index order on every
// rank, as allreduces are without one; the end of backward waits for the
// futures in order and writes the results back to the gradients. A Python
// hook (c10d::PythonCommHook) takes the GIL only while it runs.
// A hook may chain collectives from its futures' callbacks (torch's PowerSGD
// issues three per bucket, the later ones from gloo's threads): bucket k + 1
// goes to the hook only once bucket k's future is done, so every rank issues
// the same collectives in the same order. (torch's DDP does not wait, and
// PowerSGD over gloo with several buckets fails there with a collective
// mismatch.) On NCCL a future is done once its kernels are queued, so this
// costs little; on gloo it trades the overlap of a bucket's reduction with
// the rest of backward for the order. Hooks of one collective per bucket
// (CommHook::issues_one_collective: fusetrain's allreduce and compression
// hooks) skip the wait.
//
// Note [Uneven inputs]
// A rank that runs out of data before the others "joins" (torch's Join
// protocol, torch.distributed.algorithms.join): until every rank has joined
// it repeats the collectives a synchronised backward issues, with zero
// gradients (shadow_synchronized_backward), so the ranks still training
// never wait for it. Their gradients are divided by the initial world size
// (the joined ranks add zeros) or, with divide_by_initial_world_size=False,
// by the ranks still training (set_divide_factor).
#pragma once

#include <fusetrain/dist/process_group.h>

#include <ATen/ATen.h>
#include <c10/core/Stream.h>
#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/nn/module.h>
#include <torch/ordered_dict.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fusetrain::dist {

struct DDPOptions {
  /// Size of every bucket after the first, in MiB.
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// Size of the first bucket (the last gradients of backward), in MiB.
  TORCH_ARG(double, first_bucket_cap_mb) = 1.0;
  /// Broadcast buffers (e.g. batch-norm statistics) from rank 0 at
  /// construction and in every forward; off, each rank keeps its own.
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// Tolerate parameters that get no gradient in an iteration (their gradient
  /// is reduced as zeros). Without it such a parameter is an error naming it.
  TORCH_ARG(bool, find_unused_parameters) = false;
  /// param.grad becomes a view into its bucket (saves a copy and memory),
  /// 16-byte aligned (Note [Aligned bucket offsets]).
  TORCH_ARG(bool, gradient_as_bucket_view) = false;
  /// Communicate in this dtype (e.g. bfloat16): compressed allreduce.
  TORCH_ARG(std::optional<at::ScalarType>, comm_dtype) = std::nullopt;
  /// Gradients are divided by this before the allreduce and by
  /// world_size / factor after it (fp16 overflow headroom, as apex). The
  /// default 1 divides by world_size before, as torch's DDP does.
  TORCH_ARG(double, gradient_predivide_factor) = 1.0;
  /// ZeRO stage 2 (Note [Sharded optimizer state] in zero.h): each bucket is
  /// reduce-scattered instead of allreduced, so every rank keeps only its
  /// piece of the averaged gradients (Reducer::grad_pieces()); param.grad is
  /// empty after a synchronised backward and the full buckets live only
  /// while they fill and their reduce-scatter runs (at most two of them
  /// awaiting theirs: the oldest is awaited when a third starts). The
  /// buckets keep their first layout
  /// (no rebuild in the ready order). For a ZeroRedundancyOptimizer over
  /// the same parameters and group; not with a communication hook.
  TORCH_ARG(bool, shard_gradients) = false;
};

/// Buckets as lists of parameter indices: parameters in `order` (empty:
/// reverse order), a new bucket when adding one would pass the cap (first
/// bucket: first_cap_bytes) or when the dtype or device changes. Pure;
/// unit-tested.
std::vector<std::vector<size_t>> compute_bucket_assignment(const std::vector<at::Tensor>& params,
                                                           size_t first_cap_bytes,
                                                           size_t cap_bytes,
                                                           const std::vector<size_t>& order = {});

/// Note [Aligned bucket offsets]: every parameter's offset in its bucket is a
/// multiple of this many bytes.
inline constexpr int64_t kBucketAlignmentBytes = 16;

/// Note [Aligned bucket offsets]: the element offsets of parameters of
/// `numels` elements (each `element_size` bytes) laid out in this order in
/// one flat bucket, each rounded up to a multiple of kBucketAlignmentBytes;
/// one entry more than `numels`, the end of the last parameter (the bucket's
/// numel). Pure; unit-tested; the one layout DDP's buckets and ZeRO's shards
/// (zero.h's ShardLayout) share.
std::vector<int64_t> compute_bucket_offsets(const std::vector<int64_t>& numels,
                                            int64_t element_size);

/// Checks that every rank has the same number of parameters with the same
/// shapes; raises on every rank, naming the first mismatch, instead of hanging.
void verify_param_shapes(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                         const std::vector<at::Tensor>& params,
                         const std::vector<std::string>& names);

/// Overwrites `tensors` with rank `root`'s values (coalesced broadcasts).
void broadcast_from(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                    const std::vector<at::Tensor>& tensors, int root);

/// broadcast_from(group, tensors, 0).
void broadcast_from_rank0(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                          const std::vector<at::Tensor>& tensors);

/// The gradient synchroniser of Note [Bucketed gradient reduction]; the
/// engine under both the C++ and the Python DistributedDataParallel.
class Reducer {
 public:
  Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
          c10::intrusive_ptr<c10d::ProcessGroup> group, DDPOptions options);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  /// Arms the hooks for the next backward. `outputs` are the forward's
  /// outputs; with find_unused_parameters the graph from them is searched
  /// for the parameters that will get no gradient.
  void prepare_for_backward(const std::vector<at::Tensor>& outputs);

  /// Off: backward only accumulates local gradients (no_sync).
  void set_require_sync(bool require);
  bool require_sync() const;

  /// Reduces every bucket through `hook` from now on (Note [Communication
  /// hooks]). Once per reducer, before the first prepare_for_backward, and
  /// not with comm_dtype (a compression hook of its own).
  void register_comm_hook(std::shared_ptr<c10d::CommHookInterface> hook);
  bool has_comm_hook() const;

  /// Divide the gradients by `factor` (> 0) instead of the world size in the
  /// synchronised backward passes that follow (Note [Uneven inputs]:
  /// averaging over the ranks still training). Without a hook only; 0 goes
  /// back to the world size.
  void set_divide_factor(double factor);

  /// On a rank that has joined (Note [Uneven inputs]): the collectives of
  /// one synchronised backward with zero gradients, in the same order: every
  /// bucket (through the hook when one is registered), the unused-parameter
  /// allreduce with find_unused_parameters, and the bucket-order broadcast
  /// if the buckets have not been rebuilt yet. Leaves the gradients alone.
  void shadow_synchronized_backward();

  /// The bucket layout (parameter indices per bucket), for tests and tools:
  /// reverse parameter order until the first synchronised backward, the
  /// order gradients became ready in after it.
  std::vector<std::vector<size_t>> bucket_indices() const;

  /// Seconds the last synchronised backward spent, after its last bucket
  /// was ready, waiting for allreduces: the communication not hidden behind
  /// the backward pass (the overlap benchmark compares it with the time of
  /// the same allreduces alone). CPU parameters (gloo): host time around the
  /// waits. Device parameters (NCCL, whose wait only makes a stream wait):
  /// device time between two events, the last bucket ready and the waits
  /// done; the call waits for the second one. NaN when the last backward was
  /// captured in a CUDA graph (nothing is timed there) or has not run.
  double last_exposed_comm_seconds() const;

  /// With shard_gradients: this rank's piece of every bucket's averaged
  /// gradients after the last synchronised backward (one flat tensor per
  /// bucket, in the parameters' dtype; the layout is zero.h's ShardLayout
  /// over bucket_indices()). Empty without shard_gradients.
  std::vector<at::Tensor> grad_pieces() const;
  bool shard_gradients() const;
  /// With shard_gradients, per parameter: whether the pieces hold a
  /// gradient for it (false for one no rank used, with
  /// find_unused_parameters, as p.grad would stay None).
  std::vector<bool> has_gradient() const;
  /// Synchronised backward passes add into the pieces (as autograd into
  /// p.grad) until this clears them: the next one overwrites.
  /// ZeroRedundancyOptimizer calls it after its step and in zero_grad.
  void zero_grad_pieces();
  /// The parameters, in the order bucket_indices() refers to.
  const std::vector<at::Tensor>& parameters() const;
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const;

  /// The side stream the gradient accumulators and this reducer's hooks run
  /// on, for device parameters (Note [DDP and CUDA graphs]); nullopt for CPU
  /// parameters.
  std::optional<c10::Stream> stream() const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

/// Options of DistributedDataParallel::join (torch's names and defaults).
struct JoinOptions {
  /// Average over the initial world size (the joined ranks add zeros); off,
  /// over the ranks still training.
  TORCH_ARG(bool, divide_by_initial_world_size) = true;
  /// Once any rank runs out of data every rank throws (at its next forward,
  /// or in finish()) instead of training on.
  TORCH_ARG(bool, throw_on_early_termination) = false;
};

/// Note [Uneven inputs] in C++ (the Python face uses torch's Join): while a
/// JoinContext lives, each training forward starts with one allreduce of
/// [which ranks train (one-hot), whether they synchronise this backward,
/// whether one asks all to stop]; finish() on a rank out of data answers
/// those with zeros, shadowing buffer broadcasts and backward collectives,
/// until no rank trains; then every rank takes the model of the last one to
/// finish. Made by DistributedDataParallel::join(). The handshake is read on
/// the host (one small allreduce and a sync per training forward while the
/// context lives): join mode is for the ragged end of an epoch, not for
/// steps captured in a CUDA graph.
class JoinContext {
 public:
  /// `on_close` runs when the context is destroyed (the DDP forgets it).
  JoinContext(Reducer& reducer, c10::intrusive_ptr<c10d::ProcessGroup> group,
              std::vector<at::Tensor> params, std::vector<at::Tensor> buffers, JoinOptions options,
              std::function<void()> on_close = {});
  /// finish() unless it ran or an exception is unwinding (with
  /// throw_on_early_termination call finish() yourself: a destructor cannot
  /// throw); an error here is a warning.
  ~JoinContext();
  JoinContext(const JoinContext&) = delete;
  JoinContext& operator=(const JoinContext&) = delete;

  /// A training rank's handshake before its forward (DistributedDataParallel
  /// calls it); broadcasts `buffers` from the highest training rank when
  /// given. Throws on every rank once one asked to stop.
  void before_forward(bool require_sync, const std::vector<at::Tensor>& buffers);

  /// This rank is out of data: shadow the others until all are, then share
  /// the last finisher's parameters and buffers. Idempotent.
  void finish();

 private:
  at::Tensor handshake(bool training, bool require_sync, bool stop);

  Reducer& reducer_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::vector<at::Tensor> params_, buffers_;
  JoinOptions options_;
  std::function<void()> on_close_;
  bool finished_ = false;
};

/// DistributedDataParallel for a torch::nn module holder (e.g. a TORCH_MODULE
/// type or std::shared_ptr<M>):
///
///   auto group = fusetrain::dist::init_process_group(*Environment::from_env());
///   fusetrain::dist::DistributedDataParallel<Net> ddp(net, group);
///   auto loss = criterion(ddp.forward(x), y);
///   loss.backward();   // gradients averaged across ranks when it returns
///
/// At construction parameter shapes are checked across ranks and parameters
/// and buffers broadcast from rank 0.
template <typename ModuleHolder>
class DistributedDataParallel {
 public:
  DistributedDataParallel(ModuleHolder module, c10::intrusive_ptr<c10d::ProcessGroup> group,
                          DDPOptions options = {})
      : module_(std::move(module)), group_(std::move(group)), options_(options) {
    std::vector<at::Tensor> params;
    std::vector<std::string> names;
    for (const auto& item : module_->named_parameters()) {
      if (!item.value().requires_grad()) continue;
      names.push_back(item.key());
      params.push_back(item.value());
    }
    verify_param_shapes(group_, params, names);
    std::vector<at::Tensor> state = params;
    // Buffers only with broadcast_buffers, as torch's DDP.
    if (options_.broadcast_buffers()) {
      for (const auto& b : module_->buffers()) state.push_back(b);
    }
    broadcast_from_rank0(group_, state);
    reducer_ = std::make_unique<Reducer>(params, names, group_, options_);
  }

  template <typename... Args>
  auto forward(Args&&... args) {
    const std::vector<at::Tensor> buffers =
        options_.broadcast_buffers() ? module_->buffers() : std::vector<at::Tensor>{};
    if (join_ != nullptr && at::GradMode::is_enabled()) {
      join_->before_forward(reducer_->require_sync(), buffers);  // broadcasts the buffers
    } else if (!buffers.empty()) {
      broadcast_from_rank0(group_, buffers);
    }
    auto output = module_->forward(std::forward<Args>(args)...);
    if (at::GradMode::is_enabled()) reducer_->prepare_for_backward(tensors_of(output));
    return output;
  }

  /// Gradient accumulation: within the guard's scope backward only
  /// accumulates local gradients; the first backward after it synchronises.
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(Reducer& reducer) : reducer_(reducer), prev_(reducer.require_sync()) {
      reducer_.set_require_sync(false);
    }
    ~NoSyncGuard() { reducer_.set_require_sync(prev_); }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    Reducer& reducer_;
    bool prev_;
  };
  [[nodiscard]] std::unique_ptr<NoSyncGuard> no_sync() {
    return std::make_unique<NoSyncGuard>(*reducer_);
  }

  /// Uneven inputs (Note [Uneven inputs], torch's DDP.join()):
  ///
  ///   {
  ///     auto join = ddp.join();
  ///     for (auto& batch : this_ranks_batches) { /* forward, backward, step */ }
  ///     join->finish();   // shadows the others until every rank is done
  ///   }
  ///
  /// The returned context must not outlive this object.
  [[nodiscard]] std::unique_ptr<JoinContext> join(JoinOptions options = {}) {
    TORCH_CHECK(join_ == nullptr, "DistributedDataParallel: join() is already active");
    std::vector<at::Tensor> params;
    for (const auto& p : module_->parameters()) {
      if (p.requires_grad()) params.push_back(p);
    }
    auto context = std::make_unique<JoinContext>(
        *reducer_, group_, params,
        options_.broadcast_buffers() ? module_->buffers() : std::vector<at::Tensor>{}, options,
        [this] { join_ = nullptr; });
    join_ = context.get();
    return context;
  }

  ModuleHolder& module() { return module_; }
  Reducer& reducer() { return *reducer_; }
  /// Reduces the buckets through `hook` (Note [Communication hooks]; e.g.
  /// fusetrain::dist::powersgd_hook), once, before the first forward.
  void register_comm_hook(std::shared_ptr<c10d::CommHookInterface> hook) {
    reducer_->register_comm_hook(std::move(hook));
  }
  /// Reducer::stream(): run warm-up, capture and replay of fused steps under
  /// it (c10::StreamGuard) to save cross-stream waits.
  std::optional<c10::Stream> stream() const { return reducer_->stream(); }

  /// The wrapped module's parameters and buffers under a "module." prefix,
  /// as torch's DistributedDataParallel names them.
  torch::OrderedDict<std::string, at::Tensor> state_dict() const {
    torch::OrderedDict<std::string, at::Tensor> out;
    for (const auto& p : module_->named_parameters()) out.insert("module." + p.key(), p.value());
    for (const auto& b : module_->named_buffers()) out.insert("module." + b.key(), b.value());
    return out;
  }

 private:
  static std::vector<at::Tensor> tensors_of(const at::Tensor& t) { return {t}; }
  static std::vector<at::Tensor> tensors_of(const std::vector<at::Tensor>& ts) { return ts; }
  template <typename... T>
  static std::vector<at::Tensor> tensors_of(const std::tuple<T...>& tuple) {
    std::vector<at::Tensor> out;
    std::apply([&](const auto&... x) { (append(out, x), ...); }, tuple);
    return out;
  }
  static void append(std::vector<at::Tensor>& out, const at::Tensor& t) { out.push_back(t); }
  template <typename T>
  static void append(std::vector<at::Tensor>&, const T&) {}

  ModuleHolder module_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  DDPOptions options_;
  std::unique_ptr<Reducer> reducer_;
  JoinContext* join_ = nullptr;  // the live join() context, if any
};

}  // namespace fusetrain::dist

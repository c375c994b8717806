// Communication hooks in C++ (Note [Communication hooks] in ddp.h): how
// DistributedDataParallel reduces a bucket of gradients, for LibTorch users
// and the trainer, with the semantics of torch's Python hooks
// (torch.distributed.algorithms.ddp_comm_hooks):
//
//   auto ddp = fusetrain::dist::DistributedDataParallel<Net>(net, group);
//   ddp.register_comm_hook(fusetrain::dist::powersgd_hook(
//       group, fusetrain::dist::PowerSGDOptions().matrix_approximation_rank(2)));
//
// Each hook receives the bucket's local (not yet averaged) gradients and
// returns a future of their average over the group.
#pragma once

#include <ATen/ATen.h>
#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <cstdint>
#include <memory>
#include <string>

namespace fusetrain::dist {

/// A hook: torch's c10d::CommHookInterface (runHook(GradBucket&) returns a
/// future of the reduced flat bucket), plus a name for logs and configs.
class CommHook : public c10d::CommHookInterface {
 public:
  /// The future's value: a tensor, or the first of a list of tensors (what a
  /// collective's future holds).
  at::Tensor parseHookResult(const c10::IValue& result) override;
  virtual std::string name() const = 0;
  /// One collective per bucket, issued in runHook: the reducer need not wait
  /// for a bucket's future before the next bucket (Note [Communication
  /// hooks]).
  virtual bool issues_one_collective() const { return false; }
};

/// Sums the bucket with an allreduce and divides by the group's size: what
/// DDP does without a hook (torch's allreduce_hook).
std::shared_ptr<CommHook> allreduce_hook(c10::intrusive_ptr<c10d::ProcessGroup> group);

/// Casts the bucket to `dtype` (float16 or bfloat16), divides by the group's
/// size, allreduces, and the result is cast back into the bucket: half the
/// bytes of float32 (torch's fp16_compress_hook / bf16_compress_hook).
std::shared_ptr<CommHook> compress_hook(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                        at::ScalarType dtype);

/// torch's PowerSGDState arguments (same names and defaults).
struct PowerSGDOptions {
  /// Rank r of the low-rank factors P (n x r) and Q (m x r) of each
  /// compressed n x m gradient matrix.
  TORCH_ARG(int64_t, matrix_approximation_rank) = 1;
  /// Plain allreduce (averaging) for the first iterations: a model moves too
  /// fast early on for a low-rank approximation (and DDP rebuilds its buckets
  /// after the first one). Must be > 1 with error feedback or warm start.
  TORCH_ARG(int64_t, start_powerSGD_iter) = 1000;
  /// Compress a matrix only when n * m > min_compression_rate * (n + m) * r.
  TORCH_ARG(double, min_compression_rate) = 2.0;
  /// Add the previous step's compression error to the gradients.
  TORCH_ARG(bool, use_error_feedback) = true;
  /// Start each step's power iteration from the previous step's Q.
  TORCH_ARG(bool, warm_start) = true;
  /// Added to the norms in Gram-Schmidt (0: plain normalisation).
  TORCH_ARG(double, orthogonalization_epsilon) = 0.0;
  /// Seeds the random initial Qs, as torch's state does through numpy's
  /// RandomState(random_seed): the same Qs as torch's hook.
  TORCH_ARG(int64_t, random_seed) = 0;
  /// Compress same-shape matrices of a bucket as one batch.
  TORCH_ARG(bool, batch_tensors_with_same_shape) = false;
};

/// PowerSGD (Vogels et al., 2019), torch's powerSGD_hook: per bucket, the
/// matrices worth compressing are replaced by P Q^T from one power iteration
/// (allreduce P, orthogonalise, Q = M^T P, allreduce Q), the rest are
/// averaged with one allreduce. Equal to torch's hook on the same buckets.
/// Its collectives run in the calling thread, in order (no overlap of a
/// bucket's three allreduces with the rest of backward).
std::shared_ptr<CommHook> powersgd_hook(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                        PowerSGDOptions options = {});

/// The hook a config names: "none" (null: DDP's own allreduce), "allreduce",
/// "fp16", "bf16" or "powersgd" (rank `powersgd_rank`); an error names the
/// choices otherwise.
std::shared_ptr<CommHook> comm_hook_from_name(const std::string& name,
                                              c10::intrusive_ptr<c10d::ProcessGroup> group,
                                              int64_t powersgd_rank = 1,
                                              int64_t start_powersgd_iter = 1000);

}  // namespace fusetrain::dist

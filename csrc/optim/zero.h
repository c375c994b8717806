// ZeroRedundancyOptimizer for LibTorch: ZeRO stage 1 (optimizer state
// sharded across the data-parallel ranks) over FusedAdamW or FusedSGD, and
// stage 2 with a DistributedDataParallel whose reducer shards the gradients
// (DDPOptions::shard_gradients). Note [Sharded optimizer state] in
// dist/zero.h has the layout.
//
//   fusetrain::dist::DistributedDataParallel<Net> ddp(net, group);
//   auto opt = fusetrain::optim::ZeroRedundancyOptimizer::adamw(
//       net->parameters(), FusedAdamWOptions(1e-3), group);
//   ... loss.backward(); scaler.step(*opt); scaler.update();
#pragma once

#include <fusetrain/dist/zero.h>
#include <fusetrain/optim/fused.h>

#include <functional>
#include <memory>

namespace fusetrain::dist {
class Reducer;
}  // namespace fusetrain::dist

namespace fusetrain::optim {

struct ZeroOptions {
  /// Each parameter's storage moves into one flat buffer per bucket, so the
  /// all-gather writes the parameters in place (torch's argument).
  TORCH_ARG(bool, parameters_as_bucket_view) = false;
  /// Stage 1's bucket size, in MiB (stage 2 takes the reducer's buckets).
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// Clip the global gradient L2 norm (computed from every rank's shard:
  /// one allreduce) in the step: the shards are unscaled and multiplied by
  /// the clip coefficient, as GradScaler::unscale_ and a clip of the whole
  /// gradients would; 0: off.
  TORCH_ARG(double, max_grad_norm) = 0.0;
};

class ZeroRedundancyOptimizer : public FusedOptimizer {
 public:
  /// Makes the local optimizer over this rank's slices (one group per given
  /// group, its options kept).
  using LocalFactory = std::function<std::unique_ptr<FusedOptimizer>(
      std::vector<torch::optim::OptimizerParamGroup>)>;

  /// Stage 1 (reducer == nullptr) or stage 2 over `reducer`, which must be
  /// made with shard_gradients over exactly these parameters and `group`.
  /// Collective: every rank constructs it (a rank that disagrees on the
  /// stage is an error on every rank).
  ZeroRedundancyOptimizer(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                          std::unique_ptr<torch::optim::OptimizerOptions> defaults,
                          LocalFactory make_local, c10::intrusive_ptr<c10d::ProcessGroup> group,
                          ZeroOptions options = {}, dist::Reducer* reducer = nullptr);

  /// Over FusedAdamW / FusedSGD with `defaults` for every group.
  static std::unique_ptr<ZeroRedundancyOptimizer> adamw(
      std::vector<torch::optim::OptimizerParamGroup> param_groups, FusedAdamWOptions defaults,
      c10::intrusive_ptr<c10d::ProcessGroup> group, ZeroOptions options = {},
      dist::Reducer* reducer = nullptr);
  static std::unique_ptr<ZeroRedundancyOptimizer> sgd(
      std::vector<torch::optim::OptimizerParamGroup> param_groups, FusedSGDOptions defaults,
      c10::intrusive_ptr<c10d::ProcessGroup> group, ZeroOptions options = {},
      dist::Reducer* reducer = nullptr);

  /// The local optimizer's step over this rank's slices (the groups'
  /// options, e.g. lr, carried over first), then one all-gather per bucket.
  /// Collective.
  at::Tensor step(LossClosure closure = nullptr) override;
  void set_amp_scaling(std::optional<at::Tensor> grad_scale,
                       std::optional<at::Tensor> found_inf) override;
  void set_lr_tensor(std::optional<at::Tensor> lr) override;
  /// Stage 2: the gradient slices and one element that is inf when any
  /// rank's slices overflowed (one small allreduce). Stage 1: nullopt.
  std::optional<std::vector<at::Tensor>> amp_gradients() override;

  /// Fills state() with the unsharded per-parameter states (the states of
  /// FusedAdamW / FusedSGD over the whole parameters, as their checkpoints
  /// hold them) on rank `to`, or on every rank when to < 0. Collective.
  void consolidate_state(int to = -1);
  /// Replaces this rank's local state with its slices of the unsharded
  /// states in state() (from any world size), then clears state().
  void shard_state();

  FusedOptimizer& local() { return *local_; }
  const dist::ShardedParameters& shards() const { return *shards_; }
  /// Bytes of this rank's optimizer state tensors (per-rank accounting).
  int64_t local_state_bytes() const;
  /// The global gradient norm of the latest step with max_grad_norm.
  const at::Tensor& last_grad_norm() const { return last_grad_norm_; }

  /// Refused (the state is spread over the ranks): checkpoint with
  /// consolidate_state() and the local FusedAdamW/FusedSGD state format, as
  /// fusetrain's trainer does.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  std::vector<at::Tensor> grad_slices() const;
  void sync_options();
  bool is_adamw() const;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  ZeroOptions options_;
  dist::Reducer* reducer_;
  std::unique_ptr<dist::ShardedParameters> shards_;
  std::vector<at::Tensor> all_params_;  // param_groups order
  std::vector<size_t> layout_index_;    // all_params_ index -> shards_ params index
  std::vector<size_t> slice_group_;     // per slice: its group
  std::vector<size_t> local_groups_;    // local group k serves param group local_groups_[k]
  std::unique_ptr<FusedOptimizer> local_;
  std::optional<at::Tensor> grad_scale_, found_inf_;
  at::Tensor last_grad_norm_;
};

}  // namespace fusetrain::optim

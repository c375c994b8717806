// Fused optimizers for LibTorch: FusedAdamW (Adam with decoupled_weight_decay
// false) and FusedSGD as torch::optim::Optimizer subclasses, options in the
// style of torch::optim::AdamWOptions. One multi-tensor launch per device and
// dtype per step; optional fp32 master weights; driven by amp::GradScaler
// without host syncs (they are AmpScalingOptimizers).
#pragma once

#include <fusetrain/amp/grad_scaler.h>

#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <optional>
#include <tuple>
#include <vector>

namespace fusetrain::optim {

/// What FusedAdamW and FusedSGD share: the device-side scalars their kernels
/// read (the loss scale and overflow flag from amp::GradScaler, and an
/// optional learning-rate tensor).
class FusedOptimizer : public torch::optim::Optimizer, public amp::AmpScalingOptimizer {
 public:
  /// Each group keeps the options it was given (a group without any gets the
  /// defaults), on every supported torch (compat::add_param_group).
  FusedOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                 std::unique_ptr<torch::optim::OptimizerOptions> defaults);
  FusedOptimizer(std::vector<at::Tensor> params,
                 std::unique_ptr<torch::optim::OptimizerOptions> defaults);
  /// torch::optim::Optimizer::add_param_group, keeping the group's options.
  void add_param_group(const torch::optim::OptimizerParamGroup& param_group);

  void set_amp_scaling(std::optional<at::Tensor> grad_scale,
                       std::optional<at::Tensor> found_inf) override;
  /// Reads the learning rate from `lr` (one float64 or float32 element; moved
  /// to each group's device) at every step instead of the groups' `lr`
  /// options, so a captured CUDA graph follows values written into it between
  /// replays (see fusetrain::graph::FusedSteps). Applies to every group;
  /// std::nullopt goes back to the options.
  virtual void set_lr_tensor(std::optional<at::Tensor> lr);

 protected:
  /// The scalars of a launch on `device`, moved there if they live elsewhere.
  struct DeviceScalars {
    std::optional<at::Tensor> grad_scale, found_inf, lr;
  };
  DeviceScalars scalars_on(const at::Device& device) const;

 private:
  std::optional<at::Tensor> grad_scale_;
  std::optional<at::Tensor> found_inf_;
  std::optional<at::Tensor> lr_tensor_;
};

struct FusedAdamWOptions : public torch::optim::OptimizerCloneableOptions<FusedAdamWOptions> {
  FusedAdamWOptions(double lr = 1e-3);  // NOLINT: implicit, as torch's options
  TORCH_ARG(double, lr) = 1e-3;
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 1e-2;
  TORCH_ARG(bool, amsgrad) = false;
  TORCH_ARG(bool, maximize) = false;
  /// AdamW (true) or Adam with L2 weight decay (false).
  TORCH_ARG(bool, decoupled_weight_decay) = true;
  /// 16-bit parameters get fp32 master copies; moments are fp32.
  TORCH_ARG(bool, master_weights) = false;

 public:  // TORCH_ARG leaves the section private
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double value) override { lr(value); }
};

struct FusedAdamWParamState
    : public torch::optim::OptimizerCloneableParamState<FusedAdamWParamState> {
  /// One-element float32 on the parameter's device (read by the kernels).
  TORCH_ARG(at::Tensor, step);
  TORCH_ARG(at::Tensor, exp_avg);
  TORCH_ARG(at::Tensor, exp_avg_sq);
  TORCH_ARG(at::Tensor, max_exp_avg_sq);
  TORCH_ARG(at::Tensor, master_param);

 public:  // TORCH_ARG leaves the section private
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

class FusedAdamW : public FusedOptimizer {
 public:
  explicit FusedAdamW(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                      FusedAdamWOptions defaults = {});
  explicit FusedAdamW(std::vector<at::Tensor> params, FusedAdamWOptions defaults = {})
      : FusedAdamW({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

  /// One fused launch per (device, dtype) group. Returns the closure's loss.
  at::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
};

struct FusedSGDOptions : public torch::optim::OptimizerCloneableOptions<FusedSGDOptions> {
  FusedSGDOptions(double lr);  // NOLINT: implicit, as torch's SGDOptions
  TORCH_ARG(double, lr);
  TORCH_ARG(double, momentum) = 0;
  TORCH_ARG(double, dampening) = 0;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, nesterov) = false;
  TORCH_ARG(bool, maximize) = false;
  TORCH_ARG(bool, master_weights) = false;

 public:  // TORCH_ARG leaves the section private
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double value) override { lr(value); }
};

struct FusedSGDParamState
    : public torch::optim::OptimizerCloneableParamState<FusedSGDParamState> {
  TORCH_ARG(at::Tensor, momentum_buffer);
  TORCH_ARG(at::Tensor, master_param);

 public:  // TORCH_ARG leaves the section private
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

/// SGD with momentum as torch.optim.SGD: the first step starts each momentum
/// buffer from the gradient. One difference: when that first step is skipped
/// for an overflow (found_inf, on the device), the buffer stays zero and the
/// next step blends the gradient into it, which differs from torch only with
/// dampening != 0.
class FusedSGD : public FusedOptimizer {
 public:
  explicit FusedSGD(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                    FusedSGDOptions defaults);
  explicit FusedSGD(std::vector<at::Tensor> params, FusedSGDOptions defaults)
      : FusedSGD({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

  at::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
};

}  // namespace fusetrain::optim

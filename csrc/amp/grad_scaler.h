// Dynamic loss scaling for mixed-precision training: fusetrain's GradScaler,
// with torch.amp.GradScaler's semantics and state dict, on CPU and CUDA, for
// fp32, fp16 and bf16 gradients, without host syncs for optimizers that take
// the scale and the overflow flag as tensors.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/ordered_dict.h>

#include <limits>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fusetrain::amp {

/// Where an optimizer is in the current iteration (torch's OptState).
enum class OptState { kReady, kUnscaled, kStepped };

/// Constructor arguments of GradScaler, named and defaulted as torch's.
struct GradScalerOptions {
  TORCH_ARG(double, init_scale) = 65536.0;
  TORCH_ARG(double, growth_factor) = 2.0;
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 2000;
  TORCH_ARG(bool, enabled) = true;
  /// Growth never takes the scale above this (apex caps at 2^24). Off: inf.
  TORCH_ARG(double, max_scale) = std::numeric_limits<double>::infinity();
  /// Overflows tolerated before backing off (DeepSpeed's hysteresis); each one
  /// still skips its step. Off: 0, back off on every overflow as torch does.
  TORCH_ARG(int64_t, hysteresis) = 0;
};

/// An optimizer that unscales inside its step and skips it when found_inf is
/// set, both read on the device (torch's `_step_supports_amp_scaling`). The
/// scaler hands it the tensors right before step() and clears them after.
class AmpScalingOptimizer {
 public:
  virtual ~AmpScalingOptimizer() = default;
  /// grad_scale: the scale to divide gradients by (nullopt: already unscaled);
  /// found_inf: a one-element float32 tensor, non-zero to skip. Both nullopt to clear.
  virtual void set_amp_scaling(std::optional<at::Tensor> grad_scale,
                               std::optional<at::Tensor> found_inf) = 0;
  /// The gradients the scaler checks and unscales, when they are not the
  /// param groups' p.grad (a ZeroRedundancyOptimizer whose gradients are
  /// sharded); nullopt: the param groups'.
  virtual std::optional<std::vector<at::Tensor>> amp_gradients() { return std::nullopt; }
};

/// The loss scaler. A typical iteration:
///
///   scaler.scale(loss).backward();
///   scaler.step(optimizer);   // unscales, skips the step on inf/NaN
///   scaler.update();          // grows or backs off the scale, on the device
///
/// Per optimizer it follows torch's stage machine (READY -> UNSCALED ->
/// STEPPED, reset by update()) and raises torch's errors for misuse.
class GradScaler {
 public:
  /// Identifies an optimizer across calls within one iteration.
  using OptimizerKey = uintptr_t;

  /// `device_type` is where the scale lives: any device that holds data (CPU
  /// and CUDA run fusetrain's kernels, other backends the device-generic
  /// ops); Meta is an error. A CUDA scaler on a machine without CUDA warns
  /// and disables itself, as torch's does.
  explicit GradScaler(c10::DeviceType device_type = c10::DeviceType::CUDA,
                      GradScalerOptions options = {});

  /// outputs * scale. The first call creates the scale on outputs' device.
  at::Tensor scale(const at::Tensor& outputs);
  std::vector<at::Tensor> scale(const std::vector<at::Tensor>& outputs);

  /// Divides the optimizer's gradients by the scale in place and records
  /// whether any held inf/NaN; at most once per optimizer per iteration.
  void unscale_(torch::optim::Optimizer& optimizer);

  /// Steps the optimizer unless this iteration's gradients held inf/NaN.
  /// AmpScalingOptimizers get the scale and flag as tensors (no host sync);
  /// others are unscaled here and the flag is read on the host, as torch does.
  /// Returns the optimizer's step() result (undefined when skipped).
  at::Tensor step(torch::optim::Optimizer& optimizer);

  /// Updates the scale from this iteration's overflow flags (on the device),
  /// or sets it to `new_scale`. Resets every optimizer to READY.
  void update();
  void update(double new_scale);
  void update(const at::Tensor& new_scale);

  /// The current scale (a host sync), init_scale before the first scale(),
  /// 1.0 when disabled.
  double get_scale() const;
  double get_growth_factor() const { return options_.growth_factor(); }
  void set_growth_factor(double v);
  double get_backoff_factor() const { return options_.backoff_factor(); }
  void set_backoff_factor(double v);
  int64_t get_growth_interval() const { return options_.growth_interval(); }
  void set_growth_interval(int64_t v);
  double get_max_scale() const { return options_.max_scale(); }
  int64_t get_hysteresis() const { return options_.hysteresis(); }
  bool is_enabled() const { return options_.enabled(); }
  c10::DeviceType device_type() const { return device_type_; }

  /// The scale tensor; undefined before the first scale().
  const at::Tensor& scale_tensor() const { return scale_; }

  /// Overflow flag (one-element float32 on the scale's device, non-zero on
  /// overflow) of the latest step() or update(); undefined before either.
  const at::Tensor& found_inf() const { return last_found_inf_; }
  /// Whether the latest step() was skipped. Reads found_inf (a host sync).
  bool step_was_skipped() const;
  /// Indices of `grads` that hold inf or NaN (one host sync). For debugging
  /// which layer overflowed: call after step() and before zero_grad().
  static std::vector<int64_t> non_finite_indices(const std::vector<at::Tensor>& grads);
  /// Names of the parameters whose gradients hold inf or NaN (see above).
  static std::vector<std::string> overflow_report(
      const torch::OrderedDict<std::string, at::Tensor>& named_parameters);

  /// torch's keys: scale, growth_factor, backoff_factor, growth_interval,
  /// _growth_tracker; plus max_scale / hysteresis and _overflow_tracker when
  /// those options are on. Empty when disabled.
  c10::impl::GenericDict state_dict() const;
  /// Accepts a state dict of torch's scaler or ours; raises on an empty one.
  void load_state_dict(const c10::impl::GenericDict& state);
  /// Writes state_dict() to `path` atomically, readable by Python's torch.load.
  void save(const std::string& path) const;
  /// Loads a file written by save() or by torch.save(scaler.state_dict()).
  void load(const std::string& path);

  // The per-optimizer steps that step() and unscale_() are made of; the
  // Python face drives them with id(optimizer) and the optimizer's gradients
  // (undefined entries for parameters without one, keeping the indices).

  /// unscale_() on an explicit gradient list.
  void unscale_grads_(OptimizerKey key, const std::vector<at::Tensor>& grads);
  /// Checks and readies a step: returns {grad_scale, found_inf} to hand the
  /// optimizer when `optimizer_takes_scale`, else unscales first and returns
  /// {nullopt, found_inf} for the caller to read.
  std::pair<std::optional<at::Tensor>, at::Tensor> prepare_step(
      OptimizerKey key, const std::vector<at::Tensor>& grads, bool optimizer_takes_scale);
  /// Marks the optimizer's step as taken (its stage becomes STEPPED).
  void mark_stepped(OptimizerKey key);
  OptState stage(OptimizerKey key) const;
  /// True between the first unscale_()/step() of an iteration and update().
  bool in_iteration() const { return !per_optimizer_.empty(); }

 private:
  struct PerOptimizer {
    OptState stage = OptState::kReady;
    std::vector<std::pair<c10::Device, at::Tensor>> found_inf_per_device;
  };

  void check_initialized(const char* fn) const;
  void record_inf_checks(PerOptimizer& state, const std::vector<at::Tensor>& grads,
                         const at::Tensor& inv_scale);
  at::Tensor combined_found_inf(const PerOptimizer& state) const;

  c10::DeviceType device_type_;
  GradScalerOptions options_;
  // Values used when the tensors are created (set by load_state_dict before).
  double init_scale_;
  int64_t init_growth_tracker_ = 0;
  int64_t init_overflow_tracker_ = 0;
  at::Tensor scale_;             // 0-d float32
  at::Tensor growth_tracker_;    // 0-d int32
  at::Tensor overflow_tracker_;  // 0-d int32
  at::Tensor last_found_inf_;
  std::unordered_map<OptimizerKey, PerOptimizer> per_optimizer_;
};

/// The gradients of an optimizer's parameters in param-group order, with
/// undefined tensors for parameters that have none.
std::vector<at::Tensor> optimizer_grads(torch::optim::Optimizer& optimizer);

}  // namespace fusetrain::amp

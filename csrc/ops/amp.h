// C++ entry points of the mixed-precision ops. They call through the
// dispatcher, so one call serves CPU and CUDA tensors alike.
#pragma once

#include <ATen/ATen.h>

#include <limits>

namespace fusetrain::ops {

/// In place: tensors *= inv_scale (skipped when inv_scale == 1); found_inf := 1
/// if any element was inf or NaN. All tensors, found_inf and inv_scale (both
/// one-element float32) on one device; the caller zeroes found_inf. No host sync.
void non_finite_check_and_unscale_(at::TensorList tensors, at::Tensor& found_inf,
                                   const at::Tensor& inv_scale);

/// Hyper-parameters of the dynamic loss-scale update.
struct ScaleUpdateOptions {
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  /// Growth never takes the scale above this.
  double max_scale = std::numeric_limits<double>::infinity();
  /// Overflows tolerated (steps skipped, scale kept) before backing off.
  int64_t hysteresis = 0;
};

/// In place, on the device (no host sync):
/// - found_inf != 0: overflow_tracker += 1; once it exceeds `hysteresis` the scale
///   is multiplied by backoff_factor and overflow_tracker reset; growth_tracker := 0.
/// - otherwise growth_tracker += 1; when it reaches growth_interval the scale is
///   multiplied by growth_factor (capped at max_scale, kept only if finite) and
///   both trackers reset.
at::Tensor& update_scale_(at::Tensor& scale, at::Tensor& growth_tracker,
                          at::Tensor& overflow_tracker, const at::Tensor& found_inf,
                          const ScaleUpdateOptions& options);

/// Validates update_scale_'s arguments (shared by the CPU and CUDA versions).
void check_update_scale_args(const at::Tensor& scale, const at::Tensor& growth_tracker,
                             const at::Tensor& overflow_tracker, const at::Tensor& found_inf,
                             double growth_factor, double backoff_factor, int64_t growth_interval,
                             double max_scale, int64_t hysteresis);

/// Validates non_finite_check_and_unscale_'s arguments.
void check_unscale_args(at::TensorList tensors, const at::Tensor& found_inf,
                        const at::Tensor& inv_scale);

}  // namespace fusetrain::ops

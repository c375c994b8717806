// Launchers of the fused optimizer and norm CUDA kernels. Pure CUDA: raw
// pointers, sizes, scalars and a stream; no ATen. Each returns the launch's
// error code. CPU references: csrc/ops/cpu/optim_cpu.cpp.
#pragma once

#include "amp_kernels.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fusetrain::kernels {

/// A float32 or float64 value in device memory (null: none).
struct DeviceScalar {
  const void* ptr;
  bool is_double;
};

/// Per-tensor pointers of one fused Adam(W) step; `max_exp_avg_sq` and
/// `master` may hold null pointers (no amsgrad / no master weights).
struct AdamTensors {
  void* const* param;
  void* const* grad;
  void* const* exp_avg;
  void* const* exp_avg_sq;
  void* const* max_exp_avg_sq;
  void* const* master;
  void* const* step;  // one float each, incremented unless *found_inf
  const int64_t* numel;
  int n;
};

struct AdamScalars {
  // lr and the betas in double: the bias corrections 1 - beta^step lose their
  // precision when beta is rounded to float first (1 - 0.999f is 1.3e-5 off).
  double lr, beta1, beta2;
  float weight_decay, eps;
  // Formed in double by the caller and rounded once, as torch does:
  // 1 - beta1, 1 - beta2 and the decoupled decay factor 1 - lr * weight_decay.
  float one_minus_beta1, one_minus_beta2, decay;
  bool amsgrad, maximize, decoupled_weight_decay;
  const float* grad_scale;  // device pointer or null
  const float* found_inf;   // device pointer or null
  // A device-side learning rate (replaces lr and decay when set): the kernel
  // forms lr / bias correction and 1 - lr * weight_decay64 from it in double.
  DeviceScalar lr_device;
  double weight_decay64;
};

/// `param_type` is the parameters' and gradients' type; moments and masters
/// are fp32 when `has_master`, else of param_type.
cudaError_t launch_fused_adam(FloatType param_type, bool has_master, const AdamTensors& tensors,
                              const AdamScalars& scalars, int max_blocks, cudaStream_t stream);

struct SgdTensors {
  void* const* param;
  void* const* grad;
  void* const* momentum_buffer;  // null pointers when momentum == 0
  void* const* master;
  const int64_t* numel;
  int n;
};

struct SgdScalars {
  float lr, momentum, weight_decay;
  DeviceScalar lr_device;  // replaces lr when set
  float one_minus_dampening;  // formed in double by the caller, rounded once
  bool nesterov, maximize, is_first_step;
  bool has_buffer;  // momentum_buffers given (momentum != 0)
  const float* grad_scale;
  const float* found_inf;
};

cudaError_t launch_fused_sgd(FloatType param_type, bool has_master, const SgdTensors& tensors,
                             const SgdScalars& scalars, int max_blocks, cudaStream_t stream);

/// Chunks of kChunkSize elements a tensor of `numel` elements is cut into.
int64_t chunks_of(int64_t numel);

/// Sum of squares of every tensor into `per_tensor_sq`, accumulated in float
/// (and in double for kFloat64 tensors: `partials` and `per_tensor_sq` are
/// then double arrays): first per chunk of kChunkSize elements into
/// `partials` (one value per chunk of all tensors, chunks_of(numel) each),
/// then per tensor summed in chunk order (deterministic). Nothing is copied
/// from the host but kernel parameters, so the launches can be captured in a
/// CUDA graph.
cudaError_t launch_sum_squares(FloatType type, void* const* tensors, const int64_t* numel,
                               int n, void* partials, void* per_tensor_sq, int max_blocks,
                               cudaStream_t stream);

/// dst[where[i]] = src[i] for i < n, with `where` (host) passed as kernel
/// parameters (capturable; no pinned staging buffer).
cudaError_t launch_scatter(const float* src, const int64_t* where, int n, float* dst,
                           cudaStream_t stream);
cudaError_t launch_scatter(const double* src, const int64_t* where, int n, double* dst,
                           cudaStream_t stream);

}  // namespace fusetrain::kernels

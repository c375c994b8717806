// Launchers of the fused layer / RMS norm CUDA kernels, and of the
// deterministic column sums their weight gradients (and bias_gelu's bias
// gradient) finish with. Pure CUDA: raw pointers, sizes, scalars and a
// stream; no ATen. Each returns the launch's error code. Semantics:
// fusetrain::ops::layer_norm, rms_norm and their backwards (Note [Fused
// norms] in csrc/ops/norm.h); CPU references in csrc/ops/cpu/norm_cpu.cpp.
#pragma once

#include "amp_kernels.h"  // FloatType

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fusetrain::kernels {

/// One forward call: `rows` contiguous rows of `width` elements. Device
/// pointers; the optional ones are null when absent.
struct NormForwardArgs {
  int64_t rows;
  int64_t width;
  FloatType type;      // input, residual and residual_out: kFloat32, kFloat16 or kBFloat16
  FloatType out_type;  // out: one of the same three
  const void* input;
  const void* residual;   // optional; input + residual is what is normalised
  const void* weight;     // optional, [width] of weight_type
  FloatType weight_type;  // kFloat32 or `type`
  const void* bias;       // optional (layer norm only), [width] of bias_type
  FloatType bias_type;    // kFloat32 or `type`
  float eps;
  bool rms;            // RMS norm: no mean subtracted, `mean` unused
  void* out;           // [rows, width] of out_type
  void* residual_out;  // [rows, width] of type, written when residual is given
  float* mean;         // [rows], layer norm only
  float* rstd;         // [rows]
};

/// out = norm(input (+ residual)) * weight + bias per row, fp32 math, one
/// read of each input row; writes residual_out (with a residual), mean and
/// rstd. Nothing is launched for zero rows.
cudaError_t launch_norm_forward(const NormForwardArgs& args, cudaStream_t stream);

/// One backward call. grad_input, grad_weight and grad_bias are each
/// optional (null: not computed); grad_weight needs weight.
struct NormBackwardArgs {
  int64_t rows;
  int64_t width;
  FloatType type;           // normed, grad_residual_out and grad_input
  FloatType grad_out_type;  // the forward's out_type
  const void* grad_out;
  const void* grad_residual_out;  // optional, added to grad_input
  const void* normed;             // what the forward normalised (residual_out, else input)
  const void* weight;             // optional, [width] of weight_type
  FloatType weight_type;          // kFloat32 or `type`; also grad_weight's
  FloatType bias_type;            // grad_bias's: kFloat32 or `type`
  const float* mean;              // [rows] for layer norm; null for RMS norm
  const float* rstd;              // [rows]
  void* grad_input;               // [rows, width] of type
  void* grad_weight;              // [width] of weight_type
  void* grad_bias;                // [width] of bias_type
  float* scratch;                 // norm_backward_scratch_floats(args) floats of device memory
};

/// The float32 scratch launch_norm_backward needs for `args` (its rows,
/// width, type and which of grad_weight / grad_bias are wanted; the other
/// pointers are not read): the per-row-group partial sums of the weight and
/// bias gradients. 0 when neither is wanted.
int64_t norm_backward_scratch_floats(const NormBackwardArgs& args);

/// grad_input = rstd * (g - mean(g) - xhat * mean(g * xhat)) (+
/// grad_residual_out), g = grad_out * weight, per row; grad_weight and
/// grad_bias summed over the rows deterministically (Note [Deterministic
/// column sums] in norm_kernels.cu): no float atomics, the same bits every
/// run for a given shape. Nothing is launched for zero rows (the weight
/// and bias gradients are then zeros: one launch).
cudaError_t launch_norm_backward(const NormBackwardArgs& args, cudaStream_t stream);

/// out[j] = sum over i < parts of partials[i * width + j], summed in a fixed
/// order in fp32 and rounded once to out_type (kFloat32, kFloat16,
/// kBFloat16); zeros when parts is 0. The second step of every
/// deterministic column reduction of these kernels.
cudaError_t launch_column_sums(const float* partials, int64_t parts, int64_t width,
                               FloatType out_type, void* out, cudaStream_t stream);

}  // namespace fusetrain::kernels

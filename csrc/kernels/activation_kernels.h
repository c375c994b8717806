// Launchers of the fused activation CUDA kernels: bias + GELU and SwiGLU,
// forward and backward. Pure CUDA: raw pointers, sizes, scalars and a
// stream; no ATen. Each returns the launch's error code. Semantics:
// fusetrain::ops::bias_gelu, swiglu and their backwards (Note [Fused
// activations] in csrc/ops/activation.h); CPU references in
// csrc/ops/cpu/activation_cpu.cpp.
#pragma once

#include "amp_kernels.h"  // FloatType

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fusetrain::kernels {

/// bias_gelu's operands: `rows` contiguous rows of `width` elements of
/// `type` (kFloat32, kFloat16 or kBFloat16), the bias broadcast over the
/// rows. Device pointers.
struct BiasGeluRows {
  FloatType type;
  int64_t rows;
  int64_t width;
  const void* input;
  const void* bias;     // optional, [width] of bias_type
  FloatType bias_type;  // kFloat32 or `type`
  bool tanh;            // the tanh approximation, else the exact erf form
};

/// out = gelu(input + bias), the sum rounded to `type` first, fp32 math,
/// rounded once; out: rows x width of `type`. Nothing is launched for an
/// empty input.
cudaError_t launch_bias_gelu_forward(const BiasGeluRows& x, void* out, cudaStream_t stream);

/// The float32 scratch launch_bias_gelu_backward needs for a bias gradient
/// of `x`'s shape and type: the per-row-chunk partial sums.
int64_t bias_gelu_backward_scratch_floats(const BiasGeluRows& x);

/// grad_input = grad_out * gelu'(input + bias) in `type` (when grad_input is
/// given) and grad_bias = grad_input summed over the rows (when grad_bias is
/// given: [width] of x.bias_type), deterministically, as the norms' weight
/// gradients (Note [Deterministic column sums] in norm_kernels.cu); the sum
/// adds grad_input in fp32, before its rounding to `type`, as the CPU op does.
/// scratch: bias_gelu_backward_scratch_floats(x) floats when grad_bias is
/// given. Zero rows: grad_bias is zeros.
cudaError_t launch_bias_gelu_backward(const BiasGeluRows& x, const void* grad_out, void* grad_input,
                                      void* grad_bias, float* scratch, cudaStream_t stream);

/// SwiGLU's operands: `rows` rows of `width` outputs; row r's gate starts at
/// gate + r * in_stride elements and its up projection at up + r *
/// in_stride (two tensors: in_stride = width; one [gate | up] tensor: up =
/// gate + width, in_stride = 2 * width). Device pointers of `type`.
struct SwigluRows {
  FloatType type;
  int64_t rows;
  int64_t width;
  int64_t in_stride;
  const void* gate;
  const void* up;
};

/// out = silu(gate) * up, fp32 math, rounded once; out: rows x width,
/// contiguous.
cudaError_t launch_swiglu_forward(const SwigluRows& x, void* out, cudaStream_t stream);

/// grad_gate = grad_out * up * sigmoid(gate) * (1 + gate * (1 - sigmoid(gate)))
/// and grad_up = grad_out * silu(gate), laid out as gate and up (rows
/// in_stride apart; grad_up = grad_gate + width for the one-tensor form);
/// grad_out: rows x width, contiguous.
cudaError_t launch_swiglu_backward(const SwigluRows& x, const void* grad_out, void* grad_gate,
                                   void* grad_up, cudaStream_t stream);

}  // namespace fusetrain::kernels

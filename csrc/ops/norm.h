// C++ entry points of the fused layer and RMS normalisation ops (schemas in
// schemas.cpp). They call through the dispatcher, so one call serves every
// device: the CPU and CUDA have kernels of ours (cpu/norm_cpu.cpp,
// cuda/norm_cuda.cpp), other backends the ATen composition (generic.cpp).
// The autograd of the forward ops is registered once, at the Autograd key
// (autograd/norm.cpp); fusetrain::nn and fusetrain.nn call the ops.
//
// Note [Fused norms]
// A pre-norm transformer block spends the time between its GEMMs in passes
// over the activations: the residual add, the norm, the cast to the next
// GEMM's dtype, and the same backwards. One op does them in one read and one
// write of a row:
//   sum = input + residual          (rounded to the input's dtype, stored:
//                                    the next block's residual)
//   out = norm(sum) * weight + bias (fp32 math, rounded once to out_dtype)
// Rows are the elements of the normalised (last) dimensions, contiguous.
// The statistics are fp32 per row: mean and rstd = 1 / sqrt(var + eps) for
// layer norm (biased variance, centred two-pass over the row), rstd =
// 1 / sqrt(mean(x^2) + eps) for RMS norm. Normalising the rounded sum is what
// the unfused `norm(x + r)` computes, so both give one loss curve. The
// backward of a row, with xhat = (x - mean) * rstd (x * rstd for RMS),
// g = grad_out * weight and n the row's width:
//   grad_x = rstd * (g - mean(g) - xhat * mean(g * xhat))    (layer norm)
//   grad_x = rstd * (g - xhat * mean(g * xhat))              (RMS norm)
// plus the gradient arriving at `sum` (the next residual's); the residual's
// gradient is grad_x itself. grad_weight = sum over rows of grad_out * xhat,
// grad_bias = sum of grad_out, summed over fixed blocks of rows in fp32 and
// the blocks then in order, so the bits do not depend on the thread count.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <tuple>

namespace fusetrain::ops {

/// Layer normalisation of `input` over its last normalized_shape.size()
/// dimensions (which must equal normalized_shape), as
/// torch.nn.functional.layer_norm, optionally of input + residual (Note
/// [Fused norms]). input: float32, float16 or bfloat16; residual: the
/// input's shape and dtype; weight, bias: normalized_shape, float32 or the
/// input's dtype; out_dtype: float32, float16 or bfloat16 (default the
/// input's). Returns
///   - out: input's shape, out_dtype, contiguous;
///   - residual_out: input + residual in the input's dtype (an empty tensor
///     without a residual);
///   - mean, rstd: float32, input's shape without the normalised dimensions.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm(
    const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    const std::optional<at::Tensor>& residual, std::optional<at::ScalarType> out_dtype);

/// Gradients of layer_norm with respect to its input (the residual's too),
/// weight and bias, each where `output_mask` asks (else undefined).
/// `normed` is what was normalised: residual_out with a residual, else the
/// input. grad_out: out's shape and dtype; grad_residual_out, when given, the
/// gradient of residual_out, added to the input's. grad_input has normed's
/// dtype; grad_weight and grad_bias the weight's and bias's.
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_residual_out,
    const at::Tensor& normed, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& mean, const at::Tensor& rstd, std::array<bool, 3> output_mask);

/// RMS normalisation as torch.nn.functional.rms_norm (eps: default the
/// input dtype's machine epsilon, as torch's), fused as layer_norm above.
/// Returns out, residual_out and rstd.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm(
    const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, std::optional<double> eps,
    const std::optional<at::Tensor>& residual, std::optional<at::ScalarType> out_dtype);

/// Gradients of rms_norm with respect to its input and weight.
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_residual_out,
    const at::Tensor& normed, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const at::Tensor& rstd,
    std::array<bool, 2> output_mask);

/// The rows and width of a normalisation: width = prod(normalized_shape),
/// rows = input.numel() / width; checks the shapes and dtypes of the
/// forward's arguments (every implementation calls it).
struct NormShape {
  int64_t rows;
  int64_t width;
  at::ScalarType out_dtype;
};
NormShape check_norm_forward_args(const char* op, const at::Tensor& input,
                                  at::IntArrayRef normalized_shape,
                                  const std::optional<at::Tensor>& weight,
                                  const std::optional<at::Tensor>& bias,
                                  const std::optional<at::Tensor>& residual,
                                  std::optional<at::ScalarType> out_dtype);

/// The same for the backwards (bias: layer norm's only).
NormShape check_norm_backward_args(const char* op, const at::Tensor& grad_out,
                                   const std::optional<at::Tensor>& grad_residual_out,
                                   const at::Tensor& normed, at::IntArrayRef normalized_shape,
                                   const std::optional<at::Tensor>& weight,
                                   const std::optional<at::Tensor>& bias,
                                   const std::optional<at::Tensor>& mean, const at::Tensor& rstd);

/// The statistics' shape: input's without the normalised dimensions.
std::vector<int64_t> norm_stat_shape(const at::Tensor& input, at::IntArrayRef normalized_shape);

/// rms_norm's eps: the given one, else the machine epsilon of `dtype`.
double rms_norm_eps(std::optional<double> eps, at::ScalarType dtype);

}  // namespace fusetrain::ops

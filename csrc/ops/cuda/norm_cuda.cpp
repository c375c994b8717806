// CUDA glue of the fused layer and RMS norms (Note [Fused norms] in
// ../norm.h): checks, device guard, stream, outputs and the scratch of the
// deterministic weight gradients. The kernels are in
// csrc/kernels/norm_kernels.cu.
#include <fusetrain/kernels/norm_kernels.h>
#include <fusetrain/ops/checks.h>
#include <fusetrain/ops/cuda/cuda_utils.h>
#include <fusetrain/ops/norm.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>

namespace fusetrain::ops::cuda {

namespace {

constexpr const char* kLayerNormOp = "fusetrain::layer_norm";
constexpr const char* kLayerNormBackwardOp = "fusetrain::layer_norm_backward";
constexpr const char* kRmsNormOp = "fusetrain::rms_norm";
constexpr const char* kRmsNormBackwardOp = "fusetrain::rms_norm_backward";

at::Tensor contiguous_or_empty(const std::optional<at::Tensor>& t) {
  return given(t) ? t->contiguous() : at::Tensor();
}

const void* data_or_null(const at::Tensor& t) { return t.defined() ? t.const_data_ptr() : nullptr; }

void* mutable_data_or_null(at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

// The type of an optional weight or bias (any valid one when absent: the
// kernels do not read it then).
kernels::FloatType param_type(const at::Tensor& t, const char* op) {
  return t.defined() ? float_type(t.scalar_type(), op) : kernels::FloatType::kFloat32;
}

struct ForwardOutputs {
  at::Tensor out;
  at::Tensor residual_out;
  at::Tensor mean;  // undefined for RMS norm
  at::Tensor rstd;
};

ForwardOutputs norm_forward(const char* op, const at::Tensor& input_in,
                            at::IntArrayRef normalized_shape,
                            const std::optional<at::Tensor>& weight_in,
                            const std::optional<at::Tensor>& bias_in, double eps,
                            const std::optional<at::Tensor>& residual_in,
                            std::optional<at::ScalarType> out_dtype, bool rms) {
  const NormShape s = check_norm_forward_args(op, input_in, normalized_shape, weight_in, bias_in,
                                              residual_in, out_dtype);
  const c10::cuda::CUDAGuard guard(input_in.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor input = input_in.contiguous();
  const at::Tensor residual = contiguous_or_empty(residual_in);
  const at::Tensor weight = contiguous_or_empty(weight_in);
  const at::Tensor bias = contiguous_or_empty(bias_in);
  const auto stat_shape = norm_stat_shape(input, normalized_shape);
  const auto f32 = input.options().dtype(at::kFloat);

  ForwardOutputs o;
  o.out = at::empty(input.sizes(), input.options().dtype(s.out_dtype));
  o.residual_out = residual.defined() ? at::empty(input.sizes(), input.options())
                                      : at::empty({0}, input.options());
  o.mean = rms ? at::Tensor() : at::empty(stat_shape, f32);
  o.rstd = at::empty(stat_shape, f32);
  if (s.width == 0) {
    // Rows of no elements (normalized_shape holds a 0): mean 0, variance 0,
    // as the CPU op.
    if (o.mean.defined()) o.mean.zero_();
    o.rstd.fill_(1.0 / std::sqrt(eps));
    return o;
  }
  const kernels::NormForwardArgs args{s.rows,
                                      s.width,
                                      float_type(input.scalar_type(), op),
                                      float_type(s.out_dtype, op),
                                      input.const_data_ptr(),
                                      data_or_null(residual),
                                      data_or_null(weight),
                                      param_type(weight, op),
                                      data_or_null(bias),
                                      param_type(bias, op),
                                      static_cast<float>(eps),
                                      rms,
                                      o.out.data_ptr(),
                                      mutable_data_or_null(o.residual_out),
                                      o.mean.defined() ? o.mean.data_ptr<float>() : nullptr,
                                      o.rstd.data_ptr<float>()};
  C10_CUDA_CHECK(kernels::launch_norm_forward(args, stream));
  return o;
}

struct BackwardOutputs {
  at::Tensor grad_input;
  at::Tensor grad_weight;
  at::Tensor grad_bias;
};

// mean_in: undefined for RMS norm.
BackwardOutputs norm_backward(const char* op, const at::Tensor& grad_out_in,
                              const std::optional<at::Tensor>& grad_residual_out_in,
                              const at::Tensor& normed_in, at::IntArrayRef normalized_shape,
                              const std::optional<at::Tensor>& weight_in,
                              const std::optional<at::Tensor>& bias_in,
                              const std::optional<at::Tensor>& mean_in, const at::Tensor& rstd_in,
                              bool want_input, bool want_weight, bool want_bias) {
  const NormShape s =
      check_norm_backward_args(op, grad_out_in, grad_residual_out_in, normed_in, normalized_shape,
                               weight_in, bias_in, mean_in, rstd_in);
  const c10::cuda::CUDAGuard guard(normed_in.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor grad_out = grad_out_in.contiguous();
  const at::Tensor grad_residual_out = contiguous_or_empty(grad_residual_out_in);
  const at::Tensor normed = normed_in.contiguous();
  const at::Tensor weight = contiguous_or_empty(weight_in);
  const at::Tensor mean = contiguous_or_empty(mean_in);
  const at::Tensor rstd = rstd_in.contiguous();
  want_weight = want_weight && weight.defined();
  want_bias = want_bias && given(bias_in);

  BackwardOutputs o;
  if (want_input) o.grad_input = at::empty(normed.sizes(), normed.options());
  if (want_weight) o.grad_weight = at::empty(weight.sizes(), weight.options());
  if (want_bias) o.grad_bias = at::empty(bias_in->sizes(), bias_in->options());
  kernels::NormBackwardArgs args{
      s.rows,
      s.width,
      float_type(normed.scalar_type(), op),
      float_type(grad_out.scalar_type(), op),
      grad_out.const_data_ptr(),
      data_or_null(grad_residual_out),
      normed.const_data_ptr(),
      data_or_null(weight),
      param_type(weight, op),
      want_bias ? float_type(bias_in->scalar_type(), op) : kernels::FloatType::kFloat32,
      mean.defined() ? mean.const_data_ptr<float>() : nullptr,
      rstd.const_data_ptr<float>(),
      mutable_data_or_null(o.grad_input),
      mutable_data_or_null(o.grad_weight),
      mutable_data_or_null(o.grad_bias),
      nullptr};
  // The per-row-group partials of the weight and bias gradients (Note
  // [Deterministic column sums] in norm_kernels.cu), from the caching
  // allocator on this stream.
  const int64_t scratch_floats = kernels::norm_backward_scratch_floats(args);
  const at::Tensor scratch = scratch_floats > 0
                                 ? at::empty({scratch_floats}, normed.options().dtype(at::kFloat))
                                 : at::Tensor();
  if (scratch.defined()) args.scratch = scratch.data_ptr<float>();
  C10_CUDA_CHECK(kernels::launch_norm_backward(args, stream));
  return o;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_cuda(
    const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    const std::optional<at::Tensor>& residual, std::optional<at::ScalarType> out_dtype) {
  ForwardOutputs o = norm_forward(kLayerNormOp, input, normalized_shape, weight, bias, eps,
                                  residual, out_dtype, false);
  return {o.out, o.residual_out, o.mean, o.rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_cuda(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_residual_out,
    const at::Tensor& normed, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& mean, const at::Tensor& rstd, std::array<bool, 3> mask) {
  BackwardOutputs o =
      norm_backward(kLayerNormBackwardOp, grad_out, grad_residual_out, normed, normalized_shape,
                    weight, bias, mean, rstd, mask[0], mask[1], mask[2]);
  return {o.grad_input, o.grad_weight, o.grad_bias};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_cuda(
    const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, std::optional<double> eps,
    const std::optional<at::Tensor>& residual, std::optional<at::ScalarType> out_dtype) {
  ForwardOutputs o =
      norm_forward(kRmsNormOp, input, normalized_shape, weight, std::nullopt,
                   rms_norm_eps(eps, input.scalar_type()), residual, out_dtype, true);
  return {o.out, o.residual_out, o.rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cuda(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_residual_out,
    const at::Tensor& normed, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const at::Tensor& rstd, std::array<bool, 2> mask) {
  BackwardOutputs o =
      norm_backward(kRmsNormBackwardOp, grad_out, grad_residual_out, normed, normalized_shape,
                    weight, std::nullopt, std::nullopt, rstd, mask[0], mask[1], false);
  return {o.grad_input, o.grad_weight};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusetrain, CUDA, m) {
  m.impl("layer_norm", &layer_norm_cuda);
  m.impl("layer_norm_backward", &layer_norm_backward_cuda);
  m.impl("rms_norm", &rms_norm_cuda);
  m.impl("rms_norm_backward", &rms_norm_backward_cuda);
}

}  // namespace fusetrain::ops::cuda

// Fused layer and RMS normalisation (Note [Fused norms] in norm.h): the
// dispatcher entry points, the argument checks every implementation shares
// and the Meta implementations torch.compile traces with. CPU kernels:
// cpu/norm_cpu.cpp; CUDA: cuda/norm_cuda.cpp; other backends: generic.cpp.
#include <fusetrain/ops/checks.h>
#include <fusetrain/ops/norm.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <limits>

namespace fusetrain::ops {

namespace {

bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

void check_param(const std::optional<at::Tensor>& t, const at::Tensor& input,
                 at::IntArrayRef normalized_shape, const char* op, const char* name) {
  if (!given(t)) return;
  TORCH_CHECK(t->sizes() == normalized_shape, op, ": ", name,
              " must have the normalized_shape ", normalized_shape, ", got shape ", t->sizes());
  TORCH_CHECK(t->scalar_type() == at::kFloat || t->scalar_type() == input.scalar_type(), op, ": ",
              name, " must be float32 or the input's dtype (", input.scalar_type(), "), got ",
              t->scalar_type());
  check_same_device(*t, input, op, name, "input");
}

// rows and width of `input` normalised over its trailing `normalized_shape`.
NormShape shape_of(const char* op, const at::Tensor& input, at::IntArrayRef normalized_shape,
                   const char* name) {
  TORCH_CHECK(input.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(is_float_type(input.scalar_type()), op, ": ", name,
              " must be float32, float16 or bfloat16, got ", input.scalar_type());
  const int64_t k = static_cast<int64_t>(normalized_shape.size());
  TORCH_CHECK(k >= 1, op, ": normalized_shape must name at least one dimension");
  TORCH_CHECK(input.dim() >= k && input.sizes().slice(input.dim() - k) == normalized_shape, op,
              ": expected ", name, " of shape [*, ", normalized_shape,
              "] (its last dimensions the normalized_shape), got ", input.sizes());
  int64_t width = 1;
  for (const int64_t s : normalized_shape) {
    TORCH_CHECK(s >= 0, op, ": normalized_shape has a negative size: ", normalized_shape);
    width *= s;
  }
  const int64_t rows = width == 0 ? 0 : input.numel() / width;
  return {rows, width, input.scalar_type()};
}

}  // namespace

std::vector<int64_t> norm_stat_shape(const at::Tensor& input, at::IntArrayRef normalized_shape) {
  const auto lead = input.sizes().slice(0, input.dim() - normalized_shape.size());
  return {lead.begin(), lead.end()};
}

double rms_norm_eps(std::optional<double> eps, at::ScalarType dtype) {
  if (eps.has_value()) return *eps;
  switch (dtype) {
    case at::kHalf:
      return static_cast<double>(std::numeric_limits<c10::Half>::epsilon());
    case at::kBFloat16:
      return static_cast<double>(std::numeric_limits<c10::BFloat16>::epsilon());
    default:
      return static_cast<double>(std::numeric_limits<float>::epsilon());
  }
}

NormShape check_norm_forward_args(const char* op, const at::Tensor& input,
                                  at::IntArrayRef normalized_shape,
                                  const std::optional<at::Tensor>& weight,
                                  const std::optional<at::Tensor>& bias,
                                  const std::optional<at::Tensor>& residual,
                                  std::optional<at::ScalarType> out_dtype) {
  NormShape shape = shape_of(op, input, normalized_shape, "input");
  check_param(weight, input, normalized_shape, op, "weight");
  check_param(bias, input, normalized_shape, op, "bias");
  if (given(residual)) {
    TORCH_CHECK(residual->sizes() == input.sizes() &&
                    residual->scalar_type() == input.scalar_type(),
                op, ": residual must have the input's shape and dtype (", input.scalar_type(), " ",
                input.sizes(), "), got ", residual->scalar_type(), " ", residual->sizes());
    check_same_device(*residual, input, op, "residual", "input");
  }
  if (out_dtype.has_value()) {
    TORCH_CHECK(is_float_type(*out_dtype), op,
                ": out_dtype must be float32, float16 or bfloat16, got ", *out_dtype);
    shape.out_dtype = *out_dtype;
  }
  return shape;
}

NormShape check_norm_backward_args(const char* op, const at::Tensor& grad_out,
                                   const std::optional<at::Tensor>& grad_residual_out,
                                   const at::Tensor& normed, at::IntArrayRef normalized_shape,
                                   const std::optional<at::Tensor>& weight,
                                   const std::optional<at::Tensor>& bias,
                                   const std::optional<at::Tensor>& mean, const at::Tensor& rstd) {
  NormShape shape = shape_of(op, normed, normalized_shape, "normed");
  TORCH_CHECK(grad_out.defined(), op, ": grad_out is undefined");
  TORCH_CHECK(grad_out.sizes() == normed.sizes() && is_float_type(grad_out.scalar_type()), op,
              ": grad_out must be a float32, float16 or bfloat16 tensor of normed's shape ",
              normed.sizes(), ", got ", grad_out.scalar_type(), " ", grad_out.sizes());
  check_same_device(grad_out, normed, op, "grad_out", "normed");
  shape.out_dtype = grad_out.scalar_type();
  if (given(grad_residual_out)) {
    TORCH_CHECK(grad_residual_out->sizes() == normed.sizes() &&
                    grad_residual_out->scalar_type() == normed.scalar_type(),
                op, ": grad_residual_out must have normed's shape and dtype (",
                normed.scalar_type(), " ", normed.sizes(), "), got ",
                grad_residual_out->scalar_type(), " ", grad_residual_out->sizes());
    check_same_device(*grad_residual_out, normed, op, "grad_residual_out", "normed");
  }
  check_param(weight, normed, normalized_shape, op, "weight");
  check_param(bias, normed, normalized_shape, op, "bias");
  const std::vector<int64_t> stat_shape = norm_stat_shape(normed, normalized_shape);
  const auto check_stat = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.defined() && t.scalar_type() == at::kFloat && t.sizes() == stat_shape, op, ": ",
                name, " must be the forward's float32 ", at::IntArrayRef(stat_shape),
                " statistic");
    check_same_device(t, normed, op, name, "normed");
  };
  if (mean.has_value()) check_stat(*mean, "mean");
  check_stat(rstd, "rstd");
  return shape;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm(
    const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    const std::optional<at::Tensor>& residual, std::optional<at::ScalarType> out_dtype) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fusetrain::layer_norm", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, at::IntArrayRef, const std::optional<at::Tensor>&,
                           const std::optional<at::Tensor>&, double,
                           const std::optional<at::Tensor>&, std::optional<at::ScalarType>)>();
  return op.call(input, normalized_shape, weight, bias, eps, residual, out_dtype);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_residual_out,
    const at::Tensor& normed, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& mean, const at::Tensor& rstd, std::array<bool, 3> output_mask) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fusetrain::layer_norm_backward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                           at::IntArrayRef, const std::optional<at::Tensor>&,
                           const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
                           std::array<bool, 3>)>();
  return op.call(grad_out, grad_residual_out, normed, normalized_shape, weight, bias, mean, rstd,
                 output_mask);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm(
    const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, std::optional<double> eps,
    const std::optional<at::Tensor>& residual, std::optional<at::ScalarType> out_dtype) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fusetrain::rms_norm", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, at::IntArrayRef, const std::optional<at::Tensor>&,
                           std::optional<double>, const std::optional<at::Tensor>&,
                           std::optional<at::ScalarType>)>();
  return op.call(input, normalized_shape, weight, eps, residual, out_dtype);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_residual_out,
    const at::Tensor& normed, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const at::Tensor& rstd,
    std::array<bool, 2> output_mask) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fusetrain::rms_norm_backward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                           at::IntArrayRef, const std::optional<at::Tensor>&, const at::Tensor&,
                           std::array<bool, 2>)>();
  return op.call(grad_out, grad_residual_out, normed, normalized_shape, weight, rstd, output_mask);
}

namespace {

at::Tensor empty_param_grad(const std::optional<at::Tensor>& p, bool wanted) {
  return wanted && given(p) ? at::empty_like(*p, at::MemoryFormat::Contiguous) : at::Tensor();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_meta(
    const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double,
    const std::optional<at::Tensor>& residual, std::optional<at::ScalarType> out_dtype) {
  const NormShape s = check_norm_forward_args("fusetrain::layer_norm", input, normalized_shape,
                                              weight, bias, residual, out_dtype);
  const auto stat = norm_stat_shape(input, normalized_shape);
  const auto f32 = input.options().dtype(at::kFloat);
  return {at::empty(input.sizes(), input.options().dtype(s.out_dtype)),
          given(residual) ? at::empty(input.sizes(), input.options()) : at::empty({0}, input.options()),
          at::empty(stat, f32), at::empty(stat, f32)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_meta(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_residual_out,
    const at::Tensor& normed, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& mean, const at::Tensor& rstd, std::array<bool, 3> mask) {
  check_norm_backward_args("fusetrain::layer_norm_backward", grad_out, grad_residual_out, normed,
                           normalized_shape, weight, bias, mean, rstd);
  return {mask[0] ? at::empty(normed.sizes(), normed.options()) : at::Tensor(),
          empty_param_grad(weight, mask[1]), empty_param_grad(bias, mask[2])};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_meta(
    const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, std::optional<double>,
    const std::optional<at::Tensor>& residual, std::optional<at::ScalarType> out_dtype) {
  const NormShape s = check_norm_forward_args("fusetrain::rms_norm", input, normalized_shape,
                                              weight, std::nullopt, residual, out_dtype);
  return {at::empty(input.sizes(), input.options().dtype(s.out_dtype)),
          given(residual) ? at::empty(input.sizes(), input.options()) : at::empty({0}, input.options()),
          at::empty(norm_stat_shape(input, normalized_shape), input.options().dtype(at::kFloat))};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_meta(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_residual_out,
    const at::Tensor& normed, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const at::Tensor& rstd, std::array<bool, 2> mask) {
  check_norm_backward_args("fusetrain::rms_norm_backward", grad_out, grad_residual_out, normed,
                           normalized_shape, weight, std::nullopt, std::nullopt, rstd);
  return {mask[0] ? at::empty(normed.sizes(), normed.options()) : at::Tensor(),
          empty_param_grad(weight, mask[1])};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusetrain, Meta, m) {
  m.impl("layer_norm", &layer_norm_meta);
  m.impl("layer_norm_backward", &layer_norm_backward_meta);
  m.impl("rms_norm", &rms_norm_meta);
  m.impl("rms_norm_backward", &rms_norm_backward_meta);
}

}  // namespace fusetrain::ops

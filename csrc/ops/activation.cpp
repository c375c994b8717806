// Fused bias + GELU and SwiGLU (Note [Fused activations] in activation.h):
// dispatcher entry points, the argument checks every implementation shares,
// and the Meta implementations. CPU: cpu/activation_cpu.cpp; CUDA:
// cuda/activation_cuda.cpp; other backends: generic_transformer.cpp.
#include <fusetrain/ops/activation.h>
#include <fusetrain/ops/checks.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace fusetrain::ops {

namespace {
void check_float(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  const at::ScalarType d = t.scalar_type();
  TORCH_CHECK(d == at::kFloat || d == at::kHalf || d == at::kBFloat16, op, ": ", name,
              " must be float32, float16 or bfloat16, got ", d);
}
}  // namespace

GeluApproximation parse_gelu_approximation(c10::string_view approximate, const char* op) {
  if (approximate == "none") return GeluApproximation::kNone;
  if (approximate == "tanh") return GeluApproximation::kTanh;
  TORCH_CHECK_VALUE(false, op, ": approximate must be 'none' or 'tanh' (as torch.nn.functional.gelu), got '",
                    std::string(approximate), "'");
}

int64_t check_bias_gelu_args(const char* op, const at::Tensor& input,
                             const std::optional<at::Tensor>& bias, const at::Tensor* grad_out) {
  check_float(input, op, "input");
  TORCH_CHECK(input.dim() >= 1, op, ": input must have at least one dimension, got a scalar");
  const int64_t width = input.size(-1);
  if (given(bias)) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == width, op,
                ": bias must be 1-D with the input's last dimension (", width, "), got shape ",
                bias->sizes());
    TORCH_CHECK(bias->scalar_type() == at::kFloat || bias->scalar_type() == input.scalar_type(),
                op, ": bias must be float32 or the input's dtype (", input.scalar_type(), "), got ",
                bias->scalar_type());
    check_same_device(*bias, input, op, "bias", "input");
  }
  if (grad_out != nullptr) {
    TORCH_CHECK(grad_out->defined() && grad_out->sizes() == input.sizes() &&
                    grad_out->scalar_type() == input.scalar_type(),
                op, ": grad_out must have the input's shape and dtype (", input.scalar_type(), " ",
                input.sizes(), ")");
    check_same_device(*grad_out, input, op, "grad_out", "input");
  }
  return width;
}

int64_t check_swiglu_args(const char* op, const at::Tensor& a, const std::optional<at::Tensor>& b,
                          const at::Tensor* grad_out) {
  check_float(a, op, "a");
  TORCH_CHECK(a.dim() >= 1, op, ": a must have at least one dimension, got a scalar");
  std::vector<int64_t> out_shape = a.sizes().vec();
  if (given(b)) {
    TORCH_CHECK(b->sizes() == a.sizes() && b->scalar_type() == a.scalar_type(), op,
                ": b must have a's shape and dtype (", a.scalar_type(), " ", a.sizes(), "), got ",
                b->scalar_type(), " ", b->sizes());
    check_same_device(*b, a, op, "b", "a");
  } else {
    TORCH_CHECK(a.size(-1) % 2 == 0, op,
                ": without b, a's last dimension holds the gate and up halves and must be even, "
                "got shape ",
                a.sizes());
    out_shape.back() /= 2;
  }
  if (grad_out != nullptr) {
    TORCH_CHECK(grad_out->defined() && grad_out->sizes() == at::IntArrayRef(out_shape) &&
                    grad_out->scalar_type() == a.scalar_type(),
                op, ": grad_out must have the output's shape and dtype (", a.scalar_type(), " ",
                at::IntArrayRef(out_shape), ")");
    check_same_device(*grad_out, a, op, "grad_out", "a");
  }
  return out_shape.back();
}

at::Tensor bias_gelu(const at::Tensor& input, const std::optional<at::Tensor>& bias,
                     c10::string_view approximate) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fusetrain::bias_gelu", "")
                       .typed<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&,
                                         c10::string_view)>();
  return op.call(input, bias, approximate);
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_backward(const at::Tensor& grad_out,
                                                      const at::Tensor& input,
                                                      const std::optional<at::Tensor>& bias,
                                                      c10::string_view approximate,
                                                      std::array<bool, 2> output_mask) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fusetrain::bias_gelu_backward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                           c10::string_view, std::array<bool, 2>)>();
  return op.call(grad_out, input, bias, approximate, output_mask);
}

at::Tensor swiglu(const at::Tensor& a, const std::optional<at::Tensor>& b) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fusetrain::swiglu", "")
                       .typed<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&)>();
  return op.call(a, b);
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad_out, const at::Tensor& a,
                                                   const std::optional<at::Tensor>& b) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fusetrain::swiglu_backward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
  return op.call(grad_out, a, b);
}

namespace {

at::Tensor bias_gelu_meta(const at::Tensor& input, const std::optional<at::Tensor>& bias,
                          c10::string_view approximate) {
  check_bias_gelu_args("fusetrain::bias_gelu", input, bias);
  parse_gelu_approximation(approximate, "fusetrain::bias_gelu");
  return at::empty(input.sizes(), input.options());
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_backward_meta(const at::Tensor& grad_out,
                                                           const at::Tensor& input,
                                                           const std::optional<at::Tensor>& bias,
                                                           c10::string_view approximate,
                                                           std::array<bool, 2> mask) {
  check_bias_gelu_args("fusetrain::bias_gelu_backward", input, bias, &grad_out);
  parse_gelu_approximation(approximate, "fusetrain::bias_gelu_backward");
  return {mask[0] ? at::empty(input.sizes(), input.options()) : at::Tensor(),
          mask[1] && given(bias) ? at::empty(bias->sizes(), bias->options()) : at::Tensor()};
}

at::Tensor swiglu_meta(const at::Tensor& a, const std::optional<at::Tensor>& b) {
  const int64_t width = check_swiglu_args("fusetrain::swiglu", a, b);
  std::vector<int64_t> shape = a.sizes().vec();
  shape.back() = width;
  return at::empty(shape, a.options());
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_meta(const at::Tensor& grad_out,
                                                        const at::Tensor& a,
                                                        const std::optional<at::Tensor>& b) {
  check_swiglu_args("fusetrain::swiglu_backward", a, b, &grad_out);
  return {at::empty(a.sizes(), a.options()),
          given(b) ? at::empty(b->sizes(), b->options()) : at::empty({0}, a.options())};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusetrain, Meta, m) {
  m.impl("bias_gelu", &bias_gelu_meta);
  m.impl("bias_gelu_backward", &bias_gelu_backward_meta);
  m.impl("swiglu", &swiglu_meta);
  m.impl("swiglu_backward", &swiglu_backward_meta);
}

}  // namespace fusetrain::ops

// CUDA glue of the fused activations (Note [Fused activations] in
// ../activation.h): checks, device guard, stream, outputs and the scratch of
// the deterministic bias gradient. The kernels are in
// csrc/kernels/activation_kernels.cu; they see rows of the last dimension
// where a bias or the [gate | up] halves give the rows a meaning, else the
// whole tensor as one row, which vectorises whatever the last dimension.
#include <fusetrain/kernels/activation_kernels.h>
#include <fusetrain/ops/activation.h>
#include <fusetrain/ops/checks.h>
#include <fusetrain/ops/cuda/cuda_utils.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace fusetrain::ops::cuda {

namespace {

constexpr const char* kBiasGeluOp = "fusetrain::bias_gelu";
constexpr const char* kBiasGeluBackwardOp = "fusetrain::bias_gelu_backward";
constexpr const char* kSwigluOp = "fusetrain::swiglu";
constexpr const char* kSwigluBackwardOp = "fusetrain::swiglu_backward";

// bias_gelu's operands as the kernels see them; `input` and `bias`
// contiguous.
kernels::BiasGeluRows gelu_rows(const at::Tensor& input, const at::Tensor& bias, int64_t width,
                                GeluApproximation form, const char* op) {
  const bool one_row = !bias.defined();
  const int64_t n = input.numel();
  return {float_type(input.scalar_type(), op),
          one_row ? (n > 0 ? 1 : 0) : (width == 0 ? 0 : n / width),
          one_row ? n : width,
          input.const_data_ptr(),
          bias.defined() ? bias.const_data_ptr() : nullptr,
          bias.defined() ? float_type(bias.scalar_type(), op) : kernels::FloatType::kFloat32,
          form == GeluApproximation::kTanh};
}

at::Tensor bias_gelu_cuda(const at::Tensor& input_in, const std::optional<at::Tensor>& bias_in,
                          c10::string_view approximate) {
  const int64_t width = check_bias_gelu_args(kBiasGeluOp, input_in, bias_in);
  const GeluApproximation form = parse_gelu_approximation(approximate, kBiasGeluOp);
  const c10::cuda::CUDAGuard guard(input_in.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor input = input_in.contiguous();
  const at::Tensor bias = given(bias_in) ? bias_in->contiguous() : at::Tensor();
  at::Tensor out = at::empty(input.sizes(), input.options());
  C10_CUDA_CHECK(kernels::launch_bias_gelu_forward(gelu_rows(input, bias, width, form, kBiasGeluOp),
                                                   out.data_ptr(), stream));
  return out;
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_backward_cuda(const at::Tensor& grad_out_in,
                                                           const at::Tensor& input_in,
                                                           const std::optional<at::Tensor>& bias_in,
                                                           c10::string_view approximate,
                                                           std::array<bool, 2> mask) {
  const int64_t width = check_bias_gelu_args(kBiasGeluBackwardOp, input_in, bias_in, &grad_out_in);
  const GeluApproximation form = parse_gelu_approximation(approximate, kBiasGeluBackwardOp);
  const c10::cuda::CUDAGuard guard(input_in.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor input = input_in.contiguous();
  const at::Tensor grad_out = grad_out_in.contiguous();
  const at::Tensor bias = given(bias_in) ? bias_in->contiguous() : at::Tensor();
  at::Tensor grad_input = mask[0] ? at::empty(input.sizes(), input.options()) : at::Tensor();
  at::Tensor grad_bias =
      mask[1] && bias.defined() ? at::empty(bias.sizes(), bias.options()) : at::Tensor();
  const kernels::BiasGeluRows rows = gelu_rows(input, bias, width, form, kBiasGeluBackwardOp);
  // The per-row-chunk partials of grad_bias (Note [Deterministic column
  // sums] in csrc/kernels/norm_kernels.cu), from the caching allocator.
  const int64_t scratch_floats =
      grad_bias.defined() ? kernels::bias_gelu_backward_scratch_floats(rows) : 0;
  at::Tensor scratch = scratch_floats > 0
                           ? at::empty({scratch_floats}, input.options().dtype(at::kFloat))
                           : at::Tensor();
  C10_CUDA_CHECK(kernels::launch_bias_gelu_backward(
      rows, grad_out.const_data_ptr(), grad_input.defined() ? grad_input.data_ptr() : nullptr,
      grad_bias.defined() ? grad_bias.data_ptr() : nullptr,
      scratch.defined() ? scratch.data_ptr<float>() : nullptr, stream));
  return {grad_input, grad_bias};
}

// swiglu's operands as the kernels see them, `a` (and `b`) contiguous: two
// tensors as one row; one [gate | up] tensor as its rows, `width` the
// output's last dimension.
kernels::SwigluRows swiglu_rows(const at::Tensor& a, const at::Tensor& b, int64_t width,
                                const char* op) {
  const kernels::FloatType type = float_type(a.scalar_type(), op);
  if (b.defined()) {
    const int64_t n = a.numel();
    return {type, n > 0 ? 1 : 0, n, n, a.const_data_ptr(), b.const_data_ptr()};
  }
  const int64_t rows = width == 0 ? 0 : a.numel() / (2 * width);
  const auto* gate = static_cast<const char*>(a.const_data_ptr());
  const char* up = rows == 0 ? gate : gate + width * a.element_size();
  return {type, rows, width, 2 * width, gate, up};
}

at::Tensor swiglu_cuda(const at::Tensor& a_in, const std::optional<at::Tensor>& b_in) {
  const int64_t width = check_swiglu_args(kSwigluOp, a_in, b_in);
  const c10::cuda::CUDAGuard guard(a_in.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor a = a_in.contiguous();
  const at::Tensor b = given(b_in) ? b_in->contiguous() : at::Tensor();
  std::vector<int64_t> shape = a.sizes().vec();
  shape.back() = width;
  at::Tensor out = at::empty(shape, a.options());
  C10_CUDA_CHECK(
      kernels::launch_swiglu_forward(swiglu_rows(a, b, width, kSwigluOp), out.data_ptr(), stream));
  return out;
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_cuda(const at::Tensor& grad_out_in,
                                                        const at::Tensor& a_in,
                                                        const std::optional<at::Tensor>& b_in) {
  const int64_t width = check_swiglu_args(kSwigluBackwardOp, a_in, b_in, &grad_out_in);
  const c10::cuda::CUDAGuard guard(a_in.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor a = a_in.contiguous();
  const at::Tensor b = given(b_in) ? b_in->contiguous() : at::Tensor();
  const at::Tensor grad_out = grad_out_in.contiguous();
  at::Tensor grad_a = at::empty(a.sizes(), a.options());
  at::Tensor grad_b = b.defined() ? at::empty(b.sizes(), b.options()) : at::empty({0}, a.options());
  // The gradients are laid out as the operands: grad_b, or the up half of
  // grad_a's rows.
  auto* grad_gate = static_cast<char*>(grad_a.data_ptr());
  void* grad_up = b.defined()           ? grad_b.data_ptr()
                  : grad_a.numel() == 0 ? grad_gate
                                        : grad_gate + width * grad_a.element_size();
  C10_CUDA_CHECK(kernels::launch_swiglu_backward(swiglu_rows(a, b, width, kSwigluBackwardOp),
                                                 grad_out.const_data_ptr(), grad_gate, grad_up,
                                                 stream));
  return {grad_a, grad_b};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusetrain, CUDA, m) {
  m.impl("bias_gelu", &bias_gelu_cuda);
  m.impl("bias_gelu_backward", &bias_gelu_backward_cuda);
  m.impl("swiglu", &swiglu_cuda);
  m.impl("swiglu_backward", &swiglu_backward_cuda);
}

}  // namespace fusetrain::ops::cuda

// CUDA glue of the float8 quantisation ops: checks, device guard, stream and
// the launch. The kernels are in csrc/kernels/fp8_kernels.cu.
#include <fusetrain/kernels/fp8_kernels.h>
#include <fusetrain/ops/cuda/cuda_utils.h>
#include <fusetrain/ops/fp8.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace fusetrain::ops::cuda {

namespace {

constexpr const char* kCurrentOp = "fusetrain::fp8_quantize_current";
constexpr const char* kDelayedOp = "fusetrain::fp8_quantize_delayed";
constexpr const char* kCurrentTransposeOp = "fusetrain::fp8_quantize_current_transpose";
constexpr const char* kDelayedTransposeOp = "fusetrain::fp8_quantize_delayed_transpose";

kernels::Fp8Type fp8_type(at::ScalarType dtype) {
  return dtype == at::kFloat8_e5m2 ? kernels::Fp8Type::kE5M2 : kernels::Fp8Type::kE4M3;
}

at::Tensor quantize_current_cuda(const at::Tensor& self, at::ScalarType dtype, at::Tensor& scale,
                                 at::Tensor& amax, int64_t margin) {
  check_fp8_quantize_args(kCurrentOp, self, dtype, scale, amax, "amax", margin);
  TORCH_CHECK(amax.numel() == 1, kCurrentOp, ": amax must hold exactly one element, got shape ",
              amax.sizes());
  const c10::cuda::CUDAGuard guard(self.device());
  const at::Tensor x = self.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(dtype));
  C10_CUDA_CHECK(kernels::launch_fp8_quantize_current(
      float_type(x.scalar_type(), kCurrentOp), x.const_data_ptr(), x.numel(), fp8_type(dtype),
      static_cast<uint8_t*>(out.mutable_data_ptr()), scale.mutable_data_ptr<float>(),
      amax.mutable_data_ptr<float>(), static_cast<int>(margin), multi_tensor_blocks(),
      at::cuda::getCurrentCUDAStream()));
  return out;
}

at::Tensor quantize_delayed_cuda(const at::Tensor& self, at::ScalarType dtype, at::Tensor& scale,
                                 at::Tensor& amax_history, int64_t margin) {
  check_fp8_quantize_args(kDelayedOp, self, dtype, scale, amax_history, "amax_history", margin);
  const c10::cuda::CUDAGuard guard(self.device());
  const at::Tensor x = self.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(dtype));
  C10_CUDA_CHECK(kernels::launch_fp8_quantize_delayed(
      float_type(x.scalar_type(), kDelayedOp), x.const_data_ptr(), x.numel(), fp8_type(dtype),
      static_cast<uint8_t*>(out.mutable_data_ptr()), scale.mutable_data_ptr<float>(),
      amax_history.mutable_data_ptr<float>(), amax_history.numel(), static_cast<int>(margin),
      multi_tensor_blocks(), at::cuda::getCurrentCUDAStream()));
  return out;
}

// The outputs of a transposing quantisation: q [rows, cols] and q_t [cols,
// padded_rows], both as bytes for the kernel.
struct Transposed {
  at::Tensor q;
  at::Tensor q_t;
  uint8_t* q_bytes() { return static_cast<uint8_t*>(q.mutable_data_ptr()); }
  uint8_t* q_t_bytes() { return static_cast<uint8_t*>(q_t.mutable_data_ptr()); }
};

Transposed transposed_outputs(const at::Tensor& x, at::ScalarType dtype, int64_t padded_rows,
                              const char* op) {
  // The kernel's grid has a 64-column tile per block along y (at most 65535).
  TORCH_CHECK(x.size(1) <= int64_t{65535} * 64, op, ": at most ", int64_t{65535} * 64,
              " columns, got ", x.size(1));
  const auto options = x.options().dtype(dtype);
  return {at::empty(x.sizes(), options), at::empty({x.size(1), padded_rows}, options)};
}

std::tuple<at::Tensor, at::Tensor> quantize_current_transpose_cuda(
    const at::Tensor& self, at::ScalarType dtype, at::Tensor& scale, at::Tensor& amax,
    int64_t margin, int64_t row_multiple) {
  check_fp8_quantize_args(kCurrentTransposeOp, self, dtype, scale, amax, "amax", margin);
  TORCH_CHECK(amax.numel() == 1, kCurrentTransposeOp,
              ": amax must hold exactly one element, got shape ", amax.sizes());
  const int64_t padded_rows = fp8_padded_rows(kCurrentTransposeOp, self, row_multiple);
  const c10::cuda::CUDAGuard guard(self.device());
  const at::Tensor x = self.contiguous();
  Transposed out = transposed_outputs(x, dtype, padded_rows, kCurrentTransposeOp);
  C10_CUDA_CHECK(kernels::launch_fp8_quantize_current_transpose(
      float_type(x.scalar_type(), kCurrentTransposeOp), x.const_data_ptr(), x.size(0), x.size(1),
      padded_rows, fp8_type(dtype), out.q_bytes(), out.q_t_bytes(),
      scale.mutable_data_ptr<float>(), amax.mutable_data_ptr<float>(), static_cast<int>(margin),
      multi_tensor_blocks(), at::cuda::getCurrentCUDAStream()));
  return {out.q, out.q_t};
}

std::tuple<at::Tensor, at::Tensor> quantize_delayed_transpose_cuda(
    const at::Tensor& self, at::ScalarType dtype, at::Tensor& scale, at::Tensor& amax_history,
    int64_t margin, int64_t row_multiple) {
  check_fp8_quantize_args(kDelayedTransposeOp, self, dtype, scale, amax_history, "amax_history",
                          margin);
  const int64_t padded_rows = fp8_padded_rows(kDelayedTransposeOp, self, row_multiple);
  const c10::cuda::CUDAGuard guard(self.device());
  const at::Tensor x = self.contiguous();
  Transposed out = transposed_outputs(x, dtype, padded_rows, kDelayedTransposeOp);
  C10_CUDA_CHECK(kernels::launch_fp8_quantize_delayed_transpose(
      float_type(x.scalar_type(), kDelayedTransposeOp), x.const_data_ptr(), x.size(0), x.size(1),
      padded_rows, fp8_type(dtype), out.q_bytes(), out.q_t_bytes(),
      scale.mutable_data_ptr<float>(), amax_history.mutable_data_ptr<float>(),
      amax_history.numel(), static_cast<int>(margin), multi_tensor_blocks(),
      at::cuda::getCurrentCUDAStream()));
  return {out.q, out.q_t};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusetrain, CUDA, m) {
  m.impl("fp8_quantize_current", &quantize_current_cuda);
  m.impl("fp8_quantize_delayed", &quantize_delayed_cuda);
  m.impl("fp8_quantize_current_transpose", &quantize_current_transpose_cuda);
  m.impl("fp8_quantize_delayed_transpose", &quantize_delayed_transpose_cuda);
}

}  // namespace fusetrain::ops::cuda

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

}  // namespace

TORCH_LIBRARY_IMPL(fusetrain, CUDA, m) {
  m.impl("fp8_quantize_current", &quantize_current_cuda);
  m.impl("fp8_quantize_delayed", &quantize_delayed_cuda);
}

}  // namespace fusetrain::ops::cuda

// CUDA glue of the mixed-precision ops: checks, device guard, stream, and one
// multi-tensor launch per dtype. The kernels are in csrc/kernels/amp_kernels.cu.
#include <fusetrain/kernels/amp_kernels.h>
#include <fusetrain/ops/amp.h>
#include <fusetrain/ops/cuda/cuda_utils.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <map>

namespace fusetrain::ops::cuda {

namespace {

void unscale_cuda(at::TensorList tensors, at::Tensor& found_inf, const at::Tensor& inv_scale) {
  check_unscale_args(tensors, found_inf, inv_scale);
  const c10::cuda::CUDAGuard guard(found_inf.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  struct Group {
    std::vector<void*> ptrs;
    std::vector<int64_t> numel;
  };
  std::map<at::ScalarType, Group> groups;
  for (const at::Tensor& t : tensors) {
    if (t.numel() == 0) continue;
    if (!t.is_non_overlapping_and_dense()) {
      // Rare strided views: elementwise ops, still without a host sync.
      found_inf.masked_fill_(at::isfinite(t).all().logical_not(), 1.f);
      t.mul_(inv_scale);
      continue;
    }
    Group& g = groups[t.scalar_type()];
    g.ptrs.push_back(t.data_ptr());
    g.numel.push_back(t.numel());
  }
  for (auto& [dtype, g] : groups) {
    C10_CUDA_CHECK(kernels::launch_non_finite_check_and_unscale(
        float_type(dtype, "fusetrain::non_finite_check_and_unscale_"),
        g.ptrs.data(), g.numel.data(), static_cast<int>(g.ptrs.size()),
        found_inf.data_ptr<float>(), inv_scale.const_data_ptr<float>(), multi_tensor_blocks(),
        stream));
  }
}

at::Tensor& update_scale_cuda(at::Tensor& scale, at::Tensor& growth_tracker,
                              at::Tensor& overflow_tracker, const at::Tensor& found_inf,
                              double growth_factor, double backoff_factor, int64_t growth_interval,
                              double max_scale, int64_t hysteresis) {
  check_update_scale_args(scale, growth_tracker, overflow_tracker, found_inf, growth_factor,
                          backoff_factor, growth_interval, max_scale, hysteresis);
  const c10::cuda::CUDAGuard guard(scale.device());
  C10_CUDA_CHECK(kernels::launch_update_scale(
      scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
      overflow_tracker.data_ptr<int32_t>(), found_inf.const_data_ptr<float>(), growth_factor,
      backoff_factor, growth_interval, max_scale, hysteresis, at::cuda::getCurrentCUDAStream()));
  return scale;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusetrain, CUDA, m) {
  m.impl("non_finite_check_and_unscale_", &unscale_cuda);
  m.impl("update_scale_", &update_scale_cuda);
}

}  // namespace fusetrain::ops::cuda

// Shared CUDA glue: the launch grid that fills the current device, and the
// element type of a tensor as the pure kernels name it.
#pragma once

#include <fusetrain/kernels/amp_kernels.h>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

namespace fusetrain::ops::cuda {

/// Blocks for a grid-stride multi-tensor launch: enough resident 512-thread
/// blocks to fill every SM of the current device.
inline int multi_tensor_blocks() {
  return at::cuda::getCurrentDeviceProperties()->multiProcessorCount * 4;
}

inline kernels::FloatType float_type(at::ScalarType dtype, const char* op) {
  switch (dtype) {
    case at::kFloat:
      return kernels::FloatType::kFloat32;
    case at::kHalf:
      return kernels::FloatType::kFloat16;
    case at::kBFloat16:
      return kernels::FloatType::kBFloat16;
    case at::kDouble:
      return kernels::FloatType::kFloat64;
    default:
      TORCH_CHECK(false, op, ": unsupported dtype ", dtype);
  }
}

}  // namespace fusetrain::ops::cuda

// Launchers of the mixed-precision CUDA kernels. Pure CUDA: raw pointers,
// sizes, scalars and a stream; no ATen. Each returns the launch's error code.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fusetrain::kernels {

enum class FloatType { kFloat32, kFloat16, kBFloat16, kFloat64 };

/// tensors[i][0, numel[i]) *= *inv_scale (skipped when it is 1); *found_inf = 1
/// if any element is inf or NaN. All tensors share `type`. found_inf and
/// inv_scale are device pointers; nothing is read back to the host.
cudaError_t launch_non_finite_check_and_unscale(FloatType type, void* const* tensors,
                                                const int64_t* numel, int n, float* found_inf,
                                                const float* inv_scale, int max_blocks,
                                                cudaStream_t stream);

/// The loss-scale update of fusetrain::update_scale_ (see ops/amp.h), one thread.
cudaError_t launch_update_scale(float* scale, int32_t* growth_tracker, int32_t* overflow_tracker,
                                const float* found_inf, double growth_factor,
                                double backoff_factor, int64_t growth_interval, double max_scale,
                                int64_t hysteresis, cudaStream_t stream);

}  // namespace fusetrain::kernels

// Mixed-precision CUDA kernels: multi-tensor non-finite check + unscale, and
// the one-thread loss-scale update. CPU references: csrc/ops/cpu/amp_cpu.cpp.
#include "amp_kernels.h"
#include "multi_tensor_apply.cuh"
#include "vec.cuh"

namespace fusetrain::kernels {

namespace {

// Elements are read once, checked and multiplied in fp32 (fp64 for double),
// and written back only when inv_scale != 1. A non-finite element makes its
// thread write 1 to found_inf: a benign race, every writer writes the same.
template <typename T>
struct UnscaleOp {
  float* found_inf;
  const float* inv_scale;

  __device__ void operator()(const TensorListMeta<1>& meta, int t, int64_t start,
                             int64_t n) const {
    T* x = static_cast<T*>(meta.ptrs[0][t]) + start;
    const float inv = *inv_scale;
    const bool scale = inv != 1.f;
    bool bad = false;
    int64_t i = 0;
    if (is_aligned16(x)) {
      using P = Pack<T>;
      const int64_t packs = n / P::kSize;
      for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
        P pack = reinterpret_cast<const P*>(x)[p];
#pragma unroll
        for (int k = 0; k < P::kSize; ++k) {
          const float v = to_float(pack.v[k]);
          bad |= !isfinite(v);
          pack.v[k] = from_float<T>(v * inv);
        }
        if (scale) reinterpret_cast<P*>(x)[p] = pack;
      }
      i = packs * P::kSize;
    }
    for (int64_t j = i + threadIdx.x; j < n; j += blockDim.x) {
      const float v = to_float(x[j]);
      bad |= !isfinite(v);
      if (scale) x[j] = from_float<T>(v * inv);
    }
    if (bad) *found_inf = 1.f;
  }
};

// double is read and scaled in double, as torch's kernels do for it.
template <>
struct UnscaleOp<double> {
  float* found_inf;
  const float* inv_scale;

  __device__ void operator()(const TensorListMeta<1>& meta, int t, int64_t start,
                             int64_t n) const {
    double* x = static_cast<double*>(meta.ptrs[0][t]) + start;
    const double inv = *inv_scale;
    const bool scale = inv != 1.0;
    bool bad = false;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const double v = x[j];
      bad |= !isfinite(v);
      if (scale) x[j] = v * inv;
    }
    if (bad) *found_inf = 1.f;
  }
};

template <typename T>
cudaError_t launch_unscale(void* const* tensors, const int64_t* numel, int n, float* found_inf,
                           const float* inv_scale, int max_blocks, cudaStream_t stream) {
  void* const* ptrs[1] = {tensors};
  return multi_tensor_apply<1>(ptrs, numel, n, max_blocks, stream,
                               UnscaleOp<T>{found_inf, inv_scale});
}

__global__ void update_scale_kernel(float* scale, int32_t* growth_tracker,
                                    int32_t* overflow_tracker, const float* found_inf,
                                    double growth_factor, double backoff_factor,
                                    int64_t growth_interval, double max_scale,
                                    int64_t hysteresis) {
  if (*found_inf != 0.f) {
    *growth_tracker = 0;
    if (*overflow_tracker + 1 > hysteresis) {
      *scale = static_cast<float>(*scale * backoff_factor);
      *overflow_tracker = 0;
    } else {
      *overflow_tracker += 1;
    }
  } else if (*growth_tracker + 1 == growth_interval) {
    // std::min's NaN semantics (the CPU reference's): a NaN scale stays NaN
    // and is refused below, where fmin would replace it with max_scale.
    const double wanted = *scale * growth_factor;
    const float grown = static_cast<float>(max_scale < wanted ? max_scale : wanted);
    if (isfinite(grown)) *scale = grown;
    *growth_tracker = 0;
    *overflow_tracker = 0;
  } else {
    *growth_tracker += 1;
  }
}

}  // namespace

cudaError_t launch_non_finite_check_and_unscale(FloatType type, void* const* tensors,
                                                const int64_t* numel, int n, float* found_inf,
                                                const float* inv_scale, int max_blocks,
                                                cudaStream_t stream) {
  switch (type) {
    case FloatType::kFloat32:
      return launch_unscale<float>(tensors, numel, n, found_inf, inv_scale, max_blocks, stream);
    case FloatType::kFloat16:
      return launch_unscale<__half>(tensors, numel, n, found_inf, inv_scale, max_blocks, stream);
    case FloatType::kBFloat16:
      return launch_unscale<__nv_bfloat16>(tensors, numel, n, found_inf, inv_scale, max_blocks,
                                           stream);
    case FloatType::kFloat64:
      return launch_unscale<double>(tensors, numel, n, found_inf, inv_scale, max_blocks, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_update_scale(float* scale, int32_t* growth_tracker, int32_t* overflow_tracker,
                                const float* found_inf, double growth_factor,
                                double backoff_factor, int64_t growth_interval, double max_scale,
                                int64_t hysteresis, cudaStream_t stream) {
  update_scale_kernel<<<1, 1, 0, stream>>>(scale, growth_tracker, overflow_tracker, found_inf,
                                           growth_factor, backoff_factor, growth_interval,
                                           max_scale, hysteresis);
  return cudaGetLastError();
}

}  // namespace fusetrain::kernels

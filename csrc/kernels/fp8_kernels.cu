// Float8 quantisation kernels: amax, the scale update and the saturating cast
// (with the amax of the tensor taken in the same pass for delayed scaling).
// CPU reference: csrc/ops/fp8.cpp; the scaling rule both use: fp8_scaling.h.
#include "fp8_kernels.h"
#include "fp8_scaling.h"
#include "vec.cuh"

#include <cuda_fp8.h>

namespace fusetrain::kernels {

namespace {

constexpr int kThreads = 512;

// Max over the block of a per-thread value (kBlock threads, a multiple of
// 32); the result is valid in thread 0.
template <int kBlock>
__device__ uint32_t block_max(uint32_t v) {
  static_assert(kBlock % 32 == 0 && kBlock <= 1024, "block of whole warps");
  __shared__ uint32_t warp_max[kBlock / 32];
  for (int offset = 16; offset > 0; offset >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kBlock / 32 ? warp_max[lane] : 0u;
    for (int offset = 16; offset > 0; offset >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// Non-finite inputs keep torch's cast (fp8_scaling.h); finite ones are scaled,
// clamped to the format's range (a product that rounded to inf included) and
// rounded to nearest even, as the CPU op does.
template <bool kE5M2>
__device__ __forceinline__ uint8_t to_fp8(float x, float scale) {
  if (fp8::abs_bits(x) >= fp8::kInfBits) return fp8::non_finite_byte(x, kE5M2);
  constexpr float kMax = kE5M2 ? fp8::kE5M2Max : fp8::kE4M3Max;
  const float v = fminf(fmaxf(x * scale, -kMax), kMax);
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, kE5M2 ? __NV_E5M2 : __NV_E4M3);
}

template <int N>
struct alignas(N) Bytes {
  uint8_t b[N];
};

template <typename T>
__global__ void __launch_bounds__(kThreads) amax_kernel(const T* x, int64_t n, uint32_t* amax) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  uint32_t m = 0;
  int64_t tail = 0;
  if (is_aligned16(x)) {
    using P = Pack<T>;
    const int64_t packs = n / P::kSize;
    for (int64_t p = tid; p < packs; p += stride) {
      const P pack = reinterpret_cast<const P*>(x)[p];
#pragma unroll
      for (int k = 0; k < P::kSize; ++k) m = max(m, fp8::abs_bits(to_float(pack.v[k])));
    }
    tail = packs * P::kSize;
  }
  for (int64_t i = tail + tid; i < n; i += stride) m = max(m, fp8::abs_bits(to_float(x[i])));
  m = block_max<kThreads>(m);
  if (threadIdx.x == 0 && m != 0) atomicMax(amax, m);
}

// out[i] = fp8(x[i] * *scale); with kAmax also atomically maxes |x| into *amax.
template <typename T, bool kE5M2, bool kAmax>
__global__ void __launch_bounds__(kThreads)
    cast_kernel(const T* x, int64_t n, uint8_t* out, const float* scale_ptr, uint32_t* amax) {
  const float scale = *scale_ptr;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  uint32_t m = 0;
  int64_t tail = 0;
  using P = Pack<T>;
  using B = Bytes<P::kSize>;
  if (is_aligned16(x) && (reinterpret_cast<uintptr_t>(out) % P::kSize) == 0) {
    const int64_t packs = n / P::kSize;
    for (int64_t p = tid; p < packs; p += stride) {
      const P pack = reinterpret_cast<const P*>(x)[p];
      B bytes;
#pragma unroll
      for (int k = 0; k < P::kSize; ++k) {
        const float v = to_float(pack.v[k]);
        if (kAmax) m = max(m, fp8::abs_bits(v));
        bytes.b[k] = to_fp8<kE5M2>(v, scale);
      }
      reinterpret_cast<B*>(out)[p] = bytes;
    }
    tail = packs * P::kSize;
  }
  for (int64_t i = tail + tid; i < n; i += stride) {
    const float v = to_float(x[i]);
    if (kAmax) m = max(m, fp8::abs_bits(v));
    out[i] = to_fp8<kE5M2>(v, scale);
  }
  if (kAmax) {
    m = block_max<kThreads>(m);
    if (threadIdx.x == 0 && m != 0) atomicMax(amax, m);
  }
}

__global__ void current_scale_kernel(float* scale, const float* amax, float fp8_max, int margin) {
  *scale = fp8::scale_from_amax(*amax, *scale, fp8_max, margin);
}

// One block of kMaxAmaxHistory threads: thread i reads history[i - 1] (and
// history[i] for the max) before any thread writes, then stores it at i.
constexpr int kHistoryThreads = static_cast<int>(fp8::kMaxAmaxHistory);

__global__ void __launch_bounds__(kHistoryThreads)
    delayed_scale_kernel(float* scale, float* history, int64_t len, float fp8_max, int margin) {
  const int i = threadIdx.x;
  uint32_t m = 0;
  float shifted = 0.f;
  if (i < len) {
    const uint32_t b = fp8::abs_bits(history[i]);
    if (b < fp8::kInfBits) m = b;
    if (i > 0) shifted = history[i - 1];
  }
  m = block_max<kHistoryThreads>(m);
  __syncthreads();  // every thread has read before any writes
  if (i < len) history[i] = shifted;  // history[0] = 0: the cast maxes this step's amax into it
  if (i == 0) *scale = fp8::scale_from_amax(fp8::bits_float(m), *scale, fp8_max, margin);
}

int grid_for(int64_t n, int pack, int max_blocks) {
  const int64_t work = (n / pack) + (n % pack);
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 1 ? 1 : (blocks < max_blocks ? blocks : max_blocks));
}

template <typename T, bool kAmax>
cudaError_t launch_cast(const T* x, int64_t n, Fp8Type out_type, uint8_t* out, const float* scale,
                        uint32_t* amax, int max_blocks, cudaStream_t stream) {
  const int grid = grid_for(n, Pack<T>::kSize, max_blocks);
  if (out_type == Fp8Type::kE5M2) {
    cast_kernel<T, true, kAmax><<<grid, kThreads, 0, stream>>>(x, n, out, scale, amax);
  } else {
    cast_kernel<T, false, kAmax><<<grid, kThreads, 0, stream>>>(x, n, out, scale, amax);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t quantize_current(const T* x, int64_t n, Fp8Type out_type, uint8_t* out, float* scale,
                             float* amax, int margin, int max_blocks, cudaStream_t stream) {
  const float fp8_max = out_type == Fp8Type::kE5M2 ? fp8::kE5M2Max : fp8::kE4M3Max;
  cudaError_t err = cudaMemsetAsync(amax, 0, sizeof(float), stream);
  if (err != cudaSuccess) return err;
  if (n > 0) {
    amax_kernel<T><<<grid_for(n, Pack<T>::kSize, max_blocks), kThreads, 0, stream>>>(
        x, n, reinterpret_cast<uint32_t*>(amax));
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  current_scale_kernel<<<1, 1, 0, stream>>>(scale, amax, fp8_max, margin);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  if (n == 0) return cudaSuccess;
  return launch_cast<T, false>(x, n, out_type, out, scale, nullptr, max_blocks, stream);
}

template <typename T>
cudaError_t quantize_delayed(const T* x, int64_t n, Fp8Type out_type, uint8_t* out, float* scale,
                             float* history, int64_t len, int margin, int max_blocks,
                             cudaStream_t stream) {
  const float fp8_max = out_type == Fp8Type::kE5M2 ? fp8::kE5M2Max : fp8::kE4M3Max;
  if (len < 1 || len > fp8::kMaxAmaxHistory) return cudaErrorInvalidValue;
  delayed_scale_kernel<<<1, kHistoryThreads, 0, stream>>>(scale, history, len, fp8_max, margin);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || n == 0) return err;
  return launch_cast<T, true>(x, n, out_type, out, scale, reinterpret_cast<uint32_t*>(history),
                              max_blocks, stream);
}

}  // namespace

cudaError_t launch_fp8_quantize_current(FloatType in_type, const void* x, int64_t n,
                                        Fp8Type out_type, uint8_t* out, float* scale,
                                        float* amax, int margin, int max_blocks,
                                        cudaStream_t stream) {
  switch (in_type) {
    case FloatType::kFloat32:
      return quantize_current(static_cast<const float*>(x), n, out_type, out, scale, amax, margin,
                              max_blocks, stream);
    case FloatType::kFloat16:
      return quantize_current(static_cast<const __half*>(x), n, out_type, out, scale, amax,
                              margin, max_blocks, stream);
    case FloatType::kBFloat16:
      return quantize_current(static_cast<const __nv_bfloat16*>(x), n, out_type, out, scale, amax,
                              margin, max_blocks, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t launch_fp8_quantize_delayed(FloatType in_type, const void* x, int64_t n,
                                        Fp8Type out_type, uint8_t* out, float* scale,
                                        float* history, int64_t history_len, int margin,
                                        int max_blocks, cudaStream_t stream) {
  switch (in_type) {
    case FloatType::kFloat32:
      return quantize_delayed(static_cast<const float*>(x), n, out_type, out, scale, history,
                              history_len, margin, max_blocks, stream);
    case FloatType::kFloat16:
      return quantize_delayed(static_cast<const __half*>(x), n, out_type, out, scale, history,
                              history_len, margin, max_blocks, stream);
    case FloatType::kBFloat16:
      return quantize_delayed(static_cast<const __nv_bfloat16*>(x), n, out_type, out, scale,
                              history, history_len, margin, max_blocks, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace fusetrain::kernels

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

// Note [Float8 cast + transpose]
// The float8 backward needs each operand in both layouts: x [rows, cols]
// row-major for one GEMM and its transpose for the other (CUDA's _scaled_mm
// takes its second operand column-major, and wants the reduced dimension a
// multiple of 16, so the transpose gets zero columns up to padded_rows).
// Rather than a cast and then torch's copy kernel for the transpose and the
// padding, one kernel writes both: a block casts a 64 x 64 tile (4 threads
// per row, 16 consecutive elements each: 16-byte loads and one 16-byte store
// where aligned), stages its bytes in shared memory, and after a barrier
// writes the tile's columns as rows of out_t (4 threads per column, 16 rows
// each). The grid covers padded_rows, so the tiles past `rows` write the
// padding's zeros. Shared rows are 68 bytes (17 words): the column reads of
// a warp fall in different banks but for a 2-way conflict.
constexpr int kTile = 64;
constexpr int kTileThreads = 256;
constexpr int kTileRun = kTile * kTile / kTileThreads;  // 16 elements a thread
constexpr int kTileStride = kTile + 4;
static_assert(kTileRun == 16, "one 16-byte store of float8 bytes per thread");

template <typename T, bool kE5M2, bool kAmax>
__global__ void __launch_bounds__(kTileThreads)
    cast_transpose_kernel(const T* x, int64_t rows, int64_t cols, int64_t padded_rows,
                          uint8_t* out, uint8_t* out_t, const float* scale_ptr, uint32_t* amax) {
  __shared__ uint8_t tile[kTile][kTileStride];
  const float scale = *scale_ptr;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * kTile;
  uint32_t m = 0;

  // Cast: tile row r, columns [c, c + 16); rows past `rows` are padding.
  const int r = threadIdx.x / (kTile / kTileRun);
  const int c = threadIdx.x % (kTile / kTileRun) * kTileRun;
  const int64_t i = row0 + r;
  const int64_t j0 = col0 + c;
  Bytes<kTileRun> b;
#pragma unroll
  for (int k = 0; k < kTileRun; ++k) b.b[k] = 0;
  if (i < rows) {
    const T* src = x + i * cols + j0;
    uint8_t* dst = out + i * cols + j0;
    const bool whole = j0 + kTileRun <= cols;
    if (whole && is_aligned16(src)) {
      using P = Pack<T>;
#pragma unroll
      for (int a = 0; a < kTileRun / P::kSize; ++a) {
        const P pack = reinterpret_cast<const P*>(src)[a];
#pragma unroll
        for (int k = 0; k < P::kSize; ++k) {
          const float v = to_float(pack.v[k]);
          if (kAmax) m = max(m, fp8::abs_bits(v));
          b.b[a * P::kSize + k] = to_fp8<kE5M2>(v, scale);
        }
      }
    } else {
      for (int k = 0; k < kTileRun && j0 + k < cols; ++k) {
        const float v = to_float(src[k]);
        if (kAmax) m = max(m, fp8::abs_bits(v));
        b.b[k] = to_fp8<kE5M2>(v, scale);
      }
    }
    if (whole && is_aligned16(dst)) {
      *reinterpret_cast<Bytes<kTileRun>*>(dst) = b;
    } else {
      for (int k = 0; k < kTileRun && j0 + k < cols; ++k) dst[k] = b.b[k];
    }
  }
#pragma unroll
  for (int k = 0; k < kTileRun; ++k) tile[r][c + k] = b.b[k];
  __syncthreads();

  // Transpose: tile column jj becomes rows [ii, ii + 16) of out_t's row col0 + jj.
  const int jj = threadIdx.x / (kTile / kTileRun);
  const int ii = threadIdx.x % (kTile / kTileRun) * kTileRun;
  const int64_t j = col0 + jj;
  const int64_t i0 = row0 + ii;
  if (j < cols && i0 < padded_rows) {
    Bytes<kTileRun> t;
#pragma unroll
    for (int k = 0; k < kTileRun; ++k) t.b[k] = tile[ii + k][jj];
    uint8_t* dst = out_t + j * padded_rows + i0;
    if (i0 + kTileRun <= padded_rows && is_aligned16(dst)) {
      *reinterpret_cast<Bytes<kTileRun>*>(dst) = t;
    } else {
      for (int k = 0; k < kTileRun && i0 + k < padded_rows; ++k) dst[k] = t.b[k];
    }
  }
  if (kAmax) {
    m = block_max<kTileThreads>(m);
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

// The cast of quantize_current or quantize_delayed: into `out` alone, or
// (out_t given) into both layouts, Note [Float8 cast + transpose].
struct CastTarget {
  uint8_t* out;
  uint8_t* out_t;  // null: no transpose
  int64_t rows;
  int64_t cols;
  int64_t padded_rows;
};

template <typename T, bool kAmax>
cudaError_t launch_cast_to(const T* x, const CastTarget& to, Fp8Type out_type, const float* scale,
                           uint32_t* amax, int max_blocks, cudaStream_t stream) {
  if (to.out_t == nullptr) {
    const int64_t n = to.rows * to.cols;
    if (n == 0) return cudaSuccess;
    return launch_cast<T, kAmax>(x, n, out_type, to.out, scale, amax, max_blocks, stream);
  }
  const int64_t row_tiles = (to.padded_rows + kTile - 1) / kTile;
  const int64_t col_tiles = (to.cols + kTile - 1) / kTile;
  if (row_tiles == 0 || col_tiles == 0) return cudaSuccess;
  if (row_tiles > INT32_MAX || col_tiles > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(row_tiles), static_cast<unsigned>(col_tiles));
  if (out_type == Fp8Type::kE5M2) {
    cast_transpose_kernel<T, true, kAmax><<<grid, kTileThreads, 0, stream>>>(
        x, to.rows, to.cols, to.padded_rows, to.out, to.out_t, scale, amax);
  } else {
    cast_transpose_kernel<T, false, kAmax><<<grid, kTileThreads, 0, stream>>>(
        x, to.rows, to.cols, to.padded_rows, to.out, to.out_t, scale, amax);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t quantize_current(const T* x, const CastTarget& to, Fp8Type out_type, float* scale,
                             float* amax, int margin, int max_blocks, cudaStream_t stream) {
  const float fp8_max = out_type == Fp8Type::kE5M2 ? fp8::kE5M2Max : fp8::kE4M3Max;
  const int64_t n = to.rows * to.cols;
  cudaError_t err = cudaMemsetAsync(amax, 0, sizeof(float), stream);
  if (err != cudaSuccess) return err;
  if (n > 0) {
    amax_kernel<T><<<grid_for(n, Pack<T>::kSize, max_blocks), kThreads, 0, stream>>>(
        x, n, reinterpret_cast<uint32_t*>(amax));
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  current_scale_kernel<<<1, 1, 0, stream>>>(scale, amax, fp8_max, margin);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  return launch_cast_to<T, false>(x, to, out_type, scale, nullptr, max_blocks, stream);
}

template <typename T>
cudaError_t quantize_delayed(const T* x, const CastTarget& to, Fp8Type out_type, float* scale,
                             float* history, int64_t len, int margin, int max_blocks,
                             cudaStream_t stream) {
  const float fp8_max = out_type == Fp8Type::kE5M2 ? fp8::kE5M2Max : fp8::kE4M3Max;
  if (len < 1 || len > fp8::kMaxAmaxHistory) return cudaErrorInvalidValue;
  delayed_scale_kernel<<<1, kHistoryThreads, 0, stream>>>(scale, history, len, fp8_max, margin);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return launch_cast_to<T, true>(x, to, out_type, scale, reinterpret_cast<uint32_t*>(history),
                                 max_blocks, stream);
}

// Calls f(x as const T*) for the input's element type.
template <typename F>
cudaError_t dispatch_input(FloatType in_type, const void* x, F&& f) {
  switch (in_type) {
    case FloatType::kFloat32:
      return f(static_cast<const float*>(x));
    case FloatType::kFloat16:
      return f(static_cast<const __half*>(x));
    case FloatType::kBFloat16:
      return f(static_cast<const __nv_bfloat16*>(x));
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_fp8_quantize_current(FloatType in_type, const void* x, int64_t n,
                                        Fp8Type out_type, uint8_t* out, float* scale,
                                        float* amax, int margin, int max_blocks,
                                        cudaStream_t stream) {
  const CastTarget to{out, nullptr, 1, n, n};
  return dispatch_input(in_type, x, [&](auto* typed) {
    return quantize_current(typed, to, out_type, scale, amax, margin, max_blocks, stream);
  });
}

cudaError_t launch_fp8_quantize_delayed(FloatType in_type, const void* x, int64_t n,
                                        Fp8Type out_type, uint8_t* out, float* scale,
                                        float* history, int64_t history_len, int margin,
                                        int max_blocks, cudaStream_t stream) {
  const CastTarget to{out, nullptr, 1, n, n};
  return dispatch_input(in_type, x, [&](auto* typed) {
    return quantize_delayed(typed, to, out_type, scale, history, history_len, margin, max_blocks,
                            stream);
  });
}

cudaError_t launch_fp8_quantize_current_transpose(FloatType in_type, const void* x, int64_t rows,
                                                  int64_t cols, int64_t padded_rows,
                                                  Fp8Type out_type, uint8_t* out, uint8_t* out_t,
                                                  float* scale, float* amax, int margin,
                                                  int max_blocks, cudaStream_t stream) {
  if (padded_rows < rows || out_t == nullptr) return cudaErrorInvalidValue;
  const CastTarget to{out, out_t, rows, cols, padded_rows};
  return dispatch_input(in_type, x, [&](auto* typed) {
    return quantize_current(typed, to, out_type, scale, amax, margin, max_blocks, stream);
  });
}

cudaError_t launch_fp8_quantize_delayed_transpose(FloatType in_type, const void* x, int64_t rows,
                                                  int64_t cols, int64_t padded_rows,
                                                  Fp8Type out_type, uint8_t* out, uint8_t* out_t,
                                                  float* scale, float* history,
                                                  int64_t history_len, int margin, int max_blocks,
                                                  cudaStream_t stream) {
  if (padded_rows < rows || out_t == nullptr) return cudaErrorInvalidValue;
  const CastTarget to{out, out_t, rows, cols, padded_rows};
  return dispatch_input(in_type, x, [&](auto* typed) {
    return quantize_delayed(typed, to, out_type, scale, history, history_len, margin, max_blocks,
                            stream);
  });
}

}  // namespace fusetrain::kernels

// Fused layer / RMS norm CUDA kernels (Note [Fused norms] in csrc/ops/norm.h)
// and the deterministic column sums that finish their weight gradients. CPU
// reference: csrc/ops/cpu/norm_cpu.cpp.
//
// Note [Norm row kernels]
// A group of kThreads threads owns a row: a warp for rows of up to 512
// elements (four rows per block), a block of 128 or 512 threads up to 2048
// or 8192. Thread `lane` of the group owns the columns of chunks lane,
// lane + kThreads, ... of V = 16 / sizeof(T) elements each, kItems = 16
// elements in all, and keeps them in registers: the forward reads each input
// row once, sums it, then passes over the registers for the centred variance
// and the output; the backward reads grad_out and the normed row once for
// both of its row sums. Chunks are 16-byte accesses where the row (of each
// array separately) starts on a boundary that allows them, else element by
// element; a row's last chunk stops at its width. Columns go to threads by
// their index, not their address, so a thread owns the same columns in every
// row: that is what lets it add up the weight and bias gradients of all the
// rows of its group in registers (Note [Deterministic column sums]). Rows
// wider than 8192 take a looped kernel of 512 threads that reads the row
// again for each pass (three reads in the forward, two in the backward)
// instead of holding it. Statistics and sums are fp32; each group reduces
// with warp butterflies and then, across warps, every thread adds the warp
// sums in the same order, so all threads hold the same bits and the result
// does not depend on scheduling.
//
// Note [Deterministic column sums]
// Gradients summed over rows (weight, bias) never use float atomics. The
// backward runs a fixed number of row groups for a given shape (group g
// takes rows g, g + G, ...), each adding its rows in order into fp32
// registers (global scratch for the looped kernel, each column always
// updated by the same thread) and writing one row of partial sums to a
// scratch [G, width]; launch_column_sums then adds the G partials of each
// column in a fixed order and rounds once. G is chosen from the shape alone
// (enough groups to fill a large GPU, fewer when there are fewer rows), so
// the bits are the same on every run and every device.
#include "norm_kernels.h"
#include "vec.cuh"

#include <algorithm>

namespace fusetrain::kernels {

namespace {

// Elements a thread holds on the fast path: 16 fp32 registers per held
// array keeps the backward (two held arrays, two accumulators) within the
// 128 registers a thread of a 512-thread block may use.
constexpr int kItems = 16;
constexpr int kWideThreads = 512;
// Fast-path limits (elements a row) of the 32-, 128- and 512-thread groups.
constexpr int64_t kWarpWidth = 32 * kItems;
constexpr int64_t kMidWidth = 128 * kItems;
constexpr int64_t kBlockWidth = 512 * kItems;
// Threads in flight when the backward accumulates weight partials: about
// what a large GPU keeps resident. Fewer groups would leave SMs idle, more
// would only grow the scratch.
constexpr int64_t kPartialThreads = int64_t{1} << 17;
// Row groups of the looped backward with partials: its partial rows are as
// wide as its rows, so fewer than the threads alone would ask for.
constexpr int64_t kWidePartialGroups = 128;
// Groups of a launch without partials; groups loop over the rows beyond.
constexpr int64_t kMaxGroups = int64_t{1} << 20;
constexpr int kSumColumns = 32;
constexpr int kSumSlices = 8;

template <int kThreads>
struct RowGroup {
  static constexpr int kBlock = kThreads == 32 ? 128 : kThreads;
  static constexpr int kRowsPerBlock = kBlock / kThreads;
};

// V elements of U moved as one access: 16 bytes, 8 (four 16-bit values) or
// two 16-byte accesses (eight floats).
template <typename U, int V>
struct alignas(V * sizeof(U) >= 16 ? 16 : V * sizeof(U)) Chunk {
  U v[V];
};

template <typename U, int V>
__device__ __forceinline__ bool chunk_aligned(const void* row) {
  return reinterpret_cast<uintptr_t>(row) % alignof(Chunk<U, V>) == 0;
}

// Elements [j0, j0 + V) of a row as floats, 0 past its width; one access
// when the row start allows it and the chunk is whole.
template <typename U, int V>
__device__ __forceinline__ void load_chunk(const U* row, int64_t j0, int64_t width, bool aligned,
                                           float (&out)[V]) {
  if (aligned && j0 + V <= width) {
    const Chunk<U, V> c = *reinterpret_cast<const Chunk<U, V>*>(row + j0);
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = to_float(c.v[k]);
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = j0 + k < width ? to_float(row[j0 + k]) : 0.f;
  }
}

template <typename U, int V>
__device__ __forceinline__ void store_chunk(U* row, int64_t j0, int64_t width, bool aligned,
                                            const float (&in)[V]) {
  if (aligned && j0 + V <= width) {
    Chunk<U, V> c;
#pragma unroll
    for (int k = 0; k < V; ++k) c.v[k] = from_float<U>(in[k]);
    *reinterpret_cast<Chunk<U, V>*>(row + j0) = c;
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      if (j0 + k < width) row[j0 + k] = from_float<U>(in[k]);
    }
  }
}

// A weight or bias chunk: float32 or T (a uniform branch), `absent` where
// there is none.
template <typename T, int V>
__device__ __forceinline__ void load_param(const void* p, bool is_float, int64_t j0, int64_t width,
                                           float absent, float (&out)[V]) {
  if (p == nullptr) {
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = absent;
  } else if (is_float) {
    load_chunk<float, V>(static_cast<const float*>(p), j0, width, chunk_aligned<float, V>(p), out);
  } else {
    load_chunk<T, V>(static_cast<const T*>(p), j0, width, chunk_aligned<T, V>(p), out);
  }
}

// Sums each of v[0, N) over the group; every thread of the group gets the
// same bits (Note [Norm row kernels]). kThreads > 32: one group a block,
// reached by all its threads.
template <int kThreads, int N>
__device__ __forceinline__ void group_sum(float (&v)[N]) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
#pragma unroll
    for (int n = 0; n < N; ++n) v[n] += __shfl_xor_sync(0xffffffffu, v[n], offset);
  }
  if constexpr (kThreads > 32) {
    constexpr int kWarps = kThreads / 32;
    __shared__ float warp_sums[N][kWarps];
    if (threadIdx.x % 32 == 0) {
#pragma unroll
      for (int n = 0; n < N; ++n) warp_sums[n][threadIdx.x / 32] = v[n];
    }
    __syncthreads();
#pragma unroll
    for (int n = 0; n < N; ++n) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s += warp_sums[n][w];
      v[n] = s;
    }
    // The next call's writes wait until every thread has read these.
    __syncthreads();
  }
}

// The row sum (x + residual, rounded to T) of chunk [j0, j0 + V): read from
// the input and residual, stored to residual_out when there is a residual.
template <typename T, int V>
__device__ __forceinline__ void load_sum(const T* x, const T* r, T* r_out, int64_t j0,
                                         int64_t width, bool x_aligned, bool r_aligned,
                                         bool r_out_aligned, float (&v)[V]) {
  load_chunk<T, V>(x, j0, width, x_aligned, v);
  if (r == nullptr) return;
  float rv[V];
  load_chunk<T, V>(r, j0, width, r_aligned, rv);
#pragma unroll
  for (int k = 0; k < V; ++k) v[k] = to_float(from_float<T>(v[k] + rv[k]));
  store_chunk<T, V>(r_out, j0, width, r_out_aligned, v);
}

// The forward's rows, as the kernels index them.
template <typename T, typename O>
struct ForwardRow {
  const T* x;
  const T* r;
  T* r_out;
  O* out;
  bool x_aligned, r_aligned, r_out_aligned, out_aligned;

  __device__ __forceinline__ ForwardRow(const NormForwardArgs& a, int64_t row) {
    constexpr int V = 16 / sizeof(T);
    const int64_t at = row * a.width;
    x = static_cast<const T*>(a.input) + at;
    r = a.residual == nullptr ? nullptr : static_cast<const T*>(a.residual) + at;
    r_out = r == nullptr ? nullptr : static_cast<T*>(a.residual_out) + at;
    out = static_cast<O*>(a.out) + at;
    x_aligned = chunk_aligned<T, V>(x);
    r_aligned = chunk_aligned<T, V>(r);
    r_out_aligned = chunk_aligned<T, V>(r_out);
    out_aligned = chunk_aligned<O, V>(out);
  }
};

// out = (v - mean) * rstd * weight + bias for one chunk.
template <typename T, typename O, int V>
__device__ __forceinline__ void write_out(const NormForwardArgs& a, const ForwardRow<T, O>& rw,
                                          int64_t j0, float mean, float rstd, const float (&v)[V]) {
  const bool w_float = a.weight_type == FloatType::kFloat32;
  const bool b_float = a.bias_type == FloatType::kFloat32;
  float w[V], b[V], y[V];
  load_param<T, V>(a.weight, w_float, j0, a.width, 1.f, w);
  load_param<T, V>(a.bias, b_float, j0, a.width, 0.f, b);
#pragma unroll
  for (int k = 0; k < V; ++k) y[k] = (v[k] - mean) * rstd * w[k] + b[k];
  store_chunk<O, V>(rw.out, j0, a.width, rw.out_aligned, y);
}

// mean (layer norm) and rstd from the row's sum (of squares, for RMS norm)
// and the centred sum of squares; written once per row.
__device__ __forceinline__ float rstd_of(float mean_square, float eps) {
  // Not rsqrtf: IEEE sqrt and division give the same bits here and in the
  // emulator, rsqrtf's approximation does not.
  return 1.f / sqrtf(mean_square + eps);
}

template <typename T, typename O, int kThreads>
__global__ void __launch_bounds__(RowGroup<kThreads>::kBlock)
    forward_kernel(const NormForwardArgs a) {
  using G = RowGroup<kThreads>;
  constexpr int V = 16 / sizeof(T);
  constexpr int kPacks = kItems / V;
  const int lane = threadIdx.x % kThreads;
  const int64_t groups = static_cast<int64_t>(gridDim.x) * G::kRowsPerBlock;
  const float width = static_cast<float>(a.width);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * G::kRowsPerBlock + threadIdx.x / kThreads;
       row < a.rows; row += groups) {
    const ForwardRow<T, O> rw(a, row);
    float v[kPacks][V];
    float sum[1] = {0.f};
#pragma unroll
    for (int i = 0; i < kPacks; ++i) {
      const int64_t j0 = static_cast<int64_t>(lane + i * kThreads) * V;
      if (j0 < a.width) {
        load_sum<T, V>(rw.x, rw.r, rw.r_out, j0, a.width, rw.x_aligned, rw.r_aligned,
                       rw.r_out_aligned, v[i]);
      } else {
#pragma unroll
        for (int k = 0; k < V; ++k) v[i][k] = 0.f;
      }
#pragma unroll
      for (int k = 0; k < V; ++k) sum[0] += a.rms ? v[i][k] * v[i][k] : v[i][k];
    }
    group_sum<kThreads>(sum);
    float mean = 0.f;
    float square = sum[0] / width;
    if (!a.rms) {
      mean = sum[0] / width;
      float centred[1] = {0.f};
#pragma unroll
      for (int i = 0; i < kPacks; ++i) {
        const int64_t j0 = static_cast<int64_t>(lane + i * kThreads) * V;
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const float d = v[i][k] - mean;
          centred[0] += j0 + k < a.width ? d * d : 0.f;
        }
      }
      group_sum<kThreads>(centred);
      square = centred[0] / width;
    }
    const float rstd = rstd_of(square, a.eps);
    if (lane == 0) {
      if (!a.rms) a.mean[row] = mean;
      a.rstd[row] = rstd;
    }
#pragma unroll
    for (int i = 0; i < kPacks; ++i) {
      const int64_t j0 = static_cast<int64_t>(lane + i * kThreads) * V;
      if (j0 < a.width) write_out<T, O, V>(a, rw, j0, mean, rstd, v[i]);
    }
  }
}

// Rows wider than the fast path's: each pass reads the row again (the sum
// from residual_out once the first pass has written it, each thread reading
// back only its own writes).
template <typename T, typename O>
__global__ void __launch_bounds__(kWideThreads) forward_wide_kernel(const NormForwardArgs a) {
  constexpr int V = 16 / sizeof(T);
  const float width = static_cast<float>(a.width);
  const int64_t step = static_cast<int64_t>(kWideThreads) * V;
  const int64_t first = static_cast<int64_t>(threadIdx.x) * V;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const ForwardRow<T, O> rw(a, row);
    // After the first pass: the row's sums, wherever they now are.
    const T* s = rw.r == nullptr ? rw.x : rw.r_out;
    const bool s_aligned = rw.r == nullptr ? rw.x_aligned : rw.r_out_aligned;
    float sum[1] = {0.f};
    for (int64_t j0 = first; j0 < a.width; j0 += step) {
      float v[V];
      load_sum<T, V>(rw.x, rw.r, rw.r_out, j0, a.width, rw.x_aligned, rw.r_aligned,
                     rw.r_out_aligned, v);
#pragma unroll
      for (int k = 0; k < V; ++k) sum[0] += a.rms ? v[k] * v[k] : v[k];
    }
    group_sum<kWideThreads>(sum);
    float mean = 0.f;
    float square = sum[0] / width;
    if (!a.rms) {
      mean = sum[0] / width;
      float centred[1] = {0.f};
      for (int64_t j0 = first; j0 < a.width; j0 += step) {
        float v[V];
        load_chunk<T, V>(s, j0, a.width, s_aligned, v);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const float d = v[k] - mean;
          centred[0] += j0 + k < a.width ? d * d : 0.f;
        }
      }
      group_sum<kWideThreads>(centred);
      square = centred[0] / width;
    }
    const float rstd = rstd_of(square, a.eps);
    if (threadIdx.x == 0) {
      if (!a.rms) a.mean[row] = mean;
      a.rstd[row] = rstd;
    }
    for (int64_t j0 = first; j0 < a.width; j0 += step) {
      float v[V];
      load_chunk<T, V>(s, j0, a.width, s_aligned, v);
      write_out<T, O, V>(a, rw, j0, mean, rstd, v);
    }
  }
}

// The backward's rows, as the kernels index them.
template <typename T, typename O>
struct BackwardRow {
  const O* go;
  const T* x;
  const T* gr;
  T* gi;
  bool go_aligned, x_aligned, gr_aligned, gi_aligned;

  __device__ __forceinline__ BackwardRow(const NormBackwardArgs& a, int64_t row) {
    constexpr int V = 16 / sizeof(T);
    const int64_t at = row * a.width;
    go = static_cast<const O*>(a.grad_out) + at;
    x = static_cast<const T*>(a.normed) + at;
    gr = a.grad_residual_out == nullptr ? nullptr : static_cast<const T*>(a.grad_residual_out) + at;
    gi = a.grad_input == nullptr ? nullptr : static_cast<T*>(a.grad_input) + at;
    go_aligned = chunk_aligned<O, V>(go);
    x_aligned = chunk_aligned<T, V>(x);
    gr_aligned = chunk_aligned<T, V>(gr);
    gi_aligned = chunk_aligned<T, V>(gi);
  }
};

// One chunk's grad_out, xhat and g = grad_out * weight.
template <typename T, typename O, int V>
__device__ __forceinline__ void load_backward_chunk(const NormBackwardArgs& a,
                                                    const BackwardRow<T, O>& rw, int64_t j0,
                                                    float mean, float rstd, float (&go)[V],
                                                    float (&xhat)[V], float (&g)[V]) {
  float w[V];
  load_chunk<O, V>(rw.go, j0, a.width, rw.go_aligned, go);
  load_chunk<T, V>(rw.x, j0, a.width, rw.x_aligned, xhat);
  load_param<T, V>(a.weight, a.weight_type == FloatType::kFloat32, j0, a.width, 1.f, w);
#pragma unroll
  for (int k = 0; k < V; ++k) {
    xhat[k] = (xhat[k] - mean) * rstd;
    g[k] = go[k] * w[k];
  }
}

// grad_input of one chunk from the row's mean(g) (0 for RMS norm) and
// mean(g * xhat).
template <typename T, typename O, int V>
__device__ __forceinline__ void write_grad_input(const NormBackwardArgs& a,
                                                 const BackwardRow<T, O>& rw, int64_t j0,
                                                 float rstd, float mean_g, float mean_gx,
                                                 const float (&xhat)[V], const float (&g)[V]) {
  float gi[V];
#pragma unroll
  for (int k = 0; k < V; ++k) gi[k] = rstd * (g[k] - mean_g - xhat[k] * mean_gx);
  if (rw.gr != nullptr) {
    float gr[V];
    load_chunk<T, V>(rw.gr, j0, a.width, rw.gr_aligned, gr);
#pragma unroll
    for (int k = 0; k < V; ++k) gi[k] += gr[k];
  }
  store_chunk<T, V>(rw.gi, j0, a.width, rw.gi_aligned, gi);
}

// Where the weight and bias partials of group g go (null: not wanted).
struct Partials {
  float* weight;
  float* bias;
};

__host__ __device__ __forceinline__ Partials partials_of(const NormBackwardArgs& a,
                                                         int64_t groups) {
  const bool weight = a.grad_weight != nullptr;
  const bool bias = a.grad_bias != nullptr;
  return {weight ? a.scratch : nullptr,
          bias ? a.scratch + (weight ? groups * a.width : 0) : nullptr};
}

template <typename T, typename O, int kThreads>
__global__ void __launch_bounds__(RowGroup<kThreads>::kBlock)
    backward_kernel(const NormBackwardArgs a) {
  using G = RowGroup<kThreads>;
  constexpr int V = 16 / sizeof(T);
  constexpr int kPacks = kItems / V;
  const int lane = threadIdx.x % kThreads;
  const int64_t groups = static_cast<int64_t>(gridDim.x) * G::kRowsPerBlock;
  const int64_t group =
      static_cast<int64_t>(blockIdx.x) * G::kRowsPerBlock + threadIdx.x / kThreads;
  const float width = static_cast<float>(a.width);
  const Partials part = partials_of(a, groups);
  float dw[kPacks][V] = {};
  float db[kPacks][V] = {};
  for (int64_t row = group; row < a.rows; row += groups) {
    const BackwardRow<T, O> rw(a, row);
    const float mean = a.mean == nullptr ? 0.f : a.mean[row];
    const float rstd = a.rstd[row];
    float xhat[kPacks][V];
    float g[kPacks][V];
    float sums[2] = {0.f, 0.f};  // of g and g * xhat
#pragma unroll
    for (int i = 0; i < kPacks; ++i) {
      const int64_t j0 = static_cast<int64_t>(lane + i * kThreads) * V;
      float go[V];
      if (j0 < a.width) {
        load_backward_chunk<T, O, V>(a, rw, j0, mean, rstd, go, xhat[i], g[i]);
      } else {
#pragma unroll
        for (int k = 0; k < V; ++k) go[k] = xhat[i][k] = g[i][k] = 0.f;
      }
#pragma unroll
      for (int k = 0; k < V; ++k) {
        sums[0] += g[i][k];
        sums[1] += g[i][k] * xhat[i][k];
        dw[i][k] += go[k] * xhat[i][k];
        db[i][k] += go[k];
      }
    }
    if (rw.gi == nullptr) continue;
    group_sum<kThreads>(sums);
    const float mean_g = a.mean == nullptr ? 0.f : sums[0] / width;
    const float mean_gx = sums[1] / width;
#pragma unroll
    for (int i = 0; i < kPacks; ++i) {
      const int64_t j0 = static_cast<int64_t>(lane + i * kThreads) * V;
      if (j0 < a.width) write_grad_input<T, O, V>(a, rw, j0, rstd, mean_g, mean_gx, xhat[i], g[i]);
    }
  }
  // Every group writes its partial row, zeros when it had no rows.
#pragma unroll
  for (int i = 0; i < kPacks; ++i) {
    const int64_t j0 = static_cast<int64_t>(lane + i * kThreads) * V;
    if (j0 >= a.width) continue;
    if (part.weight != nullptr) {
      float* p = part.weight + group * a.width;
      store_chunk<float, V>(p, j0, a.width, chunk_aligned<float, V>(p), dw[i]);
    }
    if (part.bias != nullptr) {
      float* p = part.bias + group * a.width;
      store_chunk<float, V>(p, j0, a.width, chunk_aligned<float, V>(p), db[i]);
    }
  }
}

// partial[j0, j0 + V) = add (the group's first row) or += add, in fp32:
// each column of a group's partial row is only ever touched by one thread.
template <int V>
__device__ __forceinline__ void accumulate(float* partial, int64_t j0, int64_t width, bool first,
                                           const float (&add)[V]) {
  const bool aligned = chunk_aligned<float, V>(partial);
  float acc[V];
  if (first) {
    store_chunk<float, V>(partial, j0, width, aligned, add);
    return;
  }
  load_chunk<float, V>(partial, j0, width, aligned, acc);
#pragma unroll
  for (int k = 0; k < V; ++k) acc[k] += add[k];
  store_chunk<float, V>(partial, j0, width, aligned, acc);
}

// The looped backward of wide rows: one block a group, at least one row
// each (the launcher's grid); the partials accumulate in the scratch.
template <typename T, typename O>
__global__ void __launch_bounds__(kWideThreads) backward_wide_kernel(const NormBackwardArgs a) {
  constexpr int V = 16 / sizeof(T);
  const float width = static_cast<float>(a.width);
  const int64_t step = static_cast<int64_t>(kWideThreads) * V;
  const int64_t first = static_cast<int64_t>(threadIdx.x) * V;
  const int64_t group = blockIdx.x;
  const Partials part = partials_of(a, gridDim.x);
  for (int64_t row = group; row < a.rows; row += gridDim.x) {
    const BackwardRow<T, O> rw(a, row);
    const float mean = a.mean == nullptr ? 0.f : a.mean[row];
    const float rstd = a.rstd[row];
    float mean_g = 0.f;
    float mean_gx = 0.f;
    if (rw.gi != nullptr) {
      float sums[2] = {0.f, 0.f};
      for (int64_t j0 = first; j0 < a.width; j0 += step) {
        float go[V], xhat[V], g[V];
        load_backward_chunk<T, O, V>(a, rw, j0, mean, rstd, go, xhat, g);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          sums[0] += g[k];
          sums[1] += g[k] * xhat[k];
        }
      }
      group_sum<kWideThreads>(sums);
      if (a.mean != nullptr) mean_g = sums[0] / width;
      mean_gx = sums[1] / width;
    }
    for (int64_t j0 = first; j0 < a.width; j0 += step) {
      float go[V], xhat[V], g[V];
      load_backward_chunk<T, O, V>(a, rw, j0, mean, rstd, go, xhat, g);
      if (rw.gi != nullptr) write_grad_input<T, O, V>(a, rw, j0, rstd, mean_g, mean_gx, xhat, g);
      if (part.weight != nullptr) {
        float dw[V];
#pragma unroll
        for (int k = 0; k < V; ++k) dw[k] = go[k] * xhat[k];
        accumulate<V>(part.weight + group * a.width, j0, a.width, row == group, dw);
      }
      if (part.bias != nullptr)
        accumulate<V>(part.bias + group * a.width, j0, a.width, row == group, go);
    }
  }
}

// Columns in blocks of 32; each of 8 slices adds every 8th partial row in
// order, then the first slice adds the 8 slice sums in order.
template <typename W>
__global__ void __launch_bounds__(kSumColumns* kSumSlices)
    column_sum_kernel(const float* __restrict__ partials, int64_t parts, int64_t width,
                      W* __restrict__ out) {
  __shared__ float slice_sums[kSumSlices][kSumColumns];
  const int column = threadIdx.x % kSumColumns;
  const int slice = threadIdx.x / kSumColumns;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kSumColumns + column;
  float acc = 0.f;
  if (j < width) {
    for (int64_t i = slice; i < parts; i += kSumSlices) acc += partials[i * width + j];
  }
  slice_sums[slice][column] = acc;
  __syncthreads();
  if (slice != 0 || j >= width) return;
  float total = 0.f;
#pragma unroll
  for (int s = 0; s < kSumSlices; ++s) total += slice_sums[s][column];
  out[j] = from_float<W>(total);
}

template <typename T>
struct Tag {
  using type = T;
};

// Calls fn(Tag<T>{}) for the element type of `type` (float, half or
// bfloat16); other types are refused.
template <typename Fn>
cudaError_t with_type(FloatType type, Fn&& fn) {
  switch (type) {
    case FloatType::kFloat32:
      fn(Tag<float>{});
      return cudaSuccess;
    case FloatType::kFloat16:
      fn(Tag<__half>{});
      return cudaSuccess;
    case FloatType::kBFloat16:
      fn(Tag<__nv_bfloat16>{});
      return cudaSuccess;
    default:
      return cudaErrorInvalidValue;
  }
}

// The group size of a row width (Note [Norm row kernels]); 0: the looped
// kernel.
int threads_for(int64_t width) {
  if (width <= kWarpWidth) return 32;
  if (width <= kMidWidth) return 128;
  if (width <= kBlockWidth) return 512;
  return 0;
}

int rows_per_block(int threads) { return threads == 32 ? RowGroup<32>::kRowsPerBlock : 1; }

// Blocks of a backward launch; groups = blocks * rows_per_block. With
// partials: about kPartialThreads threads (the looped kernel: at most
// kWidePartialGroups, and no more than there are rows, as its groups start
// their partials from their first row).
int64_t backward_blocks(const NormBackwardArgs& a) {
  const int threads = threads_for(a.width);
  const bool partials = a.grad_weight != nullptr || a.grad_bias != nullptr;
  if (threads == 0) return std::min<int64_t>(a.rows, partials ? kWidePartialGroups : kMaxGroups);
  const int per_block = rows_per_block(threads);
  const int64_t cap = (partials ? kPartialThreads / threads : kMaxGroups) / per_block;
  return std::min<int64_t>((a.rows + per_block - 1) / per_block, cap);
}

bool valid_param_type(FloatType param, FloatType type) {
  return param == FloatType::kFloat32 || param == type;
}

}  // namespace

cudaError_t launch_norm_forward(const NormForwardArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.width == 0) return cudaSuccess;
  if ((a.weight != nullptr && !valid_param_type(a.weight_type, a.type)) ||
      (a.bias != nullptr && !valid_param_type(a.bias_type, a.type))) {
    return cudaErrorInvalidValue;
  }
  const int threads = threads_for(a.width);
  cudaError_t err = cudaSuccess;
  const cudaError_t type_err = with_type(a.type, [&](auto t) {
    using T = typename decltype(t)::type;
    err = with_type(a.out_type, [&](auto o) {
      using O = typename decltype(o)::type;
      if (threads == 0) {
        const auto blocks = static_cast<unsigned>(std::min<int64_t>(a.rows, kMaxGroups));
        forward_wide_kernel<T, O><<<blocks, kWideThreads, 0, stream>>>(a);
        return;
      }
      const int per_block = rows_per_block(threads);
      const auto blocks = static_cast<unsigned>(
          std::min<int64_t>((a.rows + per_block - 1) / per_block, kMaxGroups / per_block));
      if (threads == 32) {
        forward_kernel<T, O, 32><<<blocks, RowGroup<32>::kBlock, 0, stream>>>(a);
      } else if (threads == 128) {
        forward_kernel<T, O, 128><<<blocks, RowGroup<128>::kBlock, 0, stream>>>(a);
      } else {
        forward_kernel<T, O, 512><<<blocks, RowGroup<512>::kBlock, 0, stream>>>(a);
      }
    });
  });
  if (type_err != cudaSuccess) return type_err;
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

int64_t norm_backward_scratch_floats(const NormBackwardArgs& a) {
  const int64_t wanted = (a.grad_weight != nullptr) + (a.grad_bias != nullptr);
  if (wanted == 0 || a.rows == 0) return 0;
  const int threads = threads_for(a.width);
  const int64_t groups = backward_blocks(a) * (threads == 0 ? 1 : rows_per_block(threads));
  return wanted * groups * a.width;
}

cudaError_t launch_norm_backward(const NormBackwardArgs& a, cudaStream_t stream) {
  if (a.width == 0) return cudaSuccess;
  if ((a.weight != nullptr && !valid_param_type(a.weight_type, a.type)) ||
      (a.grad_weight != nullptr &&
       (a.weight == nullptr || !valid_param_type(a.weight_type, a.type))) ||
      (a.grad_bias != nullptr && !valid_param_type(a.bias_type, a.type))) {
    return cudaErrorInvalidValue;
  }
  const int threads = threads_for(a.width);
  const int64_t blocks = a.rows == 0 ? 0 : backward_blocks(a);
  const int64_t groups = blocks * (threads == 0 ? 1 : rows_per_block(threads));
  const bool partials = a.grad_weight != nullptr || a.grad_bias != nullptr;
  if (blocks > 0 && (a.grad_input != nullptr || partials)) {
    cudaError_t err = cudaSuccess;
    const cudaError_t type_err = with_type(a.type, [&](auto t) {
      using T = typename decltype(t)::type;
      err = with_type(a.grad_out_type, [&](auto o) {
        using O = typename decltype(o)::type;
        const auto grid = static_cast<unsigned>(blocks);
        if (threads == 0) {
          backward_wide_kernel<T, O><<<grid, kWideThreads, 0, stream>>>(a);
        } else if (threads == 32) {
          backward_kernel<T, O, 32><<<grid, RowGroup<32>::kBlock, 0, stream>>>(a);
        } else if (threads == 128) {
          backward_kernel<T, O, 128><<<grid, RowGroup<128>::kBlock, 0, stream>>>(a);
        } else {
          backward_kernel<T, O, 512><<<grid, RowGroup<512>::kBlock, 0, stream>>>(a);
        }
      });
    });
    if (type_err != cudaSuccess) return type_err;
    if (err != cudaSuccess) return err;
    const cudaError_t launch_err = cudaGetLastError();
    if (launch_err != cudaSuccess) return launch_err;
  }
  const Partials part = partials_of(a, groups);
  if (a.grad_weight != nullptr) {
    const cudaError_t err =
        launch_column_sums(part.weight, groups, a.width, a.weight_type, a.grad_weight, stream);
    if (err != cudaSuccess) return err;
  }
  if (a.grad_bias != nullptr) {
    return launch_column_sums(part.bias, groups, a.width, a.bias_type, a.grad_bias, stream);
  }
  return cudaSuccess;
}

cudaError_t launch_column_sums(const float* partials, int64_t parts, int64_t width,
                               FloatType out_type, void* out, cudaStream_t stream) {
  if (width == 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned>((width + kSumColumns - 1) / kSumColumns);
  const cudaError_t err = with_type(out_type, [&](auto w) {
    using W = typename decltype(w)::type;
    column_sum_kernel<W><<<blocks, kSumColumns * kSumSlices, 0, stream>>>(partials, parts, width,
                                                                          static_cast<W*>(out));
  });
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

}  // namespace fusetrain::kernels

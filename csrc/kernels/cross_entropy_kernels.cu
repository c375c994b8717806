// Fused softmax cross-entropy CUDA kernels. CPU reference:
// csrc/ops/cpu/cross_entropy_cpu.cpp.
//
// Note [Cross-entropy row kernels]
// A group of threads owns a row: one warp for narrow rows (four rows per
// block), a whole block for wide ones. Each thread walks its share of the row
// in 16-byte packs (elements before the first 16-byte boundary and after the
// last one go one at a time, so any C and any row offset work) and keeps an
// online log-sum-exp: its running maximum m and s = sum exp(x - m), rescaled
// only when a pack raises the maximum. The group then merges the (m, s)
// pairs. The forward thus reads every logit once and writes 8 bytes per row;
// the backward reads the logits and the saved lse once and writes the
// gradient once. All arithmetic is fp32 whatever the logits' type, except
// the once-per-row finish of the forward (lse and loss), done in fp64.
#include "cross_entropy_kernels.h"
#include "vec.cuh"

#include <stdio.h>

// The device-side assert behind assert() and torch's CUDA_KERNEL_ASSERT;
// declared here because glibc's <assert.h> hides it under NDEBUG.
extern "C" __host__ __device__ void __assert_fail(const char* assertion, const char* file,
                                                  unsigned int line, const char* function) noexcept
    __attribute__((__noreturn__));

namespace fusetrain::kernels {

namespace {

constexpr int kReduceBlock = 1024;

template <int kRowThreads>
struct RowGroup {
  static constexpr int kBlock = kRowThreads == 32 ? 128 : kRowThreads;
  static constexpr int kRowsPerBlock = kBlock / kRowThreads;
};

// Online log-sum-exp of a thread's elements, plus their plain sum (for label
// smoothing).
struct Stats {
  float m;
  float s;
  float sum;
};

// Subtracting 0 instead of a -inf maximum keeps exp(-inf - m) at 0 rather
// than NaN while a thread has seen only -inf; NaN logits still give NaN.
__device__ __forceinline__ float finite_shift(float m) { return m == -INFINITY ? 0.f : m; }

__device__ __forceinline__ void add_element(Stats& st, float v) {
  if (v > st.m) {
    st.s *= __expf(st.m - v);
    st.m = v;
  }
  st.s += __expf(v - finite_shift(st.m));
  st.sum += v;
}

template <int K>
__device__ __forceinline__ void add_pack(Stats& st, const float (&v)[K]) {
  float pm = v[0];
#pragma unroll
  for (int k = 1; k < K; ++k) pm = fmaxf(pm, v[k]);
  if (pm > st.m) {
    st.s *= __expf(st.m - pm);
    st.m = pm;
  }
  const float shift = finite_shift(st.m);
  float s = 0.f;
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    s += __expf(v[k] - shift);
    sum += v[k];
  }
  st.s += s;
  st.sum += sum;
}

// Merges two partial results; a side whose maximum is the merged one keeps
// its sum as is (which also covers two -inf maxima).
__device__ __forceinline__ Stats merge(const Stats& a, const Stats& b) {
  const float m = fmaxf(a.m, b.m);
  const float sa = a.m == m ? a.s : a.s * __expf(a.m - m);
  const float sb = b.m == m ? b.s : b.s * __expf(b.m - m);
  return {m, sa + sb, a.sum + b.sum};
}

__device__ __forceinline__ Stats warp_merge(Stats st) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const Stats other{__shfl_xor_sync(0xffffffffu, st.m, offset),
                      __shfl_xor_sync(0xffffffffu, st.s, offset),
                      __shfl_xor_sync(0xffffffffu, st.sum, offset)};
    st = merge(st, other);
  }
  return st;
}

// The row's merged Stats, valid in the group's first thread.
template <int kRowThreads>
__device__ __forceinline__ Stats group_merge(Stats st) {
  st = warp_merge(st);
  if constexpr (kRowThreads > 32) {
    constexpr int kWarps = kRowThreads / 32;
    __shared__ Stats partial[kWarps];
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (lane == 0) partial[warp] = st;
    __syncthreads();
    if (warp == 0) {
      st = lane < kWarps ? partial[lane] : Stats{-INFINITY, 0.f, 0.f};
      st = warp_merge(st);
    }
  }
  return st;
}

__device__ __forceinline__ void check_target(int64_t row, int64_t t, int64_t c,
                                             int64_t ignore_index) {
  if (t != ignore_index && (t < 0 || t >= c)) {
    printf(
        "fusetrain::softmax_cross_entropy: target[%lld] = %lld is out of range for %lld "
        "classes (ignore_index = %lld)\n",
        static_cast<long long>(row), static_cast<long long>(t), static_cast<long long>(c),
        static_cast<long long>(ignore_index));
    // Not assert(): release builds define NDEBUG, and this must still stop.
    __assert_fail("target in [0, C) or == ignore_index", __FILE__, __LINE__, __func__);
  }
}

// Elements before the row's first 16-byte boundary.
template <typename T>
__device__ __forceinline__ int64_t head_elements(const T* p, int64_t c) {
  const int64_t head = ((16 - (reinterpret_cast<uintptr_t>(p) & 15)) & 15) / sizeof(T);
  return head < c ? head : c;
}

// Calls fn(p, packs[p]) for p = lane, lane + kRowThreads, ... < num_packs,
// issuing four loads before using any: enough bytes in flight per thread to
// cover memory latency at the occupancy these kernels reach.
template <int kRowThreads, typename P, typename Fn>
__device__ __forceinline__ void for_each_pack(const P* __restrict__ packs, int64_t num_packs,
                                              int lane, Fn&& fn) {
  constexpr int kUnroll = 4;
  int64_t p = lane;
  for (; p + (kUnroll - 1) * kRowThreads < num_packs; p += kUnroll * kRowThreads) {
    P batch[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) batch[u] = packs[p + u * kRowThreads];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) fn(p + u * kRowThreads, batch[u]);
  }
  for (; p < num_packs; p += kRowThreads) fn(p, packs[p]);
}

template <typename T, int kRowThreads>
__global__ void __launch_bounds__(RowGroup<kRowThreads>::kBlock)
    forward_kernel(const T* __restrict__ logits, int64_t row_stride,
                   const int64_t* __restrict__ target, int64_t n, int64_t c, int64_t ignore_index,
                   float label_smoothing, float* __restrict__ row_loss, float* __restrict__ lse) {
  using G = RowGroup<kRowThreads>;
  using P = Pack<T>;
  const int64_t row =
      static_cast<int64_t>(blockIdx.x) * G::kRowsPerBlock + threadIdx.x / kRowThreads;
  // Whole groups leave together, so the group's shuffles and barrier stay
  // uniform.
  if (row >= n) return;
  const int lane = threadIdx.x % kRowThreads;
  const T* x = logits + row * row_stride;

  Stats st{-INFINITY, 0.f, 0.f};
  const int64_t head = head_elements(x, c);
  for (int64_t j = lane; j < head; j += kRowThreads) add_element(st, to_float(x[j]));
  const P* packs = reinterpret_cast<const P*>(x + head);
  const int64_t num_packs = (c - head) / P::kSize;
  for_each_pack<kRowThreads>(packs, num_packs, lane, [&](int64_t, const P& pack) {
    float v[P::kSize];
#pragma unroll
    for (int k = 0; k < P::kSize; ++k) v[k] = to_float(pack.v[k]);
    add_pack(st, v);
  });
  for (int64_t j = head + num_packs * P::kSize + lane; j < c; j += kRowThreads) {
    add_element(st, to_float(x[j]));
  }

  st = group_merge<kRowThreads>(st);
  if (lane != 0) return;
  const int64_t t = target[row];
  check_target(row, t, c, ignore_index);
  // Once per row, so in double: the loss is a small difference of lse and a
  // logit, rounded once.
  const double row_lse = static_cast<double>(finite_shift(st.m)) + log(static_cast<double>(st.s));
  lse[row] = static_cast<float>(row_lse);
  if (t == ignore_index) {
    row_loss[row] = 0.f;
    return;
  }
  // As the CPU version: (1 - ls) * nll + ls * mean_j(-log p_j).
  const double ls = label_smoothing;
  const double nll = row_lse - static_cast<double>(to_float(x[t]));
  row_loss[row] = static_cast<float>(
      ls == 0.0 ? nll : (1.0 - ls) * nll + ls * (row_lse - static_cast<double>(st.sum) / c));
}

// `grad` may be `logits` itself (row_stride == c): each thread reads each of
// its elements once, before writing that element's gradient, so neither
// pointer is __restrict__.
template <typename T, int kRowThreads>
__global__ void __launch_bounds__(RowGroup<kRowThreads>::kBlock)
    backward_kernel(const T* logits, int64_t row_stride,
                    const int64_t* __restrict__ target, const float* __restrict__ lse,
                    const float* __restrict__ grad_loss, bool per_row,
                    const float* __restrict__ kept_rows, int64_t n, int64_t c, int64_t ignore_index,
                    float label_smoothing, T* grad) {
  using G = RowGroup<kRowThreads>;
  using P = Pack<T>;
  const int64_t row =
      static_cast<int64_t>(blockIdx.x) * G::kRowsPerBlock + threadIdx.x / kRowThreads;
  if (row >= n) return;
  const int lane = threadIdx.x % kRowThreads;
  const T* x = logits + row * row_stride;
  T* g = grad + row * c;
  const int64_t t = target[row];
  const int64_t head = head_elements(g, c);
  const int64_t num_packs = (c - head) / P::kSize;
  const int64_t tail = head + num_packs * P::kSize;

  if (t == ignore_index) {
    const T zero = from_float<T>(0.f);
    P zeros;
#pragma unroll
    for (int k = 0; k < P::kSize; ++k) zeros.v[k] = zero;
    for (int64_t j = lane; j < head; j += kRowThreads) g[j] = zero;
    for (int64_t p = lane; p < num_packs; p += kRowThreads)
      reinterpret_cast<P*>(g + head)[p] = zeros;
    for (int64_t j = tail + lane; j < c; j += kRowThreads) g[j] = zero;
    return;
  }
  if (lane == 0) check_target(row, t, c, ignore_index);

  float scale = grad_loss[per_row ? row : 0];
  if (kept_rows != nullptr) scale /= *kept_rows;
  const float row_lse = lse[row];
  const float smooth = label_smoothing / static_cast<float>(c);
  const float hot = 1.f - label_smoothing;
  auto grad_of = [&](int64_t j, float v) {
    return (__expf(v - row_lse) - smooth - (j == t ? hot : 0.f)) * scale;
  };

  // Packs need the logits and the gradient rows equally misaligned, as they
  // are for contiguous logits; other row strides go element by element.
  const bool packed =
      (reinterpret_cast<uintptr_t>(x) & 15) == (reinterpret_cast<uintptr_t>(g) & 15);
  if (!packed) {
    for (int64_t j = lane; j < c; j += kRowThreads)
      g[j] = from_float<T>(grad_of(j, to_float(x[j])));
    return;
  }
  for (int64_t j = lane; j < head; j += kRowThreads)
    g[j] = from_float<T>(grad_of(j, to_float(x[j])));
  const P* in = reinterpret_cast<const P*>(x + head);
  P* out = reinterpret_cast<P*>(g + head);
  for_each_pack<kRowThreads>(in, num_packs, lane, [&](int64_t p, const P& pack) {
    P result;
    const int64_t j0 = head + p * P::kSize;
#pragma unroll
    for (int k = 0; k < P::kSize; ++k) {
      result.v[k] = from_float<T>(grad_of(j0 + k, to_float(pack.v[k])));
    }
    out[p] = result;
  });
  for (int64_t j = tail + lane; j < c; j += kRowThreads)
    g[j] = from_float<T>(grad_of(j, to_float(x[j])));
}

// One block: the sum of row_loss (double accumulation, fixed order, so
// deterministic) and the count of kept rows. Writes *out = the sum or, when
// `mean`, the sum over the count (when out is given: row_loss is then too),
// and *kept_out = the count (when given).
__global__ void __launch_bounds__(kReduceBlock)
    reduce_kernel(const float* __restrict__ row_loss, const int64_t* __restrict__ target, int64_t n,
                  int64_t ignore_index, bool mean, float* __restrict__ out,
                  float* __restrict__ kept_out) {
  double sum = 0.0;
  long long kept = 0;
  for (int64_t i = threadIdx.x; i < n; i += kReduceBlock) {
    if (out != nullptr) sum += row_loss[i];
    kept += target[i] != ignore_index;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    kept += __shfl_xor_sync(0xffffffffu, kept, offset);
  }
  __shared__ double sums[kReduceBlock / 32];
  __shared__ long long counts[kReduceBlock / 32];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (lane == 0) {
    sums[warp] = sum;
    counts[warp] = kept;
  }
  __syncthreads();
  if (warp != 0) return;
  sum = sums[lane];
  kept = counts[lane];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    kept += __shfl_xor_sync(0xffffffffu, kept, offset);
  }
  if (lane != 0) return;
  if (kept_out != nullptr) *kept_out = static_cast<float>(kept);
  // No kept rows: 0 / 0 = NaN, torch's mean of an all-ignored batch.
  if (out != nullptr) *out = static_cast<float>(mean ? sum / static_cast<double>(kept) : sum);
}

template <int kRowThreads>
unsigned grid_for(int64_t n) {
  constexpr int kRows = RowGroup<kRowThreads>::kRowsPerBlock;
  return static_cast<unsigned>((n + kRows - 1) / kRows);
}

// Launches one kernel instantiation; by_width picks T's and the row width's.
struct ForwardLaunch {
  const CrossEntropyRows& r;
  float* row_loss;
  float* lse;
  cudaStream_t stream;

  template <typename T, int kRowThreads>
  void operator()() const {
    forward_kernel<T, kRowThreads>
        <<<grid_for<kRowThreads>(r.n), RowGroup<kRowThreads>::kBlock, 0, stream>>>(
            static_cast<const T*>(r.logits), r.row_stride, r.target, r.n, r.c, r.ignore_index,
            r.label_smoothing, row_loss, lse);
  }
};

struct BackwardLaunch {
  const CrossEntropyRows& r;
  const float* grad_loss;
  bool per_row;
  const float* kept_rows;
  const float* lse;
  void* grad;
  cudaStream_t stream;

  template <typename T, int kRowThreads>
  void operator()() const {
    backward_kernel<T, kRowThreads>
        <<<grid_for<kRowThreads>(r.n), RowGroup<kRowThreads>::kBlock, 0, stream>>>(
            static_cast<const T*>(r.logits), r.row_stride, r.target, lse, grad_loss, per_row,
            kept_rows, r.n, r.c, r.ignore_index, r.label_smoothing, static_cast<T*>(grad));
  }
};

// Threads per row: a warp up to 1024 classes (at most 32 elements a lane),
// then a block wide enough that each thread still streams several packs.
template <typename T, typename Launch>
void by_width(int64_t c, const Launch& launch) {
  if (c <= 1024) {
    launch.template operator()<T, 32>();
  } else if (c <= 4096) {
    launch.template operator()<T, 128>();
  } else {
    launch.template operator()<T, 256>();
  }
}

template <typename Launch>
cudaError_t by_type(FloatType type, int64_t c, const Launch& launch) {
  switch (type) {
    case FloatType::kFloat32:
      by_width<float>(c, launch);
      break;
    case FloatType::kFloat16:
      by_width<__half>(c, launch);
      break;
    case FloatType::kBFloat16:
      by_width<__nv_bfloat16>(c, launch);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_cross_entropy_forward(const CrossEntropyRows& rows, float* row_loss, float* lse,
                                         cudaStream_t stream) {
  if (rows.n == 0) return cudaSuccess;
  return by_type(rows.type, rows.c, ForwardLaunch{rows, row_loss, lse, stream});
}

cudaError_t launch_cross_entropy_reduce(const float* row_loss, const int64_t* target, int64_t n,
                                        int64_t ignore_index, bool mean, float* out,
                                        float* kept_out, cudaStream_t stream) {
  reduce_kernel<<<1, kReduceBlock, 0, stream>>>(row_loss, target, n, ignore_index, mean, out,
                                                kept_out);
  return cudaGetLastError();
}

cudaError_t launch_cross_entropy_backward(const CrossEntropyRows& rows, const float* grad_loss,
                                          bool per_row, bool mean, const float* kept_rows,
                                          float* count_scratch, const float* lse, void* grad,
                                          cudaStream_t stream) {
  if (rows.n == 0 || rows.c == 0) return cudaSuccess;
  if (!mean) {
    kept_rows = nullptr;
  } else if (kept_rows == nullptr) {
    reduce_kernel<<<1, kReduceBlock, 0, stream>>>(nullptr, rows.target, rows.n, rows.ignore_index,
                                                  false, nullptr, count_scratch);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    kept_rows = count_scratch;
  }
  return by_type(rows.type, rows.c,
                 BackwardLaunch{rows, grad_loss, per_row, kept_rows, lse, grad, stream});
}

}  // namespace fusetrain::kernels

// Fused optimizer and norm CUDA kernels over multi-tensor launches (Note
// [Multi-tensor launch layout]). Every element is read and written once, in
// fp32 math; an overflow flag read on the device turns a step into a no-op.
#include "multi_tensor_apply.cuh"
#include "optim_kernels.h"
#include "vec.cuh"

#include <algorithm>
#include <type_traits>

namespace fusetrain::kernels {

namespace {

// Elements a thread handles per iteration: as many as make one 16-byte access
// of the op's narrowest array (4 for fp32 only, 8 where a 16-bit array takes
// part), so every access of a chunk moves 16 bytes when every array is
// 16-byte aligned; the fp32 arrays of a 16-bit op move 2 x 16 bytes.
template <typename... T>
constexpr int kIlpOf = static_cast<int>(16 / std::min({sizeof(T)...}));

template <typename T>
__device__ __forceinline__ bool aligned_or_null(const T* p) {
  return p == nullptr || is_aligned16(p);
}

// dst[k] = src[i + k] for k < N (0 past n): as N / Pack<T>::kSize 16-byte
// loads when `vectorized` (src 16-byte aligned and i + N <= n; i is a
// multiple of N, so each load is aligned too), else one element at a time.
template <int N, typename T>
__device__ __forceinline__ void load_vec(float (&dst)[N], const T* src, int64_t i, int64_t n,
                                         bool vectorized) {
  using P = Pack<T>;
  static_assert(N % P::kSize == 0, "whole 16-byte packs");
  if (vectorized) {
#pragma unroll
    for (int a = 0; a < N / P::kSize; ++a) {
      const P pack = reinterpret_cast<const P*>(src + i)[a];
#pragma unroll
      for (int k = 0; k < P::kSize; ++k) dst[a * P::kSize + k] = to_float(pack.v[k]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) dst[k] = i + k < n ? to_float(src[i + k]) : 0.f;
  }
}

template <int N, typename T>
__device__ __forceinline__ void store_vec(T* dst, const float (&src)[N], int64_t i, int64_t n,
                                          bool vectorized) {
  using P = Pack<T>;
  static_assert(N % P::kSize == 0, "whole 16-byte packs");
  if (vectorized) {
#pragma unroll
    for (int a = 0; a < N / P::kSize; ++a) {
      P pack;
#pragma unroll
      for (int k = 0; k < P::kSize; ++k) pack.v[k] = from_float<T>(src[a * P::kSize + k]);
      reinterpret_cast<P*>(dst + i)[a] = pack;
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (i + k < n) dst[i + k] = from_float<T>(src[k]);
    }
  }
}

// The value of a device scalar, or `fallback` when it has none.
__device__ __forceinline__ double read_or(const DeviceScalar& d, double fallback) {
  if (d.ptr == nullptr) return fallback;
  return d.is_double ? *static_cast<const double*>(d.ptr)
                     : static_cast<double>(*static_cast<const float*>(d.ptr));
}

// Note [Unscaled gradients after a fused step]
// With a grad_scale the optimizers divide each gradient by it (a division,
// not a multiplication by the reciprocal: the same rounding as torch's fused
// optimizers for any scale) and write the quotient back to the gradient, as
// torch's fused AdamW/Adam/SGD do, so p.grad holds the unscaled gradient
// after scaler.step(). A skipped step (found_inf) leaves the gradients as
// they were.
template <int N, typename P>
__device__ __forceinline__ void unscale_into_grads(P* g, float (&rg)[N], float scale, int64_t i,
                                                   int64_t n, bool vectorized) {
#pragma unroll
  for (int k = 0; k < N; ++k) rg[k] = rg[k] / scale;
  store_vec(g, rg, i, n, vectorized);
}

// ------------------------------------------------------------------- Adam

template <typename P, typename S>
struct AdamOp {
  AdamScalars s;

  __device__ void operator()(const TensorListMeta<7>& meta, int t, int64_t start,
                             int64_t n) const {
    if (s.found_inf != nullptr && *s.found_inf != 0.f) return;
    P* p = static_cast<P*>(meta.ptrs[0][t]) + start;
    P* g = static_cast<P*>(meta.ptrs[1][t]) + start;
    S* m = static_cast<S*>(meta.ptrs[2][t]) + start;
    S* v = static_cast<S*>(meta.ptrs[3][t]) + start;
    S* vmax = s.amsgrad ? static_cast<S*>(meta.ptrs[4][t]) + start : nullptr;
    float* master = meta.ptrs[5][t] != nullptr ? static_cast<float*>(meta.ptrs[5][t]) + start
                                               : nullptr;
    // The step count is incremented by a later launch; this one sees step - 1.
    const double step = static_cast<double>(*static_cast<const float*>(meta.ptrs[6][t])) + 1.0;
    const double lr = read_or(s.lr_device, s.lr);
    // As the host forms it (csrc/ops/cuda/optim_cuda.cpp), in double, rounded once.
    // No FMA contraction: the host rounds the product, then the difference.
    const float decay = s.lr_device.ptr != nullptr
                            ? static_cast<float>(__dsub_rn(1.0, __dmul_rn(lr, s.weight_decay64)))
                            : s.decay;
    const float step_size = static_cast<float>(lr / (1.0 - pow(s.beta1, step)));
    const float bc2_sqrt = static_cast<float>(sqrt(1.0 - pow(s.beta2, step)));
    const float* scale = s.grad_scale;
    const float beta1 = static_cast<float>(s.beta1), beta2 = static_cast<float>(s.beta2);

    constexpr int kIlp = kIlpOf<P, S>;
    const bool vec = is_aligned16(p) && is_aligned16(g) && is_aligned16(m) && is_aligned16(v) &&
                     aligned_or_null(vmax) && aligned_or_null(master);
    for (int64_t i = static_cast<int64_t>(threadIdx.x) * kIlp; i < n;
         i += static_cast<int64_t>(blockDim.x) * kIlp) {
      const bool full = vec && i + kIlp <= n;
      float rp[kIlp], rg[kIlp], rm[kIlp], rv[kIlp], rx[kIlp];
      load_vec(rg, g, i, n, full);
      if (master != nullptr) {
        load_vec(rp, master, i, n, full);
      } else {
        load_vec(rp, p, i, n, full);
      }
      load_vec(rm, m, i, n, full);
      load_vec(rv, v, i, n, full);
      if (vmax != nullptr) load_vec(rx, vmax, i, n, full);
      if (scale != nullptr) unscale_into_grads(g, rg, *scale, i, n, full);
#pragma unroll
      for (int k = 0; k < kIlp; ++k) {
        float grad = rg[k];
        if (s.maximize) grad = -grad;
        float param = rp[k];
        if (s.weight_decay != 0.f) {
          if (s.decoupled_weight_decay) {
            param *= decay;
          } else {
            grad += s.weight_decay * param;
          }
        }
        rm[k] = beta1 * rm[k] + s.one_minus_beta1 * grad;
        rv[k] = beta2 * rv[k] + s.one_minus_beta2 * grad * grad;
        float second = rv[k];
        if (vmax != nullptr) {
          rx[k] = rx[k] < rv[k] ? rv[k] : rx[k];  // std::max(vmax, v): a NaN vmax stays
          second = rx[k];
        }
        const float denom = sqrtf(second) / bc2_sqrt + s.eps;
        rp[k] = param - step_size * rm[k] / denom;
      }
      store_vec(m, rm, i, n, full);
      store_vec(v, rv, i, n, full);
      if (vmax != nullptr) store_vec(vmax, rx, i, n, full);
      if (master != nullptr) store_vec(master, rp, i, n, full);
      store_vec(p, rp, i, n, full);
    }
  }
};

// Step counters travel in the kernel's parameter block: one thread per
// counter (a multi-tensor grid of 512-thread blocks per one-float tensor
// would waste all but one thread of each block).
struct StepBlock {
  static constexpr int kMax = (kParamBytes - 16) / 8;
  float* step[kMax];
  int32_t count;
};

// step += 1 unless the step was skipped. The op's checks make every counter
// a distinct tensor, so no two threads add to one float.
__global__ void increment_steps_kernel(const __grid_constant__ StepBlock b, const float* found_inf) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= b.count || (found_inf != nullptr && *found_inf != 0.f)) return;
  *b.step[i] += 1.f;
}

cudaError_t launch_increment_steps(void* const* steps, int n, const float* found_inf,
                                   cudaStream_t stream) {
  StepBlock b;
  for (int first = 0; first < n; first += StepBlock::kMax) {
    b.count = n - first < StepBlock::kMax ? n - first : StepBlock::kMax;
    for (int i = 0; i < b.count; ++i) b.step[i] = static_cast<float*>(steps[first + i]);
    increment_steps_kernel<<<(b.count + 255) / 256, 256, 0, stream>>>(b, found_inf);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <typename P, typename S>
cudaError_t launch_adam_typed(const AdamTensors& t, const AdamScalars& s, int max_blocks,
                              cudaStream_t stream) {
  void* const* ptrs[7] = {t.param,          t.grad,   t.exp_avg, t.exp_avg_sq,
                          t.max_exp_avg_sq, t.master, t.step};
  cudaError_t err = multi_tensor_apply<7>(ptrs, t.numel, t.n, max_blocks, stream, AdamOp<P, S>{s});
  if (err != cudaSuccess) return err;
  return launch_increment_steps(t.step, t.n, s.found_inf, stream);
}

// -------------------------------------------------------------------- SGD

template <typename P, typename S>
struct SgdOp {
  SgdScalars s;

  __device__ void operator()(const TensorListMeta<4>& meta, int t, int64_t start,
                             int64_t n) const {
    if (s.found_inf != nullptr && *s.found_inf != 0.f) return;
    P* p = static_cast<P*>(meta.ptrs[0][t]) + start;
    P* g = static_cast<P*>(meta.ptrs[1][t]) + start;
    S* buf = s.has_buffer ? static_cast<S*>(meta.ptrs[2][t]) + start : nullptr;
    float* master = meta.ptrs[3][t] != nullptr ? static_cast<float*>(meta.ptrs[3][t]) + start
                                               : nullptr;
    const float* scale = s.grad_scale;
    const float lr = s.lr_device.ptr != nullptr ? static_cast<float>(read_or(s.lr_device, 0.0)) : s.lr;
    constexpr int kIlp = kIlpOf<P, S>;
    const bool vec =
        is_aligned16(p) && is_aligned16(g) && aligned_or_null(buf) && aligned_or_null(master);
    for (int64_t i = static_cast<int64_t>(threadIdx.x) * kIlp; i < n;
         i += static_cast<int64_t>(blockDim.x) * kIlp) {
      const bool full = vec && i + kIlp <= n;
      float rp[kIlp], rg[kIlp], rb[kIlp];
      load_vec(rg, g, i, n, full);
      if (master != nullptr) {
        load_vec(rp, master, i, n, full);
      } else {
        load_vec(rp, p, i, n, full);
      }
      if (buf != nullptr && !s.is_first_step) load_vec(rb, buf, i, n, full);
      if (scale != nullptr) unscale_into_grads(g, rg, *scale, i, n, full);
#pragma unroll
      for (int k = 0; k < kIlp; ++k) {
        float grad = rg[k];
        if (s.maximize) grad = -grad;
        if (s.weight_decay != 0.f) grad += s.weight_decay * rp[k];
        if (buf != nullptr) {
          rb[k] = s.is_first_step ? grad : s.momentum * rb[k] + s.one_minus_dampening * grad;
          grad = s.nesterov ? grad + s.momentum * rb[k] : rb[k];
        }
        rp[k] = rp[k] - lr * grad;
      }
      if (buf != nullptr) store_vec(buf, rb, i, n, full);
      if (master != nullptr) store_vec(master, rp, i, n, full);
      store_vec(p, rp, i, n, full);
    }
  }
};

template <typename P, typename S>
cudaError_t launch_sgd_typed(const SgdTensors& t, const SgdScalars& s, int max_blocks,
                             cudaStream_t stream) {
  void* const* ptrs[4] = {t.param, t.grad, t.momentum_buffer, t.master};
  return multi_tensor_apply<4>(ptrs, t.numel, t.n, max_blocks, stream, SgdOp<P, S>{s});
}

// Calls f(P{}, S{}) for the parameter type and the state type.
template <typename F>
cudaError_t dispatch_param_state(FloatType type, bool master, F&& f) {
  switch (type) {
    case FloatType::kFloat32:
      return f(float{}, float{});
    case FloatType::kFloat64:  // the glue refuses it: the kernels compute in fp32
      return cudaErrorInvalidValue;
    case FloatType::kFloat16:
      return master ? f(__half{}, float{}) : f(__half{}, __half{});
    case FloatType::kBFloat16:
      return master ? f(__nv_bfloat16{}, float{}) : f(__nv_bfloat16{}, __nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

// ---------------------------------------------------------------- L2 norm

// Sums of squares accumulate in float, and in double for double inputs (as
// the CPU reference does for every input).
template <typename T>
using SquareAcc = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <int kThreads, typename Acc>
__device__ __forceinline__ Acc block_sum(Acc v) {
  __shared__ Acc warp_sums[kThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
  __syncthreads();
  v = threadIdx.x < kThreads / 32 ? warp_sums[threadIdx.x] : Acc(0);
  if (threadIdx.x < 32) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  __syncthreads();
  return v;  // valid in thread 0
}

template <typename T>
struct SumSquaresOp {
  SquareAcc<T>* partials;

  __device__ void operator()(const TensorListMeta<1>& meta, int t, int64_t start,
                             int64_t n) const {
    const T* x = static_cast<const T*>(meta.ptrs[0][t]) + start;
    SquareAcc<T> acc = 0;
    if constexpr (std::is_same_v<T, double>) {
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += x[i] * x[i];
    } else {
      constexpr int kIlp = kIlpOf<T>;
      const bool vec = is_aligned16(x);
      for (int64_t i = static_cast<int64_t>(threadIdx.x) * kIlp; i < n;
           i += static_cast<int64_t>(blockDim.x) * kIlp) {
        float r[kIlp];
        load_vec(r, x, i, n, vec && i + kIlp <= n);
#pragma unroll
        for (int k = 0; k < kIlp; ++k) acc += r[k] * r[k];
      }
    }
    acc = block_sum<kBlockSize>(acc);
    if (threadIdx.x == 0) {
      const int64_t chunk = meta.chunk_offset + meta.first_chunk[t] + start / kChunkSize;
      partials[chunk] = acc;
    }
  }
};

// Index lists travel in the kernel's parameter block, not through a host to
// device copy: a CUDA graph captures them by value, and no pinned staging
// buffer has to outlive the launch.
struct IndexBlock {
  static constexpr int kMax = (kParamBytes - 16) / 4 - 1;
  int32_t v[kMax + 1];
  int32_t count;
};

// One block per tensor sums its chunks' partials in order: tensor t of this
// launch owns partials [b.v[t], b.v[t + 1]) and writes per_tensor_sq[t].
template <typename Acc>
__global__ void per_tensor_sum_kernel(const Acc* partials, const __grid_constant__ IndexBlock b,
                                      Acc* per_tensor_sq) {
  const int t = blockIdx.x;
  Acc acc = 0;
  for (int32_t c = b.v[t] + static_cast<int32_t>(threadIdx.x); c < b.v[t + 1]; c += blockDim.x) {
    acc += partials[c];
  }
  acc = block_sum<256>(acc);
  if (threadIdx.x == 0) per_tensor_sq[t] = acc;
}

// dst[b.v[i]] = src[i] for i < b.count.
template <typename Acc>
__global__ void scatter_kernel(const Acc* src, const __grid_constant__ IndexBlock b, Acc* dst) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < b.count; i += gridDim.x * blockDim.x) {
    dst[b.v[i]] = src[i];
  }
}

template <typename Acc>
cudaError_t launch_scatter_typed(const Acc* src, const int64_t* where, int n, Acc* dst,
                                 cudaStream_t stream) {
  IndexBlock b;
  for (int first = 0; first < n; first += IndexBlock::kMax) {
    b.count = n - first < IndexBlock::kMax ? n - first : IndexBlock::kMax;
    for (int i = 0; i < b.count; ++i) b.v[i] = static_cast<int32_t>(where[first + i]);
    scatter_kernel<<<(b.count + 255) / 256, 256, 0, stream>>>(src + first, b, dst);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <typename T>
cudaError_t launch_sum_squares_typed(void* const* tensors, const int64_t* numel, int n,
                                     void* partials_out, void* per_tensor_out, int max_blocks,
                                     cudaStream_t stream) {
  using Acc = SquareAcc<T>;
  Acc* partials = static_cast<Acc*>(partials_out);
  void* const* ptrs[1] = {tensors};
  cudaError_t err =
      multi_tensor_apply<1>(ptrs, numel, n, max_blocks, stream, SumSquaresOp<T>{partials});
  if (err != cudaSuccess) return err;
  // Tensor i's partials start at the sum of the chunk counts before it (the
  // order multi_tensor_apply numbers chunks in), in launches of kMax tensors.
  IndexBlock b;
  int64_t begin = 0;
  for (int first = 0; first < n; first += IndexBlock::kMax) {
    b.count = n - first < IndexBlock::kMax ? n - first : IndexBlock::kMax;
    for (int i = 0; i < b.count; ++i) {
      b.v[i] = static_cast<int32_t>(begin);
      begin += chunks_of(numel[first + i]);
    }
    b.v[b.count] = static_cast<int32_t>(begin);
    per_tensor_sum_kernel<<<b.count, 256, 0, stream>>>(partials, b,
                                                       static_cast<Acc*>(per_tensor_out) + first);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_fused_adam(FloatType param_type, bool has_master, const AdamTensors& tensors,
                              const AdamScalars& scalars, int max_blocks, cudaStream_t stream) {
  return dispatch_param_state(param_type, has_master, [&](auto ptag, auto stag) {
    return launch_adam_typed<decltype(ptag), decltype(stag)>(tensors, scalars, max_blocks,
                                                             stream);
  });
}

cudaError_t launch_fused_sgd(FloatType param_type, bool has_master, const SgdTensors& tensors,
                             const SgdScalars& scalars, int max_blocks, cudaStream_t stream) {
  return dispatch_param_state(param_type, has_master, [&](auto ptag, auto stag) {
    return launch_sgd_typed<decltype(ptag), decltype(stag)>(tensors, scalars, max_blocks, stream);
  });
}

int64_t chunks_of(int64_t numel) { return (numel + kChunkSize - 1) / kChunkSize; }

cudaError_t launch_scatter(const float* src, const int64_t* where, int n, float* dst,
                           cudaStream_t stream) {
  return launch_scatter_typed(src, where, n, dst, stream);
}

cudaError_t launch_scatter(const double* src, const int64_t* where, int n, double* dst,
                           cudaStream_t stream) {
  return launch_scatter_typed(src, where, n, dst, stream);
}

cudaError_t launch_sum_squares(FloatType type, void* const* tensors, const int64_t* numel,
                               int n, void* partials, void* per_tensor_sq, int max_blocks,
                               cudaStream_t stream) {
  switch (type) {
    case FloatType::kFloat32:
      return launch_sum_squares_typed<float>(tensors, numel, n, partials, per_tensor_sq,
                                             max_blocks, stream);
    case FloatType::kFloat16:
      return launch_sum_squares_typed<__half>(tensors, numel, n, partials, per_tensor_sq,
                                              max_blocks, stream);
    case FloatType::kBFloat16:
      return launch_sum_squares_typed<__nv_bfloat16>(tensors, numel, n, partials, per_tensor_sq,
                                                     max_blocks, stream);
    case FloatType::kFloat64:
      return launch_sum_squares_typed<double>(tensors, numel, n, partials, per_tensor_sq,
                                              max_blocks, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace fusetrain::kernels

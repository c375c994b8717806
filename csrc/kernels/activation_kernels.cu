// Fused bias + GELU and SwiGLU CUDA kernels (Note [Fused activations] in
// csrc/ops/activation.h). CPU reference: csrc/ops/cpu/activation_cpu.cpp.
//
// Note [Activation column tiles]
// The operands are rows of `width` elements. A block of 128 threads owns a
// tile of 128 16-byte packs of columns (blockIdx.x) over a chunk of
// consecutive rows (blockIdx.y), and each thread walks its pack down the
// chunk's rows. The bias of a thread's columns is thus read once per chunk
// and the partial sums of its gradient stay in registers until the chunk's
// end, when each chunk writes one row of partials (Note [Deterministic
// column sums] in norm_kernels.cu: the grid, and so the bits, depend on the
// shape alone). A pack is one 16-byte access where the row of that array
// starts on a 16-byte boundary, element by element otherwise and in a row's
// last, partial pack. There are enough chunks to put about 2^18 threads in
// flight, fewer with fewer rows, at most 65535 (the grid's y limit); a
// tensor without a row structure (no bias, two SwiGLU operands) is best
// handed over as one row. All math is fp32 with the accurate erfcf and expf
// (not __expf), so that the GPU and the emulator agree to an ulp or two.
#include "activation_kernels.h"
#include "norm_kernels.h"  // launch_column_sums
#include "vec.cuh"

#include <algorithm>

namespace fusetrain::kernels {

namespace {

constexpr int kThreads = 128;
constexpr int64_t kTargetThreads = int64_t{1} << 18;
constexpr int64_t kMaxChunks = 65535;

constexpr float kSqrtHalf = 0.70710678118654752440f;    // 1 / sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;  // 1 / sqrt(2 pi)
constexpr float kTanhScale = 0.79788456080286535588f;   // sqrt(2 / pi)
constexpr float kTanhCubic = 0.044715f;

// The launch grid of a rows x width operand of `element_size`-byte elements
// (Note [Activation column tiles]).
struct Tiling {
  int64_t tiles;
  int64_t chunks;
  int64_t rows_per_chunk;
};

Tiling tiling_of(int64_t rows, int64_t width, int element_size) {
  const int64_t per_pack = 16 / element_size;
  const int64_t packs = (width + per_pack - 1) / per_pack;
  const int64_t tiles = (packs + kThreads - 1) / kThreads;
  int64_t chunks = std::max<int64_t>(1, kTargetThreads / (tiles * kThreads));
  chunks = std::min({chunks, rows, kMaxChunks});
  const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
  // No empty chunk: each one that exists writes a row of partials.
  return {tiles, (rows + rows_per_chunk - 1) / rows_per_chunk, rows_per_chunk};
}

int element_size(FloatType type) { return type == FloatType::kFloat32 ? 4 : 2; }

bool valid_type(FloatType type) {
  return type == FloatType::kFloat32 || type == FloatType::kFloat16 || type == FloatType::kBFloat16;
}

// The rows [first, last) of this block's chunk.
struct ChunkRows {
  int64_t first;
  int64_t last;
};

__device__ __forceinline__ ChunkRows chunk_rows(int64_t rows, int64_t rows_per_chunk) {
  const int64_t first = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t end = first + rows_per_chunk;
  return {first, end < rows ? end : rows};
}

// The first column of this thread's pack.
template <typename T>
__device__ __forceinline__ int64_t pack_column() {
  return (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * Pack<T>::kSize;
}

// Elements [j0, j0 + V) of a row as floats (0 past its width).
template <typename T, int V = Pack<T>::kSize>
__device__ __forceinline__ void load_pack(const T* row, int64_t j0, int64_t width,
                                          float (&out)[V]) {
  if (is_aligned16(row) && j0 + V <= width) {
    const Pack<T> p = *reinterpret_cast<const Pack<T>*>(row + j0);
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = to_float(p.v[k]);
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = j0 + k < width ? to_float(row[j0 + k]) : 0.f;
  }
}

template <typename T, int V = Pack<T>::kSize>
__device__ __forceinline__ void store_pack(T* row, int64_t j0, int64_t width,
                                           const float (&in)[V]) {
  if (is_aligned16(row) && j0 + V <= width) {
    Pack<T> p;
#pragma unroll
    for (int k = 0; k < V; ++k) p.v[k] = from_float<T>(in[k]);
    *reinterpret_cast<Pack<T>*>(row + j0) = p;
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      if (j0 + k < width) row[j0 + k] = from_float<T>(in[k]);
    }
  }
}

// The bias of a pack's columns, float32 or T: read once per chunk, so
// element by element.
template <typename T, int V = Pack<T>::kSize>
__device__ __forceinline__ void load_bias(const BiasGeluRows& x, int64_t j0, float (&b)[V]) {
  const bool is_float = x.bias_type == FloatType::kFloat32;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int64_t j = j0 + k;
    b[k] = j >= x.width ? 0.f
           : is_float   ? static_cast<const float*>(x.bias)[j]
                        : to_float(static_cast<const T*>(x.bias)[j]);
  }
}

// input + bias rounded to T, as the unfused x + b; without a bias the input
// as it is (adding +0 would turn -0 into +0).
template <typename T, int V = Pack<T>::kSize>
__device__ __forceinline__ void add_bias(bool has_bias, const float (&b)[V], float (&v)[V]) {
  if (!has_bias) return;
#pragma unroll
  for (int k = 0; k < V; ++k) v[k] = to_float(from_float<T>(v[k] + b[k]));
}

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// Phi(x) as erfc, not 1 + erf: no cancellation for negative x, where gelu
// is a small difference otherwise.
__device__ __forceinline__ float normal_cdf(float x) { return 0.5f * erfcf(-x * kSqrtHalf); }

// The tanh form's 2 sqrt(2/pi) (x + 0.044715 x^3): x/2 (1 + tanh(z / 2)) is
// x sigmoid(z), which again needs no cancellation.
__device__ __forceinline__ float tanh_form_arg(float x) {
  return x * (2.f * kTanhScale + 2.f * kTanhScale * kTanhCubic * x * x);
}

template <bool kTanh>
__device__ __forceinline__ float gelu(float x) {
  if constexpr (kTanh) {
    return x * sigmoid(tanh_form_arg(x));
  } else {
    return x * normal_cdf(x);
  }
}

template <bool kTanh>
__device__ __forceinline__ float gelu_derivative(float x) {
  if constexpr (kTanh) {
    const float s = sigmoid(tanh_form_arg(x));
    const float arg_derivative = 2.f * kTanhScale * (1.f + 3.f * kTanhCubic * x * x);
    return s + x * s * (1.f - s) * arg_derivative;
  } else {
    return normal_cdf(x) + x * kInvSqrt2Pi * expf(-0.5f * x * x);
  }
}

template <typename T, bool kTanh>
__global__ void __launch_bounds__(kThreads)
    bias_gelu_forward_kernel(const BiasGeluRows x, int64_t rows_per_chunk, T* __restrict__ out) {
  constexpr int V = Pack<T>::kSize;
  const int64_t j0 = pack_column<T>();
  if (j0 >= x.width) return;
  const ChunkRows rows = chunk_rows(x.rows, rows_per_chunk);
  const bool has_bias = x.bias != nullptr;
  float b[V];
  if (has_bias) load_bias<T>(x, j0, b);
  for (int64_t r = rows.first; r < rows.last; ++r) {
    float v[V];
    load_pack<T>(static_cast<const T*>(x.input) + r * x.width, j0, x.width, v);
    add_bias<T>(has_bias, b, v);
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = gelu<kTanh>(v[k]);
    store_pack<T>(out + r * x.width, j0, x.width, v);
  }
}

// grad_input (when wanted) and the chunk's partial bias gradient (when
// `partials` is given): the sum of grad_input before its rounding to T.
template <typename T, bool kTanh>
__global__ void __launch_bounds__(kThreads)
    bias_gelu_backward_kernel(const BiasGeluRows x, const T* __restrict__ grad_out,
                              int64_t rows_per_chunk, T* __restrict__ grad_input,
                              float* __restrict__ partials) {
  constexpr int V = Pack<T>::kSize;
  const int64_t j0 = pack_column<T>();
  if (j0 >= x.width) return;
  const ChunkRows rows = chunk_rows(x.rows, rows_per_chunk);
  const bool has_bias = x.bias != nullptr;
  float b[V];
  if (has_bias) load_bias<T>(x, j0, b);
  float acc[V] = {};
  for (int64_t r = rows.first; r < rows.last; ++r) {
    float v[V];
    float g[V];
    load_pack<T>(static_cast<const T*>(x.input) + r * x.width, j0, x.width, v);
    load_pack<T>(grad_out + r * x.width, j0, x.width, g);
    add_bias<T>(has_bias, b, v);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      g[k] *= gelu_derivative<kTanh>(v[k]);
      acc[k] += g[k];
    }
    if (grad_input != nullptr) store_pack<T>(grad_input + r * x.width, j0, x.width, g);
  }
  if (partials == nullptr) return;
  float* row = partials + static_cast<int64_t>(blockIdx.y) * x.width;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    if (j0 + k < x.width) row[j0 + k] = acc[k];
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    swiglu_forward_kernel(const SwigluRows x, int64_t rows_per_chunk, T* __restrict__ out) {
  constexpr int V = Pack<T>::kSize;
  const int64_t j0 = pack_column<T>();
  if (j0 >= x.width) return;
  const ChunkRows rows = chunk_rows(x.rows, rows_per_chunk);
  for (int64_t r = rows.first; r < rows.last; ++r) {
    float a[V];
    float b[V];
    load_pack<T>(static_cast<const T*>(x.gate) + r * x.in_stride, j0, x.width, a);
    load_pack<T>(static_cast<const T*>(x.up) + r * x.in_stride, j0, x.width, b);
#pragma unroll
    for (int k = 0; k < V; ++k) a[k] = a[k] * sigmoid(a[k]) * b[k];
    store_pack<T>(out + r * x.width, j0, x.width, a);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_kernel(const SwigluRows x, const T* __restrict__ grad_out,
                           int64_t rows_per_chunk, T* grad_gate, T* grad_up) {
  constexpr int V = Pack<T>::kSize;
  const int64_t j0 = pack_column<T>();
  if (j0 >= x.width) return;
  const ChunkRows rows = chunk_rows(x.rows, rows_per_chunk);
  for (int64_t r = rows.first; r < rows.last; ++r) {
    float a[V];
    float b[V];
    float g[V];
    load_pack<T>(static_cast<const T*>(x.gate) + r * x.in_stride, j0, x.width, a);
    load_pack<T>(static_cast<const T*>(x.up) + r * x.in_stride, j0, x.width, b);
    load_pack<T>(grad_out + r * x.width, j0, x.width, g);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float s = sigmoid(a[k]);
      const float grad_b = g[k] * a[k] * s;
      a[k] = g[k] * b[k] * s * (1.f + a[k] * (1.f - s));
      b[k] = grad_b;
    }
    store_pack<T>(grad_gate + r * x.in_stride, j0, x.width, a);
    store_pack<T>(grad_up + r * x.in_stride, j0, x.width, b);
  }
}

// Calls fn(T{}) for the element type of `type`; other types are refused.
template <typename Fn>
cudaError_t with_type(FloatType type, Fn&& fn) {
  switch (type) {
    case FloatType::kFloat32:
      fn(float{});
      break;
    case FloatType::kFloat16:
      fn(__half{});
      break;
    case FloatType::kBFloat16:
      fn(__nv_bfloat16{});
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

dim3 grid_of(const Tiling& t) {
  return dim3(static_cast<unsigned>(t.tiles), static_cast<unsigned>(t.chunks));
}

bool valid_bias(const BiasGeluRows& x) {
  return x.bias == nullptr || x.bias_type == FloatType::kFloat32 || x.bias_type == x.type;
}

}  // namespace

cudaError_t launch_bias_gelu_forward(const BiasGeluRows& x, void* out, cudaStream_t stream) {
  if (!valid_type(x.type) || !valid_bias(x)) return cudaErrorInvalidValue;
  if (x.rows == 0 || x.width == 0) return cudaSuccess;
  const Tiling t = tiling_of(x.rows, x.width, element_size(x.type));
  return with_type(x.type, [&](auto tag) {
    using T = decltype(tag);
    if (x.tanh) {
      bias_gelu_forward_kernel<T, true>
          <<<grid_of(t), kThreads, 0, stream>>>(x, t.rows_per_chunk, static_cast<T*>(out));
    } else {
      bias_gelu_forward_kernel<T, false>
          <<<grid_of(t), kThreads, 0, stream>>>(x, t.rows_per_chunk, static_cast<T*>(out));
    }
  });
}

int64_t bias_gelu_backward_scratch_floats(const BiasGeluRows& x) {
  if (x.rows == 0 || x.width == 0) return 0;
  return tiling_of(x.rows, x.width, element_size(x.type)).chunks * x.width;
}

cudaError_t launch_bias_gelu_backward(const BiasGeluRows& x, const void* grad_out, void* grad_input,
                                      void* grad_bias, float* scratch, cudaStream_t stream) {
  if (!valid_type(x.type) || !valid_bias(x) || (grad_bias != nullptr && x.bias == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (x.width == 0) return cudaSuccess;
  const Tiling t = x.rows == 0 ? Tiling{0, 0, 0} : tiling_of(x.rows, x.width, element_size(x.type));
  if (x.rows > 0 && (grad_input != nullptr || grad_bias != nullptr)) {
    float* partials = grad_bias == nullptr ? nullptr : scratch;
    const cudaError_t err = with_type(x.type, [&](auto tag) {
      using T = decltype(tag);
      const auto* go = static_cast<const T*>(grad_out);
      auto* gi = static_cast<T*>(grad_input);
      if (x.tanh) {
        bias_gelu_backward_kernel<T, true>
            <<<grid_of(t), kThreads, 0, stream>>>(x, go, t.rows_per_chunk, gi, partials);
      } else {
        bias_gelu_backward_kernel<T, false>
            <<<grid_of(t), kThreads, 0, stream>>>(x, go, t.rows_per_chunk, gi, partials);
      }
    });
    if (err != cudaSuccess) return err;
  }
  if (grad_bias == nullptr) return cudaSuccess;
  return launch_column_sums(scratch, t.chunks, x.width, x.bias_type, grad_bias, stream);
}

cudaError_t launch_swiglu_forward(const SwigluRows& x, void* out, cudaStream_t stream) {
  if (!valid_type(x.type)) return cudaErrorInvalidValue;
  if (x.rows == 0 || x.width == 0) return cudaSuccess;
  const Tiling t = tiling_of(x.rows, x.width, element_size(x.type));
  return with_type(x.type, [&](auto tag) {
    using T = decltype(tag);
    swiglu_forward_kernel<T>
        <<<grid_of(t), kThreads, 0, stream>>>(x, t.rows_per_chunk, static_cast<T*>(out));
  });
}

cudaError_t launch_swiglu_backward(const SwigluRows& x, const void* grad_out, void* grad_gate,
                                   void* grad_up, cudaStream_t stream) {
  if (!valid_type(x.type)) return cudaErrorInvalidValue;
  if (x.rows == 0 || x.width == 0) return cudaSuccess;
  const Tiling t = tiling_of(x.rows, x.width, element_size(x.type));
  return with_type(x.type, [&](auto tag) {
    using T = decltype(tag);
    swiglu_backward_kernel<T>
        <<<grid_of(t), kThreads, 0, stream>>>(x, static_cast<const T*>(grad_out), t.rows_per_chunk,
                                              static_cast<T*>(grad_gate), static_cast<T*>(grad_up));
  });
}

}  // namespace fusetrain::kernels

// The CPU implementation of max pooling over non-overlapping windows. Checks
// and entry points: ../max_pool.cpp.
//
// Note [Window max pool]
// With the stride equal to the kernel (the 2x2 pooling after each block of a
// CNN) every input element belongs to at most one window, so the backward
// needs no scatter-add into a zeroed gradient: each gradient element is
// written once, the window's gradient at the position of its maximum and zero
// elsewhere. torch's CPU max_pool2d backward zero-fills the input gradient,
// copies its inputs to one memory format (on a channels_last CNN the incoming
// gradient of the last pooling comes from a flatten, contiguous), and
// scatters; its forward writes int64 flat indices. Here the forward writes
// the maximum's position in its window as one byte, and the backward reads
// those bytes and the output gradient and writes the input gradient, in
// either layout without copies. Channels innermost (channels_last) the loops
// are vectors across channels; in contiguous NCHW planes 2x2 windows are
// vectors along the rows, each input row's vectors split into their even and
// odd columns (max_pool_loops.inc), and other windows go one by one.
//
// The maximum is torch's: scanning the window row by row, a value replaces the
// one kept when it is greater or NaN, so ties keep the first and NaNs the
// last, and the output element is that input element, bit for bit. The
// gradient is 0 + g at that position (torch adds into zeros, turning -0 into
// +0), zero elsewhere and in the rows and columns past the last whole window,
// so output and gradients equal torch's bit for bit, on every path.
#include <fusetrain/ops/checks.h>
#include <fusetrain/ops/cpu/cpu_features.h>
#include <fusetrain/ops/generic.h>
#include <fusetrain/ops/max_pool.h>

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <fusetrain/ops/cpu/simd_avx2.h>
#include <fusetrain/ops/cpu/simd_avx512.h>

namespace fusetrain::ops {

namespace {
constexpr const char* kForwardOp = "fusetrain::max_pool2d";
constexpr const char* kBackwardOp = "fusetrain::max_pool2d_backward";
// Input elements per unit of parallel work, at least.
constexpr int64_t kGrain = 1 << 15;

struct Window {
  int64_t kh, kw;
};

Window window_of(at::IntArrayRef kernel_size) {
  const auto [kh, kw] = max_pool2d_window(kernel_size);
  return {kh, kw};
}

// One window's maximum (Note [Window max pool]): x at its element (0, 0),
// element (i, j) at i * row + j * col.
template <typename T>
void window_max(const T* x, int64_t row, int64_t col, const Window& k, T* out, uint8_t* argmax) {
  float m = static_cast<float>(x[0]);
  int64_t best = 0;
  for (int64_t i = 0; i < k.kh; ++i) {
    for (int64_t j = i == 0 ? 1 : 0; j < k.kw; ++j) {
      const float v = static_cast<float>(x[i * row + j * col]);
      if (m < v || std::isnan(v)) m = v, best = i * k.kw + j;
    }
  }
  *out = x[(best / k.kw) * row + (best % k.kw) * col];
  *argmax = static_cast<uint8_t>(best);
}

// One window's gradient: 0 + g at position `argmax`, zero elsewhere.
template <typename T>
void window_grad(T g, uint8_t argmax, int64_t row, int64_t col, const Window& k, T* grad_in) {
  for (int64_t i = 0; i < k.kh; ++i) {
    for (int64_t j = 0; j < k.kw; ++j) {
      grad_in[i * row + j * col] =
          i * k.kw + j == argmax ? static_cast<T>(static_cast<float>(g) + 0.f) : static_cast<T>(0.f);
    }
  }
}

// window_max and window_grad for a 2x2 window of an NCHW plane, unrolled:
// the tails of the 2x2 row loops (a row of a 28-wide image has 14 windows,
// under one AVX-512 vector), where the general ones spent most of the time.
template <typename T>
inline void window_max_2x2(const T* x, int64_t row, T* out, uint8_t* argmax) {
  const T* at[4] = {x, x + 1, x + row, x + row + 1};
  float m = static_cast<float>(*at[0]);
  int best = 0;
  for (int k = 1; k < 4; ++k) {
    const float v = static_cast<float>(*at[k]);
    if (m < v || std::isnan(v)) m = v, best = k;
  }
  *out = *at[best];
  *argmax = static_cast<uint8_t>(best);
}

template <typename T>
inline void window_grad_2x2(T g, uint8_t argmax, int64_t row, T* grad_in) {
  const T hit = static_cast<T>(static_cast<float>(g) + 0.f), zero = static_cast<T>(0.f);
  grad_in[0] = argmax == 0 ? hit : zero;
  grad_in[1] = argmax == 1 ? hit : zero;
  grad_in[row] = argmax == 2 ? hit : zero;
  grad_in[row + 1] = argmax == 3 ? hit : zero;
}

namespace scalar {
template <typename T>
void forward_row(const T* x, int64_t c, int64_t row, const Window& k, int64_t count, T* out,
                 uint8_t* argmax) {
  for (int64_t w = 0; w < count; ++w) {
    for (int64_t ch = 0; ch < c; ++ch) {
      window_max(x + w * k.kw * c + ch, row, c, k, out + w * c + ch, argmax + w * c + ch);
    }
  }
}

template <typename T>
void backward_row(const T* grad_out, const uint8_t* argmax, int64_t c, int64_t row,
                  const Window& k, int64_t count, T* grad_in) {
  for (int64_t w = 0; w < count; ++w) {
    for (int64_t ch = 0; ch < c; ++ch) {
      window_grad(grad_out[w * c + ch], argmax[w * c + ch], row, c, k, grad_in + w * k.kw * c + ch);
    }
  }
}

template <typename T>
void forward_rows_2x2(const T* x, int64_t row, int64_t count, T* out, uint8_t* argmax) {
  for (int64_t w = 0; w < count; ++w) window_max_2x2(x + 2 * w, row, out + w, argmax + w);
}

template <typename T>
void backward_rows_2x2(const T* grad_out, const uint8_t* argmax, int64_t row, int64_t count,
                       T* grad_in) {
  for (int64_t w = 0; w < count; ++w) window_grad_2x2(grad_out[w], argmax[w], row, grad_in + 2 * w);
}
}  // namespace scalar
}  // namespace
}  // namespace fusetrain::ops

#define FUSETRAIN_SIMD_LOOPS "max_pool_loops.inc"
#include <fusetrain/ops/cpu/simd_each_isa.inc>

namespace fusetrain::ops {

namespace {

#ifdef FUSETRAIN_SIMD_X86
// Rows of 2x2 windows shorter than a 16-lane vector (a 28-wide image has 14)
// take the 8-lane loop: AVX-512 CPUs run AVX2, and the two give the same bits.
template <typename T>
void forward_rows_2x2_avx512(const T* x, int64_t row, int64_t count, T* out, uint8_t* argmax) {
  if (count < avx512::kLanes) return avx2::forward_rows_2x2<T>(x, row, count, out, argmax);
  avx512::forward_rows_2x2<T>(x, row, count, out, argmax);
}

template <typename T>
void backward_rows_2x2_avx512(const T* grad_out, const uint8_t* argmax, int64_t row, int64_t count,
                              T* grad_in) {
  if (count < avx512::kLanes) return avx2::backward_rows_2x2<T>(grad_out, argmax, row, count, grad_in);
  avx512::backward_rows_2x2<T>(grad_out, argmax, row, count, grad_in);
}
#endif

template <typename T>
struct RowLoops {
  // Channels innermost, any window.
  void (*forward)(const T*, int64_t, int64_t, const Window&, int64_t, T*, uint8_t*);
  void (*backward)(const T*, const uint8_t*, int64_t, int64_t, const Window&, int64_t, T*);
  // NCHW planes, 2x2 windows.
  void (*forward_2x2)(const T*, int64_t, int64_t, T*, uint8_t*);
  void (*backward_2x2)(const T*, const uint8_t*, int64_t, int64_t, T*);
};

template <typename T>
RowLoops<T> row_loops() {
#ifdef FUSETRAIN_SIMD_X86
  switch (cpu_path()) {
    case CpuPath::kAvx512:
      return {&avx512::forward_row<T>, &avx512::backward_row<T>, &forward_rows_2x2_avx512<T>,
              &backward_rows_2x2_avx512<T>};
    case CpuPath::kAvx2:
      return {&avx2::forward_row<T>, &avx2::backward_row<T>, &avx2::forward_rows_2x2<T>,
              &avx2::backward_rows_2x2<T>};
    case CpuPath::kGeneric:  // the op went to generic:: before
    case CpuPath::kScalar:
      break;
  }
#endif
  return {&scalar::forward_row<T>, &scalar::backward_row<T>, &scalar::forward_rows_2x2<T>,
          &scalar::backward_rows_2x2<T>};
}

struct Shape {
  int64_t n, c, h, w, oh, ow;
};

Shape shape_of(const at::Tensor& input, const Window& k) {
  return {input.size(0), input.size(1), input.size(2), input.size(3),
          input.size(2) / k.kh, input.size(3) / k.kw};
}

// Runs fn(u, n, oh) for output row u = n * OH + oh of a channels-innermost
// tensor, in parallel.
template <typename Fn>
void for_each_window_row(const Shape& s, const Window& k, const Fn& fn) {
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(k.kh * s.w * s.c, 1));
  at::parallel_for(0, s.n * s.oh, grain, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) fn(u, u / s.oh, u % s.oh);
  });
}

// Runs fn(u, oh) for every output row oh of every (n, c) plane u of an NCHW
// tensor, in parallel by planes.
template <typename Fn>
void for_each_plane_row(const Shape& s, const Fn& fn) {
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(s.h * s.w, 1));
  at::parallel_for(0, s.n * s.c, grain, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      for (int64_t oh = 0; oh < s.oh; ++oh) fn(u, oh);
    }
  });
}

// `format` is the layout of all three tensors: channels_last or contiguous.
template <typename T>
void forward_typed(const at::Tensor& x, const Window& k, at::MemoryFormat format, at::Tensor& out,
                   at::Tensor& argmax) {
  const Shape s = shape_of(x, k);
  const RowLoops<T> loops = row_loops<T>();
  const T* xp = x.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  uint8_t* ap = argmax.mutable_data_ptr<uint8_t>();
  if (format == at::MemoryFormat::ChannelsLast) {
    const int64_t row = s.w * s.c;  // one input row
    for_each_window_row(s, k, [&](int64_t u, int64_t n, int64_t oh) {
      loops.forward(xp + (n * s.h + oh * k.kh) * row, s.c, row, k, s.ow, op + u * s.ow * s.c,
                    ap + u * s.ow * s.c);
    });
    return;
  }
  const bool two_by_two = k.kh == 2 && k.kw == 2;
  for_each_plane_row(s, [&](int64_t u, int64_t oh) {
    const T* rows = xp + u * s.h * s.w + oh * k.kh * s.w;
    const int64_t o = (u * s.oh + oh) * s.ow;
    if (two_by_two) return loops.forward_2x2(rows, s.w, s.ow, op + o, ap + o);
    for (int64_t ow = 0; ow < s.ow; ++ow) {
      window_max(rows + ow * k.kw, s.w, 1, k, op + o + ow, ap + o + ow);
    }
  });
}

template <typename T>
void backward_typed(const at::Tensor& grad_out, const at::Tensor& argmax, const Window& k,
                    at::MemoryFormat format, at::Tensor& grad_in) {
  const Shape s = shape_of(grad_in, k);
  const RowLoops<T> loops = row_loops<T>();
  const T* gp = grad_out.const_data_ptr<T>();
  const uint8_t* ap = argmax.const_data_ptr<uint8_t>();
  T* ip = grad_in.mutable_data_ptr<T>();
  const auto zero = [](T* p, int64_t n) { std::memset(static_cast<void*>(p), 0, n * sizeof(T)); };
  if (format == at::MemoryFormat::ChannelsLast) {
    const int64_t row = s.w * s.c;
    const int64_t covered = s.ow * k.kw * s.c;  // of each input row, the part in windows
    for_each_window_row(s, k, [&](int64_t u, int64_t n, int64_t oh) {
      T* rows = ip + (n * s.h + oh * k.kh) * row;
      loops.backward(gp + u * s.ow * s.c, ap + u * s.ow * s.c, s.c, row, k, s.ow, rows);
      for (int64_t i = 0; i < k.kh; ++i) zero(rows + i * row + covered, row - covered);
      if (oh == s.oh - 1) {  // the rows past the last whole window
        zero(ip + (n * s.h + s.oh * k.kh) * row, (s.h - s.oh * k.kh) * row);
      }
    });
    return;
  }
  const bool two_by_two = k.kh == 2 && k.kw == 2;
  const bool partial = s.ow * k.kw < s.w || s.oh * k.kh < s.h;  // elements in no window
  for_each_plane_row(s, [&](int64_t u, int64_t oh) {
    if (oh == 0 && partial) zero(ip + u * s.h * s.w, s.h * s.w);
    T* rows = ip + u * s.h * s.w + oh * k.kh * s.w;
    const int64_t o = (u * s.oh + oh) * s.ow;
    if (two_by_two) return loops.backward_2x2(gp + o, ap + o, s.w, s.ow, rows);
    for (int64_t ow = 0; ow < s.ow; ++ow) {
      window_grad(gp[o + ow], ap[o + ow], s.w, 1, k, rows + ow * k.kw);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> forward_cpu(const at::Tensor& input, at::IntArrayRef kernel_size) {
  if (cpu_path() == CpuPath::kGeneric) return generic::max_pool2d(input, kernel_size);
  const auto [oh, ow] = check_max_pool2d_args(input, kernel_size);
  const at::MemoryFormat format = input.suggest_memory_format();
  const at::Tensor x = input.contiguous(format);
  const auto sizes = {input.size(0), input.size(1), oh, ow};
  at::Tensor out = at::empty(sizes, input.options().memory_format(format));
  at::Tensor argmax = at::empty(sizes, input.options().dtype(at::kByte).memory_format(format));
  const Window k = window_of(kernel_size);
  with_element_type(input.scalar_type(), kForwardOp,
                    [&](auto tag) { forward_typed<decltype(tag)>(x, k, format, out, argmax); });
  return {out, argmax};
}

at::Tensor backward_cpu(const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& argmax,
                        at::IntArrayRef kernel_size) {
  if (cpu_path() == CpuPath::kGeneric) {
    return generic::max_pool2d_backward(grad_out, input, argmax, kernel_size);
  }
  check_max_pool2d_backward_args(grad_out, input, argmax, kernel_size);
  const at::MemoryFormat format = input.suggest_memory_format();
  at::Tensor grad_in = at::empty(input.sizes(), input.options().memory_format(format));
  const Window k = window_of(kernel_size);
  // Copies only where the layouts differ (a gradient that came through a
  // flatten, say): the loops walk all three alike.
  const at::Tensor g = grad_out.contiguous(format);
  const at::Tensor a = argmax.contiguous(format);
  with_element_type(input.scalar_type(), kBackwardOp,
                    [&](auto tag) { backward_typed<decltype(tag)>(g, a, k, format, grad_in); });
  return grad_in;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusetrain, CPU, m) {
  m.impl("max_pool2d", &forward_cpu);
  m.impl("max_pool2d_backward", &backward_cpu);
}

}  // namespace fusetrain::ops

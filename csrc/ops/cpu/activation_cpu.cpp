// The CPU implementation of bias + GELU and SwiGLU (Note [Fused activations]
// in ../activation.h). Checks, entry points and Meta: ../activation.cpp. The
// vector loops are in activation_loops.inc; the scalar ones below use the C
// library's exp and erfc (a few ulps apart from the vector polynomials). The
// bias gradient is summed per block of kBlockRows rows, then over the blocks
// in order, as the norms' weight gradients (Note [Fused norms]).
#include <fusetrain/ops/activation.h>
#include <fusetrain/ops/checks.h>
#include <fusetrain/ops/cpu/cpu_features.h>
#include <fusetrain/ops/generic.h>

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <fusetrain/ops/cpu/simd_avx2.h>
#include <fusetrain/ops/cpu/simd_avx512.h>

namespace fusetrain::ops {

namespace {
constexpr const char* kGeluOp = "fusetrain::bias_gelu";
constexpr const char* kGeluBackwardOp = "fusetrain::bias_gelu_backward";
constexpr const char* kSwigluOp = "fusetrain::swiglu";
constexpr const char* kSwigluBackwardOp = "fusetrain::swiglu_backward";
constexpr int64_t kBlockRows = 32;
constexpr int64_t kGrain = 1 << 15;

// The tanh form's 2 sqrt(2/pi) and 2 sqrt(2/pi) 0.044715 (u2 = 2u), and
// 1 / sqrt(2 pi).
constexpr float kGeluTanh2 = 1.5957691216057308f;
constexpr float kGeluTanhCubic2 = 0.07135481627260025f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;

namespace scalar {
// As simd_math.inc's Logistic, with the C library's exp.
float sigmoid(float x) {
  const float e = std::exp(-std::fabs(x));
  return (x < 0.f ? e : 1.f) / (1.f + e);
}
float sigmoid_slope(float x) {
  const float e = std::exp(-std::fabs(x)), d = 1.f + e;
  return e / (d * d);
}
float silu(float x) {
  const float e = std::exp(-std::fabs(x));
  return (x < 0.f ? x * e : x) / (1.f + e);
}
float normal_cdf(float x) { return 0.5f * std::erfc(-x * 0.70710678118654752f); }

template <bool kTanh>
float gelu(float v) {
  if constexpr (kTanh) return v * sigmoid(v * (kGeluTanh2 + kGeluTanhCubic2 * v * v));
  return v * normal_cdf(v);
}

template <bool kTanh>
float gelu_grad(float v) {
  if constexpr (kTanh) {
    const float u2 = v * (kGeluTanh2 + kGeluTanhCubic2 * v * v);
    return sigmoid(u2) + v * sigmoid_slope(u2) * (kGeluTanh2 + 3.f * kGeluTanhCubic2 * v * v);
  }
  return normal_cdf(v) + v * std::exp(-0.5f * v * v) * kInvSqrt2Pi;
}

template <typename T>
float biased(T x, float b) {
  return static_cast<float>(static_cast<T>(static_cast<float>(x) + b));
}

template <bool kTanh, typename T>
void gelu_span(const T* x, const float* b, T* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<T>(gelu<kTanh>(biased(x[i], b[i])));
}

template <bool kTanh, typename T>
void gelu_backward_span(const T* g, const T* x, const float* b, T* dx, float* db, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float d = static_cast<float>(g[i]) * gelu_grad<kTanh>(biased(x[i], b[i]));
    if (dx != nullptr) dx[i] = static_cast<T>(d);
    if (db != nullptr) db[i] += d;
  }
}

template <typename T>
void swiglu_span(const T* a, const T* u, T* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    y[i] = static_cast<T>(silu(static_cast<float>(a[i])) * static_cast<float>(u[i]));
  }
}

template <typename T>
void swiglu_backward_span(const T* g, const T* a, const T* u, T* da, T* du, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float gv = static_cast<float>(g[i]), av = static_cast<float>(a[i]);
    da[i] = static_cast<T>(gv * static_cast<float>(u[i]) * (sigmoid(av) + av * sigmoid_slope(av)));
    du[i] = static_cast<T>(gv * silu(av));
  }
}
}  // namespace scalar
}  // namespace
}  // namespace fusetrain::ops

#define FUSETRAIN_SIMD_LOOPS "activation_loops.inc"
#include <fusetrain/ops/cpu/simd_each_isa.inc>

namespace fusetrain::ops {

namespace {

template <bool kTanh, typename T>
struct Loops {
  void (*gelu)(const T*, const float*, T*, int64_t);
  void (*gelu_backward)(const T*, const T*, const float*, T*, float*, int64_t);
  void (*swiglu)(const T*, const T*, T*, int64_t);
  void (*swiglu_backward)(const T*, const T*, const T*, T*, T*, int64_t);
};

template <bool kTanh, typename T>
Loops<kTanh, T> loops() {
#ifdef FUSETRAIN_SIMD_X86
  switch (cpu_path()) {
    case CpuPath::kAvx512:
      return {&avx512::gelu_span<kTanh, T>, &avx512::gelu_backward_span<kTanh, T>,
              &avx512::swiglu_span<T>, &avx512::swiglu_backward_span<T>};
    case CpuPath::kAvx2:
      return {&avx2::gelu_span<kTanh, T>, &avx2::gelu_backward_span<kTanh, T>,
              &avx2::swiglu_span<T>, &avx2::swiglu_backward_span<T>};
    case CpuPath::kGeneric:
    case CpuPath::kScalar:
      break;
  }
#endif
  return {&scalar::gelu_span<kTanh, T>, &scalar::gelu_backward_span<kTanh, T>,
          &scalar::swiglu_span<T>, &scalar::swiglu_backward_span<T>};
}

// fn(bool_constant<tanh>, T{}).
template <typename Fn>
void with_gelu_types(GeluApproximation form, at::ScalarType dtype, const char* op, const Fn& fn) {
  with_element_type(dtype, op, [&](auto tag) {
    if (form == GeluApproximation::kTanh) {
      fn(std::true_type{}, tag);
    } else {
      fn(std::false_type{}, tag);
    }
  });
}

at::Tensor bias_row(const std::optional<at::Tensor>& bias, int64_t width, const at::Tensor& like) {
  if (given(bias)) return bias->to(at::kFloat).contiguous();
  return at::zeros({width}, like.options().dtype(at::kFloat));
}

at::Tensor bias_gelu_cpu(const at::Tensor& input_in, const std::optional<at::Tensor>& bias,
                         c10::string_view approximate) {
  if (cpu_path() == CpuPath::kGeneric) return generic::bias_gelu(input_in, bias, approximate);
  const int64_t n = check_bias_gelu_args(kGeluOp, input_in, bias);
  const GeluApproximation form = parse_gelu_approximation(approximate, kGeluOp);
  const at::Tensor input = input_in.contiguous();
  at::Tensor out = at::empty(input.sizes(), input.options());
  if (input.numel() == 0) return out;
  const int64_t rows = input.numel() / n;
  const at::Tensor b = bias_row(bias, n, input);
  with_gelu_types(form, input.scalar_type(), kGeluOp, [&](auto tanh_tag, auto t_tag) {
    using T = decltype(t_tag);
    const auto span = loops<decltype(tanh_tag)::value, T>().gelu;
    const T* x = input.const_data_ptr<T>();
    const float* bp = b.const_data_ptr<float>();
    T* y = out.mutable_data_ptr<T>();
    at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) span(x + r * n, bp, y + r * n, n);
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_backward_cpu(const at::Tensor& grad_out_in,
                                                          const at::Tensor& input_in,
                                                          const std::optional<at::Tensor>& bias,
                                                          c10::string_view approximate,
                                                          std::array<bool, 2> mask) {
  if (cpu_path() == CpuPath::kGeneric) {
    return generic::bias_gelu_backward(grad_out_in, input_in, bias, approximate, mask);
  }
  const int64_t n = check_bias_gelu_args(kGeluBackwardOp, input_in, bias, &grad_out_in);
  const GeluApproximation form = parse_gelu_approximation(approximate, kGeluBackwardOp);
  const bool want_bias = mask[1] && given(bias);
  const at::Tensor input = input_in.contiguous();
  const at::Tensor grad_out = grad_out_in.contiguous();
  at::Tensor grad_input = mask[0] ? at::empty(input.sizes(), input.options()) : at::Tensor();
  const int64_t rows = n == 0 ? 0 : input.numel() / n;
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  at::Tensor partials = want_bias ? at::zeros({blocks, n}, input.options().dtype(at::kFloat))
                                  : at::Tensor();
  if (rows > 0 && (mask[0] || want_bias)) {
    const at::Tensor b = bias_row(bias, n, input);
    with_gelu_types(form, input.scalar_type(), kGeluBackwardOp, [&](auto tanh_tag, auto t_tag) {
      using T = decltype(t_tag);
      const auto span = loops<decltype(tanh_tag)::value, T>().gelu_backward;
      const T* g = grad_out.const_data_ptr<T>();
      const T* x = input.const_data_ptr<T>();
      const float* bp = b.const_data_ptr<float>();
      T* dx = mask[0] ? grad_input.mutable_data_ptr<T>() : nullptr;
      float* dbp = want_bias ? partials.mutable_data_ptr<float>() : nullptr;
      at::parallel_for(0, blocks, std::max<int64_t>(1, kGrain / (n * kBlockRows)),
                       [&](int64_t begin, int64_t end) {
                         for (int64_t blk = begin; blk < end; ++blk) {
                           const int64_t last = std::min(rows, (blk + 1) * kBlockRows);
                           for (int64_t r = blk * kBlockRows; r < last; ++r) {
                             span(g + r * n, x + r * n, bp, dx == nullptr ? nullptr : dx + r * n,
                                  dbp == nullptr ? nullptr : dbp + blk * n, n);
                           }
                         }
                       });
    });
  }
  at::Tensor grad_bias;
  if (want_bias) grad_bias = partials.to(at::kDouble).sum(0).to(bias->scalar_type());
  return {grad_input, grad_bias};
}

// The gate and up rows of swiglu: row r's gate at a + r * stride, its up at
// u + r * stride, `width` elements each.
struct SwigluRows {
  int64_t rows, width, stride, up_offset;
};

SwigluRows swiglu_rows(const at::Tensor& a, bool two_inputs, int64_t width) {
  const int64_t rows = width == 0 ? 0 : a.numel() / (two_inputs ? width : 2 * width);
  return two_inputs ? SwigluRows{rows, width, width, 0} : SwigluRows{rows, width, 2 * width, width};
}

at::Tensor swiglu_cpu(const at::Tensor& a_in, const std::optional<at::Tensor>& b_in) {
  if (cpu_path() == CpuPath::kGeneric) return generic::swiglu(a_in, b_in);
  const int64_t width = check_swiglu_args(kSwigluOp, a_in, b_in);
  const at::Tensor a = a_in.contiguous();
  const at::Tensor b = given(b_in) ? b_in->contiguous() : at::Tensor();
  std::vector<int64_t> shape = a.sizes().vec();
  shape.back() = width;
  at::Tensor out = at::empty(shape, a.options());
  const SwigluRows s = swiglu_rows(a, b.defined(), width);
  if (s.rows == 0) return out;
  with_element_type(a.scalar_type(), kSwigluOp, [&](auto tag) {
    using T = decltype(tag);
    const auto span = loops<false, T>().swiglu;
    const T* gate = a.const_data_ptr<T>();
    const T* up = b.defined() ? b.const_data_ptr<T>() : gate + s.up_offset;
    T* y = out.mutable_data_ptr<T>();
    at::parallel_for(0, s.rows, std::max<int64_t>(1, kGrain / s.width),
                     [&](int64_t begin, int64_t end) {
                       for (int64_t r = begin; r < end; ++r) {
                         span(gate + r * s.stride, up + r * s.stride, y + r * s.width, s.width);
                       }
                     });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_cpu(const at::Tensor& grad_out_in,
                                                       const at::Tensor& a_in,
                                                       const std::optional<at::Tensor>& b_in) {
  if (cpu_path() == CpuPath::kGeneric) return generic::swiglu_backward(grad_out_in, a_in, b_in);
  const int64_t width = check_swiglu_args(kSwigluBackwardOp, a_in, b_in, &grad_out_in);
  const at::Tensor a = a_in.contiguous();
  const at::Tensor b = given(b_in) ? b_in->contiguous() : at::Tensor();
  const at::Tensor g = grad_out_in.contiguous();
  at::Tensor grad_a = at::empty(a.sizes(), a.options());
  at::Tensor grad_b = b.defined() ? at::empty(b.sizes(), b.options()) : at::empty({0}, a.options());
  const SwigluRows s = swiglu_rows(a, b.defined(), width);
  if (s.rows == 0) return {grad_a, grad_b};
  with_element_type(a.scalar_type(), kSwigluBackwardOp, [&](auto tag) {
    using T = decltype(tag);
    const auto span = loops<false, T>().swiglu_backward;
    const T* gp = g.const_data_ptr<T>();
    const T* gate = a.const_data_ptr<T>();
    const T* up = b.defined() ? b.const_data_ptr<T>() : gate + s.up_offset;
    T* dgate = grad_a.mutable_data_ptr<T>();
    T* dup = b.defined() ? grad_b.mutable_data_ptr<T>() : dgate + s.up_offset;
    at::parallel_for(0, s.rows, std::max<int64_t>(1, kGrain / s.width),
                     [&](int64_t begin, int64_t end) {
                       for (int64_t r = begin; r < end; ++r) {
                         span(gp + r * s.width, gate + r * s.stride, up + r * s.stride,
                              dgate + r * s.stride, dup + r * s.stride, s.width);
                       }
                     });
  });
  return {grad_a, grad_b};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusetrain, CPU, m) {
  m.impl("bias_gelu", &bias_gelu_cpu);
  m.impl("bias_gelu_backward", &bias_gelu_backward_cpu);
  m.impl("swiglu", &swiglu_cpu);
  m.impl("swiglu_backward", &swiglu_backward_cpu);
}

}  // namespace fusetrain::ops

// The CPU implementation of the fused layer and RMS norms (Note [Fused norms]
// in ../norm.h). Checks, entry points and Meta: ../norm.cpp. The rows go to
// the vector loops of norm_loops.inc (AVX2 or AVX-512, Note [CPU paths]) or
// to the scalar ones below; the weight and bias gradients are summed per
// block of kBlockRows rows, then over the blocks in order, so the result does
// not depend on the number of threads.
#include <fusetrain/ops/checks.h>
#include <fusetrain/ops/cpu/cpu_features.h>
#include <fusetrain/ops/generic.h>
#include <fusetrain/ops/norm.h>

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include <fusetrain/ops/cpu/simd_avx2.h>
#include <fusetrain/ops/cpu/simd_avx512.h>

namespace fusetrain::ops {

namespace {
constexpr const char* kLayerNormOp = "fusetrain::layer_norm";
constexpr const char* kLayerNormBackwardOp = "fusetrain::layer_norm_backward";
constexpr const char* kRmsNormOp = "fusetrain::rms_norm";
constexpr const char* kRmsNormBackwardOp = "fusetrain::rms_norm_backward";
// Rows per block of the weight and bias gradients' partial sums.
constexpr int64_t kBlockRows = 32;
// Elements per unit of parallel work, at least.
constexpr int64_t kGrain = 1 << 15;

// The per-element pieces that the scalar loops and the vector loops' tails
// share, so that every element of a row is computed the same way.
template <typename T>
T add_rounded(T x, T r) {
  return static_cast<T>(static_cast<float>(x) + static_cast<float>(r));
}

float row_rstd(double squares, int64_t n, float eps) {
  const float var = static_cast<float>(squares / static_cast<double>(n));
  return 1.f / std::sqrt(var + eps);
}

template <typename T>
float normalized(T v, float mean, float rstd, float w, float b) {
  return std::fma((static_cast<float>(v) - mean) * rstd, w, b);
}

template <typename T, typename G>
T input_grad(G dy, const T* dres, T v, float w, float mean, float rstd, float c_g, float c_gx) {
  const float xhat = (static_cast<float>(v) - mean) * rstd;
  const float g = static_cast<float>(dy) * w;
  float d = std::fma(-xhat, c_gx, g - c_g) * rstd;
  if (dres != nullptr) d += static_cast<float>(*dres);
  return static_cast<T>(d);
}

namespace scalar {
template <bool kRms, typename T, typename O>
void forward_row(const T* x, const T* r, T* s, const float* w, const float* b, O* y, int64_t n,
                 float eps, float* mean_out, float* rstd_out) {
  const T* v = x;
  if (r != nullptr) {
    for (int64_t i = 0; i < n; ++i) s[i] = add_rounded(x[i], r[i]);
    v = s;
  }
  float mean = 0.f;
  if (!kRms) {
    double total = 0;
    for (int64_t i = 0; i < n; ++i) total += static_cast<float>(v[i]);
    mean = static_cast<float>(total / static_cast<double>(n));
  }
  double squares = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float d = static_cast<float>(v[i]) - mean;
    squares += d * d;
  }
  const float rstd = row_rstd(squares, n, eps);
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<O>(normalized(v[i], mean, rstd, w[i], b[i]));
  if (mean_out != nullptr) *mean_out = mean;
  *rstd_out = rstd;
}

template <bool kRms, typename T, typename G>
void backward_row(const G* dy, const T* dres, const T* v, const float* w, float mean, float rstd,
                  int64_t n, T* dx, float* dw, float* db) {
  double sum_g = 0, sum_gx = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float xhat = (static_cast<float>(v[i]) - mean) * rstd;
    const float gy = static_cast<float>(dy[i]);
    const float g = gy * w[i];
    sum_g += g;
    sum_gx += g * xhat;
    if (dw != nullptr) dw[i] += gy * xhat;
    if (db != nullptr) db[i] += gy;
  }
  if (dx == nullptr) return;
  const float c_g = kRms ? 0.f : static_cast<float>(sum_g / static_cast<double>(n));
  const float c_gx = static_cast<float>(sum_gx / static_cast<double>(n));
  for (int64_t i = 0; i < n; ++i) {
    dx[i] = input_grad(dy[i], dres == nullptr ? nullptr : dres + i, v[i], w[i], mean, rstd, c_g,
                       c_gx);
  }
}
}  // namespace scalar
}  // namespace
}  // namespace fusetrain::ops

#define FUSETRAIN_SIMD_LOOPS "norm_loops.inc"
#include <fusetrain/ops/cpu/simd_each_isa.inc>

namespace fusetrain::ops {

namespace {

template <bool kRms, typename T, typename O>
using ForwardRow = void (*)(const T*, const T*, T*, const float*, const float*, O*, int64_t, float,
                            float*, float*);
template <bool kRms, typename T, typename G>
using BackwardRow = void (*)(const G*, const T*, const T*, const float*, float, float, int64_t, T*,
                             float*, float*);

template <bool kRms, typename T, typename O>
ForwardRow<kRms, T, O> forward_row() {
#ifdef FUSETRAIN_SIMD_X86
  switch (cpu_path()) {
    case CpuPath::kAvx512:
      return &avx512::forward_row<kRms, T, O>;
    case CpuPath::kAvx2:
      return &avx2::forward_row<kRms, T, O>;
    case CpuPath::kGeneric:
    case CpuPath::kScalar:
      break;
  }
#endif
  return &scalar::forward_row<kRms, T, O>;
}

template <bool kRms, typename T, typename G>
BackwardRow<kRms, T, G> backward_row() {
#ifdef FUSETRAIN_SIMD_X86
  switch (cpu_path()) {
    case CpuPath::kAvx512:
      return &avx512::backward_row<kRms, T, G>;
    case CpuPath::kAvx2:
      return &avx2::backward_row<kRms, T, G>;
    case CpuPath::kGeneric:
    case CpuPath::kScalar:
      break;
  }
#endif
  return &scalar::backward_row<kRms, T, G>;
}

// An fp32 contiguous copy of a weight or bias, or `absent` everywhere.
at::Tensor float_row(const std::optional<at::Tensor>& t, int64_t width, float absent,
                     const at::TensorOptions& like) {
  if (given(t)) return t->to(at::kFloat).contiguous().view({width});
  return at::full({width}, absent, like.dtype(at::kFloat));
}

template <typename Fn>
auto with_two_types(at::ScalarType a, at::ScalarType b, const char* op, const Fn& fn) {
  return with_element_type(a, op, [&](auto ta) {
    return with_element_type(b, op, [&](auto tb) { return fn(ta, tb); });
  });
}

// out, residual_out and the statistics of layer_norm (kRms false) or rms_norm.
template <bool kRms>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_forward(
    const char* op, const at::Tensor& input_in, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    const std::optional<at::Tensor>& residual_in, std::optional<at::ScalarType> out_dtype) {
  const NormShape s =
      check_norm_forward_args(op, input_in, normalized_shape, weight, bias, residual_in, out_dtype);
  const at::Tensor input = input_in.contiguous();
  const at::Tensor residual = given(residual_in) ? residual_in->contiguous() : at::Tensor();
  const auto stat_shape = norm_stat_shape(input, normalized_shape);
  const auto f32 = input.options().dtype(at::kFloat);
  at::Tensor out = at::empty(input.sizes(), input.options().dtype(s.out_dtype));
  at::Tensor sum = residual.defined() ? at::empty_like(input) : at::empty({0}, input.options());
  // RMS norm has no mean: undefined, and rms_norm_cpu drops it.
  at::Tensor mean = kRms ? at::Tensor() : at::empty(stat_shape, f32);
  at::Tensor rstd = at::empty(stat_shape, f32);
  if (s.rows == 0) {
    if (!kRms) mean.zero_();
    rstd.fill_(1.0 / std::sqrt(eps));  // an empty row's variance is 0
    return {out, sum, mean, rstd};
  }
  const at::Tensor w = float_row(weight, s.width, 1.f, input.options());
  const at::Tensor b = float_row(bias, s.width, 0.f, input.options());
  const int64_t n = s.width;
  with_two_types(input.scalar_type(), s.out_dtype, op, [&](auto t_tag, auto o_tag) {
    using T = decltype(t_tag);
    using O = decltype(o_tag);
    const auto row = forward_row<kRms, T, O>();
    const T* x = input.const_data_ptr<T>();
    const T* r = residual.defined() ? residual.const_data_ptr<T>() : nullptr;
    T* sp = residual.defined() ? sum.mutable_data_ptr<T>() : nullptr;
    O* y = out.mutable_data_ptr<O>();
    const float* wp = w.const_data_ptr<float>();
    const float* bp = b.const_data_ptr<float>();
    float* mp = kRms ? nullptr : mean.mutable_data_ptr<float>();
    float* rp = rstd.mutable_data_ptr<float>();
    const int64_t grain = std::max<int64_t>(1, kGrain / n);
    at::parallel_for(0, s.rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        row(x + i * n, r == nullptr ? nullptr : r + i * n, sp == nullptr ? nullptr : sp + i * n,
            wp, bp, y + i * n, n, static_cast<float>(eps), mp == nullptr ? nullptr : mp + i,
            rp + i);
      }
    });
  });
  return {out, sum, mean, rstd};
}

// grad_input (where wanted) and the fp32 column sums of grad_out * xhat and
// grad_out (where wanted) of layer_norm (kRms false) or rms_norm.
template <bool kRms>
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_backward(
    const char* op, const at::Tensor& grad_out_in, const std::optional<at::Tensor>& grad_res_in,
    const at::Tensor& normed_in, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& mean_in, const at::Tensor& rstd_in, bool want_input,
    bool want_weight, bool want_bias) {
  const NormShape s = check_norm_backward_args(op, grad_out_in, grad_res_in, normed_in,
                                               normalized_shape, weight, bias, mean_in, rstd_in);
  const at::Tensor normed = normed_in.contiguous();
  const at::Tensor grad_out = grad_out_in.contiguous();
  const at::Tensor grad_res = given(grad_res_in) ? grad_res_in->contiguous() : at::Tensor();
  const at::Tensor rstd = rstd_in.contiguous();
  const at::Tensor mean = kRms ? at::Tensor() : mean_in->contiguous();
  want_weight = want_weight && given(weight);
  want_bias = want_bias && given(bias);
  const int64_t n = s.width;
  at::Tensor grad_input = want_input ? at::empty_like(normed, at::MemoryFormat::Contiguous)
                                     : at::Tensor();
  const int64_t blocks = (s.rows + kBlockRows - 1) / kBlockRows;
  const auto f32 = normed.options().dtype(at::kFloat);
  at::Tensor dw_blocks = want_weight ? at::zeros({blocks, n}, f32) : at::Tensor();
  at::Tensor db_blocks = want_bias ? at::zeros({blocks, n}, f32) : at::Tensor();
  if (s.rows > 0 && (want_input || want_weight || want_bias)) {
    const at::Tensor w = float_row(weight, n, 1.f, normed.options());
    with_two_types(normed.scalar_type(), s.out_dtype, op, [&](auto t_tag, auto g_tag) {
      using T = decltype(t_tag);
      using G = decltype(g_tag);
      const auto row = backward_row<kRms, T, G>();
      const G* dy = grad_out.const_data_ptr<G>();
      const T* dres = grad_res.defined() ? grad_res.const_data_ptr<T>() : nullptr;
      const T* v = normed.const_data_ptr<T>();
      const float* wp = w.const_data_ptr<float>();
      const float* mp = kRms ? nullptr : mean.const_data_ptr<float>();
      const float* rp = rstd.const_data_ptr<float>();
      T* dx = want_input ? grad_input.mutable_data_ptr<T>() : nullptr;
      float* dwp = want_weight ? dw_blocks.mutable_data_ptr<float>() : nullptr;
      float* dbp = want_bias ? db_blocks.mutable_data_ptr<float>() : nullptr;
      const int64_t grain = std::max<int64_t>(1, kGrain / (n * kBlockRows));
      at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
        for (int64_t blk = begin; blk < end; ++blk) {
          float* dwb = dwp == nullptr ? nullptr : dwp + blk * n;
          float* dbb = dbp == nullptr ? nullptr : dbp + blk * n;
          const int64_t last = std::min(s.rows, (blk + 1) * kBlockRows);
          for (int64_t i = blk * kBlockRows; i < last; ++i) {
            row(dy + i * n, dres == nullptr ? nullptr : dres + i * n, v + i * n, wp,
                mp == nullptr ? 0.f : mp[i], rp[i], n, dx == nullptr ? nullptr : dx + i * n, dwb,
                dbb);
          }
        }
      });
    });
  }
  // The blocks in order, in float64 (Note [Fused norms]).
  const auto column_sums = [&](const at::Tensor& partials, const std::optional<at::Tensor>& p) {
    return partials.to(at::kDouble).sum(0).to(p->scalar_type()).view(p->sizes());
  };
  return {grad_input, want_weight ? column_sums(dw_blocks, weight) : at::Tensor(),
          want_bias ? column_sums(db_blocks, bias) : at::Tensor()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_cpu(
    const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    const std::optional<at::Tensor>& residual, std::optional<at::ScalarType> out_dtype) {
  if (cpu_path() == CpuPath::kGeneric) {
    return generic::layer_norm(input, normalized_shape, weight, bias, eps, residual, out_dtype);
  }
  return norm_forward<false>(kLayerNormOp, input, normalized_shape, weight, bias, eps, residual,
                             out_dtype);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_cpu(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_residual_out,
    const at::Tensor& normed, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& mean, const at::Tensor& rstd, std::array<bool, 3> mask) {
  if (cpu_path() == CpuPath::kGeneric) {
    return generic::layer_norm_backward(grad_out, grad_residual_out, normed, normalized_shape,
                                        weight, bias, mean, rstd, mask);
  }
  return norm_backward<false>(kLayerNormBackwardOp, grad_out, grad_residual_out, normed,
                              normalized_shape, weight, bias, mean, rstd, mask[0], mask[1],
                              mask[2]);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_cpu(
    const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, std::optional<double> eps,
    const std::optional<at::Tensor>& residual, std::optional<at::ScalarType> out_dtype) {
  if (cpu_path() == CpuPath::kGeneric) {
    return generic::rms_norm(input, normalized_shape, weight, eps, residual, out_dtype);
  }
  auto [out, sum, mean, rstd] =
      norm_forward<true>(kRmsNormOp, input, normalized_shape, weight, std::nullopt,
                         rms_norm_eps(eps, input.scalar_type()), residual, out_dtype);
  return {out, sum, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_residual_out,
    const at::Tensor& normed, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const at::Tensor& rstd, std::array<bool, 2> mask) {
  if (cpu_path() == CpuPath::kGeneric) {
    return generic::rms_norm_backward(grad_out, grad_residual_out, normed, normalized_shape,
                                      weight, rstd, mask);
  }
  auto [dx, dw, db] = norm_backward<true>(kRmsNormBackwardOp, grad_out, grad_residual_out, normed,
                                          normalized_shape, weight, std::nullopt, std::nullopt,
                                          rstd, mask[0], mask[1], false);
  return {dx, dw};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusetrain, CPU, m) {
  m.impl("layer_norm", &layer_norm_cpu);
  m.impl("layer_norm_backward", &layer_norm_backward_cpu);
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("rms_norm_backward", &rms_norm_backward_cpu);
}

}  // namespace fusetrain::ops

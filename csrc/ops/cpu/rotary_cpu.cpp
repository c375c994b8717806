// The CPU implementation of the fused rotary embedding (Note [Fused rotary]
// in ../rotary.h): each row of q and k read once and written once, the
// vector loops in rotary_loops.inc. Checks, entry points and Meta:
// ../rotary.cpp.
#include <fusetrain/ops/checks.h>
#include <fusetrain/ops/cpu/cpu_features.h>
#include <fusetrain/ops/generic.h>
#include <fusetrain/ops/rotary.h>

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include <fusetrain/ops/cpu/simd_avx2.h>
#include <fusetrain/ops/cpu/simd_avx512.h>

namespace fusetrain::ops {

namespace {
constexpr const char* kRotaryOp = "fusetrain::rotary";
constexpr const char* kRotaryInplaceOp = "fusetrain::rotary_";
constexpr int64_t kGrain = 1 << 15;

// One pair: (x1 c - x2 s, x2 c + x1 s), the vector loops' FMAs.
template <typename T>
void rotate_pair(T x1_in, T x2_in, float c, float s, T& y1, T& y2) {
  const float x1 = static_cast<float>(x1_in), x2 = static_cast<float>(x2_in);
  y1 = static_cast<T>(std::fma(-x2, s, x1 * c));
  y2 = static_cast<T>(std::fma(x1, s, x2 * c));
}

namespace scalar {
template <typename T, typename C>
void rotate_row(const T* x, T* y, const C* c, const C* s, int64_t half, int64_t d,
                bool interleaved, float sign) {
  for (int64_t j = 0; j < half; ++j) {
    const int64_t i1 = interleaved ? 2 * j : j, i2 = interleaved ? 2 * j + 1 : j + half;
    rotate_pair(x[i1], x[i2], static_cast<float>(c[j]), static_cast<float>(s[j]) * sign, y[i1],
                y[i2]);
  }
  if (y != x) {
    for (int64_t i = 2 * half; i < d; ++i) y[i] = x[i];
  }
}
}  // namespace scalar
}  // namespace
}  // namespace fusetrain::ops

#define FUSETRAIN_SIMD_LOOPS "rotary_loops.inc"
#include <fusetrain/ops/cpu/simd_each_isa.inc>

namespace fusetrain::ops {

namespace {

template <typename T, typename C>
using RowFn = void (*)(const T*, T*, const C*, const C*, int64_t, int64_t, bool, float);

template <typename T, typename C>
RowFn<T, C> row_fn() {
#ifdef FUSETRAIN_SIMD_X86
  switch (cpu_path()) {
    case CpuPath::kAvx512:
      return &avx512::rotate_row<T, C>;
    case CpuPath::kAvx2:
      return &avx2::rotate_row<T, C>;
    case CpuPath::kGeneric:
    case CpuPath::kScalar:
      break;
  }
#endif
  return &scalar::rotate_row<T, C>;
}

// Rotates the contiguous x into the contiguous y (possibly x itself).
void rotate(const at::Tensor& x, at::Tensor& y, const at::Tensor& cos, const at::Tensor& sin,
            int64_t half, bool interleaved, bool inverse, const char* op) {
  const int64_t d = x.size(-1);
  if (x.numel() == 0 || d == 0) return;
  const int64_t rows = x.numel() / d;
  const at::Tensor offsets = rotary_row_offsets(x, cos, half);
  const int64_t* off = offsets.const_data_ptr<int64_t>();
  const float sign = inverse ? -1.f : 1.f;
  with_element_type(x.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    const auto run = [&](auto c_tag) {
      using C = decltype(c_tag);
      const auto row = row_fn<T, C>();
      const T* xp = x.const_data_ptr<T>();
      T* yp = y.mutable_data_ptr<T>();
      const C* cp = cos.const_data_ptr<C>();
      const C* sp = sin.const_data_ptr<C>();
      at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / d), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          row(xp + r * d, yp + r * d, cp + off[r], sp + off[r], half, d, interleaved, sign);
        }
      });
    };
    if (cos.scalar_type() == at::kFloat) {
      run(float{});
    } else {
      run(T{});
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rotary_cpu(const at::Tensor& q,
                                              const std::optional<at::Tensor>& k,
                                              const at::Tensor& cos_in, const at::Tensor& sin_in,
                                              bool interleaved, bool inverse) {
  if (cpu_path() == CpuPath::kGeneric) {
    return generic::rotary(q, k, cos_in, sin_in, interleaved, inverse);
  }
  const int64_t half = check_rotary_args(kRotaryOp, q, k, cos_in, sin_in);
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const at::Tensor qc = q.contiguous();
  at::Tensor q_out = at::empty(q.sizes(), q.options());
  rotate(qc, q_out, cos, sin, half, interleaved, inverse, kRotaryOp);
  at::Tensor k_out = at::empty({0}, q.options());
  if (given(k)) {
    const at::Tensor kc = k->contiguous();
    k_out = at::empty(k->sizes(), k->options());
    rotate(kc, k_out, cos, sin, half, interleaved, inverse, kRotaryOp);
  }
  return {q_out, k_out};
}

void rotate_in_place(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t half,
                     bool interleaved, bool inverse) {
  if (x.is_contiguous()) {
    rotate(x, x, cos, sin, half, interleaved, inverse, kRotaryInplaceOp);
    return;
  }
  at::Tensor c = x.contiguous();
  rotate(c, c, cos, sin, half, interleaved, inverse, kRotaryInplaceOp);
  x.copy_(c);
}

void rotary_cpu_(at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& cos_in,
                 const at::Tensor& sin_in, bool interleaved, bool inverse) {
  if (cpu_path() == CpuPath::kGeneric) {
    generic::rotary_(q, k, cos_in, sin_in, interleaved, inverse);
    return;
  }
  const int64_t half = check_rotary_args(kRotaryInplaceOp, q, k, cos_in, sin_in);
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  rotate_in_place(q, cos, sin, half, interleaved, inverse);
  if (given(k)) {
    at::Tensor kt = *k;
    rotate_in_place(kt, cos, sin, half, interleaved, inverse);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(fusetrain, CPU, m) {
  m.impl("rotary", &rotary_cpu);
  m.impl("rotary_", &rotary_cpu_);
}

}  // namespace fusetrain::ops

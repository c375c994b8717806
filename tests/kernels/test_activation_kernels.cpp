// The fused activation kernels (csrc/kernels/activation_kernels.cu) run
// through the CUDA emulator against the CPU ops (fusetrain::ops::bias_gelu,
// swiglu and their backwards) over the three types, both GELU forms, with
// and without a bias (float32 or the input's type), the one-tensor and
// two-tensor SwiGLU, partial 16-byte packs, misaligned rows, bias gradients
// over more rows than the grid has row chunks, and empty inputs.
//
// Tolerances, u = 2^-24. Each result is checked against float64 maths at
// the same rounded input + bias (which both sides compute as one fp32 add
// rounded to the input's type: the test does it too), and against the CPU
// op. The kernel's fp32 formulas are off by c u of a result's size, c = 16
// for their handful of rounded operations and of the library's erfcf and
// expf (a few ulps), plus what the functions amplify: the rounding of the
// argument of erfc(-s / sqrt 2) grows by its logarithmic derivative, up to
// s^2 in relative terms, that of sigmoid(z) in the tanh form by |z|. So,
// with F = 16 + 2 s^2 + 2 |z|:
//   gelu:      F u |gelu(s)|;
//   gelu':     |g| F u (|t1| + |t2|), t1 + t2 its two terms (Phi(s) and
//              s phi(s), or their tanh-form counterparts), which cancel
//              near s = -0.75;
//   grad_bias: the sum of those over the rows plus (rows + 48) u of
//              sum |g| (|t1| + |t2|) for the summation (the kernel's row
//              chunks and fixed tree; the CPU's 32-row blocks);
//   swiglu:    16 u |y|; grad_b 16 u |g a s|; grad_a = g b s (1 + a (1 - s))
//              cancels near a = -1.28: 16 u |g b s| (1 + |a|);
// plus one ulp of the result's type at the larger of the two values
// compared, and the absolute errors of underflow in the far tails
// (kKernelUnderflow). Against the CPU op the bound doubles (both sides'
// error) and adds the CPU's documented approximations (cpu_cdf_error,
// kCpuUnderflow).
#include <fusetrain/ops/activation.h>

#include <ATen/ATen.h>

#include <catch2/catch.hpp>

#include <cmath>
#include <iomanip>
#include <optional>
#include <sstream>
#include <string>

#include "activation_kernels.h"
#include "kernel_test.h"

namespace {

using fusetrain::kernels::BiasGeluRows;
using fusetrain::kernels::FloatType;
using fusetrain::kernels::launch_bias_gelu_backward;
using fusetrain::kernels::launch_bias_gelu_forward;
using fusetrain::kernels::launch_swiglu_backward;
using fusetrain::kernels::launch_swiglu_forward;
using fusetrain::kernels::SwigluRows;
using kernel_test::check_within;
using kernel_test::dbl;
using kernel_test::float_type;
using kernel_test::tiny;
using kernel_test::ulp_gap;
using kernel_test::unit_roundoff;

constexpr double kU = 0x1p-24;
constexpr double kTanhScale = 0.79788456080286535588;  // sqrt(2 / pi)
constexpr double kTanhCubic = 0.044715;

// An array `offset` elements past a 64-byte boundary, a sentinel before it.
struct Buffer {
  at::Tensor storage;
  at::Tensor view;
  int64_t offset = 0;
};

Buffer buffer(at::IntArrayRef shape, at::ScalarType dtype, int64_t offset) {
  int64_t n = 1;
  for (const int64_t s : shape) n *= s;
  Buffer b;
  b.offset = offset;
  b.storage = at::full({offset + n}, 7.0, dtype);
  b.view = b.storage.narrow(0, offset, n).view(shape);
  return b;
}

Buffer buffer_of(const at::Tensor& values, at::ScalarType dtype, int64_t offset) {
  Buffer b = buffer(values.sizes(), dtype, offset);
  b.view.copy_(values);
  return b;
}

void check_sentinel(const Buffer& b) {
  if (b.offset == 0) return;
  CHECK(at::equal(b.storage.narrow(0, 0, b.offset),
                  at::full({b.offset}, 7.0, b.storage.scalar_type())));
}

enum class Bias { kNone, kFloat32, kInputType };

struct GeluCase {
  at::ScalarType dtype;
  bool tanh;
  int64_t rows;
  int64_t width;
  Bias bias;
  bool misaligned;
};

// The amplification factor F of the file's comment, per element of s.
at::Tensor amplification(const at::Tensor& s, bool tanh) {
  const at::Tensor z = s * (2 * kTanhScale + 2 * kTanhScale * kTanhCubic * s.square());
  return 16 + 2 * s.square() + (tanh ? 2 * z.abs() : at::zeros_like(s));
}

// gelu and its derivative's two terms (Phi(s) and s phi(s), or sigmoid(z)
// and s sigmoid'(z) z') in float64.
struct Gelu64 {
  at::Tensor y;
  at::Tensor t1;
  at::Tensor t2;
};

Gelu64 gelu64(const at::Tensor& s, bool tanh) {
  if (tanh) {
    const at::Tensor z = s * (2 * kTanhScale + 2 * kTanhScale * kTanhCubic * s.square());
    const at::Tensor sg = z.sigmoid();
    const at::Tensor dz = 2 * kTanhScale * (1 + 3 * kTanhCubic * s.square());
    return {s * sg, sg, s * sg * (1 - sg) * dz};
  }
  const at::Tensor cdf = 0.5 * at::erfc(-s / std::sqrt(2.0));
  return {s * cdf, cdf, s * (-0.5 * s.square()).exp() / std::sqrt(2 * M_PI)};
}

// Absolute errors of underflow, per unit of |s| in gelu and of |g| (times
// underflow_scale) in gelu': the kernel's fp32 sigmoid is 0 once exp(-z)
// overflows (sigmoid < 2^-127), its erfc and exp lose their digits below
// 2^-126; the CPU op's exp returns 0 below -86 (e^-86 < 5e-38).
constexpr double kKernelUnderflow = 0x1p-126;
constexpr double kCpuUnderflow = 5e-38;

at::Tensor underflow_scale(const at::Tensor& s, bool tanh) {
  const at::Tensor dz =
      tanh ? 2 * kTanhScale * (1 + 3 * kTanhCubic * s.square()) : at::ones_like(s);
  return 1 + s.abs() * (1 + dz);
}

// What the CPU op's normal CDF adds to its error (csrc/ops/cpu/
// simd_math.inc): it is Abramowitz and Stegun 7.1.26, as torch's own
// vectorised erf, off by up to 1.5e-7 in erfc (7.5e-8 in Phi) anywhere, so
// most in relative terms in the negative tail. Per unit of |s| in gelu and
// of |g| in gelu'.
double cpu_cdf_error(bool tanh) { return tanh ? 0.0 : 7.5e-8; }

void check_gelu_case(const GeluCase& c) {
  const auto off = [&](int64_t k) { return c.misaligned ? k : int64_t{0}; };
  const char* approximate = c.tanh ? "tanh" : "none";
  const Buffer x = buffer_of(at::randn({c.rows, c.width}, at::kDouble) * 3, c.dtype, off(1));
  Buffer b;
  if (c.bias != Bias::kNone) {
    b = buffer_of(at::randn({c.width}, at::kDouble) * 0.5,
                  c.bias == Bias::kFloat32 ? at::kFloat : c.dtype, off(3));
  }
  const std::optional<at::Tensor> bias =
      b.view.defined() ? std::optional<at::Tensor>(b.view) : std::nullopt;
  const BiasGeluRows rows{float_type(c.dtype),
                          c.rows,
                          c.width,
                          x.view.data_ptr(),
                          b.view.defined() ? b.view.data_ptr() : nullptr,
                          b.view.defined() ? float_type(b.view.scalar_type()) : FloatType::kFloat32,
                          c.tanh};

  // The rounded input + bias, as both sides compute it, and the float64
  // results from it.
  const at::Tensor s =
      b.view.defined() ? dbl((dbl(x.view) + dbl(b.view)).to(at::kFloat).to(c.dtype)) : dbl(x.view);
  const at::Tensor amp = amplification(s, c.tanh);
  const Gelu64 exact = gelu64(s, c.tanh);
  const double cdf_error = cpu_cdf_error(c.tanh);

  Buffer out = buffer({c.rows, c.width}, c.dtype, off(2));
  REQUIRE_LAUNCH(launch_bias_gelu_forward(rows, out.view.data_ptr(), nullptr));
  check_sentinel(out);
  const at::Tensor err = amp * kU * exact.y.abs() + kKernelUnderflow * s.abs();
  check_within("bias_gelu against float64", out.view, exact.y,
               err + ulp_gap(out.view, exact.y, c.dtype));
  const at::Tensor out_ref = fusetrain::ops::bias_gelu(x.view, bias, approximate);
  REQUIRE(out_ref.scalar_type() == c.dtype);
  check_within(
      "bias_gelu against the CPU op", out.view, out_ref,
      2 * err + (cdf_error + kCpuUnderflow) * s.abs() + ulp_gap(out.view, out_ref, c.dtype));

  const Buffer go = buffer_of(at::randn({c.rows, c.width}, at::kDouble), c.dtype, off(3));
  const at::Tensor g = dbl(go.view);
  Buffer gi = buffer({c.rows, c.width}, c.dtype, off(2));
  Buffer gb = b.view.defined() ? buffer({c.width}, b.view.scalar_type(), off(1)) : Buffer{};
  at::Tensor scratch = at::full({fusetrain::kernels::bias_gelu_backward_scratch_floats(rows)}, 5.f);
  REQUIRE_LAUNCH(launch_bias_gelu_backward(rows, go.view.data_ptr(), gi.view.data_ptr(),
                                           gb.view.defined() ? gb.view.data_ptr() : nullptr,
                                           scratch.data_ptr<float>(), nullptr));
  check_sentinel(gi);
  const at::Tensor d = g * (exact.t1 + exact.t2);
  const at::Tensor terms = g.abs() * (exact.t1.abs() + exact.t2.abs());
  const at::Tensor flush = g.abs() * underflow_scale(s, c.tanh);
  const at::Tensor d_err = amp * kU * terms + kKernelUnderflow * flush;
  const at::Tensor cpu_err = cdf_error * g.abs() + kCpuUnderflow * flush;
  check_within("grad_input against float64", gi.view, d, d_err + ulp_gap(gi.view, d, c.dtype));
  const auto [gi_ref, gb_ref] =
      fusetrain::ops::bias_gelu_backward(go.view, x.view, bias, approximate, {true, true});
  check_within("grad_input against the CPU op", gi.view, gi_ref,
               2 * d_err + cpu_err + ulp_gap(gi.view, gi_ref, c.dtype));
  if (b.view.defined()) {
    check_sentinel(gb);
    REQUIRE(gb_ref.defined());
    const at::ScalarType bias_type = b.view.scalar_type();
    const double rows_bound = (static_cast<double>(c.rows) + 48) * kU;
    const at::Tensor sum_err = d_err.sum(0) + rows_bound * terms.sum(0);
    check_within("grad_bias against float64", gb.view, d.sum(0),
                 sum_err + ulp_gap(gb.view, d.sum(0), bias_type));
    check_within("grad_bias against the CPU op", gb.view, gb_ref,
                 2 * sum_err + cpu_err.sum(0) + ulp_gap(gb.view, gb_ref, bias_type));
  }
}

struct SwigluCase {
  at::ScalarType dtype;
  int64_t rows;
  int64_t width;  // of the output
  int form;       // 0: one [gate | up] tensor, 1: two tensors by rows, 2: two tensors as one row
  bool misaligned;
};

void check_swiglu_case(const SwigluCase& c) {
  const auto off = [&](int64_t k) { return c.misaligned ? k : int64_t{0}; };
  const int64_t w = c.width;
  const bool packed = c.form == 0;
  const Buffer a =
      buffer_of(at::randn({c.rows, packed ? 2 * w : w}, at::kDouble) * 3, c.dtype, off(1));
  const Buffer b =
      packed ? Buffer{} : buffer_of(at::randn({c.rows, w}, at::kDouble), c.dtype, off(3));
  const std::optional<at::Tensor> b_opt = packed ? std::nullopt : std::optional<at::Tensor>(b.view);
  const int64_t elem = a.view.element_size();
  const auto* a_bytes = static_cast<const char*>(a.view.data_ptr());
  SwigluRows rows{float_type(c.dtype),
                  c.rows,
                  w,
                  packed ? 2 * w : w,
                  a.view.data_ptr(),
                  packed ? a_bytes + w * elem : b.view.data_ptr()};
  if (c.form == 2) {
    rows.rows = 1;
    rows.width = rows.in_stride = c.rows * w;
  }

  const at::Tensor gate = packed ? dbl(a.view).narrow(1, 0, w) : dbl(a.view);
  const at::Tensor up = packed ? dbl(a.view).narrow(1, w, w) : dbl(b.view);
  const at::Tensor sg = gate.sigmoid();

  Buffer out = buffer({c.rows, w}, c.dtype, off(2));
  REQUIRE_LAUNCH(launch_swiglu_forward(rows, out.view.data_ptr(), nullptr));
  check_sentinel(out);
  const at::Tensor y = gate * sg * up;
  check_within("swiglu against float64", out.view, y,
               16 * kU * y.abs() + ulp_gap(out.view, y, c.dtype));
  const at::Tensor out_ref = fusetrain::ops::swiglu(a.view, b_opt);
  REQUIRE(out_ref.scalar_type() == c.dtype);
  check_within("swiglu against the CPU op", out.view, out_ref,
               32 * kU * y.abs() + ulp_gap(out.view, out_ref, c.dtype));

  const Buffer go = buffer_of(at::randn({c.rows, w}, at::kDouble), c.dtype, off(3));
  Buffer ga = buffer(a.view.sizes(), c.dtype, off(2));
  Buffer gb = packed ? Buffer{} : buffer({c.rows, w}, c.dtype, off(1));
  auto* ga_bytes = static_cast<char*>(ga.view.data_ptr());
  REQUIRE_LAUNCH(launch_swiglu_backward(rows, go.view.data_ptr(), ga.view.data_ptr(),
                                        packed ? ga_bytes + w * elem : gb.view.data_ptr(),
                                        nullptr));
  check_sentinel(ga);
  const at::Tensor g = dbl(go.view);
  const at::Tensor d_gate = g * up * sg * (1 + gate * (1 - sg));
  const at::Tensor d_up = g * gate * sg;
  const at::Tensor err_gate = 16 * kU * (g * up * sg).abs() * (1 + gate.abs());
  const at::Tensor err_up = 16 * kU * d_up.abs();
  const at::Tensor d_a = packed ? at::cat({d_gate, d_up}, 1) : d_gate;
  const at::Tensor err_a = packed ? at::cat({err_gate, err_up}, 1) : err_gate;
  check_within("grad_a against float64", ga.view, d_a, err_a + ulp_gap(ga.view, d_a, c.dtype));
  const auto [ga_ref, gb_ref] = fusetrain::ops::swiglu_backward(go.view, a.view, b_opt);
  check_within("grad_a against the CPU op", ga.view, ga_ref,
               2 * err_a + ulp_gap(ga.view, ga_ref, c.dtype));
  if (!packed) {
    check_sentinel(gb);
    check_within("grad_b against float64", gb.view, d_up, err_up + ulp_gap(gb.view, d_up, c.dtype));
    check_within("grad_b against the CPU op", gb.view, gb_ref,
                 2 * err_up + ulp_gap(gb.view, gb_ref, c.dtype));
  } else {
    CHECK(gb_ref.numel() == 0);
  }
}

}  // namespace

TEST_CASE("bias_gelu kernels equal the CPU ops within their rounding",
          "[kernels][activation_kernels]") {
  at::manual_seed(11);
  const at::ScalarType dtype = GENERATE(at::kFloat, at::kHalf, at::kBFloat16);
  const bool tanh = GENERATE(false, true);
  const int64_t width = GENERATE(1, 7, 64, 768, 1000, 4100);
  const auto [bias, misaligned] = GENERATE(table<Bias, bool>({{Bias::kNone, false},
                                                              {Bias::kFloat32, true},
                                                              {Bias::kInputType, false},
                                                              {Bias::kInputType, true}}));
  CAPTURE(dtype, tanh, width, static_cast<int>(bias), misaligned);
  check_gelu_case({dtype, tanh, 5, width, bias, misaligned});
}

// Several rows a chunk (Note [Activation column tiles]): the bias gradient's
// partials add rows in registers before the column sums add the chunks.
TEST_CASE("bias_gelu kernels: bias gradients over more rows than row chunks",
          "[kernels][activation_kernels]") {
  at::manual_seed(12);
  // 2048 chunks of one column tile; 227 of nine tiles.
  const auto [width, rows] = GENERATE(table<int64_t, int64_t>({{7, 5000}, {8200, 300}}));
  const bool tanh = GENERATE(false, true);
  CAPTURE(width, rows, tanh);
  check_gelu_case({at::kHalf, tanh, rows, width, Bias::kFloat32, true});
}

TEST_CASE("swiglu kernels equal the CPU ops within their rounding",
          "[kernels][activation_kernels]") {
  at::manual_seed(13);
  const at::ScalarType dtype = GENERATE(at::kFloat, at::kHalf, at::kBFloat16);
  const int64_t width = GENERATE(1, 7, 64, 768, 1000, 4100);
  const int form = GENERATE(0, 1, 2);
  const bool misaligned = GENERATE(false, true);
  CAPTURE(dtype, width, form, misaligned);
  check_swiglu_case({dtype, 5, width, form, misaligned});
}

TEST_CASE("activation kernels launch nothing for empty inputs but zero the bias gradient",
          "[kernels][activation_kernels]") {
  const int64_t width = 40;
  const at::Tensor bias = at::randn({width});
  at::Tensor grad_bias = at::full({width}, 3.f);
  const BiasGeluRows rows{FloatType::kFloat32, 0,    width, nullptr, bias.data_ptr(),
                          FloatType::kFloat32, false};
  const int64_t launches = cuda_emu::counts().launches;
  REQUIRE_LAUNCH(launch_bias_gelu_forward(rows, nullptr, nullptr));
  CHECK(fusetrain::kernels::bias_gelu_backward_scratch_floats(rows) == 0);
  REQUIRE_LAUNCH(
      launch_bias_gelu_backward(rows, nullptr, nullptr, grad_bias.data_ptr(), nullptr, nullptr));
  CHECK(cuda_emu::counts().launches == launches + 1);  // the column sum, over no partials
  CHECK(at::equal(grad_bias, at::zeros({width})));
  const SwigluRows empty{FloatType::kBFloat16, 0, width, 2 * width, nullptr, nullptr};
  REQUIRE_LAUNCH(launch_swiglu_forward(empty, nullptr, nullptr));
  REQUIRE_LAUNCH(launch_swiglu_backward(empty, nullptr, nullptr, nullptr, nullptr));
  CHECK(cuda_emu::counts().launches == launches + 1);
}

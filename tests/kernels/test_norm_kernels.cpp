// The fused layer / RMS norm kernels (csrc/kernels/norm_kernels.cu) run
// through the CUDA emulator against the CPU ops (fusetrain::ops::layer_norm,
// rms_norm and their backwards) over the three input types, other output
// types, with and without residual, weight and bias (float32 or the input's
// type), every group size of Note [Norm row kernels] and the looped kernel
// beyond it, partial 16-byte chunks, misaligned rows, weight gradients over
// more rows than the backward has row groups, and zero rows.
//
// Tolerances, u = 2^-24. The two sides sum a row in different orders: the
// kernel adds a thread's width / threads elements in fp32, then log2(32)
// butterfly levels and threads / 32 warp sums; the CPU op two fp32
// accumulators a SIMD lane (at most width / 16 terms each; 8-lane AVX2),
// finished in double. A sum of terms t_i is then off by at most
//   S = (width / threads + log2 threads + threads / 32 + width / 16 + 8) u
// times sum |t_i| between the two (each side's error bound, added). So
//   mean:  |dmean| <= S mean|v| + an ulp of the mean;
//   rstd:  the centred squares add S plus 3 u (d = v - mean, d * d), and
//          the means' difference adds dmean^2 / var; rstd halves that
//          relative error and adds 3 u (sum with eps, sqrt, division);
//   out = (v - mean) rstd w + b: |w| (|dmean| rstd + |xhat| |drstd|) plus
//          8 u (|xhat w| + |b|) of fp32 rounding on the two sides (with or
//          without FMA), plus one ulp of out_dtype at the larger of the two
//          results (they may round to either side of a boundary).
// The backward takes the CPU's mean and rstd on both sides, so xhat differs
// by rounding only; mean(g) and mean(g xhat) are off by S times the means of
// |g| and |g xhat| (plus 4 u for xhat's own rounding), and grad_input =
// rstd (g - mean(g) - xhat mean(g xhat)) + grad_residual by rstd times those
// plus 8 u of its terms, then an ulp of its type. The weight and bias
// gradients sum `rows` terms per column: the kernel row by row per group
// and the groups in a fixed tree, the CPU 32 rows per block and the blocks
// in double; (rows + 48) u of sum |terms| covers both, plus an ulp of the
// gradient's type. Residual sums are one fp32 add rounded once on both
// sides: the same bits.
#include <fusetrain/ops/norm.h>

#include <ATen/ATen.h>

#include <catch2/catch.hpp>

#include <cmath>
#include <iomanip>
#include <optional>
#include <sstream>
#include <string>

#include "kernel_test.h"
#include "norm_kernels.h"

namespace {

using fusetrain::kernels::FloatType;
using fusetrain::kernels::launch_norm_backward;
using fusetrain::kernels::launch_norm_forward;
using fusetrain::kernels::NormBackwardArgs;
using fusetrain::kernels::NormForwardArgs;
using kernel_test::check_within;
using kernel_test::dbl;
using kernel_test::float_type;
using kernel_test::tiny;
using kernel_test::ulp_gap;
using kernel_test::unit_roundoff;

constexpr double kU = 0x1p-24;
constexpr double kLayerNormEps = 1e-5;

// Note [Norm row kernels]: threads a row (512 for the looped kernel too).
int row_threads(int64_t width) { return width <= 512 ? 32 : (width <= 2048 ? 128 : 512); }

double sum_bound(int64_t width) {
  const int threads = row_threads(width);
  const double w = static_cast<double>(width);
  return (std::ceil(w / threads) + std::log2(threads) + threads / 32.0 + std::ceil(w / 16) + 8) *
         kU;
}

enum class Param { kNone, kFloat32, kInputType };

// One configuration of the optional operands and layouts.
struct Variant {
  const char* name;
  bool residual;
  Param weight;
  Param bias;      // layer norm only
  int out_choice;  // 0: the input's type, 1: float32 (bfloat16 for float32), 2: the other 16-bit
                   // type
  bool misaligned;
  bool grad_residual;
  bool grad_input;  // output_mask[0]
};

constexpr Variant kVariants[] = {
    {"plain", false, Param::kNone, Param::kNone, 0, false, false, true},
    {"residual, float32 params, other out type, misaligned", true, Param::kFloat32, Param::kFloat32,
     1, true, true, true},
    {"residual, params of the input type, weight grads only", true, Param::kInputType,
     Param::kInputType, 2, false, false, false},
    {"weight of the input type, float32 bias, misaligned", false, Param::kInputType,
     Param::kFloat32, 1, true, true, true},
};

at::ScalarType out_type_of(at::ScalarType t, int choice) {
  if (choice == 0) return t;
  if (choice == 1) return t == at::kFloat ? at::kBFloat16 : at::kFloat;
  return t == at::kHalf ? at::kBFloat16 : at::kHalf;
}

// Arrays as the kernels see them: each `offset` elements past a 64-byte
// boundary, the elements before it filled with a sentinel that a kernel
// writing before its row would overwrite.
struct Buffer {
  at::Tensor storage;
  at::Tensor view;
  int64_t offset;
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
  if (b.offset > 0)
    CHECK(at::equal(b.storage.narrow(0, 0, b.offset),
                    at::full({b.offset}, 7.0, b.storage.scalar_type())));
}

FloatType param_type(const Buffer& p) {
  return p.view.defined() ? float_type(p.view.scalar_type()) : FloatType::kFloat32;
}

const void* ptr(const Buffer& b) { return b.view.defined() ? b.view.data_ptr() : nullptr; }

std::optional<at::Tensor> opt(const Buffer& b) {
  return b.view.defined() ? std::optional<at::Tensor>(b.view) : std::nullopt;
}

struct Operands {
  Buffer x, r, w, b;
};

Operands make_operands(int64_t rows, int64_t width, at::ScalarType dtype, const Variant& v,
                       bool rms) {
  // Offsets differ between arrays (each its own phase) when misaligned.
  const auto off = [&](int64_t k) { return v.misaligned ? k : int64_t{0}; };
  const auto param_dtype = [&](Param p) { return p == Param::kFloat32 ? at::kFloat : dtype; };
  Operands o;
  // A mean well away from zero: the centred variance must subtract it.
  o.x = buffer_of(at::randn({rows, width}, at::kDouble) * 2 + 0.75, dtype, off(1));
  if (v.residual) o.r = buffer_of(at::randn({rows, width}, at::kDouble), dtype, off(3));
  if (v.weight != Param::kNone) {
    o.w = buffer_of(1 + 0.5 * at::randn({width}, at::kDouble), param_dtype(v.weight), off(1));
  }
  if (!rms && v.bias != Param::kNone) {
    o.b = buffer_of(0.5 * at::randn({width}, at::kDouble), param_dtype(v.bias), off(3));
  }
  return o;
}

struct NormCase {
  bool rms;
  at::ScalarType dtype;
  int64_t rows;
  int64_t width;
  Variant variant;
};

// Runs the forward and backward of `c` on the emulator and the CPU and
// compares them within the bounds of the file's comment.
void check_norm_case(const NormCase& c) {
  const Variant& v = c.variant;
  const int64_t rows = c.rows;
  const int64_t width = c.width;
  const at::ScalarType out_dtype = out_type_of(c.dtype, v.out_choice);
  const auto off = [&](int64_t k) { return v.misaligned ? k : int64_t{0}; };
  const Operands o = make_operands(rows, width, c.dtype, v, c.rms);
  const double eps = c.rms ? fusetrain::ops::rms_norm_eps(std::nullopt, c.dtype) : kLayerNormEps;

  // The CPU op.
  at::Tensor out_ref, sum_ref, mean_ref, rstd_ref;
  if (c.rms) {
    std::tie(out_ref, sum_ref, rstd_ref) =
        fusetrain::ops::rms_norm(o.x.view, {width}, opt(o.w), std::nullopt, opt(o.r), out_dtype);
  } else {
    std::tie(out_ref, sum_ref, mean_ref, rstd_ref) =
        fusetrain::ops::layer_norm(o.x.view, {width}, opt(o.w), opt(o.b), eps, opt(o.r), out_dtype);
  }

  // The kernel.
  Buffer out = buffer({rows, width}, out_dtype, off(2));
  Buffer sum = v.residual ? buffer({rows, width}, c.dtype, off(1)) : Buffer{};
  at::Tensor mean = at::full({rows}, 123.f);
  at::Tensor rstd = at::full({rows}, 123.f);
  const NormForwardArgs fa{rows,
                           width,
                           float_type(c.dtype),
                           float_type(out_dtype),
                           o.x.view.data_ptr(),
                           ptr(o.r),
                           ptr(o.w),
                           param_type(o.w),
                           ptr(o.b),
                           param_type(o.b),
                           static_cast<float>(eps),
                           c.rms,
                           out.view.data_ptr(),
                           v.residual ? sum.view.data_ptr() : nullptr,
                           c.rms ? nullptr : mean.data_ptr<float>(),
                           rstd.data_ptr<float>()};
  REQUIRE_LAUNCH(launch_norm_forward(fa, nullptr));
  check_sentinel(out);

  // The row as normalised (the rounded sum), the reference's statistics.
  const at::Tensor normed = v.residual ? sum_ref : o.x.view;
  if (v.residual) {
    REQUIRE_BITS_EQUAL(sum.view, sum_ref);
    check_sentinel(sum);
  }
  const at::Tensor vals = dbl(normed);
  const at::Tensor ref_mean =
      c.rms ? at::zeros({rows, 1}, at::kDouble) : dbl(mean_ref).unsqueeze(1);
  const at::Tensor ref_rstd = dbl(rstd_ref).unsqueeze(1);
  const double s_bound = sum_bound(width);
  const at::Tensor tol_mean =
      s_bound * vals.abs().mean(1, true) + 2 * kU * ref_mean.abs() + tiny(at::kFloat);
  if (!c.rms) check_within("mean", mean, mean_ref, tol_mean.squeeze(1));
  const at::Tensor var = (vals - vals.mean(1, true)).square().mean(1, true);
  const at::Tensor dmean = c.rms ? at::zeros_like(tol_mean) : tol_mean;
  const at::Tensor rel_var = s_bound + 3 * kU + dmean.square() / (var + eps);
  const at::Tensor tol_rstd = ref_rstd * (0.5 * rel_var + 3 * kU);
  check_within("rstd", rstd, rstd_ref, tol_rstd.squeeze(1));

  const at::Tensor w = o.w.view.defined() ? dbl(o.w.view) : at::ones({width}, at::kDouble);
  const at::Tensor b = o.b.view.defined() ? dbl(o.b.view) : at::zeros({width}, at::kDouble);
  const at::Tensor xhat = (vals - ref_mean) * ref_rstd;
  const at::Tensor tol_out = w.abs() * (dmean * ref_rstd + xhat.abs() * tol_rstd) +
                             8 * kU * ((xhat * w).abs() + b.abs()) +
                             ulp_gap(out.view, out_ref, out_dtype);
  check_within("out", out.view, out_ref, tol_out);

  // Backward, from the CPU's statistics on both sides.
  const at::Tensor go = at::randn({rows, width}, at::kDouble).to(out_dtype);
  const Buffer grad_out = buffer_of(go, out_dtype, off(3));
  const Buffer grad_res = v.grad_residual
                              ? buffer_of(at::randn({rows, width}, at::kDouble), c.dtype, off(2))
                              : Buffer{};
  const Buffer normed_in = buffer_of(normed, c.dtype, off(1));
  const bool want_w = o.w.view.defined();
  const bool want_b = o.b.view.defined();
  at::Tensor gi_ref, gw_ref, gb_ref;
  if (c.rms) {
    std::tie(gi_ref, gw_ref) =
        fusetrain::ops::rms_norm_backward(grad_out.view, opt(grad_res), normed_in.view, {width},
                                          opt(o.w), rstd_ref, {v.grad_input, true});
  } else {
    std::tie(gi_ref, gw_ref, gb_ref) = fusetrain::ops::layer_norm_backward(
        grad_out.view, opt(grad_res), normed_in.view, {width}, opt(o.w), opt(o.b), mean_ref,
        rstd_ref, {v.grad_input, true, true});
  }
  Buffer gi = v.grad_input ? buffer({rows, width}, c.dtype, off(2)) : Buffer{};
  Buffer gw = want_w ? buffer({width}, o.w.view.scalar_type(), off(1)) : Buffer{};
  Buffer gb = want_b ? buffer({width}, o.b.view.scalar_type(), off(2)) : Buffer{};
  NormBackwardArgs ba{rows,
                      width,
                      float_type(c.dtype),
                      float_type(out_dtype),
                      grad_out.view.data_ptr(),
                      ptr(grad_res),
                      normed_in.view.data_ptr(),
                      ptr(o.w),
                      param_type(o.w),
                      param_type(o.b),
                      c.rms ? nullptr : mean_ref.data_ptr<float>(),
                      rstd_ref.data_ptr<float>(),
                      v.grad_input ? gi.view.data_ptr() : nullptr,
                      want_w ? gw.view.data_ptr() : nullptr,
                      want_b ? gb.view.data_ptr() : nullptr,
                      nullptr};
  at::Tensor scratch = at::full({fusetrain::kernels::norm_backward_scratch_floats(ba)}, 5.f);
  ba.scratch = scratch.data_ptr<float>();
  REQUIRE_LAUNCH(launch_norm_backward(ba, nullptr));

  const at::Tensor g_out = dbl(grad_out.view);
  const at::Tensor g = g_out * w;
  if (v.grad_input) {
    REQUIRE(gi_ref.defined());
    const at::Tensor dmg = c.rms ? at::zeros({rows, 1}, at::kDouble)
                                 : s_bound * g.abs().mean(1, true) + 2 * kU * g.mean(1, true).abs();
    const at::Tensor mgx = (g * xhat).mean(1, true);
    const at::Tensor dmgx =
        (s_bound + 4 * kU) * (g * xhat).abs().mean(1, true) + 2 * kU * mgx.abs();
    const at::Tensor mg = c.rms ? at::zeros({rows, 1}, at::kDouble) : g.mean(1, true);
    const at::Tensor gr = grad_res.view.defined() ? dbl(grad_res.view) : at::zeros_like(g);
    const at::Tensor tol_gi =
        ref_rstd * (dmg + xhat.abs() * dmgx + 8 * kU * (g.abs() + mg.abs() + (xhat * mgx).abs())) +
        2 * kU * gr.abs() + ulp_gap(gi.view, gi_ref, c.dtype);
    check_within("grad_input", gi.view, gi_ref, tol_gi);
    check_sentinel(gi);
  }
  const double rows_bound = (static_cast<double>(rows) + 48) * kU;
  if (want_w) {
    const at::Tensor tol =
        rows_bound * (g_out * xhat).abs().sum(0) + ulp_gap(gw.view, gw_ref, gw_ref.scalar_type());
    check_within("grad_weight", gw.view, gw_ref, tol);
    check_sentinel(gw);
  }
  if (want_b) {
    const at::Tensor tol =
        rows_bound * g_out.abs().sum(0) + ulp_gap(gb.view, gb_ref, gb_ref.scalar_type());
    check_within("grad_bias", gb.view, gb_ref, tol);
    check_sentinel(gb);
  }
}

}  // namespace

TEST_CASE("norm kernels equal the CPU ops within their summation error",
          "[kernels][norm_kernels]") {
  at::manual_seed(7);
  const bool rms = GENERATE(false, true);
  const at::ScalarType dtype = GENERATE(at::kFloat, at::kHalf, at::kBFloat16);
  // 32 threads a row (<= 512), 128 (<= 2048), 512 (<= 8192), then looped;
  // widths off the 4- and 8-element chunks.
  const int64_t width = GENERATE(1, 7, 64, 768, 1000, 4100, 9001);
  const int variant = GENERATE(0, 1, 2, 3);
  const NormCase c{rms, dtype, 5, width, kVariants[variant]};
  CAPTURE(rms, dtype, width, c.variant.name);
  check_norm_case(c);
}

TEST_CASE("norm kernels: the widest rows take the looped kernel", "[kernels][norm_kernels]") {
  at::manual_seed(8);
  const bool rms = GENERATE(false, true);
  const at::ScalarType dtype = GENERATE(at::kFloat, at::kBFloat16);
  const int variant = GENERATE(1, 3);
  const NormCase c{rms, dtype, 2, 65536 + 3, kVariants[variant]};
  CAPTURE(rms, dtype, c.variant.name);
  check_norm_case(c);
}

// More rows than the backward runs row groups (Note [Deterministic column
// sums]): each group adds several rows into its partials, in registers or,
// for the looped kernel, in the scratch.
TEST_CASE("norm kernels: weight gradients over more rows than row groups",
          "[kernels][norm_kernels]") {
  at::manual_seed(9);
  // Groups: 4096 of 32 threads, 1024 of 128, 256 of 512, 128 looped.
  const auto [width, rows] = GENERATE(table<int64_t, int64_t>(
      {{7, 4096 + 37}, {1000, 1024 + 5}, {4100, 256 + 3}, {9001, 128 + 3}}));
  const bool rms = GENERATE(false, true);
  const NormCase c{rms, at::kBFloat16, rows, width, kVariants[1]};
  CAPTURE(rms, width, rows);
  check_norm_case(c);
}

TEST_CASE("norm kernels launch nothing for zero rows but zero the weight gradients",
          "[kernels][norm_kernels]") {
  const int64_t width = 100;
  const at::Tensor w = at::randn({width});
  const at::Tensor b = at::randn({width});
  at::Tensor gw = at::full({width}, 3.f);
  at::Tensor gb = at::full({width}, 3.f);
  const int64_t launches = cuda_emu::counts().launches;
  const NormForwardArgs fa{0,
                           width,
                           FloatType::kFloat32,
                           FloatType::kFloat32,
                           nullptr,
                           nullptr,
                           w.data_ptr(),
                           FloatType::kFloat32,
                           b.data_ptr(),
                           FloatType::kFloat32,
                           1e-5f,
                           false,
                           nullptr,
                           nullptr,
                           nullptr,
                           nullptr};
  REQUIRE_LAUNCH(launch_norm_forward(fa, nullptr));
  CHECK(cuda_emu::counts().launches == launches);

  NormBackwardArgs ba{0,
                      width,
                      FloatType::kFloat32,
                      FloatType::kFloat32,
                      nullptr,
                      nullptr,
                      nullptr,
                      w.data_ptr(),
                      FloatType::kFloat32,
                      FloatType::kFloat32,
                      nullptr,
                      nullptr,
                      nullptr,
                      gw.data_ptr(),
                      gb.data_ptr(),
                      nullptr};
  CHECK(fusetrain::kernels::norm_backward_scratch_floats(ba) == 0);
  REQUIRE_LAUNCH(launch_norm_backward(ba, nullptr));
  // Only the two column sums ran, over no partials.
  CHECK(cuda_emu::counts().launches == launches + 2);
  CHECK(at::equal(gw, at::zeros({width})));
  CHECK(at::equal(gb, at::zeros({width})));
}

TEST_CASE("norm kernels refuse a weight of a third type", "[kernels][norm_kernels]") {
  const at::Tensor x = at::randn({2, 8}).to(at::kHalf);
  const at::Tensor w = at::randn({8}).to(at::kBFloat16);
  at::Tensor out = at::empty({2, 8}, at::kHalf);
  at::Tensor rstd = at::empty({2});
  const NormForwardArgs fa{2,
                           8,
                           FloatType::kFloat16,
                           FloatType::kFloat16,
                           x.data_ptr(),
                           nullptr,
                           w.data_ptr(),
                           FloatType::kBFloat16,
                           nullptr,
                           FloatType::kFloat32,
                           1e-5f,
                           true,
                           out.data_ptr(),
                           nullptr,
                           nullptr,
                           rstd.data_ptr<float>()};
  const int64_t launches = cuda_emu::counts().launches;
  CHECK(launch_norm_forward(fa, nullptr) == cudaErrorInvalidValue);
  CHECK(cuda_emu::counts().launches == launches);
}

// The CUDA fused norm and activation ops (csrc/ops/cuda/norm_cuda.cpp,
// activation_cuda.cpp) against the CPU ops: [cuda] cases, run on the GPU box
// (make gpu-check). Each result is compared with float64 maths at the same
// rounded inputs (input + residual, input + bias, and for the backwards the
// CPU forward's float32 mean and rstd); the CUDA op's largest error must be
// within twice the CPU op's largest error plus one ulp of the result's type
// at the reference's largest magnitude (the two sides round differently, and
// the GPU contracts to FMAs, but neither may be worse than the other by more
// than that). Residual sums are one rounded add on both sides: equal bits.
// The kernels themselves are tested in depth through the CUDA emulator
// (tests/kernels/test_norm_kernels.cpp, test_activation_kernels.cpp); these
// cases check the glue: shapes, dtypes, output masks, non-contiguous inputs,
// the caching allocator's scratch, and the deterministic weight gradients.
#include <fusetrain/ops/activation.h>
#include <fusetrain/ops/norm.h>

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <catch2/catch.hpp>

#include "cuda_test.h"

#include <cmath>
#include <optional>
#include <string>
#include <tuple>

namespace {

const at::Device kCuda(at::kCUDA);

double unit_roundoff(at::ScalarType t) {
  switch (t) {
    case at::kHalf:
      return 0x1p-11;
    case at::kBFloat16:
      return 0x1p-8;
    default:
      return 0x1p-24;
  }
}

at::Tensor dbl(const at::Tensor& t) { return t.cpu().to(at::kDouble); }

std::optional<at::Tensor> on(const std::optional<at::Tensor>& t, const at::Device& d) {
  return t.has_value() ? std::optional<at::Tensor>(t->to(d)) : std::nullopt;
}

// The CUDA result's largest error against `ref` (float64) within twice the
// CPU result's plus an ulp of the type at the reference's largest magnitude,
// plus `extra` where the CUDA kernels sum in another order than the CPU's.
void check_cuda_vs_cpu(const char* what, const at::Tensor& cuda, const at::Tensor& cpu,
                       const at::Tensor& ref, double extra = 0.0) {
  INFO(what);
  REQUIRE(cuda.defined());
  REQUIRE(cpu.defined());
  CHECK(cuda.is_cuda());
  REQUIRE(cuda.scalar_type() == cpu.scalar_type());
  REQUIRE(cuda.sizes() == cpu.sizes());
  if (cuda.numel() == 0) return;
  const double err_cuda = (dbl(cuda) - ref).abs().max().item<double>();
  const double err_cpu = (dbl(cpu) - ref).abs().max().item<double>();
  const double ulp = 2 * unit_roundoff(cuda.scalar_type()) * ref.abs().max().item<double>();
  INFO("largest errors: CUDA " << err_cuda << ", CPU " << err_cpu << ", ulp " << ulp
                               << ", summation " << extra);
  CHECK(err_cuda <= 2 * err_cpu + ulp + extra);
}

double max_of(const at::Tensor& t) { return t.abs().max().item<double>(); }

// The float32 summation error bound of a row on the GPU, relative to the sum
// of its terms' magnitudes (Note [Norm row kernels]: a thread adds
// width / threads elements, then a butterfly of log2(32) and threads / 32
// warp sums); the CPU's own error is already within the comparison.
double row_sum_bound(int64_t width) {
  const int threads = width <= 512 ? 32 : (width <= 2048 ? 128 : 512);
  return (std::ceil(static_cast<double>(width) / threads) + 5 + threads / 32.0 + 4) * 0x1p-24;
}

struct NormCase {
  bool rms;
  at::ScalarType dtype;
  int64_t width;
  bool residual;
  at::ScalarType param_dtype;  // of weight and bias
  at::ScalarType out_dtype;
  bool transposed;  // a non-contiguous input
};

void check_norm(const NormCase& c) {
  const int64_t a = 3;
  const int64_t b = 5;
  at::Tensor x = (at::randn({b, a, c.width}, at::kDouble) * 2 + 0.5).to(c.dtype).transpose(0, 1);
  if (!c.transposed) x = x.contiguous();
  const std::optional<at::Tensor> r =
      c.residual ? std::optional<at::Tensor>(at::randn({a, b, c.width}).to(c.dtype)) : std::nullopt;
  const at::Tensor w = (1 + 0.5 * at::randn({c.width})).to(c.param_dtype);
  const std::optional<at::Tensor> bias =
      c.rms ? std::nullopt
            : std::optional<at::Tensor>((0.5 * at::randn({c.width})).to(c.param_dtype));
  const double eps = c.rms ? fusetrain::ops::rms_norm_eps(std::nullopt, c.dtype) : 1e-5;

  at::Tensor out_cpu, sum_cpu, mean_cpu, rstd_cpu, out_gpu, sum_gpu, mean_gpu, rstd_gpu;
  if (c.rms) {
    std::tie(out_cpu, sum_cpu, rstd_cpu) =
        fusetrain::ops::rms_norm(x, {c.width}, w, std::nullopt, r, c.out_dtype);
    std::tie(out_gpu, sum_gpu, rstd_gpu) = fusetrain::ops::rms_norm(
        x.to(kCuda), {c.width}, w.to(kCuda), std::nullopt, on(r, kCuda), c.out_dtype);
  } else {
    std::tie(out_cpu, sum_cpu, mean_cpu, rstd_cpu) =
        fusetrain::ops::layer_norm(x, {c.width}, w, bias, eps, r, c.out_dtype);
    std::tie(out_gpu, sum_gpu, mean_gpu, rstd_gpu) = fusetrain::ops::layer_norm(
        x.to(kCuda), {c.width}, w.to(kCuda), on(bias, kCuda), eps, on(r, kCuda), c.out_dtype);
  }
  REQUIRE(out_gpu.scalar_type() == c.out_dtype);
  REQUIRE(out_gpu.is_contiguous());
  REQUIRE(rstd_gpu.sizes() == at::IntArrayRef({a, b}));
  if (c.residual) {
    CHECK(at::equal(sum_gpu.cpu(), sum_cpu));
  } else {
    CHECK(sum_gpu.numel() == 0);
  }

  // Forward in float64 from the rounded sum.
  const at::Tensor v = dbl(c.residual ? sum_cpu : x);
  const at::Tensor mean = c.rms ? at::zeros({a, b, 1}, at::kDouble) : v.mean(-1, true);
  const at::Tensor var = c.rms ? v.square().mean(-1, true) : (v - mean).square().mean(-1, true);
  const at::Tensor rstd = (var + eps).rsqrt();
  const at::Tensor y =
      (v - mean) * rstd * dbl(w) + (bias ? dbl(*bias) : at::zeros({1}, at::kDouble));
  const double sb = row_sum_bound(c.width);
  if (!c.rms) check_cuda_vs_cpu("mean", mean_gpu, mean_cpu, mean.squeeze(-1), sb * max_of(v));
  check_cuda_vs_cpu("rstd", rstd_gpu, rstd_cpu, rstd.squeeze(-1), sb * max_of(rstd));
  check_cuda_vs_cpu("out", out_gpu, out_cpu, y,
                    sb * max_of(dbl(w)) * max_of(rstd) * (max_of(v) + max_of(v - mean)));

  // Backward from the CPU's statistics, on both sides.
  const at::Tensor normed = c.residual ? sum_cpu : x;
  const at::Tensor go = at::randn({a, b, c.width}).to(c.out_dtype);
  const std::optional<at::Tensor> gr =
      c.residual ? std::optional<at::Tensor>(at::randn({a, b, c.width}).to(c.dtype)) : std::nullopt;
  const at::Tensor xhat =
      (v - dbl(c.rms ? at::zeros({a, b}) : mean_cpu).unsqueeze(-1)) * dbl(rstd_cpu).unsqueeze(-1);
  const at::Tensor g = dbl(go) * dbl(w);
  const at::Tensor mg = c.rms ? at::zeros({a, b, 1}, at::kDouble) : g.mean(-1, true);
  const at::Tensor gi = dbl(rstd_cpu).unsqueeze(-1) * (g - mg - xhat * (g * xhat).mean(-1, true)) +
                        (gr ? dbl(*gr) : at::zeros({1}, at::kDouble));
  const at::Tensor gw = (dbl(go) * xhat).sum(at::IntArrayRef{0, 1});
  const at::Tensor gb = dbl(go).sum(at::IntArrayRef{0, 1});
  // The GPU's summation errors: the row sums of g and g xhat (times rstd
  // and |xhat|), and the column sums of the a * b rows (row groups, then a
  // fixed tree).
  const double gi_sum_error =
      sb * max_of(dbl(rstd_cpu)) *
      (max_of(g.abs().mean(-1)) + max_of(xhat) * max_of((g * xhat).abs().mean(-1)));
  const double rows_bound = (a * b + 16) * 0x1p-24;
  // grad_input left out once: its tensor is then undefined.
  for (const bool want_input : {true, false}) {
    INFO("grad_input wanted: " << want_input);
    at::Tensor gi_cpu, gw_cpu, gb_cpu, gi_gpu, gw_gpu, gb_gpu, gw_again;
    if (c.rms) {
      std::tie(gi_cpu, gw_cpu) = fusetrain::ops::rms_norm_backward(go, gr, normed, {c.width}, w,
                                                                   rstd_cpu, {want_input, true});
      const auto run = [&] {
        return fusetrain::ops::rms_norm_backward(go.to(kCuda), on(gr, kCuda), normed.to(kCuda),
                                                 {c.width}, w.to(kCuda), rstd_cpu.to(kCuda),
                                                 {want_input, true});
      };
      std::tie(gi_gpu, gw_gpu) = run();
      gw_again = std::get<1>(run());
    } else {
      std::tie(gi_cpu, gw_cpu, gb_cpu) = fusetrain::ops::layer_norm_backward(
          go, gr, normed, {c.width}, w, bias, mean_cpu, rstd_cpu, {want_input, true, true});
      const auto run = [&] {
        return fusetrain::ops::layer_norm_backward(
            go.to(kCuda), on(gr, kCuda), normed.to(kCuda), {c.width}, w.to(kCuda), on(bias, kCuda),
            mean_cpu.to(kCuda), rstd_cpu.to(kCuda), {want_input, true, true});
      };
      std::tie(gi_gpu, gw_gpu, gb_gpu) = run();
      gw_again = std::get<1>(run());
      check_cuda_vs_cpu("grad_bias", gb_gpu, gb_cpu, gb,
                        rows_bound * max_of(dbl(go).abs().sum(at::IntArrayRef{0, 1})));
    }
    if (want_input) {
      check_cuda_vs_cpu("grad_input", gi_gpu, gi_cpu, gi, gi_sum_error);
    } else {
      CHECK_FALSE(gi_gpu.defined());
    }
    check_cuda_vs_cpu("grad_weight", gw_gpu, gw_cpu, gw,
                      rows_bound * max_of((dbl(go) * xhat).abs().sum(at::IntArrayRef{0, 1})));
    // No float atomics: the same bits on every run.
    CHECK(at::equal(gw_gpu, gw_again));
  }
}

}  // namespace

TEST_CASE("CUDA layer_norm and rms_norm match the CPU ops", "[cuda][norm]") {
  REQUIRE_CUDA();
  at::manual_seed(21);
  const bool rms = GENERATE(false, true);
  // 32, 128 and 512 threads a row, and the looped kernel beyond 8192.
  const int64_t width = GENERATE(64, 1000, 4104, 9001);
  const NormCase c =
      GENERATE(NormCase{false, at::kFloat, 0, false, at::kFloat, at::kFloat, false},
               NormCase{false, at::kBFloat16, 0, true, at::kFloat, at::kBFloat16, true},
               NormCase{false, at::kBFloat16, 0, true, at::kBFloat16, at::kFloat, false},
               NormCase{false, at::kHalf, 0, false, at::kHalf, at::kBFloat16, false});
  NormCase run = c;
  run.rms = rms;
  run.width = width;
  CAPTURE(rms, width, c.dtype, c.residual, c.param_dtype, c.out_dtype, c.transposed);
  check_norm(run);
}

TEST_CASE("CUDA norms of zero rows: empty outputs, zero weight gradients", "[cuda][norm]") {
  REQUIRE_CUDA();
  const at::Tensor x = at::empty({0, 48}, at::TensorOptions(kCuda).dtype(at::kBFloat16));
  const at::Tensor w = at::randn({48}, at::TensorOptions(kCuda));
  const at::Tensor b = at::randn({48}, at::TensorOptions(kCuda));
  const auto [out, sum, mean, rstd] =
      fusetrain::ops::layer_norm(x, {48}, w, b, 1e-5, std::nullopt, std::nullopt);
  CHECK(out.sizes() == x.sizes());
  CHECK(mean.numel() == 0);
  const auto [gi, gw, gb] = fusetrain::ops::layer_norm_backward(
      at::empty_like(x), std::nullopt, x, {48}, w, b, mean, rstd, {true, true, true});
  CHECK(gi.numel() == 0);
  CHECK(at::equal(gw.cpu(), at::zeros({48})));
  CHECK(at::equal(gb.cpu(), at::zeros({48})));
}

namespace {

constexpr double kTanhScale = 0.79788456080286535588;  // sqrt(2 / pi)
constexpr double kTanhCubic = 0.044715;

// gelu(s) and gelu'(s) in float64.
std::pair<at::Tensor, at::Tensor> gelu64(const at::Tensor& s, bool tanh) {
  if (tanh) {
    const at::Tensor z = s * (2 * kTanhScale + 2 * kTanhScale * kTanhCubic * s.square());
    const at::Tensor sg = z.sigmoid();
    const at::Tensor dz = 2 * kTanhScale * (1 + 3 * kTanhCubic * s.square());
    return {s * sg, sg + s * sg * (1 - sg) * dz};
  }
  const at::Tensor cdf = 0.5 * at::erfc(-s / std::sqrt(2.0));
  return {s * cdf, cdf + s * (-0.5 * s.square()).exp() / std::sqrt(2 * M_PI)};
}

}  // namespace

TEST_CASE("CUDA bias_gelu matches the CPU op", "[cuda][activation]") {
  REQUIRE_CUDA();
  at::manual_seed(22);
  const at::ScalarType dtype = GENERATE(at::kFloat, at::kBFloat16);
  const bool tanh = GENERATE(false, true);
  const int64_t width = GENERATE(1000, 4100);
  // No bias, a float32 one, one of the input's type.
  const int bias_kind = GENERATE(0, 1, 2);
  CAPTURE(dtype, tanh, width, bias_kind);
  const char* approximate = tanh ? "tanh" : "none";
  const at::Tensor x = (at::randn({4, 9, width}) * 3).to(dtype);
  const std::optional<at::Tensor> bias =
      bias_kind == 0 ? std::nullopt
                     : std::optional<at::Tensor>(
                           (0.5 * at::randn({width})).to(bias_kind == 1 ? at::kFloat : dtype));
  const at::Tensor s = bias ? dbl((dbl(x) + dbl(*bias)).to(at::kFloat).to(dtype)) : dbl(x);
  const auto [y, dy] = gelu64(s, tanh);

  const at::Tensor out_cpu = fusetrain::ops::bias_gelu(x, bias, approximate);
  const at::Tensor out_gpu = fusetrain::ops::bias_gelu(x.to(kCuda), on(bias, kCuda), approximate);
  check_cuda_vs_cpu("bias_gelu", out_gpu, out_cpu, y);

  const at::Tensor go = at::randn({4, 9, width}).to(dtype);
  const auto [gi_cpu, gb_cpu] =
      fusetrain::ops::bias_gelu_backward(go, x, bias, approximate, {true, true});
  const auto run = [&](std::array<bool, 2> mask) {
    return fusetrain::ops::bias_gelu_backward(go.to(kCuda), x.to(kCuda), on(bias, kCuda),
                                              approximate, mask);
  };
  const auto [gi_gpu, gb_gpu] = run({true, true});
  const at::Tensor d = dbl(go) * dy;
  check_cuda_vs_cpu("grad_input", gi_gpu, gi_cpu, d);
  if (bias) {
    check_cuda_vs_cpu("grad_bias", gb_gpu, gb_cpu, d.sum(at::IntArrayRef{0, 1}));
    const auto [no_input, gb_again] = run({false, true});
    CHECK_FALSE(no_input.defined());
    CHECK(at::equal(gb_gpu, gb_again));
  } else {
    CHECK_FALSE(gb_gpu.defined());
  }
}

TEST_CASE("CUDA swiglu matches the CPU op, one [gate | up] tensor or two", "[cuda][activation]") {
  REQUIRE_CUDA();
  at::manual_seed(23);
  const at::ScalarType dtype = GENERATE(at::kFloat, at::kHalf, at::kBFloat16);
  const int64_t width = GENERATE(7, 1000, 4096);
  const bool packed = GENERATE(false, true);
  CAPTURE(dtype, width, packed);
  const at::Tensor a = (at::randn({6, packed ? 2 * width : width}) * 3).to(dtype);
  const std::optional<at::Tensor> b =
      packed ? std::nullopt : std::optional<at::Tensor>(at::randn({6, width}).to(dtype));
  const at::Tensor gate = packed ? dbl(a).narrow(1, 0, width) : dbl(a);
  const at::Tensor up = packed ? dbl(a).narrow(1, width, width) : dbl(*b);
  const at::Tensor sg = gate.sigmoid();

  const at::Tensor out_cpu = fusetrain::ops::swiglu(a, b);
  const at::Tensor out_gpu = fusetrain::ops::swiglu(a.to(kCuda), on(b, kCuda));
  check_cuda_vs_cpu("swiglu", out_gpu, out_cpu, gate * sg * up);

  const at::Tensor go = at::randn({6, width}).to(dtype);
  const auto [ga_cpu, gb_cpu] = fusetrain::ops::swiglu_backward(go, a, b);
  const auto [ga_gpu, gb_gpu] =
      fusetrain::ops::swiglu_backward(go.to(kCuda), a.to(kCuda), on(b, kCuda));
  const at::Tensor g = dbl(go);
  const at::Tensor d_gate = g * up * sg * (1 + gate * (1 - sg));
  const at::Tensor d_up = g * gate * sg;
  if (packed) {
    check_cuda_vs_cpu("grad_a", ga_gpu, ga_cpu, at::cat({d_gate, d_up}, 1));
    CHECK(gb_gpu.numel() == 0);
  } else {
    check_cuda_vs_cpu("grad_a", ga_gpu, ga_cpu, d_gate);
    check_cuda_vs_cpu("grad_b", gb_gpu, gb_cpu, d_up);
  }
}

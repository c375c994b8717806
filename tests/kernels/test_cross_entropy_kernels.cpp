// The softmax cross-entropy kernels (csrc/kernels/cross_entropy_kernels.cu)
// run through the CUDA emulator against the CPU ops of
// csrc/ops/cpu/cross_entropy_cpu.cpp, over the three row widths (a warp, 128 and 256
// threads a row), tails of the 16-byte packs, misaligned rows, row strides,
// ignore_index, label smoothing and the three reductions.
//
// Tolerances. The two sides sum the row's exponentials in different orders
// and precisions (the kernel: fp32 per thread, then a merge tree; the CPU:
// fp64), so lse agrees to the kernel's fp32 summation error: about
// (C / threads + 2 log2(threads) + 16) u relative to the sum, i.e. absolute
// in lse, u = 2^-24 (the 16 covers the 16-byte packs' partial sums, the
// rescales when a thread's maximum grows, and exp's own rounding). On a GPU
// __expf (ex2.approx, <= 2 ulp) and FMA contraction add a few u more; here
// the host's expf is used. The gradient is compared with the kernel's own
// lse fed to both sides, so what remains is one exp (the CPU's vectorised
// exp <= 1.01 ulp, the host's expf < 1 ulp) and the rounding of the result.
#include <fusetrain/ops/cross_entropy.h>

#include <ATen/ATen.h>

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <string>

#include "cross_entropy_kernels.h"
#include "kernel_test.h"

namespace {

using fusetrain::kernels::CrossEntropyRows;
using fusetrain::kernels::launch_cross_entropy_backward;
using fusetrain::kernels::launch_cross_entropy_forward;
using fusetrain::kernels::launch_cross_entropy_reduce;
using kernel_test::float_type;

constexpr double kU = 0x1p-24;

// Threads that share a row (Note [Cross-entropy row kernels]).
int row_threads(int64_t c) { return c <= 1024 ? 32 : (c <= 4096 ? 128 : 256); }

double lse_tolerance(int64_t c) {
  const int threads = row_threads(c);
  return (static_cast<double>(c) / threads + 2 * std::log2(threads) + 16) * kU;
}

// An ulp of |x| in float32, at least the smallest normal's.
double ulp32(double x) {
  const float f = std::max(std::abs(static_cast<float>(x)), std::numeric_limits<float>::min());
  return std::nextafter(f, std::numeric_limits<float>::infinity()) - f;
}

// |got - want| <= tol, or both the same infinity or both NaN (a -inf logit
// makes the smoothed loss +inf on both sides).
bool close(double got, double want, double tol) {
  if (!std::isfinite(want)) return std::isnan(want) ? std::isnan(got) : got == want;
  return std::abs(got - want) <= tol;
}

struct Layout {
  const char* name;
  int64_t offset;        // logits' first element past a 64-byte boundary
  int64_t extra_stride;  // row_stride - c
  int64_t grad_offset;   // the gradient's first element past a 64-byte boundary
};

// The logits [n, c] as the kernels see them: rows of c elements,
// row_stride apart, starting `offset` elements into an allocation.
struct Logits {
  at::Tensor storage;
  at::Tensor view;  // [n, c], strides {row_stride, 1}
  int64_t row_stride;
};

Logits make_logits(int64_t n, int64_t c, at::ScalarType dtype, const Layout& layout) {
  const int64_t row_stride = c + layout.extra_stride;
  Logits l;
  l.row_stride = row_stride;
  l.storage = at::empty({layout.offset + n * row_stride}, dtype).fill_(123);  // padding: never read
  l.view = l.storage.as_strided({n, c}, {row_stride, 1}, layout.offset);
  at::Tensor values = at::randn({n, c}, at::kDouble) * 3;
  if (c > 2) {
    values.index_put_({0, 1}, -std::numeric_limits<double>::infinity());
    values.index_put_({n - 1, c / 2}, 40.0);  // a row with one dominant class
  }
  l.view.copy_(values);
  return l;
}

at::Tensor make_targets(int64_t n, int64_t c, int64_t ignore_index) {
  at::Tensor t = at::randint(0, c, {n}, at::kLong);
  t[0] = c - 1;  // the last class: a tail element
  for (int64_t i = 2; i < n; i += 4) t[i] = ignore_index;
  return t;
}

CrossEntropyRows rows_of(const Logits& l, const at::Tensor& target, int64_t ignore_index,
                         float label_smoothing) {
  return CrossEntropyRows{float_type(l.view.scalar_type()),
                          l.view.data_ptr(),
                          l.row_stride,
                          target.data_ptr<int64_t>(),
                          l.view.size(0),
                          l.view.size(1),
                          ignore_index,
                          label_smoothing};
}

}  // namespace

TEST_CASE("cross-entropy kernels equal the CPU ops within their summation error",
          "[kernels][cross_entropy]") {
  at::manual_seed(3);
  const at::ScalarType dtype = GENERATE(at::kFloat, at::kHalf, at::kBFloat16);
  // A warp a row (<= 1024), 128 threads (<= 4096), 256 threads; pack tails.
  const int64_t c = GENERATE(1, 3, 37, 1024, 1025, 4096, 4097, 6001);
  const int64_t n = GENERATE(1, 19);  // 19: not a multiple of the 4 rows of a warp-row block
  const Layout layout = GENERATE(Layout{"aligned", 0, 0, 0}, Layout{"misaligned", 3, 0, 3},
                                 Layout{"row stride, unequal misalignment", 1, 3, 0});
  const float ls = GENERATE(0.f, 0.1f);
  const int64_t ignore_index = -100;
  CAPTURE(dtype, c, n, layout.name, ls);

  const Logits logits = make_logits(n, c, dtype, layout);
  const at::Tensor target = make_targets(n, c, ignore_index);
  const CrossEntropyRows rows = rows_of(logits, target, ignore_index, ls);

  // Forward: per-row loss and lse.
  at::Tensor row_loss = at::empty({n});
  at::Tensor lse = at::empty({n});
  REQUIRE_LAUNCH(launch_cross_entropy_forward(rows, row_loss.data_ptr<float>(),
                                              lse.data_ptr<float>(), nullptr));
  const auto [ref_loss, ref_lse, ref_kept] = fusetrain::ops::softmax_cross_entropy_forward(
      logits.view, target, ignore_index, ls, "none");
  const double mean_abs = logits.view.to(at::kDouble).abs().nan_to_num(0, 0, 0).mean().item<double>();
  for (int64_t i = 0; i < n; ++i) {
    CAPTURE(i, target[i].item<int64_t>());
    const double got_lse = lse[i].item<double>();
    const double want_lse = ref_lse[i].item<double>();
    CHECK(close(got_lse, want_lse, lse_tolerance(c) + ulp32(want_lse)));
    // The loss adds the smoothed term's fp32 sum of logits (the CPU's is fp64).
    const double want = ref_loss[i].item<double>();
    const double tol = lse_tolerance(c) + ls * (lse_tolerance(c) + 8 * kU) * mean_abs +
                       2 * ulp32(want) + ulp32(want_lse);
    CHECK(close(row_loss[i].item<double>(), want, tol));
  }

  // Reductions of the kernel's own row losses: a double sum, rounded once.
  const at::Tensor kept = target != ignore_index;
  const double sum = row_loss.to(at::kDouble).sum().item<double>();
  const int64_t kept_rows = kept.sum().item<int64_t>();
  float forward_count = -1.f;  // the forward's count, which the backward may reuse
  for (const bool mean : {false, true}) {
    float out = 0.f;
    REQUIRE_LAUNCH(launch_cross_entropy_reduce(row_loss.data_ptr<float>(),
                                               target.data_ptr<int64_t>(), n, ignore_index, mean,
                                               &out, &forward_count, nullptr));
    CHECK(forward_count == static_cast<float>(kept_rows));
    const double want = mean ? sum / static_cast<double>(kept_rows) : sum;
    if (kept_rows == 0 && mean) {
      CHECK(std::isnan(out));
    } else {
      CHECK(close(out, want, ulp32(want)));
    }
  }

  // Backward, for each reduction, with the kernel's lse on both sides; "mean"
  // with the forward's count (one launch) and counting again (two).
  for (const std::string reduction : {"none", "sum", "mean", "mean, counted again"}) {
    CAPTURE(reduction);
    const bool per_row = reduction == "none";
    const bool mean = reduction.rfind("mean", 0) == 0;
    const bool recount = reduction == "mean, counted again";
    const at::Tensor grad_loss = per_row ? at::randn({n}) : at::full({1}, 0.75f);
    at::Tensor grad_storage = at::full({layout.grad_offset + n * c}, 7.0, dtype);
    at::Tensor grad = grad_storage.narrow(0, layout.grad_offset, n * c).view({n, c});
    float count_scratch = -1.f;
    const int64_t launches = cuda_emu::counts().launches;
    REQUIRE_LAUNCH(launch_cross_entropy_backward(
        rows, grad_loss.data_ptr<float>(), per_row, mean, recount ? nullptr : &forward_count,
        recount ? &count_scratch : nullptr, lse.data_ptr<float>(), grad.data_ptr(), nullptr));
    CHECK(cuda_emu::counts().launches - launches == (recount ? 2 : 1));
    if (recount) CHECK(count_scratch == static_cast<float>(kept_rows));
    const at::Tensor ref = fusetrain::ops::softmax_cross_entropy_backward(
        per_row ? grad_loss : grad_loss.reshape({}), logits.view, target, lse, ignore_index, ls,
        mean ? "mean" : reduction);
    // |difference| <= |scale| (2 ulp of p + an ulp of the fp32 result) + the
    // result's rounding to a 16-bit type, with p = exp(x - lse) in double.
    const at::Tensor x = logits.view.to(at::kDouble);
    const at::Tensor p = (x - lse.to(at::kDouble).unsqueeze(1)).exp();
    at::Tensor scale = per_row ? grad_loss.to(at::kDouble).unsqueeze(1)
                               : grad_loss.to(at::kDouble).expand({n, 1}).clone();
    if (mean) scale = scale / static_cast<double>(std::max<int64_t>(kept_rows, 1));
    const at::Tensor r = ref.to(at::kDouble);
    const double u_out = kernel_test::unit_roundoff(dtype);
    const at::Tensor tol = scale.abs() * (4 * kU * p + 2 * kU) + 2 * u_out * r.abs() +
                           (dtype == at::kFloat ? 0.0 : 1e-30);
    const at::Tensor diff = (grad.to(at::kDouble) - r).abs();
    const at::Tensor bad = (diff > tol).logical_and(kept.unsqueeze(1));
    INFO("elements outside the tolerance: " << bad.sum().item<int64_t>() << ", largest |diff| "
                                            << diff.max().item<double>());
    CHECK(bad.sum().item<int64_t>() == 0);
    // Ignored rows are exact zeros, and nothing outside the gradient is written.
    CHECK(kernel_test::bits_equal(grad.index({kept.logical_not()}),
                                  at::zeros_like(grad.index({kept.logical_not()}))));
    if (layout.grad_offset > 0) {
      CHECK(at::equal(grad_storage.narrow(0, 0, layout.grad_offset),
                      at::full({layout.grad_offset}, 7.0, dtype)));
    }
  }
}

TEST_CASE("cross-entropy reduction of an all-ignored batch: sum 0, mean NaN",
          "[kernels][cross_entropy]") {
  const int64_t n = 37;
  const at::Tensor target = at::full({n}, -1, at::kLong);
  const at::Tensor row_loss = at::zeros({n});
  float sum = 1.f;
  float mean = 1.f;
  float kept = 1.f;
  REQUIRE_LAUNCH(launch_cross_entropy_reduce(row_loss.data_ptr<float>(),
                                             target.data_ptr<int64_t>(), n, -1, false, &sum,
                                             nullptr, nullptr));
  REQUIRE_LAUNCH(launch_cross_entropy_reduce(row_loss.data_ptr<float>(),
                                             target.data_ptr<int64_t>(), n, -1, true, &mean,
                                             &kept, nullptr));
  CHECK(sum == 0.f);
  CHECK(std::isnan(mean));
  CHECK(kept == 0.f);
}

TEST_CASE("cross-entropy reduction sums thousands of rows over every warp of the block",
          "[kernels][cross_entropy]") {
  // More rows than the block's 1024 threads: each thread sums several.
  const int64_t n = 5000;
  at::Tensor target = at::arange(n, at::kLong) % 7;  // ignore_index 3: every 7th row from 3
  const at::Tensor row_loss = at::rand({n}) * 10;
  float mean = 0.f;
  float count = 0.f;
  REQUIRE_LAUNCH(launch_cross_entropy_reduce(row_loss.data_ptr<float>(),
                                             target.data_ptr<int64_t>(), n, 3, true, &mean,
                                             nullptr, nullptr));
  // The count alone (no row losses read).
  REQUIRE_LAUNCH(launch_cross_entropy_reduce(nullptr, target.data_ptr<int64_t>(), n, 3, false,
                                             nullptr, &count, nullptr));
  const at::Tensor kept = target != 3;
  CHECK(count == static_cast<float>(kept.sum().item<int64_t>()));
  const double want = row_loss.to(at::kDouble).sum().item<double>() /
                      static_cast<double>(kept.sum().item<int64_t>());
  CHECK(std::abs(mean - want) <= ulp32(want));
}

TEST_CASE("cross-entropy kernels do nothing for an empty batch", "[kernels][cross_entropy]") {
  const int64_t launches = cuda_emu::counts().launches;
  const CrossEntropyRows rows{kernel_test::FloatType::kFloat32, nullptr, 10, nullptr, 0, 10, -100,
                              0.f};
  REQUIRE_LAUNCH(launch_cross_entropy_forward(rows, nullptr, nullptr, nullptr));
  REQUIRE_LAUNCH(launch_cross_entropy_backward(rows, nullptr, false, true, nullptr, nullptr,
                                               nullptr, nullptr, nullptr));
  CHECK(cuda_emu::counts().launches == launches);
}

// The chunked linear cross-entropy hands the kernel its logits as the
// gradient's memory too: each element must be read before it is overwritten,
// in every path of a row (the elements before the first 16-byte boundary,
// the packs, the tail) and at every row width.
TEST_CASE("the cross-entropy backward can write its gradient over the logits",
          "[kernels][cross_entropy]") {
  const auto dtype = GENERATE(at::kFloat, at::kHalf, at::kBFloat16);
  const int64_t c = GENERATE(37, 1000, 3001, 5003);
  const int64_t offset = GENERATE(0, 3);  // rows starting on and off a 16-byte boundary
  const bool per_row = GENERATE(false, true);
  CAPTURE(dtype, c, offset, per_row);
  const int64_t n = 7;
  const int64_t ignore_index = -100;
  const float ls = 0.1f;
  const Logits logits = make_logits(n, c, dtype, Layout{"in place", offset, 0, offset});
  const at::Tensor target = make_targets(n, c, ignore_index);
  at::Tensor lse = at::empty({n});
  at::Tensor row_loss = at::empty({n});
  REQUIRE_LAUNCH(launch_cross_entropy_forward(rows_of(logits, target, ignore_index, ls),
                                              row_loss.data_ptr<float>(), lse.data_ptr<float>(),
                                              nullptr));
  const at::Tensor grad_loss = per_row ? at::randn({n}) : at::full({1}, 0.5f);
  at::Tensor apart = at::full({n, c}, 7.0, dtype);
  REQUIRE_LAUNCH(launch_cross_entropy_backward(rows_of(logits, target, ignore_index, ls),
                                               grad_loss.data_ptr<float>(), per_row, false,
                                               nullptr, nullptr, lse.data_ptr<float>(),
                                               apart.data_ptr(), nullptr));
  const at::Tensor padding = logits.storage.narrow(0, 0, offset).clone();
  REQUIRE_LAUNCH(launch_cross_entropy_backward(rows_of(logits, target, ignore_index, ls),
                                               grad_loss.data_ptr<float>(), per_row, false,
                                               nullptr, nullptr, lse.data_ptr<float>(),
                                               logits.view.data_ptr(), nullptr));
  CHECK(kernel_test::bits_equal(logits.view, apart));
  CHECK(at::equal(logits.storage.narrow(0, 0, offset), padding));
}

TEST_CASE("a target out of range is a sticky device assert naming the kernel",
          "[kernels][cross_entropy]") {
  const int64_t n = 6;
  const int64_t c = 50;
  const Layout aligned{"aligned", 0, 0, 0};
  const Logits logits = make_logits(n, c, at::kFloat, aligned);
  at::Tensor target = at::zeros({n}, at::kLong);
  target[4] = c;  // one past the last class
  at::Tensor row_loss = at::empty({n});
  at::Tensor lse = at::empty({n});
  const cudaError_t err = launch_cross_entropy_forward(
      rows_of(logits, target, -100, 0.f), row_loss.data_ptr<float>(), lse.data_ptr<float>(),
      nullptr);
  CHECK(err == cudaErrorAssert);
  const std::string message = cuda_emu::last_error_message();
  CAPTURE(message);
  CHECK(message.find("forward_kernel") != std::string::npos);
  CHECK(message.find("target in [0, C)") != std::string::npos);
  CHECK(message.find("block (1,0,0)") != std::string::npos);  // row 4: the second block of 4 rows

  // Sticky, as on a GPU: later launches do not run and report the assert.
  const int64_t launches = cuda_emu::counts().launches;
  target[4] = 0;
  CHECK(launch_cross_entropy_forward(rows_of(logits, target, -100, 0.f),
                                     row_loss.data_ptr<float>(), lse.data_ptr<float>(),
                                     nullptr) == cudaErrorAssert);
  CHECK(cuda_emu::counts().launches == launches);
}

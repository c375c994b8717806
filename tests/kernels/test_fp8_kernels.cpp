// The float8 quantisation kernels (csrc/kernels/fp8_kernels.cu) run through
// the CUDA emulator against the CPU ops of csrc/ops/fp8.cpp, bit for bit:
// the amax is an integer max of |x|'s bits, the scale one rule shared by both
// sides (fp8_scaling.h), and the cast one rounded product and a saturating
// conversion per element.
#include <fusetrain/ops/fp8.h>

#include <ATen/ATen.h>

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <tuple>
#include <utility>

#include "fp8_kernels.h"
#include "kernel_test.h"

namespace {

using fusetrain::kernels::Fp8Type;
using fusetrain::kernels::launch_fp8_quantize_current;
using fusetrain::kernels::launch_fp8_quantize_current_transpose;
using fusetrain::kernels::launch_fp8_quantize_delayed;
using fusetrain::kernels::launch_fp8_quantize_delayed_transpose;
using kernel_test::at_offset;
using kernel_test::float_type;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

Fp8Type fp8_type(at::ScalarType dtype) {
  return dtype == at::kFloat8_e5m2 ? Fp8Type::kE5M2 : Fp8Type::kE4M3;
}

// Values over many binades (so some round to float8 subnormals and zero),
// ties of the float8 grid, signed zeros, and optionally inf and NaN.
at::Tensor values(int64_t n, at::ScalarType dtype, bool non_finite) {
  at::Tensor x = at::randn({n}, at::kDouble) * at::pow(10.0, at::randint(-6, 4, {n}).to(at::kDouble));
  if (n > 3) {
    x[0] = -0.0;
    x[n / 2] = 1.0625;  // between e4m3's 1.0 and 1.125 at scale 1: a tie
  }
  if (non_finite && n > 7) {
    x[5] = kInf;
    x[n - 1] = -kInf;
    x[n - 2] = kNaN;
  }
  return x.to(dtype);
}

// The float8 bytes of a quantised tensor.
at::Tensor bytes_of(const at::Tensor& q) { return q.view(at::kByte); }

// The transpose the cast+transpose kernels must write, computed from the
// CPU op's bytes by plain indexing: [cols, padded_rows], zero past rows.
at::Tensor transposed_bytes(const at::Tensor& q, int64_t padded_rows) {
  const at::Tensor b = bytes_of(q);
  at::Tensor t = at::zeros({b.size(1), padded_rows}, at::kByte);
  for (int64_t i = 0; i < b.size(0); ++i) t.select(1, i).copy_(b.select(0, i));
  return t;
}

}  // namespace

TEST_CASE("current-scaling kernels equal the CPU op bit for bit", "[kernels][fp8]") {
  at::manual_seed(4);
  const at::ScalarType in = GENERATE(at::kFloat, at::kHalf, at::kBFloat16);
  const at::ScalarType out = GENERATE(at::kFloat8_e4m3fn, at::kFloat8_e5m2);
  const int64_t n = GENERATE(1, 15, 16, 17, 4111, 278011);
  // Aligned; x off a 16-byte boundary and the bytes off their pack size; or
  // x aligned and the bytes not (the vector loads with byte-wise stores).
  const auto [x_offset, out_offset] = GENERATE(std::pair<int64_t, int64_t>{0, 0},
                                               std::pair<int64_t, int64_t>{3, 1},
                                               std::pair<int64_t, int64_t>{0, 1});
  const bool non_finite = GENERATE(false, true);
  // One block striding over everything, or many (their amaxes meet in an atomicMax).
  const int max_blocks = GENERATE(1, 64);
  const int margin = max_blocks == 1 ? 0 : 2;
  CAPTURE(in, out, n, x_offset, out_offset, non_finite, margin, max_blocks);

  const at::Tensor x = at_offset(values(n, in, non_finite), x_offset);
  at::Tensor q = at::empty({out_offset + n}, at::kByte).narrow(0, out_offset, n);
  // A previous scale of 3: the one kept when the amax is NaN.
  at::Tensor scale = at::full({1}, 3.f);
  at::Tensor amax = at::full({1}, -1.f);  // the kernel zeroes it first
  REQUIRE_LAUNCH(launch_fp8_quantize_current(float_type(in), x.data_ptr(), n, fp8_type(out),
                                             q.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                                             amax.data_ptr<float>(), margin, max_blocks, nullptr));
  at::Tensor ref_scale = at::full({1}, 3.f);
  at::Tensor ref_amax = at::zeros({1});
  const at::Tensor ref = fusetrain::ops::fp8_quantize_current(x, out, ref_scale, ref_amax, margin);
  REQUIRE_BITS_EQUAL(amax, ref_amax);
  REQUIRE_BITS_EQUAL(scale, ref_scale);
  REQUIRE_BITS_EQUAL(q, bytes_of(ref));
  if (non_finite && n > 7) CHECK(std::isnan(amax.item<float>()));
}

TEST_CASE("current scaling of an empty tensor: amax 0, scale kept", "[kernels][fp8]") {
  float scale = 5.f;
  float amax = 7.f;
  REQUIRE_LAUNCH(launch_fp8_quantize_current(kernel_test::FloatType::kFloat32, nullptr, 0,
                                             Fp8Type::kE4M3, nullptr, &scale, &amax, 0, 4,
                                             nullptr));
  CHECK(amax == 0.f);
  CHECK(scale == 5.f);
}

TEST_CASE("delayed-scaling kernels equal the CPU op bit for bit over steps", "[kernels][fp8]") {
  at::manual_seed(5);
  const at::ScalarType in = GENERATE(at::kFloat, at::kBFloat16);
  const at::ScalarType out = GENERATE(at::kFloat8_e4m3fn, at::kFloat8_e5m2);
  // 1024: the longest history, one entry per thread of the scale kernel.
  const int64_t history_len = GENERATE(1, 3, 16, 1024);
  const int64_t n = GENERATE(17, 70001);
  const int64_t x_offset = GENERATE(0, 5);
  const int margin = GENERATE(0, 1);
  CAPTURE(in, out, history_len, n, x_offset, margin);

  // A history with non-finite entries (ignored by the max) and small
  // amaxes, so that the first steps saturate the larger values of x.
  at::Tensor history = at::rand({history_len}) * 0.01;
  if (history_len > 2) {
    history[1] = std::numeric_limits<float>::infinity();
    history[history_len - 1] = std::numeric_limits<float>::quiet_NaN();
  }
  at::Tensor ref_history = history.clone();
  // Not a positive finite number: counts as 1 on both sides.
  at::Tensor scale = at::full({1}, -2.f);
  at::Tensor ref_scale = scale.clone();
  for (int step = 0; step < 4; ++step) {
    CAPTURE(step);
    const at::Tensor x = at_offset(values(n, in, step == 2) * (step + 1), x_offset);
    at::Tensor q = at::empty({n}, at::kByte);
    REQUIRE_LAUNCH(launch_fp8_quantize_delayed(float_type(in), x.data_ptr(), n, fp8_type(out),
                                               q.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                                               history.data_ptr<float>(), history_len, margin, 3,
                                               nullptr));
    const at::Tensor ref =
        fusetrain::ops::fp8_quantize_delayed(x, out, ref_scale, ref_history, margin);
    REQUIRE_BITS_EQUAL(scale, ref_scale);
    REQUIRE_BITS_EQUAL(history, ref_history);
    REQUIRE_BITS_EQUAL(q, bytes_of(ref));
  }
  // The saturating cast was exercised: some bytes are the format's largest.
  const uint8_t largest = out == at::kFloat8_e5m2 ? 0x7b : 0x7e;
  const at::Tensor x = at_offset(values(n, in, false) * 1e3, x_offset);
  at::Tensor q = at::empty({n}, at::kByte);
  history.fill_(1e-3);
  REQUIRE_LAUNCH(launch_fp8_quantize_delayed(float_type(in), x.data_ptr(), n, fp8_type(out),
                                             q.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                                             history.data_ptr<float>(), history_len, margin, 3,
                                             nullptr));
  CHECK((q.bitwise_and(0x7f) == largest).sum().item<int64_t>() > 0);
}

TEST_CASE("delayed scaling refuses a history longer than the scale kernel's block",
          "[kernels][fp8]") {
  float scale = 1.f;
  at::Tensor history = at::zeros({1025});
  const int64_t launches = cuda_emu::counts().launches;
  CHECK(launch_fp8_quantize_delayed(kernel_test::FloatType::kFloat32, nullptr, 0, Fp8Type::kE4M3,
                                    nullptr, &scale, history.data_ptr<float>(), 1025, 0, 4,
                                    nullptr) == cudaErrorInvalidValue);
  CHECK(cuda_emu::counts().launches == launches);
}

// Note [Float8 cast + transpose]: both layouts in one pass, against the CPU
// op's bytes and their transpose. Shapes: one element; ragged tiles on both
// sides (odd columns make every row after the first misaligned, so the
// scalar paths run); exactly one 64 x 64 tile; several tiles with the
// padded rows spilling into a tile of their own; padding not a multiple of
// 16 (the byte-wise transposed stores).
TEST_CASE("cast+transpose kernels write both layouts, bit for bit", "[kernels][fp8]") {
  at::manual_seed(6);
  const at::ScalarType in = GENERATE(at::kFloat, at::kHalf, at::kBFloat16);
  const at::ScalarType out = GENERATE(at::kFloat8_e4m3fn, at::kFloat8_e5m2);
  const auto [rows, cols, padded_rows] = GENERATE(
      std::tuple<int64_t, int64_t, int64_t>{1, 1, 16}, std::tuple<int64_t, int64_t, int64_t>{15, 17, 16},
      std::tuple<int64_t, int64_t, int64_t>{64, 64, 64}, std::tuple<int64_t, int64_t, int64_t>{130, 96, 144},
      std::tuple<int64_t, int64_t, int64_t>{190, 33, 195}, std::tuple<int64_t, int64_t, int64_t>{0, 48, 16});
  const int64_t x_offset = GENERATE(0, 3);
  const bool delayed = GENERATE(false, true);
  CAPTURE(in, out, rows, cols, padded_rows, x_offset, delayed);

  const at::Tensor x = at_offset(values(rows * cols, in, rows * cols > 7), x_offset);
  at::Tensor q = at::full({rows, cols}, 0xaa, at::kByte);
  // Filled with a marker, so a byte the kernel fails to write shows.
  at::Tensor q_t = at::full({cols, padded_rows}, 0xaa, at::kByte);
  at::Tensor scale = at::full({1}, 3.f);
  at::Tensor state = delayed ? at::tensor({0.5f, 2.f, 0.25f}) : at::full({1}, -1.f);
  at::Tensor ref_scale = scale.clone();
  at::Tensor ref_state = delayed ? state.clone() : at::zeros({1});
  const int margin = delayed ? 1 : 0;
  if (delayed) {
    REQUIRE_LAUNCH(launch_fp8_quantize_delayed_transpose(
        float_type(in), x.data_ptr(), rows, cols, padded_rows, fp8_type(out),
        q.data_ptr<uint8_t>(), q_t.data_ptr<uint8_t>(), scale.data_ptr<float>(),
        state.data_ptr<float>(), state.numel(), margin, 8, nullptr));
  } else {
    REQUIRE_LAUNCH(launch_fp8_quantize_current_transpose(
        float_type(in), x.data_ptr(), rows, cols, padded_rows, fp8_type(out),
        q.data_ptr<uint8_t>(), q_t.data_ptr<uint8_t>(), scale.data_ptr<float>(),
        state.data_ptr<float>(), margin, 8, nullptr));
  }
  const at::Tensor x2 = x.view({rows, cols});
  const at::Tensor ref =
      delayed ? fusetrain::ops::fp8_quantize_delayed(x2, out, ref_scale, ref_state, margin)
              : fusetrain::ops::fp8_quantize_current(x2, out, ref_scale, ref_state, margin);
  REQUIRE_BITS_EQUAL(scale, ref_scale);
  REQUIRE_BITS_EQUAL(state, ref_state);
  REQUIRE_BITS_EQUAL(q, bytes_of(ref));
  REQUIRE_BITS_EQUAL(q_t, transposed_bytes(ref, padded_rows));
}

TEST_CASE("cast+transpose refuses fewer padded rows than rows", "[kernels][fp8]") {
  float scale = 1.f;
  float amax = 0.f;
  const int64_t launches = cuda_emu::counts().launches;
  uint8_t byte = 0;
  CHECK(launch_fp8_quantize_current_transpose(kernel_test::FloatType::kFloat32, &scale, 2, 1, 1,
                                              Fp8Type::kE4M3, &byte, &byte, &scale, &amax, 0, 4,
                                              nullptr) == cudaErrorInvalidValue);
  CHECK(cuda_emu::counts().launches == launches);
}

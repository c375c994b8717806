// Helpers of the kernel tests: host tensors at chosen misalignments, the
// kernels' type tags, bitwise comparison, and a launch check that prints the
// emulator's message (kernel, block, thread, line) when a launch fails.
#pragma once

#include <ATen/ATen.h>

#include <catch2/catch.hpp>

#include <cstdint>
#include <iomanip>
#include <sstream>
#include <limits>
#include <string>

#include "amp_kernels.h"
#include "emulator.h"

#define REQUIRE_LAUNCH(...)                                   \
  do {                                                        \
    const cudaError_t launch_error_ = (__VA_ARGS__);          \
    INFO("emulator: " << ::cuda_emu::last_error_message());   \
    REQUIRE(launch_error_ == cudaSuccess);                    \
  } while (0)

namespace kernel_test {

using fusetrain::kernels::FloatType;

inline FloatType float_type(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return FloatType::kFloat32;
    case at::kHalf:
      return FloatType::kFloat16;
    case at::kBFloat16:
      return FloatType::kBFloat16;
    case at::kDouble:
      return FloatType::kFloat64;
    default:
      FAIL("no FloatType for " << dtype);
      return FloatType::kFloat32;
  }
}

/// `n` elements whose first one lies `offset` elements past a fresh 64-byte
/// aligned allocation: offsets that are not a multiple of 16 bytes take the
/// kernels' unaligned paths. The allocation ends with the view, so an access
/// past element n - 1 is a heap overflow that AddressSanitizer reports.
inline at::Tensor at_offset(const at::Tensor& values, int64_t offset) {
  at::Tensor base = at::empty({values.numel() + offset}, values.options());
  at::Tensor view = base.narrow(0, offset, values.numel());
  view.copy_(values.reshape(-1));
  return view;
}

/// A copy of `t` at the same misalignment (torch's CPU allocations are
/// 64-byte aligned), so the kernel takes the path the original would.
inline at::Tensor copy_in_place_of(const at::Tensor& t) {
  const auto misaligned = reinterpret_cast<uintptr_t>(t.data_ptr()) % 64;
  return at_offset(t, static_cast<int64_t>(misaligned) / t.element_size());
}

// The bits of `t` as integers of its width, every NaN made one NaN: the
// host conversions of cuda_fp16.h / cuda_bf16.h (as the GPU's) and c10's
// give NaNs different payloads, which no arithmetic result depends on.
inline at::Tensor as_integers(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  if (c.is_floating_point()) {
    c = at::where(c.isnan(), at::full({}, std::numeric_limits<double>::quiet_NaN(), c.options()), c);
  }
  const at::ScalarType as_int = c.element_size() == 8   ? at::kLong
                                : c.element_size() == 4 ? at::kInt
                                : c.element_size() == 2 ? at::kShort
                                                        : at::kByte;
  return c.view(as_int).reshape(-1);
}

/// Same shape, dtype and bits (signed zeros included; NaN payloads aside).
inline bool bits_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  return at::equal(as_integers(a), as_integers(b));
}

/// The first element whose bits differ, with both values, for failure
/// messages.
inline std::string first_difference(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) {
    return "shapes or dtypes differ";
  }
  const at::Tensor where = at::ne(as_integers(a), as_integers(b)).nonzero();
  if (where.numel() == 0) return "the same bits";
  const int64_t i = where[0][0].item<int64_t>();
  const at::Tensor x = a.reshape(-1).to(at::kDouble);
  const at::Tensor y = b.reshape(-1).to(at::kDouble);
  return "element " + std::to_string(i) + " of " + std::to_string(x.numel()) + ": " +
         std::to_string(x[i].item<double>()) + " vs " + std::to_string(y[i].item<double>()) +
         " (" + std::to_string(where.size(0)) + " elements differ)";
}

#define REQUIRE_BITS_EQUAL(a, b)                                                          \
  do {                                                                                    \
    const bool same_bits_ = ::kernel_test::bits_equal((a), (b));                          \
    INFO((same_bits_ ? std::string() : ::kernel_test::first_difference((a), (b))));       \
    REQUIRE(same_bits_);                                                                  \
  } while (0)

/// The unit roundoff of a floating type (half an ulp of 1).
inline double unit_roundoff(at::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf:
      return std::ldexp(1.0, -11);
    case at::kBFloat16:
      return std::ldexp(1.0, -8);
    case at::kDouble:
      return std::ldexp(1.0, -53);
    default:
      return std::ldexp(1.0, -24);
  }
}

/// The smallest positive value of a type: the floor of an ulp.
inline double tiny(at::ScalarType t) {
  switch (t) {
    case at::kHalf:
      return 0x1p-24;
    case at::kBFloat16:
      return 0x1p-133;
    default:
      return 0x1p-149;
  }
}

inline at::Tensor dbl(const at::Tensor& t) { return t.to(at::kDouble); }

/// One ulp of `type` at the larger magnitude of a and b.
inline at::Tensor ulp_gap(const at::Tensor& a, const at::Tensor& b, at::ScalarType type) {
  return 2 * unit_roundoff(type) * at::maximum(dbl(a).abs(), dbl(b).abs()) + tiny(type);
}

/// |got - want| <= tol everywhere, NaN where the reference has NaN (and
/// got's dtype want's, unless want is a float64 reference); reports the
/// count and the first element outside the bound.
inline void check_within(const char* what, const at::Tensor& got, const at::Tensor& want,
                         const at::Tensor& tol) {
  REQUIRE(got.sizes() == want.sizes());
  if (want.scalar_type() != at::kDouble) REQUIRE(got.scalar_type() == want.scalar_type());
  const at::Tensor diff = (dbl(got) - dbl(want)).abs();
  const at::Tensor bad = (diff > tol).logical_or(got.isnan() != want.isnan());
  const int64_t n_bad = bad.sum().item<int64_t>();
  std::ostringstream first;
  if (n_bad > 0) {
    const int64_t i = bad.reshape(-1).nonzero()[0][0].item<int64_t>();
    first << std::setprecision(9) << ", the first at " << i << ": "
          << dbl(got).reshape(-1)[i].item<double>() << " vs "
          << dbl(want).reshape(-1)[i].item<double>() << ", bound "
          << tol.expand_as(diff).reshape(-1)[i].item<double>();
  }
  INFO(what << ": " << n_bad << " of " << got.numel() << " elements outside the bound"
            << first.str());
  CHECK(n_bad == 0);
}

}  // namespace kernel_test

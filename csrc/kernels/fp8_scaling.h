// The float8 scaling rule and the saturating cast's edge cases, defined once
// for the CPU ops (csrc/ops/fp8.cpp) and the CUDA kernels (fp8_kernels.cu), so
// both compute the same scale to the bit. Plain C++; no torch, no CUDA runtime.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FUSETRAIN_HOST_DEVICE __host__ __device__
#else
#define FUSETRAIN_HOST_DEVICE
#endif

namespace fusetrain::kernels::fp8 {

/// Largest finite values of the two formats (OCP FP8: e4m3fn has no inf).
constexpr float kE4M3Max = 448.f;
constexpr float kE5M2Max = 57344.f;

constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kInfBits = 0x7f800000u;

FUSETRAIN_HOST_DEVICE inline uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
#endif
}

FUSETRAIN_HOST_DEVICE inline float bits_float(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
#endif
}

/// |x|'s bit pattern, with every NaN made the one positive quiet NaN
/// (0x7fc00000), so CPU and GPU agree whatever payload a conversion left. As
/// unsigned integers these order like |x|, with inf above every finite value
/// and NaN above inf: the amax of a tensor is one integer max (an atomicMax
/// on the GPU), and a NaN anywhere makes it NaN.
constexpr uint32_t kNaNBits = 0x7fc00000u;
FUSETRAIN_HOST_DEVICE inline uint32_t abs_bits(float x) {
  const uint32_t b = float_bits(x) & kAbsMask;
  return b > kInfBits ? kNaNBits : b;
}

/// Longest amax history the ops take (the scale kernel holds it in one block).
constexpr int64_t kMaxAmaxHistory = 1024;

/// Note [Float8 scaling]: the scale that maps `amax` onto the format's largest
/// value with `margin` binades of head-room, Transformer Engine's rule:
///   scale = fp8_max / amax / 2^margin,   kept within [FLT_MIN, FLT_MAX];
/// an amax that is zero, inf or NaN keeps `prev_scale` (nothing to learn from
/// it), so one overflowing step cannot poison the scale. A previous scale
/// that is not a positive finite number (never written by these ops) counts
/// as 1, so a finite x * scale is always finite or saturates, never NaN.
FUSETRAIN_HOST_DEVICE inline float scale_from_amax(float amax, float prev_scale, float fp8_max,
                                                   int margin) {
  if (!(prev_scale > 0.f) || abs_bits(prev_scale) >= kInfBits) prev_scale = 1.f;
  if (!(amax > 0.f) || abs_bits(amax) >= kInfBits) return prev_scale;
  const float scale = ldexpf(fp8_max / amax, -margin);
  if (abs_bits(scale) >= kInfBits) return FLT_MAX;
  return scale < FLT_MIN ? FLT_MIN : scale;
}

/// The float8 byte of a non-finite input: e4m3fn has no inf, so inf and NaN
/// become NaN (0x7f, with inf's sign); e5m2 keeps inf (0x7c, signed) and NaN
/// (0x7f). A NaN's sign is dropped (conversions do not agree on it). These
/// pass through the saturating cast so that GradScaler still sees overflow.
FUSETRAIN_HOST_DEVICE inline uint8_t non_finite_byte(float x, bool e5m2) {
  const uint32_t b = float_bits(x);
  if ((b & kAbsMask) > kInfBits) return 0x7fu;
  const uint8_t sign = static_cast<uint8_t>((b >> 24) & 0x80u);
  return static_cast<uint8_t>((e5m2 ? 0x7cu : 0x7fu) | sign);
}

}  // namespace fusetrain::kernels::fp8

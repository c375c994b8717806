// The AVX2 (+FMA, F16C) vector interface of Note [SIMD regions]: 8 float
// lanes. simd_avx512.h has the same names with 16 lanes.
#pragma once

#include <fusetrain/ops/cpu/simd.h>

#ifdef FUSETRAIN_SIMD_X86
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

FUSETRAIN_SIMD_BEGIN(avx2)
namespace fusetrain::ops::simd::avx2 {

constexpr int kLanes = 8;

struct F {
  __m256 v;
};
struct M {  // a lane mask: all ones or all zeros per lane
  __m256 v;
};
struct D {  // kLanes doubles: lanes 0-3 in lo, 4-7 in hi
  __m256d lo, hi;
};
struct U {  // kLanes unsigned 32-bit integers
  __m256i v;
};

inline F set1(float x) { return {_mm256_set1_ps(x)}; }
inline F zero() { return {_mm256_setzero_ps()}; }

inline F load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline F load(const c10::BFloat16* p) {
  // bf16 is the top half of an fp32: widen and shift into place.
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))};
}
inline F load(const c10::Half* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}

inline void store(float* p, F x) { _mm256_storeu_ps(p, x.v); }
inline void store(c10::BFloat16* p, F x) {
  // Round to nearest even, NaN to the canonical 0x7fc0: c10::BFloat16's
  // conversion bit for bit.
  const __m256i u = _mm256_castps_si256(x.v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x.v, x.v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline void store(c10::Half* p, F x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// x rounded to bf16 / fp16 and widened back, in registers: load(store(x))
// without the trip through memory, the same bits (NaN made 0x7fc0 as store()
// makes it).
inline F round_bf16(F x) {
  const __m256i u = _mm256_castps_si256(x.v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb),
                               _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x.v, x.v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), nan);
  return {_mm256_castsi256_ps(r)};
}
inline F round_half(F x) {
  return {_mm256_cvtph_ps(_mm256_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))};
}

// Lanes that each hold a value of T exactly (loaded from T): float and fp16
// as store(), bf16 by truncation instead of rounding, so that a NaN keeps its
// bits (store() canonicalises it, as c10's conversion does).
inline void store_bits(float* p, F x) { store(p, x); }
inline void store_bits(c10::Half* p, F x) { store(p, x); }
inline void store_bits(c10::BFloat16* p, F x) {
  const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(x.v), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// The even and odd elements of the 2 kLanes elements lo, hi (lo first), and
// back: interleave(even, odd) gives lo and hi again.
inline void deinterleave(F lo, F hi, F& even, F& odd) {
  // Per 128-bit half: [lo0 lo2 hi0 hi2 | lo4 lo6 hi4 hi6]; then the middle
  // 64-bit quarters swap places.
  const __m256 e = _mm256_shuffle_ps(lo.v, hi.v, _MM_SHUFFLE(2, 0, 2, 0));
  const __m256 o = _mm256_shuffle_ps(lo.v, hi.v, _MM_SHUFFLE(3, 1, 3, 1));
  even = {_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0)))};
  odd = {_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), _MM_SHUFFLE(3, 1, 2, 0)))};
}
inline void interleave(F even, F odd, F& lo, F& hi) {
  const __m256 a = _mm256_unpacklo_ps(even.v, odd.v);  // e0 o0 e1 o1 | e4 o4 e5 o5
  const __m256 b = _mm256_unpackhi_ps(even.v, odd.v);  // e2 o2 e3 o3 | e6 o6 e7 o7
  lo = {_mm256_permute2f128_ps(a, b, 0x20)};
  hi = {_mm256_permute2f128_ps(a, b, 0x31)};
}

// kLanes bytes as floats, and back (lanes holding integers in [0, 255]).
inline F load_u8(const uint8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
}
inline void store_u8(uint8_t* p, F x) {
  const __m256i i = _mm256_cvttps_epi32(x.v);
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
}

inline F operator+(F a, F b) { return {_mm256_add_ps(a.v, b.v)}; }
inline F operator-(F a, F b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline F operator*(F a, F b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline F operator/(F a, F b) { return {_mm256_div_ps(a.v, b.v)}; }
inline F fmadd(F a, F b, F c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }   // a * b + c
inline F fnmadd(F a, F b, F c) { return {_mm256_fnmadd_ps(a.v, b.v, c.v)}; } // c - a * b
inline F sqrt(F a) { return {_mm256_sqrt_ps(a.v)}; }
// maxps: the second operand where either is NaN, as std::max(b, a).
inline F max(F a, F b) { return {_mm256_max_ps(a.v, b.v)}; }
// a * 2^n for integral n in [-126, 127] with a * 2^n normal: an exponent add.
inline F ldexp(F a, F n) {
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n.v), 23);
  return {_mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(a.v), e))};
}

inline M operator<(F a, F b) { return {_mm256_cmp_ps(a.v, b.v, _CMP_LT_OQ)}; }
inline M operator==(F a, F b) { return {_mm256_cmp_ps(a.v, b.v, _CMP_EQ_OQ)}; }
// !(a <= b): set where a > b and where either is NaN.
inline M not_le(F a, F b) { return {_mm256_cmp_ps(a.v, b.v, _CMP_NLE_UQ)}; }
inline F select(M m, F if_set, F if_clear) { return {_mm256_blendv_ps(if_clear.v, if_set.v, m.v)}; }
// 0 where `zero` is set, else ldexp(a, n).
inline F ldexp_or_zero(M zero, F a, F n) { return select(zero, set1(0.f), ldexp(a, n)); }
inline bool all(M m) { return _mm256_movemask_ps(m.v) == 0xff; }

// Non-finite detection on bits: |x|'s bits, as unsigned, are >= 0x7f800000
// exactly for inf and NaN.
inline U zero_u() { return {_mm256_setzero_si256()}; }
inline U max_abs_bits(U acc, F x) {
  const __m256i bits = _mm256_and_si256(_mm256_castps_si256(x.v), _mm256_set1_epi32(0x7fffffff));
  return {_mm256_max_epu32(acc.v, bits)};
}
inline uint32_t reduce_max(U x) {
  alignas(32) uint32_t lanes[kLanes];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), x.v);
  uint32_t m = 0;
  for (uint32_t l : lanes) m = l > m ? l : m;
  return m;
}

inline D zero_d() { return {_mm256_setzero_pd(), _mm256_setzero_pd()}; }
inline D widen(F x) {
  return {_mm256_cvtps_pd(_mm256_castps256_ps128(x.v)), _mm256_cvtps_pd(_mm256_extractf128_ps(x.v, 1))};
}
inline D operator+(D a, D b) { return {_mm256_add_pd(a.lo, b.lo), _mm256_add_pd(a.hi, b.hi)}; }
inline D operator*(D a, D b) { return {_mm256_mul_pd(a.lo, b.lo), _mm256_mul_pd(a.hi, b.hi)}; }
inline D fmadd(D a, D b, D c) {
  return {_mm256_fmadd_pd(a.lo, b.lo, c.lo), _mm256_fmadd_pd(a.hi, b.hi, c.hi)};
}

inline void store(double* lanes, D x) {
  _mm256_storeu_pd(lanes, x.lo);
  _mm256_storeu_pd(lanes + 4, x.hi);
}

}  // namespace fusetrain::ops::simd::avx2
FUSETRAIN_SIMD_END
#endif  // FUSETRAIN_SIMD_X86

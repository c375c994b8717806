// The AVX-512 (F, BW, VL, DQ) vector interface of Note [SIMD regions]: 16
// float lanes, the names of simd_avx2.h. Conversions to bf16 round with
// integer arithmetic, not VCVTNEPS2BF16: that instruction flushes subnormal
// inputs and outputs to zero, and c10::BFloat16 (so torch) keeps them.
#pragma once

#include <fusetrain/ops/cpu/simd.h>

#ifdef FUSETRAIN_SIMD_X86
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

FUSETRAIN_SIMD_BEGIN(avx512)
namespace fusetrain::ops::simd::avx512 {

constexpr int kLanes = 16;

struct F {
  __m512 v;
};
struct M {
  __mmask16 k;
};
struct D {  // kLanes doubles: lanes 0-7 in lo, 8-15 in hi
  __m512d lo, hi;
};
struct U {
  __m512i v;
};

inline F set1(float x) { return {_mm512_set1_ps(x)}; }
inline F zero() { return {_mm512_setzero_ps()}; }

inline F load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline F load(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
inline F load(const c10::Half* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}

inline void store(float* p, F x) { _mm512_storeu_ps(p, x.v); }
inline void store(c10::BFloat16* p, F x) {
  // As simd_avx2.h: round to nearest even, NaN to 0x7fc0; vpmovdw keeps the
  // lanes in order.
  const __m512i u = _mm512_castps_si512(x.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x.v, x.v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
inline void store(c10::Half* p, F x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// x rounded to bf16 / fp16 and widened back, in registers: load(store(x))
// without the trip through memory, the same bits (NaN made 0x7fc0 as store()
// makes it).
inline F round_bf16(F x) {
  const __m512i u = _mm512_castps_si512(x.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb),
                               _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x.v, x.v, _CMP_UNORD_Q),
                            _mm512_set1_epi32(0x7fc00000));
  return {_mm512_castsi512_ps(r)};
}
inline F round_half(F x) {
  return {_mm512_cvtph_ps(_mm512_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))};
}

// Lanes that each hold a value of T exactly (loaded from T): float and fp16
// as store(), bf16 by truncation instead of rounding, so that a NaN keeps its
// bits (store() canonicalises it, as c10's conversion does).
inline void store_bits(float* p, F x) { store(p, x); }
inline void store_bits(c10::Half* p, F x) { store(p, x); }
inline void store_bits(c10::BFloat16* p, F x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x.v), 16)));
}

// The even and odd elements of the 2 kLanes elements lo, hi (lo first), and
// back: interleave(even, odd) gives lo and hi again.
inline void deinterleave(F lo, F hi, F& even, F& odd) {
  const __m512i e = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i o = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  even = {_mm512_permutex2var_ps(lo.v, e, hi.v)};
  odd = {_mm512_permutex2var_ps(lo.v, o, hi.v)};
}
inline void interleave(F even, F odd, F& lo, F& hi) {
  const __m512i l = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i h = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  lo = {_mm512_permutex2var_ps(even.v, l, odd.v)};
  hi = {_mm512_permutex2var_ps(even.v, h, odd.v)};
}

// kLanes bytes as floats, and back (lanes holding integers in [0, 255]).
inline F load_u8(const uint8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline void store_u8(uint8_t* p, F x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(x.v)));
}

inline F operator+(F a, F b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F operator-(F a, F b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline F operator*(F a, F b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F operator/(F a, F b) { return {_mm512_div_ps(a.v, b.v)}; }
inline F fmadd(F a, F b, F c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline F fnmadd(F a, F b, F c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }
inline F sqrt(F a) { return {_mm512_sqrt_ps(a.v)}; }
inline F max(F a, F b) { return {_mm512_max_ps(a.v, b.v)}; }  // as simd_avx2.h's
inline F ldexp(F a, F n) {
  const __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(n.v), 23);
  return {_mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a.v), e))};
}
// 0 where `zero` is set, else a * 2^n: ldexp's bits wherever the product is
// normal (VSCALEFPS rounds nothing then), in one instruction.
inline F ldexp_or_zero(M zero, F a, F n) {
  return {_mm512_maskz_scalef_ps(static_cast<__mmask16>(~zero.k), a.v, n.v)};
}

inline M operator<(F a, F b) { return {_mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ)}; }
inline M operator==(F a, F b) { return {_mm512_cmp_ps_mask(a.v, b.v, _CMP_EQ_OQ)}; }
// !(a <= b): set where a > b and where either is NaN.
inline M not_le(F a, F b) { return {_mm512_cmp_ps_mask(a.v, b.v, _CMP_NLE_UQ)}; }
inline F select(M m, F if_set, F if_clear) { return {_mm512_mask_blend_ps(m.k, if_clear.v, if_set.v)}; }
inline bool all(M m) { return m.k == 0xffff; }

inline U zero_u() { return {_mm512_setzero_si512()}; }
inline U max_abs_bits(U acc, F x) {
  const __m512i bits = _mm512_and_si512(_mm512_castps_si512(x.v), _mm512_set1_epi32(0x7fffffff));
  return {_mm512_max_epu32(acc.v, bits)};
}
inline uint32_t reduce_max(U x) { return _mm512_reduce_max_epu32(x.v); }

inline D zero_d() { return {_mm512_setzero_pd(), _mm512_setzero_pd()}; }
inline D widen(F x) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x.v), 1));
  return {_mm512_cvtps_pd(_mm512_castps512_ps256(x.v)), _mm512_cvtps_pd(hi)};
}
inline D operator+(D a, D b) { return {_mm512_add_pd(a.lo, b.lo), _mm512_add_pd(a.hi, b.hi)}; }
inline D operator*(D a, D b) { return {_mm512_mul_pd(a.lo, b.lo), _mm512_mul_pd(a.hi, b.hi)}; }
inline D fmadd(D a, D b, D c) {
  return {_mm512_fmadd_pd(a.lo, b.lo, c.lo), _mm512_fmadd_pd(a.hi, b.hi, c.hi)};
}

inline void store(double* lanes, D x) {
  _mm512_storeu_pd(lanes, x.lo);
  _mm512_storeu_pd(lanes + 8, x.hi);
}

}  // namespace fusetrain::ops::simd::avx512
FUSETRAIN_SIMD_END
#endif  // FUSETRAIN_SIMD_X86

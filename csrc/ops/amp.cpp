// Mixed-precision ops: the dispatcher entry points, argument checks, the CPU
// implementations (also the reference the CUDA kernels are tested against)
// and the Meta ones used by torch.compile's tracing.
#include <fusetrain/ops/amp.h>
#include <fusetrain/ops/checks.h>
#include <fusetrain/ops/cpu_features.h>

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define FUSETRAIN_X86_AVX2 1
#endif

namespace fusetrain::ops {

namespace {
constexpr const char* kUnscaleOp = "fusetrain::non_finite_check_and_unscale_";
constexpr const char* kUpdateOp = "fusetrain::update_scale_";
// Fewest elements worth a parallel region (at::parallel_for's grain): below
// this the pass runs on the calling thread.
constexpr int64_t kCpuChunk = 32768;
}  // namespace

void check_unscale_args(at::TensorList tensors, const at::Tensor& found_inf,
                        const at::Tensor& inv_scale) {
  check_scalar_tensor(found_inf, kUnscaleOp, "found_inf", at::kFloat);
  check_scalar_tensor(inv_scale, kUnscaleOp, "inv_scale", at::kFloat);
  check_same_device(inv_scale, found_inf, kUnscaleOp, "inv_scale", "found_inf");
  check_float_list(tensors, found_inf.device(), kUnscaleOp, "self");
}

void check_update_scale_args(const at::Tensor& scale, const at::Tensor& growth_tracker,
                             const at::Tensor& overflow_tracker, const at::Tensor& found_inf,
                             double growth_factor, double backoff_factor, int64_t growth_interval,
                             double max_scale, int64_t hysteresis) {
  check_scalar_tensor(scale, kUpdateOp, "self (the scale)", at::kFloat);
  check_scalar_tensor(growth_tracker, kUpdateOp, "growth_tracker", at::kInt);
  check_scalar_tensor(overflow_tracker, kUpdateOp, "overflow_tracker", at::kInt);
  check_scalar_tensor(found_inf, kUpdateOp, "found_inf", at::kFloat);
  check_same_device(growth_tracker, scale, kUpdateOp, "growth_tracker", "the scale");
  check_same_device(overflow_tracker, scale, kUpdateOp, "overflow_tracker", "the scale");
  check_same_device(found_inf, scale, kUpdateOp, "found_inf", "the scale");
  TORCH_CHECK(growth_factor > 1.0, kUpdateOp, ": growth_factor must be > 1, got ", growth_factor);
  TORCH_CHECK(backoff_factor > 0.0 && backoff_factor < 1.0, kUpdateOp,
              ": backoff_factor must be in (0, 1), got ", backoff_factor);
  TORCH_CHECK(growth_interval > 0, kUpdateOp, ": growth_interval must be > 0, got ",
              growth_interval);
  TORCH_CHECK(max_scale > 0.0, kUpdateOp, ": max_scale must be > 0, got ", max_scale);
  TORCH_CHECK(hysteresis >= 0, kUpdateOp, ": hysteresis must be >= 0, got ", hysteresis);
}

void non_finite_check_and_unscale_(at::TensorList tensors, at::Tensor& found_inf,
                                   const at::Tensor& inv_scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow(kUnscaleOp, "")
                       .typed<void(at::TensorList, at::Tensor&, const at::Tensor&)>();
  op.call(tensors, found_inf, inv_scale);
}

at::Tensor& update_scale_(at::Tensor& scale, at::Tensor& growth_tracker,
                          at::Tensor& overflow_tracker, const at::Tensor& found_inf,
                          const ScaleUpdateOptions& o) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow(kUpdateOp, "")
                       .typed<at::Tensor&(at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,
                                          double, double, int64_t, double, int64_t)>();
  return op.call(scale, growth_tracker, overflow_tracker, found_inf, o.growth_factor,
                 o.backoff_factor, o.growth_interval, o.max_scale, o.hysteresis);
}

namespace {

// Unscales x[0, n) in place (when `scale` is set) and returns true if any
// element was inf or NaN. Non-finite detection is branch-free: x * 0 is 0 for
// finite x and NaN otherwise, and NaN survives the running sum.
template <typename T>
bool unscale_span(T* x, int64_t n, float inv, bool scale) {
  using Vec = at::vec::Vectorized<float>;
  const Vec vinv(inv);
  const Vec zero(0.f);
  Vec probe(0.f);
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; i + Vec::size() <= n; i += Vec::size()) {
      Vec v = Vec::loadu(x + i);
      probe = probe + v * zero;
      if (scale) (v * vinv).store(x + i);
    }
  } else if constexpr (std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>) {
    using VecT = at::vec::Vectorized<T>;
    for (; i + VecT::size() <= n; i += VecT::size()) {
      auto [lo, hi] = at::vec::convert_to_float<T>(VecT::loadu(x + i));
      probe = probe + lo * zero + hi * zero;
      if (scale) at::vec::convert_from_float<T>(lo * vinv, hi * vinv).store(x + i);
    }
  }
  float tail_probe = 0.f;
  if constexpr (std::is_same_v<T, double>) {
    double dprobe = 0.0;
    const double dinv = inv;
    for (; i < n; ++i) {
      dprobe += x[i] * 0.0;
      if (scale) x[i] = x[i] * dinv;
    }
    return std::isnan(dprobe);
  } else {
    for (; i < n; ++i) {
      const float v = static_cast<float>(x[i]);
      tail_probe += v * 0.f;
      if (scale) x[i] = static_cast<T>(v * inv);
    }
    float lanes[Vec::size()];
    probe.store(lanes);
    for (float lane : lanes) tail_probe += lane;
    return std::isnan(tail_probe);
  }
}

#ifdef FUSETRAIN_X86_AVX2
// Note [AVX2 unscale]
// The library is compiled for the x86-64 baseline (SSE2), where ATen's
// Vectorized<T> is its generic fallback: 16-bit types convert one element at a
// time, so the pass was compute-bound at a fraction of memory bandwidth. These
// loops are compiled for AVX2+FMA+F16C only (function target attributes) and
// chosen at run time when the CPU has them, as ATen's own kernels are.
// Results equal torch's CPU kernel bit for bit on finite and infinite values:
// one fp32 multiply, then round-to-nearest-even to the storage type. Non-finite
// detection reads the stored bits: |x| >= the exponent mask (unsigned max).
#define FUSETRAIN_AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

// See Note [CPU paths] (cpu_features.h): the CPU's best, or the one forced.
bool cpu_has_avx2() { return cpu_path() >= CpuPath::kAvx2; }

FUSETRAIN_AVX2_TARGET uint32_t hmax_epu32(__m256i v) {
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
  uint32_t m = 0;
  for (uint32_t l : lanes) m = std::max(m, l);
  return m;
}

FUSETRAIN_AVX2_TARGET uint16_t hmax_epu16(__m256i v) {
  alignas(32) uint16_t lanes[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
  uint16_t m = 0;
  for (uint16_t l : lanes) m = std::max(m, l);
  return m;
}

FUSETRAIN_AVX2_TARGET bool unscale_float_avx2(float* x, int64_t n, float inv, bool scale) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256 vinv = _mm256_set1_ps(inv);
  __m256i m0 = _mm256_setzero_si256(), m1 = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i);
    const __m256 b = _mm256_loadu_ps(x + i + 8);
    m0 = _mm256_max_epu32(m0, _mm256_and_si256(_mm256_castps_si256(a), abs_mask));
    m1 = _mm256_max_epu32(m1, _mm256_and_si256(_mm256_castps_si256(b), abs_mask));
    if (scale) {
      _mm256_storeu_ps(x + i, _mm256_mul_ps(a, vinv));
      _mm256_storeu_ps(x + i + 8, _mm256_mul_ps(b, vinv));
    }
  }
  bool found = hmax_epu32(_mm256_max_epu32(m0, m1)) >= 0x7f800000u;
  for (; i < n; ++i) {
    found |= !std::isfinite(x[i]);
    if (scale) x[i] = x[i] * inv;
  }
  return found;
}

// fp32 bits -> bf16 bits, round to nearest even, in the low half of each lane.
// No NaN special case: with a finite inv (the dispatch sees to it) a NaN product
// is a bf16 input's NaN, quieted, or the default NaN; either has zero low bits,
// so the rounding add cannot carry it into another value.
FUSETRAIN_AVX2_TARGET __m256i round_to_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb),
                           16);
}

FUSETRAIN_AVX2_TARGET bool unscale_bfloat16_avx2(c10::BFloat16* x, int64_t n, float inv,
                                                 bool scale) {
  auto* p = reinterpret_cast<uint16_t*>(x);
  const __m256i abs_mask = _mm256_set1_epi16(0x7fff);
  const __m256i zero = _mm256_setzero_si256();
  const __m256 vinv = _mm256_set1_ps(inv);
  __m256i m = zero;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i));
    m = _mm256_max_epu16(m, _mm256_and_si256(h, abs_mask));
    if (scale) {
      // Interleaving zeros below each element widens it to fp32 within each
      // 128-bit lane; packus undoes exactly that order.
      const __m256 lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, h));
      const __m256 hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, h));
      const __m256i out = _mm256_packus_epi32(round_to_bf16(_mm256_mul_ps(lo, vinv)),
                                              round_to_bf16(_mm256_mul_ps(hi, vinv)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + i), out);
    }
  }
  bool found = hmax_epu16(m) >= 0x7f80;
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    found |= !std::isfinite(v);
    if (scale) x[i] = static_cast<c10::BFloat16>(v * inv);
  }
  return found;
}

FUSETRAIN_AVX2_TARGET bool unscale_half_avx2(c10::Half* x, int64_t n, float inv, bool scale) {
  auto* p = reinterpret_cast<uint16_t*>(x);
  const __m256i abs_mask = _mm256_set1_epi16(0x7fff);
  const __m256 vinv = _mm256_set1_ps(inv);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m256i m = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i));
    m = _mm256_max_epu16(m, _mm256_and_si256(h, abs_mask));
    if (scale) {
      const __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
      const __m256 hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
      const __m128i lo16 = _mm256_cvtps_ph(_mm256_mul_ps(lo, vinv), kRound);
      const __m128i hi16 = _mm256_cvtps_ph(_mm256_mul_ps(hi, vinv), kRound);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + i), _mm256_set_m128i(hi16, lo16));
    }
  }
  bool found = hmax_epu16(m) >= 0x7c00;
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    found |= !std::isfinite(v);
    if (scale) x[i] = static_cast<c10::Half>(v * inv);
  }
  return found;
}
#undef FUSETRAIN_AVX2_TARGET
#endif  // FUSETRAIN_X86_AVX2

bool unscale_span_dispatch(const at::Tensor& t, int64_t begin, int64_t end, float inv, bool scale) {
#ifdef FUSETRAIN_X86_AVX2
  if (cpu_has_avx2() && std::isfinite(inv)) {
    switch (t.scalar_type()) {
      case at::kFloat:
        return unscale_float_avx2(t.data_ptr<float>() + begin, end - begin, inv, scale);
      case at::kHalf:
        return unscale_half_avx2(t.data_ptr<c10::Half>() + begin, end - begin, inv, scale);
      case at::kBFloat16:
        return unscale_bfloat16_avx2(t.data_ptr<c10::BFloat16>() + begin, end - begin, inv, scale);
      default:
        break;
    }
  }
#endif
  switch (t.scalar_type()) {
    case at::kFloat:
      return unscale_span(t.data_ptr<float>() + begin, end - begin, inv, scale);
    case at::kHalf:
      return unscale_span(t.data_ptr<c10::Half>() + begin, end - begin, inv, scale);
    case at::kBFloat16:
      return unscale_span(t.data_ptr<c10::BFloat16>() + begin, end - begin, inv, scale);
    case at::kDouble:
      return unscale_span(t.data_ptr<double>() + begin, end - begin, inv, scale);
    default:
      TORCH_CHECK(false, kUnscaleOp, ": unsupported dtype ", t.scalar_type());
  }
}

// One parallel pass over all tensors. The dense tensors are laid end to end in
// one index space that at::parallel_for splits into one equal, contiguous range
// per thread (in blocks, so a range starts on a block boundary); each thread
// walks the tensors its range covers. Many small tensors thus still keep every
// thread busy, with balanced work and a single parallel region.
void unscale_cpu(at::TensorList tensors, at::Tensor& found_inf, const at::Tensor& inv_scale) {
  check_unscale_args(tensors, found_inf, inv_scale);
  TORCH_CHECK(found_inf.is_cpu(), kUnscaleOp, ": the CPU kernel got found_inf on ",
              found_inf.device());
  const float inv = *inv_scale.const_data_ptr<float>();
  const bool scale = inv != 1.f;

  std::vector<size_t> dense;        // indices into tensors
  std::vector<int64_t> offsets{0};  // offsets[k]: first element of dense[k]
  dense.reserve(tensors.size());
  offsets.reserve(tensors.size() + 1);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (t.numel() == 0) continue;
    if (!t.is_non_overlapping_and_dense()) {
      // Rare (a gradient that is a strided view): elementwise ops keep it correct.
      found_inf.masked_fill_(at::isfinite(t).all().logical_not(), 1.f);
      if (scale) t.mul_(inv_scale);
      continue;
    }
    // Dense: the elements are one contiguous storage span starting at data_ptr
    // once strides are ignored, which elementwise work may do.
    dense.push_back(i);
    offsets.push_back(offsets.back() + t.numel());
  }
  const int64_t total = offsets.back();
  if (total == 0) return;
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (total + kBlock - 1) / kBlock;
  std::atomic<bool> found{false};
  at::parallel_for(0, blocks, kCpuChunk / kBlock, [&](int64_t lo, int64_t hi) {
    const int64_t begin = lo * kBlock;
    const int64_t end = std::min(hi * kBlock, total);
    size_t k = std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin() - 1;
    bool local = false;
    for (; k < dense.size() && offsets[k] < end; ++k) {
      const int64_t b = std::max(begin, offsets[k]) - offsets[k];
      const int64_t e = std::min(end, offsets[k + 1]) - offsets[k];
      local |= unscale_span_dispatch(tensors[dense[k]], b, e, inv, scale);
    }
    if (local) found.store(true, std::memory_order_relaxed);
  });
  if (found.load()) found_inf.fill_(1.f);
}

at::Tensor& update_scale_cpu(at::Tensor& scale, at::Tensor& growth_tracker,
                             at::Tensor& overflow_tracker, const at::Tensor& found_inf,
                             double growth_factor, double backoff_factor, int64_t growth_interval,
                             double max_scale, int64_t hysteresis) {
  check_update_scale_args(scale, growth_tracker, overflow_tracker, found_inf, growth_factor,
                          backoff_factor, growth_interval, max_scale, hysteresis);
  TORCH_CHECK(scale.is_cpu(), kUpdateOp, ": the CPU kernel got the scale on ", scale.device());
  float* s = scale.data_ptr<float>();
  int32_t* growth = growth_tracker.data_ptr<int32_t>();
  int32_t* overflows = overflow_tracker.data_ptr<int32_t>();
  if (*found_inf.const_data_ptr<float>() != 0.f) {
    *growth = 0;
    if (*overflows + 1 > hysteresis) {
      *s = static_cast<float>(*s * backoff_factor);
      *overflows = 0;
    } else {
      *overflows += 1;
    }
  } else if (*growth + 1 == growth_interval) {  // `==` as torch's _amp_update_scale_
    const float grown = static_cast<float>(std::min(*s * growth_factor, max_scale));
    if (std::isfinite(grown)) *s = grown;
    *growth = 0;
    *overflows = 0;
  } else {
    *growth += 1;
  }
  return scale;
}

void unscale_meta(at::TensorList tensors, at::Tensor& found_inf, const at::Tensor& inv_scale) {
  check_unscale_args(tensors, found_inf, inv_scale);
}

at::Tensor& update_scale_meta(at::Tensor& scale, at::Tensor& growth_tracker,
                              at::Tensor& overflow_tracker, const at::Tensor& found_inf,
                              double growth_factor, double backoff_factor, int64_t growth_interval,
                              double max_scale, int64_t hysteresis) {
  check_update_scale_args(scale, growth_tracker, overflow_tracker, found_inf, growth_factor,
                          backoff_factor, growth_interval, max_scale, hysteresis);
  return scale;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusetrain, CPU, m) {
  m.impl("non_finite_check_and_unscale_", &unscale_cpu);
  m.impl("update_scale_", &update_scale_cpu);
}

TORCH_LIBRARY_IMPL(fusetrain, Meta, m) {
  m.impl("non_finite_check_and_unscale_", &unscale_meta);
  m.impl("update_scale_", &update_scale_meta);
}

}  // namespace fusetrain::ops

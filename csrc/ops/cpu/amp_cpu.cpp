// The CPU implementation of the mixed-precision ops (the reference the CUDA
// kernels are tested against): the unscale's vector loops (unscale_loops.inc,
// compiled per SIMD path) and the scale update. Checks and entry points:
// ../amp.cpp.
#include <fusetrain/ops/amp.h>
#include <fusetrain/ops/checks.h>
#include <fusetrain/ops/cpu/cpu_features.h>
#include <fusetrain/ops/generic.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include <fusetrain/ops/cpu/simd_avx2.h>
#include <fusetrain/ops/cpu/simd_avx512.h>

#define FUSETRAIN_SIMD_LOOPS "unscale_loops.inc"
#include <fusetrain/ops/cpu/simd_each_isa.inc>

namespace fusetrain::ops {

namespace {
constexpr const char* kUnscaleOp = "fusetrain::non_finite_check_and_unscale_";
constexpr const char* kUpdateOp = "fusetrain::update_scale_";
// Fewest elements worth a parallel region (at::parallel_for's grain): below
// this the pass runs on the calling thread.
constexpr int64_t kCpuChunk = 32768;

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

bool unscale_span_dispatch(const at::Tensor& t, int64_t begin, int64_t end, float inv, bool scale) {
#ifdef FUSETRAIN_SIMD_X86
  const at::ScalarType dtype = t.scalar_type();
  if (std::isfinite(inv) && (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16)) {
    void* x = static_cast<char*>(t.data_ptr()) + begin * t.element_size();
    switch (cpu_path()) {  // See Note [CPU paths] (cpu_features.h).
      case CpuPath::kAvx512:
        return avx512::unscale_span(dtype, x, end - begin, inv, scale);
      case CpuPath::kAvx2:
        return avx2::unscale_span(dtype, x, end - begin, inv, scale);
      case CpuPath::kGeneric:  // the op went to generic:: before
      case CpuPath::kScalar:
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
  if (cpu_path() == CpuPath::kGeneric)
    return generic::non_finite_check_and_unscale_(tensors, found_inf, inv_scale);
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
  if (cpu_path() == CpuPath::kGeneric)
    return generic::update_scale_(scale, growth_tracker, overflow_tracker, found_inf, growth_factor,
                                  backoff_factor, growth_interval, max_scale, hysteresis);
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
}  // namespace

TORCH_LIBRARY_IMPL(fusetrain, CPU, m) {
  m.impl("non_finite_check_and_unscale_", &unscale_cpu);
  m.impl("update_scale_", &update_scale_cpu);
}

}  // namespace fusetrain::ops

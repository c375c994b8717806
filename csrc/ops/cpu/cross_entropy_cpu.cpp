// The CPU implementation of the fused softmax cross-entropy (the reference
// the CUDA kernels are tested against). Checks and entry points:
// ../cross_entropy.cpp.
//
// Note [Cross-entropy CPU vectorization]
// libfusetrain is compiled for baseline x86-64, where at::vec::Vectorized
// falls back to scalar loops (torch builds its own kernels once per CPU
// capability). The row loops are therefore cross_entropy_loops.inc, compiled
// for AVX2 and for AVX-512 (Note [SIMD regions]) and chosen at run time
// (cpu_path(), Note [CPU paths]): FUSETRAIN_CPU_PATH (or
// ATEN_CPU_CAPABILITY=default) forces a lower path or the portable scalar
// loops, which is how the tests cover them all.
#include <fusetrain/ops/checks.h>
#include <fusetrain/ops/cpu/cpu_features.h>
#include <fusetrain/ops/cross_entropy.h>
#include <fusetrain/ops/generic.h>

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <utility>
#include <vector>

#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/accumulate.h>

#include <fusetrain/ops/cpu/simd_avx2.h>
#include <fusetrain/ops/cpu/simd_avx512.h>

namespace fusetrain::ops {

namespace {
constexpr const char* kForwardOp = "fusetrain::softmax_cross_entropy_forward";
constexpr const char* kBackwardOp = "fusetrain::softmax_cross_entropy_backward";
// Logit elements per unit of parallel work: enough to amortise scheduling,
// few enough that a small batch of wide rows still spreads over every thread.
constexpr int64_t kCpuGrain = 32768;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ------------------------------------------------------------ scalar rows

// Portable row loops (and the reference for the vector ones): two passes
// over the row, which stays in L1/L2 between them.
template <typename T>
void row_stats_scalar(const T* x, int64_t c, double* lse, double* sum_x) {
  float m = kNegInf;
  double sx = 0.0;
  for (int64_t j = 0; j < c; ++j) {
    const float v = static_cast<float>(x[j]);
    m = std::max(m, v);
    sx += v;
  }
  // A row of -inf has no finite maximum to subtract: exp(-inf - -inf) would
  // be NaN; shifting by 0 gives the sum 0 and lse -inf instead.
  const float shift = m == kNegInf ? 0.f : m;
  double s = 0.0;
  for (int64_t j = 0; j < c; ++j) s += std::exp(static_cast<float>(x[j]) - shift);
  *lse = shift + std::log(s);
  *sum_x = sx;
}

template <typename T>
void row_grad_scalar(const T* x, int64_t c, float lse, float scale, float smooth, T* out) {
  for (int64_t j = 0; j < c; ++j) {
    out[j] = static_cast<T>((std::exp(static_cast<float>(x[j]) - lse) - smooth) * scale);
  }
}

float exp_scalar(float v) { return std::exp(v); }

}  // namespace
}  // namespace fusetrain::ops

// ------------------------------------------------------------ vector rows

#define FUSETRAIN_SIMD_LOOPS "cross_entropy_loops.inc"
#include <fusetrain/ops/cpu/simd_each_isa.inc>

namespace fusetrain::ops {
namespace {

// The row loops of one path (Note [CPU paths]).
template <typename T>
struct RowLoops {
  void (*stats)(const T*, int64_t, double*, double*);      // without the sum of logits
  void (*stats_sum)(const T*, int64_t, double*, double*);  // with it
  void (*grad)(const T*, int64_t, float, float, float, T*);
  float (*exp)(float);
};

template <typename T>
RowLoops<T> row_loops() {
#ifdef FUSETRAIN_SIMD_X86
  switch (cpu_path()) {
    case CpuPath::kAvx512:
      return {&avx512::row_stats<false, T>, &avx512::row_stats<true, T>, &avx512::row_grad<T>,
              &avx512::exp_one};
    case CpuPath::kAvx2:
      return {&avx2::row_stats<false, T>, &avx2::row_stats<true, T>, &avx2::row_grad<T>,
              &avx2::exp_one};
    case CpuPath::kGeneric:  // the op went to generic:: before
    case CpuPath::kScalar:
      break;
  }
#endif
  return {&row_stats_scalar<T>, &row_stats_scalar<T>, &row_grad_scalar<T>, &exp_scalar};
}

// A target that is neither a class index nor ignore_index would index out of
// the row: reject it, naming the first such row (a serial pass over N ints).
void check_targets_cpu(const int64_t* target, int64_t n, int64_t c, int64_t ignore_index,
                       const char* op) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = target[i];
    TORCH_CHECK_INDEX(t == ignore_index || (t >= 0 && t < c), op, ": target[", i, "] = ", t,
                      " is out of range for ", c, " classes (valid: 0 to ", c - 1,
                      ", or ignore_index = ", ignore_index, ")");
  }
}

template <typename T>
void forward_rows(const T* x, int64_t row_stride, const int64_t* target, int64_t n, int64_t c,
                  int64_t ignore_index, double label_smoothing, float* loss, float* lse) {
  const RowLoops<T> loops = row_loops<T>();
  const double ls = label_smoothing;
  const int64_t grain = std::max<int64_t>(1, kCpuGrain / std::max<int64_t>(c, 1));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* row = x + i * row_stride;
      double row_lse = 0.0;
      double sum_x = 0.0;
      (ls != 0.0 ? loops.stats_sum : loops.stats)(row, c, &row_lse, &sum_x);
      lse[i] = static_cast<float>(row_lse);
      const int64_t t = target[i];
      if (t == ignore_index) {
        loss[i] = 0.f;
        continue;
      }
      // (1 - ls) * nll + ls * mean_j(-log p_j), each term formed as a
      // difference from lse so that a confident row's loss keeps its digits.
      const double nll = row_lse - static_cast<double>(row[t]);
      loss[i] = static_cast<float>(
          ls == 0.0 ? nll : (1.0 - ls) * nll + ls * (row_lse - sum_x / static_cast<double>(c)));
    }
  });
}

template <typename T>
void backward_rows(const T* x, int64_t row_stride, const int64_t* target, const float* lse,
                   const float* grad_loss, bool per_row_grad, float grad_divisor, int64_t n,
                   int64_t c, int64_t ignore_index, double label_smoothing, T* out) {
  const RowLoops<T> loops = row_loops<T>();
  const float ls = static_cast<float>(label_smoothing);
  const float smooth = ls / static_cast<float>(c);
  const int64_t grain = std::max<int64_t>(1, kCpuGrain / std::max<int64_t>(c, 1));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T* g = out + i * c;
      const int64_t t = target[i];
      if (t == ignore_index) {
        std::memset(static_cast<void*>(g), 0, sizeof(T) * c);
        continue;
      }
      const T* row = x + i * row_stride;
      const float scale = (per_row_grad ? grad_loss[i] : grad_loss[0]) / grad_divisor;
      // The target's logit is read first: `out` may be the logits themselves
      // (loops.grad reads each element before writing its gradient there).
      const float p_t = loops.exp(static_cast<float>(row[t]) - lse[i]);
      loops.grad(row, c, lse[i], scale, smooth, g);
      // The target's entry again, with its one-hot term and the same exp.
      g[t] = static_cast<T>((p_t - smooth - (1.f - ls)) * scale);
    }
  });
}

// Note [Gradient block cache]
// A fresh N x C gradient is a new mapping (glibc mmaps large blocks and
// unmaps them on free), faulted in 4 KiB at a time as the rows are first
// written: 65536 faults for 256 MiB, then as many unmapped when the previous
// step's gradient is freed. On a 2-core VM that costs more than the
// backward's own writes (106 ms to allocate and fill 256 MiB, 13 ms to fill
// it again). Transparent huge pages are slower still there (264 ms: the
// kernel compacts and zeroes 2 MiB pages on the fault). So the backward keeps
// the blocks of its freed gradients, at most kCachedBlocks of at least
// kMinCachedBytes, and hands one back for a gradient of the same size: in a
// training loop the previous step's gradient is freed before the next
// backward, and its pages are reused already mapped. The cache never holds
// more than two gradients' worth of memory.
constexpr size_t kMinCachedBytes = size_t{16} << 20;
constexpr size_t kCachedBlocks = 2;

class GradientBlocks {
 public:
  static GradientBlocks& get() {
    static auto* blocks = new GradientBlocks();  // never destroyed: deleters may run at exit
    return *blocks;
  }

  at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
    const size_t bytes = static_cast<size_t>(c10::multiply_integers(sizes)) *
                         c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
    if (bytes < kMinCachedBytes) return at::empty(sizes, options);
    void* p = take(bytes);
    if (p == nullptr) p = c10::alloc_cpu(bytes);
    return at::from_blob(
        p, sizes, [bytes](void* q) { get().give(q, bytes); }, options);
  }

 private:
  void* take(size_t bytes) {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second == bytes) {
        void* p = it->first;
        free_.erase(it);
        return p;
      }
    }
    return nullptr;
  }

  void give(void* p, size_t bytes) {
    void* drop = p;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (free_.size() < kCachedBlocks) {
        free_.emplace_back(p, bytes);
        return;
      }
      // Full: keep the newest block (the size the loop uses now).
      drop = free_.front().first;
      free_.erase(free_.begin());
      free_.emplace_back(p, bytes);
    }
    c10::free_cpu(drop);
  }

  std::mutex mutex_;
  std::vector<std::pair<void*, size_t>> free_;
};

int64_t count_kept(const int64_t* target, int64_t n, int64_t ignore_index) {
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) kept += target[i] != ignore_index;
  return kept;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_cpu(const at::Tensor& logits_in,
                                                           const at::Tensor& target_in,
                                                           int64_t ignore_index,
                                                           double label_smoothing,
                                                           c10::string_view reduction_view) {
  if (cpu_path() == CpuPath::kGeneric)
    return generic::softmax_cross_entropy_forward(logits_in, target_in, ignore_index,
                                                  label_smoothing, reduction_view);
  const std::string reduction(reduction_view);
  check_cross_entropy_forward_args(logits_in, target_in, label_smoothing, reduction);
  const Reduction red = parse_reduction(reduction, kForwardOp);
  const at::Tensor logits = with_contiguous_rows(logits_in);
  const at::Tensor target = target_in.contiguous();
  const int64_t n = logits.size(0);
  const int64_t c = logits.size(1);
  const int64_t* t = target.const_data_ptr<int64_t>();
  check_targets_cpu(t, n, c, ignore_index, kForwardOp);

  const auto f32 = logits.options().dtype(at::kFloat);
  at::Tensor lse = at::empty({n}, f32);
  at::Tensor rows = at::empty({n}, f32);
  if (n > 0) {
    const int64_t stride = logits.stride(0);
    switch (logits.scalar_type()) {
      case at::kFloat:
        forward_rows(logits.const_data_ptr<float>(), stride, t, n, c, ignore_index, label_smoothing,
                     rows.data_ptr<float>(), lse.data_ptr<float>());
        break;
      case at::kHalf:
        forward_rows(logits.const_data_ptr<c10::Half>(), stride, t, n, c, ignore_index,
                     label_smoothing, rows.data_ptr<float>(), lse.data_ptr<float>());
        break;
      case at::kBFloat16:
        forward_rows(logits.const_data_ptr<c10::BFloat16>(), stride, t, n, c, ignore_index,
                     label_smoothing, rows.data_ptr<float>(), lse.data_ptr<float>());
        break;
      default:
        TORCH_CHECK(false, kForwardOp, ": unsupported dtype ", logits.scalar_type());
    }
  }
  if (red == Reduction::kNone) return {rows, lse, at::empty({0}, f32)};

  // A serial sum in double: deterministic whatever the thread count, and N
  // is small next to the N x C pass above.
  const float* r = rows.const_data_ptr<float>();
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) total += r[i];
  const auto kept = static_cast<double>(count_kept(t, n, ignore_index));
  // No kept rows: 0 / 0 = NaN, as torch's mean gives.
  if (red == Reduction::kMean) total /= kept;
  return {at::full({}, total, f32), lse, at::full({}, kept, f32)};
}

// The backward's rows into `grad` (contiguous [N, C]; the logits themselves
// or memory apart from them), after the arguments were checked.
void backward_rows_into(const at::Tensor& grad_loss_in, const at::Tensor& logits_in,
                        const at::Tensor& target_in, const at::Tensor& lse_in,
                        int64_t ignore_index, double label_smoothing, Reduction red,
                        const std::optional<at::Tensor>& kept_rows, at::Tensor& grad) {
  const at::Tensor logits = with_contiguous_rows(logits_in);
  const at::Tensor target = target_in.contiguous();
  const at::Tensor lse = lse_in.contiguous();
  const at::Tensor grad_loss = grad_loss_in.contiguous();
  const int64_t n = logits.size(0);
  const int64_t c = logits.size(1);
  const int64_t* t = target.const_data_ptr<int64_t>();
  check_targets_cpu(t, n, c, ignore_index, kBackwardOp);
  if (n == 0 || c == 0) return;
  // With no kept rows every row is zeroed and the divisor is never used.
  float divisor = 1.f;
  if (red == Reduction::kMean) {
    divisor = kept_rows.has_value() && kept_rows->defined()
                  ? kept_rows->item<float>()
                  : static_cast<float>(count_kept(t, n, ignore_index));
  }
  const bool per_row = red == Reduction::kNone;
  const int64_t stride = logits.stride(0);
  const float* g = grad_loss.const_data_ptr<float>();
  const float* l = lse.const_data_ptr<float>();
  // const_data_ptr, not data_ptr: `grad` may be the logits (the same storage
  // read through one pointer and written through the other, row by row).
  switch (logits.scalar_type()) {
    case at::kFloat:
      backward_rows(logits.const_data_ptr<float>(), stride, t, l, g, per_row, divisor, n, c,
                    ignore_index, label_smoothing, grad.data_ptr<float>());
      break;
    case at::kHalf:
      backward_rows(logits.const_data_ptr<c10::Half>(), stride, t, l, g, per_row, divisor, n, c,
                    ignore_index, label_smoothing, grad.data_ptr<c10::Half>());
      break;
    case at::kBFloat16:
      backward_rows(logits.const_data_ptr<c10::BFloat16>(), stride, t, l, g, per_row, divisor, n, c,
                    ignore_index, label_smoothing, grad.data_ptr<c10::BFloat16>());
      break;
    default:
      TORCH_CHECK(false, kBackwardOp, ": unsupported dtype ", logits.scalar_type());
  }
}

at::Tensor backward_cpu(const at::Tensor& grad_loss, const at::Tensor& logits,
                        const at::Tensor& target, const at::Tensor& lse, int64_t ignore_index,
                        double label_smoothing, c10::string_view reduction_view,
                        const std::optional<at::Tensor>& kept_rows) {
  if (cpu_path() == CpuPath::kGeneric)
    return generic::softmax_cross_entropy_backward(grad_loss, logits, target, lse, ignore_index,
                                                   label_smoothing, reduction_view, kept_rows);
  const std::string reduction(reduction_view);
  check_cross_entropy_backward_args(grad_loss, logits, target, lse, label_smoothing, reduction,
                                    kept_rows);
  at::Tensor grad = GradientBlocks::get().empty({logits.size(0), logits.size(1)}, logits.options());
  backward_rows_into(grad_loss, logits, target, lse, ignore_index, label_smoothing,
                     parse_reduction(reduction, kBackwardOp), kept_rows, grad);
  return grad;
}

at::Tensor& backward_out_cpu(const at::Tensor& grad_loss, const at::Tensor& logits,
                             const at::Tensor& target, const at::Tensor& lse, int64_t ignore_index,
                             double label_smoothing, c10::string_view reduction_view,
                             const std::optional<at::Tensor>& kept_rows, at::Tensor& out) {
  if (cpu_path() == CpuPath::kGeneric)
    return generic::softmax_cross_entropy_backward_out(grad_loss, logits, target, lse,
                                                       ignore_index, label_smoothing,
                                                       reduction_view, kept_rows, out);
  const std::string reduction(reduction_view);
  check_cross_entropy_backward_args(grad_loss, logits, target, lse, label_smoothing, reduction,
                                    kept_rows);
  check_cross_entropy_backward_out(logits, out);
  backward_rows_into(grad_loss, logits, target, lse, ignore_index, label_smoothing,
                     parse_reduction(reduction, kBackwardOp), kept_rows, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusetrain, CPU, m) {
  m.impl("softmax_cross_entropy_forward", &forward_cpu);
  m.impl("softmax_cross_entropy_backward", &backward_cpu);
  m.impl("softmax_cross_entropy_backward.out", &backward_out_cpu);
}

}  // namespace fusetrain::ops

// The CPU implementation of the fused optimizer and norm ops (the reference
// the CUDA kernels are tested against). Checks and entry points: ../optim.cpp.
//
// Note [One pass over many tensors on the CPU]
// Each op cuts every tensor into chunks of kCpuChunk elements and runs one
// at::parallel_for over all chunks of all tensors, so that 200 mid-sized
// tensors keep every thread busy with one fork/join, and each element is read
// and written exactly once. Per-tensor scalars (bias corrections) are computed
// before the parallel region.
#include <fusetrain/ops/checks.h>
#include <fusetrain/ops/cpu/cpu_features.h>
#include <fusetrain/ops/generic.h>
#include <fusetrain/ops/optim.h>

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <vector>

#include <fusetrain/ops/cpu/simd_avx2.h>
#include <fusetrain/ops/cpu/simd_avx512.h>

namespace fusetrain::ops {

namespace {

constexpr const char* kAdamOp = "fusetrain::fused_adamw_";
constexpr const char* kSgdOp = "fusetrain::fused_sgd_";
constexpr const char* kNormOp = "fusetrain::multi_tensor_l2norm";
constexpr int64_t kCpuChunk = 32768;

// The learning rate a CPU step uses: `lr_tensor`'s value when given.
double resolve_lr(double lr, const std::optional<at::Tensor>& lr_tensor) {
  return lr_tensor.has_value() && lr_tensor->defined() ? lr_tensor->item<double>() : lr;
}

struct Chunk {
  int32_t tensor;
  int64_t begin, end;
};

std::vector<Chunk> make_chunks(at::TensorList tensors) {
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t n = tensors[i].numel();
    for (int64_t b = 0; b < n; b += kCpuChunk) {
      chunks.push_back({static_cast<int32_t>(i), b, std::min(b + kCpuChunk, n)});
    }
  }
  return chunks;
}

template <typename T>
T* ptr_or_null(at::TensorList list, size_t i) {
  return list.empty() ? nullptr : list[i].data_ptr<T>();
}

// Calls f(P{}, S{}) with the parameter type P and the state type S (fp32 when
// there are master weights, else the parameter's own type).
template <typename F>
void dispatch_param_state(at::ScalarType p, bool master, const char* op, F&& f) {
  switch (p) {
    case at::kFloat:
      return f(float{}, float{});
    case at::kDouble:
      TORCH_CHECK(!master, op, ": float64 params take no master weights");
      return f(double{}, double{});
    case at::kHalf:
      return master ? f(c10::Half{}, float{}) : f(c10::Half{}, c10::Half{});
    case at::kBFloat16:
      return master ? f(c10::BFloat16{}, float{}) : f(c10::BFloat16{}, c10::BFloat16{});
    default:
      TORCH_CHECK(false, op, ": unsupported parameter dtype ", p);
  }
}

// Math type: double for double tensors, float for everything else.
template <typename T>
using OpMath = std::conditional_t<std::is_same_v<T, double>, double, float>;

// Note [Unscaled gradients after a fused step] (csrc/kernels/optim_kernels.cu):
// with a grad_scale each gradient is divided by it and the quotient written
// back, as torch's fused optimizers do.
float read_grad_scale(const std::optional<at::Tensor>& grad_scale) {
  return grad_scale.has_value() && grad_scale->defined() ? *grad_scale->const_data_ptr<float>()
                                                         : 1.f;
}

bool skip_step(const std::optional<at::Tensor>& found_inf) {
  return found_inf.has_value() && found_inf->defined() &&
         *found_inf->const_data_ptr<float>() != 0.f;
}

// ------------------------------------------------------------------ AdamW

struct AdamTensorConsts {
  double step_size;  // lr / (1 - beta1^step)
  double bc2_sqrt;   // sqrt(1 - beta2^step)
};

template <typename P, typename S>
void adam_span(P* __restrict p, P* __restrict g, S* __restrict m, S* __restrict v,
               S* __restrict vmax, float* __restrict master, int64_t n, const AdamHyper& h,
               const AdamTensorConsts& c, float grad_scale, bool unscale) {
  using M = OpMath<P>;
  // 1 - beta and 1 - lr * wd are formed in double and rounded once, as torch
  // does with its Python-float scalars: 1 - beta2 formed after rounding beta2
  // to float (1 - 0.999f) is off by 1.3e-5 relative, a bias in every v.
  const M beta1 = h.beta1, beta2 = h.beta2, wd = h.weight_decay, eps = h.eps;
  const M one_minus_beta1 = 1.0 - h.beta1, one_minus_beta2 = 1.0 - h.beta2;
  const M step_size = c.step_size, bc2_sqrt = c.bc2_sqrt, scale = grad_scale;
  const M decay = 1.0 - h.lr * h.weight_decay;
  for (int64_t i = 0; i < n; ++i) {
    M grad = static_cast<M>(g[i]);
    if (unscale) {
      grad = grad / scale;
      g[i] = static_cast<P>(grad);
    }
    if (h.maximize) grad = -grad;
    M param = master != nullptr ? static_cast<M>(master[i]) : static_cast<M>(p[i]);
    if (wd != 0) {
      if (h.decoupled_weight_decay) {
        param = param * decay;
      } else {
        grad = grad + wd * param;
      }
    }
    const M mi = beta1 * static_cast<M>(m[i]) + one_minus_beta1 * grad;
    const M vi = beta2 * static_cast<M>(v[i]) + one_minus_beta2 * grad * grad;
    m[i] = static_cast<S>(mi);
    v[i] = static_cast<S>(vi);
    M second = vi;
    if (vmax != nullptr) {
      second = std::max(static_cast<M>(vmax[i]), vi);
      vmax[i] = static_cast<S>(second);
    }
    const M denom = std::sqrt(second) / bc2_sqrt + eps;
    param = param - step_size * mi / denom;
    if (master != nullptr) master[i] = static_cast<float>(param);
    p[i] = static_cast<P>(param);
  }
}

// adam_span's scalars as fp32 for the vector loops (Note [Vector Adam],
// optim_loops.inc). grad_sign is maximize's sign (a multiply by -1 or 1,
// exact); decay is 1 and l2 unused unless their mode is on.
struct AdamLaneScalars {
  float grad_scale, grad_sign, decay, l2, beta1, beta2, one_minus_beta1, one_minus_beta2, step_size,
      bc2_sqrt, eps;
};

// A vector loop over one chunk: params and grads of P, moments of S (byte
// pointers to the chunk's first element).
using AdamFn = void (*)(void*, void*, void*, void*, void*, float*, int64_t, const AdamLaneScalars&);

AdamLaneScalars adam_lane_scalars(const AdamHyper& h, const AdamTensorConsts& c, float grad_scale) {
  const bool l2 = !h.decoupled_weight_decay && h.weight_decay != 0;
  const bool decoupled = h.decoupled_weight_decay && h.weight_decay != 0;
  AdamLaneScalars s;
  s.grad_scale = grad_scale;
  s.grad_sign = h.maximize ? -1.f : 1.f;
  s.decay = decoupled ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.f;
  s.l2 = l2 ? static_cast<float>(h.weight_decay) : 0.f;
  s.beta1 = static_cast<float>(h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  s.step_size = static_cast<float>(c.step_size);
  s.bc2_sqrt = static_cast<float>(c.bc2_sqrt);
  s.eps = static_cast<float>(h.eps);
  return s;
}

// sgd_span's scalars as fp32 for the vector loops (Note [Vector SGD]).
struct SgdLaneScalars {
  float grad_scale, grad_sign;  // as AdamLaneScalars
  float weight_decay, momentum, keep, lr;
};

// A vector loop over one chunk; buf null without momentum.
using SgdFn = void (*)(void*, void*, void*, float*, int64_t, const SgdLaneScalars&);

}  // namespace
}  // namespace fusetrain::ops

#define FUSETRAIN_SIMD_LOOPS "optim_loops.inc"
#include <fusetrain/ops/cpu/simd_each_isa.inc>

namespace fusetrain::ops {
namespace {

// See Note [CPU paths] (cpu_features.h): the CPU's best, or the one forced.
AdamFn adam_fn_for(at::ScalarType param, bool master, bool amsgrad, bool l2, bool unscale) {
#ifdef FUSETRAIN_SIMD_X86
  switch (cpu_path()) {
    case CpuPath::kAvx512:
      return avx512::adam_fn(param, master, amsgrad, l2, unscale);
    case CpuPath::kAvx2:
      return avx2::adam_fn(param, master, amsgrad, l2, unscale);
    case CpuPath::kGeneric:  // the op went to generic:: before
    case CpuPath::kScalar:
      break;
  }
#endif
  return nullptr;
}

SgdFn sgd_fn_for(at::ScalarType param, bool master, bool unscale, bool decay, bool has_buf,
                 bool first, bool nesterov) {
#ifdef FUSETRAIN_SIMD_X86
  switch (cpu_path()) {
    case CpuPath::kAvx512:
      return avx512::sgd_fn(param, master, unscale, decay, has_buf, first, nesterov);
    case CpuPath::kAvx2:
      return avx2::sgd_fn(param, master, unscale, decay, has_buf, first, nesterov);
    case CpuPath::kGeneric:  // the op went to generic:: before
    case CpuPath::kScalar:
      break;
  }
#endif
  return nullptr;
}

// The vector sum of squares of a float, half or bfloat16 span; none where the
// scalar loop must run.
std::optional<double> vector_sum_squares(at::ScalarType dtype, const void* x, int64_t n) {
#ifdef FUSETRAIN_SIMD_X86
  if (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16) {
    switch (cpu_path()) {
      case CpuPath::kAvx512:
        return avx512::sum_squares(dtype, x, n);
      case CpuPath::kAvx2:
        return avx2::sum_squares(dtype, x, n);
      case CpuPath::kGeneric:  // the op went to generic:: before
      case CpuPath::kScalar:
        break;
    }
  }
#endif
  return std::nullopt;
}

void fused_adamw_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                     at::TensorList master_params, at::TensorList state_steps, double lr,
                     double beta1, double beta2, double weight_decay, double eps, bool amsgrad,
                     bool maximize, bool decoupled_weight_decay,
                     const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf,
                     const std::optional<at::Tensor>& lr_tensor) {
  if (cpu_path() == CpuPath::kGeneric)
    return generic::fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                                 master_params, state_steps, lr, beta1, beta2, weight_decay, eps,
                                 amsgrad, maximize, decoupled_weight_decay, grad_scale, found_inf,
                                 lr_tensor);
  check_adamw_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params,
                   state_steps, amsgrad, grad_scale, found_inf, lr_tensor);
  if (skip_step(found_inf)) return;
  lr = resolve_lr(lr, lr_tensor);
  const AdamHyper h{lr, beta1, beta2, weight_decay, eps, amsgrad, maximize, decoupled_weight_decay};
  std::vector<AdamTensorConsts> consts(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    float* step = state_steps[i].data_ptr<float>();
    *step += 1.f;
    consts[i].step_size = lr / (1.0 - std::pow(beta1, static_cast<double>(*step)));
    consts[i].bc2_sqrt = std::sqrt(1.0 - std::pow(beta2, static_cast<double>(*step)));
  }
  const float scale = read_grad_scale(grad_scale);
  const bool unscale = grad_scale.has_value() && grad_scale->defined();
  const bool master = !master_params.empty();
  const std::vector<Chunk> chunks = make_chunks(params);
  const bool l2 = !decoupled_weight_decay && weight_decay != 0;
  if (const AdamFn fn = adam_fn_for(params[0].scalar_type(), master, amsgrad, l2, unscale)) {
    std::vector<AdamLaneScalars> lanes;
    lanes.reserve(params.size());
    for (size_t i = 0; i < params.size(); ++i)
      lanes.push_back(adam_lane_scalars(h, consts[i], scale));
    at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t lo, int64_t hi) {
      for (int64_t k = lo; k < hi; ++k) {
        const Chunk& c = chunks[k];
        const size_t i = c.tensor;
        const int64_t b = c.begin;
        const int64_t pb = b * params[i].element_size();
        const int64_t sb = b * exp_avgs[i].element_size();
        fn(static_cast<char*>(params[i].data_ptr()) + pb,
           static_cast<char*>(grads[i].data_ptr()) + pb,
           static_cast<char*>(exp_avgs[i].data_ptr()) + sb,
           static_cast<char*>(exp_avg_sqs[i].data_ptr()) + sb,
           amsgrad ? static_cast<char*>(max_exp_avg_sqs[i].data_ptr()) + sb : nullptr,
           master ? master_params[i].data_ptr<float>() + b : nullptr, c.end - b, lanes[i]);
      }
    });
    return;
  }
  dispatch_param_state(params[0].scalar_type(), master, kAdamOp, [&](auto ptag, auto stag) {
    using P = decltype(ptag);
    using S = decltype(stag);
    at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t lo, int64_t hi) {
      for (int64_t k = lo; k < hi; ++k) {
        const Chunk& c = chunks[k];
        const size_t i = c.tensor;
        const int64_t b = c.begin;
        adam_span<P, S>(params[i].data_ptr<P>() + b, grads[i].data_ptr<P>() + b,
                        exp_avgs[i].data_ptr<S>() + b, exp_avg_sqs[i].data_ptr<S>() + b,
                        amsgrad ? max_exp_avg_sqs[i].data_ptr<S>() + b : nullptr,
                        master ? master_params[i].data_ptr<float>() + b : nullptr, c.end - b, h,
                        consts[i], scale, unscale);
      }
    });
  });
}

// -------------------------------------------------------------------- SGD

template <typename P, typename S>
void sgd_span(P* __restrict p, P* __restrict g, S* __restrict buf, float* __restrict master,
              int64_t n, const SgdHyper& h, bool first, float grad_scale, bool unscale) {
  using M = OpMath<P>;
  const M lr = h.lr, momentum = h.momentum, wd = h.weight_decay, scale = grad_scale;
  const M keep = 1.0 - h.dampening;  // in double, rounded once (see adam_span)
  for (int64_t i = 0; i < n; ++i) {
    M grad = static_cast<M>(g[i]);
    if (unscale) {
      grad = grad / scale;
      g[i] = static_cast<P>(grad);
    }
    if (h.maximize) grad = -grad;
    M param = master != nullptr ? static_cast<M>(master[i]) : static_cast<M>(p[i]);
    if (wd != 0) grad = grad + wd * param;
    if (buf != nullptr) {
      const M b = first ? grad : momentum * static_cast<M>(buf[i]) + keep * grad;
      buf[i] = static_cast<S>(b);
      grad = h.nesterov ? grad + momentum * b : b;
    }
    param = param - lr * grad;
    if (master != nullptr) master[i] = static_cast<float>(param);
    p[i] = static_cast<P>(param);
  }
}

void fused_sgd_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                   at::TensorList master_params, double lr, double momentum, double dampening,
                   double weight_decay, bool nesterov, bool maximize, bool is_first_step,
                   const std::optional<at::Tensor>& grad_scale,
                   const std::optional<at::Tensor>& found_inf,
                   const std::optional<at::Tensor>& lr_tensor) {
  if (cpu_path() == CpuPath::kGeneric)
    return generic::fused_sgd_(params, grads, momentum_buffers, master_params, lr, momentum,
                               dampening, weight_decay, nesterov, maximize, is_first_step,
                               grad_scale, found_inf, lr_tensor);
  check_sgd_args(params, grads, momentum_buffers, master_params, momentum, grad_scale, found_inf,
                 lr_tensor);
  if (skip_step(found_inf)) return;
  lr = resolve_lr(lr, lr_tensor);
  const SgdHyper h{lr, momentum, dampening, weight_decay, nesterov, maximize};
  const float scale = read_grad_scale(grad_scale);
  const bool unscale = grad_scale.has_value() && grad_scale->defined();
  const bool master = !master_params.empty();
  const bool has_buf = !momentum_buffers.empty();
  const std::vector<Chunk> chunks = make_chunks(params);
  if (const SgdFn fn = sgd_fn_for(params[0].scalar_type(), master, unscale, weight_decay != 0,
                                  has_buf, is_first_step, nesterov)) {
    SgdLaneScalars s;
    s.grad_scale = scale;
    s.grad_sign = maximize ? -1.f : 1.f;
    s.weight_decay = static_cast<float>(weight_decay);
    s.momentum = static_cast<float>(momentum);
    s.keep = static_cast<float>(1.0 - dampening);
    s.lr = static_cast<float>(lr);
    at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t lo, int64_t hi) {
      for (int64_t k = lo; k < hi; ++k) {
        const Chunk& c = chunks[k];
        const size_t i = c.tensor;
        const int64_t pb = c.begin * params[i].element_size();
        fn(static_cast<char*>(params[i].data_ptr()) + pb,
           static_cast<char*>(grads[i].data_ptr()) + pb,
           has_buf ? static_cast<char*>(momentum_buffers[i].data_ptr()) +
                         c.begin * momentum_buffers[i].element_size()
                   : nullptr,
           master ? master_params[i].data_ptr<float>() + c.begin : nullptr, c.end - c.begin, s);
      }
    });
    return;
  }
  dispatch_param_state(params[0].scalar_type(), master, kSgdOp, [&](auto ptag, auto stag) {
    using P = decltype(ptag);
    using S = decltype(stag);
    at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t lo, int64_t hi) {
      for (int64_t k = lo; k < hi; ++k) {
        const Chunk& c = chunks[k];
        const size_t i = c.tensor;
        const int64_t b = c.begin;
        sgd_span<P, S>(params[i].data_ptr<P>() + b, grads[i].data_ptr<P>() + b,
                       has_buf ? momentum_buffers[i].data_ptr<S>() + b : nullptr,
                       master ? master_params[i].data_ptr<float>() + b : nullptr, c.end - b, h,
                       is_first_step, scale, unscale);
      }
    });
  });
}

// ---------------------------------------------------------------- L2 norm

template <typename T>
double sum_squares(const T* x, int64_t n) {
  double acc = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = static_cast<double>(x[i]);
    acc += v * v;
  }
  return acc;
}

std::tuple<at::Tensor, at::Tensor> l2norm_cpu(at::TensorList tensors, bool per_tensor) {
  if (cpu_path() == CpuPath::kGeneric) return generic::multi_tensor_l2norm(tensors, per_tensor);
  const auto out_opts = at::TensorOptions().dtype(at::kFloat);
  if (tensors.empty()) {
    return {at::zeros({}, out_opts),
            per_tensor ? at::zeros({0}, out_opts) : at::empty({0}, out_opts)};
  }
  check_float_list(tensors, tensors[0].device(), kNormOp, "tensors");
  std::vector<at::Tensor> dense;
  dense.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    dense.push_back(t.is_non_overlapping_and_dense() ? t : t.contiguous());
  }
  const std::vector<Chunk> chunks = make_chunks(dense);
  std::vector<double> partial(chunks.size(), 0.0);
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const Chunk& c = chunks[k];
      const at::Tensor& t = dense[c.tensor];
      if (const std::optional<double> vec = vector_sum_squares(
              t.scalar_type(),
              static_cast<const char*>(t.const_data_ptr()) + c.begin * t.element_size(),
              c.end - c.begin)) {
        partial[k] = *vec;
        continue;
      }
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), kNormOp, [&] {
        partial[k] = sum_squares(t.const_data_ptr<scalar_t>() + c.begin, c.end - c.begin);
      });
    }
  });
  // Summed in chunk order: deterministic for any thread count.
  std::vector<double> per(tensors.size(), 0.0);
  for (size_t k = 0; k < chunks.size(); ++k) per[chunks[k].tensor] += partial[k];
  double total = 0.0;
  for (double s : per) total += s;
  at::Tensor norms = at::empty({per_tensor ? static_cast<int64_t>(per.size()) : 0}, out_opts);
  if (per_tensor) {
    float* out = norms.data_ptr<float>();
    for (size_t i = 0; i < per.size(); ++i) out[i] = static_cast<float>(std::sqrt(per[i]));
  }
  return {at::full({}, std::sqrt(total), out_opts), norms};
}
}  // namespace

TORCH_LIBRARY_IMPL(fusetrain, CPU, m) {
  m.impl("fused_adamw_", &fused_adamw_cpu);
  m.impl("fused_sgd_", &fused_sgd_cpu);
  m.impl("multi_tensor_l2norm", &l2norm_cpu);
}

}  // namespace fusetrain::ops

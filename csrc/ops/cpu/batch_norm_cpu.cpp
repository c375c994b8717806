// The CPU implementation of the fused batch normalisation + ReLU. Checks and
// entry points: ../batch_norm.cpp.
//
// Note [Batch norm CPU passes]
// torch's CPU batch norm followed by a ReLU reads and writes the activation
// five to six times forward (statistics, normalisation, ReLU) and eight times
// backward (ReLU's mask, then the normalisation's reduction and its input
// gradient), each pass a separate op with its own allocation. Here the
// forward is two reads and one write (the statistics in one pass, as sums of
// x - K and (x - K)^2 about a per-channel shift K, the mean of the channel's
// first few values, which keeps the variance clear of cancellation unless
// those values are outliers; then y = max(0, (x - mean) * alpha + b)) and the
// backward three reads to reduce (the ReLU's mask applied on the fly from the
// saved output) and three reads and a write for the input gradient.
//
// The loops see the tensor in one of two layouts. Channels innermost
// (channels_last, or [N, C]): element e of the flat array belongs to channel
// e % C, so with a period p = lcm(kLanes, C) the lane at offset j of every
// period belongs to channel j % C, and per-channel constants become p-long
// lane arrays: no gathers, no masks, one vector load per vector of data.
// Planes (contiguous NCHW): each (n, c) plane is a run of H*W elements of one
// channel, walked with p = kLanes and broadcast constants. The sums are
// formed per fixed chunk (at least kBatchNormChunk elements, at most
// kMaxChunks chunks, or one plane) in float32 for kBatchNormBlock periods at
// a time, then in float64, and the chunks' sums added in order, so the
// result does not depend on the thread count. The vector paths (Note [CPU
// paths]) compute every element the same way, so they differ only where the
// statistics' summation order (the lane count) moves a rounding of mean or
// invstd. Layouts the loops would walk mostly in scalar tails (a period
// beyond kMaxPeriod, planes under kMinPlane elements) run the ATen
// composition of generic.cpp instead.
#include <fusetrain/ops/batch_norm.h>
#include <fusetrain/ops/checks.h>
#include <fusetrain/ops/cpu/cpu_features.h>
#include <fusetrain/ops/generic.h>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

#include <fusetrain/ops/cpu/simd_avx2.h>
#include <fusetrain/ops/cpu/simd_avx512.h>

namespace fusetrain::ops {

namespace {
constexpr const char* kForwardOp = "fusetrain::batch_norm_relu";
constexpr const char* kBackwardOp = "fusetrain::batch_norm_relu_backward";
// Elements per chunk of the channels-innermost walk (rounded to periods):
// the unit of parallel work and of the fixed summation order.
constexpr int64_t kBatchNormChunk = 1 << 15;
// Periods summed in float32 before the float64 accumulators take them.
constexpr int64_t kBatchNormBlock = 16;
// At most this many chunks (each holds 2 C float64 sums): a bound on the
// scratch for wide [N, C] inputs that keeps the summation order fixed.
constexpr int64_t kMaxChunks = 64;
// Layouts the loops walk badly go to the device-generic implementation: a
// period longer than this (a wide odd C: p = lcm(kLanes, C) up to 16 C, most
// of it scalar tail for a small batch), or planes shorter than this (all
// scalar tail).
constexpr int64_t kMaxPeriod = 8192;
constexpr int64_t kMinPlane = 16;
// Rows (channels innermost) or elements (planes) whose mean is the shift.
constexpr int64_t kShiftRows = 16;
constexpr int64_t kShiftElements = 64;

// n zeroed values of T, on the stack when few (the lane arrays and sums of
// most layers), else on the heap: the plane walk asks for them per plane.
template <typename T>
class Scratch {
 public:
  explicit Scratch(int64_t n) {
    if (n > kInline) heap_.resize(static_cast<size_t>(n));
    data_ = n > kInline ? heap_.data() : inline_;
    std::fill_n(data_, n, T(0));
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  T* data() { return data_; }

 private:
  static constexpr int64_t kInline = 512;
  T inline_[kInline];
  std::vector<T> heap_;
  T* data_;
};

// The per-lane constants of the input gradient (Note [Batch norm CPU passes]).
struct BatchNormGradLanes {
  const float* mean;
  const float* a;
  const float* b;
  const float* c;
};

// ------------------------------------------------------------ scalar loops

// The portable loops (and the reference for the vector ones): the same
// operations as batch_norm_loops.inc, one lane at a time.
namespace scalar {

// Per lane index j: s1[j] += sum u, s2[j] += sum u * w over the elements,
// (u, w) = terms(e, j) for element e at lane j; float32 for kBatchNormBlock
// periods at a time, then float64.
template <typename Terms>
void lane_sums(int64_t n, int64_t p, const Terms& terms, double* s1, double* s2) {
  Scratch<float> acc(2 * p);
  float* a1 = acc.data();
  float* a2 = a1 + p;
  int64_t periods = 0;
  for (int64_t e = 0; e < n; e += p) {
    for (int64_t j = 0; j < p && e + j < n; ++j) {
      const auto [u, w] = terms(e + j, j);
      a1[j] += u;
      a2[j] = std::fma(u, w, a2[j]);
    }
    if (++periods == kBatchNormBlock || e + p >= n) {
      for (int64_t j = 0; j < p; ++j) {
        s1[j] += a1[j];
        s2[j] += a2[j];
        a1[j] = a2[j] = 0.f;
      }
      periods = 0;
    }
  }
}

template <typename T>
void moments(const T* x, int64_t n, int64_t p, const float* shift, double* s1, double* s2) {
  lane_sums(
      n, p,
      [&](int64_t e, int64_t j) {
        const float v = static_cast<float>(x[e]) - shift[j];
        return std::pair{v, v};
      },
      s1, s2);
}

template <typename T>
void affine(const T* x, int64_t n, int64_t p, const float* mean, const float* alpha,
            const float* bias, bool relu, T* y) {
  for (int64_t e = 0; e < n; e += p) {
    for (int64_t j = 0; j < p && e + j < n; ++j) {
      const float v = std::fma(static_cast<float>(x[e + j]) - mean[j], alpha[j], bias[j]);
      y[e + j] = static_cast<T>(relu && 0.f > v ? 0.f : v);  // NaN stays NaN
    }
  }
}

template <typename T>
float passed(const T* dy, const T* out, bool relu) {
  const float g = static_cast<float>(*dy);
  return relu && static_cast<float>(*out) <= 0.f ? 0.f : g;  // NaN passes, as in torch
}

template <typename T>
void grad_moments(const T* dy, const T* out, const T* x, int64_t n, int64_t p, const float* mean,
                  bool relu, double* sg, double* sgx) {
  lane_sums(
      n, p,
      [&](int64_t e, int64_t j) {
        return std::pair{passed(dy + e, out + e, relu), static_cast<float>(x[e]) - mean[j]};
      },
      sg, sgx);
}

template <typename T>
void grad_input(const T* dy, const T* out, const T* x, int64_t n, int64_t p,
                const BatchNormGradLanes& k, bool relu, bool through_stats, T* dx) {
  for (int64_t e = 0; e < n; e += p) {
    for (int64_t j = 0; j < p && e + j < n; ++j) {
      const float g = passed(dy + e + j, out + e + j, relu);
      const float centred = static_cast<float>(x[e + j]) - k.mean[j];
      dx[e + j] = static_cast<T>(through_stats
                                     ? std::fma(g, k.a[j], std::fma(centred, k.b[j], k.c[j]))
                                     : g * k.a[j]);
    }
  }
}

}  // namespace scalar
}  // namespace
}  // namespace fusetrain::ops

// ------------------------------------------------------------ vector loops

#define FUSETRAIN_SIMD_LOOPS "batch_norm_loops.inc"
#include <fusetrain/ops/cpu/simd_each_isa.inc>

namespace fusetrain::ops {
namespace {

// The loops of one path (Note [CPU paths]) and its lane count.
template <typename T>
struct Loops {
  int64_t lanes;
  void (*moments)(const T*, int64_t, int64_t, const float*, double*, double*);
  void (*affine)(const T*, int64_t, int64_t, const float*, const float*, const float*, bool, T*);
  void (*grad_moments)(const T*, const T*, const T*, int64_t, int64_t, const float*, bool, double*,
                       double*);
  void (*grad_input)(const T*, const T*, const T*, int64_t, int64_t, const BatchNormGradLanes&,
                     bool, bool, T*);
};

template <typename T>
Loops<T> loops_for_path() {
#ifdef FUSETRAIN_SIMD_X86
  switch (cpu_path()) {
    case CpuPath::kAvx512:
      return {avx512::kLanes, &avx512::moments<T>, &avx512::affine<T>, &avx512::grad_moments<T>,
              &avx512::grad_input<T>};
    case CpuPath::kAvx2:
      return {avx2::kLanes, &avx2::moments<T>, &avx2::affine<T>, &avx2::grad_moments<T>,
              &avx2::grad_input<T>};
    case CpuPath::kGeneric:  // the op went to generic:: before
    case CpuPath::kScalar:
      break;
  }
#endif
  return {1, &scalar::moments<T>, &scalar::affine<T>, &scalar::grad_moments<T>,
          &scalar::grad_input<T>};
}

// How the loops walk a tensor [N, C, *] (Note [Batch norm CPU passes]).
struct Walk {
  bool innermost;  // channels innermost, else (n, c) planes
  int64_t batch;
  int64_t channels;
  int64_t plane;  // elements per (n, c): the product of the trailing sizes
  int64_t numel;
  at::MemoryFormat format;  // the one the tensors are laid out in
};

// The layout the loops can walk that `t` already has, if any.
std::optional<Walk> walk_of(const at::Tensor& t) {
  Walk w{false, t.size(0), t.size(1), 1, t.numel(), at::MemoryFormat::Contiguous};
  for (int64_t d = 2; d < t.dim(); ++d) w.plane *= t.size(d);
  if (t.is_contiguous() && (t.dim() == 2 || w.plane == 1)) {
    w.innermost = true;
    return w;
  }
  if (t.dim() == 4 && t.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    w.innermost = true;
    w.format = at::MemoryFormat::ChannelsLast;
    return w;
  }
  if (t.dim() == 5 && t.is_contiguous(at::MemoryFormat::ChannelsLast3d)) {
    w.innermost = true;
    w.format = at::MemoryFormat::ChannelsLast3d;
    return w;
  }
  if (t.is_contiguous()) return w;
  return std::nullopt;
}

// `t` in a layout the loops walk: itself, or a copy in the memory format
// torch suggests for it (channels_last for channels_last-like strides).
at::Tensor walkable(const at::Tensor& t) {
  if (walk_of(t)) return t;
  at::Tensor copy = t.contiguous(t.suggest_memory_format());
  return walk_of(copy) ? copy : t.contiguous();
}

std::vector<float> floats_of(const std::optional<at::Tensor>& t, int64_t c, float absent) {
  if (!given(t)) return std::vector<float>(static_cast<size_t>(c), absent);
  const at::Tensor f = t->to(at::kFloat).contiguous();
  const float* p = f.const_data_ptr<float>();
  return std::vector<float>(p, p + c);
}

at::Tensor float_tensor(const std::vector<float>& v, const at::TensorOptions& options) {
  at::Tensor t = at::empty({static_cast<int64_t>(v.size())}, options.dtype(at::kFloat));
  std::copy(v.begin(), v.end(), t.data_ptr<float>());
  return t;
}

// The units a walk's passes split a tensor into: chunks of whole periods
// (channels innermost) or (n, c) planes, each `period` elements to the lane
// array.
struct Units {
  int64_t count;
  int64_t chunk;   // elements per unit
  int64_t period;  // p of Note [Batch norm CPU passes]
};

Units units_of(const Walk& w, int64_t lanes) {
  if (w.numel == 0) return {0, 0, lanes};
  if (!w.innermost) return {w.batch * w.channels, w.plane, lanes};
  const int64_t p = std::lcm(lanes, w.channels);
  const int64_t periods = (w.numel + p - 1) / p;
  const int64_t per_chunk =
      std::max({int64_t{1}, kBatchNormChunk / p, (periods + kMaxChunks - 1) / kMaxChunks});
  const int64_t chunk = per_chunk * p;
  return {(w.numel + chunk - 1) / chunk, chunk, p};
}

// Runs fn(u, offset, count, p, channel_of) for every unit u, in parallel:
// `count` elements from `offset`, where lane j of the unit's p-long lane
// arrays belongs to channel channel_of(j).
template <typename Fn>
void for_each_unit(const Walk& w, int64_t lanes, const Fn& fn) {
  const Units units = units_of(w, lanes);
  if (units.count == 0) return;
  if (w.innermost) {
    const auto channel_of = [c = w.channels](int64_t j) { return j % c; };
    at::parallel_for(0, units.count, 1, [&](int64_t begin, int64_t end) {
      for (int64_t u = begin; u < end; ++u) {
        const int64_t offset = u * units.chunk;
        fn(u, offset, std::min(units.chunk, w.numel - offset), units.period, channel_of);
      }
    });
  } else {
    const int64_t grain = std::max<int64_t>(1, kBatchNormChunk / std::max<int64_t>(w.plane, 1));
    at::parallel_for(0, units.count, grain, [&](int64_t begin, int64_t end) {
      for (int64_t u = begin; u < end; ++u) {
        const int64_t c = u % w.channels;
        fn(u, u * w.plane, w.plane, units.period, [c](int64_t) { return c; });
      }
    });
  }
}

// Fills `lanes` (p floats) with values[channel_of(j)].
template <typename ChannelOf>
void spread(const std::vector<float>& values, int64_t p, const ChannelOf& channel_of, float* lanes) {
  for (int64_t j = 0; j < p; ++j) lanes[j] = values[static_cast<size_t>(channel_of(j))];
}

// Per-channel sums of two per-lane quantities, folded from each unit's lane
// sums in unit order (deterministic for any thread count). `unit_sums(u,
// offset, count, p, lanes_of, s1, s2)` adds unit u's lane sums into s1, s2.
template <typename UnitSums>
std::pair<std::vector<double>, std::vector<double>> channel_sums(const Walk& w, int64_t lanes,
                                                                 const UnitSums& unit_sums) {
  const int64_t c = w.channels;
  const Units units = units_of(w, lanes);
  // A chunk's sums are C slots (one per channel), a plane's one.
  const int64_t per_unit = w.innermost ? c : 1;
  std::vector<double> partial(static_cast<size_t>(2 * units.count * per_unit), 0.0);
  for_each_unit(w, lanes, [&](int64_t u, int64_t offset, int64_t count, int64_t p, const auto& channel_of) {
    Scratch<double> sums(2 * p);
    const double* s = sums.data();
    unit_sums(u, offset, count, p, channel_of, sums.data(), sums.data() + p);
    double* out = partial.data() + 2 * u * per_unit;
    for (int64_t j = 0; j < p; ++j) {
      const int64_t slot = w.innermost ? channel_of(j) : 0;
      out[slot] += s[j];
      out[per_unit + slot] += s[p + j];
    }
  });
  std::vector<double> s1(static_cast<size_t>(c), 0.0), s2(static_cast<size_t>(c), 0.0);
  for (int64_t u = 0; u < units.count; ++u) {
    const double* in = partial.data() + 2 * u * per_unit;
    for (int64_t slot = 0; slot < per_unit; ++slot) {
      const int64_t ch = w.innermost ? slot : u % c;
      s1[ch] += in[slot];
      s2[ch] += in[per_unit + slot];
    }
  }
  return {std::move(s1), std::move(s2)};
}

// Writes new running statistics: (1 - momentum) * running + momentum * batch.
void update_running(const at::Tensor& running, const std::vector<double>& batch, double momentum) {
  at::Tensor r = running;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, r.scalar_type(), "batch_norm_relu", [&] {
    auto a = r.accessor<scalar_t, 1>();
    for (int64_t ch = 0; ch < r.size(0); ++ch) {
      const double old = static_cast<double>(a[ch]);
      a[ch] = static_cast<scalar_t>(momentum * batch[static_cast<size_t>(ch)] + (1.0 - momentum) * old);
    }
  });
  // As torch's in-place update: autograd sees the buffer changed.
  if (!r.is_inference()) r.unsafeGetTensorImpl()->bump_version();
}

// Whether the loops walk `w` well (else the generic implementation runs).
bool loops_suit(const Walk& w, int64_t lanes) {
  return w.innermost ? std::lcm(lanes, std::max<int64_t>(w.channels, 1)) <= kMaxPeriod
                     : w.plane >= kMinPlane;
}

template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_typed(
    const at::Tensor& x_in, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, bool training, double momentum, double eps,
    bool relu) {
  const Loops<T> loops = loops_for_path<T>();
  const at::Tensor x = walkable(x_in);
  const Walk w = *walk_of(x);
  if (!loops_suit(w, loops.lanes))
    return generic::batch_norm_relu(x_in, weight, bias, running_mean, running_var, training,
                                    momentum, eps, relu);
  const int64_t c = w.channels;
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor out = at::empty_like(x);  // x is dense: its strides
  const T* xp = x.const_data_ptr<T>();
  T* yp = out.data_ptr<T>();

  std::vector<float> mean(static_cast<size_t>(c)), invstd(static_cast<size_t>(c));
  if (training) {
    const int64_t count = w.numel / std::max<int64_t>(c, 1);
    if (count == 0) return {out, at::zeros({c}, f32), at::zeros({c}, f32)};
    // The shift: each channel's mean over its first few rows (or the first
    // elements of its first plane), near the batch's mean unless those few
    // values are outliers.
    std::vector<float> shift(static_cast<size_t>(c));
    for (int64_t ch = 0; ch < c; ++ch) {
      const int64_t k = w.innermost ? std::min(kShiftRows, count) : std::min(kShiftElements, w.plane);
      double sum = 0.0;
      for (int64_t i = 0; i < k; ++i) {
        sum += static_cast<double>(xp[w.innermost ? i * c + ch : ch * w.plane + i]);
      }
      shift[static_cast<size_t>(ch)] = static_cast<float>(sum / static_cast<double>(k));
    }
    auto [s1, s2] = channel_sums(w, loops.lanes, [&](int64_t, int64_t offset, int64_t n, int64_t p,
                                                     const auto& channel_of, double* a, double* b) {
      Scratch<float> lanes(p);
      spread(shift, p, channel_of, lanes.data());
      loops.moments(xp + offset, n, p, lanes.data(), a, b);
    });
    std::vector<double> batch_mean(static_cast<size_t>(c)), unbiased(static_cast<size_t>(c));
    const double n = static_cast<double>(count);
    for (int64_t ch = 0; ch < c; ++ch) {
      const size_t i = static_cast<size_t>(ch);
      const double d = s1[i] / n;
      double var_sum = s2[i] - s1[i] * d;
      if (var_sum < 0.0) var_sum = 0.0;  // rounding; a NaN stays NaN, as in torch
      batch_mean[i] = shift[i] + d;
      unbiased[i] = var_sum / (n - 1.0);
      mean[i] = static_cast<float>(batch_mean[i]);
      invstd[i] = static_cast<float>(1.0 / std::sqrt(var_sum / n + eps));
    }
    if (given(running_mean)) {
      update_running(*running_mean, batch_mean, momentum);
      update_running(*running_var, unbiased, momentum);
    }
  } else {
    mean = floats_of(running_mean, c, 0.f);
    const std::vector<float> var = floats_of(running_var, c, 1.f);
    for (int64_t ch = 0; ch < c; ++ch) {
      const size_t i = static_cast<size_t>(ch);
      invstd[i] = static_cast<float>(1.0 / std::sqrt(static_cast<double>(var[i]) + eps));
    }
  }

  // y = (x - mean) * alpha + b with alpha = invstd * w: torch's x * alpha +
  // (b - mean * alpha) would round mean * alpha, which is large where the
  // spread is small against the mean.
  const std::vector<float> wv = floats_of(weight, c, 1.f), bv = floats_of(bias, c, 0.f);
  std::vector<float> alpha(static_cast<size_t>(c));
  for (size_t i = 0; i < alpha.size(); ++i) alpha[i] = invstd[i] * wv[i];
  for_each_unit(w, loops.lanes, [&](int64_t, int64_t offset, int64_t n, int64_t p, const auto& channel_of) {
    Scratch<float> lanes(3 * p);
    float* l = lanes.data();
    spread(mean, p, channel_of, l);
    spread(alpha, p, channel_of, l + p);
    spread(bv, p, channel_of, l + 2 * p);
    loops.affine(xp + offset, n, p, l, l + p, l + 2 * p, relu, yp + offset);
  });
  return {out, float_tensor(mean, f32), float_tensor(invstd, f32)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_cpu(
    const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, bool training, double momentum, double eps,
    bool relu) {
  if (cpu_path() == CpuPath::kGeneric)
    return generic::batch_norm_relu(input, weight, bias, running_mean, running_var, training,
                                    momentum, eps, relu);
  check_batch_norm_forward_args(input, weight, bias, running_mean, running_var, training);
  return with_element_type(input.scalar_type(), kForwardOp, [&](auto tag) {
    return forward_typed<decltype(tag)>(input, weight, bias, running_mean, running_var, training,
                                        momentum, eps, relu);
  });
}

template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_typed(
    const at::Tensor& grad_out, const at::Tensor& input, const std::optional<at::Tensor>& output,
    const std::optional<at::Tensor>& weight, const at::Tensor& save_mean,
    const at::Tensor& save_invstd, bool training, bool relu, std::array<bool, 3> mask) {
  const Loops<T> loops = loops_for_path<T>();
  const at::Tensor x = walkable(input);
  const Walk w = *walk_of(x);
  if (!loops_suit(w, loops.lanes))
    return generic::batch_norm_relu_backward(grad_out, input, output, weight, save_mean,
                                             save_invstd, training, relu, mask);
  const int64_t c = w.channels;
  // Every operand in the input's layout, so one walk serves them all.
  const at::Tensor dy = grad_out.contiguous(w.format);
  const at::Tensor y = relu ? output->contiguous(w.format) : dy;
  const T* xp = x.const_data_ptr<T>();
  const T* dyp = dy.const_data_ptr<T>();
  const T* yp = y.const_data_ptr<T>();
  const std::vector<float> mean = floats_of(save_mean, c, 0.f);
  const std::vector<float> invstd = floats_of(save_invstd, c, 1.f);
  const std::vector<float> wv = floats_of(weight, c, 1.f);

  const bool need_sums = mask[1] || mask[2] || (mask[0] && training);
  std::vector<double> sg(static_cast<size_t>(c), 0.0), sgx(static_cast<size_t>(c), 0.0);
  if (need_sums) {
    std::tie(sg, sgx) = channel_sums(w, loops.lanes, [&](int64_t, int64_t offset, int64_t n, int64_t p,
                                                         const auto& channel_of, double* a, double* b) {
      Scratch<float> lanes(p);
      spread(mean, p, channel_of, lanes.data());
      loops.grad_moments(dyp + offset, yp + offset, xp + offset, n, p, lanes.data(), relu, a, b);
    });
  }

  at::Tensor grad_input, grad_weight, grad_bias;
  if (mask[0]) {
    grad_input = at::empty_like(x);
    const double count = static_cast<double>(w.numel / std::max<int64_t>(c, 1));
    std::vector<float> a(static_cast<size_t>(c)), b(a.size()), k(a.size());
    for (size_t i = 0; i < a.size(); ++i) {
      // dx = w invstd (g - sum g / n - (x - mean) invstd^2 sum g (x - mean) / n)
      const double ai = static_cast<double>(wv[i]) * invstd[i];
      a[i] = static_cast<float>(ai);
      b[i] = static_cast<float>(-ai * invstd[i] * invstd[i] * sgx[i] / count);
      k[i] = static_cast<float>(-ai * sg[i] / count);
    }
    T* dxp = grad_input.data_ptr<T>();
    for_each_unit(w, loops.lanes, [&](int64_t, int64_t offset, int64_t n, int64_t p,
                                      const auto& channel_of) {
      Scratch<float> lanes(4 * p);
      float* l = lanes.data();
      spread(mean, p, channel_of, l);
      spread(a, p, channel_of, l + p);
      spread(b, p, channel_of, l + 2 * p);
      spread(k, p, channel_of, l + 3 * p);
      loops.grad_input(dyp + offset, yp + offset, xp + offset, n, p,
                       BatchNormGradLanes{l, l + p, l + 2 * p, l + 3 * p}, relu, training,
                       dxp + offset);
    });
  }
  const auto param_options = input.options().dtype(given(weight) ? weight->scalar_type() : at::kFloat);
  if (mask[1] && given(weight)) {
    std::vector<float> gw(static_cast<size_t>(c));
    for (size_t i = 0; i < gw.size(); ++i) gw[i] = static_cast<float>(sgx[i] * invstd[i]);
    grad_weight = float_tensor(gw, param_options).to(param_options.dtype());
  }
  if (mask[2]) {
    std::vector<float> gb(sg.begin(), sg.end());
    grad_bias = float_tensor(gb, param_options).to(param_options.dtype());
  }
  return {grad_input, grad_weight, grad_bias};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& input, const std::optional<at::Tensor>& output,
    const std::optional<at::Tensor>& weight, const at::Tensor& save_mean,
    const at::Tensor& save_invstd, bool training, bool relu, std::array<bool, 3> mask) {
  if (cpu_path() == CpuPath::kGeneric)
    return generic::batch_norm_relu_backward(grad_out, input, output, weight, save_mean,
                                             save_invstd, training, relu, mask);
  check_batch_norm_backward_args(grad_out, input, output, weight, save_mean, save_invstd, relu);
  return with_element_type(input.scalar_type(), kBackwardOp, [&](auto tag) {
    return backward_typed<decltype(tag)>(grad_out, input, output, weight, save_mean, save_invstd,
                                         training, relu, mask);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fusetrain, CPU, m) {
  m.impl("batch_norm_relu", &forward_cpu);
  m.impl("batch_norm_relu_backward", &backward_cpu);
}

}  // namespace fusetrain::ops

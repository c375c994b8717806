// Float8 quantisation ops: the dispatcher entry points, argument checks, the
// CPU implementations (the reference the CUDA kernels are tested against; the
// scaling rule itself is shared, csrc/kernels/fp8_scaling.h) and the Meta ones.
#include <fusetrain/kernels/fp8_scaling.h>
#include <fusetrain/ops/checks.h>
#include <fusetrain/ops/fp8.h>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <algorithm>

namespace fusetrain::ops {

namespace {
constexpr const char* kCurrentOp = "fusetrain::fp8_quantize_current";
constexpr const char* kDelayedOp = "fusetrain::fp8_quantize_delayed";
constexpr const char* kCurrentTransposeOp = "fusetrain::fp8_quantize_current_transpose";
constexpr const char* kDelayedTransposeOp = "fusetrain::fp8_quantize_delayed_transpose";
constexpr int64_t kCpuChunk = 32768;
namespace fp8 = kernels::fp8;
}  // namespace

float fp8_max(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat8_e4m3fn:
      return fp8::kE4M3Max;
    case at::kFloat8_e5m2:
      return fp8::kE5M2Max;
    default:
      TORCH_CHECK(false, "fusetrain: float8 dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got ",
                  dtype);
  }
}

void check_fp8_quantize_args(const char* op, const at::Tensor& self, at::ScalarType dtype,
                             const at::Tensor& scale, const at::Tensor& state,
                             const char* state_name, int64_t margin) {
  TORCH_CHECK(self.defined(), op, ": self is undefined");
  const at::ScalarType in = self.scalar_type();
  TORCH_CHECK(in == at::kFloat || in == at::kHalf || in == at::kBFloat16, op,
              ": self must be float32, float16 or bfloat16, got ", in);
  TORCH_CHECK(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2, op,
              ": dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got ", dtype);
  check_scalar_tensor(scale, op, "scale", at::kFloat);
  check_same_device(scale, self, op, "scale", "self");
  TORCH_CHECK(state.defined(), op, ": ", state_name, " is undefined");
  TORCH_CHECK(state.scalar_type() == at::kFloat, op, ": ", state_name, " must be float32, got ",
              state.scalar_type());
  TORCH_CHECK(state.dim() == 1 && state.numel() >= 1 && state.is_contiguous(), op, ": ",
              state_name, " must be a contiguous 1-D tensor of at least one element, got shape ",
              state.sizes());
  check_same_device(state, self, op, state_name, "self");
  TORCH_CHECK(state.numel() <= fp8::kMaxAmaxHistory, op, ": ", state_name, " holds ",
              state.numel(), " entries; at most ", fp8::kMaxAmaxHistory, " are supported");
  TORCH_CHECK(!state.is_same(scale), op, ": scale and ",
              state_name, " must be different tensors");
  TORCH_CHECK(margin >= 0 && margin < 128, op, ": margin must be in [0, 128), got ", margin);
}

at::Tensor fp8_quantize_current(const at::Tensor& self, at::ScalarType dtype, at::Tensor& scale,
                                at::Tensor& amax, int64_t margin) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow(kCurrentOp, "")
                       .typed<at::Tensor(const at::Tensor&, at::ScalarType, at::Tensor&,
                                         at::Tensor&, int64_t)>();
  return op.call(self, dtype, scale, amax, margin);
}

at::Tensor fp8_quantize_delayed(const at::Tensor& self, at::ScalarType dtype, at::Tensor& scale,
                                at::Tensor& amax_history, int64_t margin) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow(kDelayedOp, "")
                       .typed<at::Tensor(const at::Tensor&, at::ScalarType, at::Tensor&,
                                         at::Tensor&, int64_t)>();
  return op.call(self, dtype, scale, amax_history, margin);
}

using QuantizeTransposeFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, at::ScalarType,
                                                              at::Tensor&, at::Tensor&, int64_t,
                                                              int64_t);

std::tuple<at::Tensor, at::Tensor> fp8_quantize_current_transpose(
    const at::Tensor& self, at::ScalarType dtype, at::Tensor& scale, at::Tensor& amax,
    int64_t margin, int64_t row_multiple) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow(kCurrentTransposeOp, "")
                       .typed<QuantizeTransposeFn>();
  return op.call(self, dtype, scale, amax, margin, row_multiple);
}

std::tuple<at::Tensor, at::Tensor> fp8_quantize_delayed_transpose(
    const at::Tensor& self, at::ScalarType dtype, at::Tensor& scale, at::Tensor& amax_history,
    int64_t margin, int64_t row_multiple) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow(kDelayedTransposeOp, "")
                       .typed<QuantizeTransposeFn>();
  return op.call(self, dtype, scale, amax_history, margin, row_multiple);
}

int64_t fp8_padded_rows(const char* op, const at::Tensor& self, int64_t row_multiple) {
  TORCH_CHECK(self.defined() && self.dim() == 2, op, ": self must be a matrix, got ",
              self.defined() ? self.dim() : 0, " dimensions");
  TORCH_CHECK(row_multiple >= 1, op, ": row_multiple must be at least 1, got ", row_multiple);
  return (self.size(0) + row_multiple - 1) / row_multiple * row_multiple;
}

namespace {

// max |x| as fp8::abs_bits: a NaN anywhere gives NaN bits, as on the GPU.
uint32_t amax_bits_cpu(const at::Tensor& x) {
  uint32_t result = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "fp8_amax", [&] {
    const scalar_t* p = x.const_data_ptr<scalar_t>();
    result = at::parallel_reduce(
        0, x.numel(), kCpuChunk, uint32_t{0},
        [&](int64_t begin, int64_t end, uint32_t m) {
          for (int64_t i = begin; i < end; ++i) {
            m = std::max(m, fp8::abs_bits(static_cast<float>(p[i])));
          }
          return m;
        },
        [](uint32_t a, uint32_t b) { return std::max(a, b); });
  });
  return result;
}

// Finite x: x * scale clamped to the range, then c10's round-to-nearest-even
// conversion; non-finite x: fp8_scaling.h's byte (what c10's cast writes).
template <typename Fp8>
void cast_cpu(const at::Tensor& x, at::Tensor& out, float scale) {
  constexpr bool kE5M2 = std::is_same_v<Fp8, c10::Float8_e5m2>;
  constexpr float kMax = kE5M2 ? fp8::kE5M2Max : fp8::kE4M3Max;
  Fp8* q = out.mutable_data_ptr<Fp8>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "fp8_cast", [&] {
    const scalar_t* p = x.const_data_ptr<scalar_t>();
    at::parallel_for(0, x.numel(), kCpuChunk, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const float v = static_cast<float>(p[i]);
        if (fp8::abs_bits(v) >= fp8::kInfBits) {
          q[i] = Fp8(fp8::non_finite_byte(v, kE5M2), Fp8::from_bits());
        } else {
          q[i] = Fp8(std::clamp(v * scale, -kMax, kMax));
        }
      }
    });
  });
}

at::Tensor cast_to_fp8_cpu(const at::Tensor& x, at::ScalarType dtype, float scale) {
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(dtype));
  if (dtype == at::kFloat8_e5m2) {
    cast_cpu<c10::Float8_e5m2>(x, out, scale);
  } else {
    cast_cpu<c10::Float8_e4m3fn>(x, out, scale);
  }
  return out;
}

at::Tensor quantize_current_cpu(const at::Tensor& self, at::ScalarType dtype, at::Tensor& scale,
                                at::Tensor& amax, int64_t margin) {
  check_fp8_quantize_args(kCurrentOp, self, dtype, scale, amax, "amax", margin);
  TORCH_CHECK(amax.numel() == 1, kCurrentOp, ": amax must hold exactly one element, got shape ",
              amax.sizes());
  TORCH_CHECK(self.is_cpu(), kCurrentOp, ": the CPU kernel got self on ", self.device());
  const at::Tensor x = self.contiguous();
  float* a = amax.mutable_data_ptr<float>();
  float* s = scale.mutable_data_ptr<float>();
  *a = fp8::bits_float(amax_bits_cpu(x));
  *s = fp8::scale_from_amax(*a, *s, fp8_max(dtype), static_cast<int>(margin));
  return cast_to_fp8_cpu(x, dtype, *s);
}

at::Tensor quantize_delayed_cpu(const at::Tensor& self, at::ScalarType dtype, at::Tensor& scale,
                                at::Tensor& amax_history, int64_t margin) {
  check_fp8_quantize_args(kDelayedOp, self, dtype, scale, amax_history, "amax_history", margin);
  TORCH_CHECK(self.is_cpu(), kDelayedOp, ": the CPU kernel got self on ", self.device());
  const at::Tensor x = self.contiguous();
  float* h = amax_history.mutable_data_ptr<float>();
  float* s = scale.mutable_data_ptr<float>();
  const int64_t len = amax_history.numel();
  uint32_t m = 0;
  for (int64_t i = 0; i < len; ++i) {
    const uint32_t b = fp8::abs_bits(h[i]);
    if (b < fp8::kInfBits) m = std::max(m, b);
  }
  *s = fp8::scale_from_amax(fp8::bits_float(m), *s, fp8_max(dtype), static_cast<int>(margin));
  std::copy_backward(h, h + len - 1, h + len);
  h[0] = fp8::bits_float(amax_bits_cpu(x));
  return cast_to_fp8_cpu(x, dtype, *s);
}

at::Tensor quantize_current_meta(const at::Tensor& self, at::ScalarType dtype, at::Tensor& scale,
                                 at::Tensor& amax, int64_t margin) {
  check_fp8_quantize_args(kCurrentOp, self, dtype, scale, amax, "amax", margin);
  TORCH_CHECK(amax.numel() == 1, kCurrentOp, ": amax must hold exactly one element, got shape ",
              amax.sizes());
  return at::empty(self.sizes(), self.options().dtype(dtype));
}

at::Tensor quantize_delayed_meta(const at::Tensor& self, at::ScalarType dtype, at::Tensor& scale,
                                 at::Tensor& amax_history, int64_t margin) {
  check_fp8_quantize_args(kDelayedOp, self, dtype, scale, amax_history, "amax_history", margin);
  return at::empty(self.sizes(), self.options().dtype(dtype));
}

// The transposing ops on every backend but CUDA: the quantisation through
// the dispatcher, then the transpose as a copy (on CUDA one kernel writes
// both, csrc/ops/cuda/fp8_cuda.cpp). Meta tensors take this path too.
at::Tensor transposed_padded(const at::Tensor& q, int64_t padded_rows) {
  at::Tensor t = at::zeros({q.size(1), padded_rows}, q.options().dtype(at::kByte));
  t.narrow(1, 0, q.size(0)).copy_(q.view(at::kByte).t());
  return t.view(q.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> quantize_current_transpose_generic(
    const at::Tensor& self, at::ScalarType dtype, at::Tensor& scale, at::Tensor& amax,
    int64_t margin, int64_t row_multiple) {
  const int64_t padded_rows = fp8_padded_rows(kCurrentTransposeOp, self, row_multiple);
  at::Tensor q = fp8_quantize_current(self, dtype, scale, amax, margin);
  return {q, transposed_padded(q, padded_rows)};
}

std::tuple<at::Tensor, at::Tensor> quantize_delayed_transpose_generic(
    const at::Tensor& self, at::ScalarType dtype, at::Tensor& scale, at::Tensor& amax_history,
    int64_t margin, int64_t row_multiple) {
  const int64_t padded_rows = fp8_padded_rows(kDelayedTransposeOp, self, row_multiple);
  at::Tensor q = fp8_quantize_delayed(self, dtype, scale, amax_history, margin);
  return {q, transposed_padded(q, padded_rows)};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusetrain, CompositeExplicitAutograd, m) {
  m.impl("fp8_quantize_current_transpose", &quantize_current_transpose_generic);
  m.impl("fp8_quantize_delayed_transpose", &quantize_delayed_transpose_generic);
}

TORCH_LIBRARY_IMPL(fusetrain, CPU, m) {
  m.impl("fp8_quantize_current", &quantize_current_cpu);
  m.impl("fp8_quantize_delayed", &quantize_delayed_cpu);
}

TORCH_LIBRARY_IMPL(fusetrain, Meta, m) {
  m.impl("fp8_quantize_current", &quantize_current_meta);
  m.impl("fp8_quantize_delayed", &quantize_delayed_meta);
}

}  // namespace fusetrain::ops

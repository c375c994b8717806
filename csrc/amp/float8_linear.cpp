// Float8LinearImpl: the float8 GEMMs of the mixed_float8 policy as a custom
// autograd function over fusetrain's quantisation ops and float8 GEMMs
// (at::_scaled_mm on CUDA, an fp32 GEMM of the upcast operands on the CPU).
// The Python twin is python/fusetrain/float8.py; both keep the same state.
#include <fusetrain/amp/float8_linear.h>
#include <fusetrain/ops/fp8.h>

#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>
#include <torch/nn/init.h>

#include <cmath>

#ifdef FUSETRAIN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace fusetrain::amp {

namespace {

constexpr int kInput = 0;
constexpr int kWeight = 1;
constexpr int kGrad = 2;

struct Seeded : torch::CustomClassHolder {
  std::array<bool, 3> value{false, false, false};
};

Seeded& seeded_of(const c10::intrusive_ptr<torch::CustomClassHolder>& p) {
  return *static_cast<Seeded*>(p.get());
}

// Whether a CUDA graph capture is recording on the current stream of x's
// device (no sync; asked only on a layer's first steps).
bool capturing(const at::Tensor& x) {
#ifdef FUSETRAIN_WITH_CUDA
  if (!x.is_cuda()) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(
      cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(x.device().index()), &status));
  return status != cudaStreamCaptureStatusNone;
#else
  (void)x;
  return false;
#endif
}

// What to do when a capture reaches a layer's first training step.
// fusetrain::graph::FusedSteps recognises both messages by "Run one eager
// training step before capturing".
constexpr const char* kCaptureWarmup =
    " Run one eager training step before capturing (FusedSteps: warmup_executions >= 1; the "
    "default runs at least 2)";

// The rows of a quantised operand's transpose are padded to a multiple of
// this: CUDA's _scaled_mm wants its reduced dimension a multiple of 16 (zero
// columns add nothing); the CPU's fp32 GEMM takes any size.
int64_t row_multiple(const at::Tensor& x) { return x.is_cuda() ? 16 : 1; }

// Casts the matrix x with the recipe's scale, updating scale[i] and
// history[i] in place, and returns the float8 x and its transpose (rows
// padded, fusetrain::ops::fp8_quantize_current_transpose), written in one
// pass on CUDA: the layouts the three GEMMs take. The first call of operand
// i seeds its history and marks it in both flags.
// A delayed cast that would seed while a CUDA graph is being captured is an
// error: the graph would replay the seeding cast (the tensor's own amax) at
// every step, and delayed scaling would never take over.
std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& x, at::ScalarType dtype,
                                            const at::Tensor& scale, const at::Tensor& history,
                                            const at::Tensor& seeded_buffer, Seeded& seeded, int i,
                                            bool delayed, int64_t margin) {
  at::Tensor s = scale.narrow(0, i, 1);
  at::Tensor h = history.select(0, i);
  if (delayed && seeded.value[i]) {
    return ops::fp8_quantize_delayed_transpose(x, dtype, s, h, margin, row_multiple(x));
  }
  TORCH_CHECK(!delayed || !capturing(x), "Float8Linear: a CUDA graph capture reached the first "
              "training step of a layer with delayed scaling, which casts with the tensor's own "
              "amax and seeds the amax history; captured, that first step would replay at every "
              "step and delayed scaling would never take over.", kCaptureWarmup);
  at::Tensor first = h.narrow(0, 0, 1);  // current scaling, or seeding the history
  auto q = ops::fp8_quantize_current_transpose(x, dtype, s, first, margin, row_multiple(x));
  if (!seeded.value[i]) {
    seeded.value[i] = true;
    seeded_buffer.narrow(0, i, 1).fill_(1);
  }
  return q;
}

// scale_a * scale_b * (a @ b) + bias in out_dtype, a and b float8, fp32
// accumulation. On CUDA this is at::_scaled_mm, in fast-accumulation mode
// where float8_fast_accum(gemm) says so (the forward). On a CPU torch's _scaled_mm
// runs oneDNN's float8 kernel, a reference loop where the CPU has no float8
// instructions (measured: 0.5 s for a 1024 x 64 x 256 GEMM on an AVX-512
// Xeon, 2000x an fp32 GEMM), so the CPU multiplies the operands upcast to
// float32 instead: a float8 value and the product of two are exact in
// float32, so this is the same sum with fp32 accumulation; the scales and the
// bias apply to the fp32 result, rounded once to out_dtype. Autocast is off
// for the fp32 GEMM (it would run a CPU mm in bf16).
// python/fusetrain/float8.py's _scaled_mm is the same sequence of ATen ops.
at::Tensor scaled_mm(Float8Gemm gemm, const at::Tensor& a, const at::Tensor& b,
                     const at::Tensor& scale_a, const at::Tensor& scale_b, const at::Tensor& bias,
                     at::ScalarType out_dtype) {
  if (a.is_cuda()) {
    const bool fused_bias = bias.defined() && out_dtype != at::kFloat;
    at::Tensor out = at::_scaled_mm(
        a, b, scale_a, scale_b,
        fused_bias ? std::optional<at::Tensor>(bias.to(out_dtype)) : std::nullopt, std::nullopt,
        out_dtype, /*use_fast_accum=*/float8_fast_accum(gemm));
    return bias.defined() && !fused_bias ? out + bias.to(out_dtype) : out;
  }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  at::Tensor out = at::mm(a.to(at::kFloat), b.to(at::kFloat)).mul_(scale_a).mul_(scale_b);
  if (bias.defined()) out.add_(bias.to(at::kFloat));
  return out.to(out_dtype);
}

class Float8LinearFunction : public torch::autograd::Function<Float8LinearFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, const at::Tensor& bias,
                            const at::Tensor& scale, const at::Tensor& history,
                            const at::Tensor& seeded_buffer, const Float8Recipe& recipe,
                            at::ScalarType out_dtype,
                            const c10::intrusive_ptr<torch::CustomClassHolder>& seeded_ptr) {
    Seeded& seeded = seeded_of(seeded_ptr);
    const bool delayed = recipe.scaling == Float8Recipe::Scaling::kDelayed;
    const int64_t in_features = weight.size(1);
    const at::Tensor x = input.reshape({-1, in_features});
    const auto [qx, qx_t] = quantize(x, at::kFloat8_e4m3fn, scale, history, seeded_buffer, seeded,
                                     kInput, delayed, recipe.margin);
    const auto [qw, qw_t] = quantize(weight, at::kFloat8_e4m3fn, scale, history, seeded_buffer,
                                     seeded, kWeight, delayed, recipe.margin);
    const at::Tensor inv_x = scale.select(0, kInput).reciprocal();
    const at::Tensor inv_w = scale.select(0, kWeight).reciprocal();
    const at::Tensor out = scaled_mm(Float8Gemm::kForward, qx, qw.t(), inv_x, inv_w, bias,
                                     out_dtype);
    // The backward's GEMMs take the transposes (row-major qx_t [in, tokens]
    // and qw_t [in, out] read column-major), so those are saved, not qx and
    // qw. The operands of this call (fresh tensors) are saved; the scaling state
    // is not: it is mutable, and the backward reads and updates it live, as
    // the Python twin does (its state object rides on the context). Saved,
    // a layer applied twice in one forward would fail autograd's version
    // check, its second call having moved the scale and the history on.
    ctx->save_for_backward({qx_t, qw_t, inv_x, inv_w});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["history"] = history;
    ctx->saved_data["seeded_buffer"] = seeded_buffer;
    ctx->saved_data["delayed"] = delayed;
    ctx->saved_data["margin"] = recipe.margin;
    ctx->saved_data["seeded"] = c10::IValue::make_capsule(seeded_ptr);
    ctx->saved_data["input_sizes"] = input.sizes().vec();
    ctx->saved_data["input_dtype"] = input.scalar_type();
    ctx->saved_data["has_bias"] = bias.defined();
    std::vector<int64_t> out_sizes = input.sizes().vec();
    out_sizes.back() = weight.size(0);
    return out.reshape(out_sizes);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &qx_t = saved[0], &qw_t = saved[1], &inv_x = saved[2], &inv_w = saved[3];
    const at::Tensor scale = ctx->saved_data["scale"].toTensor();
    const at::Tensor history = ctx->saved_data["history"].toTensor();
    const at::Tensor seeded_buffer = ctx->saved_data["seeded_buffer"].toTensor();
    const auto seeded_ptr = ctx->saved_data["seeded"].toCapsule();
    Seeded& seeded = seeded_of(seeded_ptr);
    const at::Tensor g = grads[0].reshape({-1, qw_t.size(1)});
    const auto [qg, qg_t] =
        quantize(g, at::kFloat8_e5m2, scale, history, seeded_buffer, seeded, kGrad,
                 ctx->saved_data["delayed"].toBool(), ctx->saved_data["margin"].toInt());
    const at::Tensor inv_g = scale.select(0, kGrad).reciprocal();
    at::Tensor grad_input, grad_weight, grad_bias;
    if (ctx->needs_input_grad(0)) {
      // g [tokens, out] @ w [out, in]: w column-major is qw_t read transposed.
      grad_input = scaled_mm(Float8Gemm::kGradInput, qg, qw_t.t(), inv_g, inv_w, {},
                             ctx->saved_data["input_dtype"].toScalarType())
                       .reshape(ctx->saved_data["input_sizes"].toIntVector());
    }
    if (ctx->needs_input_grad(1)) {
      // g^T [out, tokens] @ x [tokens, in], the tokens padded with zeros on
      // CUDA: qg_t row-major and qx_t read transposed (column-major).
      grad_weight = scaled_mm(Float8Gemm::kGradWeight, qg_t, qx_t.t(), inv_g, inv_x, {},
                              at::kFloat);
    }
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)) {
      grad_bias = g.sum(0, /*keepdim=*/false, at::kFloat);
    }
    return {grad_input, grad_weight, grad_bias, {}, {}, {}, {}, {}, {}};
  }
};

}  // namespace

Float8Recipe Float8Recipe::from_name(const std::string& scaling) {
  Float8Recipe r;
  if (scaling == "delayed") {
    r.scaling = Scaling::kDelayed;
  } else if (scaling == "current") {
    r.scaling = Scaling::kCurrent;
  } else {
    TORCH_CHECK(false, "float8 scaling must be \"delayed\" or \"current\", got \"", scaling, "\"");
  }
  return r;
}

bool float8_eligible(int64_t in_features, int64_t out_features, int64_t min_features) {
  return in_features >= min_features && out_features >= min_features && in_features % 16 == 0 &&
         out_features % 16 == 0;
}

void check_float8_device(const c10::Device& device) {
  if (device.is_cpu()) return;
#ifdef FUSETRAIN_WITH_CUDA
  if (device.is_cuda()) {
    const c10::DeviceIndex index = device.has_index() ? device.index() : at::cuda::current_device();
    const cudaDeviceProp* prop = at::cuda::getDeviceProperties(index);
    TORCH_CHECK(prop->major > 8 || (prop->major == 8 && prop->minor >= 9), "mixed_float8: ",
                prop->name, " (", device, ") has compute capability ", prop->major, ".",
                prop->minor, "; float8 GEMMs need 8.9 (Ada) or 9.0 (Hopper) or newer. Use the "
                "mixed_bfloat16 policy on this GPU");
    return;
  }
#endif
  TORCH_CHECK(false, "mixed_float8: no float8 GEMM for device type \"", device.type(),
              "\" (float8 runs on CUDA GPUs of compute capability >= 8.9 and on the CPU); use "
              "mixed_bfloat16");
}

Float8LinearImpl::Float8LinearImpl(int64_t in_features, int64_t out_features, bool bias,
                                   Float8Recipe recipe)
    : in_features_(in_features),
      out_features_(out_features),
      with_bias_(bias),
      recipe_(recipe),
      seeded_(c10::make_intrusive<Seeded>()) {
  TORCH_CHECK(recipe.amax_history_len >= 1 && recipe.amax_history_len <= 1024,
              "Float8Recipe: amax_history_len must be in [1, 1024], got ", recipe.amax_history_len);
  TORCH_CHECK(recipe.margin >= 0 && recipe.margin < 128,
              "Float8Recipe: margin must be in [0, 128), got ", recipe.margin);
  reset();
}

void Float8LinearImpl::reset() {
  // torch::nn::Linear's parameters and initialisation.
  weight = register_parameter("weight", torch::empty({out_features_, in_features_}));
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (with_bias_) {
    bias = register_parameter("bias", torch::empty({out_features_}));
    const double bound = in_features_ > 0 ? 1.0 / std::sqrt(static_cast<double>(in_features_)) : 0;
    torch::nn::init::uniform_(bias, -bound, bound);
  } else {
    bias = register_parameter("bias", {}, /*requires_grad=*/false);
  }
  fp8_scale = register_buffer("fp8_scale", torch::ones({3}, at::kFloat));
  fp8_amax_history =
      register_buffer("fp8_amax_history", torch::zeros({3, recipe_.history_len()}, at::kFloat));
  fp8_seeded = register_buffer("fp8_seeded", torch::zeros({3}, at::kByte));
  seeded_ = c10::make_intrusive<Seeded>();
  // clone() copies the buffers after reset(): the first forward reads them.
  seeded_known_ = false;
}

namespace {
// Runs `cast` (a Module::to) and gives the scaling buffers their own dtypes
// back, with their values as they were.
template <typename Cast>
void keep_state_dtypes(Float8LinearImpl& m, Cast&& cast) {
  const at::Tensor scale = m.fp8_scale.detach().clone();
  const at::Tensor history = m.fp8_amax_history.detach().clone();
  const at::Tensor seeded = m.fp8_seeded.detach().clone();
  cast();
  m.fp8_scale.set_data(scale.to(m.fp8_scale.device()));
  m.fp8_amax_history.set_data(history.to(m.fp8_amax_history.device()));
  m.fp8_seeded.set_data(seeded.to(m.fp8_seeded.device()));
}
}  // namespace

void Float8LinearImpl::to(torch::Dtype dtype, bool non_blocking) {
  keep_state_dtypes(*this, [&] { Cloneable::to(dtype, non_blocking); });
}

void Float8LinearImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  keep_state_dtypes(*this, [&] { Cloneable::to(device, dtype, non_blocking); });
}

void Float8LinearImpl::to(torch::Device device, bool non_blocking) {
  Cloneable::to(device, non_blocking);
}

at::Tensor Float8LinearImpl::forward(const at::Tensor& input) {
  check_float8_device(input.device());
  TORCH_CHECK(!input.is_cuda() || (in_features_ % 16 == 0 && out_features_ % 16 == 0),
              "Float8Linear(", in_features_, ", ", out_features_, "): float8 GEMMs on CUDA need in "
              "and out features that are multiples of 16; keep this layer a torch::nn::Linear");
  const c10::DeviceType type = input.device().type();
  const at::ScalarType out_dtype =
      at::autocast::is_autocast_enabled(type) ? at::autocast::get_autocast_dtype(type)
                                              : input.scalar_type();
  if (!is_training()) {
    // Each tensor scaled by itself; the training state is left alone.
    Float8Recipe current = Float8Recipe::from_name("current");
    current.margin = recipe_.margin;
    auto fresh = c10::make_intrusive<Seeded>();
    fresh->value = {true, true, true};
    return Float8LinearFunction::apply(
        input, weight, bias, torch::ones({3}, fp8_scale.options()),
        torch::zeros({3, 1}, fp8_scale.options()), torch::ones({3}, fp8_seeded.options()),
        current, out_dtype, c10::intrusive_ptr<torch::CustomClassHolder>(fresh));
  }
  if (!seeded_known_) {
    // Reading fp8_seeded syncs with the device, which a capture cannot record.
    TORCH_CHECK(!capturing(input), "Float8Linear: a CUDA graph capture reached the first training "
                "forward since this layer was made, reset or loaded (state_loaded()), which reads "
                "fp8_seeded from the device once.", kCaptureWarmup);
    const at::Tensor seen = fp8_seeded.cpu();
    for (int i = 0; i < 3; ++i) seeded_of(seeded_).value[i] = seen[i].item<uint8_t>() != 0;
    seeded_known_ = true;
  }
  return Float8LinearFunction::apply(input, weight, bias, fp8_scale, fp8_amax_history, fp8_seeded,
                                     recipe_, out_dtype, seeded_);
}

}  // namespace fusetrain::amp

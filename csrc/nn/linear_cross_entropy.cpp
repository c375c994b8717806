// fusetrain::nn::linear_cross_entropy: torch's argument checks (its messages
// and exception types), the choice between the chunked path and the
// reference, the options' resolution (torch's LinearCrossEntropyOptions
// rules), the autocast casts, and the autograd Function over the two
// chunked ops.
#include <fusetrain/nn/linear_cross_entropy.h>
#include <fusetrain/ops/linear_cross_entropy.h>

#include <ATen/autocast_mode.h>
#include <torch/autograd.h>
#include <torch/nn/init.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>

namespace fusetrain::nn {

namespace {

constexpr const char* kName = "linear_cross_entropy";

at::Reduction::Reduction reduction_enum(const std::string& reduction) {
  if (reduction == "mean") return at::Reduction::Mean;
  if (reduction == "sum") return at::Reduction::Sum;
  if (reduction == "none") return at::Reduction::None;
  TORCH_CHECK_VALUE(false, reduction, " is not a valid value for reduction");
  return at::Reduction::Mean;
}

bool is_16_bit(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

std::string shape_string(at::IntArrayRef shape) {
  // Python's tuple notation, as torch's messages print shapes.
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << (shape.size() == 1 ? ",)" : ")");
  return out.str();
}

// The C++ name torch's GEMM check prints ("float", "double", "c10::Half"...).
const char* gemm_dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float";
    case at::kDouble: return "double";
    case at::kHalf: return "c10::Half";
    case at::kBFloat16: return "c10::BFloat16";
    default: return c10::toString(t);
  }
}

// torch's LinearCrossEntropyOptions._adjust for one call: the rows per chunk
// (<= 0: fusetrain's rule) and whether 16-bit linears compute in float32.
ChunkedPlan resolve(const LinearCrossEntropyOptions& o, int64_t rows, int64_t in_features,
                    int64_t classes, at::ScalarType dtype, c10::DeviceType device) {
  TORCH_CHECK_VALUE(o.acc_policy == "auto" || o.acc_policy == "accurate" ||
                        o.acc_policy == "compact",
                    "invalid acc_policy: '", o.acc_policy,
                    "'; expected one of 'auto', 'accurate', 'compact'");
  int64_t factor = 0;  // aspect_ratio's divisor; 0: not aspect_ratio
  if (o.chunking_method && *o.chunking_method != "auto") {
    const std::string& m = *o.chunking_method;
    const auto colon = m.find(':');
    const std::string name = m.substr(0, colon);
    const std::string digits = colon == std::string::npos ? "1" : m.substr(colon + 1);
    const bool numeric = !digits.empty() && digits.size() < 10 &&
                         std::all_of(digits.begin(), digits.end(),
                                     [](char c) { return c >= '0' && c <= '9'; });
    factor = numeric ? std::stoll(digits) : 0;
    TORCH_CHECK_VALUE(name == "aspect_ratio" && factor > 0, "invalid chunking_method: '", m, "'");
  }
  TORCH_CHECK_VALUE(!o.batch_chunk_size || *o.batch_chunk_size > 0,
                    "batch_chunk_size must be positive int or None, got ",
                    o.batch_chunk_size.value_or(0));
  const bool sixteen = is_16_bit(dtype);
  const std::string policy =
      o.acc_policy != "auto"
          ? o.acc_policy
          : (device == c10::DeviceType::CPU && sixteen ? "accurate" : "compact");
  const at::ScalarType acc =
      o.acc_dtype ? *o.acc_dtype
                  : (o.acc_policy == "auto" && sixteen &&
                             (device == c10::DeviceType::CPU || device == c10::DeviceType::CUDA)
                         ? at::kFloat
                         : dtype);
  TORCH_CHECK_VALUE(acc == at::kHalf || acc == at::kBFloat16 || acc == at::kFloat ||
                        acc == at::kDouble,
                    "acc_dtype must be one of {None, torch.float16, torch.bfloat16, "
                    "torch.float32, torch.float64}, got ", acc);
  TORCH_CHECK(acc == dtype || (sixteen && acc == at::kFloat),
              "linear_cross_entropy supports float32 acc_dtype with float16/bfloat16 inputs, "
              "but got ", acc, " acc_dtype and ", dtype, " inputs.");
  ChunkedPlan plan;
  plan.accurate = sixteen && acc == at::kFloat && policy == "accurate";
  plan.allow_retain_graph = o.allow_retain_graph;
  plan.reference_autograd = false;
  plan.gradients_in_forward = o.gradients_in_forward;
  const bool automatic = o.chunking_method && *o.chunking_method == "auto";
  if (automatic) {
    plan.chunk_rows = o.batch_chunk_size ? std::min(*o.batch_chunk_size, rows) : 0;
  } else if (factor > 0) {
    // next_pow2(ceil(rows / ceil(classes / in_features))) / factor
    const int64_t ratio = (classes + in_features - 1) / std::max<int64_t>(in_features, 1);
    const int64_t target = (rows + ratio - 1) / std::max<int64_t>(ratio, 1);
    int64_t pow2 = 1;
    while (pow2 < target) pow2 <<= 1;
    const int64_t chunk = std::min(pow2 / factor, rows);
    TORCH_CHECK_VALUE(!o.batch_chunk_size || *o.batch_chunk_size == chunk, "batch_chunk_size (=",
                      o.batch_chunk_size.value_or(0), ") and chunking_method ('",
                      *o.chunking_method, "') give different chunk sizes (",
                      o.batch_chunk_size.value_or(0), " vs ", chunk, "); pass only one.");
    plan.chunk_rows = chunk;
  } else {
    plan.chunk_rows = o.batch_chunk_size ? std::min(*o.batch_chunk_size, rows) : rows;
  }
  if (!automatic || o.batch_chunk_size) plan.chunk_rows = std::max<int64_t>(1, plan.chunk_rows);
  return plan;
}

// The plan when no options are given: the fastest path of the same
// precision as eager PyTorch (Note [Accumulation precision] in
// csrc/ops/linear_cross_entropy.cpp): 16-bit GEMMs, except float16 on the
// CPU, which has no float16 GEMMs worth the name and computes in float32.
ChunkedPlan default_plan(at::ScalarType dtype, c10::DeviceType device) {
  ChunkedPlan plan;
  plan.accurate = dtype == at::kHalf && device == c10::DeviceType::CPU;
  return plan;
}

std::optional<at::Tensor> optional(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

class LinearCrossEntropyFunction
    : public torch::autograd::Function<LinearCrossEntropyFunction> {
 public:
  // The optional tensors travel as std::optional: an undefined at::Tensor
  // argument is not allowed by Function::apply.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& linear_weight,
                            const std::optional<at::Tensor>& linear_bias,
                            const at::Tensor& target, const std::optional<at::Tensor>& weight,
                            int64_t ignore_index, double label_smoothing,
                            const std::string& reduction, ChunkedPlan plan) {
    const std::array<bool, 3> mask = plan.grad_mask;
    auto [loss, lse, denominator, grad_input, grad_weight, grad_bias, grad_scale] =
        ops::linear_cross_entropy_forward(input, linear_weight, linear_bias, target, weight,
                                          ignore_index, label_smoothing, reduction,
                                          plan.chunk_rows, mask, plan.accurate);
    ctx->save_for_backward({input, linear_weight, linear_bias.value_or(at::Tensor()), target,
                            weight.value_or(at::Tensor()), lse, denominator});
    ctx->saved_data["held"] = mask[0] || mask[1] || mask[2];
    // The gradients for a loss gradient of 1 / grad_scale: the backward
    // rescales them.
    ctx->saved_data["grad_input"] = grad_input;
    ctx->saved_data["grad_weight"] = grad_weight;
    ctx->saved_data["grad_bias"] = grad_bias;
    ctx->saved_data["grad_scale"] = grad_scale;
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["label_smoothing"] = label_smoothing;
    ctx->saved_data["reduction"] = reduction;
    ctx->saved_data["chunk_rows"] = plan.chunk_rows;
    ctx->saved_data["accurate"] = plan.accurate;
    ctx->saved_data["allow_retain_graph"] = plan.allow_retain_graph;
    ctx->saved_data["reference_autograd"] = plan.reference_autograd;
    return loss;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor& grad_loss = grads[0];
    const auto saved = ctx->get_saved_variables();
    const std::string reduction = ctx->saved_data["reduction"].toStringRef();
    const int64_t ignore_index = ctx->saved_data["ignore_index"].toInt();
    const double label_smoothing = ctx->saved_data["label_smoothing"].toDouble();
    const bool has_bias = saved[2].defined();
    const std::array<bool, 3> mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                   ctx->needs_input_grad(2) && has_bias};
    const bool reference = ctx->saved_data["reference_autograd"].toBool();
    if (at::GradMode::is_enabled() && reference) {
      // create_graph: the reference's graph, so that the gradients have
      // gradients of their own (torch's options=None path is twice
      // differentiable). Costs the logits, as the reference does.
      at::Tensor logits = at::linear(saved[0], saved[1], saved[2]);
      // (Autocast's casts are behind us: its float32 class weights meet the
      // 16-bit logits as its cross_entropy would, in float32.)
      if (saved[4].defined() && saved[4].scalar_type() != logits.scalar_type()) {
        logits = logits.to(saved[4].scalar_type());
      }
      const at::Tensor loss =
          at::cross_entropy_loss(logits, saved[3], saved[4], reduction_enum(reduction),
                                 ignore_index, label_smoothing);
      std::vector<at::Tensor> wrt;
      for (int i = 0; i < 3; ++i) {
        if (mask[i]) wrt.push_back(saved[i]);
      }
      const auto got = torch::autograd::grad({loss}, wrt, {grad_loss.to(loss.scalar_type())},
                                             /*retain_graph=*/true, /*create_graph=*/true);
      torch::autograd::variable_list out(9);
      for (int i = 0, k = 0; i < 3; ++i) {
        if (mask[i]) out[i] = got[k++];
      }
      return out;
    }
    at::Tensor gi, gw, gb;
    if (ctx->saved_data["held"].toBool() && !ctx->saved_data["grad_input"].isNone()) {
      // The gradients computed in the forward are handed over, not copied:
      // rescaled in place and released from the context, so that the
      // weight's gradient (as large as the weight) is not held twice and
      // AccumulateGrad can take it as p.grad without a copy; with
      // allow_retain_graph they are kept for another backward instead.
      const bool keep = ctx->saved_data["allow_retain_graph"].toBool();
      const at::Tensor grad_scale = ctx->saved_data["grad_scale"].toTensor();
      const at::Tensor factor = grad_loss.reshape({}).to(grad_scale.scalar_type()).mul(grad_scale);
      const at::ScalarType dtype = saved[0].scalar_type();
      const auto scaled = [&](const char* key, bool want) {
        at::Tensor g = ctx->saved_data[key].toTensor();
        if (!keep) ctx->saved_data[key] = c10::IValue();
        if (!want) return at::Tensor();
        // float16 is held in float32 (Note [Accumulation precision]): scaled
        // there, rounded once.
        return (keep ? g.mul(factor) : g.mul_(factor)).to(dtype);
      };
      gi = scaled("grad_input", mask[0]);
      gw = scaled("grad_weight", mask[1]);
      gb = scaled("grad_bias", mask[2]);
      return {gi, gw, gb, {}, {}, {}, {}, {}, {}};
    }
    if (ctx->saved_data["held"].toBool()) {
      // A second backward through a graph whose gradients the first took.
      TORCH_CHECK(reference,
                  "linear_cross_entropy chunked backward called twice; retain_graph=True / "
                  "double backward are not supported.");
    }
    // Once differentiable with options given, as torch's chunked path: no
    // graph for the gradients even under create_graph.
    const at::NoGradGuard no_grad;
    std::tie(gi, gw, gb) = ops::linear_cross_entropy_backward(
        grad_loss, saved[0], saved[1], optional(saved[2]), saved[3], optional(saved[4]),
        saved[5], saved[6], ignore_index, label_smoothing, reduction,
        ctx->saved_data["chunk_rows"].toInt(), mask, ctx->saved_data["accurate"].toBool());
    if (!mask[0]) gi = at::Tensor();
    if (!mask[1]) gw = at::Tensor();
    if (!mask[2]) gb = at::Tensor();
    return {gi, gw, gb, {}, {}, {}, {}, {}, {}};
  }
};

}  // namespace

at::Tensor linear_cross_entropy_chunked(const at::Tensor& input, const at::Tensor& linear_weight,
                                        const at::Tensor& linear_bias, const at::Tensor& target,
                                        const at::Tensor& weight, const std::string& reduction,
                                        int64_t ignore_index, double label_smoothing,
                                        const ChunkedPlan& plan) {
  // Only the gradients autograd will ask for (a frozen head pays no weight
  // gradient GEMM), and only for a scalar loss; asked here, where grad mode
  // is the caller's (a Function's forward runs without it).
  ChunkedPlan with_mask = plan;
  const bool grad = at::GradMode::is_enabled() && plan.gradients_in_forward && reduction != "none";
  with_mask.grad_mask = {grad && input.requires_grad(), grad && linear_weight.requires_grad(),
                         grad && linear_bias.defined() && linear_bias.requires_grad()};
  return LinearCrossEntropyFunction::apply(input, linear_weight, optional(linear_bias), target,
                                           optional(weight), ignore_index, label_smoothing,
                                           reduction, with_mask);
}

at::Tensor linear_cross_entropy(const at::Tensor& input, const at::Tensor& linear_weight,
                                const at::Tensor& target,
                                const LinearCrossEntropyFuncOptions& options) {
  TORCH_CHECK(input.defined() && linear_weight.defined() && target.defined(), kName,
              ": input, linear_weight and target must be defined");
  // torch's checks, in its order and words.
  TORCH_CHECK(input.dim() >= 1 && input.dim() <= 2,
              "expected input with dimensionality 1 or 2, got ", input.dim());
  TORCH_CHECK(linear_weight.dim() >= 2,
              "expected linear_weight with dimensionality at least 2, got ", linear_weight.dim());
  const int64_t in_features = input.size(-1);
  TORCH_CHECK(in_features == linear_weight.size(-1),
              "expected equal input and linear_weight last dimensions (in_features), got ",
              in_features, " and ", linear_weight.size(-1), ", respectively");
  const int64_t classes = linear_weight.size(0);
  const auto out_features = linear_weight.sizes().slice(1, linear_weight.dim() - 2);
  std::vector<int64_t> bias_shape{classes};
  bias_shape.insert(bias_shape.end(), out_features.begin(), out_features.end());
  const at::Tensor& bias = options.linear_bias;
  TORCH_CHECK(!bias.defined() || bias.sizes() == at::IntArrayRef(bias_shape),
              "expected linear_bias shape ", shape_string(bias_shape), ", got ",
              shape_string(bias.sizes()));
  TORCH_CHECK(out_features.empty() || input.dim() == 2,
              "K-dimensional loss defined by linear_weight shape ",
              shape_string(linear_weight.sizes()), " requires batched input, (N, ", in_features,
              "), got unbatched input with shape ", shape_string(input.sizes()));
  std::vector<int64_t> logits_shape(input.sizes().begin(), input.sizes().end() - 1);
  logits_shape.insert(logits_shape.end(), bias_shape.begin(), bias_shape.end());
  const bool probabilities = target.sizes() == at::IntArrayRef(logits_shape);
  TORCH_CHECK(!(probabilities && options.ignore_index.has_value()),
              "ignore_index cannot be specified when target contains probabilities");
  const int64_t ignore_index = options.ignore_index.value_or(-100);
  const at::Reduction::Reduction reduction = reduction_enum(options.reduction);
  TORCH_CHECK(options.label_smoothing >= 0.0 && options.label_smoothing <= 1.0,
              "label_smoothing must be between 0.0 and 1.0. Got: ", options.label_smoothing);

  const auto& how = options.options;
  const bool chunkable = !probabilities && out_features.empty();
  if (how && !chunkable) {
    TORCH_WARN("linear_cross_entropy: ``options`` ignored; the chunked path needs class-index "
               "targets and out_features == (); got out_features=",
               shape_string(out_features), ", a probability target: ", probabilities,
               ". The reference computes it, holding the logits.");
  }
  if (!chunkable) {
    // The reference: every logit held (autocast applies to both calls).
    const int64_t flat = std::accumulate(bias_shape.begin(), bias_shape.end(), int64_t{1},
                                         std::multiplies<int64_t>());
    const at::Tensor w = linear_weight.reshape({flat, in_features});
    const at::Tensor b = bias.defined() ? bias.reshape({flat}) : bias;
    const at::Tensor logits = at::linear(input, w, b).reshape(logits_shape);
    return at::cross_entropy_loss(logits, target, options.weight, reduction, ignore_index,
                                  options.label_smoothing);
  }
  TORCH_CHECK(target.scalar_type() == at::kLong || target.scalar_type() == at::kByte,
              "expected target dtype to be Long or Byte, but got ",
              c10::toString(target.scalar_type()));
  if (input.dim() == 2) {
    TORCH_CHECK_VALUE(target.dim() == 1 && target.size(0) == input.size(0),
                      "Expected input batch_size (", input.size(0),
                      ") to match target batch_size (", target.dim() ? target.size(0) : 0,
                      ").");
  } else {
    TORCH_CHECK(target.dim() == 0, "0D or 1D target tensor expected, multi-target not supported");
  }
  if (options.weight.defined()) {
    TORCH_CHECK(options.weight.dim() == 1 && options.weight.numel() == classes,
                "weight tensor should be defined either for all ", classes,
                " classes or no classes but got weight tensor of shape: ",
                options.weight.sizes());
  }

  // Under autocast the GEMMs run in its dtype, as F.linear's would, and the
  // loss comes out in float32, as autocast's cross_entropy gives.
  const c10::DeviceType device_type = input.device().type();
  const bool autocast = at::autocast::is_autocast_available(device_type) &&
                        at::autocast::is_autocast_enabled(device_type);
  at::Tensor x = input;
  at::Tensor w = linear_weight;
  at::Tensor b = bias;
  if (autocast) {
    const at::ScalarType dtype = at::autocast::get_autocast_dtype(device_type);
    x = x.to(dtype);
    w = w.to(dtype);
    if (b.defined()) b = b.to(dtype);
  }
  TORCH_CHECK(x.scalar_type() == w.scalar_type(),
              "expected m1 and m2 to have the same dtype, but got: ",
              gemm_dtype_name(x.scalar_type()), " != ", gemm_dtype_name(w.scalar_type()));
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble ||
                  is_16_bit(x.scalar_type()),
              kName, ": input must be float32, float64, float16 or bfloat16, got ",
              x.scalar_type());
  const at::ScalarType out_dtype = autocast ? at::kFloat : x.scalar_type();
  const at::Tensor rows = x.dim() == 1 ? x.unsqueeze(0) : x;
  const ChunkedPlan plan =
      how ? resolve(*how, rows.size(0), in_features, classes, x.scalar_type(), device_type)
          : default_plan(x.scalar_type(), device_type);
  at::Tensor loss = linear_cross_entropy_chunked(rows, w, b, target.reshape({-1}).to(at::kLong),
                                                 options.weight, options.reduction,
                                                 ignore_index, options.label_smoothing, plan);
  if (reduction == at::Reduction::None) loss = loss.reshape(target.sizes());
  return loss.to(out_dtype);
}

LinearCrossEntropyLossImpl::LinearCrossEntropyLossImpl(const LinearCrossEntropyLossOptions& o)
    : options(o) {
  TORCH_CHECK(!o.weight.defined() || (o.weight.dim() == 1 && o.weight.size(0) == o.num_classes),
              "expected weight shape to be (", o.num_classes, ",), got ",
              o.weight.defined() ? shape_string(o.weight.sizes()) : "()");
  TORCH_CHECK(o.label_smoothing >= 0.0 && o.label_smoothing <= 1.0,
              "expected label_smoothing to be in range [0, 1], got ", o.label_smoothing);
  reset();
}

void LinearCrossEntropyLossImpl::reset() {
  const int64_t outputs = std::accumulate(options.out_features.begin(),
                                          options.out_features.end(), options.num_classes,
                                          std::multiplies<int64_t>());
  linear = register_module(
      "linear",
      torch::nn::Linear(torch::nn::LinearOptions(options.in_features, outputs).bias(options.bias)));
  weight = options.weight.defined() ? register_buffer("weight", options.weight) : at::Tensor();
}

at::Tensor LinearCrossEntropyLossImpl::forward(const at::Tensor& input, const at::Tensor& target) {
  std::vector<int64_t> shape{options.num_classes};
  shape.insert(shape.end(), options.out_features.begin(), options.out_features.end());
  LinearCrossEntropyFuncOptions f;
  f.linear_bias = options.bias ? linear->bias.reshape(shape) : at::Tensor();
  shape.push_back(options.in_features);
  f.weight = weight;
  f.reduction = options.reduction;
  f.ignore_index = options.ignore_index;
  f.label_smoothing = options.label_smoothing;
  f.options = options.options;
  return linear_cross_entropy(input, linear->weight.reshape(shape), target, f);
}

}  // namespace fusetrain::nn

// The autograd Function behind fusetrain::nn::linear_cross_entropy and the
// LinearCrossEntropyLoss module: argument handling (torch's), the autocast
// casts, the reference path, and the two chunked ops.
#include <fusetrain/nn/linear_cross_entropy.h>
#include <fusetrain/ops/linear_cross_entropy.h>

#include <ATen/autocast_mode.h>
#include <torch/autograd.h>
#include <torch/nn/init.h>

#include <cmath>

namespace fusetrain::nn {

namespace {

constexpr const char* kName = "linear_cross_entropy";

at::Reduction::Reduction reduction_enum(const std::string& reduction) {
  if (reduction == "mean") return at::Reduction::Mean;
  if (reduction == "sum") return at::Reduction::Sum;
  if (reduction == "none") return at::Reduction::None;
  TORCH_CHECK_VALUE(false, kName, ": reduction must be \"mean\", \"sum\" or \"none\", got \"",
                    reduction, "\"");
  return at::Reduction::Mean;
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
                            const std::string& reduction, int64_t chunk_rows, bool with_grad) {
    auto [loss, lse, denominator, grad_input, grad_weight, grad_bias] =
        ops::linear_cross_entropy_forward(input, linear_weight, linear_bias, target, weight,
                                          ignore_index, label_smoothing, reduction, chunk_rows,
                                          with_grad);
    ctx->saved_data["with_grad"] = with_grad;
    if (with_grad) {
      // The gradients for a loss gradient of 1: the backward rescales them.
      ctx->saved_data["grad_input"] = grad_input;
      ctx->saved_data["grad_weight"] = grad_weight;
      ctx->saved_data["grad_bias"] = grad_bias;
    } else {
      ctx->save_for_backward({input, linear_weight, linear_bias.value_or(at::Tensor()), target,
                              weight.value_or(at::Tensor()), lse, denominator});
      ctx->saved_data["ignore_index"] = ignore_index;
      ctx->saved_data["label_smoothing"] = label_smoothing;
      ctx->saved_data["reduction"] = reduction;
      ctx->saved_data["chunk_rows"] = chunk_rows;
    }
    return loss;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    // Not twice differentiable: a backward that builds a graph
    // (create_graph=True) would give gradients whose own gradient through
    // this loss is silently zero.
    TORCH_CHECK(!at::GradMode::is_enabled(), kName,
                ": double backward is not supported (the op is once differentiable); "
                "compute the loss with torch::nn::functional::cross_entropy(linear(...)) where "
                "second-order gradients are needed");
    const at::Tensor& grad_loss = grads[0];
    at::Tensor gi, gw, gb;
    if (ctx->saved_data["with_grad"].toBool()) {
      // The gradients computed in the forward are handed over, not copied:
      // rescaled in place and released from the context, so that the
      // weight's gradient (as large as the weight, float32) is not held
      // twice and AccumulateGrad can take it as p.grad without a copy. A
      // second backward through the same graph finds them gone.
      TORCH_CHECK(!ctx->saved_data["grad_input"].isNone(), kName,
                  ": a second backward through the same graph (retain_graph=True) needs "
                  "LinearCrossEntropyOptions::gradients_in_forward = false: the gradients "
                  "computed in the forward were handed to the first backward");
      // needs_input_grad is false for an absent bias (not an input variable).
      const auto scaled = [&](const char* key, int i) {
        at::Tensor g = ctx->saved_data[key].toTensor();
        ctx->saved_data[key] = c10::IValue();
        return ctx->needs_input_grad(i) ? g.mul_(grad_loss.reshape({})) : at::Tensor();
      };
      gi = scaled("grad_input", 0);
      gw = scaled("grad_weight", 1);
      gb = scaled("grad_bias", 2);
    } else {
      const auto saved = ctx->get_saved_variables();
      const auto optional = [](const at::Tensor& t) {
        return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
      };
      const std::array<bool, 3> mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                     ctx->needs_input_grad(2) && saved[2].defined()};
      std::tie(gi, gw, gb) = ops::linear_cross_entropy_backward(
          grad_loss, saved[0], saved[1], optional(saved[2]), saved[3], optional(saved[4]),
          saved[5], saved[6], ctx->saved_data["ignore_index"].toInt(),
          ctx->saved_data["label_smoothing"].toDouble(),
          ctx->saved_data["reduction"].toStringRef(), ctx->saved_data["chunk_rows"].toInt(),
          mask);
      if (!mask[0]) gi = at::Tensor();
      if (!mask[1]) gw = at::Tensor();
      if (!mask[2]) gb = at::Tensor();
    }
    return {gi, gw, gb, {}, {}, {}, {}, {}, {}, {}};
  }
};

}  // namespace

at::Tensor linear_cross_entropy(const at::Tensor& input, const at::Tensor& linear_weight,
                                const at::Tensor& target,
                                const LinearCrossEntropyFuncOptions& options) {
  TORCH_CHECK(input.defined() && linear_weight.defined() && target.defined(), kName,
              ": input, linear_weight and target must be defined");
  const LinearCrossEntropyOptions& how = options.options;
  TORCH_CHECK_VALUE(how.chunking_method == "auto" || how.chunking_method == "none", kName,
                    ": options.chunking_method must be \"auto\" or \"none\", got \"",
                    how.chunking_method, "\"");
  TORCH_CHECK_VALUE(!how.batch_chunk_size.has_value() || *how.batch_chunk_size >= 1, kName,
                    ": options.batch_chunk_size must be at least 1, got ",
                    how.batch_chunk_size.value_or(0));
  const int64_t ignore_index = options.ignore_index.value_or(-100);
  const at::Reduction::Reduction reduction = reduction_enum(options.reduction);
  TORCH_CHECK(!target.is_floating_point(), kName,
              ": the C++ face takes class-index targets; class probabilities go through "
              "torch::nn::functional::cross_entropy(linear(...))");
  TORCH_CHECK(input.dim() >= 1, kName, ": input must have a feature dimension, got a 0-d tensor");
  const auto batch = input.sizes().slice(0, input.dim() - 1);
  TORCH_CHECK(target.sizes() == batch, kName, ": input of shape ", input.sizes(),
              " needs target of shape ", batch, " (its leading dimensions), got ", target.sizes());

  if (how.chunking_method == "none") {
    // The reference: every logit held (autocast applies to both calls).
    const at::Tensor logits = at::linear(input, linear_weight, options.linear_bias);
    if (logits.dim() == 1) {  // one unbatched row, a 0-d target
      return at::cross_entropy_loss(logits, target, options.weight, reduction, ignore_index,
                                    options.label_smoothing);
    }
    const at::Tensor loss =
        at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), target.reshape({-1}),
                               options.weight, reduction, ignore_index, options.label_smoothing);
    return reduction == at::Reduction::None ? loss.reshape(target.sizes()) : loss;
  }

  // Under autocast the GEMMs run in its dtype, as F.linear's would, and the
  // loss comes out in float32, as autocast's cross_entropy gives.
  const c10::DeviceType device_type = input.device().type();
  const bool autocast = at::autocast::is_autocast_available(device_type) &&
                        at::autocast::is_autocast_enabled(device_type);
  at::Tensor x = input;
  at::Tensor w = linear_weight;
  at::Tensor b = options.linear_bias;
  if (autocast) {
    const at::ScalarType dtype = at::autocast::get_autocast_dtype(device_type);
    x = x.to(dtype);
    w = w.to(dtype);
    if (b.defined()) b = b.to(dtype);
  }
  const at::ScalarType out_dtype = autocast ? at::kFloat : x.scalar_type();
  TORCH_CHECK(linear_weight.dim() == 2, kName, ": linear_weight must be 2-D [classes, "
              "in_features], got shape ", linear_weight.sizes());
  const int64_t in_features = linear_weight.size(1);
  TORCH_CHECK(input.size(-1) == in_features, kName, ": input has ", input.size(-1),
              " features (shape ", input.sizes(), ") but linear_weight has shape ",
              linear_weight.sizes());
  const at::Tensor rows = x.reshape({-1, in_features});
  const int64_t chunk_rows = how.batch_chunk_size.value_or(ops::linear_cross_entropy_chunk_rows(
      rows.size(0), in_features, linear_weight.size(0), x.scalar_type(), x.device().type()));
  const std::string reduction_name = options.reduction;
  const bool needs_grad = at::GradMode::is_enabled() &&
                          (x.requires_grad() || w.requires_grad() ||
                           (b.defined() && b.requires_grad()));
  const bool with_grad =
      how.gradients_in_forward && needs_grad && reduction != at::Reduction::None;
  const auto optional = [](const at::Tensor& t) {
    return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
  };
  at::Tensor loss = LinearCrossEntropyFunction::apply(
      rows, w, optional(b), target.reshape({-1}).to(at::kLong), optional(options.weight),
      ignore_index, options.label_smoothing, reduction_name, chunk_rows, with_grad);
  if (reduction == at::Reduction::None) loss = loss.reshape(target.sizes());
  return loss.to(out_dtype);
}

LinearCrossEntropyLossImpl::LinearCrossEntropyLossImpl(const LinearCrossEntropyLossOptions& o)
    : options(o) {
  reset();
}

void LinearCrossEntropyLossImpl::reset() {
  linear = register_module(
      "linear", torch::nn::Linear(torch::nn::LinearOptions(options.in_features, options.num_classes)
                                      .bias(options.bias)));
  weight = options.weight.defined() ? register_buffer("weight", options.weight) : at::Tensor();
}

at::Tensor LinearCrossEntropyLossImpl::forward(const at::Tensor& input, const at::Tensor& target) {
  LinearCrossEntropyFuncOptions f;
  f.linear_bias = options.bias ? linear->bias : at::Tensor();
  f.weight = weight;
  f.reduction = options.reduction;
  f.ignore_index = options.ignore_index;
  f.label_smoothing = options.label_smoothing;
  f.options = options.options;
  return linear_cross_entropy(input, linear->weight, target, f);
}

}  // namespace fusetrain::nn

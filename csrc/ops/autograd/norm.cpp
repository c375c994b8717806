// The autograd of the fused norms (Note [Fused norms] in ../norm.h),
// registered once at the dispatcher's Autograd key: C++, eager Python and
// torch.compile all call torch.ops.fusetrain.layer_norm / rms_norm and get
// the same backward. The forward redispatches below autograd to the device's
// kernel; the backward calls the *_backward op, so under torch.compile both
// land in the traced graph.
#include <fusetrain/ops/norm.h>

#include "optional_inputs.h"

#include <torch/autograd.h>
#include <torch/library.h>

namespace fusetrain::ops {

namespace {

using autograd::maybe;
using autograd::present;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What both norms' backwards share: grads[0] is out's gradient, grads[1]
// residual_out's (either may be undefined: an output nobody used).
struct NormGrads {
  at::Tensor grad_out;
  std::optional<at::Tensor> grad_residual_out;
};

NormGrads norm_grads(const variable_list& grads, bool has_residual) {
  return {grads[0], has_residual ? maybe(grads[1]) : std::nullopt};
}

// The edges of the tensors given (Note [Optional inputs of C++ autograd
// Functions] in optional_inputs.h), numbered in argument order.
struct EdgeIndex {
  int next = 0;
  int of(bool is_given) { return is_given ? next++ : -1; }
};

bool needs(AutogradContext* ctx, int64_t edge) { return edge >= 0 && ctx->needs_input_grad(edge); }

void save_edges(AutogradContext* ctx, const std::optional<at::Tensor>& weight,
                const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual) {
  EdgeIndex e;
  e.of(true);  // input
  ctx->saved_data["weight_edge"] = e.of(weight.has_value());
  ctx->saved_data["bias_edge"] = e.of(bias.has_value());
  ctx->saved_data["residual_edge"] = e.of(residual.has_value());
}

bool needs_saved(AutogradContext* ctx, const char* name) {
  return needs(ctx, ctx->saved_data[name].toInt());
}

class LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input,
                               std::vector<int64_t> normalized_shape,
                               const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, double eps,
                               const std::optional<at::Tensor>& residual,
                               std::optional<at::ScalarType> out_dtype) {
    const at::AutoDispatchBelowADInplaceOrView below;
    auto [out, sum, mean, rstd] =
        layer_norm(input, normalized_shape, weight, bias, eps, residual, out_dtype);
    const bool has_residual = residual.has_value();
    save_edges(ctx, weight, bias, residual);
    ctx->save_for_backward({has_residual ? sum : input, weight.value_or(at::Tensor()),
                            bias.value_or(at::Tensor()), mean, rstd});
    ctx->saved_data["normalized_shape"] = normalized_shape;
    ctx->saved_data["has_residual"] = has_residual;
    ctx->mark_non_differentiable(has_residual ? variable_list{mean, rstd}
                                              : variable_list{sum, mean, rstd});
    return {out, sum, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool has_residual = ctx->saved_data["has_residual"].toBool();
    const auto shape = ctx->saved_data["normalized_shape"].toIntVector();
    const NormGrads g = norm_grads(grads, has_residual);
    const bool want_input = ctx->needs_input_grad(0) || needs_saved(ctx, "residual_edge");
    at::Tensor grad_input, grad_weight, grad_bias;
    if (g.grad_out.defined()) {
      std::tie(grad_input, grad_weight, grad_bias) = layer_norm_backward(
          g.grad_out, g.grad_residual_out, saved[0], shape, maybe(saved[1]), maybe(saved[2]),
          saved[3], saved[4],
          {want_input, needs_saved(ctx, "weight_edge"), needs_saved(ctx, "bias_edge")});
    } else if (g.grad_residual_out.has_value()) {
      grad_input = *g.grad_residual_out;  // only the sum was used
    }
    return {grad_input,  at::Tensor(), grad_weight, grad_bias, at::Tensor(),
            has_residual ? grad_input : at::Tensor(), at::Tensor()};
  }
};

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input,
                               std::vector<int64_t> normalized_shape,
                               const std::optional<at::Tensor>& weight, std::optional<double> eps,
                               const std::optional<at::Tensor>& residual,
                               std::optional<at::ScalarType> out_dtype) {
    const at::AutoDispatchBelowADInplaceOrView below;
    auto [out, sum, rstd] = rms_norm(input, normalized_shape, weight, eps, residual, out_dtype);
    const bool has_residual = residual.has_value();
    save_edges(ctx, weight, std::nullopt, residual);
    ctx->save_for_backward({has_residual ? sum : input, weight.value_or(at::Tensor()), rstd});
    ctx->saved_data["normalized_shape"] = normalized_shape;
    ctx->saved_data["has_residual"] = has_residual;
    ctx->mark_non_differentiable(has_residual ? variable_list{rstd} : variable_list{sum, rstd});
    return {out, sum, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool has_residual = ctx->saved_data["has_residual"].toBool();
    const auto shape = ctx->saved_data["normalized_shape"].toIntVector();
    const NormGrads g = norm_grads(grads, has_residual);
    const bool want_input = ctx->needs_input_grad(0) || needs_saved(ctx, "residual_edge");
    at::Tensor grad_input, grad_weight;
    if (g.grad_out.defined()) {
      std::tie(grad_input, grad_weight) =
          rms_norm_backward(g.grad_out, g.grad_residual_out, saved[0], shape, maybe(saved[1]),
                            saved[2], {want_input, needs_saved(ctx, "weight_edge")});
    } else if (g.grad_residual_out.has_value()) {
      grad_input = *g.grad_residual_out;
    }
    return {grad_input, at::Tensor(), grad_weight, at::Tensor(),
            has_residual ? grad_input : at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_autograd(
    const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    const std::optional<at::Tensor>& residual, std::optional<at::ScalarType> out_dtype) {
  const auto outs = LayerNormFunction::apply(input, normalized_shape.vec(), present(weight),
                                             present(bias), eps, present(residual), out_dtype);
  return {outs[0], outs[1], outs[2], outs[3]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_autograd(
    const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, std::optional<double> eps,
    const std::optional<at::Tensor>& residual, std::optional<at::ScalarType> out_dtype) {
  const auto outs = RmsNormFunction::apply(input, normalized_shape.vec(), present(weight), eps,
                                           present(residual), out_dtype);
  return {outs[0], outs[1], outs[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusetrain, Autograd, m) {
  m.impl("layer_norm", &layer_norm_autograd);
  m.impl("rms_norm", &rms_norm_autograd);
}

}  // namespace fusetrain::ops

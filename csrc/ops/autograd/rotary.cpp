// The autograd of the fused rotary embedding (Note [Fused rotary] in
// ../rotary.h), registered once at the Autograd key: the gradient of a
// rotation is the inverse rotation of the output's gradient, the same op with
// `inverse` flipped. cos and sin get no gradient (they are functions of the
// positions); the in-place rotary_ has no autograd (fusetrain.nn.functional
// refuses it on tensors that require grad).
#include <fusetrain/ops/rotary.h>

#include "optional_inputs.h"

#include <torch/autograd.h>
#include <torch/library.h>

namespace fusetrain::ops {

namespace {

using autograd::present;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class RotaryFunction : public torch::autograd::Function<RotaryFunction> {
 public:
  // Absent tensors as std::nullopt (Note [Optional inputs of C++ autograd
  // Functions] in optional_inputs.h).
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q,
                               const std::optional<at::Tensor>& k, const at::Tensor& cos,
                               const at::Tensor& sin, bool interleaved, bool inverse) {
    const at::AutoDispatchBelowADInplaceOrView below;
    auto [q_out, k_out] = rotary(q, k, cos, sin, interleaved, inverse);
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["inverse"] = inverse;
    ctx->saved_data["has_k"] = k.has_value();
    if (!k.has_value()) ctx->mark_non_differentiable({k_out});
    return {q_out, k_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool has_k = ctx->saved_data["has_k"].toBool();
    const bool interleaved = ctx->saved_data["interleaved"].toBool();
    const bool inverse = !ctx->saved_data["inverse"].toBool();
    at::Tensor grad_q, grad_k;
    const bool with_q = grads[0].defined(), with_k = has_k && grads[1].defined();
    if (with_q || with_k) {
      // The output nobody used has a zero gradient: rotate only the other.
      const at::Tensor first = with_q ? grads[0] : grads[1];
      auto [a, b] = rotary(first, with_q && with_k ? std::optional<at::Tensor>(grads[1])
                                                   : std::nullopt,
                           saved[0], saved[1], interleaved, inverse);
      grad_q = with_q ? a : at::Tensor();
      grad_k = with_k ? (with_q ? b : a) : at::Tensor();
    }
    return {grad_q, grad_k, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> rotary_autograd(const at::Tensor& q,
                                                   const std::optional<at::Tensor>& k,
                                                   const at::Tensor& cos, const at::Tensor& sin,
                                                   bool interleaved, bool inverse) {
  const auto outs = RotaryFunction::apply(q, present(k), cos, sin, interleaved, inverse);
  return {outs[0], outs[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusetrain, Autograd, m) { m.impl("rotary", &rotary_autograd); }

}  // namespace fusetrain::ops

// The autograd of bias + GELU and SwiGLU (Note [Fused activations] in
// ../activation.h), registered once at the dispatcher's Autograd key, as
// autograd/norm.cpp does for the norms.
#include <fusetrain/ops/activation.h>

#include "optional_inputs.h"

#include <torch/autograd.h>
#include <torch/library.h>

#include <string>

namespace fusetrain::ops {

namespace {

using autograd::maybe;
using autograd::present;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class BiasGeluFunction : public torch::autograd::Function<BiasGeluFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const std::optional<at::Tensor>& bias, std::string approximate) {
    const at::AutoDispatchBelowADInplaceOrView below;
    at::Tensor out = bias_gelu(input, bias, approximate);
    ctx->save_for_backward({input, bias.value_or(at::Tensor())});
    ctx->saved_data["approximate"] = approximate;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [grad_input, grad_bias] =
        bias_gelu_backward(grads[0], saved[0], maybe(saved[1]),
                           ctx->saved_data["approximate"].toStringRef(),
                           {ctx->needs_input_grad(0),
                            saved[1].defined() && ctx->needs_input_grad(1)});
    return {grad_input, grad_bias, at::Tensor()};
  }
};

class SwigluFunction : public torch::autograd::Function<SwigluFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a,
                            const std::optional<at::Tensor>& b) {
    const at::AutoDispatchBelowADInplaceOrView below;
    at::Tensor out = swiglu(a, b);
    ctx->save_for_backward({a, b.value_or(at::Tensor())});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [grad_a, grad_b] = swiglu_backward(grads[0], saved[0], maybe(saved[1]));
    return {grad_a, saved[1].defined() ? grad_b : at::Tensor()};
  }
};

at::Tensor bias_gelu_autograd(const at::Tensor& input, const std::optional<at::Tensor>& bias,
                              c10::string_view approximate) {
  return BiasGeluFunction::apply(input, present(bias), std::string(approximate));
}

at::Tensor swiglu_autograd(const at::Tensor& a, const std::optional<at::Tensor>& b) {
  return SwigluFunction::apply(a, present(b));
}

}  // namespace

TORCH_LIBRARY_IMPL(fusetrain, Autograd, m) {
  m.impl("bias_gelu", &bias_gelu_autograd);
  m.impl("swiglu", &swiglu_autograd);
}

}  // namespace fusetrain::ops

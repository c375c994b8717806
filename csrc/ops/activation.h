// C++ entry points of the fused activation ops of a transformer's MLP: bias +
// GELU and SwiGLU (schemas in schemas.cpp). Through the dispatcher: CPU and
// CUDA kernels of ours (cpu/activation_cpu.cpp, cuda/activation_cuda.cpp),
// the ATen composition elsewhere (generic.cpp); autograd at the Autograd key
// (autograd/activation.cpp).
//
// Note [Fused activations]
// Elementwise, fp32 math, one read of each input and one write of each
// output. bias_gelu(x, b) = gelu(x + b) with the sum rounded to x's dtype
// first, as the unfused F.gelu(x + b) rounds it: "none" is x Phi(x) =
// x/2 (1 + erf(x / sqrt 2)), "tanh" x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715
// x^3))), torch's two forms. Its backward recomputes the sum and returns
// grad_input and grad_bias: the fp32 values of grad_input (before their
// rounding to the input's dtype) summed over every dimension but the last,
// in fixed blocks of rows in fp32, then the blocks in order (as Note [Fused
// norms]); the unfused form sums the rounded ones. swiglu(a, b) = silu(a) * b = a sigmoid(a) b, rounded once;
// without b, a's last dimension holds [gate | up] halves, Liger's and
// Llama's fused gate_up projection. Its backward:
//   grad_a = g b sigmoid(a) (1 + a (1 - sigmoid(a))),  grad_b = g silu(a).
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <c10/util/string_view.h>
#include <tuple>

namespace fusetrain::ops {

/// gelu(input + bias) (Note [Fused activations]). input: float32, float16 or
/// bfloat16, any shape; bias: [input.size(-1)], float32 or the input's dtype,
/// or none; approximate: "none" or "tanh". Returns the input's shape and
/// dtype, contiguous.
at::Tensor bias_gelu(const at::Tensor& input, const std::optional<at::Tensor>& bias,
                     c10::string_view approximate);

/// Gradients of bias_gelu: grad_input (the input's dtype) and grad_bias (the
/// bias's dtype), each where output_mask asks.
std::tuple<at::Tensor, at::Tensor> bias_gelu_backward(const at::Tensor& grad_out,
                                                      const at::Tensor& input,
                                                      const std::optional<at::Tensor>& bias,
                                                      c10::string_view approximate,
                                                      std::array<bool, 2> output_mask);

/// silu(a) * b; without b, silu(a[..., :h]) * a[..., h:] with h = a.size(-1) / 2
/// (a's last dimension even). a, b: float32, float16 or bfloat16, one shape
/// and dtype. Returns b's shape (a's with the last dimension halved without
/// b) and dtype, contiguous.
at::Tensor swiglu(const at::Tensor& a, const std::optional<at::Tensor>& b);

/// Gradients of swiglu: (grad_a, grad_b) with b, (grad of the whole a, an
/// empty tensor) without.
std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad_out, const at::Tensor& a,
                                                   const std::optional<at::Tensor>& b);

/// GELU's two forms.
enum class GeluApproximation { kNone, kTanh };

/// "none" or "tanh", else an error naming `op` and the argument.
GeluApproximation parse_gelu_approximation(c10::string_view approximate, const char* op);

/// Argument checks every implementation calls. bias_gelu: returns the width
/// (input's last dimension). swiglu: returns the output's width per row.
int64_t check_bias_gelu_args(const char* op, const at::Tensor& input,
                             const std::optional<at::Tensor>& bias,
                             const at::Tensor* grad_out = nullptr);
int64_t check_swiglu_args(const char* op, const at::Tensor& a, const std::optional<at::Tensor>& b,
                          const at::Tensor* grad_out = nullptr);

}  // namespace fusetrain::ops

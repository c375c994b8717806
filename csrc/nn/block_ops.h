// fusetrain::nn's fused transformer-block functions for LibTorch: layer and
// RMS norm (with the residual add and a second output dtype), bias + GELU
// and SwiGLU. Each is one fusetrain op (ops/norm.h, ops/activation.h) whose
// backward is registered at the dispatcher, so autograd works through them
// as through any ATen op, on every device (CPU and CUDA kernels of ours, the
// ATen composition elsewhere). The same functions as fusetrain.nn.functional.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/modules/normalization.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fusetrain::nn {

/// torch::nn::functional::layer_norm over the last normalized_shape.size()
/// dimensions; weight and bias (normalized_shape, float32 or the input's
/// dtype) may be undefined. `out_dtype`: the output's dtype (default the
/// input's), rounded once from fp32. Input float32, float16 or bfloat16.
at::Tensor layer_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                      const at::Tensor& weight = {}, const at::Tensor& bias = {},
                      double eps = 1e-5, std::optional<at::ScalarType> out_dtype = std::nullopt);

/// torch::nn::functional::rms_norm: eps std::nullopt is the input dtype's
/// machine epsilon.
at::Tensor rms_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                    const at::Tensor& weight = {}, std::optional<double> eps = std::nullopt,
                    std::optional<at::ScalarType> out_dtype = std::nullopt);

/// {layer_norm(s), s} with s = input + residual (the input's dtype), one pass
/// each way: a pre-norm block's residual add and norm. Both carry gradients.
std::pair<at::Tensor, at::Tensor> add_layer_norm(
    const at::Tensor& input, const at::Tensor& residual, at::IntArrayRef normalized_shape,
    const at::Tensor& weight = {}, const at::Tensor& bias = {}, double eps = 1e-5,
    std::optional<at::ScalarType> out_dtype = std::nullopt);

/// {rms_norm(s), s} with s = input + residual.
std::pair<at::Tensor, at::Tensor> add_rms_norm(
    const at::Tensor& input, const at::Tensor& residual, at::IntArrayRef normalized_shape,
    const at::Tensor& weight = {}, std::optional<double> eps = std::nullopt,
    std::optional<at::ScalarType> out_dtype = std::nullopt);

/// What `ln->forward(input)` gives, through layer_norm above.
at::Tensor layer_norm(torch::nn::LayerNormImpl& ln, const at::Tensor& input);

/// gelu(input + bias) ("none": x Phi(x); "tanh": torch's tanh form); bias
/// ([input.size(-1)]) may be undefined.
at::Tensor gelu(const at::Tensor& input, const std::string& approximate = "none",
                const at::Tensor& bias = {});

/// silu(a) * b; with b undefined, silu(a[..., :h]) * a[..., h:].
at::Tensor swiglu(const at::Tensor& a, const at::Tensor& b = {});

/// Rotary position embedding of q and k ([..., head_dim]; k may be
/// undefined) by cos / sin ([..., rotary_dim / 2], broadcastable to the rows;
/// Hugging Face's [..., head_dim] tables are taken as they are): pairs
/// (x[j], x[j + rotary_dim/2]), or (x[2j], x[2j+1]) with `interleaved`.
/// Returns the rotated copies, differentiable (Note [Fused rotary]).
std::pair<at::Tensor, at::Tensor> apply_rotary(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& cos, const at::Tensor& sin,
                                               bool interleaved = false);

}  // namespace fusetrain::nn

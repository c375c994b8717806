// fusetrain::nn::batch_norm_relu: batch normalisation followed by a ReLU in
// one fused op on the CPU (ops/batch_norm.h), autograd-aware; torch's own
// ops on other devices. For CNNs built of conv + batch norm + ReLU, where on
// a CPU the two memory-bound layers cost as much as the convolutions.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/modules/batchnorm.h>

namespace fusetrain::nn {

/// relu(torch::nn::functional::batch_norm(input, running_mean, running_var,
/// weight, bias, training, momentum, eps)), or without the ReLU when `relu`
/// is false; the same arguments and semantics (input [N, C, *], statistics
/// over every dimension but 1; in training the batch's mean and biased
/// variance normalise and the running statistics, where defined, move by
/// `momentum` towards the batch's mean and unbiased variance). On the CPU,
/// for float32, float16 and bfloat16 inputs in any memory format (weight and
/// statistics float32 or the input's dtype), one fused op forward and one
/// backward, fp32 math; the output keeps the input's memory format. Any
/// tensor but `input` may be undefined.
at::Tensor batch_norm_relu(const at::Tensor& input, const at::Tensor& running_mean,
                           const at::Tensor& running_var, const at::Tensor& weight,
                           const at::Tensor& bias, bool training, double momentum, double eps,
                           bool relu = true);

/// What `bn->forward(input)` then a ReLU give, through the function above:
/// the module's parameters, buffers and options, num_batches_tracked counted
/// as torch::nn::BatchNorm2d counts it (momentum std::nullopt: the
/// cumulative average), and its training flag.
at::Tensor batch_norm_relu(torch::nn::BatchNorm2dImpl& bn, const at::Tensor& input,
                           bool relu = true);

}  // namespace fusetrain::nn

// fusetrain::nn::max_pool2d: max pooling over non-overlapping windows (the
// 2x2 pooling of most CNNs) through the window ops on the CPU (ops/max_pool.h,
// Note [Window max pool]), autograd-aware; torch's max_pool2d everywhere else.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/modules/pooling.h>

namespace fusetrain::nn {

/// torch::nn::functional::max_pool2d(input, kernel_size) (stride = kernel,
/// no padding, no dilation, floor mode): the same values and gradients, bit
/// for bit. On the CPU, for 4-D float32, float16 and bfloat16 inputs in
/// channels_last (the output keeps it), or contiguous NCHW with 2x2 windows,
/// one pass forward that writes the output and a byte per window, one pass
/// backward that writes the input gradient; anything else is
/// at::max_pool2d. Not twice differentiable on the CPU path.
at::Tensor max_pool2d(const at::Tensor& input, at::IntArrayRef kernel_size);

/// What `pool->forward(input)` gives, through the function above where the
/// module's windows do not overlap (stride equal to the kernel or unset, no
/// padding, dilation 1, floor mode), else the module itself.
at::Tensor max_pool2d(torch::nn::MaxPool2dImpl& pool, const at::Tensor& input);

}  // namespace fusetrain::nn

// C++ entry points of the max pooling ops over non-overlapping windows (the
// 2x2 pooling of most CNNs). They call through the dispatcher, so one call
// serves every device: the CPU has kernels of ours (Note [Window max pool] in
// cpu/max_pool_cpu.cpp), other backends the ATen composition (generic.cpp). The
// autograd-aware function built on them is fusetrain::nn::max_pool2d.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <tuple>

namespace fusetrain::ops {

/// torch.nn.functional.max_pool2d(input, kernel_size) with stride equal to
/// the kernel, no padding, no dilation and floor mode: each output element is
/// the maximum of one kh x kw window of `input` [N, C, H, W] (float32,
/// float16 or bfloat16, any memory format), the first maximum where several
/// are equal and the last NaN where there are NaNs, as torch picks them.
/// Returns
///   - out [N, C, H / kh, W / kw]: the input's dtype and memory format;
///   - argmax: uint8, out's shape and layout, the position of each maximum in
///     its window, row-major (i * kw + j): what the backward takes instead of
///     torch's int64 flat indices (1 byte an element instead of 8).
std::tuple<at::Tensor, at::Tensor> max_pool2d(const at::Tensor& input, at::IntArrayRef kernel_size);

/// The gradient of max_pool2d with respect to `input`: each window's
/// gradient at its argmax position and zero elsewhere (rows and columns past
/// the last whole window included), in the input's dtype and memory format.
/// `input` gives the shape and layout only.
at::Tensor max_pool2d_backward(const at::Tensor& grad_out, const at::Tensor& input,
                               const at::Tensor& argmax, at::IntArrayRef kernel_size);

/// The window's height and width: kernel_size holds one size for both, or
/// two (check_max_pool2d_args checks that it does).
inline std::array<int64_t, 2> max_pool2d_window(at::IntArrayRef kernel_size) {
  return {kernel_size[0], kernel_size.size() == 2 ? kernel_size[1] : kernel_size[0]};
}

/// The output's height and width, validating the forward's arguments (shared
/// by every implementation).
std::array<int64_t, 2> check_max_pool2d_args(const at::Tensor& input, at::IntArrayRef kernel_size);

/// Validates the backward's arguments.
void check_max_pool2d_backward_args(const at::Tensor& grad_out, const at::Tensor& input,
                                    const at::Tensor& argmax, at::IntArrayRef kernel_size);

}  // namespace fusetrain::ops

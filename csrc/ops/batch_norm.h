// C++ entry points of the fused batch normalisation (+ ReLU) ops. They call
// through the dispatcher, so one call serves every device: the CPU has
// kernels of ours (Note [Batch norm CPU passes] in cpu/batch_norm_cpu.cpp), other
// backends the ATen composition (generic.cpp). The autograd-aware function
// built on them is fusetrain::nn::batch_norm_relu.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <tuple>

namespace fusetrain::ops {

/// Batch normalisation of `input` [N, C, *] (float32, float16 or bfloat16, any
/// memory format) over every dimension but 1, then max(0, y) when `relu`:
///   y = (x - mean_c) * invstd_c * weight_c + bias_c,
/// with fp32 math. In training the batch's mean and biased variance are used,
/// invstd = 1 / sqrt(var + eps), and the running statistics (when given) move
/// by `momentum` towards the batch's mean and unbiased variance, as
/// torch.nn.functional.batch_norm does; in evaluation the running statistics
/// are used. `weight`, `bias`, `running_mean`, `running_var`: [C], float32 or
/// the input's dtype; weight 1 and bias 0 where absent. Returns
///   - out: the input's dtype, shape and memory format;
///   - save_mean, save_invstd: float32 [C], the statistics used (the batch's
///     in training, the running ones in evaluation), which the backward takes.
std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_relu(
    const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, bool training, double momentum, double eps,
    bool relu);

/// Gradients of batch_norm_relu with respect to input, weight and bias (each
/// computed where `output_mask` asks for it, else undefined). `output` is the
/// forward's `out` (required with `relu`: the ReLU stops the gradient where
/// out <= 0, as torch's threshold_backward does; a NaN output passes it); `save_mean` and
/// `save_invstd` the forward's. With `training` the gradient flows through
/// the batch statistics; without, they are constants. Weight and bias
/// gradients are float32, or the weight's dtype.
std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_relu_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const std::optional<at::Tensor>& output,
    const std::optional<at::Tensor>& weight, const at::Tensor& save_mean,
    const at::Tensor& save_invstd, bool training, bool relu, std::array<bool, 3> output_mask);

/// Validates the forward's arguments (shared by every implementation).
void check_batch_norm_forward_args(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                                   const std::optional<at::Tensor>& bias,
                                   const std::optional<at::Tensor>& running_mean,
                                   const std::optional<at::Tensor>& running_var, bool training);

/// Validates the backward's arguments.
void check_batch_norm_backward_args(const at::Tensor& grad_out, const at::Tensor& input,
                                    const std::optional<at::Tensor>& output,
                                    const std::optional<at::Tensor>& weight,
                                    const at::Tensor& save_mean, const at::Tensor& save_invstd,
                                    bool relu);

}  // namespace fusetrain::ops

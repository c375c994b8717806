// The device-generic implementations of fusetrain's ops: ATen operations
// only, so they run wherever torch runs (a TPU through torch_tpu, XPU, MPS,
// any PrivateUse1 backend). Semantics are the ops' own (csrc/ops/schemas.cpp).
//
// Note [Device-generic ops]
// Every op has a CPU and a CUDA kernel; a backend with neither would fail
// with "no kernel for this backend". So each op also registers the functions
// below under CompositeExplicitAutograd. The dispatcher uses a backend's own
// kernel when there is one and this key's otherwise: CPU, CUDA and Meta keep
// theirs, every other backend (PrivateUse1, XPU, MPS, HPU...) gets these.
// CompositeImplicitAutograd would not do: its kernels also fill the Autograd
// keys, so they would shadow the CPU and CUDA kernels; a PrivateUse1-only
// registration would leave XPU and MPS out.
//
// The same contracts hold: nothing reads a device value on the host (no
// host sync: found_inf, the scale, lr_tensor and the step counts stay on the
// device, a skipped step is a `where`), and no op allocates with a size that
// depends on data. The cost is memory traffic: each ATen op is one pass, so a
// step reads and writes its tensors several times where a fused kernel does
// it once, and float32 copies of 16-bit tensors are temporaries.
//
// Arithmetic: the CPU kernels' scalar loops (adam_span, sgd_span), operation
// by operation in float32 with the same rounding of every scalar, so on the
// CPU the optimizers and the loss-scale ops give the scalar path's bits (the
// vector paths differ from it by FMA contractions, Note [Vector Adam]); the
// one exception is sqrt, which torch's CPU kernel does not round correctly,
// so Adam's goes through float64 on the CPU (sqrt_rounded), and float64
// parameters, whose sqrt has nothing wider (an ulp of it apart). Step
// -dependent scalars (bias corrections) are formed on the device in float64
// where the backend has it (CPU, CUDA, XPU), else in float32. The L2 norm
// accumulates in float64 where available (float32 elsewhere) and
// cross-entropy in float32 (the CPU kernel uses float64): those agree with
// the CPU kernels within their summation error. An out-of-range target,
// which the CPU kernel reports as an error, cannot be checked without a host
// sync here: its row's loss and gradient are NaN.
//
// On the CPU these run when FUSETRAIN_CPU_PATH=generic (Note [CPU paths]),
// which is how the tests check them against the CPU kernels.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <string_view>
#include <tuple>

namespace fusetrain::ops::generic {

void non_finite_check_and_unscale_(at::TensorList self, at::Tensor& found_inf,
                                   const at::Tensor& inv_scale);

at::Tensor& update_scale_(at::Tensor& scale, at::Tensor& growth_tracker,
                          at::Tensor& overflow_tracker, const at::Tensor& found_inf,
                          double growth_factor, double backoff_factor, int64_t growth_interval,
                          double max_scale, int64_t hysteresis);

void fused_adamw_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                  at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                  at::TensorList master_params, at::TensorList state_steps, double lr, double beta1,
                  double beta2, double weight_decay, double eps, bool amsgrad, bool maximize,
                  bool decoupled_weight_decay, const std::optional<at::Tensor>& grad_scale,
                  const std::optional<at::Tensor>& found_inf,
                  const std::optional<at::Tensor>& lr_tensor);

void fused_sgd_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                at::TensorList master_params, double lr, double momentum, double dampening,
                double weight_decay, bool nesterov, bool maximize, bool is_first_step,
                const std::optional<at::Tensor>& grad_scale,
                const std::optional<at::Tensor>& found_inf,
                const std::optional<at::Tensor>& lr_tensor);

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(at::TensorList tensors, bool per_tensor);

std::tuple<at::Tensor, at::Tensor, at::Tensor> softmax_cross_entropy_forward(
    const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index,
    double label_smoothing, c10::string_view reduction);

at::Tensor softmax_cross_entropy_backward(const at::Tensor& grad_loss, const at::Tensor& logits,
                                          const at::Tensor& target, const at::Tensor& lse,
                                          int64_t ignore_index, double label_smoothing,
                                          c10::string_view reduction,
                                          const std::optional<at::Tensor>& kept_rows);

// The gradient computed out of place, then copied into `out` (which may be
// the logits).
at::Tensor& softmax_cross_entropy_backward_out(const at::Tensor& grad_loss,
                                               const at::Tensor& logits, const at::Tensor& target,
                                               const at::Tensor& lse, int64_t ignore_index,
                                               double label_smoothing, c10::string_view reduction,
                                               const std::optional<at::Tensor>& kept_rows,
                                               at::Tensor& out);

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_relu(
    const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, bool training, double momentum, double eps,
    bool relu);

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_relu_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const std::optional<at::Tensor>& output,
    const std::optional<at::Tensor>& weight, const at::Tensor& save_mean,
    const at::Tensor& save_invstd, bool training, bool relu, std::array<bool, 3> output_mask);

std::tuple<at::Tensor, at::Tensor> max_pool2d(const at::Tensor& input, at::IntArrayRef kernel_size);

at::Tensor max_pool2d_backward(const at::Tensor& grad_out, const at::Tensor& input,
                               const at::Tensor& argmax, at::IntArrayRef kernel_size);

// The fused transformer-block ops (generic_transformer.cpp).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm(
    const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    const std::optional<at::Tensor>& residual, std::optional<at::ScalarType> out_dtype);

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_residual_out,
    const at::Tensor& normed, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& mean, const at::Tensor& rstd, std::array<bool, 3> output_mask);

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm(
    const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, std::optional<double> eps,
    const std::optional<at::Tensor>& residual, std::optional<at::ScalarType> out_dtype);

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_residual_out,
    const at::Tensor& normed, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const at::Tensor& rstd,
    std::array<bool, 2> output_mask);

at::Tensor bias_gelu(const at::Tensor& input, const std::optional<at::Tensor>& bias,
                     c10::string_view approximate);

std::tuple<at::Tensor, at::Tensor> bias_gelu_backward(const at::Tensor& grad_out,
                                                      const at::Tensor& input,
                                                      const std::optional<at::Tensor>& bias,
                                                      c10::string_view approximate,
                                                      std::array<bool, 2> output_mask);

at::Tensor swiglu(const at::Tensor& a, const std::optional<at::Tensor>& b);

std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad_out, const at::Tensor& a,
                                                   const std::optional<at::Tensor>& b);

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const std::optional<at::Tensor>& k,
                                          const at::Tensor& cos, const at::Tensor& sin,
                                          bool interleaved, bool inverse);

void rotary_(at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& cos,
             const at::Tensor& sin, bool interleaved, bool inverse);

}  // namespace fusetrain::ops::generic

// The operator contract: every fusetrain op's schema, in one place. CPU,
// CUDA and Meta implementations register separately, next to their code.
#include <torch/library.h>

TORCH_LIBRARY(fusetrain, m) {
  // Multiplies every element of `self` by `inv_scale` (unless it is 1) and sets
  // `found_inf` to 1 if any element is inf or NaN. The caller zeroes found_inf.
  m.def(
      "non_finite_check_and_unscale_(Tensor(a!)[] self, Tensor(b!) found_inf, "
      "Tensor inv_scale) -> ()");
  // Dynamic loss-scale update, torch's growth/backoff rule plus a growth cap
  // (`max_scale`) and `hysteresis` (overflows tolerated before backing off).
  m.def(
      "update_scale_(Tensor(a!) self, Tensor(b!) growth_tracker, Tensor(c!) overflow_tracker, "
      "Tensor found_inf, float growth_factor, float backoff_factor, int growth_interval, "
      "float max_scale, int hysteresis) -> Tensor(a!)");

  // Adam / AdamW over many tensors in one pass. Empty `max_exp_avg_sqs` unless
  // amsgrad; empty `master_params` unless the params are a low-precision copy of
  // fp32 masters (then m, v and the update are fp32 and params get the rounded
  // master). `grad_scale` divides the gradients in the kernel, which writes
  // the quotients back to `grads` (torch's fused optimizers leave p.grad
  // unscaled too); a non-zero `found_inf` makes the op a no-op, step counts
  // and gradients included. Step counts are
  // one-element float32 tensors, incremented here. `lr_tensor` (a one-element
  // float32/float64 tensor on the params' device) replaces `lr` when given: the
  // kernel reads it, so a CUDA graph follows a schedule written into it.
  m.def(
      "fused_adamw_(Tensor(a!)[] params, Tensor(g!)[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] master_params, "
      "Tensor(f!)[] state_steps, *, float lr, float beta1, float beta2, float weight_decay, "
      "float eps, bool amsgrad, bool maximize, bool decoupled_weight_decay, "
      "Tensor? grad_scale=None, Tensor? found_inf=None, Tensor? lr_tensor=None) -> ()");
  // SGD with momentum, dampening, nesterov, weight decay, optional fp32
  // masters, `grad_scale` / `found_inf` / `lr_tensor` as above. `is_first_step` initialises
  // the momentum buffers to the first gradient, as torch.optim.SGD does.
  m.def(
      "fused_sgd_(Tensor(a!)[] params, Tensor(d!)[] grads, Tensor(b!)[] momentum_buffers, "
      "Tensor(c!)[] master_params, *, float lr, float momentum, float dampening, "
      "float weight_decay, bool nesterov, bool maximize, bool is_first_step, "
      "Tensor? grad_scale=None, Tensor? found_inf=None, Tensor? lr_tensor=None) -> ()");
  // L2 norms with fp32 (CPU: fp64) accumulation: the total over all tensors
  // (0-d float32) and, when per_tensor, each tensor's ([n] float32; else empty).
  m.def("multi_tensor_l2norm(Tensor[] tensors, bool per_tensor=False) -> (Tensor, Tensor)");

  // Softmax cross-entropy over [N, C] logits (fp32/fp16/bf16) with int64
  // targets, fp32 accumulation. Returns the loss (fp32; shape [N] for
  // reduction "none", else 0-d), the per-row log-sum-exp the backward reuses
  // and the count of rows not ignored (fp32, 0-d; empty for "none").
  m.def(
      "softmax_cross_entropy_forward(Tensor logits, Tensor target, int ignore_index, "
      "float label_smoothing, str reduction) -> (Tensor loss, Tensor lse, Tensor kept_rows)");
  // Gradient of the above with respect to the logits, in the logits' dtype;
  // "mean" divides by kept_rows, the forward's count, when given (else counts).
  m.def(
      "softmax_cross_entropy_backward(Tensor grad_loss, Tensor logits, Tensor target, "
      "Tensor lse, int ignore_index, float label_smoothing, str reduction, "
      "Tensor? kept_rows=None) -> Tensor");
  // The same into `out` ([N, C], the logits' dtype), which may be the logits
  // themselves: each element is read before its gradient overwrites it (the
  // chunked linear cross-entropy's logits become their gradient in place).
  m.def(
      "softmax_cross_entropy_backward.out(Tensor grad_loss, Tensor logits, Tensor target, "
      "Tensor lse, int ignore_index, float label_smoothing, str reduction, "
      "Tensor? kept_rows=None, *, Tensor(a!) out) -> Tensor(a!)");

  // Chunked linear + cross-entropy (Note [Chunked linear cross-entropy] in
  // csrc/ops/linear_cross_entropy.cpp): the loss of cross_entropy(input @
  // linear_weight^T + linear_bias, target) over chunks of chunk_rows rows,
  // never holding more than one chunk's logits. The forward returns the loss,
  // each row's log-sum-exp, what "mean" divides by and the gradients
  // grad_mask asks for, which times grad_scale are those of a loss gradient
  // of 1 (empty tensors for the others); the backward recomputes each
  // chunk's logits. accurate: 16-bit linears computed in float32 (ops/
  // linear_cross_entropy.h).
  m.def(
      "linear_cross_entropy_forward(Tensor input, Tensor linear_weight, Tensor? linear_bias, "
      "Tensor target, Tensor? weight, int ignore_index, float label_smoothing, str reduction, "
      "int chunk_rows, bool[3] grad_mask, bool accurate) -> (Tensor loss, Tensor lse, "
      "Tensor denominator, Tensor grad_input, Tensor grad_weight, Tensor grad_bias, "
      "Tensor grad_scale)");
  m.def(
      "linear_cross_entropy_backward(Tensor grad_loss, Tensor input, Tensor linear_weight, "
      "Tensor? linear_bias, Tensor target, Tensor? weight, Tensor lse, Tensor denominator, "
      "int ignore_index, float label_smoothing, str reduction, int chunk_rows, "
      "bool[3] output_mask, bool accurate) -> (Tensor grad_input, Tensor grad_weight, "
      "Tensor grad_bias)");

  // Max pooling over non-overlapping windows (stride = kernel_size, no
  // padding, floor mode) of [N, C, H, W]: out (the input's dtype and memory
  // format) and each maximum's position in its window, row-major, as uint8
  // (ops/max_pool.h).
  m.def("max_pool2d(Tensor input, int[2] kernel_size) -> (Tensor out, Tensor argmax)");
  // Its gradient with respect to the input; `input` gives shape and layout.
  m.def(
      "max_pool2d_backward(Tensor grad_out, Tensor input, Tensor argmax, int[2] kernel_size) "
      "-> Tensor");

  // Batch normalisation over every dimension but 1, then max(0, y) when
  // `relu`, fp32 math; running statistics (when given) updated in training.
  // Returns out (the input's dtype and memory format) and the float32 [C]
  // mean and invstd used, which the backward takes (ops/batch_norm.h).
  m.def(
      "batch_norm_relu(Tensor input, Tensor? weight, Tensor? bias, Tensor(a!)? running_mean, "
      "Tensor(b!)? running_var, bool training, float momentum, float eps, bool relu) "
      "-> (Tensor out, Tensor save_mean, Tensor save_invstd)");
  // Gradients of the above with respect to input, weight and bias, where
  // output_mask asks; `output` (the forward's out) is the ReLU's mask.
  m.def(
      "batch_norm_relu_backward(Tensor grad_out, Tensor input, Tensor? output, Tensor? weight, "
      "Tensor save_mean, Tensor save_invstd, bool training, bool relu, bool[3] output_mask) "
      "-> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");

  // Float8 quantisation with a per-tensor scale, Note [Float8 scaling]
  // (csrc/kernels/fp8_scaling.h): `dtype` is float8_e4m3fn or float8_e5m2;
  // finite values saturate, inf/NaN stay non-finite. Current scaling sets
  // `amax` to max|self| and `scale` from it; delayed scaling sets `scale` from
  // the history's largest finite amax, then shifts the history and records
  // max|self| first. Both return self * scale in `dtype`; no host sync.
  m.def(
      "fp8_quantize_current(Tensor self, ScalarType dtype, Tensor(a!) scale, Tensor(b!) amax, "
      "int margin=0) -> Tensor");
  m.def(
      "fp8_quantize_delayed(Tensor self, ScalarType dtype, Tensor(a!) scale, "
      "Tensor(b!) amax_history, int margin=0) -> Tensor");
  // The same for a matrix, also returning its transpose [cols, rows rounded
  // up to row_multiple] with zero columns past rows (Note [Float8 cast +
  // transpose]): the layouts the float8 backward's GEMMs take, in one pass.
  m.def(
      "fp8_quantize_current_transpose(Tensor self, ScalarType dtype, Tensor(a!) scale, "
      "Tensor(b!) amax, int margin=0, int row_multiple=1) -> (Tensor, Tensor)");
  m.def(
      "fp8_quantize_delayed_transpose(Tensor self, ScalarType dtype, Tensor(a!) scale, "
      "Tensor(b!) amax_history, int margin=0, int row_multiple=1) -> (Tensor, Tensor)");

  // Layer / RMS normalisation over the last dimensions, optionally of
  // input + residual, with the output in a second dtype (Note [Fused norms],
  // ops/norm.h). residual_out is input + residual (empty without one); the
  // float32 statistics are what the backwards take.
  m.def(
      "layer_norm(Tensor input, int[] normalized_shape, Tensor? weight=None, "
      "Tensor? bias=None, float eps=1e-05, Tensor? residual=None, ScalarType? out_dtype=None) "
      "-> (Tensor out, Tensor residual_out, Tensor mean, Tensor rstd)");
  m.def(
      "layer_norm_backward(Tensor grad_out, Tensor? grad_residual_out, Tensor normed, "
      "int[] normalized_shape, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd, "
      "bool[3] output_mask) -> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
  m.def(
      "rms_norm(Tensor input, int[] normalized_shape, Tensor? weight=None, float? eps=None, "
      "Tensor? residual=None, ScalarType? out_dtype=None) "
      "-> (Tensor out, Tensor residual_out, Tensor rstd)");
  m.def(
      "rms_norm_backward(Tensor grad_out, Tensor? grad_residual_out, Tensor normed, "
      "int[] normalized_shape, Tensor? weight, Tensor rstd, bool[2] output_mask) "
      "-> (Tensor grad_input, Tensor grad_weight)");

  // gelu(input + bias) and silu(a) * b (Note [Fused activations],
  // ops/activation.h), fp32 math, and their gradients.
  m.def("bias_gelu(Tensor input, Tensor? bias=None, str approximate='none') -> Tensor");
  m.def(
      "bias_gelu_backward(Tensor grad_out, Tensor input, Tensor? bias, str approximate, "
      "bool[2] output_mask) -> (Tensor grad_input, Tensor grad_bias)");
  m.def("swiglu(Tensor a, Tensor? b=None) -> Tensor");
  m.def("swiglu_backward(Tensor grad_out, Tensor a, Tensor? b) -> (Tensor grad_a, Tensor grad_b)");

  // Rotary position embedding of q and k (Note [Fused rotary], ops/rotary.h):
  // rotated copies, or in place; `inverse` rotates back (the gradient).
  m.def(
      "rotary(Tensor q, Tensor? k, Tensor cos, Tensor sin, bool interleaved=False, "
      "bool inverse=False) -> (Tensor q_out, Tensor k_out)");
  m.def(
      "rotary_(Tensor(a!) q, Tensor(b!)? k, Tensor cos, Tensor sin, bool interleaved=False, "
      "bool inverse=False) -> ()");
}

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

  // Softmax cross-entropy over [N, C] logits (fp32/fp16/bf16) with int64
  // targets, fp32 accumulation. Returns the loss (fp32; shape [N] for
  // reduction "none", else 0-d) and the per-row log-sum-exp the backward reuses.
  m.def(
      "softmax_cross_entropy_forward(Tensor logits, Tensor target, int ignore_index, "
      "float label_smoothing, str reduction) -> (Tensor loss, Tensor lse)");
  // Gradient of the above with respect to the logits, in the logits' dtype.
  m.def(
      "softmax_cross_entropy_backward(Tensor grad_loss, Tensor logits, Tensor target, "
      "Tensor lse, int ignore_index, float label_smoothing, str reduction) -> Tensor");
}

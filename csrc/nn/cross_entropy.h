// fusetrain::nn::softmax_cross_entropy: the autograd-aware C++ face of the
// fused softmax cross-entropy ops, a drop-in for
// torch::nn::functional::cross_entropy with class-index targets.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

namespace fusetrain::nn {

/// Options of softmax_cross_entropy, torch's names and defaults.
struct SoftmaxCrossEntropyOptions {
  /// Rows whose target equals this contribute no loss and no gradient, and
  /// do not count towards the "mean".
  int64_t ignore_index = -100;
  /// "mean" (over the rows not ignored), "sum" or "none" (one loss per row).
  std::string reduction = "mean";
  /// In [0, 1]: the target distribution puts 1 - label_smoothing on the
  /// target class and spreads label_smoothing evenly over all classes.
  double label_smoothing = 0.0;
};

/// Cross-entropy of softmax(logits) against class indices, with torch's
/// semantics (F.cross_entropy without class weights). `logits` is [N, C]
/// float32, float16 or bfloat16; `target` is int64 [N]. The loss is float32
/// whatever the logits' dtype (torch returns the logits' dtype); the gradient
/// flowing back to `logits` has their dtype. Computed in fp32 in one pass
/// over the logits each way, without an fp32 [N, C] buffer; only the [N]
/// log-sum-exp is kept for the backward. Twice-differentiable it is not.
at::Tensor softmax_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                 const SoftmaxCrossEntropyOptions& options = {});

}  // namespace fusetrain::nn

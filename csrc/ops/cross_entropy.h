// C++ entry points of the fused softmax cross-entropy ops. They call through
// the dispatcher, so one call serves CPU and CUDA tensors alike. The
// autograd-aware function built on them is fusetrain::nn::softmax_cross_entropy.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>

namespace fusetrain::ops {

/// Reductions of the loss, torch's names.
enum class Reduction { kNone, kMean, kSum };

/// Parses "none" / "mean" / "sum"; anything else is an error naming `op`.
Reduction parse_reduction(const std::string& reduction, const char* op);

/// Softmax cross-entropy of `logits` [N, C] (float32, float16 or bfloat16)
/// against int64 class indices `target` [N], computed in fp32 without an fp32
/// copy of the logits. Per row i with t = target[i]:
///   loss_i = (1 - ls) * (lse_i - x_it) + ls * (lse_i - mean_j x_ij)
/// (torch's label smoothing), and 0 where t == ignore_index. Returns
///   - loss: float32, [N] for "none", else 0-d: the sum, or the sum divided by
///     the number of non-ignored rows for "mean" (NaN when every row is
///     ignored, as torch gives);
///   - lse: float32 [N], each row's log-sum-exp, which the backward reuses;
///   - kept_rows: float32 0-d, the number of rows whose target is not
///     ignore_index, which the backward of "mean" divides by (empty for
///     "none"; on CUDA counted in the pass that sums the loss).
/// A target outside [0, C) that is not ignore_index is an error naming the
/// row (on CUDA a device-side assert, as in torch's nll_loss).
std::tuple<at::Tensor, at::Tensor, at::Tensor> softmax_cross_entropy_forward(const at::Tensor& logits,
                                                                 const at::Tensor& target,
                                                                 int64_t ignore_index,
                                                                 double label_smoothing,
                                                                 const std::string& reduction);

/// Gradient of the forward's loss with respect to `logits`, in the logits'
/// dtype: grad_ij = g_i * (softmax_ij - ls / C - (1 - ls) * [j == t_i]), zero
/// on ignored rows, where g_i is grad_loss[i] ("none"), grad_loss ("sum") or
/// grad_loss / (non-ignored rows) ("mean"): the forward's `kept_rows` when
/// given, else counted again (on CUDA one more launch). The softmax is
/// recomputed from the logits and the saved `lse`; nothing of size [N, C] is
/// stored between passes.
at::Tensor softmax_cross_entropy_backward(const at::Tensor& grad_loss, const at::Tensor& logits,
                                          const at::Tensor& target, const at::Tensor& lse,
                                          int64_t ignore_index, double label_smoothing,
                                          const std::string& reduction,
                                          const std::optional<at::Tensor>& kept_rows = {});

/// softmax_cross_entropy_backward into `out`: [N, C] in the logits' dtype, on
/// their device, contiguous. `out` may be `logits` itself, whose elements are
/// then each read before their gradient replaces them (no [N, C] buffer
/// besides the logits); any other overlap with the logits is an error.
at::Tensor& softmax_cross_entropy_backward_out(const at::Tensor& grad_loss,
                                               const at::Tensor& logits, const at::Tensor& target,
                                               const at::Tensor& lse, int64_t ignore_index,
                                               double label_smoothing,
                                               const std::string& reduction,
                                               const std::optional<at::Tensor>& kept_rows,
                                               at::Tensor& out);

/// Validates the forward's arguments (shared by the CPU, CUDA and Meta kernels).
void check_cross_entropy_forward_args(const at::Tensor& logits, const at::Tensor& target,
                                      double label_smoothing, const std::string& reduction);

/// `logits` itself when each row is contiguous (any row stride), else a
/// contiguous copy: the kernels walk rows as spans.
at::Tensor with_contiguous_rows(const at::Tensor& logits);

/// Validates the backward's arguments.
void check_cross_entropy_backward_args(const at::Tensor& grad_loss, const at::Tensor& logits,
                                       const at::Tensor& target, const at::Tensor& lse,
                                       double label_smoothing, const std::string& reduction,
                                       const std::optional<at::Tensor>& kept_rows);

/// Validates the backward's `out` (shape, dtype, device, layout, and overlap
/// with the logits: none, or the very same elements).
void check_cross_entropy_backward_out(const at::Tensor& logits, const at::Tensor& out);

/// The forward's kept_rows output for `reduction`: `count` as a float32 0-d
/// tensor, or an empty one for "none".
at::Tensor kept_rows_output(const at::Tensor& count, Reduction reduction);

}  // namespace fusetrain::ops

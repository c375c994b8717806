// fusetrain::nn::linear_cross_entropy and LinearCrossEntropyLoss: a
// language-model head's linear layer and its cross-entropy in one, over
// chunks of rows, never holding the [rows, classes] logits (Note [Chunked
// linear cross-entropy] in csrc/ops/linear_cross_entropy.cpp). The names,
// defaults and semantics are those of torch 2.13's
// torch.nn.functional.linear_cross_entropy and torch.nn.LinearCrossEntropyLoss
// (class-index targets), which LibTorch does not have.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fusetrain::nn {

/// How the chunked path computes: torch's LinearCrossEntropyOptions, field
/// for field, and one field of ours. Given (not nullopt) in
/// LinearCrossEntropyFuncOptions, as torch's `options` argument.
struct LinearCrossEntropyOptions {
  /// Allow a second backward through the loss (retain_graph): the gradients
  /// computed in the forward are kept (one more gradient-sized allocation a
  /// call) instead of being handed to the first backward.
  bool allow_retain_graph = false;
  /// Rows per chunk; unset: chunking_method's, or one chunk when that is
  /// unset too.
  std::optional<int64_t> batch_chunk_size;
  /// "auto" (fusetrain's rule, by measurement: a chunk's logits and their
  /// gradient about the memory of the input, at least 64 MiB and 512 rows,
  /// 2048 on CUDA; an explicit batch_chunk_size wins), "aspect_ratio" or
  /// "aspect_ratio:N" (torch's: chunks whose logits match the input in
  /// memory, divided by N), or unset (batch_chunk_size alone). A
  /// batch_chunk_size that "aspect_ratio" disagrees with is an error.
  std::optional<std::string> chunking_method = "auto";
  /// "auto" ("accurate" for 16-bit linears on the CPU, else "compact"),
  /// "accurate" (16-bit linears computed in float32) or "compact" (in their
  /// own dtype, as eager PyTorch; fp32 sums over the chunks either way).
  std::string acc_policy = "auto";
  /// float32 for 16-bit linears (unset: float32 under "auto" and the input's
  /// dtype otherwise, as torch), or the input's own dtype ("compact").
  std::optional<at::ScalarType> acc_dtype;
  /// Ours. For "mean" and "sum" losses that need gradients: compute them in
  /// the forward pass (three GEMMs a chunk; the gradients are held until the
  /// backward) rather than recomputing each chunk's logits in the backward
  /// (four GEMMs, less memory held between the passes).
  bool gradients_in_forward = true;
};

/// The arguments after input, linear_weight and target, torch's names and
/// defaults.
struct LinearCrossEntropyFuncOptions {
  /// [classes] (or [classes, d1, ...] with a K-dimensional weight), or
  /// undefined.
  at::Tensor linear_bias;
  /// Class weights [classes], or undefined.
  at::Tensor weight;
  /// "mean" (weighted mean over the targets not ignored), "sum" or "none".
  std::string reduction = "mean";
  /// Unset means -100, as torch maps None.
  std::optional<int64_t> ignore_index;
  double label_smoothing = 0.0;
  /// nullopt (the default): fusetrain's chunked path, whose autograd is the
  /// reference's (retain_graph and double backward work); given: torch's
  /// chunked-path options.
  std::optional<LinearCrossEntropyOptions> options;
};

/// cross_entropy(linear(input, linear_weight, linear_bias), target, ...)
/// without holding the logits, torch's linear_cross_entropy: `input` [H] or
/// [N, H]; `linear_weight` [C, H], or [C, d1, ..., dK, H] for a
/// K-dimensional loss (computed by the reference, the logits held, as torch
/// does); `linear_bias` of its leading shape; `target` class indices of the
/// rows' shape (or class probabilities of the logits' shape: the
/// reference). float32, float64, float16 or bfloat16; under autocast the
/// linear runs in its dtype, as F.linear would. The loss has the linear's
/// dtype (float32 under autocast).
at::Tensor linear_cross_entropy(const at::Tensor& input, const at::Tensor& linear_weight,
                                const at::Tensor& target,
                                const LinearCrossEntropyFuncOptions& options = {});

/// How linear_cross_entropy_chunked runs, resolved from the options.
struct ChunkedPlan {
  int64_t chunk_rows = 0;  // <= 0: fusetrain's rule
  bool accurate = false;   // 16-bit linears computed in float32
  bool allow_retain_graph = false;
  /// The reference's autograd (options unset): a second backward recomputes,
  /// a backward with create_graph builds the reference's graph.
  bool reference_autograd = true;
  bool gradients_in_forward = true;
  /// Set by linear_cross_entropy_chunked: the gradients the forward computes.
  std::array<bool, 3> grad_mask{};
};

/// The chunked path on checked arguments: `input` [N, H] and the linear of
/// one dtype (autocast already applied), `target` int64 [N]; the loss in
/// the loss dtype of the ops (float32, float64 for float64).
at::Tensor linear_cross_entropy_chunked(const at::Tensor& input, const at::Tensor& linear_weight,
                                        const at::Tensor& linear_bias, const at::Tensor& target,
                                        const at::Tensor& weight, const std::string& reduction,
                                        int64_t ignore_index, double label_smoothing,
                                        const ChunkedPlan& plan);

/// torch.nn.LinearCrossEntropyLoss: a Linear(in_features, num_classes) and
/// its loss, with the state-dict keys linear.weight, linear.bias (when
/// bias) and weight (the class weights, a buffer, when given).
struct LinearCrossEntropyLossOptions {
  LinearCrossEntropyLossOptions(int64_t in_features, int64_t num_classes)
      : in_features(in_features), num_classes(num_classes) {}
  int64_t in_features;
  int64_t num_classes;
  /// (d1, ..., dK) of a K-dimensional loss; the linear holds
  /// num_classes * d1 * ... * dK outputs.
  std::vector<int64_t> out_features;
  bool bias = false;
  std::string reduction = "mean";
  at::Tensor weight;
  std::optional<int64_t> ignore_index;
  double label_smoothing = 0.0;
  std::optional<LinearCrossEntropyOptions> options;
};

class LinearCrossEntropyLossImpl : public torch::nn::Cloneable<LinearCrossEntropyLossImpl> {
 public:
  explicit LinearCrossEntropyLossImpl(const LinearCrossEntropyLossOptions& options);
  void reset() override;
  /// The loss of `input` [in_features] or [N, in_features] against `target`.
  at::Tensor forward(const at::Tensor& input, const at::Tensor& target);

  LinearCrossEntropyLossOptions options;
  torch::nn::Linear linear{nullptr};
  at::Tensor weight;
};
TORCH_MODULE(LinearCrossEntropyLoss);

}  // namespace fusetrain::nn

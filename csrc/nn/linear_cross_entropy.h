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

#include <cstdint>
#include <optional>
#include <string>

namespace fusetrain::nn {

/// How the loss is computed (torch's LinearCrossEntropyOptions, and one field
/// of ours).
struct LinearCrossEntropyOptions {
  /// Rows per chunk; unset: chosen so that a chunk's logits and their
  /// gradient take about the memory of the input, and at least 64 MiB, with
  /// at least 512 rows (2048 on CUDA) for the GEMMs' sake
  /// (fusetrain::ops::linear_cross_entropy_chunk_rows).
  std::optional<int64_t> batch_chunk_size;
  /// "auto": the chunked path wherever it applies (the default, unlike
  /// torch 2.13's options=None); "none": the reference, F.linear then
  /// F.cross_entropy, holding all the logits.
  std::string chunking_method = "auto";
  /// For "mean" and "sum" losses that need gradients: compute them in the
  /// forward pass (three GEMMs a chunk; the input and weight gradients are
  /// held until the backward) rather than recomputing each chunk's logits in
  /// the backward (four GEMMs, less memory held between the passes).
  bool gradients_in_forward = true;
};

/// The arguments after input, linear_weight and target, torch's names and
/// defaults.
struct LinearCrossEntropyFuncOptions {
  /// [classes], or undefined.
  at::Tensor linear_bias;
  /// Class weights [classes], or undefined.
  at::Tensor weight;
  /// "mean" (weighted mean over the rows not ignored), "sum" or "none".
  std::string reduction = "mean";
  /// Unset means -100, as torch maps None.
  std::optional<int64_t> ignore_index;
  double label_smoothing = 0.0;
  LinearCrossEntropyOptions options;
};

/// cross_entropy(linear(input, linear_weight, linear_bias), target, ...)
/// without holding the logits: `input` [..., in_features], `linear_weight`
/// [classes, in_features] and `linear_bias` of one floating dtype (under
/// autocast they are cast to its dtype, as F.linear would be), `target`
/// [...] class indices. The loss has the linear's dtype (float32 under
/// autocast, whose cross_entropy runs in float32); it is computed in fp32.
/// Twice-differentiable it is not.
at::Tensor linear_cross_entropy(const at::Tensor& input, const at::Tensor& linear_weight,
                                const at::Tensor& target,
                                const LinearCrossEntropyFuncOptions& options = {});

/// torch.nn.LinearCrossEntropyLoss: a Linear(in_features, num_classes) and
/// its loss, with the state-dict keys linear.weight, linear.bias (when
/// bias) and weight (the class weights, a buffer, when given).
struct LinearCrossEntropyLossOptions {
  LinearCrossEntropyLossOptions(int64_t in_features, int64_t num_classes)
      : in_features(in_features), num_classes(num_classes) {}
  int64_t in_features;
  int64_t num_classes;
  bool bias = false;
  std::string reduction = "mean";
  at::Tensor weight;
  std::optional<int64_t> ignore_index;
  double label_smoothing = 0.0;
  LinearCrossEntropyOptions options;
};

class LinearCrossEntropyLossImpl : public torch::nn::Cloneable<LinearCrossEntropyLossImpl> {
 public:
  explicit LinearCrossEntropyLossImpl(const LinearCrossEntropyLossOptions& options);
  void reset() override;
  /// The loss of `input` [..., in_features] against `target` [...].
  at::Tensor forward(const at::Tensor& input, const at::Tensor& target);

  LinearCrossEntropyLossOptions options;
  torch::nn::Linear linear{nullptr};
  at::Tensor weight;
};
TORCH_MODULE(LinearCrossEntropyLoss);

}  // namespace fusetrain::nn

// C++ entry points of the chunked linear + cross-entropy ops (Note [Chunked
// linear cross-entropy] in linear_cross_entropy.cpp): the loss of
// cross_entropy(input @ linear_weight^T + linear_bias, target) without ever
// holding the [rows, classes] logits. They call through the dispatcher, so one
// call serves every device; the autograd-aware faces are
// fusetrain::nn::linear_cross_entropy (C++) and
// fusetrain.nn.functional.linear_cross_entropy (Python).
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>

namespace fusetrain::ops {

/// The forward over chunks of `chunk_rows` rows (<= 0: the rule's,
/// linear_cross_entropy_chunk_rows) of `input` [N, H] (the linear's dtype:
/// float32, float64, float16 or bfloat16) against `linear_weight` [C, H] and
/// `linear_bias` [C] of the same dtype; `target` int64 [N] class indices or
/// ignore_index; `weight` (class weights) [C], any float dtype. Per chunk one
/// GEMM gives the logits, the softmax cross-entropy runs over them in fp32
/// (fp64 for float64), and the chunk's logit gradient feeds the input-gradient
/// GEMM and accumulates the weight and bias gradients for the gradients
/// `grad_mask` asks for (input, weight, bias; only for "mean" and "sum").
/// `accurate`: 16-bit linears computed in float32 (Note [Accumulation
/// precision] in linear_cross_entropy.cpp). Returns
///   - loss: float32 (float64 for float64), [N] for "none", else 0-d (sum, or
///     sum / denominator);
///   - lse: [N] in the loss's dtype, each row's log-sum-exp (what the
///     backward reuses);
///   - denominator: 0-d, what "mean" divides by (the kept rows, or with class
///     weights the sum of their targets' weights), 1 otherwise;
///   - grad_input [N, H], grad_weight [C, H], grad_bias [C]: the gradients
///     asked for (empty tensors otherwise), in the linear's dtype, but
///     float32 for float16; times `grad_scale` they are d loss / d each for a
///     loss gradient of 1;
///   - grad_scale: 0-d, 1 except for float16 GEMMs (1 / denominator there).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
linear_cross_entropy_forward(const at::Tensor& input, const at::Tensor& linear_weight,
                             const std::optional<at::Tensor>& linear_bias,
                             const at::Tensor& target, const std::optional<at::Tensor>& weight,
                             int64_t ignore_index, double label_smoothing,
                             const std::string& reduction, int64_t chunk_rows,
                             std::array<bool, 3> grad_mask, bool accurate);

/// The gradients for `grad_loss` (0-d, or [N] for "none"), recomputing each
/// chunk's logits from input and weights and its softmax from the forward's
/// `lse`: (grad_input, grad_weight, grad_bias) in the linear's dtype, each
/// empty where `output_mask` says it is not needed (grad_bias also without a
/// bias). `chunk_rows` and `accurate` as the forward's.
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_backward(
    const at::Tensor& grad_loss, const at::Tensor& input, const at::Tensor& linear_weight,
    const std::optional<at::Tensor>& linear_bias, const at::Tensor& target,
    const std::optional<at::Tensor>& weight, const at::Tensor& lse, const at::Tensor& denominator,
    int64_t ignore_index, double label_smoothing, const std::string& reduction,
    int64_t chunk_rows, std::array<bool, 3> output_mask, bool accurate);

/// out += mat1 @ mat2 with `out` float32 and mat1, mat2 of one dtype
/// (float32, float16 or bfloat16), accumulated in fp32: on CUDA one cuBLAS
/// GEMM with beta = 1 into `out` (addmm with out_dtype float32); elsewhere
/// 16-bit GEMMs over cache-sized blocks of out's rows (fp32 accumulation
/// inside each, the block's product rounded to 16 bits once), each added
/// into `out`.
void mm_accumulate_(at::Tensor& out, const at::Tensor& mat1, const at::Tensor& mat2);

/// A float32 sum kept as its two 16-bit halves (Note [Split float32 sum] in
/// linear_cross_entropy.cpp): `high`, a contiguous bfloat16 CPU tensor, holds
/// the upper 16 bits of each float32 and `low`, int16 of the same shape, the
/// lower 16; zeros in both are 0.0f. split_sum_add_ adds a bfloat16 tensor of
/// their shape to the sums (float32 additions); split_sum_round_ rounds each
/// sum to the nearest bfloat16, ties to even, into `high`.
void split_sum_add_(at::Tensor& high, at::Tensor& low, const at::Tensor& addend);
void split_sum_round_(at::Tensor& high, const at::Tensor& low);

/// Rows per chunk when the caller gives none (Note [Chunked linear
/// cross-entropy]): a chunk's logits and their gradient take about the
/// memory of the input itself, and at least 64 MiB; and at least 512 rows
/// (on CUDA 2048), so that the chunk's GEMMs outweigh its pass over the fp32
/// weight gradient; a multiple of 64 rows, at most `rows`.
int64_t linear_cross_entropy_chunk_rows(int64_t rows, int64_t in_features, int64_t classes,
                                        at::ScalarType dtype, c10::DeviceType device);

}  // namespace fusetrain::ops

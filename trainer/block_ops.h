// The transformer models' residual stream through fusetrain's fused block ops
// (model.fused_block_ops, Note [Fused norms] in csrc/ops/norm.h): each
// block's pending branch is added to the residual by the next norm, in the
// same pass, and under autocast the norm writes the next GEMM's dtype
// directly (the cast autocast would make of its float32 output: the same
// bits, one pass fewer).
#pragma once

#include <fusetrain/nn/block_ops.h>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

#include <optional>
#include <utility>

namespace fusetrain::trainer {

/// The dtype autocast gives the GEMM that reads `x`, when it is on for x's
/// device and would cast a float32 x; else none.
inline std::optional<at::ScalarType> gemm_input_dtype(const at::Tensor& x) {
  const c10::DeviceType device = x.device().type();
  if (x.scalar_type() != at::kFloat || !at::autocast::is_autocast_enabled(device)) {
    return std::nullopt;
  }
  return at::autocast::get_autocast_dtype(device);
}

/// A norm's output and the residual stream after the pending branch.
struct Normed {
  at::Tensor out;
  at::Tensor residual;
};

/// residual += branch (branch undefined: nothing pending), then layer norm
/// of the residual; out in `out_dtype` (none: the residual's dtype). The
/// branch is cast to the residual's dtype first, as eager's type promotion
/// of `residual + branch` does.
inline Normed add_layer_norm(const at::Tensor& branch, const at::Tensor& residual,
                             torch::nn::LayerNormImpl& ln,
                             std::optional<at::ScalarType> out_dtype) {
  const auto& o = ln.options;
  if (!branch.defined()) {
    return {fusetrain::nn::layer_norm(residual, o.normalized_shape(), ln.weight, ln.bias, o.eps(), out_dtype),
            residual};
  }
  auto [out, sum] = fusetrain::nn::add_layer_norm(branch.to(residual.scalar_type()), residual,
                                       o.normalized_shape(), ln.weight, ln.bias, o.eps(), out_dtype);
  return {out, sum};
}

/// The same with RMS norm (weight [d], eps).
inline Normed add_rms_norm(const at::Tensor& branch, const at::Tensor& residual,
                           const at::Tensor& weight, double eps,
                           std::optional<at::ScalarType> out_dtype) {
  const int64_t d = residual.size(-1);
  if (!branch.defined()) return {fusetrain::nn::rms_norm(residual, {d}, weight, eps, out_dtype), residual};
  auto [out, sum] = fusetrain::nn::add_rms_norm(branch.to(residual.scalar_type()), residual, {d}, weight, eps,
                                     out_dtype);
  return {out, sum};
}

/// Clears a model's fused-ops flag for its lifetime: a traced model (export
/// --torchscript) must load without libfusetrain, so it records torch's ops.
class UnfusedScope {
 public:
  explicit UnfusedScope(bool& fused) : fused_(fused), was_(fused) { fused_ = false; }
  ~UnfusedScope() { fused_ = was_; }
  UnfusedScope(const UnfusedScope&) = delete;
  UnfusedScope& operator=(const UnfusedScope&) = delete;

 private:
  bool& fused_;
  bool was_;
};

}  // namespace fusetrain::trainer

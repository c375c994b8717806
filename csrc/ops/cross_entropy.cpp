// Fused softmax cross-entropy: the dispatcher entry points, the argument
// checks and helpers shared by every backend, and the Meta implementations
// used by torch.compile's tracing. The CPU implementation is in
// cpu/cross_entropy_cpu.cpp, the CUDA glue in cuda/cross_entropy_cuda.cpp, the
// device-generic path in generic.cpp.
#include <fusetrain/ops/checks.h>
#include <fusetrain/ops/cross_entropy.h>

#include <ATen/MemoryOverlap.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string>

namespace fusetrain::ops {

namespace {
constexpr const char* kForwardOp = "fusetrain::softmax_cross_entropy_forward";
constexpr const char* kBackwardOp = "fusetrain::softmax_cross_entropy_backward";
}  // namespace

Reduction parse_reduction(const std::string& reduction, const char* op) {
  if (reduction == "mean") return Reduction::kMean;
  if (reduction == "sum") return Reduction::kSum;
  if (reduction == "none") return Reduction::kNone;
  TORCH_CHECK_VALUE(false, op, ": reduction must be \"mean\", \"sum\" or \"none\", got \"",
                    reduction, "\"");
}

void check_cross_entropy_forward_args(const at::Tensor& logits, const at::Tensor& target,
                                      double label_smoothing, const std::string& reduction) {
  TORCH_CHECK(logits.defined(), kForwardOp, ": logits is undefined");
  TORCH_CHECK(target.defined(), kForwardOp, ": target is undefined");
  TORCH_CHECK(logits.dim() == 2, kForwardOp, ": logits must be 2-D [N, C], got shape ",
              logits.sizes());
  const at::ScalarType dtype = logits.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, kForwardOp,
              ": logits must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(target.dim() == 1 && target.size(0) == logits.size(0), kForwardOp,
              ": target must be 1-D with one class index per row of logits (", logits.size(0),
              "), got shape ", target.sizes());
  TORCH_CHECK(target.scalar_type() == at::kLong, kForwardOp, ": target must be int64, got ",
              target.scalar_type());
  check_same_device(target, logits, kForwardOp, "target", "logits");
  TORCH_CHECK_VALUE(label_smoothing >= 0.0 && label_smoothing <= 1.0, kForwardOp,
                    ": label_smoothing must be in [0, 1], got ", label_smoothing);
  parse_reduction(reduction, kForwardOp);
}

void check_cross_entropy_backward_args(const at::Tensor& grad_loss, const at::Tensor& logits,
                                       const at::Tensor& target, const at::Tensor& lse,
                                       double label_smoothing, const std::string& reduction,
                                       const std::optional<at::Tensor>& kept_rows) {
  check_cross_entropy_forward_args(logits, target, label_smoothing, reduction);
  const int64_t n = logits.size(0);
  TORCH_CHECK(grad_loss.defined(), kBackwardOp, ": grad_loss is undefined");
  TORCH_CHECK(grad_loss.scalar_type() == at::kFloat, kBackwardOp,
              ": grad_loss must be float32 (the loss's dtype), got ", grad_loss.scalar_type());
  if (parse_reduction(reduction, kBackwardOp) == Reduction::kNone) {
    TORCH_CHECK(grad_loss.dim() == 1 && grad_loss.size(0) == n, kBackwardOp,
                ": with reduction \"none\" grad_loss must have shape [", n, "], got ",
                grad_loss.sizes());
  } else {
    TORCH_CHECK(grad_loss.numel() == 1, kBackwardOp, ": with reduction \"", reduction,
                "\" grad_loss must hold one element, got shape ", grad_loss.sizes());
  }
  TORCH_CHECK(lse.defined(), kBackwardOp, ": lse is undefined");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 1 && lse.size(0) == n, kBackwardOp,
              ": lse must be the forward's float32 [", n, "] output, got ", lse.scalar_type(),
              " of shape ", lse.sizes());
  check_same_device(grad_loss, logits, kBackwardOp, "grad_loss", "logits");
  check_same_device(lse, logits, kBackwardOp, "lse", "logits");
  if (kept_rows.has_value() && kept_rows->defined() &&
      parse_reduction(reduction, kBackwardOp) == Reduction::kMean) {
    TORCH_CHECK(kept_rows->scalar_type() == at::kFloat && kept_rows->numel() == 1, kBackwardOp,
                ": kept_rows must be the forward's float32 count of one element, got ",
                kept_rows->scalar_type(), " of shape ", kept_rows->sizes());
    check_same_device(*kept_rows, logits, kBackwardOp, "kept_rows", "logits");
  }
}

void check_cross_entropy_backward_out(const at::Tensor& logits, const at::Tensor& out) {
  TORCH_CHECK(out.defined(), kBackwardOp, ": out is undefined");
  TORCH_CHECK(out.sizes() == logits.sizes(), kBackwardOp, ": out must have the logits' shape ",
              logits.sizes(), ", got ", out.sizes());
  TORCH_CHECK(out.scalar_type() == logits.scalar_type(), kBackwardOp,
              ": out must have the logits' dtype ", logits.scalar_type(), ", got ",
              out.scalar_type());
  check_same_device(out, logits, kBackwardOp, "out", "logits");
  TORCH_CHECK(out.is_contiguous(), kBackwardOp, ": out must be contiguous, got strides ",
              out.strides());
  // The rows are walked in parallel: the gradient may replace the very
  // logits it is computed from, element by element, and nothing else.
  const at::MemOverlapStatus overlap = at::get_overlap_status(out, logits);
  const bool distinct = overlap == at::MemOverlapStatus::No ||
                        (overlap == at::MemOverlapStatus::TooHard &&
                         !out.storage().is_alias_of(logits.storage()));
  TORCH_CHECK(distinct || overlap == at::MemOverlapStatus::Full, kBackwardOp,
              ": out overlaps the logits only in part; pass the logits themselves (contiguous) "
              "to write the gradient in place, or memory that does not overlap them");
}

at::Tensor kept_rows_output(const at::Tensor& count, Reduction reduction) {
  if (reduction == Reduction::kNone) return at::empty({0}, count.options().dtype(at::kFloat));
  return count.to(at::kFloat).reshape({});
}

at::Tensor with_contiguous_rows(const at::Tensor& logits) {
  // A size-1 class dimension may carry any stride: its one element is found
  // through the row stride alone.
  if (logits.size(1) <= 1 || logits.stride(1) == 1) return logits;
  return logits.contiguous();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> softmax_cross_entropy_forward(
    const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index,
    double label_smoothing, const std::string& reduction) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow(kForwardOp, "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, int64_t, double,
                           c10::string_view)>();
  return op.call(logits, target, ignore_index, label_smoothing, reduction);
}

at::Tensor softmax_cross_entropy_backward(const at::Tensor& grad_loss, const at::Tensor& logits,
                                          const at::Tensor& target, const at::Tensor& lse,
                                          int64_t ignore_index, double label_smoothing,
                                          const std::string& reduction,
                                          const std::optional<at::Tensor>& kept_rows) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow(kBackwardOp, "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, int64_t, double, c10::string_view,
                                         const std::optional<at::Tensor>&)>();
  return op.call(grad_loss, logits, target, lse, ignore_index, label_smoothing, reduction,
                 kept_rows);
}

at::Tensor& softmax_cross_entropy_backward_out(const at::Tensor& grad_loss,
                                               const at::Tensor& logits, const at::Tensor& target,
                                               const at::Tensor& lse, int64_t ignore_index,
                                               double label_smoothing,
                                               const std::string& reduction,
                                               const std::optional<at::Tensor>& kept_rows,
                                               at::Tensor& out) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow(kBackwardOp, "out")
                       .typed<at::Tensor&(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          const at::Tensor&, int64_t, double, c10::string_view,
                                          const std::optional<at::Tensor>&, at::Tensor&)>();
  return op.call(grad_loss, logits, target, lse, ignore_index, label_smoothing, reduction,
                 kept_rows, out);
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_meta(const at::Tensor& logits,
                                                            const at::Tensor& target,
                                                            int64_t ignore_index,
                                                            double label_smoothing,
                                                            c10::string_view reduction_view) {
  const std::string reduction(reduction_view);
  check_cross_entropy_forward_args(logits, target, label_smoothing, reduction);
  const auto f32 = logits.options().dtype(at::kFloat);
  const int64_t n = logits.size(0);
  const bool none = parse_reduction(reduction, kForwardOp) == Reduction::kNone;
  return {none ? at::empty({n}, f32) : at::empty({}, f32), at::empty({n}, f32),
          none ? at::empty({0}, f32) : at::empty({}, f32)};
}

at::Tensor backward_meta(const at::Tensor& grad_loss, const at::Tensor& logits,
                         const at::Tensor& target, const at::Tensor& lse, int64_t ignore_index,
                         double label_smoothing, c10::string_view reduction_view,
                         const std::optional<at::Tensor>& kept_rows) {
  const std::string reduction(reduction_view);
  check_cross_entropy_backward_args(grad_loss, logits, target, lse, label_smoothing, reduction,
                                    kept_rows);
  return at::empty({logits.size(0), logits.size(1)}, logits.options());
}

at::Tensor& backward_out_meta(const at::Tensor& grad_loss, const at::Tensor& logits,
                              const at::Tensor& target, const at::Tensor& lse,
                              int64_t ignore_index, double label_smoothing,
                              c10::string_view reduction_view,
                              const std::optional<at::Tensor>& kept_rows, at::Tensor& out) {
  const std::string reduction(reduction_view);
  check_cross_entropy_backward_args(grad_loss, logits, target, lse, label_smoothing, reduction,
                                    kept_rows);
  check_cross_entropy_backward_out(logits, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusetrain, Meta, m) {
  m.impl("softmax_cross_entropy_forward", &forward_meta);
  m.impl("softmax_cross_entropy_backward", &backward_meta);
  m.impl("softmax_cross_entropy_backward.out", &backward_out_meta);
}

}  // namespace fusetrain::ops

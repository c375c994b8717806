// The autograd Function behind fusetrain::nn::softmax_cross_entropy: the
// forward op saves the logits and per-row log-sum-exp, the backward op
// recomputes the softmax from them.
#include <fusetrain/nn/cross_entropy.h>
#include <fusetrain/ops/cross_entropy.h>

#include <torch/autograd.h>

namespace fusetrain::nn {

namespace {

class SoftmaxCrossEntropyFunction : public torch::autograd::Function<SoftmaxCrossEntropyFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& target, int64_t ignore_index, double label_smoothing,
                            const std::string& reduction) {
    auto [loss, lse, kept_rows] = ops::softmax_cross_entropy_forward(
        logits, target, ignore_index, label_smoothing, reduction);
    ctx->save_for_backward({logits, target, lse});
    // The count "mean" divides by, so the backward does not count again.
    ctx->saved_data["kept_rows"] = kept_rows;
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["label_smoothing"] = label_smoothing;
    ctx->saved_data["reduction"] = reduction;
    return loss;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    // The incoming gradient has the loss's dtype unless a caller cast it.
    const at::Tensor grad_loss = grads[0].to(at::kFloat);
    at::Tensor grad_logits = ops::softmax_cross_entropy_backward(
        grad_loss, saved[0], saved[1], saved[2], ctx->saved_data["ignore_index"].toInt(),
        ctx->saved_data["label_smoothing"].toDouble(), ctx->saved_data["reduction"].toStringRef(),
        ctx->saved_data["kept_rows"].toTensor());
    return {grad_logits, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor softmax_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                 const SoftmaxCrossEntropyOptions& options) {
  return SoftmaxCrossEntropyFunction::apply(logits, target, options.ignore_index,
                                            options.label_smoothing, options.reduction);
}

}  // namespace fusetrain::nn

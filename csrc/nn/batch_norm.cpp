// The autograd Function behind fusetrain::nn::batch_norm_relu: the forward op
// saves the input, the output (the ReLU's mask) and the statistics it used;
// the backward op takes them.
#include <fusetrain/nn/batch_norm.h>
#include <fusetrain/ops/batch_norm.h>

#include <ATen/Context.h>
#include <torch/autograd.h>

#include <optional>

namespace fusetrain::nn {

namespace {

std::optional<at::Tensor> maybe(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

class BatchNormReluFunction : public torch::autograd::Function<BatchNormReluFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, const at::Tensor& bias,
                            const at::Tensor& running_mean, const at::Tensor& running_var,
                            bool training, double momentum, double eps, bool relu) {
    auto [out, mean, invstd] =
        ops::batch_norm_relu(input, maybe(weight), maybe(bias), maybe(running_mean),
                             maybe(running_var), training, momentum, eps, relu);
    ctx->save_for_backward({input, relu ? out : at::Tensor(), weight, mean, invstd});
    ctx->saved_data["training"] = training;
    ctx->saved_data["relu"] = relu;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& weight = saved[2];
    const std::array<bool, 3> mask = {ctx->needs_input_grad(0),
                                      weight.defined() && ctx->needs_input_grad(1),
                                      ctx->needs_input_grad(2)};
    const bool relu = ctx->saved_data["relu"].toBool();
    auto [grad_input, grad_weight, grad_bias] = ops::batch_norm_relu_backward(
        grads[0], saved[0], relu ? std::optional<at::Tensor>(saved[1]) : std::nullopt,
        maybe(weight), saved[3], saved[4], ctx->saved_data["training"].toBool(), relu, mask);
    return {grad_input, grad_weight, grad_bias, at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

bool fused_kernels_for(const at::Tensor& input) {
  const at::ScalarType dtype = input.scalar_type();
  return input.is_cpu() &&
         (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf);
}

}  // namespace

at::Tensor batch_norm_relu(const at::Tensor& input, const at::Tensor& running_mean,
                           const at::Tensor& running_var, const at::Tensor& weight,
                           const at::Tensor& bias, bool training, double momentum, double eps,
                           bool relu) {
  if (!fused_kernels_for(input)) {
    // torch's batch norm (cuDNN on CUDA); the ReLU in place on its output,
    // which its backward does not need.
    at::Tensor y = at::batch_norm(input, weight, bias, running_mean, running_var, training,
                                  momentum, eps, at::globalContext().userEnabledCuDNN());
    return relu ? y.relu_() : y;
  }
  return BatchNormReluFunction::apply(input, weight, bias, running_mean, running_var, training,
                                      momentum, eps, relu);
}

at::Tensor batch_norm_relu(torch::nn::BatchNorm2dImpl& bn, const at::Tensor& input, bool relu) {
  TORCH_CHECK(input.dim() == 4, "fusetrain::nn::batch_norm_relu: BatchNorm2d expects a 4-D input [N, C, H, W], got ",
              input.dim(), "-D");
  const auto& options = bn.options;
  double momentum = options.momentum().value_or(0.0);
  if (bn.is_training() && options.track_running_stats() && bn.num_batches_tracked.defined()) {
    // As torch::nn::BatchNorm2d's forward: count the batch, and without a
    // momentum average the running statistics over every batch so far. That
    // reads the count on the host, as torch's module does (a device sync off
    // the CPU); with a momentum, the default, nothing is read.
    bn.num_batches_tracked += 1;
    if (!options.momentum().has_value()) momentum = 1.0 / bn.num_batches_tracked.item<double>();
  }
  return batch_norm_relu(input, bn.running_mean, bn.running_var, bn.weight, bn.bias,
                         bn.is_training() || !options.track_running_stats(), momentum,
                         options.eps(), relu);
}

}  // namespace fusetrain::nn

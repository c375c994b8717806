// Fused batch normalisation + ReLU: the dispatcher entry points, the argument
// checks and the Meta implementations used by torch.compile's tracing. The
// CPU implementation is in cpu/batch_norm_cpu.cpp; other backends run the
// ATen composition (generic.cpp).
#include <fusetrain/ops/batch_norm.h>
#include <fusetrain/ops/checks.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace fusetrain::ops {

namespace {
constexpr const char* kForwardOp = "fusetrain::batch_norm_relu";
constexpr const char* kBackwardOp = "fusetrain::batch_norm_relu_backward";

void check_param(const std::optional<at::Tensor>& t, const at::Tensor& input, const char* op,
                 const char* name) {
  if (!given(t)) return;
  const int64_t c = input.size(1);
  TORCH_CHECK(t->dim() == 1 && t->size(0) == c, op, ": ", name,
              " must be 1-D with one value per channel (", c, "), got shape ", t->sizes());
  TORCH_CHECK(t->scalar_type() == at::kFloat || t->scalar_type() == input.scalar_type(), op, ": ",
              name, " must be float32 or the input's dtype (", input.scalar_type(), "), got ",
              t->scalar_type());
  check_same_device(*t, input, op, name, "input");
}
}  // namespace

namespace {
void check_input(const at::Tensor& input, const char* op) {
  TORCH_CHECK(input.defined(), op, ": input is undefined");
  TORCH_CHECK(input.dim() >= 2, op,
              ": input must have a batch and a channel dimension [N, C, ...], got shape ",
              input.sizes());
  const at::ScalarType dtype = input.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op,
              ": input must be float32, float16 or bfloat16, got ", dtype);
}

void check_statistic(const at::Tensor& t, const at::Tensor& input, const char* name) {
  const int64_t c = input.size(1);
  TORCH_CHECK(t.defined(), kBackwardOp, ": ", name, " is undefined");
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 1 && t.size(0) == c, kBackwardOp, ": ",
              name, " must be the forward's float32 [", c, "] output, got ", t.scalar_type(),
              " of shape ", t.sizes());
  check_same_device(t, input, kBackwardOp, name, "input");
}
}  // namespace

void check_batch_norm_forward_args(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                                   const std::optional<at::Tensor>& bias,
                                   const std::optional<at::Tensor>& running_mean,
                                   const std::optional<at::Tensor>& running_var, bool training) {
  check_input(input, kForwardOp);
  check_param(weight, input, kForwardOp, "weight");
  check_param(bias, input, kForwardOp, "bias");
  check_param(running_mean, input, kForwardOp, "running_mean");
  check_param(running_var, input, kForwardOp, "running_var");
  TORCH_CHECK(given(running_mean) == given(running_var), kForwardOp,
              ": pass both running_mean and running_var, or neither");
  if (training) {
    // torch.nn.functional.batch_norm's check: one value has no variance.
    const int64_t per_channel = input.numel() / std::max<int64_t>(input.size(1), 1);
    TORCH_CHECK_VALUE(per_channel != 1, kForwardOp,
                      ": expected more than 1 value per channel when training, got input size ",
                      input.sizes());
  } else {
    TORCH_CHECK(given(running_mean), kForwardOp,
                ": evaluation (training=False) normalises with the running statistics; pass "
                "running_mean and running_var");
  }
}

void check_batch_norm_backward_args(const at::Tensor& grad_out, const at::Tensor& input,
                                    const std::optional<at::Tensor>& output,
                                    const std::optional<at::Tensor>& weight,
                                    const at::Tensor& save_mean, const at::Tensor& save_invstd,
                                    bool relu) {
  check_input(input, kBackwardOp);
  check_param(weight, input, kBackwardOp, "weight");
  TORCH_CHECK(grad_out.defined(), kBackwardOp, ": grad_out is undefined");
  TORCH_CHECK(grad_out.sizes() == input.sizes() && grad_out.scalar_type() == input.scalar_type(),
              kBackwardOp, ": grad_out must have the input's dtype and shape (",
              input.scalar_type(), " ", input.sizes(), "), got ", grad_out.scalar_type(), " ",
              grad_out.sizes());
  check_same_device(grad_out, input, kBackwardOp, "grad_out", "input");
  if (relu) {
    TORCH_CHECK(given(output), kBackwardOp,
                ": relu=True needs the forward's output (the ReLU's mask)");
    TORCH_CHECK(output->sizes() == input.sizes() && output->scalar_type() == input.scalar_type(),
                kBackwardOp, ": output must be the forward's out (", input.scalar_type(), " ",
                input.sizes(), "), got ", output->scalar_type(), " ", output->sizes());
    check_same_device(*output, input, kBackwardOp, "output", "input");
  }
  check_statistic(save_mean, input, "save_mean");
  check_statistic(save_invstd, input, "save_invstd");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_relu(
    const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, bool training, double momentum, double eps,
    bool relu) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow(kForwardOp, "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const std::optional<at::Tensor>&,
                           const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                           const std::optional<at::Tensor>&, bool, double, double, bool)>();
  return op.call(input, weight, bias, running_mean, running_var, training, momentum, eps, relu);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_relu_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const std::optional<at::Tensor>& output,
    const std::optional<at::Tensor>& weight, const at::Tensor& save_mean,
    const at::Tensor& save_invstd, bool training, bool relu, std::array<bool, 3> output_mask) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow(kBackwardOp, "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                           const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
                           bool, bool, std::array<bool, 3>)>();
  return op.call(grad_out, input, output, weight, save_mean, save_invstd, training, relu,
                 output_mask);
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_meta(
    const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, bool training, double, double, bool) {
  check_batch_norm_forward_args(input, weight, bias, running_mean, running_var, training);
  const auto f32 = input.options().dtype(at::kFloat);
  return {at::empty_like(input),
          at::empty({input.size(1)}, f32), at::empty({input.size(1)}, f32)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_meta(
    const at::Tensor& grad_out, const at::Tensor& input, const std::optional<at::Tensor>& output,
    const std::optional<at::Tensor>& weight, const at::Tensor& save_mean,
    const at::Tensor& save_invstd, bool, bool relu, std::array<bool, 3> mask) {
  check_batch_norm_backward_args(grad_out, input, output, weight, save_mean, save_invstd, relu);
  const auto param = input.options().dtype(given(weight) ? weight->scalar_type() : at::kFloat);
  return {mask[0] ? at::empty_like(input)
                  : at::Tensor(),
          mask[1] && given(weight) ? at::empty({input.size(1)}, param) : at::Tensor(),
          mask[2] ? at::empty({input.size(1)}, param) : at::Tensor()};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusetrain, Meta, m) {
  m.impl("batch_norm_relu", &forward_meta);
  m.impl("batch_norm_relu_backward", &backward_meta);
}

}  // namespace fusetrain::ops

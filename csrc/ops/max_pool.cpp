// Max pooling over non-overlapping windows: the dispatcher entry points, the
// argument checks and the Meta implementations used by torch.compile's
// tracing. The CPU implementation is in cpu/max_pool_cpu.cpp; other backends
// run the ATen composition (generic.cpp).
#include <fusetrain/ops/checks.h>
#include <fusetrain/ops/max_pool.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <array>

namespace fusetrain::ops {

namespace {
constexpr const char* kForwardOp = "fusetrain::max_pool2d";
constexpr const char* kBackwardOp = "fusetrain::max_pool2d_backward";

std::tuple<at::Tensor, at::Tensor> forward_meta(const at::Tensor& input, at::IntArrayRef kernel_size) {
  const auto [oh, ow] = check_max_pool2d_args(input, kernel_size);
  const at::MemoryFormat format = input.suggest_memory_format();
  const auto sizes = {input.size(0), input.size(1), oh, ow};
  return {at::empty(sizes, input.options().memory_format(format)),
          at::empty(sizes, input.options().dtype(at::kByte).memory_format(format))};
}

at::Tensor backward_meta(const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& argmax,
                         at::IntArrayRef kernel_size) {
  check_max_pool2d_backward_args(grad_out, input, argmax, kernel_size);
  return at::empty(input.sizes(), input.options().memory_format(input.suggest_memory_format()));
}

}  // namespace

std::array<int64_t, 2> check_max_pool2d_args(const at::Tensor& input, at::IntArrayRef kernel_size) {
  const char* op = kForwardOp;
  TORCH_CHECK(input.defined(), op, ": input is undefined");
  TORCH_CHECK(input.dim() == 4, op, ": input must be 4-D [N, C, H, W], got shape ", input.sizes());
  const at::ScalarType dtype = input.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op,
              ": input must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(kernel_size.size() == 1 || kernel_size.size() == 2, op,
              ": kernel_size must be one size or two (height, width), got ", kernel_size);
  const auto [kh, kw] = max_pool2d_window(kernel_size);
  TORCH_CHECK(kh >= 1 && kw >= 1, op, ": kernel_size must be positive, got ", kernel_size);
  TORCH_CHECK(kh * kw <= 256, op, ": a window of ", kh, "x", kw,
              " has more than 256 positions, which the uint8 argmax cannot number; use "
              "torch.nn.functional.max_pool2d");
  const int64_t oh = input.size(2) / kh, ow = input.size(3) / kw;
  TORCH_CHECK(oh >= 1 && ow >= 1, op, ": input of height ", input.size(2), " and width ",
              input.size(3), " is smaller than the ", kh, "x", kw, " window");
  return {oh, ow};
}

void check_max_pool2d_backward_args(const at::Tensor& grad_out, const at::Tensor& input,
                                    const at::Tensor& argmax, at::IntArrayRef kernel_size) {
  const char* op = kBackwardOp;
  const auto [oh, ow] = check_max_pool2d_args(input, kernel_size);
  const std::array<int64_t, 4> out_sizes = {input.size(0), input.size(1), oh, ow};
  TORCH_CHECK(grad_out.defined() && grad_out.sizes() == at::IntArrayRef(out_sizes), op,
              ": grad_out must have the output's shape ", at::IntArrayRef(out_sizes), ", got ",
              grad_out.defined() ? grad_out.sizes() : at::IntArrayRef{});
  TORCH_CHECK(grad_out.scalar_type() == input.scalar_type(), op, ": grad_out must be ",
              input.scalar_type(), " as the input, got ", grad_out.scalar_type());
  TORCH_CHECK(argmax.defined() && argmax.sizes() == at::IntArrayRef(out_sizes), op,
              ": argmax must have the output's shape ", at::IntArrayRef(out_sizes), ", got ",
              argmax.defined() ? argmax.sizes() : at::IntArrayRef{});
  TORCH_CHECK(argmax.scalar_type() == at::kByte, op,
              ": argmax must be uint8 (max_pool2d's second output), got ", argmax.scalar_type());
  check_same_device(grad_out, input, op, "grad_out", "input");
  check_same_device(argmax, input, op, "argmax", "input");
}

std::tuple<at::Tensor, at::Tensor> max_pool2d(const at::Tensor& input, at::IntArrayRef kernel_size) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fusetrain::max_pool2d", "")
                             .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&,
                                                                       at::IntArrayRef)>();
  return op.call(input, kernel_size);
}

at::Tensor max_pool2d_backward(const at::Tensor& grad_out, const at::Tensor& input,
                               const at::Tensor& argmax, at::IntArrayRef kernel_size) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fusetrain::max_pool2d_backward", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            at::IntArrayRef)>();
  return op.call(grad_out, input, argmax, kernel_size);
}

TORCH_LIBRARY_IMPL(fusetrain, Meta, m) {
  m.impl("max_pool2d", &forward_meta);
  m.impl("max_pool2d_backward", &backward_meta);
}

}  // namespace fusetrain::ops

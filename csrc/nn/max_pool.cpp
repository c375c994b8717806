// The autograd Function behind fusetrain::nn::max_pool2d: the forward op
// saves the input (for its shape and layout) and the argmax bytes; the
// backward op takes them.
#include <fusetrain/nn/max_pool.h>
#include <fusetrain/ops/max_pool.h>

#include <torch/autograd.h>

#include <array>
#include <vector>

namespace fusetrain::nn {

namespace {

class MaxPool2dFunction : public torch::autograd::Function<MaxPool2dFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            at::IntArrayRef kernel_size) {
    auto [out, argmax] = ops::max_pool2d(input, kernel_size);
    ctx->save_for_backward({input, argmax});
    ctx->saved_data["kernel_size"] = kernel_size.vec();
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const std::vector<int64_t> kernel_size = ctx->saved_data["kernel_size"].toIntVector();
    return {ops::max_pool2d_backward(grads[0], saved[0], saved[1], kernel_size), at::Tensor()};
  }
};

bool window_ops_for(const at::Tensor& input, at::IntArrayRef kernel_size) {
  const at::ScalarType dtype = input.scalar_type();
  // channels_last: vectors across channels, any window; contiguous NCHW:
  // vectors along the rows for 2x2 windows (other windows go one by one
  // there, slower than torch's NCHW kernel).
  const bool two_by_two = kernel_size.size() == 2 ? kernel_size[0] == 2 && kernel_size[1] == 2
                                                  : kernel_size.size() == 1 && kernel_size[0] == 2;
  const bool layout = input.suggest_memory_format() == at::MemoryFormat::ChannelsLast ||
                      (input.is_contiguous() && two_by_two);
  return input.is_cpu() && input.dim() == 4 && layout &&
         (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf);
}

}  // namespace

at::Tensor max_pool2d(const at::Tensor& input, at::IntArrayRef kernel_size) {
  if (!window_ops_for(input, kernel_size)) return at::max_pool2d(input, kernel_size, kernel_size);
  return MaxPool2dFunction::apply(input, kernel_size);
}

at::Tensor max_pool2d(torch::nn::MaxPool2dImpl& pool, const at::Tensor& input) {
  const auto& o = pool.options;
  const auto& kernel = *o.kernel_size();
  const auto& stride = *o.stride();
  const bool windows = stride == kernel && *o.padding() == std::array<int64_t, 2>{0, 0} &&
                       *o.dilation() == std::array<int64_t, 2>{1, 1} && !o.ceil_mode();
  if (!windows) return pool.forward(input);
  return nn::max_pool2d(input, kernel);
}

}  // namespace fusetrain::nn

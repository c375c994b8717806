// CUDA glue of the fused softmax cross-entropy ops: checks, device guard,
// stream, outputs. The kernels are in csrc/kernels/cross_entropy_kernels.cu.
// An out-of-range target is caught by a device-side assert there (the host
// cannot see targets without a sync), which, as with torch's nll_loss, leaves
// the CUDA context unusable; the CPU ops raise an IndexError instead.
#include <fusetrain/kernels/cross_entropy_kernels.h>
#include <fusetrain/ops/cross_entropy.h>
#include <fusetrain/ops/cuda/cuda_utils.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace fusetrain::ops::cuda {

namespace {

constexpr const char* kForwardOp = "fusetrain::softmax_cross_entropy_forward";
constexpr const char* kBackwardOp = "fusetrain::softmax_cross_entropy_backward";

kernels::CrossEntropyRows rows_of(const at::Tensor& logits, const at::Tensor& target,
                                  int64_t ignore_index, double label_smoothing, const char* op) {
  return {float_type(logits.scalar_type(), op),
          logits.const_data_ptr(),
          logits.stride(0),
          target.const_data_ptr<int64_t>(),
          logits.size(0),
          logits.size(1),
          ignore_index,
          static_cast<float>(label_smoothing)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_cuda(const at::Tensor& logits_in,
                                                            const at::Tensor& target_in,
                                                            int64_t ignore_index,
                                                            double label_smoothing,
                                                            c10::string_view reduction_view) {
  const std::string reduction(reduction_view);
  check_cross_entropy_forward_args(logits_in, target_in, label_smoothing, reduction);
  const Reduction red = parse_reduction(reduction, kForwardOp);
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor logits = with_contiguous_rows(logits_in);
  const at::Tensor target = target_in.contiguous();
  const int64_t n = logits.size(0);

  const auto f32 = logits.options().dtype(at::kFloat);
  at::Tensor lse = at::empty({n}, f32);
  at::Tensor rows = at::empty({n}, f32);
  C10_CUDA_CHECK(kernels::launch_cross_entropy_forward(
      rows_of(logits, target, ignore_index, label_smoothing, kForwardOp), rows.data_ptr<float>(),
      lse.data_ptr<float>(), stream));
  if (red == Reduction::kNone) return {rows, lse, at::empty({0}, f32)};
  // The loss and the kept-row count in one pass: the backward of "mean"
  // divides by the count without counting again.
  at::Tensor loss = at::empty({}, f32);
  at::Tensor kept_rows = at::empty({}, f32);
  C10_CUDA_CHECK(kernels::launch_cross_entropy_reduce(
      rows.const_data_ptr<float>(), target.const_data_ptr<int64_t>(), n, ignore_index,
      red == Reduction::kMean, loss.data_ptr<float>(), kept_rows.data_ptr<float>(), stream));
  return {loss, lse, kept_rows};
}

// The backward into `grad` (contiguous [N, C]: the logits themselves or
// memory apart from them), after the arguments were checked.
void backward_into(const at::Tensor& grad_loss_in, const at::Tensor& logits_in,
                   const at::Tensor& target_in, const at::Tensor& lse_in, int64_t ignore_index,
                   double label_smoothing, Reduction red,
                   const std::optional<at::Tensor>& kept_rows_in, at::Tensor& grad) {
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor logits = with_contiguous_rows(logits_in);
  const at::Tensor target = target_in.contiguous();
  const at::Tensor lse = lse_in.contiguous();
  // An expanded gradient (loss.sum().backward() on reduction "none") has
  // stride 0; the kernel indexes it densely.
  const at::Tensor grad_loss = grad_loss_in.contiguous();
  // "mean" divides by the forward's kept-row count when the caller passes
  // it; else the rows are counted again, into one float of device scratch.
  const bool mean = red == Reduction::kMean;
  const bool have_count = mean && kept_rows_in.has_value() && kept_rows_in->defined();
  const at::Tensor kept_rows = have_count ? kept_rows_in->contiguous() : at::Tensor();
  const at::Tensor scratch =
      mean && !have_count ? at::empty({1}, logits.options().dtype(at::kFloat)) : at::Tensor();
  C10_CUDA_CHECK(kernels::launch_cross_entropy_backward(
      rows_of(logits, target, ignore_index, label_smoothing, kBackwardOp),
      grad_loss.const_data_ptr<float>(), red == Reduction::kNone, mean,
      have_count ? kept_rows.const_data_ptr<float>() : nullptr,
      scratch.defined() ? scratch.data_ptr<float>() : nullptr, lse.const_data_ptr<float>(),
      grad.data_ptr(), stream));
}

at::Tensor backward_cuda(const at::Tensor& grad_loss, const at::Tensor& logits,
                         const at::Tensor& target, const at::Tensor& lse, int64_t ignore_index,
                         double label_smoothing, c10::string_view reduction_view,
                         const std::optional<at::Tensor>& kept_rows) {
  const std::string reduction(reduction_view);
  check_cross_entropy_backward_args(grad_loss, logits, target, lse, label_smoothing, reduction,
                                    kept_rows);
  at::Tensor grad = at::empty({logits.size(0), logits.size(1)}, logits.options());
  backward_into(grad_loss, logits, target, lse, ignore_index, label_smoothing,
                parse_reduction(reduction, kBackwardOp), kept_rows, grad);
  return grad;
}

at::Tensor& backward_out_cuda(const at::Tensor& grad_loss, const at::Tensor& logits,
                              const at::Tensor& target, const at::Tensor& lse,
                              int64_t ignore_index, double label_smoothing,
                              c10::string_view reduction_view,
                              const std::optional<at::Tensor>& kept_rows, at::Tensor& out) {
  const std::string reduction(reduction_view);
  check_cross_entropy_backward_args(grad_loss, logits, target, lse, label_smoothing, reduction,
                                    kept_rows);
  check_cross_entropy_backward_out(logits, out);
  backward_into(grad_loss, logits, target, lse, ignore_index, label_smoothing,
                parse_reduction(reduction, kBackwardOp), kept_rows, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusetrain, CUDA, m) {
  m.impl("softmax_cross_entropy_forward", &forward_cuda);
  m.impl("softmax_cross_entropy_backward", &backward_cuda);
  m.impl("softmax_cross_entropy_backward.out", &backward_out_cuda);
}

}  // namespace fusetrain::ops::cuda

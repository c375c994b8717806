// CUDA glue of the fused optimizer and norm ops: checks, device guard,
// stream, pointer lists. Kernels: csrc/kernels/optim_kernels.cu.
#include <fusetrain/kernels/optim_kernels.h>
#include <fusetrain/ops/checks.h>
#include <fusetrain/ops/cuda/cuda_utils.h>
#include <fusetrain/ops/optim.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <map>
#include <vector>

namespace fusetrain::ops::cuda {

namespace {

std::vector<void*> pointers(at::TensorList list, size_t n) {
  std::vector<void*> out(n, nullptr);
  for (size_t i = 0; i < list.size(); ++i) out[i] = list[i].data_ptr();
  return out;
}

const float* optional_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->const_data_ptr<float>() : nullptr;
}

kernels::DeviceScalar device_scalar(const std::optional<at::Tensor>& t) {
  if (!t.has_value() || !t->defined()) return {nullptr, false};
  return {t->const_data_ptr(), t->scalar_type() == at::kDouble};
}

void check_cuda_params(at::TensorList params, const char* op) {
  TORCH_CHECK(params[0].is_cuda(), op, ": the CUDA kernel got params on ", params[0].device());
  TORCH_CHECK(params[0].scalar_type() != at::kDouble, op,
              ": float64 params are not supported on CUDA (the kernels compute in fp32); use "
              "float32, float16 or bfloat16");
}

void fused_adamw_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                      at::TensorList master_params, at::TensorList state_steps, double lr,
                      double beta1, double beta2, double weight_decay, double eps, bool amsgrad,
                      bool maximize, bool decoupled_weight_decay,
                      const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf,
                      const std::optional<at::Tensor>& lr_tensor) {
  constexpr const char* kOp = "fusetrain::fused_adamw_";
  check_adamw_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params,
                   state_steps, amsgrad, grad_scale, found_inf, lr_tensor);
  check_cuda_params(params, kOp);
  const c10::cuda::CUDAGuard guard(params[0].device());
  const size_t n = params.size();
  const auto p = pointers(params, n), g = pointers(grads, n), m = pointers(exp_avgs, n),
             v = pointers(exp_avg_sqs, n), vmax = pointers(max_exp_avg_sqs, n),
             master = pointers(master_params, n), steps = pointers(state_steps, n);
  std::vector<int64_t> numel(n);
  for (size_t i = 0; i < n; ++i) numel[i] = params[i].numel();
  const kernels::AdamTensors tensors{p.data(),      g.data(),    m.data(),     v.data(),
                                     vmax.data(),   master.data(), steps.data(), numel.data(),
                                     static_cast<int>(n)};
  kernels::AdamScalars scalars{};
  scalars.lr = lr;
  scalars.beta1 = beta1;
  scalars.beta2 = beta2;
  scalars.weight_decay = static_cast<float>(weight_decay);
  scalars.eps = static_cast<float>(eps);
  // In double, rounded once (as the CPU reference and torch do).
  scalars.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  scalars.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  scalars.decay = static_cast<float>(1.0 - lr * weight_decay);
  scalars.amsgrad = amsgrad;
  scalars.maximize = maximize;
  scalars.decoupled_weight_decay = decoupled_weight_decay;
  scalars.grad_scale = optional_ptr(grad_scale);
  scalars.found_inf = optional_ptr(found_inf);
  scalars.lr_device = device_scalar(lr_tensor);
  scalars.weight_decay64 = weight_decay;
  C10_CUDA_CHECK(kernels::launch_fused_adam(float_type(params[0].scalar_type(), kOp),
                                            !master_params.empty(), tensors, scalars,
                                            multi_tensor_blocks(),
                                            at::cuda::getCurrentCUDAStream()));
}

void fused_sgd_cuda(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                    at::TensorList master_params, double lr, double momentum, double dampening,
                    double weight_decay, bool nesterov, bool maximize, bool is_first_step,
                    const std::optional<at::Tensor>& grad_scale,
                    const std::optional<at::Tensor>& found_inf,
                    const std::optional<at::Tensor>& lr_tensor) {
  constexpr const char* kOp = "fusetrain::fused_sgd_";
  check_sgd_args(params, grads, momentum_buffers, master_params, momentum, grad_scale, found_inf,
                 lr_tensor);
  check_cuda_params(params, kOp);
  const c10::cuda::CUDAGuard guard(params[0].device());
  const size_t n = params.size();
  const auto p = pointers(params, n), g = pointers(grads, n), b = pointers(momentum_buffers, n),
             master = pointers(master_params, n);
  std::vector<int64_t> numel(n);
  for (size_t i = 0; i < n; ++i) numel[i] = params[i].numel();
  const kernels::SgdTensors tensors{p.data(), g.data(), b.data(), master.data(), numel.data(),
                                    static_cast<int>(n)};
  kernels::SgdScalars scalars{};
  scalars.lr = static_cast<float>(lr);
  scalars.momentum = static_cast<float>(momentum);
  scalars.weight_decay = static_cast<float>(weight_decay);
  scalars.one_minus_dampening = static_cast<float>(1.0 - dampening);
  scalars.nesterov = nesterov;
  scalars.maximize = maximize;
  scalars.is_first_step = is_first_step;
  scalars.has_buffer = !momentum_buffers.empty();
  scalars.grad_scale = optional_ptr(grad_scale);
  scalars.found_inf = optional_ptr(found_inf);
  scalars.lr_device = device_scalar(lr_tensor);
  C10_CUDA_CHECK(kernels::launch_fused_sgd(float_type(params[0].scalar_type(), kOp),
                                           !master_params.empty(), tensors, scalars,
                                           multi_tensor_blocks(),
                                           at::cuda::getCurrentCUDAStream()));
}

// Sum of squares of each tensor of a single-dtype group: [k] float32, or
// float64 for float64 tensors (accumulated in double, as the CPU reference).
at::Tensor group_sum_squares(const std::vector<at::Tensor>& group) {
  constexpr const char* kOp = "fusetrain::multi_tensor_l2norm";
  const int n = static_cast<int>(group.size());
  std::vector<void*> ptrs(n);
  std::vector<int64_t> numel(n);
  int64_t chunks = 0;
  for (int i = 0; i < n; ++i) {
    ptrs[i] = group[i].data_ptr();
    numel[i] = group[i].numel();
    chunks += kernels::chunks_of(numel[i]);
  }
  const at::ScalarType acc = group[0].scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto opts = at::TensorOptions().dtype(acc).device(group[0].device());
  at::Tensor partials = at::empty({std::max<int64_t>(chunks, 1)}, opts);
  at::Tensor per_sq = at::empty({n}, opts);
  C10_CUDA_CHECK(kernels::launch_sum_squares(
      float_type(group[0].scalar_type(), kOp), ptrs.data(), numel.data(), n, partials.data_ptr(),
      per_sq.data_ptr(), multi_tensor_blocks(), at::cuda::getCurrentCUDAStream()));
  return per_sq;
}

std::tuple<at::Tensor, at::Tensor> l2norm_cuda(at::TensorList tensors, bool per_tensor) {
  constexpr const char* kOp = "fusetrain::multi_tensor_l2norm";
  check_float_list(tensors, tensors[0].device(), kOp, "tensors");
  const c10::cuda::CUDAGuard guard(tensors[0].device());
  // One launch per dtype; results go back to the caller's order.
  std::map<at::ScalarType, std::vector<int64_t>> by_dtype;
  for (size_t i = 0; i < tensors.size(); ++i) {
    by_dtype[tensors[i].scalar_type()].push_back(static_cast<int64_t>(i));
  }
  // Sums of squares in double when any input is double (the others' float
  // sums widen exactly), else in float; the norms are float32 either way.
  const at::ScalarType acc = by_dtype.count(at::kDouble) ? at::kDouble : at::kFloat;
  const auto acc_opts = at::TensorOptions().dtype(acc).device(tensors[0].device());
  at::Tensor per_sq;
  for (const auto& [dtype, idx] : by_dtype) {
    std::vector<at::Tensor> group;
    for (int64_t i : idx) {
      const at::Tensor& t = tensors[i];
      group.push_back(t.is_non_overlapping_and_dense() ? t : t.contiguous());
    }
    at::Tensor sq = group_sum_squares(group).to(acc);
    if (by_dtype.size() == 1) {  // one dtype (the usual case): already in order
      per_sq = sq;
      break;
    }
    if (!per_sq.defined()) per_sq = at::empty({static_cast<int64_t>(tensors.size())}, acc_opts);
    // Back to the caller's positions; they travel as kernel parameters (no
    // host sync, capturable).
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    if (acc == at::kDouble) {
      C10_CUDA_CHECK(kernels::launch_scatter(sq.const_data_ptr<double>(), idx.data(),
                                             static_cast<int>(idx.size()),
                                             per_sq.data_ptr<double>(), stream));
    } else {
      C10_CUDA_CHECK(kernels::launch_scatter(sq.const_data_ptr<float>(), idx.data(),
                                             static_cast<int>(idx.size()),
                                             per_sq.data_ptr<float>(), stream));
    }
  }
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(tensors[0].device());
  at::Tensor total = per_sq.sum().sqrt().to(at::kFloat);
  return {total, per_tensor ? per_sq.sqrt().to(at::kFloat) : at::empty({0}, f32)};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusetrain, CUDA, m) {
  m.impl("fused_adamw_", &fused_adamw_cuda);
  m.impl("fused_sgd_", &fused_sgd_cuda);
  m.impl("multi_tensor_l2norm", &l2norm_cuda);
}

}  // namespace fusetrain::ops::cuda

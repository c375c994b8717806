// Fused optimizer and norm ops: the dispatcher entry points, the argument
// checks (shared by every backend) and the Meta implementations used by
// torch.compile's tracing. The CPU implementation is in cpu/optim_cpu.cpp, the
// CUDA glue in cuda/optim_cuda.cpp, the device-generic path in generic.cpp.
#include <fusetrain/ops/checks.h>
#include <fusetrain/ops/optim.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <unordered_map>

namespace fusetrain::ops {

namespace {

constexpr const char* kAdamOp = "fusetrain::fused_adamw_";
constexpr const char* kSgdOp = "fusetrain::fused_sgd_";
constexpr const char* kNormOp = "fusetrain::multi_tensor_l2norm";

void check_optional_scalar(const std::optional<at::Tensor>& t, const at::Tensor& ref,
                           const char* op, const char* name) {
  if (!t.has_value() || !t->defined()) return;
  check_scalar_tensor(*t, op, name, at::kFloat);
  check_same_device(*t, ref, op, name, "params[0]");
}

// `list` holds one tensor per parameter (or none when `allow_empty`), each
// laid out like its parameter so that flat element i matches element i.
void check_state_list(at::TensorList params, at::TensorList list, const char* op, const char* name,
                      std::optional<at::ScalarType> dtype, bool allow_empty) {
  if (allow_empty && list.empty()) return;
  TORCH_CHECK(list.size() == params.size(), op, ": ", name, " has ", list.size(),
              " tensors but params has ", params.size());
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& t = list[i];
    const at::Tensor& p = params[i];
    TORCH_CHECK(t.defined(), op, ": ", name, "[", i, "] is undefined");
    TORCH_CHECK(t.device() == p.device(), op, ": ", name, "[", i, "] is on ", t.device(),
                " but params[", i, "] is on ", p.device());
    TORCH_CHECK(t.sizes() == p.sizes(), op, ": ", name, "[", i, "] has shape ", t.sizes(),
                " but params[", i, "] has shape ", p.sizes());
    TORCH_CHECK(t.strides() == p.strides(), op, ": ", name, "[", i, "] has strides ", t.strides(),
                " but params[", i, "] has strides ", p.strides(),
                "; create optimizer state with torch.zeros_like(param)");
    const at::ScalarType want = dtype.value_or(p.scalar_type());
    TORCH_CHECK(t.scalar_type() == want, op, ": ", name, "[", i, "] must be ", want, ", got ",
                t.scalar_type());
  }
}

// Non-empty, dense, floating point, one device and one dtype.
void check_params(at::TensorList params, const char* op) {
  TORCH_CHECK(!params.empty(), op, ": params is empty");
  check_float_list(params, params[0].device(), op, "params");
  const at::ScalarType dtype = params[0].scalar_type();
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(params[i].is_non_overlapping_and_dense(), op, ": params[", i,
                "] must be dense (non-overlapping, no gaps); got strides ", params[i].strides());
    TORCH_CHECK(params[i].scalar_type() == dtype, op, ": params[", i, "] is ",
                params[i].scalar_type(), " but params[0] is ", dtype,
                "; group parameters by dtype");
  }
}

// A device-side learning rate: one float32/float64 element on the params' device.
void check_lr_tensor(const std::optional<at::Tensor>& lr, const at::Tensor& ref, const char* op) {
  if (!lr.has_value() || !lr->defined()) return;
  TORCH_CHECK(lr->numel() == 1, op, ": lr_tensor must hold exactly one element, got shape ",
              lr->sizes());
  TORCH_CHECK(lr->scalar_type() == at::kFloat || lr->scalar_type() == at::kDouble, op,
              ": lr_tensor must be float32 or float64, got ", lr->scalar_type());
  check_same_device(*lr, ref, op, "lr_tensor", "params[0]");
}

void check_steps(at::TensorList params, at::TensorList steps, const char* op) {
  TORCH_CHECK(steps.size() == params.size(), op, ": state_steps has ", steps.size(),
              " tensors but params has ", params.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    const std::string name = "state_steps[" + std::to_string(i) + "]";
    check_scalar_tensor(steps[i], op, name.c_str(), at::kFloat);
    TORCH_CHECK(steps[i].device() == params[i].device(), op, ": state_steps[", i, "] is on ",
                steps[i].device(), " but params[", i, "] is on ", params[i].device());
  }
  // Each step is incremented once per parameter (on CUDA by its own thread):
  // a counter shared by two parameters would count twice, or lose updates.
  // Meta and fake tensors have no data to compare.
  if (steps.empty() || steps[0].is_meta() || !steps[0].has_storage()) return;
  std::unordered_map<const void*, size_t> owner;
  owner.reserve(steps.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    const auto [it, fresh] = owner.emplace(steps[i].const_data_ptr(), i);
    TORCH_CHECK(fresh, op, ": state_steps[", it->second, "] and state_steps[", i,
                "] are the same step counter; give every parameter a step tensor of its own "
                "(as torch's optimizers keep one per parameter)");
  }
}

// ------------------------------------------------------------------ Meta

void fused_adamw_meta(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                      at::TensorList master_params, at::TensorList state_steps, double, double,
                      double, double, double, bool amsgrad, bool, bool,
                      const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf,
                      const std::optional<at::Tensor>& lr_tensor) {
  check_adamw_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params,
                   state_steps, amsgrad, grad_scale, found_inf, lr_tensor);
}

void fused_sgd_meta(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                    at::TensorList master_params, double, double momentum, double, double, bool,
                    bool, bool, const std::optional<at::Tensor>& grad_scale,
                    const std::optional<at::Tensor>& found_inf,
                    const std::optional<at::Tensor>& lr_tensor) {
  check_sgd_args(params, grads, momentum_buffers, master_params, momentum, grad_scale, found_inf,
                 lr_tensor);
}

std::tuple<at::Tensor, at::Tensor> l2norm_meta(at::TensorList tensors, bool per_tensor) {
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(at::kMeta);
  return {at::empty({}, opts),
          at::empty({per_tensor ? static_cast<int64_t>(tensors.size()) : 0}, opts)};
}

}  // namespace

void check_adamw_args(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                      at::TensorList master_params, at::TensorList state_steps, bool amsgrad,
                      const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf,
                      const std::optional<at::Tensor>& lr_tensor) {
  check_params(params, kAdamOp);
  const bool master = !master_params.empty();
  const std::optional<at::ScalarType> state_dtype =
      master ? std::optional<at::ScalarType>(at::kFloat) : std::nullopt;
  check_state_list(params, grads, kAdamOp, "grads", std::nullopt, false);
  check_state_list(params, exp_avgs, kAdamOp, "exp_avgs", state_dtype, false);
  check_state_list(params, exp_avg_sqs, kAdamOp, "exp_avg_sqs", state_dtype, false);
  TORCH_CHECK(amsgrad || max_exp_avg_sqs.empty(), kAdamOp,
              ": max_exp_avg_sqs must be empty without amsgrad");
  check_state_list(params, max_exp_avg_sqs, kAdamOp, "max_exp_avg_sqs", state_dtype, !amsgrad);
  check_state_list(params, master_params, kAdamOp, "master_params", at::kFloat, true);
  check_steps(params, state_steps, kAdamOp);
  check_optional_scalar(grad_scale, params[0], kAdamOp, "grad_scale");
  check_optional_scalar(found_inf, params[0], kAdamOp, "found_inf");
  check_lr_tensor(lr_tensor, params[0], kAdamOp);
}

void check_sgd_args(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                    at::TensorList master_params, double momentum,
                    const std::optional<at::Tensor>& grad_scale,
                    const std::optional<at::Tensor>& found_inf,
                    const std::optional<at::Tensor>& lr_tensor) {
  check_params(params, kSgdOp);
  const bool master = !master_params.empty();
  const std::optional<at::ScalarType> state_dtype =
      master ? std::optional<at::ScalarType>(at::kFloat) : std::nullopt;
  check_state_list(params, grads, kSgdOp, "grads", std::nullopt, false);
  TORCH_CHECK(momentum != 0 || momentum_buffers.empty(), kSgdOp,
              ": momentum_buffers must be empty when momentum is 0");
  check_state_list(params, momentum_buffers, kSgdOp, "momentum_buffers", state_dtype,
                   momentum == 0);
  check_state_list(params, master_params, kSgdOp, "master_params", at::kFloat, true);
  check_optional_scalar(grad_scale, params[0], kSgdOp, "grad_scale");
  check_optional_scalar(found_inf, params[0], kSgdOp, "found_inf");
  check_lr_tensor(lr_tensor, params[0], kSgdOp);
}

void fused_adamw_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                  at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                  at::TensorList master_params, at::TensorList state_steps, const AdamHyper& h,
                  const std::optional<at::Tensor>& grad_scale,
                  const std::optional<at::Tensor>& found_inf,
                  const std::optional<at::Tensor>& lr_tensor) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow(kAdamOp, "")
          .typed<void(at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                      at::TensorList, at::TensorList, at::TensorList, double, double, double,
                      double, double, bool, bool, bool, const std::optional<at::Tensor>&,
                      const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>();
  op.call(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, state_steps, h.lr,
          h.beta1, h.beta2, h.weight_decay, h.eps, h.amsgrad, h.maximize, h.decoupled_weight_decay,
          grad_scale, found_inf, lr_tensor);
}

void fused_sgd_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                at::TensorList master_params, const SgdHyper& h, bool is_first_step,
                const std::optional<at::Tensor>& grad_scale,
                const std::optional<at::Tensor>& found_inf,
                const std::optional<at::Tensor>& lr_tensor) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow(kSgdOp, "")
          .typed<void(at::TensorList, at::TensorList, at::TensorList, at::TensorList, double,
                      double, double, double, bool, bool, bool, const std::optional<at::Tensor>&,
                      const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>();
  op.call(params, grads, momentum_buffers, master_params, h.lr, h.momentum, h.dampening,
          h.weight_decay, h.nesterov, h.maximize, is_first_step, grad_scale, found_inf, lr_tensor);
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(at::TensorList tensors, bool per_tensor) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow(kNormOp, "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(at::TensorList, bool)>();
  return op.call(tensors, per_tensor);
}

TORCH_LIBRARY_IMPL(fusetrain, Meta, m) {
  m.impl("fused_adamw_", &fused_adamw_meta);
  m.impl("fused_sgd_", &fused_sgd_meta);
  m.impl("multi_tensor_l2norm", &l2norm_meta);
}

}  // namespace fusetrain::ops

// C++ entry points of the fused optimizer and norm ops (dispatcher calls:
// one call serves CPU and CUDA tensors). Semantics: csrc/ops/schemas.cpp.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace fusetrain::ops {

struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double weight_decay = 1e-2;
  double eps = 1e-8;
  bool amsgrad = false;
  bool maximize = false;
  /// AdamW (true) or Adam with L2 weight decay (false).
  bool decoupled_weight_decay = true;
};

struct SgdHyper {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool maximize = false;
};

void fused_adamw_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                  at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                  at::TensorList master_params, at::TensorList state_steps, const AdamHyper& h,
                  const std::optional<at::Tensor>& grad_scale = std::nullopt,
                  const std::optional<at::Tensor>& found_inf = std::nullopt,
                  const std::optional<at::Tensor>& lr_tensor = std::nullopt);

void fused_sgd_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                at::TensorList master_params, const SgdHyper& h, bool is_first_step,
                const std::optional<at::Tensor>& grad_scale = std::nullopt,
                const std::optional<at::Tensor>& found_inf = std::nullopt,
                const std::optional<at::Tensor>& lr_tensor = std::nullopt);

/// {total L2 norm (0-d float32), per-tensor norms ([n] float32, empty unless per_tensor)}.
std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(at::TensorList tensors,
                                                       bool per_tensor = false);

/// Argument checks shared by the CPU and CUDA implementations.
void check_adamw_args(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                      at::TensorList master_params, at::TensorList state_steps, bool amsgrad,
                      const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf,
                      const std::optional<at::Tensor>& lr_tensor);
void check_sgd_args(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                    at::TensorList master_params, double momentum,
                    const std::optional<at::Tensor>& grad_scale,
                    const std::optional<at::Tensor>& found_inf,
                    const std::optional<at::Tensor>& lr_tensor);

}  // namespace fusetrain::ops

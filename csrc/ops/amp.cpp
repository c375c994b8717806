// Mixed-precision ops: the dispatcher entry points, the argument checks (shared
// by every backend) and the Meta implementations used by torch.compile's
// tracing. The CPU implementation is in cpu/amp_cpu.cpp, the CUDA glue in
// cuda/amp_cuda.cpp, the device-generic path in generic.cpp.
#include <fusetrain/ops/amp.h>
#include <fusetrain/ops/checks.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace fusetrain::ops {

namespace {
constexpr const char* kUnscaleOp = "fusetrain::non_finite_check_and_unscale_";
constexpr const char* kUpdateOp = "fusetrain::update_scale_";
}  // namespace

void check_unscale_args(at::TensorList tensors, const at::Tensor& found_inf,
                        const at::Tensor& inv_scale) {
  check_scalar_tensor(found_inf, kUnscaleOp, "found_inf", at::kFloat);
  check_scalar_tensor(inv_scale, kUnscaleOp, "inv_scale", at::kFloat);
  check_same_device(inv_scale, found_inf, kUnscaleOp, "inv_scale", "found_inf");
  check_float_list(tensors, found_inf.device(), kUnscaleOp, "self");
}

void check_update_scale_args(const at::Tensor& scale, const at::Tensor& growth_tracker,
                             const at::Tensor& overflow_tracker, const at::Tensor& found_inf,
                             double growth_factor, double backoff_factor, int64_t growth_interval,
                             double max_scale, int64_t hysteresis) {
  check_scalar_tensor(scale, kUpdateOp, "self (the scale)", at::kFloat);
  check_scalar_tensor(growth_tracker, kUpdateOp, "growth_tracker", at::kInt);
  check_scalar_tensor(overflow_tracker, kUpdateOp, "overflow_tracker", at::kInt);
  check_scalar_tensor(found_inf, kUpdateOp, "found_inf", at::kFloat);
  check_same_device(growth_tracker, scale, kUpdateOp, "growth_tracker", "the scale");
  check_same_device(overflow_tracker, scale, kUpdateOp, "overflow_tracker", "the scale");
  check_same_device(found_inf, scale, kUpdateOp, "found_inf", "the scale");
  TORCH_CHECK(growth_factor > 1.0, kUpdateOp, ": growth_factor must be > 1, got ", growth_factor);
  TORCH_CHECK(backoff_factor > 0.0 && backoff_factor < 1.0, kUpdateOp,
              ": backoff_factor must be in (0, 1), got ", backoff_factor);
  TORCH_CHECK(growth_interval > 0, kUpdateOp, ": growth_interval must be > 0, got ",
              growth_interval);
  TORCH_CHECK(max_scale > 0.0, kUpdateOp, ": max_scale must be > 0, got ", max_scale);
  TORCH_CHECK(hysteresis >= 0, kUpdateOp, ": hysteresis must be >= 0, got ", hysteresis);
}

void non_finite_check_and_unscale_(at::TensorList tensors, at::Tensor& found_inf,
                                   const at::Tensor& inv_scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow(kUnscaleOp, "")
                       .typed<void(at::TensorList, at::Tensor&, const at::Tensor&)>();
  op.call(tensors, found_inf, inv_scale);
}

at::Tensor& update_scale_(at::Tensor& scale, at::Tensor& growth_tracker,
                          at::Tensor& overflow_tracker, const at::Tensor& found_inf,
                          const ScaleUpdateOptions& o) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow(kUpdateOp, "")
                       .typed<at::Tensor&(at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,
                                          double, double, int64_t, double, int64_t)>();
  return op.call(scale, growth_tracker, overflow_tracker, found_inf, o.growth_factor,
                 o.backoff_factor, o.growth_interval, o.max_scale, o.hysteresis);
}

namespace {

void unscale_meta(at::TensorList tensors, at::Tensor& found_inf, const at::Tensor& inv_scale) {
  check_unscale_args(tensors, found_inf, inv_scale);
}

at::Tensor& update_scale_meta(at::Tensor& scale, at::Tensor& growth_tracker,
                              at::Tensor& overflow_tracker, const at::Tensor& found_inf,
                              double growth_factor, double backoff_factor, int64_t growth_interval,
                              double max_scale, int64_t hysteresis) {
  check_update_scale_args(scale, growth_tracker, overflow_tracker, found_inf, growth_factor,
                          backoff_factor, growth_interval, max_scale, hysteresis);
  return scale;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusetrain, Meta, m) {
  m.impl("non_finite_check_and_unscale_", &unscale_meta);
  m.impl("update_scale_", &update_scale_meta);
}

}  // namespace fusetrain::ops

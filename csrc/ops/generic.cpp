// The device-generic implementations (Note [Device-generic ops], generic.h):
// ATen operations only, registered under CompositeExplicitAutograd.
#include <fusetrain/ops/amp.h>
#include <fusetrain/ops/batch_norm.h>
#include <fusetrain/ops/checks.h>
#include <fusetrain/ops/cross_entropy.h>
#include <fusetrain/ops/generic.h>
#include <fusetrain/ops/max_pool.h>
#include <fusetrain/ops/optim.h>

#include <torch/library.h>

#include <limits>
#include <string>
#include <vector>

namespace fusetrain::ops::generic {

namespace {

// The widest float type the backend computes in, for step-dependent scalars
// and norm sums: float64 on the CPU, CUDA and XPU; float32 on the rest (MPS
// and most accelerators have no float64).
at::ScalarType wide_float(const at::Device& device) {
  switch (device.type()) {
    case c10::DeviceType::CPU:
    case c10::DeviceType::CUDA:
    case c10::DeviceType::XPU:
    case c10::DeviceType::Meta:
      return at::kDouble;
    default:
      return at::kFloat;
  }
}

// The type a parameter's update is computed in: float64 for float64 params,
// float32 for the rest (the CPU kernels' OpMath).
at::ScalarType math_type(const at::Tensor& param) {
  return param.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// sqrt(x), correctly rounded. torch's vectorised float32 sqrt on the CPU is
// not (about 0.7% of uniform inputs come out an ulp off); the float64 root
// of a float rounded to float32 is (53 >= 2 * 24 + 2 bits), so there it goes
// through float64. Other backends' sqrt is their own.
at::Tensor sqrt_rounded(const at::Tensor& x) {
  if (x.is_cpu() && x.scalar_type() == at::kFloat)
    return at::sqrt(x.to(at::kDouble)).to(at::kFloat);
  return at::sqrt(x);
}

// A non-zero found_inf as a 0-d bool on the device, or none.
std::optional<at::Tensor> skip_mask(const std::optional<at::Tensor>& found_inf) {
  if (!given(found_inf)) return std::nullopt;
  return found_inf->reshape({}).ne(0);
}

// dst := value, or dst unchanged where `skip` is set (a skipped step).
void assign(const at::Tensor& dst, const at::Tensor& value, const std::optional<at::Tensor>& skip) {
  if (skip.has_value()) {
    dst.copy_(at::where(*skip, dst, value));
  } else {
    dst.copy_(value);
  }
}

// A step's gradient in the math type: divided by `scale` (the quotient
// written back to `grad`, as torch's fused optimizers leave p.grad), then
// negated for `maximize`.
at::Tensor step_gradient(const at::Tensor& grad, at::ScalarType math,
                         const std::optional<at::Tensor>& scale, bool maximize,
                         const std::optional<at::Tensor>& skip) {
  at::Tensor g = grad.to(math);
  if (scale.has_value()) {
    g = g.div(*scale);
    assign(grad, g, skip);
  }
  return maximize ? g.neg() : g;
}

}  // namespace

// ------------------------------------------------------- loss-scale ops

void non_finite_check_and_unscale_(at::TensorList self, at::Tensor& found_inf,
                                   const at::Tensor& inv_scale) {
  check_unscale_args(self, found_inf, inv_scale);
  const at::Tensor inv = inv_scale.reshape({});
  std::vector<at::Tensor> finite;
  std::vector<at::Tensor> float32;
  finite.reserve(self.size());
  for (const at::Tensor& t : self) {
    if (t.numel() == 0) continue;
    // Checked before scaling: a finite value that the scale takes past the
    // dtype's range is not an overflow of the backward.
    finite.push_back(at::isfinite(t).all());
  }
  if (finite.empty()) return;
  found_inf.masked_fill_(at::stack(finite).all().logical_not(), 1.f);
  for (const at::Tensor& t : self) {
    if (t.numel() == 0) continue;
    switch (t.scalar_type()) {
      case at::kFloat:
        float32.push_back(t);
        break;
      case at::kDouble:
        t.mul_(inv);  // in float64, as the CPU kernel does
        break;
      default:
        // 16-bit: the product in float32, rounded once (whatever the
        // backend's rule for a 16-bit tensor times a float32 scalar).
        t.copy_(t.to(at::kFloat).mul_(inv));
    }
  }
  if (!float32.empty()) at::_foreach_mul_(float32, inv);
}

at::Tensor& update_scale_(at::Tensor& scale, at::Tensor& growth_tracker,
                          at::Tensor& overflow_tracker, const at::Tensor& found_inf,
                          double growth_factor, double backoff_factor, int64_t growth_interval,
                          double max_scale, int64_t hysteresis) {
  check_update_scale_args(scale, growth_tracker, overflow_tracker, found_inf, growth_factor,
                          backoff_factor, growth_interval, max_scale, hysteresis);
  // The CPU kernel's branches as masks. Its products are formed in float64
  // and rounded; here in float32, which gives the same float whenever the
  // factor is a float (the exact product of two floats, rounded once):
  // the defaults 2 and 0.5 and every power of two.
  const at::Tensor s = scale.reshape({});
  const at::Tensor growth = growth_tracker.reshape({});
  const at::Tensor overflows = overflow_tracker.reshape({});
  const at::Tensor found = found_inf.reshape({}).ne(0);
  const at::Tensor back_off = found.logical_and(overflows.add(1).gt(hysteresis));
  const at::Tensor grow = found.logical_not().logical_and(growth.add(1).eq(growth_interval));
  const at::Tensor grown = at::clamp_max(s.mul(growth_factor), max_scale);
  const at::Tensor new_scale = at::where(
      back_off, s.mul(backoff_factor), at::where(grow.logical_and(at::isfinite(grown)), grown, s));
  const at::Tensor new_growth = at::where(found.logical_or(grow), 0, growth.add(1));
  const at::Tensor new_overflows =
      at::where(back_off.logical_or(grow), 0, at::where(found, overflows.add(1), overflows));
  scale.copy_(new_scale.reshape(scale.sizes()));
  growth_tracker.copy_(new_growth.reshape(growth_tracker.sizes()));
  overflow_tracker.copy_(new_overflows.reshape(overflow_tracker.sizes()));
  return scale;
}

// ---------------------------------------------------------- optimizers

void fused_adamw_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                  at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                  at::TensorList master_params, at::TensorList state_steps, double lr, double beta1,
                  double beta2, double weight_decay, double eps, bool amsgrad, bool maximize,
                  bool decoupled_weight_decay, const std::optional<at::Tensor>& grad_scale,
                  const std::optional<at::Tensor>& found_inf,
                  const std::optional<at::Tensor>& lr_tensor) {
  check_adamw_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params,
                   state_steps, amsgrad, grad_scale, found_inf, lr_tensor);
  const std::optional<at::Tensor> skip = skip_mask(found_inf);
  const bool master = !master_params.empty();
  const at::ScalarType M = math_type(params[0]);
  const at::ScalarType W = wide_float(params[0].device());
  const std::optional<at::Tensor> scale =
      given(grad_scale) ? std::optional<at::Tensor>(grad_scale->reshape({})) : std::nullopt;
  // The learning rate and what follows from it (adam_span: in float64, then
  // rounded to the math type).
  const at::Tensor lr_w = given(lr_tensor) ? lr_tensor->reshape({}).to(W)
                                           : at::scalar_tensor(lr, params[0].options().dtype(W));
  const at::Tensor decay = at::rsub(lr_w.mul(weight_decay), 1).to(M);
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor step = state_steps[i].add(1);
    assign(state_steps[i], step, skip);
    const at::Tensor step_w = step.reshape({}).to(W);
    const at::Tensor step_size = lr_w.div(at::rsub(at::pow(beta1, step_w), 1)).to(M);
    const at::Tensor bc2_sqrt = at::sqrt(at::rsub(at::pow(beta2, step_w), 1)).to(M);

    at::Tensor grad = step_gradient(grads[i], M, scale, maximize, skip);
    at::Tensor param = master ? master_params[i] : params[i].to(M);
    if (weight_decay != 0) {
      if (decoupled_weight_decay) {
        param = param.mul(decay);
      } else {
        grad = grad.add(param.mul(weight_decay));
      }
    }
    const at::Tensor m = exp_avgs[i].to(M).mul(beta1).add(grad.mul(1.0 - beta1));
    const at::Tensor v = exp_avg_sqs[i].to(M).mul(beta2).add(grad.mul(1.0 - beta2).mul(grad));
    assign(exp_avgs[i], m, skip);
    assign(exp_avg_sqs[i], v, skip);
    at::Tensor second = v;
    if (amsgrad) {
      const at::Tensor vmax = max_exp_avg_sqs[i].to(M);
      second = at::where(vmax.lt(v), v, vmax);  // std::max(vmax, v), NaNs included
      assign(max_exp_avg_sqs[i], second, skip);
    }
    const at::Tensor denom = sqrt_rounded(second).div(bc2_sqrt).add(eps);
    param = param.sub(m.mul(step_size).div(denom));
    if (master) assign(master_params[i], param, skip);
    assign(params[i], param, skip);
  }
}

void fused_sgd_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                at::TensorList master_params, double lr, double momentum, double dampening,
                double weight_decay, bool nesterov, bool maximize, bool is_first_step,
                const std::optional<at::Tensor>& grad_scale,
                const std::optional<at::Tensor>& found_inf,
                const std::optional<at::Tensor>& lr_tensor) {
  check_sgd_args(params, grads, momentum_buffers, master_params, momentum, grad_scale, found_inf,
                 lr_tensor);
  const std::optional<at::Tensor> skip = skip_mask(found_inf);
  const bool master = !master_params.empty();
  const bool has_buf = !momentum_buffers.empty();
  const at::ScalarType M = math_type(params[0]);
  const std::optional<at::Tensor> scale =
      given(grad_scale) ? std::optional<at::Tensor>(grad_scale->reshape({})) : std::nullopt;
  const at::Tensor lr_m = given(lr_tensor) ? lr_tensor->reshape({}).to(M)
                                           : at::scalar_tensor(lr, params[0].options().dtype(M));
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor grad = step_gradient(grads[i], M, scale, maximize, skip);
    at::Tensor param = master ? master_params[i] : params[i].to(M);
    if (weight_decay != 0) grad = grad.add(param.mul(weight_decay));
    if (has_buf) {
      const at::Tensor buf =
          is_first_step ? grad
                        : momentum_buffers[i].to(M).mul(momentum).add(grad.mul(1.0 - dampening));
      assign(momentum_buffers[i], buf, skip);
      grad = nesterov ? grad.add(buf.mul(momentum)) : buf;
    }
    param = param.sub(grad.mul(lr_m));
    if (master) assign(master_params[i], param, skip);
    assign(params[i], param, skip);
  }
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(at::TensorList tensors, bool per_tensor) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  if (tensors.empty()) {
    return {at::zeros({}, f32), at::zeros({0}, f32)};
  }
  check_float_list(tensors, tensors[0].device(), "fusetrain::multi_tensor_l2norm", "tensors");
  const at::ScalarType W = wide_float(tensors[0].device());
  std::vector<at::Tensor> sums;  // each tensor's sum of squares, in W
  sums.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    sums.push_back(at::linalg_vector_norm(t, 2, std::nullopt, false, W).square());
  }
  const at::Tensor per = at::stack(sums);
  const at::Tensor total = at::sqrt(per.sum()).to(at::kFloat);
  const auto out = tensors[0].options().dtype(at::kFloat);
  return {total, per_tensor ? at::sqrt(per).to(at::kFloat) : at::empty({0}, out)};
}

// -------------------------------------------------------- cross-entropy

namespace {

// What the forward and backward share: the logits in float32, which rows
// count, and each row's target clamped into range for the gather.
struct Rows {
  at::Tensor x;        // [N, C] float32
  at::Tensor kept;     // [N] bool: target != ignore_index
  at::Tensor invalid;  // [N] bool: kept but outside [0, C): NaN rows
  at::Tensor target;   // [N, 1] int64, in range
};

Rows rows_of(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index) {
  Rows r;
  const int64_t c = logits.size(1);
  r.x = logits.to(at::kFloat);
  r.kept = target.ne(ignore_index);
  const at::Tensor in_range = target.ge(0).logical_and(target.lt(c));
  r.invalid = r.kept.logical_and(in_range.logical_not());
  r.target = at::where(in_range, target, 0).unsqueeze(1);
  return r;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> softmax_cross_entropy_forward(
    const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index,
    double label_smoothing, c10::string_view reduction_view) {
  const std::string reduction(reduction_view);
  check_cross_entropy_forward_args(logits, target, label_smoothing, reduction);
  const Reduction red = parse_reduction(reduction, "fusetrain::softmax_cross_entropy_forward");
  const Rows r = rows_of(logits, target, ignore_index);
  const at::Tensor lse = at::logsumexp(r.x, {1});
  // (1 - ls) * nll + ls * mean_j(-log p_j), each a difference from lse.
  at::Tensor loss = lse.sub(r.x.gather(1, r.target).squeeze(1));
  if (label_smoothing != 0.0) {
    loss = loss.mul(1.0 - label_smoothing).add(lse.sub(r.x.mean(1)).mul(label_smoothing));
  }
  loss =
      at::where(r.kept, loss, 0.f).masked_fill(r.invalid, std::numeric_limits<float>::quiet_NaN());
  const at::Tensor kept_rows = kept_rows_output(r.kept.sum(), red);
  if (red == Reduction::kSum) return {loss.sum(), lse, kept_rows};
  // No kept row: 0 / 0 = NaN, as torch's mean gives.
  if (red == Reduction::kMean) return {loss.sum().div(kept_rows), lse, kept_rows};
  return {loss, lse, kept_rows};
}

at::Tensor softmax_cross_entropy_backward(const at::Tensor& grad_loss, const at::Tensor& logits,
                                          const at::Tensor& target, const at::Tensor& lse,
                                          int64_t ignore_index, double label_smoothing,
                                          c10::string_view reduction_view,
                                          const std::optional<at::Tensor>& kept_rows) {
  const std::string reduction(reduction_view);
  check_cross_entropy_backward_args(grad_loss, logits, target, lse, label_smoothing, reduction,
                                    kept_rows);
  const Reduction red = parse_reduction(reduction, "fusetrain::softmax_cross_entropy_backward");
  const int64_t c = logits.size(1);
  const Rows r = rows_of(logits, target, ignore_index);
  // The CPU kernel's order: (p - ls / C) everywhere, then - (1 - ls) at the
  // target, times grad_loss / divisor.
  const float ls = static_cast<float>(label_smoothing);
  at::Tensor grad = at::exp(r.x.sub(lse.unsqueeze(1)));
  if (ls != 0.f) grad = grad.sub(ls / static_cast<float>(c));
  grad = grad.scatter_add(1, r.target, at::full({logits.size(0), 1}, -(1.f - ls), r.x.options()));
  at::Tensor row_scale = red == Reduction::kNone ? grad_loss : grad_loss.reshape({});
  if (red == Reduction::kMean) {
    row_scale = row_scale.div(given(kept_rows) ? kept_rows->reshape({}) : r.kept.sum());
  }
  grad = grad.mul(red == Reduction::kNone ? row_scale.unsqueeze(1) : row_scale);
  grad = at::where(r.kept.unsqueeze(1), grad, 0.f)
             .masked_fill(r.invalid.unsqueeze(1), std::numeric_limits<float>::quiet_NaN());
  return grad.to(logits.scalar_type());
}

at::Tensor& softmax_cross_entropy_backward_out(const at::Tensor& grad_loss,
                                               const at::Tensor& logits, const at::Tensor& target,
                                               const at::Tensor& lse, int64_t ignore_index,
                                               double label_smoothing, c10::string_view reduction,
                                               const std::optional<at::Tensor>& kept_rows,
                                               at::Tensor& out) {
  check_cross_entropy_backward_out(logits, out);
  return out.copy_(softmax_cross_entropy_backward(grad_loss, logits, target, lse, ignore_index,
                                                  label_smoothing, reduction, kept_rows));
}

namespace {

// The dimensions batch norm reduces over (all but 1) and the shape that
// broadcasts a [C] tensor against the input.
struct ChannelDims {
  std::vector<int64_t> reduce;
  std::vector<int64_t> broadcast;
};

ChannelDims channel_dims(const at::Tensor& input) {
  ChannelDims d;
  for (int64_t i = 0; i < input.dim(); ++i) {
    if (i != 1) d.reduce.push_back(i);
    d.broadcast.push_back(i == 1 ? input.size(1) : 1);
  }
  return d;
}

at::Tensor param_or(const std::optional<at::Tensor>& t, const at::Tensor& input, float absent) {
  if (given(t)) return t->to(at::kFloat);
  return at::full({input.size(1)}, absent, input.options().dtype(at::kFloat));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_relu(
    const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, bool training, double momentum, double eps,
    bool relu) {
  check_batch_norm_forward_args(input, weight, bias, running_mean, running_var, training);
  const auto f32 = input.options().dtype(at::kFloat);
  if (input.numel() == 0) {  // nothing to normalise; the running statistics stay
    return {at::empty_like(input), at::zeros({input.size(1)}, f32), at::zeros({input.size(1)}, f32)};
  }
  const ChannelDims d = channel_dims(input);
  const at::Tensor x = input.to(at::kFloat);
  at::Tensor mean, var;
  if (training) {
    mean = x.mean(d.reduce);
    var = x.var(d.reduce, /*correction=*/0);
    if (given(running_mean)) {
      const double n = static_cast<double>(input.numel() / std::max<int64_t>(input.size(1), 1));
      const at::Tensor unbiased = var.mul(n / (n - 1.0));
      running_mean->copy_(running_mean->to(at::kFloat).mul(1.0 - momentum).add(mean.mul(momentum)));
      running_var->copy_(running_var->to(at::kFloat).mul(1.0 - momentum).add(unbiased.mul(momentum)));
    }
  } else {
    // Copies: the outputs must not alias the buffers the next step updates.
    mean = running_mean->to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    var = running_var->to(at::kFloat);
  }
  const at::Tensor invstd = var.add(eps).rsqrt();
  // The CPU kernels' form: (x - mean) * alpha + b.
  const at::Tensor alpha = invstd.mul(param_or(weight, input, 1.f));
  at::Tensor y = x.sub(mean.view(d.broadcast))
                     .mul(alpha.view(d.broadcast))
                     .add(param_or(bias, input, 0.f).view(d.broadcast));
  if (relu) y = at::relu(y);
  at::Tensor out = at::empty_like(input, input.options().dtype(input.scalar_type()));
  out.copy_(y);
  return {out, mean.contiguous(), invstd.contiguous()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_relu_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const std::optional<at::Tensor>& output,
    const std::optional<at::Tensor>& weight, const at::Tensor& save_mean,
    const at::Tensor& save_invstd, bool training, bool relu, std::array<bool, 3> output_mask) {
  check_batch_norm_backward_args(grad_out, input, output, weight, save_mean, save_invstd, relu);
  const ChannelDims d = channel_dims(input);
  at::Tensor g = grad_out.to(at::kFloat);
  if (relu) g = at::where(output->le(0), 0.f, g);  // threshold_backward's mask: NaN passes
  const at::Tensor invstd = save_invstd.view(d.broadcast);
  const at::Tensor centred = input.to(at::kFloat).sub(save_mean.view(d.broadcast));
  const at::Tensor sg = g.sum(d.reduce);
  const at::Tensor sgx = g.mul(centred).sum(d.reduce);
  const at::ScalarType param_dtype = given(weight) ? weight->scalar_type() : at::kFloat;
  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0]) {
    const at::Tensor a = param_or(weight, input, 1.f).view(d.broadcast).mul(invstd);
    at::Tensor gi = g;
    if (training) {
      const double n = static_cast<double>(input.numel() / std::max<int64_t>(input.size(1), 1));
      gi = g.sub(sg.view(d.broadcast).div(n))
               .sub(centred.mul(invstd.square()).mul(sgx.view(d.broadcast).div(n)));
    }
    grad_input = at::empty_like(input);
    grad_input.copy_(gi.mul(a));
  }
  if (output_mask[1] && given(weight)) grad_weight = sgx.mul(save_invstd).to(param_dtype);
  if (output_mask[2]) grad_bias = sg.to(param_dtype);
  return {grad_input, grad_weight, grad_bias};
}

namespace {

// A window's first row and column in the input plane, per output row
// ([OH, 1]) and column ([1, OW]), as int64 of `like`'s device.
std::pair<at::Tensor, at::Tensor> window_origins(int64_t oh, int64_t ow, int64_t kh, int64_t kw,
                                                 const at::Tensor& like) {
  const auto opts = like.options().dtype(at::kLong);
  return {at::arange(oh, opts).mul_(kh).view({oh, 1}), at::arange(ow, opts).mul_(kw).view({1, ow})};
}

}  // namespace

// torch's max_pool2d_with_indices, its flat indices (h * W + w) turned into
// positions in the window, and back for the backward.
std::tuple<at::Tensor, at::Tensor> max_pool2d(const at::Tensor& input, at::IntArrayRef kernel_size) {
  const auto [oh, ow] = check_max_pool2d_args(input, kernel_size);
  const int64_t kh = kernel_size[0], kw = kernel_size.size() == 2 ? kernel_size[1] : kh;
  auto [out, indices] = at::max_pool2d_with_indices(input, {kh, kw}, {kh, kw});
  const auto [row0, col0] = window_origins(oh, ow, kh, kw, indices);
  const int64_t w = input.size(3);
  const at::Tensor i = indices.div(w, "floor").sub_(row0);
  const at::Tensor j = indices.remainder(w).sub_(col0);
  return {out, i.mul_(kw).add_(j).to(at::kByte)};
}

at::Tensor max_pool2d_backward(const at::Tensor& grad_out, const at::Tensor& input,
                               const at::Tensor& argmax, at::IntArrayRef kernel_size) {
  check_max_pool2d_backward_args(grad_out, input, argmax, kernel_size);
  const auto [oh, ow] = check_max_pool2d_args(input, kernel_size);
  const int64_t kh = kernel_size[0], kw = kernel_size.size() == 2 ? kernel_size[1] : kh;
  const auto [row0, col0] = window_origins(oh, ow, kh, kw, argmax);
  const at::Tensor pos = argmax.to(at::kLong);
  const at::Tensor indices = pos.div(kw, "floor").add_(row0).mul_(input.size(3)).add_(
      pos.remainder(kw).add_(col0));
  return at::max_pool2d_with_indices_backward(grad_out, input, {kh, kw}, {kh, kw}, {0, 0}, {1, 1},
                                              false, indices);
}

}  // namespace fusetrain::ops::generic

// Every backend without a kernel of its own (Note [Device-generic ops]).
TORCH_LIBRARY_IMPL(fusetrain, CompositeExplicitAutograd, m) {
  namespace g = fusetrain::ops::generic;
  m.impl("non_finite_check_and_unscale_", &g::non_finite_check_and_unscale_);
  m.impl("update_scale_", &g::update_scale_);
  m.impl("fused_adamw_", &g::fused_adamw_);
  m.impl("fused_sgd_", &g::fused_sgd_);
  m.impl("multi_tensor_l2norm", &g::multi_tensor_l2norm);
  m.impl("softmax_cross_entropy_forward", &g::softmax_cross_entropy_forward);
  m.impl("softmax_cross_entropy_backward", &g::softmax_cross_entropy_backward);
  m.impl("softmax_cross_entropy_backward.out", &g::softmax_cross_entropy_backward_out);
  m.impl("max_pool2d", &g::max_pool2d);
  m.impl("max_pool2d_backward", &g::max_pool2d_backward);
  m.impl("batch_norm_relu", &g::batch_norm_relu);
  m.impl("batch_norm_relu_backward", &g::batch_norm_relu_backward);
}

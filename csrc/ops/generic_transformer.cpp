// The device-generic implementations (Note [Device-generic ops], generic.h)
// of the fused transformer-block ops: layer / RMS norm (Note [Fused norms])
// and bias + GELU / SwiGLU (Note [Fused activations]), as ATen compositions
// in float32. On the CPU they run with FUSETRAIN_CPU_PATH=generic, which is
// how the tests hold them to the CPU kernels.
#include <fusetrain/ops/activation.h>
#include <fusetrain/ops/checks.h>
#include <fusetrain/ops/generic.h>
#include <fusetrain/ops/norm.h>
#include <fusetrain/ops/rotary.h>

#include <torch/library.h>

#include <cmath>

namespace fusetrain::ops::generic {

namespace {

at::Tensor float_row(const std::optional<at::Tensor>& t, int64_t width, float absent,
                     const at::Tensor& like) {
  if (given(t)) return t->to(at::kFloat).reshape({width});
  return at::full({width}, absent, like.options().dtype(at::kFloat));
}

// out, residual_out, mean, rstd; `rms` drops the centring (mean stays 0).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_forward(
    const NormShape& s, bool rms, const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    const std::optional<at::Tensor>& residual) {
  const auto stat_shape = norm_stat_shape(input, normalized_shape);
  const auto f32 = input.options().dtype(at::kFloat);
  at::Tensor sum = given(residual) ? input.add(*residual) : at::empty({0}, input.options());
  if (s.rows == 0) {
    return {at::empty(input.sizes(), input.options().dtype(s.out_dtype)), sum,
            at::zeros(stat_shape, f32), at::full(stat_shape, 1.0 / std::sqrt(eps), f32)};
  }
  const at::Tensor x = (given(residual) ? sum : input).to(at::kFloat).reshape({s.rows, s.width});
  const at::Tensor mean = rms ? at::zeros({s.rows, 1}, f32) : x.mean(1, /*keepdim=*/true);
  const at::Tensor centred = x.sub(mean);
  const at::Tensor rstd = centred.square().mean(1, true).add(eps).rsqrt();
  const at::Tensor y = centred.mul(rstd)
                           .mul(float_row(weight, s.width, 1.f, input))
                           .add(float_row(bias, s.width, 0.f, input));
  return {y.to(s.out_dtype).view(input.sizes()), sum, mean.view(stat_shape),
          rstd.view(stat_shape)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_backward(
    const NormShape& s, bool rms, const at::Tensor& grad_out,
    const std::optional<at::Tensor>& grad_residual_out, const at::Tensor& normed,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& mean_in, const at::Tensor& rstd_in, std::array<bool, 3> mask) {
  const auto f32 = normed.options().dtype(at::kFloat);
  const at::Tensor x = normed.to(at::kFloat).reshape({s.rows, s.width});
  const at::Tensor mean = rms ? at::zeros({s.rows, 1}, f32) : mean_in.reshape({s.rows, 1});
  const at::Tensor rstd = rstd_in.reshape({s.rows, 1});
  const at::Tensor xhat = x.sub(mean).mul(rstd);
  const at::Tensor gy = grad_out.to(at::kFloat).reshape({s.rows, s.width});
  at::Tensor grad_input, grad_weight, grad_bias;
  if (mask[0]) {
    const at::Tensor g = gy.mul(float_row(weight, s.width, 1.f, normed));
    at::Tensor d = g.sub(xhat.mul(g.mul(xhat).mean(1, true)));
    if (!rms) d = d.sub(g.mean(1, true));
    d = d.mul(rstd);
    if (given(grad_residual_out)) d = d.add(grad_residual_out->to(at::kFloat).reshape(d.sizes()));
    grad_input = d.to(normed.scalar_type()).view(normed.sizes());
  }
  if (mask[1] && given(weight)) {
    grad_weight = gy.mul(xhat).sum(0).to(weight->scalar_type()).view(weight->sizes());
  }
  if (mask[2] && given(bias)) grad_bias = gy.sum(0).to(bias->scalar_type()).view(bias->sizes());
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm(
    const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    const std::optional<at::Tensor>& residual, std::optional<at::ScalarType> out_dtype) {
  const NormShape s = check_norm_forward_args("fusetrain::layer_norm", input, normalized_shape,
                                              weight, bias, residual, out_dtype);
  return norm_forward(s, false, input, normalized_shape, weight, bias, eps, residual);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_residual_out,
    const at::Tensor& normed, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& mean, const at::Tensor& rstd, std::array<bool, 3> output_mask) {
  const NormShape s =
      check_norm_backward_args("fusetrain::layer_norm_backward", grad_out, grad_residual_out,
                               normed, normalized_shape, weight, bias, mean, rstd);
  return norm_backward(s, false, grad_out, grad_residual_out, normed, weight, bias, mean, rstd,
                       output_mask);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm(
    const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, std::optional<double> eps,
    const std::optional<at::Tensor>& residual, std::optional<at::ScalarType> out_dtype) {
  const NormShape s = check_norm_forward_args("fusetrain::rms_norm", input, normalized_shape,
                                              weight, std::nullopt, residual, out_dtype);
  auto [out, sum, mean, rstd] =
      norm_forward(s, true, input, normalized_shape, weight, std::nullopt,
                   rms_norm_eps(eps, input.scalar_type()), residual);
  return {out, sum, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_residual_out,
    const at::Tensor& normed, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const at::Tensor& rstd,
    std::array<bool, 2> output_mask) {
  const NormShape s =
      check_norm_backward_args("fusetrain::rms_norm_backward", grad_out, grad_residual_out,
                               normed, normalized_shape, weight, std::nullopt, std::nullopt, rstd);
  auto [dx, dw, db] = norm_backward(s, true, grad_out, grad_residual_out, normed, weight,
                                    std::nullopt, rstd, rstd, {output_mask[0], output_mask[1], false});
  return {dx, dw};
}

namespace {

// x + bias rounded to x's dtype, then in float32 (Note [Fused activations]).
at::Tensor biased(const at::Tensor& input, const std::optional<at::Tensor>& bias) {
  at::Tensor x = given(bias) ? input.add(bias->to(input.scalar_type())) : input;
  return x.to(at::kFloat);
}

// The halves of swiglu's one input.
std::pair<at::Tensor, at::Tensor> gate_and_up(const at::Tensor& a,
                                              const std::optional<at::Tensor>& b) {
  if (given(b)) return {a, *b};
  const auto halves = a.chunk(2, -1);
  return {halves[0], halves[1]};
}

}  // namespace

at::Tensor bias_gelu(const at::Tensor& input, const std::optional<at::Tensor>& bias,
                     c10::string_view approximate) {
  check_bias_gelu_args("fusetrain::bias_gelu", input, bias);
  const GeluApproximation form = parse_gelu_approximation(approximate, "fusetrain::bias_gelu");
  return at::gelu(biased(input, bias), form == GeluApproximation::kTanh ? "tanh" : "none")
      .to(input.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_backward(const at::Tensor& grad_out,
                                                      const at::Tensor& input,
                                                      const std::optional<at::Tensor>& bias,
                                                      c10::string_view approximate,
                                                      std::array<bool, 2> output_mask) {
  const char* op = "fusetrain::bias_gelu_backward";
  check_bias_gelu_args(op, input, bias, &grad_out);
  const GeluApproximation form = parse_gelu_approximation(approximate, op);
  const at::Tensor g = at::gelu_backward(grad_out.to(at::kFloat), biased(input, bias),
                                         form == GeluApproximation::kTanh ? "tanh" : "none");
  at::Tensor grad_bias;
  if (output_mask[1] && given(bias)) {
    grad_bias = g.reshape({-1, input.size(-1)}).sum(0).to(bias->scalar_type()).view(bias->sizes());
  }
  return {output_mask[0] ? g.to(input.scalar_type()) : at::Tensor(), grad_bias};
}

at::Tensor swiglu(const at::Tensor& a, const std::optional<at::Tensor>& b) {
  check_swiglu_args("fusetrain::swiglu", a, b);
  const auto [gate, up] = gate_and_up(a, b);
  return at::silu(gate.to(at::kFloat)).mul(up.to(at::kFloat)).to(a.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad_out, const at::Tensor& a,
                                                   const std::optional<at::Tensor>& b) {
  check_swiglu_args("fusetrain::swiglu_backward", a, b, &grad_out);
  const auto [gate_in, up_in] = gate_and_up(a, b);
  const at::Tensor gate = gate_in.to(at::kFloat), up = up_in.to(at::kFloat);
  const at::Tensor g = grad_out.to(at::kFloat);
  const at::Tensor sig = at::sigmoid(gate);
  const at::Tensor grad_gate = g.mul(up).mul(sig).mul(gate.mul(sig.neg().add(1)).add(1));
  const at::Tensor grad_up = g.mul(gate.mul(sig));
  if (given(b)) return {grad_gate.to(a.scalar_type()), grad_up.to(b->scalar_type())};
  return {at::cat({grad_gate, grad_up}, -1).to(a.scalar_type()), at::empty({0}, a.options())};
}

namespace {

// x rotated by the angles of cos / sin (Note [Fused rotary]), in float32.
at::Tensor rotated(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t half,
                   bool interleaved, bool inverse) {
  const at::Tensor x32 = x.to(at::kFloat);
  const at::Tensor c = cos.to(at::kFloat);
  const at::Tensor s = inverse ? sin.to(at::kFloat).neg() : sin.to(at::kFloat);
  const at::Tensor rot = x32.narrow(-1, 0, 2 * half);
  at::Tensor x1, x2;
  if (interleaved) {
    const at::Tensor pairs = rot.unflatten(-1, {half, 2});
    x1 = pairs.select(-1, 0);
    x2 = pairs.select(-1, 1);
  } else {
    x1 = rot.narrow(-1, 0, half);
    x2 = rot.narrow(-1, half, half);
  }
  const at::Tensor y1 = x1.mul(c).sub(x2.mul(s));
  const at::Tensor y2 = x2.mul(c).add(x1.mul(s));
  const at::Tensor y = interleaved ? at::stack({y1, y2}, -1).flatten(-2) : at::cat({y1, y2}, -1);
  const int64_t rest = x.size(-1) - 2 * half;
  return (rest > 0 ? at::cat({y, x32.narrow(-1, 2 * half, rest)}, -1) : y).to(x.scalar_type());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const std::optional<at::Tensor>& k,
                                          const at::Tensor& cos, const at::Tensor& sin,
                                          bool interleaved, bool inverse) {
  const int64_t half = check_rotary_args("fusetrain::rotary", q, k, cos, sin);
  return {rotated(q, cos, sin, half, interleaved, inverse).contiguous(),
          given(k) ? rotated(*k, cos, sin, half, interleaved, inverse).contiguous()
                   : at::empty({0}, q.options())};
}

void rotary_(at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& cos,
             const at::Tensor& sin, bool interleaved, bool inverse) {
  const int64_t half = check_rotary_args("fusetrain::rotary_", q, k, cos, sin);
  q.copy_(rotated(q, cos, sin, half, interleaved, inverse));
  if (given(k)) {
    at::Tensor kt = *k;
    kt.copy_(rotated(kt, cos, sin, half, interleaved, inverse));
  }
}

}  // namespace fusetrain::ops::generic

TORCH_LIBRARY_IMPL(fusetrain, CompositeExplicitAutograd, m) {
  namespace g = fusetrain::ops::generic;
  m.impl("layer_norm", &g::layer_norm);
  m.impl("layer_norm_backward", &g::layer_norm_backward);
  m.impl("rms_norm", &g::rms_norm);
  m.impl("rms_norm_backward", &g::rms_norm_backward);
  m.impl("bias_gelu", &g::bias_gelu);
  m.impl("bias_gelu_backward", &g::bias_gelu_backward);
  m.impl("swiglu", &g::swiglu);
  m.impl("swiglu_backward", &g::swiglu_backward);
  m.impl("rotary", &g::rotary);
  m.impl("rotary_", &g::rotary_);
}

// fusetrain::nn's fused transformer-block functions: thin calls of the ops,
// whose autograd lives at the dispatcher (csrc/ops/autograd/).
#include <fusetrain/nn/block_ops.h>
#include <fusetrain/ops/activation.h>
#include <fusetrain/ops/norm.h>
#include <fusetrain/ops/rotary.h>

namespace fusetrain::nn {

namespace {
std::optional<at::Tensor> maybe(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}
}  // namespace

at::Tensor layer_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                      const at::Tensor& weight, const at::Tensor& bias, double eps,
                      std::optional<at::ScalarType> out_dtype) {
  return std::get<0>(ops::layer_norm(input, normalized_shape, maybe(weight), maybe(bias), eps,
                                     std::nullopt, out_dtype));
}

at::Tensor rms_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                    const at::Tensor& weight, std::optional<double> eps,
                    std::optional<at::ScalarType> out_dtype) {
  return std::get<0>(
      ops::rms_norm(input, normalized_shape, maybe(weight), eps, std::nullopt, out_dtype));
}

std::pair<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& input,
                                                 const at::Tensor& residual,
                                                 at::IntArrayRef normalized_shape,
                                                 const at::Tensor& weight, const at::Tensor& bias,
                                                 double eps,
                                                 std::optional<at::ScalarType> out_dtype) {
  auto [out, sum, mean, rstd] = ops::layer_norm(input, normalized_shape, maybe(weight),
                                                maybe(bias), eps, residual, out_dtype);
  return {out, sum};
}

std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& input, const at::Tensor& residual,
                                               at::IntArrayRef normalized_shape,
                                               const at::Tensor& weight, std::optional<double> eps,
                                               std::optional<at::ScalarType> out_dtype) {
  auto [out, sum, rstd] =
      ops::rms_norm(input, normalized_shape, maybe(weight), eps, residual, out_dtype);
  return {out, sum};
}

at::Tensor layer_norm(torch::nn::LayerNormImpl& ln, const at::Tensor& input) {
  const auto& o = ln.options;
  return layer_norm(input, o.normalized_shape(), ln.weight, ln.bias, o.eps());
}

at::Tensor gelu(const at::Tensor& input, const std::string& approximate, const at::Tensor& bias) {
  return ops::bias_gelu(input, maybe(bias), approximate);
}

at::Tensor swiglu(const at::Tensor& a, const at::Tensor& b) { return ops::swiglu(a, maybe(b)); }

std::pair<at::Tensor, at::Tensor> apply_rotary(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& cos, const at::Tensor& sin,
                                               bool interleaved) {
  at::Tensor c = cos, s = sin;
  if (!interleaved && cos.size(-1) == q.size(-1) && q.size(-1) % 2 == 0) {
    c = cos.narrow(-1, 0, q.size(-1) / 2);  // Hugging Face's cat([freqs, freqs])
    s = sin.narrow(-1, 0, q.size(-1) / 2);
  }
  auto [q_out, k_out] = ops::rotary(q, maybe(k), c, s, interleaved, /*inverse=*/false);
  return {q_out, k.defined() ? k_out : at::Tensor()};
}

}  // namespace fusetrain::nn

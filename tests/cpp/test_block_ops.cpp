// Tests of fusetrain::nn's fused transformer-block functions from C++
// (nn/block_ops.h): autograd reaches them through the dispatcher (their
// backward is registered at the Autograd key), so a LibTorch user's
// backward() gives the same gradients as torch's own functions computed in
// float64; and the LayerNorm module overload reads the module's options.
#include <fusetrain/nn/block_ops.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <catch2/catch.hpp>

namespace {

double max_err(const at::Tensor& a, const at::Tensor& ref) {
  return (a.to(at::kDouble) - ref.to(at::kDouble)).abs().max().item<double>();
}

at::Tensor leaf(const at::Tensor& t, at::ScalarType dtype = at::kFloat) {
  return t.detach().to(dtype).requires_grad_();
}

}  // namespace

TEST_CASE("add_layer_norm's gradients from C++ equal torch's in float64", "[block_ops]") {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const at::Tensor x0 = at::randn({13, 37}, gen) * 2 + 1, r0 = at::randn({13, 37}, gen);
  const at::Tensor w0 = at::randn({37}, gen), b0 = at::randn({37}, gen);
  const at::Tensor gy = at::randn({13, 37}, gen), gs = at::randn({13, 37}, gen);

  at::Tensor x = leaf(x0), r = leaf(r0), w = leaf(w0), b = leaf(b0);
  auto [out, sum] = fusetrain::nn::add_layer_norm(x, r, {37}, w, b, 1e-5);
  ((out * gy).sum() + (sum * gs).sum()).backward();

  at::Tensor xd = leaf(x0, at::kDouble), rd = leaf(r0, at::kDouble);
  at::Tensor wd = leaf(w0, at::kDouble), bd = leaf(b0, at::kDouble);
  const at::Tensor sd = xd + rd;
  const at::Tensor ref = at::layer_norm(sd, {37}, wd, bd, 1e-5);
  ((ref * gy.to(at::kDouble)).sum() + (sd * gs.to(at::kDouble)).sum()).backward();

  // float32: a few ulps of the values (|out| < 8, gradients < 40).
  CHECK(max_err(out, ref) < 4e-6);
  CHECK(max_err(sum, sd) < 1e-6);
  CHECK(max_err(x.grad(), xd.grad()) < 2e-5);
  CHECK(at::equal(x.grad(), r.grad()));
  CHECK(max_err(w.grad(), wd.grad()) < 2e-5);
  CHECK(max_err(b.grad(), bd.grad()) < 2e-5);
}

TEST_CASE("rms_norm, gelu and swiglu from C++ equal torch's", "[block_ops]") {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
  const at::Tensor x0 = at::randn({6, 5, 24}, gen) * 3;
  const at::Tensor w0 = at::randn({24}, gen), gy = at::randn({6, 5, 24}, gen);

  at::Tensor x = leaf(x0), w = leaf(w0);
  at::Tensor y = fusetrain::nn::rms_norm(x, {24}, w, 1e-6);
  at::Tensor xd = leaf(x0, at::kDouble), wd = leaf(w0, at::kDouble);
  at::Tensor yd = xd * at::rsqrt(xd.pow(2).mean(-1, true) + 1e-6) * wd;
  (y * gy).sum().backward();
  (yd * gy.to(at::kDouble)).sum().backward();
  CHECK(max_err(y, yd) < 4e-6);
  CHECK(max_err(x.grad(), xd.grad()) < 2e-5);
  CHECK(max_err(w.grad(), wd.grad()) < 4e-5);

  for (const std::string approximate : {"none", "tanh"}) {
    at::Tensor xg = leaf(x0), bias = leaf(w0);
    at::Tensor g = fusetrain::nn::gelu(xg, approximate, bias);
    at::Tensor xgd = leaf(x0, at::kDouble), biasd = leaf(w0, at::kDouble);
    at::Tensor gd = at::gelu(xgd + biasd, approximate);
    (g * gy).sum().backward();
    (gd * gy.to(at::kDouble)).sum().backward();
    INFO(approximate);
    CHECK(max_err(g, gd) < 1e-5);
    CHECK(max_err(xg.grad(), xgd.grad()) < 1e-5);
    CHECK(max_err(bias.grad(), biasd.grad()) < 1e-4);
  }

  at::Tensor a = leaf(x0);
  at::Tensor s = fusetrain::nn::swiglu(a);
  at::Tensor ad = leaf(x0, at::kDouble);
  at::Tensor sd = at::silu(ad.narrow(-1, 0, 12)) * ad.narrow(-1, 12, 12);
  (s * gy.narrow(-1, 0, 12)).sum().backward();
  (sd * gy.narrow(-1, 0, 12).to(at::kDouble)).sum().backward();
  CHECK(max_err(s, sd) < 1e-5);
  CHECK(max_err(a.grad(), ad.grad()) < 1e-5);
}

TEST_CASE("layer_norm of a torch::nn::LayerNorm reads its options", "[block_ops]") {
  torch::nn::LayerNorm ln(torch::nn::LayerNormOptions({4, 6}).eps(1e-3));
  {
    torch::NoGradGuard no_grad;
    ln->weight.uniform_(0.5, 1.5);
    ln->bias.uniform_(-0.5, 0.5);
  }
  const at::Tensor x = at::randn({3, 4, 6});
  CHECK(max_err(fusetrain::nn::layer_norm(*ln, x), ln(x)) < 2e-6);
  // bf16 output for the next GEMM: the float32 result rounded once.
  const at::Tensor y16 = fusetrain::nn::layer_norm(x, {4, 6}, ln->weight, ln->bias, 1e-3, at::kBFloat16);
  CHECK(y16.scalar_type() == at::kBFloat16);
  CHECK(at::equal(y16, fusetrain::nn::layer_norm(x, {4, 6}, ln->weight, ln->bias, 1e-3).to(at::kBFloat16)));
}

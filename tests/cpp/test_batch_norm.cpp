// Tests of fusetrain::nn::batch_norm_relu from C++: a torch::nn::BatchNorm2d
// run through the fused op against the same module's own forward and a ReLU,
// computed in float64 on the same inputs (output, gradients of the input,
// weight and bias, running statistics, num_batches_tracked), in training and
// evaluation, channels_last and NCHW, float32 and bfloat16 under autocast.
#include <fusetrain/amp/policy.h>
#include <fusetrain/nn/batch_norm.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <catch2/catch.hpp>

#include <cmath>

namespace {

double max_err(const at::Tensor& a, const at::Tensor& ref) {
  return (a.to(at::kDouble) - ref.to(at::kDouble)).abs().max().item<double>();
}

struct Outcome {
  at::Tensor y, grad_input, grad_weight, grad_bias;
};

// A BatchNorm2d with the given parameters trained one step on x (fused or
// the module's forward + relu), in the module's dtype.
Outcome step(torch::nn::BatchNorm2d& bn, const at::Tensor& x_in, const at::Tensor& dy, bool fused) {
  bn->zero_grad();
  at::Tensor x = x_in.detach().requires_grad_();
  at::Tensor y = fused ? fusetrain::nn::batch_norm_relu(*bn, x) : torch::relu(bn(x));
  y.backward(dy.to(y.scalar_type()));
  return {y.detach(), x.grad(), bn->weight.grad(), bn->bias.grad()};
}

torch::nn::BatchNorm2d make_bn(int64_t c, at::ScalarType dtype) {
  torch::nn::BatchNorm2d bn(c);
  torch::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  bn->weight.copy_(at::randn({c}, gen));
  bn->bias.copy_(at::randn({c}, gen));
  bn->to(dtype);
  return bn;
}

}  // namespace

TEST_CASE("batch_norm_relu on a BatchNorm2d matches the module and a ReLU in float64",
          "[batch_norm]") {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(0);
  for (auto format : {at::MemoryFormat::ChannelsLast, at::MemoryFormat::Contiguous}) {
    const at::Tensor x = (at::randn({16, 24, 10, 10}, gen) * 2 + 3).contiguous(format);
    const at::Tensor dy = at::randn({16, 24, 10, 10}, gen).contiguous(format);
    torch::nn::BatchNorm2d ours = make_bn(24, at::kFloat);
    torch::nn::BatchNorm2d ref = make_bn(24, at::kDouble);
    for (int s = 0; s < 2; ++s) {
      const Outcome a = step(ours, x, dy, /*fused=*/true);
      const Outcome r = step(ref, x.to(at::kDouble), dy.to(at::kDouble), /*fused=*/false);
      CHECK(a.y.is_contiguous(format));
      // Half an ulp of float32 plus the float32 statistics' error.
      CHECK(max_err(a.y, r.y) < 2e-6 * r.y.abs().max().item<double>());
      CHECK(max_err(a.grad_input, r.grad_input) < 2e-6 * r.grad_input.abs().max().item<double>());
      CHECK(max_err(a.grad_weight, r.grad_weight) < 1e-4);
      CHECK(max_err(a.grad_bias, r.grad_bias) < 1e-4);
    }
    CHECK(ours->num_batches_tracked.item<int64_t>() == 2);
    CHECK(max_err(ours->running_mean, ref->running_mean) < 1e-6);
    CHECK(max_err(ours->running_var, ref->running_var) < 1e-6);

    ours->eval();
    ref->eval();
    const Outcome a = step(ours, x, dy, true);
    const Outcome r = step(ref, x.to(at::kDouble), dy.to(at::kDouble), false);
    CHECK(ours->num_batches_tracked.item<int64_t>() == 2);
    CHECK(max_err(a.y, r.y) < 2e-6 * r.y.abs().max().item<double>());
    CHECK(max_err(a.grad_input, r.grad_input) < 2e-6 * r.grad_input.abs().max().item<double>());
  }
}

TEST_CASE("batch_norm_relu takes bfloat16 activations under autocast with float32 parameters",
          "[batch_norm]") {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const at::Tensor x = (at::randn({8, 48, 7, 7}, gen) + 1)
                           .to(at::kBFloat16)
                           .contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor dy = at::randn({8, 48, 7, 7}, gen).to(at::kBFloat16);
  torch::nn::BatchNorm2d ours = make_bn(48, at::kFloat);
  torch::nn::BatchNorm2d ref = make_bn(48, at::kDouble);
  Outcome a;
  {
    fusetrain::amp::AutocastGuard autocast(c10::DeviceType::CPU,
                                           fusetrain::amp::Policy("mixed_bfloat16"));
    a = step(ours, x, dy, true);
  }
  const Outcome r = step(ref, x.to(at::kDouble), dy.to(at::kDouble), false);
  CHECK(a.y.scalar_type() == at::kBFloat16);
  CHECK(a.grad_input.scalar_type() == at::kBFloat16);
  CHECK(a.grad_weight.scalar_type() == at::kFloat);
  // Rounded once to bfloat16: half an ulp, 2^-8 relative.
  CHECK(((a.y.to(at::kDouble) - r.y).abs() <= r.y.abs() * std::ldexp(1.0, -8) + 1e-5).all().item<bool>());
  CHECK(max_err(a.grad_weight, r.grad_weight) < 1e-3);
  CHECK(max_err(ours->running_mean, ref->running_mean) < 1e-6);
}

TEST_CASE("batch_norm_relu without momentum averages every batch, as BatchNorm2d does",
          "[batch_norm]") {
  torch::nn::BatchNorm2d ours(torch::nn::BatchNorm2dOptions(3).momentum(std::nullopt));
  torch::nn::BatchNorm2d ref(torch::nn::BatchNorm2dOptions(3).momentum(std::nullopt));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2);
  for (int s = 0; s < 3; ++s) {
    const at::Tensor x = at::randn({4, 3, 5, 5}, gen) * (s + 1);
    torch::NoGradGuard no_grad;
    fusetrain::nn::batch_norm_relu(*ours, x);
    ref(x);
  }
  CHECK(max_err(ours->running_mean, ref->running_mean) < 1e-6);
  CHECK(max_err(ours->running_var, ref->running_var) < 1e-5);
  CHECK(ours->num_batches_tracked.item<int64_t>() == 3);
}

TEST_CASE("a conv + batch norm + ReLU stack trains the same fused as with torch's ops",
          "[batch_norm]") {
  // Gradients of every parameter after one backward through two conv +
  // batch norm + ReLU layers and a max pool, channels_last, float32 fused
  // vs torch's ops in float64.
  auto run = [](at::ScalarType dtype, bool fused) {
    torch::manual_seed(0);
    torch::nn::Conv2d c1(torch::nn::Conv2dOptions(1, 8, 3).padding(1).bias(false));
    torch::nn::BatchNorm2d b1(8);
    torch::nn::Conv2d c2(torch::nn::Conv2dOptions(8, 8, 3).padding(1).bias(false));
    torch::nn::BatchNorm2d b2(8);
    std::vector<torch::nn::Module*> mods = {c1.get(), b1.get(), c2.get(), b2.get()};
    std::vector<at::Tensor> params;
    for (auto* m : mods) {
      m->to(dtype);
      for (auto& p : m->parameters()) params.push_back(p);
    }
    {
      torch::NoGradGuard no_grad;
      for (auto* w : {&c1->weight, &c2->weight}) {
        w->set_data(w->contiguous(at::MemoryFormat::ChannelsLast));
      }
    }
    auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
    at::Tensor x = at::randn({16, 1, 12, 12}, gen).to(dtype).contiguous(at::MemoryFormat::ChannelsLast);
    auto bn = [&](torch::nn::BatchNorm2d& b, const at::Tensor& t) {
      return fused ? fusetrain::nn::batch_norm_relu(*b, t) : torch::relu(b(t));
    };
    at::Tensor y = torch::max_pool2d(bn(b2, c2(bn(b1, c1(x)))), 2);
    at::Tensor target = at::randn(y.sizes(), gen).to(dtype);
    (y * target).sum().backward();
    std::vector<at::Tensor> grads;
    for (auto& p : params) grads.push_back(p.grad().to(at::kDouble));
    return grads;
  };
  const auto ours = run(at::kFloat, true);
  const auto ref = run(at::kDouble, false);
  const auto theirs = run(at::kFloat, false);
  REQUIRE(ours.size() == ref.size());
  for (size_t i = 0; i < ours.size(); ++i) {
    INFO("parameter " << i);
    const double scale = ref[i].abs().max().item<double>();
    CHECK(max_err(ours[i], ref[i]) <= 1e-5 * scale);
    CHECK(max_err(theirs[i], ref[i]) <= 1e-5 * scale);
  }
}

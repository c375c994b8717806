// Tests of the float8 layer from C++: Float8Linear's GEMMs against float64
// products of the same quantised operands, delayed scaling's seeding and
// history, evaluation leaving the state alone, a reloaded state rereading
// its seeding, the "mixed_float8" policy and the device check. The
// quantisation itself is tested bit for bit in tests/python/test_float8.py.
#include <fusetrain/fusetrain.h>

#include <torch/torch.h>

#include <catch2/catch.hpp>

#include <cmath>

namespace {

using fusetrain::amp::Float8Linear;
using fusetrain::amp::Float8Recipe;

Float8Recipe recipe(const char* scaling, int64_t history = 16) {
  Float8Recipe r = Float8Recipe::from_name(scaling);
  r.amax_history_len = history;
  return r;
}

// x cast to float8 with `scale` and back, in float64: the operand the GEMM sees.
at::Tensor dequantized(const at::Tensor& x, at::ScalarType dtype, float scale) {
  at::Tensor s = torch::full({1}, scale);
  at::Tensor h = torch::zeros({1});
  // Delayed with an empty history keeps `scale`: a cast with exactly this scale.
  const at::Tensor q = fusetrain::ops::fp8_quantize_delayed(x.detach(), dtype, s, h);
  REQUIRE(s.item<float>() == scale);
  return q.to(at::kDouble) * static_cast<double>(1.0f / scale);
}

// gamma_K |a| |b| for float32 accumulation, plus the float32 output rounding.
at::Tensor gemm_bound(const at::Tensor& a, const at::Tensor& b) {
  const double k = static_cast<double>(a.size(1));
  const double u = std::ldexp(1.0, -24);
  return a.abs().mm(b.abs()) * (k * u / (1 - k * u)) + 2 * u * a.mm(b).abs();
}

bool within(const at::Tensor& actual, const at::Tensor& expected, const at::Tensor& bound) {
  return ((actual.to(at::kDouble) - expected).abs() <= bound).all().item<bool>();
}

}  // namespace

TEST_CASE("Float8Linear's GEMMs are float64 products of the quantised operands", "[float8]") {
  torch::manual_seed(0);
  Float8Linear layer(48, 32, /*bias=*/true, recipe("current"));
  const at::Tensor x = (torch::randn({2, 13, 48}) * 3).requires_grad_();
  const at::Tensor y = layer->forward(x);
  REQUIRE(y.scalar_type() == at::kFloat);
  REQUIRE(y.sizes() == at::IntArrayRef({2, 13, 32}));
  const float sx = layer->fp8_scale[0].item<float>();
  const float sw = layer->fp8_scale[1].item<float>();
  CHECK(sx == 448.f / x.abs().max().item<float>());
  const at::Tensor xq = dequantized(x.reshape({-1, 48}), at::kFloat8_e4m3fn, sx);
  const at::Tensor wq = dequantized(layer->weight, at::kFloat8_e4m3fn, sw);
  const at::Tensor expected = xq.mm(wq.t()) + layer->bias.to(at::kDouble);
  CHECK(within(y.reshape({-1, 32}), expected, gemm_bound(xq, wq.t()) + 1e-6 * expected.abs()));

  const at::Tensor g = torch::randn({2, 13, 32}) * 1e-3;
  y.backward(g);
  const float sg = layer->fp8_scale[2].item<float>();
  CHECK(sg == 57344.f / g.abs().max().item<float>());
  const at::Tensor gq = dequantized(g.reshape({-1, 32}), at::kFloat8_e5m2, sg);
  CHECK(within(x.grad().reshape({-1, 48}), gq.mm(wq), gemm_bound(gq, wq)));
  REQUIRE(layer->weight.grad().scalar_type() == at::kFloat);
  CHECK(within(layer->weight.grad(), gq.t().mm(xq), gemm_bound(gq.t(), xq)));
  CHECK(torch::allclose(layer->bias.grad(), g.reshape({-1, 32}).sum(0), 1e-6, 1e-9));
}

TEST_CASE("Float8Linear's weight gradient is an fp32 GEMM under autocast", "[float8]") {
  // A CPU mm left under bf16 autocast would round it to bf16 (2^-9, not 2^-24).
  torch::manual_seed(1);
  Float8Linear layer(64, 32, /*bias=*/true, recipe("current"));
  const at::Tensor x = torch::randn({16, 64}) * 3;
  const at::Tensor g = (torch::randn({16, 32}) * 1e-2).to(at::kBFloat16);
  {
    const fusetrain::amp::AutocastGuard autocast(c10::DeviceType::CPU,
                                                 fusetrain::amp::Policy("mixed_float8"));
    const at::Tensor y = layer->forward(x);
    REQUIRE(y.scalar_type() == at::kBFloat16);
    y.backward(g);  // the backward pass under autocast as well
  }
  const at::Tensor xq = dequantized(x, at::kFloat8_e4m3fn, layer->fp8_scale[0].item<float>());
  const at::Tensor gq = dequantized(g, at::kFloat8_e5m2, layer->fp8_scale[2].item<float>());
  REQUIRE(layer->weight.grad().scalar_type() == at::kFloat);
  CHECK(within(layer->weight.grad(), gq.t().mm(xq), gemm_bound(gq.t(), xq)));
}

TEST_CASE("Float8Linear: delayed scaling seeds its history, then uses it", "[float8]") {
  torch::manual_seed(0);
  Float8Linear layer(32, 16, true, recipe("delayed", 3));
  REQUIRE(layer->fp8_amax_history.sizes() == at::IntArrayRef({3, 3}));
  std::vector<float> amaxes;
  std::vector<float> scales;
  for (double m : {4.0, 1.0, 0.5, 2.0, 1.0}) {
    const at::Tensor x = torch::randn({5, 32}) * m;
    layer->forward(x).sum().backward();
    amaxes.insert(amaxes.begin(), x.abs().max().item<float>());
    scales.push_back(layer->fp8_scale[0].item<float>());
    CHECK(layer->fp8_amax_history[0][0].item<float>() == amaxes[0]);
  }
  // amaxes is newest first: a0 = amaxes[4] ... a4 = amaxes[0]. Step 0 seeds
  // with its own amax; step s uses the (up to 3) amaxes before it, so the
  // large a0 leaves the window at step 4.
  CHECK(scales[0] == 448.f / amaxes[4]);
  CHECK(scales[1] == 448.f / amaxes[4]);
  CHECK(scales[2] == 448.f / std::max(amaxes[4], amaxes[3]));
  CHECK(scales[3] == 448.f / std::max({amaxes[4], amaxes[3], amaxes[2]}));
  CHECK(scales[4] == 448.f / std::max({amaxes[3], amaxes[2], amaxes[1]}));
  CHECK(scales[4] > scales[3]);  // the x4 step dropped out of the history
  CHECK(layer->fp8_amax_history[0][2].item<float>() == amaxes[2]);

  // A clone keeps the seeding: its next step uses the copied history, as
  // the original's does.
  auto cloned = std::dynamic_pointer_cast<fusetrain::amp::Float8LinearImpl>(layer->clone());
  REQUIRE(cloned);
  const at::Tensor x5 = torch::randn({5, 32});
  CHECK(torch::equal(cloned->forward(x5), layer->forward(x5)));
  CHECK(torch::equal(cloned->fp8_scale, layer->fp8_scale));
  CHECK(torch::equal(cloned->fp8_amax_history, layer->fp8_amax_history));

  // A copy loaded into a fresh layer rereads its seeding: the next step
  // uses the history, exactly as the original's next step does.
  Float8Linear copy(32, 16, true, recipe("delayed", 3));
  {
    torch::NoGradGuard no_grad;
    copy->weight.copy_(layer->weight);
    copy->bias.copy_(layer->bias);
    copy->fp8_scale.copy_(layer->fp8_scale);
    copy->fp8_amax_history.copy_(layer->fp8_amax_history);
    copy->fp8_seeded.copy_(layer->fp8_seeded);
  }
  copy->state_loaded();
  const at::Tensor x = torch::randn({5, 32}) * 100;
  const at::Tensor a = layer->forward(x);
  const at::Tensor b = copy->forward(x);
  CHECK(torch::equal(a, b));
  CHECK(torch::equal(layer->fp8_scale, copy->fp8_scale));
  CHECK(torch::equal(layer->fp8_amax_history, copy->fp8_amax_history));
}

TEST_CASE("Float8Linear: a dtype cast keeps the scaling state float32", "[float8]") {
  Float8Linear layer(32, 16);
  layer->forward(torch::randn({4, 32})).sum().backward();
  const at::Tensor scale = layer->fp8_scale.clone();
  layer->to(at::kBFloat16);
  CHECK(layer->weight.scalar_type() == at::kBFloat16);
  CHECK(layer->fp8_scale.scalar_type() == at::kFloat);
  CHECK(torch::equal(layer->fp8_scale, scale));
  CHECK(layer->fp8_amax_history.scalar_type() == at::kFloat);
  CHECK(layer->fp8_seeded.scalar_type() == at::kByte);
  CHECK(layer->forward(torch::randn({4, 32}, at::kBFloat16)).scalar_type() == at::kBFloat16);
}

TEST_CASE("Float8Linear in eval mode leaves the scaling state alone", "[float8]") {
  Float8Linear layer(32, 16);
  layer->forward(torch::randn({4, 32})).sum().backward();
  const at::Tensor scale = layer->fp8_scale.clone();
  const at::Tensor history = layer->fp8_amax_history.clone();
  layer->eval();
  torch::NoGradGuard no_grad;
  const at::Tensor y = layer->forward(torch::randn({4, 32}) * 1000);
  CHECK(torch::isfinite(y).all().item<bool>());
  CHECK(torch::equal(layer->fp8_scale, scale));
  CHECK(torch::equal(layer->fp8_amax_history, history));
}

TEST_CASE("Float8Linear has nn::Linear's parameters and initialisation", "[float8]") {
  torch::manual_seed(3);
  torch::nn::Linear plain(40, 24);
  torch::manual_seed(3);
  Float8Linear f8(40, 24);
  CHECK(torch::equal(plain->weight, f8->weight));
  CHECK(torch::equal(plain->bias, f8->bias));
  std::vector<std::string> names;
  for (const auto& p : f8->named_parameters()) names.push_back(p.key());
  for (const auto& b : f8->named_buffers()) names.push_back(b.key());
  CHECK(names == std::vector<std::string>{"weight", "bias", "fp8_scale", "fp8_amax_history",
                                          "fp8_seeded"});
  // Under bf16 autocast the output is bf16.
  const fusetrain::amp::AutocastGuard autocast(c10::DeviceType::CPU,
                                               fusetrain::amp::Policy("mixed_float8"));
  CHECK(f8->forward(torch::randn({3, 40})).scalar_type() == at::kBFloat16);
}

TEST_CASE("the mixed_float8 policy, eligibility and device errors", "[float8]") {
  const fusetrain::amp::Policy p("mixed_float8");
  CHECK(p.is_float8());
  CHECK(p.is_mixed());
  CHECK(p.compute_dtype() == at::kBFloat16);
  CHECK_FALSE(fusetrain::amp::Policy("mixed_bfloat16").is_float8());
  CHECK(fusetrain::amp::float8_eligible(1024, 4096, 1024));
  CHECK_FALSE(fusetrain::amp::float8_eligible(1024, 1000, 16));  // not a multiple of 16
  CHECK_FALSE(fusetrain::amp::float8_eligible(512, 4096, 1024));
  CHECK_THROWS_WITH(Float8Recipe::from_name("dynamic"),
                    Catch::Contains("\"delayed\" or \"current\""));
  CHECK_THROWS_WITH(fusetrain::amp::check_float8_device(c10::Device(c10::kMeta)),
                    Catch::Contains("no float8 GEMM for device type"));
  CHECK_NOTHROW(fusetrain::amp::check_float8_device(c10::Device(c10::kCPU)));
}

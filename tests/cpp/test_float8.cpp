// Tests of the float8 layer from C++: Float8Linear's GEMMs against float64
// products of the same quantised operands, delayed scaling's seeding and
// history, evaluation leaving the state alone, a reloaded state rereading
// its seeding, a layer applied twice in one forward, which GEMMs accumulate
// fast, the "mixed_float8" policy and the device check; on CUDA ([cuda]) the
// layer against the CPU's, the weight gradient's exact sum and FusedSteps
// refusing to capture a first step. The quantisation itself is tested bit
// for bit in tests/python/test_float8.py.
#include <fusetrain/fusetrain.h>

#include <torch/torch.h>

#include <catch2/catch.hpp>

#include <array>
#include <cmath>
#include <utility>

#include "cuda_test.h"

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

// --------------------------------------------------------------- the GEMMs' accumulation

TEST_CASE("Float8Linear: only the forward GEMM accumulates fast", "[float8]") {
  // On Hopper fast accumulation keeps partial sums at about 14 bits; the
  // backward GEMMs, the weight gradient summing over every token, accumulate
  // exactly (Transformer Engine's and torchao's choice). The [cuda] case
  // below sees the weight gradient's sum on the GPU.
  using fusetrain::amp::float8_fast_accum;
  using fusetrain::amp::Float8Gemm;
  CHECK(float8_fast_accum(Float8Gemm::kForward));
  CHECK_FALSE(float8_fast_accum(Float8Gemm::kGradInput));
  CHECK_FALSE(float8_fast_accum(Float8Gemm::kGradWeight));
}

TEST_CASE("Float8Linear on CUDA: the weight gradient sums 65541 rows exactly", "[float8][cuda]") {
  REQUIRE_CUDA();
  // Inputs 8..14 and gradients 4..7 with amaxes 14 and 7 cast with the
  // scales 32 and 8192 exactly, so every product is x * g * 2^18 and the
  // sum over the rows, at most 98 * 65541 < 2^23 units, is exact in float32
  // in any order: the exact mode gets it. Partial sums of 14 bits (fast
  // accumulation) drop the products' low bits once they pass 2^14 units, a
  // few hundred rows in. 65541 rows: the GEMM pads them to 65552.
  constexpr int64_t rows = 65541;
  torch::manual_seed(7);
  at::Tensor x = torch::randint(8, 15, {rows, 16}).to(at::kFloat);
  at::Tensor g = torch::randint(4, 8, {rows, 16}).to(at::kFloat);
  x[0][0] = 14;
  g[0][0] = 7;
  Float8Linear layer(16, 16, /*bias=*/false, recipe("current"));
  layer->to(torch::kCUDA);
  layer->forward(x.to(torch::kCUDA)).backward(g.to(torch::kCUDA));
  REQUIRE(layer->fp8_scale[0].item<float>() == 32.f);
  REQUIRE(layer->fp8_scale[2].item<float>() == 8192.f);
  const at::Tensor expected = g.to(at::kDouble).t().mm(x.to(at::kDouble));
  const at::Tensor error = (layer->weight.grad().cpu().to(at::kDouble) - expected).abs() / expected;
  // Exact, but for some headroom; 14-bit partial sums err by far more.
  INFO("largest relative error " << error.max().item<double>());
  CHECK((error <= std::ldexp(1.0, -16)).all().item<bool>());
}

// ------------------------------------------------ one layer applied twice in a forward

namespace {

// Float8Linear's function as the Python module defines it, op by op: a
// forward keeps its casts and their dequantisation factors; a backward casts
// the output gradient with the scaling state as it is when it runs.
struct ReferenceState {
  at::Tensor scale = torch::ones({3});
  at::Tensor history;
  std::array<bool, 3> seeded{false, false, false};

  // (x cast with operand i's scale, 1 / that scale), moving the state on.
  std::pair<at::Tensor, at::Tensor> cast(const at::Tensor& x, at::ScalarType dtype, int i) {
    at::Tensor s = scale.narrow(0, i, 1);
    at::Tensor h = history.select(0, i);
    at::Tensor q;
    if (seeded[i]) {
      q = fusetrain::ops::fp8_quantize_delayed(x, dtype, s, h);
    } else {
      at::Tensor first = h.narrow(0, 0, 1);
      q = fusetrain::ops::fp8_quantize_current(x, dtype, s, first);
      seeded[i] = true;
    }
    return {q, scale.select(0, i).reciprocal()};
  }
};

// inv_a * inv_b * (a @ b), the float8 operands upcast to float32.
at::Tensor scaled_product(const at::Tensor& a, const at::Tensor& b, const at::Tensor& inv_a,
                          const at::Tensor& inv_b) {
  return at::mm(a.to(at::kFloat), b.to(at::kFloat)).mul_(inv_a).mul_(inv_b);
}

}  // namespace

TEST_CASE("Float8Linear applied twice in one forward: gradients as the Python module's",
          "[float8]") {
  torch::manual_seed(4);
  Float8Linear layer(32, 32, /*bias=*/true, recipe("delayed", 4));
  const at::Tensor x = (torch::randn({6, 32}) * 2).requires_grad_();
  const at::Tensor g = torch::randn({6, 32}) * 1e-3;
  // y = L(L(x)): the second use moves the scaling state on before either
  // backward, and its backward (first) seeds the output gradient's history.
  const at::Tensor y = layer->forward(layer->forward(x));
  y.backward(g);

  constexpr auto e4m3 = at::kFloat8_e4m3fn;
  constexpr auto e5m2 = at::kFloat8_e5m2;
  const at::Tensor w = layer->weight.detach();
  const at::Tensor b = layer->bias.detach();
  ReferenceState ref;
  ref.history = torch::zeros({3, 4});
  const auto [qx, inv_x] = ref.cast(x.detach(), e4m3, 0);
  const auto [qw1, inv_w1] = ref.cast(w, e4m3, 1);
  const at::Tensor h = scaled_product(qx, qw1.t(), inv_x, inv_w1) + b;
  const auto [qh, inv_h] = ref.cast(h, e4m3, 0);
  const auto [qw2, inv_w2] = ref.cast(w, e4m3, 1);
  const at::Tensor y_ref = scaled_product(qh, qw2.t(), inv_h, inv_w2) + b;
  const auto [qg2, inv_g2] = ref.cast(g, e5m2, 2);  // the second use's backward: seeds
  const at::Tensor dh = scaled_product(qg2, qw2, inv_g2, inv_w2);
  const auto [qg1, inv_g1] = ref.cast(dh, e5m2, 2);  // the first use's: delayed
  const at::Tensor dx = scaled_product(qg1, qw1, inv_g1, inv_w1);
  const at::Tensor dw =
      scaled_product(qg2.t(), qh, inv_g2, inv_h) + scaled_product(qg1.t(), qx, inv_g1, inv_x);
  const at::Tensor db = g.sum(0) + dh.sum(0);
  // The first use's backward casts its gradient with the history the second
  // use's seeded, not with its own amax as a snapshot of its forward would.
  REQUIRE(dh.abs().max().item<float>() != g.abs().max().item<float>());
  REQUIRE(inv_g1.item<float>() == inv_g2.item<float>());

  const auto close = [](const at::Tensor& actual, const at::Tensor& expected) {
    return torch::allclose(actual, expected, 1e-6, 1e-12);
  };
  CHECK(close(y, y_ref));
  CHECK(close(x.grad(), dx));
  CHECK(close(layer->weight.grad(), dw));
  CHECK(close(layer->bias.grad(), db));
  CHECK(torch::equal(layer->fp8_scale, ref.scale));
  CHECK(torch::equal(layer->fp8_amax_history, ref.history));
  CHECK(torch::equal(layer->fp8_seeded, torch::ones({3}, at::kByte)));
}

// ------------------------------------------------------------------------- CUDA

namespace {

// How far a sum of K products on tensor cores may be from the float64 one:
// partial sums of about 14 bits (Hopper's fast accumulation; the exact mode
// promotes them to float32 every few products), and the float32 output's
// rounding. Loose for an exact sum, tight against a wrong layout, scale or
// padding row.
at::Tensor tensor_core_bound(const at::Tensor& a, const at::Tensor& b) {
  const double k = static_cast<double>(a.size(1));
  return a.abs().mm(b.abs()) * (k * std::ldexp(1.0, -13)) + std::ldexp(1.0, -23) * a.mm(b).abs();
}

}  // namespace

TEST_CASE("Float8Linear on CUDA equals the CPU's, 37 rows", "[float8][cuda]") {
  REQUIRE_CUDA();
  torch::manual_seed(6);
  Float8Linear cpu(64, 48, /*bias=*/true, recipe("delayed", 4));
  const auto gpu = std::dynamic_pointer_cast<fusetrain::amp::Float8LinearImpl>(cpu->clone());
  REQUIRE(gpu);
  gpu->to(torch::kCUDA);
  // Two steps: the first seeds the histories, the second casts with them.
  // 37 rows: the weight gradient's GEMM pads them to 48.
  for (int step = 0; step < 2; ++step) {
    INFO("step " << step);
    cpu->zero_grad();
    gpu->zero_grad();
    const at::Tensor x = torch::randn({37, 64}) * (step + 1);
    const at::Tensor g = torch::randn({37, 48}) * 1e-2;
    const at::Tensor x_cpu = x.clone().requires_grad_();
    const at::Tensor x_gpu = x.to(torch::kCUDA).requires_grad_();
    const at::Tensor y_cpu = cpu->forward(x_cpu);
    const at::Tensor y_gpu = gpu->forward(x_gpu);
    y_cpu.backward(g);
    y_gpu.backward(g.to(torch::kCUDA));
    // The same amaxes: the same scales and histories, bit for bit.
    REQUIRE(torch::equal(gpu->fp8_scale.cpu(), cpu->fp8_scale));
    REQUIRE(torch::equal(gpu->fp8_amax_history.cpu(), cpu->fp8_amax_history));
    REQUIRE(torch::equal(gpu->fp8_seeded.cpu(), cpu->fp8_seeded));

    // The same float8 operands (the scales just compared were the ones used);
    // the GEMMs accumulate in another order and precision.
    const at::Tensor xq = dequantized(x, at::kFloat8_e4m3fn, cpu->fp8_scale[0].item<float>());
    const at::Tensor wq =
        dequantized(cpu->weight, at::kFloat8_e4m3fn, cpu->fp8_scale[1].item<float>());
    const at::Tensor gq = dequantized(g, at::kFloat8_e5m2, cpu->fp8_scale[2].item<float>());
    REQUIRE(y_gpu.scalar_type() == at::kFloat);
    REQUIRE(y_gpu.sizes() == y_cpu.sizes());
    CHECK(within(y_gpu.cpu(), y_cpu.to(at::kDouble),
                 tensor_core_bound(xq, wq.t()) + gemm_bound(xq, wq.t()) + 1e-6 * y_cpu.abs()));
    CHECK(within(x_gpu.grad().cpu(), x_cpu.grad().to(at::kDouble),
                 tensor_core_bound(gq, wq) + gemm_bound(gq, wq)));
    REQUIRE(gpu->weight.grad().scalar_type() == at::kFloat);
    CHECK(within(gpu->weight.grad().cpu(), cpu->weight.grad().to(at::kDouble),
                 tensor_core_bound(gq.t(), xq) + gemm_bound(gq.t(), xq)));
    CHECK(torch::allclose(gpu->bias.grad().cpu(), cpu->bias.grad(), 1e-5, 1e-7));
  }
}

TEST_CASE("FusedSteps refuses to capture a Float8Linear's first training step", "[float8][cuda]") {
  REQUIRE_CUDA();
  // Delayed scaling's first step casts with the tensor's own amax and seeds
  // the history; captured, it would replay forever.
  torch::manual_seed(5);
  Float8Linear layer(32, 16, /*bias=*/true, recipe("delayed", 4));
  layer->to(torch::kCUDA);
  const fusetrain::graph::StepFn step = [&](const std::vector<at::Tensor>& batch) {
    const at::Tensor loss = layer->forward(batch[0]).square().mean();
    loss.backward();
    return loss.detach();
  };
  const at::Tensor x = torch::randn({24, 32}, torch::kCUDA);
  fusetrain::graph::FusedStepsOptions options;
  options.steps_per_execution = 2;
  options.warmup_executions = 0;
  fusetrain::graph::FusedSteps unwarmed(step, {x}, options);
  CHECK_THROWS_WITH(unwarmed.run({{x}, {x}}),
                    Catch::Contains("has not run an eager training step yet") &&
                        Catch::Contains("warmup_executions >= 1"));
  CHECK_FALSE(unwarmed.captured());
  CHECK(layer->fp8_seeded.sum().item<int64_t>() == 0);
  CHECK(layer->fp8_amax_history.abs().sum().item<float>() == 0);

  // An eager forward seeds the input's and the weight's histories, not the
  // output gradient's, which the captured backward would.
  {
    torch::NoGradGuard no_grad;
    layer->forward(x);
  }
  CHECK_THROWS_WITH(unwarmed.run({{x}, {x}}),
                    Catch::Contains("has not run an eager training step"));
  CHECK_FALSE(unwarmed.captured());
  CHECK(layer->fp8_seeded.cpu().equal(torch::tensor({1, 1, 0}, at::kByte)));
  layer->zero_grad();

  // After one eager execution the graph replays delayed scaling: the
  // histories roll at every step.
  options.warmup_executions = 1;
  fusetrain::graph::FusedSteps warmed(step, {x}, options);
  warmed.run({{x}, {x}});
  const at::Tensor x4 = x * 4;
  warmed.run({{x4}, {x4}});
  REQUIRE(warmed.captured());
  const float a = x.abs().max().item<float>();
  CHECK(layer->fp8_amax_history[0].cpu().equal(torch::tensor({4 * a, 4 * a, a, a})));
  CHECK(layer->fp8_scale[0].item<float>() == 448.f / (4 * a));
}

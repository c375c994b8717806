// Tests of fusetrain::nn::softmax_cross_entropy from C++: forward and
// backward against torch::nn::functional::cross_entropy for float32 and
// bfloat16 logits, each reduction, label smoothing and ignored rows; the
// bfloat16 results are held to within 2x of torch's own error against a
// float64 computation on the same logits.
#include <fusetrain/nn/cross_entropy.h>
#include <fusetrain/ops/cross_entropy.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <string>

namespace {

namespace F = torch::nn::functional;
using fusetrain::nn::SoftmaxCrossEntropyOptions;

struct Result {
  at::Tensor loss;
  at::Tensor grad;
};

struct Case {
  at::Tensor logits;
  at::Tensor target;
};

Case make_case(int64_t n, int64_t c, at::ScalarType dtype, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor x = (at::randn({n, c}, gen) * 3.0).to(dtype);
  at::Tensor t = at::randint(0, c, {n}, gen, at::kLong);
  // Every third row ignored.
  t.index_put_({torch::indexing::Slice(torch::indexing::None, torch::indexing::None, 3)}, -100);
  return {x, t};
}

// Loss and d(loss)/d(logits) for a fixed upstream gradient, with `logits`
// promoted to `compute_dtype` first (float64 for the reference).
template <typename Fn>
Result run(Fn&& fn, const Case& cs, at::ScalarType compute_dtype, const std::string& reduction) {
  at::Tensor x = cs.logits.to(compute_dtype).detach().requires_grad_();
  at::Tensor loss = fn(x, cs.target);
  // Multiples of 1/4, which torch's bf16 loss also takes exactly.
  at::Tensor upstream = reduction == "none"
                            ? (at::arange(loss.numel(), loss.options()).remainder(7) - 3) / 4
                            : at::full({}, 1.75, loss.options());
  loss.backward(upstream);
  return {loss.detach(), x.grad()};
}

double max_err(const at::Tensor& a, const at::Tensor& ref) {
  if (ref.numel() == 0) return 0.0;
  return (a.to(at::kDouble) - ref).abs().max().item<double>();
}

F::CrossEntropyFuncOptions torch_options(const std::string& reduction, double ls) {
  F::CrossEntropyFuncOptions o;
  o.ignore_index(-100).label_smoothing(ls);
  if (reduction == "mean") o.reduction(torch::kMean);
  if (reduction == "sum") o.reduction(torch::kSum);
  if (reduction == "none") o.reduction(torch::kNone);
  return o;
}

}  // namespace

TEST_CASE("softmax_cross_entropy matches torch's cross_entropy", "[cross_entropy]") {
  const auto dtype = GENERATE(at::kFloat, at::kBFloat16);
  const std::string reduction = GENERATE("mean", "sum", "none");
  const double ls = GENERATE(0.0, 0.1);
  const int64_t c = GENERATE(1, 7, 1000, 32771);
  const int64_t n = c > 10000 ? 3 : 13;
  CAPTURE(dtype, reduction, ls, c);

  const Case cs = make_case(n, c, dtype, 7);
  const SoftmaxCrossEntropyOptions opts{-100, reduction, ls};
  const Result ours =
      run([&](const at::Tensor& x,
              const at::Tensor& t) { return fusetrain::nn::softmax_cross_entropy(x, t, opts); },
          cs, dtype, reduction);
  auto torch_ce = [&](const at::Tensor& x, const at::Tensor& t) {
    return F::cross_entropy(x, t, torch_options(reduction, ls));
  };
  const Result theirs = run(torch_ce, cs, dtype, reduction);
  const Result ref = run(torch_ce, cs, at::kDouble, reduction);

  REQUIRE(ours.loss.scalar_type() == at::kFloat);
  REQUIRE(ours.grad.scalar_type() == dtype);
  REQUIRE(ours.loss.sizes() == ref.loss.sizes());

  if (dtype == at::kFloat) {
    // p = exp(x - lse) inherits the fp32 rounding of the saved lse: a few
    // ulps relative to |lse|, next to torch, which keeps log-probabilities.
    const double lse = at::logsumexp(cs.logits.to(at::kDouble), 1).abs().max().item<double>();
    const double scale = ref.grad.abs().max().item<double>();
    CHECK(max_err(ours.loss, ref.loss) <= std::max(2 * max_err(theirs.loss, ref.loss),
                                                   1.2e-7 * ref.loss.abs().max().item<double>()));
    CHECK(max_err(ours.grad, ref.grad) <=
          2 * max_err(theirs.grad, ref.grad) + 1.2e-7 * (1 + lse) * scale);
  } else {
    const double unit = 0.0078125 * ref.grad.abs().max().item<double>();  // one bf16 ulp
    CHECK(max_err(ours.loss, ref.loss) <= 2 * max_err(theirs.loss, ref.loss));
    CHECK(max_err(ours.grad, ref.grad) <= std::max(2 * max_err(theirs.grad, ref.grad), unit));
  }
  // Ignored rows: no gradient at all.
  const at::Tensor ignored = cs.target == -100;
  CHECK(ours.grad.index({ignored}).abs().max().item<double>() == 0.0);
}

TEST_CASE("softmax_cross_entropy: every target ignored", "[cross_entropy]") {
  at::Tensor x = at::randn({4, 9}).to(at::kBFloat16).requires_grad_();
  const at::Tensor t = at::full({4}, -100, at::kLong);
  at::Tensor loss = fusetrain::nn::softmax_cross_entropy(x, t);
  // torch: the mean over no targets is 0 / 0.
  CHECK(std::isnan(loss.item<float>()));
  loss.backward();
  CHECK(x.grad().abs().max().item<float>() == 0.0f);
  SoftmaxCrossEntropyOptions sum;
  sum.reduction = "sum";
  CHECK(fusetrain::nn::softmax_cross_entropy(x, t, sum).item<float>() == 0.0f);
}

TEST_CASE("softmax_cross_entropy: argument errors name the argument", "[cross_entropy]") {
  const at::Tensor x = at::randn({3, 5});
  at::Tensor t = at::tensor({1, 7, 2}, at::kLong);
  CHECK_THROWS_WITH(fusetrain::nn::softmax_cross_entropy(x, t), Catch::Contains("target[1] = 7"));
  t = at::tensor({1, 0, 2}, at::kLong);
  SoftmaxCrossEntropyOptions bad;
  bad.reduction = "avg";
  CHECK_THROWS_WITH(fusetrain::nn::softmax_cross_entropy(x, t, bad), Catch::Contains("reduction"));
  bad = SoftmaxCrossEntropyOptions{};
  bad.label_smoothing = -0.5;
  CHECK_THROWS_WITH(fusetrain::nn::softmax_cross_entropy(x, t, bad),
                    Catch::Contains("label_smoothing"));
  CHECK_THROWS_WITH(fusetrain::nn::softmax_cross_entropy(x.to(at::kDouble), t),
                    Catch::Contains("logits must be float32, float16 or bfloat16"));
}

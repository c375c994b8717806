// Tests of fusetrain::nn::softmax_cross_entropy from C++: forward and
// backward against torch::nn::functional::cross_entropy for float32 and
// bfloat16 logits, each reduction, label smoothing and ignored rows; the
// bfloat16 results are held to within 2x of torch's own error against a
// float64 computation on the same logits. A [cuda] case runs the CUDA kernels
// (through the ops and the autograd face) against the CPU op, within an error
// bound derived from both sides' arithmetic (Note [CUDA cross-entropy bound]).
#include <fusetrain/nn/cross_entropy.h>
#include <fusetrain/ops/cross_entropy.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <catch2/catch.hpp>

#include "cuda_test.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>

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

// ------------------------------------------------------------------ CUDA

namespace {

// Note [CUDA cross-entropy bound]
// The CUDA kernels and the CPU op evaluate the same formulas in fp32, in
// different orders and with different exps, so they agree within a bound,
// not bit for bit. The bound below is derived per row (per element for the
// gradient) from the logits, in float64, for the CPU op's own row loops (not
// FUSETRAIN_CPU_PATH=generic, which accumulates in float32 like torch).
// eps = 2^-24, the fp32 unit roundoff: a rounding moves v by at most eps |v|,
// and an fp32 ulp of v is at most 2 eps |v|. u_j = max_k x_k - x_j is a
// logit's gap to its row's maximum, w_j its softmax weight, and
// ubar = sum_j w_j u_j. E = ceil(C / 32) + 3 bounds the steps (an element or
// a 16-byte pack each) of one GPU thread, whatever the threads per row: a
// row has at least a warp.
// - s = sum_j exp(-u_j), lse = max + log s; d(lse) = ds / s.
//   GPU: __expf(a) is within 2 + floor(1.173 |a|) ulps (CUDA C++ Programming
//   Guide, intrinsic functions), not the ~1 ulp of expf, and grows with the
//   argument. A term goes through at most E + 11 of them (its own, one per
//   later rise of its thread's running maximum, one per merge level, at most
//   10 in a 1024-thread block) whose arguments add up to -u_j, each argument
//   an fp32 difference (eps |a|); then at most 2 E + 27 roundings in a chain
//   (adds: 7 in a pack, one per step, one per merge; rescaling multiplies).
//   nvcc contracts a multiply feeding an add into an FMA (the rescale and
//   add of a running sum), which rounds once where two roundings are
//   counted: the bound holds with or without contraction, which is also why
//   the last bits differ from the CPU's. Relative error of s:
//     eps (4 (E + 11) + 2 E + 27 + (2 * 1.173 + 1) ubar)
//   CPU: its exp is within 1.01 ulps (cross_entropy_loops.inc; glibc's expf
//   on the scalar path within 1), at most ceil(C / 64) + 9 per term (its
//   own, one per later step of its vector lane), arguments as above, 7 fp32
//   adds (a chunk of 8), the rest in double:
//     eps (2.02 (ceil(C / 64) + 9) + 8 + ubar)
//   The two lse's differ by at most the sum of those; each side stores its
//   lse in fp32: + 2 eps |lse|.
// - A row's loss is formed in double on both sides from the unrounded lse:
//   the same difference, plus ls / C times the error of the sum of the
//   logits (fp32 chains of E + 17 adds on the GPU, 7 on the CPU, each at most
//   eps sum_j |x_j|), plus its two fp32 roundings, 2 eps |loss|. "sum" and
//   "mean" add the rows' bounds (over the kept rows), plus 2 eps |loss|: both
//   sides sum the fp32 rows in double.
// - The gradient is g = q * scale with q = p - ls / C - (1 - ls) [j == t] and
//   p = exp(a), a = x_j - lse, from each side's stored lse (scale and ls / C
//   are the same floats on both sides): |dp| <= p (d(lse) + eps (2 (2 +
//   1.173 |a|) + 2.02 + 2 |a|)) with d(lse) the stored lse's bound above,
//   and each side's three roundings after the exp add eps (p + ls / C + 2 |q|)
//   |scale|. A bfloat16 gradient rounds once more on each side: one bf16 ulp
//   (8 significant bits) of the larger result.
// Second-order terms (products of two of these) are covered by a factor 1.01.
constexpr double kEps = 0x1p-24;
constexpr double kSecondOrder = 1.01;

struct CudaBounds {
  at::Tensor lse;   // [N]
  at::Tensor loss;  // [N] for "none", else 0-d
  at::Tensor grad;  // [N, C]; 0 on ignored rows, which must be exactly 0
};

// The bounds of Note [CUDA cross-entropy bound] for |CUDA - CPU op|, with
// ignore_index -100 and `upstream` the loss's incoming gradient.
CudaBounds cuda_vs_cpu_bounds(const Case& cs, double ls, const std::string& reduction,
                              const at::Tensor& upstream) {
  const at::Tensor x = cs.logits.to(at::kDouble);
  const int64_t c = x.size(1);
  const double steps = std::ceil(static_cast<double>(c) / 32) + 3;
  const double cpu_exps = std::ceil(static_cast<double>(c) / 64) + 9;
  const at::Tensor kept = cs.target != -100;
  const at::Tensor t = cs.target.clamp_min(0).unsqueeze(1);

  const at::Tensor lse = at::logsumexp(x, 1);
  const at::Tensor gap = std::get<0>(x.max(1, true)) - x;
  const at::Tensor ubar = (at::softmax(x, 1) * gap).sum(1);
  const at::Tensor ds = kEps * ((4 * (steps + 11) + 2 * steps + 27 + (2 * 1.173 + 1) * ubar) +
                                (2.02 * cpu_exps + 8 + ubar));
  const at::Tensor lse_bound = ds + 2 * kEps * lse.abs();

  const at::Tensor nll = lse - x.gather(1, t).squeeze(1);
  const at::Tensor row_loss = at::where(kept, (1 - ls) * nll + ls * (lse - x.mean(1)), 0.0);
  const at::Tensor sum_error = (steps + 24) * kEps * x.abs().sum(1);
  const at::Tensor row_bound =
      at::where(kept, ds + ls / c * sum_error + 2 * kEps * row_loss.abs(), 0.0);

  CudaBounds b;
  b.lse = kSecondOrder * lse_bound;
  at::Tensor scale = upstream.to(at::kDouble);
  if (reduction == "none") {
    b.loss = kSecondOrder * row_bound;
    scale = scale.unsqueeze(1);
  } else {
    const double divisor = reduction == "mean" ? kept.sum().item<double>() : 1.0;
    const at::Tensor total = row_loss.sum() / divisor;
    b.loss = kSecondOrder * (row_bound.sum() / divisor + 2 * kEps * total.abs());
    scale = scale / divisor;
  }

  const at::Tensor a = x - lse.unsqueeze(1);
  const at::Tensor p = a.exp();
  const double smooth = ls / c;
  const at::Tensor q = p - smooth - (1 - ls) * at::zeros_like(x).scatter_(1, t, 1.0);
  const at::Tensor exp_error = kEps * (2 * (2 + 1.173 * a.abs()) + 2.02 + 2 * a.abs());
  at::Tensor g_bound = scale.abs() * (p * (lse_bound.unsqueeze(1) + exp_error) +
                                      2 * kEps * (p + smooth + 2 * q.abs()));
  if (cs.logits.scalar_type() == at::kBFloat16) {
    const at::Tensor larger = ((q * scale).abs() + g_bound) * (1 + 0x1p-8);
    g_bound = g_bound + 0x1p-7 * larger;
  }
  b.grad = kSecondOrder * at::where(kept.unsqueeze(1), g_bound, 0.0);
  return b;
}

// The largest |a - b| / bound (0 where a == b, NaN or inf past any bound),
// so that a failure shows how far past its bound the worst element went.
double worst_ratio(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bound) {
  const at::Tensor diff = (a.cpu().to(at::kDouble) - b.cpu().to(at::kDouble)).abs();
  return at::where(diff == 0, 0.0, diff / bound).max().item<double>();
}

}  // namespace

TEST_CASE("CUDA softmax_cross_entropy matches the CPU op", "[cuda][cross_entropy]") {
  REQUIRE_CUDA();
  const auto dtype = GENERATE(at::kFloat, at::kBFloat16);
  // Threads per row: a warp up to 1024 classes, 128 up to 4096, 256 beyond.
  // Odd widths: rows start at every alignment and end in partial packs.
  const int64_t c = GENERATE(997, 3001, 5003);
  const std::string reduction = GENERATE("none", "sum", "mean");
  const double ls = GENERATE(0.0, 0.1);
  CAPTURE(dtype, c, reduction, ls);
  // 37 rows: not a multiple of 16, nor of the 4 rows of a narrow block;
  // every third row ignored (target -100).
  constexpr int64_t kRows = 37;
  const Case cs = make_case(kRows, c, dtype, 11);
  const at::Tensor upstream = reduction == "none"
                                  ? (at::arange(kRows, at::kFloat).remainder(7) - 3) / 4
                                  : at::full({}, 1.75, at::kFloat);
  const at::Device cuda(at::kCUDA);
  const at::Tensor x = cs.logits.to(cuda);
  const at::Tensor t = cs.target.to(cuda);

  at::Tensor loss_cpu, lse_cpu, kept_cpu, loss_gpu, lse_gpu, kept_gpu;
  std::tie(loss_cpu, lse_cpu, kept_cpu) =
      fusetrain::ops::softmax_cross_entropy_forward(cs.logits, cs.target, -100, ls, reduction);
  std::tie(loss_gpu, lse_gpu, kept_gpu) =
      fusetrain::ops::softmax_cross_entropy_forward(x, t, -100, ls, reduction);
  // The GPU's backward divides by its forward's count ("mean"): no recount.
  const at::Tensor grad_cpu = fusetrain::ops::softmax_cross_entropy_backward(
      upstream, cs.logits, cs.target, lse_cpu, -100, ls, reduction);
  const at::Tensor grad_gpu = fusetrain::ops::softmax_cross_entropy_backward(
      upstream.to(cuda), x, t, lse_gpu, -100, ls, reduction, kept_gpu);
  REQUIRE(at::equal(kept_gpu.cpu(), kept_cpu));
  REQUIRE(loss_gpu.is_cuda());
  REQUIRE(loss_gpu.scalar_type() == at::kFloat);
  REQUIRE(loss_gpu.sizes() == loss_cpu.sizes());
  REQUIRE(grad_gpu.is_cuda());
  REQUIRE(grad_gpu.scalar_type() == dtype);
  REQUIRE(grad_gpu.sizes() == grad_cpu.sizes());

  const CudaBounds bound = cuda_vs_cpu_bounds(cs, ls, reduction, upstream);
  CHECK(worst_ratio(lse_gpu, lse_cpu, bound.lse) <= 1.0);
  CHECK(worst_ratio(loss_gpu, loss_cpu, bound.loss) <= 1.0);
  CHECK(worst_ratio(grad_gpu, grad_cpu, bound.grad) <= 1.0);
  const at::Tensor ignored = cs.target == -100;
  CHECK(grad_gpu.cpu().index({ignored}).abs().max().item<double>() == 0.0);
  if (reduction == "none") CHECK(loss_gpu.cpu().index({ignored}).abs().max().item<double>() == 0.0);

  // The autograd face runs the same deterministic kernels: the same bits.
  const SoftmaxCrossEntropyOptions opts{-100, reduction, ls};
  const at::Tensor leaf = x.detach().clone().requires_grad_();
  const at::Tensor loss_nn = fusetrain::nn::softmax_cross_entropy(leaf, t, opts);
  loss_nn.backward(upstream.to(cuda));
  CHECK(at::equal(loss_nn.detach(), loss_gpu));
  CHECK(at::equal(leaf.grad(), grad_gpu));
}

// Tests of fusetrain::nn::linear_cross_entropy and LinearCrossEntropyLoss from
// C++ (issue 38): the loss and the input, weight and bias gradients against a
// float64 reference built from at::linear + at::cross_entropy_loss on the same
// (dtype-rounded) inputs, for each reduction, label smoothing, class weights,
// ignore_index, with and without a bias, in chunks that do and do not divide
// the rows. Each result must be within 2x torch's own error (the same ops in
// the same dtype, element by element) plus a first-order bound derived for our
// arithmetic (Note [LCE test bound], the same as
// tests/python/test_linear_cross_entropy.py's lce_bounds). The module's
// parameters and buffer, the options, the errors, and (a [cuda] case) CUDA
// against the CPU.
#include <fusetrain/nn/linear_cross_entropy.h>
#include <fusetrain/ops/linear_cross_entropy.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <catch2/catch.hpp>

#include "cuda_test.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

namespace {

using fusetrain::nn::LinearCrossEntropyFuncOptions;
using torch::indexing::None;
using torch::indexing::Slice;

constexpr double kU32 = 0x1p-24;  // float32 unit roundoff
// First-order bounds leave out products of two errors, under 1% here.
constexpr double kSecondOrder = 1.1;

double unit(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16:
      return 0x1p-8;
    case at::kHalf:
      return 0x1p-11;
    default:
      return kU32;
  }
}

struct Case {
  at::Tensor x;       // [N, H]
  at::Tensor w;       // [C, H]
  at::Tensor b;       // [C] or undefined
  at::Tensor t;       // [N]
  at::Tensor weight;  // [C] class weights or undefined
};

// Every 4th row ignored (target = the ignore_index), every 5th from the 2nd
// targets class 3; logits of std ~2; class weights multiples of 1/4 (exact in
// every dtype).
Case make_case(int64_t n, int64_t h, int64_t c, at::ScalarType dtype, bool bias, bool weighted,
               int64_t ignore_index, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Case cs;
  cs.x = at::randn({n, h}, gen).to(dtype);
  cs.w = (at::randn({c, h}, gen) * (2.0 / std::sqrt(static_cast<double>(h)))).to(dtype);
  if (bias) cs.b = at::randn({c}, gen).to(dtype);
  cs.t = at::randint(0, c, {n}, gen, at::kLong);
  cs.t.index_put_({Slice(1, None, 5)}, 3);
  cs.t.index_put_({Slice(None, None, 4)}, ignore_index);
  if (weighted) cs.weight = at::randint(1, 9, {c}, gen, at::kFloat) / 4;
  return cs;
}

at::Reduction::Reduction reduction_of(const std::string& r) {
  if (r == "mean") return at::Reduction::Mean;
  if (r == "sum") return at::Reduction::Sum;
  return at::Reduction::None;
}

// 1.75 for a scalar loss; (i % 7 - 3) / 4 per row for "none" (exact in every dtype).
at::Tensor upstream_for(const std::string& reduction, int64_t n) {
  return reduction == "none" ? (at::arange(n, at::kFloat).remainder(7) - 3) / 4
                             : at::full({}, 1.75, at::kFloat);
}

struct Result {
  at::Tensor loss;
  at::Tensor gx, gw, gb;  // gb undefined without a bias
};

// Loss and gradients of (x, w, b) for `upstream`; `cast` converts the inputs first.
template <typename Fn>
Result run(Fn&& fn, const Case& cs, const at::Tensor& upstream,
           std::optional<at::ScalarType> cast = std::nullopt) {
  const auto leaf = [&](const at::Tensor& v) {
    if (!v.defined()) return at::Tensor();
    return (cast ? v.to(*cast) : v).detach().clone().requires_grad_();
  };
  const at::Tensor x = leaf(cs.x), w = leaf(cs.w), b = leaf(cs.b);
  const at::Tensor loss = fn(x, w, b);
  std::vector<at::Tensor> inputs{x, w};
  if (b.defined()) inputs.push_back(b);
  const auto grads = torch::autograd::grad({loss}, inputs, {upstream.to(loss.scalar_type())});
  return {loss.detach(), grads[0], grads[1], b.defined() ? grads[2] : at::Tensor()};
}

struct Options {
  std::string reduction = "mean";
  std::optional<int64_t> ignore_index;
  double ls = 0.0;
  std::optional<int64_t> chunk;
  bool gradients_in_forward = true;
};

LinearCrossEntropyFuncOptions func_options(const Case& cs, const Options& o, const at::Tensor& b) {
  LinearCrossEntropyFuncOptions f;
  f.linear_bias = b;
  f.weight = cs.weight;
  f.reduction = o.reduction;
  f.ignore_index = o.ignore_index;
  f.label_smoothing = o.ls;
  fusetrain::nn::LinearCrossEntropyOptions how;
  how.batch_chunk_size = o.chunk;
  how.gradients_in_forward = o.gradients_in_forward;
  how.acc_policy = "compact";  // 16-bit GEMMs: the bounds below are eager's
  f.options = how;
  return f;
}

// at::linear + at::cross_entropy_loss with the class weights in `dtype`.
at::Tensor torch_lce(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                     const at::Tensor& t, const at::Tensor& weight, const Options& o,
                     at::ScalarType dtype) {
  const at::Tensor z = at::linear(x, w, b.defined() ? std::optional<at::Tensor>(b) : std::nullopt);
  return at::cross_entropy_loss(z, t, weight.defined() ? weight.to(dtype) : at::Tensor(),
                                reduction_of(o.reduction), o.ignore_index.value_or(-100), o.ls);
}

// Note [LCE test bound]
// First-order bounds of |ours - float64| for inputs rounded to `dtype` (u its
// unit roundoff, U32 float32's), rows X [N, H], W [C, H]:
// - logits: a GEMM accumulating H products in fp32, rounded to dtype, plus
//   the bias: dz <= u (|z| + |X W^T|) + (H + 2) U32 (|X| |W|^T + |b|).
// - loss: sum_ij |G1_ij| dz_ij (G1 the float64 logits gradient for a loss
//   gradient of 1), the fp32 cross-entropy per row 2^-23 (3 + log2 C) (|lse| +
//   max |z|) sum_j c_ij, the fp32 row losses, the float32 denominator (N U32
//   relative) and the rounding to the loss dtype.
// - logits gradient G = S p - s c (c the row's class coefficients, s its
//   upstream over the denominator, S = s sum c): dG <= |S| p (dz + sum_k p_k
//   dz_k) + 4 U32 |S| p (1 + |z - lse| + |lse|) + u |G|.
// - grad_input = G W: dG |W| + (C + 1) U32 |G| |W| + 2 u |gx|; grad_weight =
//   G^T X: dG^T |X| + (N + 1) U32 |G|^T |X| + 2 u |gw| (+ u sum_chunks
//   |G_c^T X_c| for 16 bits: each chunk's CPU GEMM is 16-bit before the fp32
//   accumulator); grad_bias: sum_i dG_i + (N + 1) U32 sum_i |G_i| + 2 u |gb|.
// - each rounding to a 16-bit dtype also errs by up to half its smallest
//   subnormal, eta (fp16: 2^-25; small "mean" gradients fall below the normal
//   range): once for G, twice for each gradient, once per chunk for the
//   16-bit chunk GEMMs of grad_weight, once for the loss.
struct Reference {
  Result ref;
  Result bound;
};

Reference reference_and_bounds(const Case& cs, const Options& o, at::ScalarType dtype,
                               at::ScalarType loss_dtype, int64_t chunk,
                               const at::Tensor& upstream) {
  const int64_t n = cs.x.size(0), h = cs.x.size(1), c = cs.w.size(0);
  const int64_t ii = o.ignore_index.value_or(-100);
  const at::Tensor xl = cs.x.to(at::kDouble).requires_grad_();
  const at::Tensor wl = cs.w.to(at::kDouble).requires_grad_();
  const at::Tensor bl = cs.b.defined() ? cs.b.to(at::kDouble).requires_grad_() : at::Tensor();
  const at::Tensor w64 = cs.weight.defined() ? cs.weight.to(at::kDouble) : at::Tensor();
  const at::Tensor z =
      at::linear(xl, wl, bl.defined() ? std::optional<at::Tensor>(bl) : std::nullopt);
  const at::Tensor loss = at::cross_entropy_loss(z, cs.t, w64, reduction_of(o.reduction), ii, o.ls);
  const at::Tensor up = upstream.to(at::kDouble);
  std::vector<at::Tensor> inputs{z, xl, wl};
  if (bl.defined()) inputs.push_back(bl);
  const auto grads = torch::autograd::grad({loss}, inputs, {up}, /*retain_graph=*/true);
  const at::Tensor G1 = torch::autograd::grad({loss}, {z}, {at::ones_like(loss)})[0];

  Reference r;
  r.ref = {loss.detach(), grads[1], grads[2], bl.defined() ? grads[3] : at::Tensor()};
  at::NoGradGuard no_grad;
  const at::Tensor G = grads[0];
  const at::Tensor X = xl.detach(), W = wl.detach(), Z = z.detach();
  const at::Tensor B = bl.defined() ? bl.detach() : at::zeros({c}, at::kDouble);
  const double u = unit(dtype), u_loss = unit(loss_dtype);
  const auto half_subnormal = [](at::ScalarType t) {
    return t == at::kHalf ? 0x1p-25 : t == at::kBFloat16 ? 0x1p-134 : 0x1p-150;
  };
  const double eta = half_subnormal(dtype), eta_loss = half_subnormal(loss_dtype);
  const at::Tensor kept = cs.t.ne(ii);
  const at::Tensor tc = at::where(kept, cs.t, 0);
  const at::Tensor wv = w64.defined() ? w64 : at::ones({c}, at::kDouble);
  const at::Tensor onehot = at::one_hot(tc, c).to(at::kDouble);
  const at::Tensor coef =
      kept.unsqueeze(1) *
      ((1 - o.ls) * onehot * wv.index_select(0, tc).unsqueeze(1) + o.ls / c * wv.unsqueeze(0));
  const at::Tensor denominator =
      o.reduction == "mean" ? (wv.index_select(0, tc) * kept).sum() : at::ones({}, at::kDouble);
  const at::Tensor s = (o.reduction == "none" ? up : up.expand({n})) / denominator;
  const at::Tensor p = at::softmax(Z, 1);
  const at::Tensor lse = at::logsumexp(Z, {1});
  const at::Tensor S = s * coef.sum(1);
  // The gradient formula the bound rests on is the reference's.
  REQUIRE(at::allclose(G, S.unsqueeze(1) * p - s.unsqueeze(1) * coef, 1e-9, 1e-12));

  const at::Tensor A = at::mm(X.abs(), W.abs().t()) + B.abs();
  const at::Tensor dz = u * (Z.abs() + at::mm(X, W.t()).abs()) + (h + 2) * kU32 * A;
  const at::Tensor row_loss = at::cross_entropy_loss(Z, cs.t, w64, at::Reduction::None, ii, o.ls);
  const at::Tensor T = 0x1p-23 * (3 + std::log2(static_cast<double>(c))) *
                       (lse.abs() + std::get<0>(Z.abs().max(1))) * coef.sum(1);
  const at::Tensor from_logits = (G1.abs() * dz).sum(1);
  if (o.reduction == "none") {
    r.bound.loss = from_logits + T + (u_loss + kU32) * row_loss.abs() + eta_loss;
  } else {
    r.bound.loss = from_logits.sum() + (T.sum() + kU32 * row_loss.abs().sum()) / denominator +
                   (u_loss + (n + 2) * kU32) * r.ref.loss.abs() + eta_loss;
  }
  const at::Tensor Sa = S.abs().unsqueeze(1);
  const at::Tensor dG =
      Sa * p * (dz + (p * dz).sum(1, true)) +
      4 * kU32 * Sa * p * (1 + (Z - lse.unsqueeze(1)).abs() + lse.abs().unsqueeze(1)) +
      u * G.abs() + eta;
  r.bound.gx = at::mm(dG, W.abs()) + (c + 1) * kU32 * at::mm(G.abs(), W.abs()) +
               2 * u * r.ref.gx.abs() + 2 * eta;
  r.bound.gw = at::mm(dG.t(), X.abs()) + (n + 1) * kU32 * at::mm(G.abs().t(), X.abs()) +
               2 * u * r.ref.gw.abs() + 2 * eta;
  if (dtype != at::kFloat) {
    for (int64_t r0 = 0; r0 < n; r0 += chunk) {
      const int64_t rows = std::min(chunk, n - r0);
      r.bound.gw += u * at::mm(G.narrow(0, r0, rows).t(), X.narrow(0, r0, rows)).abs() + eta;
    }
  }
  if (bl.defined()) {
    r.bound.gb = dG.sum(0) + (n + 1) * kU32 * G.abs().sum(0) + 2 * u * r.ref.gb.abs() + 2 * eta;
  }
  for (at::Tensor* v : {&r.bound.loss, &r.bound.gx, &r.bound.gw, &r.bound.gb}) {
    if (v->defined()) *v = *v * kSecondOrder;
  }
  return r;
}

// The largest |ours - ref| / (2 |torch - ref| + bound): at most 1 passes.
double worst_ratio(const at::Tensor& ours, const at::Tensor& theirs, const at::Tensor& ref,
                   const at::Tensor& bound) {
  REQUIRE(ours.sizes() == ref.sizes());
  const at::Tensor err = (ours.cpu().to(at::kDouble) - ref).abs();
  const at::Tensor allowed = 2 * (theirs.cpu().to(at::kDouble) - ref).abs() + bound;
  if (err.numel() == 0) return 0.0;
  return at::where(err == 0, 0.0, err / allowed).max().item<double>();
}

void check_near_reference(const Result& ours, const Result& theirs, const Reference& r) {
  CHECK(worst_ratio(ours.loss, theirs.loss, r.ref.loss, r.bound.loss) <= 1.0);
  CHECK(worst_ratio(ours.gx, theirs.gx, r.ref.gx, r.bound.gx) <= 1.0);
  CHECK(worst_ratio(ours.gw, theirs.gw, r.ref.gw, r.bound.gw) <= 1.0);
  REQUIRE(ours.gb.defined() == r.ref.gb.defined());
  if (r.ref.gb.defined()) CHECK(worst_ratio(ours.gb, theirs.gb, r.ref.gb, r.bound.gb) <= 1.0);
}

bool bits_equal(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined()) return a.defined() == b.defined();
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         at::equal(a.view(a.element_size() == 4 ? at::kInt : at::kShort),
                   b.view(b.element_size() == 4 ? at::kInt : at::kShort));
}

}  // namespace

TEST_CASE("linear_cross_entropy matches float64 at::linear + at::cross_entropy_loss",
          "[linear_cross_entropy]") {
  const auto dtype = GENERATE(at::kFloat, at::kBFloat16, at::kHalf);
  const std::string reduction = GENERATE("mean", "sum", "none");
  const double ls = GENERATE(0.0, 0.1);
  const bool weighted = GENERATE(false, true);
  const bool bias = GENERATE(false, true);
  const int64_t ignore_index = GENERATE(int64_t{-100}, int64_t{3});
  // 7 does not divide the 45 rows; 16 neither; 45 is one chunk; unset: the default rule.
  const int64_t chunk = GENERATE(int64_t{7}, int64_t{45}, int64_t{-1});
  CAPTURE(dtype, reduction, ls, weighted, bias, ignore_index, chunk);

  const Case cs = make_case(45, 24, 61, dtype, bias, weighted, ignore_index, 7);
  Options o;
  o.reduction = reduction;
  o.ls = ls;
  if (ignore_index != -100) o.ignore_index = ignore_index;  // unset means -100
  if (chunk > 0) o.chunk = chunk;
  const at::Tensor up = upstream_for(reduction, 45);
  const Result ours = run(
      [&](const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
        return fusetrain::nn::linear_cross_entropy(x, w, cs.t, func_options(cs, o, b));
      },
      cs, up);
  const Result theirs =
      run([&](const at::Tensor& x, const at::Tensor& w,
              const at::Tensor& b) { return torch_lce(x, w, b, cs.t, cs.weight, o, dtype); },
          cs, up);
  REQUIRE(ours.loss.scalar_type() == dtype);
  REQUIRE(ours.gx.scalar_type() == dtype);
  REQUIRE(ours.gw.scalar_type() == dtype);
  REQUIRE(ours.loss.sizes() == theirs.loss.sizes());
  const int64_t used_chunk =
      chunk > 0 ? chunk : fusetrain::ops::linear_cross_entropy_chunk_rows(45, 24, 61, dtype,
                                                                            ours.loss.device().type());
  const Reference r = reference_and_bounds(cs, o, dtype, dtype, used_chunk, up);
  check_near_reference(ours, theirs, r);

  // Ignored rows: no input gradient, and a zero loss for "none".
  const at::Tensor ignored = cs.t.eq(ignore_index);
  CHECK(ours.gx.index({ignored}).abs().max().item<double>() == 0.0);
  if (reduction == "none") CHECK(ours.loss.index({ignored}).abs().max().item<double>() == 0.0);

  // gradients_in_forward = false recomputes in the backward: for a loss
  // gradient of 1, the same bits (float16 GEMMs take the logits' gradient at
  // one row's scale in the forward, Note [Accumulation precision]: other
  // bits, within the bounds checked above).
  if (dtype == at::kHalf) return;
  Options in_backward = o;
  in_backward.gradients_in_forward = false;
  const at::Tensor ones = at::ones_like(up);
  const auto with = [&](const Options& oo) {
    return run(
        [&](const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
          return fusetrain::nn::linear_cross_entropy(x, w, cs.t, func_options(cs, oo, b));
        },
        cs, ones);
  };
  const Result a = with(o), b = with(in_backward);
  CHECK(bits_equal(a.loss, b.loss));
  CHECK(bits_equal(a.gx, b.gx));
  CHECK(bits_equal(a.gw, b.gw));
  CHECK(bits_equal(a.gb, b.gb));
}

TEST_CASE("linear_cross_entropy: batch shapes, all rows ignored, the reference path",
          "[linear_cross_entropy]") {
  const Case cs = make_case(12, 8, 10, at::kFloat, true, true, -100, 3);
  LinearCrossEntropyFuncOptions f;
  f.linear_bias = cs.b;
  f.weight = cs.weight;
  f.label_smoothing = 0.1;
  f.options.emplace().batch_chunk_size = 5;

  SECTION("3-D input is an error, as in torch: the rows are flattened first") {
    CHECK_THROWS_WITH(
        fusetrain::nn::linear_cross_entropy(cs.x.reshape({3, 4, 8}), cs.w, cs.t.reshape({3, 4}), f),
        Catch::Contains("expected input with dimensionality 1 or 2, got 3"));
  }
  SECTION("1-D input and 0-d target: one row") {
    const at::Tensor t0 = at::scalar_tensor(4, at::kLong);
    for (const std::string reduction : {"mean", "none"}) {
      f.reduction = reduction;
      const at::Tensor l = fusetrain::nn::linear_cross_entropy(cs.x[1], cs.w, t0, f);
      const at::Tensor ref = at::cross_entropy_loss(
          at::linear(cs.x[1].to(at::kDouble), cs.w.to(at::kDouble), cs.b.to(at::kDouble)), t0,
          cs.weight.to(at::kDouble), reduction_of(reduction), -100, 0.1);
      CHECK(l.dim() == 0);
      CHECK(std::abs(l.item<double>() - ref.item<double>()) <=
            1e-5 * (1 + std::abs(ref.item<double>())));
    }
  }
  SECTION("every row ignored: mean is NaN, the gradients zero") {
    const at::Tensor none = at::full({12}, -100, at::kLong);
    for (const bool gif : {true, false}) {
      f.options->gradients_in_forward = gif;
      f.reduction = "mean";
      const at::Tensor x = cs.x.clone().requires_grad_();
      const at::Tensor loss = fusetrain::nn::linear_cross_entropy(x, cs.w, none, f);
      CHECK(std::isnan(loss.item<float>()));
      loss.backward();
      CHECK(x.grad().abs().max().item<float>() == 0.0f);
      f.reduction = "sum";
      CHECK(fusetrain::nn::linear_cross_entropy(cs.x, cs.w, none, f).item<float>() == 0.0f);
    }
  }
  SECTION("a K-dimensional weight is the reference, bit for bit") {
    // [C, 2, H] weight: targets [N, 2], the logits [N, C, 2] (torch's).
    const at::Tensor wk = at::randn({10, 2, 8});
    const at::Tensor bk = at::randn({10, 2});
    const at::Tensor tk = at::randint(0, 10, {12, 2}, at::kLong);
    f.linear_bias = bk;
    f.options.reset();
    for (const std::string reduction : {"mean", "sum", "none"}) {
      f.reduction = reduction;
      const at::Tensor logits = at::linear(cs.x, wk.reshape({20, 8}), bk.reshape({20}))
                                    .reshape({12, 10, 2});
      const at::Tensor ref = at::cross_entropy_loss(logits, tk, f.weight, reduction_of(reduction),
                                                    -100, 0.1);
      CHECK(bits_equal(fusetrain::nn::linear_cross_entropy(cs.x, wk, tk, f), ref));
    }
  }
}

TEST_CASE("linear_cross_entropy under CPU autocast: bfloat16 GEMMs, a float32 loss",
          "[linear_cross_entropy]") {
  const Case cs = make_case(37, 32, 70, at::kFloat, true, true, -100, 6);
  Options o;
  o.ls = 0.1;
  o.chunk = 10;
  const at::Tensor up = upstream_for("mean", 37);
  const bool was_enabled = at::autocast::is_autocast_enabled(at::kCPU);
  const at::ScalarType was_dtype = at::autocast::get_autocast_dtype(at::kCPU);
  at::autocast::set_autocast_enabled(at::kCPU, true);
  at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
  const Result ours = run(
      [&](const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
        return fusetrain::nn::linear_cross_entropy(x, w, cs.t, func_options(cs, o, b));
      },
      cs, up);
  const Result theirs =
      run([&](const at::Tensor& x, const at::Tensor& w,
              const at::Tensor& b) { return torch_lce(x, w, b, cs.t, cs.weight, o, at::kFloat); },
          cs, up);
  at::autocast::set_autocast_enabled(at::kCPU, was_enabled);
  at::autocast::set_autocast_dtype(at::kCPU, was_dtype);
  at::autocast::clear_cache();
  CHECK(ours.loss.scalar_type() == at::kFloat);
  CHECK(theirs.loss.scalar_type() == at::kFloat);
  CHECK(ours.gx.scalar_type() == at::kFloat);
  CHECK(ours.gw.scalar_type() == at::kFloat);
  CHECK(ours.gb.scalar_type() == at::kFloat);
  Case rounded = cs;  // what autocast gives the GEMMs
  rounded.x = cs.x.to(at::kBFloat16);
  rounded.w = cs.w.to(at::kBFloat16);
  rounded.b = cs.b.to(at::kBFloat16);
  const Reference r = reference_and_bounds(rounded, o, at::kBFloat16, at::kFloat, 10, up);
  check_near_reference(ours, theirs, r);
}

TEST_CASE("linear_cross_entropy: errors name what is wrong", "[linear_cross_entropy]") {
  const Case cs = make_case(10, 8, 13, at::kFloat, true, false, -100, 1);
  using fusetrain::nn::linear_cross_entropy;
  at::Tensor t = cs.t.clone();
  t.index_put_({6}, 13);
  CHECK_THROWS_AS(linear_cross_entropy(cs.x, cs.w, t), c10::IndexError);
  CHECK_THROWS_WITH(linear_cross_entropy(cs.x, cs.w, t), Catch::Contains("target[6] = 13"));
  t.index_put_({6}, -1);
  CHECK_THROWS_WITH(linear_cross_entropy(cs.x, cs.w, t), Catch::Contains("target[6] = -1"));
  CHECK_THROWS_WITH(linear_cross_entropy(cs.x, cs.w.narrow(1, 0, 5), cs.t),
                    Catch::Contains("expected equal input and linear_weight last dimensions "
                                    "(in_features), got 8 and 5, respectively"));
  CHECK_THROWS_WITH(linear_cross_entropy(cs.x, cs.w.to(at::kDouble), cs.t),
                    Catch::Contains("float != double"));
  CHECK_THROWS_AS(linear_cross_entropy(cs.x, cs.w, cs.t.narrow(0, 0, 5)), c10::ValueError);
  CHECK_THROWS_WITH(linear_cross_entropy(cs.x, cs.w, cs.t.narrow(0, 0, 5)),
                    Catch::Contains("Expected input batch_size (10) to match target batch_size (5)"));
  LinearCrossEntropyFuncOptions bad;
  bad.reduction = "avg";
  CHECK_THROWS_AS(linear_cross_entropy(cs.x, cs.w, cs.t, bad), c10::ValueError);
  CHECK_THROWS_WITH(linear_cross_entropy(cs.x, cs.w, cs.t, bad),
                    Catch::Contains("avg is not a valid value for reduction"));
  bad = {};
  bad.label_smoothing = 1.5;
  CHECK_THROWS_WITH(linear_cross_entropy(cs.x, cs.w, cs.t, bad),
                    Catch::Contains("label_smoothing must be between 0.0 and 1.0"));
  bad = {};
  bad.options.emplace().chunking_method = "chunked";
  CHECK_THROWS_AS(linear_cross_entropy(cs.x, cs.w, cs.t, bad), c10::ValueError);
  CHECK_THROWS_WITH(linear_cross_entropy(cs.x, cs.w, cs.t, bad),
                    Catch::Contains("invalid chunking_method: 'chunked'"));
  bad = {};
  bad.options.emplace().batch_chunk_size = 0;
  CHECK_THROWS_WITH(linear_cross_entropy(cs.x, cs.w, cs.t, bad),
                    Catch::Contains("batch_chunk_size must be positive int or None, got 0"));
  bad = {};
  bad.options.emplace().acc_policy = "fast";
  CHECK_THROWS_AS(linear_cross_entropy(cs.x, cs.w, cs.t, bad), c10::ValueError);
  CHECK_THROWS_WITH(linear_cross_entropy(cs.x, cs.w, cs.t.to(at::kInt)),
                    Catch::Contains("expected target dtype to be Long or Byte, but got Int"));
}

TEST_CASE("LinearCrossEntropyLoss: parameters, buffer, and the functional's values",
          "[linear_cross_entropy]") {
  const at::Tensor class_weight = at::rand({13});
  fusetrain::nn::LinearCrossEntropyLossOptions o(8, 13);
  o.bias = true;
  o.weight = class_weight;
  o.reduction = "sum";
  o.ignore_index = 3;
  o.label_smoothing = 0.1;
  o.options.emplace().batch_chunk_size = 4;
  fusetrain::nn::LinearCrossEntropyLoss m(o);

  std::vector<std::string> params, buffers;
  for (const auto& p : m->named_parameters()) params.push_back(p.key());
  for (const auto& b : m->named_buffers()) buffers.push_back(b.key());
  CHECK(params == std::vector<std::string>{"linear.weight", "linear.bias"});
  CHECK(buffers == std::vector<std::string>{"weight"});
  CHECK(m->linear->weight.sizes() == at::IntArrayRef{13, 8});
  CHECK(at::equal(m->weight, class_weight));

  fusetrain::nn::LinearCrossEntropyLoss plain(fusetrain::nn::LinearCrossEntropyLossOptions(8, 13));
  params.clear();
  for (const auto& p : plain->named_parameters()) params.push_back(p.key());
  CHECK(params == std::vector<std::string>{"linear.weight"});
  CHECK(plain->named_buffers().size() == 0);

  const Case cs = make_case(11, 8, 13, at::kFloat, false, false, 3, 2);
  const at::Tensor x = cs.x.clone().requires_grad_();
  const at::Tensor loss = m->forward(x, cs.t);
  loss.backward();
  // The functional with the module's tensors: the same bits.
  const at::Tensor xf = cs.x.clone().requires_grad_();
  const at::Tensor wf = m->linear->weight.detach().clone().requires_grad_();
  const at::Tensor bf = m->linear->bias.detach().clone().requires_grad_();
  LinearCrossEntropyFuncOptions f;
  f.linear_bias = bf;
  f.weight = class_weight;
  f.reduction = "sum";
  f.ignore_index = 3;
  f.label_smoothing = 0.1;
  f.options.emplace().batch_chunk_size = 4;
  const at::Tensor ref = fusetrain::nn::linear_cross_entropy(xf, wf, cs.t, f);
  ref.backward();
  CHECK(bits_equal(loss.detach(), ref.detach()));
  CHECK(bits_equal(x.grad(), xf.grad()));
  CHECK(bits_equal(m->linear->weight.grad(), wf.grad()));
  CHECK(bits_equal(m->linear->bias.grad(), bf.grad()));
  // And the float64 reference.
  const at::Tensor r64 = at::cross_entropy_loss(
      at::linear(cs.x.to(at::kDouble), wf.detach().to(at::kDouble), bf.detach().to(at::kDouble)),
      cs.t, class_weight.to(at::kDouble), at::Reduction::Sum, 3, 0.1);
  CHECK(std::abs(loss.item<double>() - r64.item<double>()) <= 1e-5 * std::abs(r64.item<double>()));

  // A clone has its own parameters with the same values, and the same loss.
  const auto copy =
      std::dynamic_pointer_cast<fusetrain::nn::LinearCrossEntropyLossImpl>(m->clone());
  REQUIRE(copy);
  CHECK(copy->linear->weight.data_ptr() != m->linear->weight.data_ptr());
  CHECK(bits_equal(copy->forward(cs.x, cs.t).detach(), loss.detach()));
  // to(dtype) converts the parameters and the class weights.
  m->to(at::kBFloat16);
  CHECK(m->linear->weight.scalar_type() == at::kBFloat16);
  CHECK(m->weight.scalar_type() == at::kBFloat16);
  CHECK(m->forward(cs.x.to(at::kBFloat16), cs.t).scalar_type() == at::kBFloat16);
}

TEST_CASE("linear_cross_entropy_chunk_rows: the default rule", "[linear_cross_entropy]") {
  using fusetrain::ops::linear_cross_entropy_chunk_rows;
  constexpr auto cpu = c10::DeviceType::CPU;
  constexpr auto cuda = c10::DeviceType::CUDA;
  // Logits and gradient of about the input's memory, at least 64 MiB, in
  // multiples of 64 rows, at most the rows ...
  CHECK(linear_cross_entropy_chunk_rows(100, 8, 10, at::kFloat, cpu) == 100);
  CHECK(linear_cross_entropy_chunk_rows(1 << 20, 8, 1000, at::kBFloat16, cpu) ==
        ((int64_t{64} << 20) / (2 * 1000 * 2)) / 64 * 64);
  CHECK(linear_cross_entropy_chunk_rows(1 << 20, 256, 100000, at::kFloat, cpu) ==
        (int64_t{1 << 20} * 256 * 4 / (2 * 100000 * 4)) / 64 * 64);  // 1280
  CHECK(linear_cross_entropy_chunk_rows(5, 1, 1, at::kHalf, cpu) == 5);
  // ... and at least 512 rows on the CPU, 2048 on CUDA (the GEMMs' share).
  CHECK(linear_cross_entropy_chunk_rows(8192, 768, 50257, at::kFloat, cpu) == 512);
  CHECK(linear_cross_entropy_chunk_rows(8192, 768, 50257, at::kBFloat16, cpu) == 512);
  CHECK(linear_cross_entropy_chunk_rows(8192, 768, 32768, at::kBFloat16, cpu) == 512);
  CHECK(linear_cross_entropy_chunk_rows(16384, 4096, 128256, at::kBFloat16, cpu) == 512);
  CHECK(linear_cross_entropy_chunk_rows(16384, 4096, 128256, at::kBFloat16, cuda) == 2048);
  CHECK(linear_cross_entropy_chunk_rows(300, 8, 1 << 24, at::kFloat, cpu) == 300);
  CHECK(linear_cross_entropy_chunk_rows(3000, 8, 1 << 24, at::kFloat, cuda) == 2048);
  CHECK(linear_cross_entropy_chunk_rows(1 << 20, 8, 10, at::kFloat, cuda) ==
        linear_cross_entropy_chunk_rows(1 << 20, 8, 10, at::kFloat, cpu));
}

TEST_CASE("split float32 sum: float32 additions, one rounding to nearest even",
          "[linear_cross_entropy]") {
  using fusetrain::ops::split_sum_add_;
  using fusetrain::ops::split_sum_round_;
  // The sums as float32, from the two halves' bits.
  const auto joined = [](const at::Tensor& high, const at::Tensor& low) {
    const at::Tensor bits = high.view(at::kShort).to(at::kInt).bitwise_left_shift(16).bitwise_or(
        low.to(at::kInt).bitwise_and(0xffff));
    return bits.view(at::kFloat);
  };
  // 70000 sums (several threads' ranges); addends over 2^-30 .. 2^30 with
  // both signs, so that sums cancel and small addends fall below bf16's step.
  at::manual_seed(11);
  const std::vector<int64_t> shape{350, 200};
  at::Tensor high = at::zeros(shape, at::kBFloat16);
  at::Tensor low = at::zeros(shape, at::kShort);
  at::Tensor reference = at::zeros(shape, at::kFloat);
  for (int k = 0; k < 40; ++k) {
    const at::Tensor scale = at::randint(-30, 31, shape).to(at::kFloat).exp2();
    const at::Tensor addend = at::randn(shape).mul(scale).to(at::kBFloat16);
    split_sum_add_(high, low, addend);
    reference.add_(addend.to(at::kFloat));  // float32 additions, in order
    REQUIRE(at::equal(joined(high, low).view(at::kInt), reference.view(at::kInt)));
  }
  split_sum_round_(high, low);
  CHECK(at::equal(high.view(at::kShort), reference.to(at::kBFloat16).view(at::kShort)));

  // Ties go to the even neighbour: 1 + 2^-8 and 1 + 3 * 2^-8 sit halfway
  // between bf16 neighbours (step 2^-7 at 1).
  at::Tensor h2 = at::zeros({3}, at::kBFloat16);
  at::Tensor l2 = at::zeros({3}, at::kShort);
  split_sum_add_(h2, l2, at::tensor({1.0, 1.0 + 1.0 / 128, -3.0}).to(at::kBFloat16));
  split_sum_add_(h2, l2, at::tensor({1.0 / 256, 1.0 / 256, 1.0 / 4096}).to(at::kBFloat16));
  split_sum_round_(h2, l2);
  const at::Tensor expected = at::tensor({1.0, 1.0 + 2.0 / 128, -3.0 + 1.0 / 4096}).to(at::kFloat);
  CHECK(at::equal(h2.to(at::kFloat), expected.to(at::kBFloat16).to(at::kFloat)));
  CHECK(h2[0].item<float>() == 1.0f);
  CHECK(h2[1].item<float>() == 1.0f + 2.0f / 128);
  CHECK(h2[2].item<float>() == -3.0f);  // 2^-12 is below half of bf16's step at 3

  CHECK_THROWS_WITH(split_sum_add_(high, low, at::zeros({2}, at::kBFloat16)),
                    Catch::Contains("addend must be bfloat16 of shape"));
  at::Tensor wrong_low = at::zeros({2}, at::kShort);
  CHECK_THROWS_WITH(split_sum_round_(high, wrong_low),
                    Catch::Contains("low must be a contiguous int16"));
}

// ------------------------------------------------------------------ CUDA

TEST_CASE("CUDA linear_cross_entropy matches the CPU and float64", "[cuda][linear_cross_entropy]") {
  REQUIRE_CUDA();
  const auto dtype = GENERATE(at::kFloat, at::kBFloat16, at::kHalf);
  const std::string reduction = GENERATE("mean", "sum", "none");
  const bool weighted = GENERATE(false, true);
  const bool gif = GENERATE(true, false);
  CAPTURE(dtype, reduction, weighted, gif);
  const Case cs = make_case(200, 64, 999, dtype, true, weighted, -100, 11);
  Options o;
  o.reduction = reduction;
  o.ls = 0.1;
  o.chunk = 48;
  o.gradients_in_forward = gif;
  const at::Tensor up = upstream_for(reduction, 200);
  const at::Device cuda(at::kCUDA);
  Case gpu = cs;
  gpu.x = cs.x.to(cuda);
  gpu.w = cs.w.to(cuda);
  gpu.b = cs.b.to(cuda);
  gpu.t = cs.t.to(cuda);
  if (weighted) gpu.weight = cs.weight.to(cuda);
  const auto ours_on = [&](const Case& c) {
    return run(
        [&](const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
          return fusetrain::nn::linear_cross_entropy(x, w, c.t, func_options(c, o, b));
        },
        c, up.to(c.x.device()));
  };
  const Result cpu = ours_on(cs);
  const Result got = ours_on(gpu);
  REQUIRE(got.loss.is_cuda());
  REQUIRE(got.loss.scalar_type() == dtype);
  REQUIRE(got.gx.is_cuda());
  const Result theirs =
      run([&](const at::Tensor& x, const at::Tensor& w,
              const at::Tensor& b) { return torch_lce(x, w, b, gpu.t, gpu.weight, o, dtype); },
          gpu, up.to(cuda));
  const Reference r = reference_and_bounds(cs, o, dtype, dtype, 48, up);
  check_near_reference(got, theirs, r);
  // Both within the float64 bound: within twice it of each other.
  const auto diff = [](const at::Tensor& a, const at::Tensor& b, const at::Tensor& bound) {
    return ((a.cpu().to(at::kDouble) - b.to(at::kDouble)).abs() / (2 * bound)).max().item<double>();
  };
  CHECK(diff(got.loss, cpu.loss, r.bound.loss) <= 1.0);
  CHECK(diff(got.gx, cpu.gx, r.bound.gx) <= 1.0);
  CHECK(diff(got.gw, cpu.gw, r.bound.gw) <= 1.0);
  CHECK(diff(got.gb, cpu.gb, r.bound.gb) <= 1.0);
  const at::Tensor ignored = cs.t.eq(-100);
  CHECK(got.gx.cpu().index({ignored}).abs().max().item<double>() == 0.0);
}

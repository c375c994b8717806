// The fused optimizer and norm kernels (csrc/kernels/optim_kernels.cu) run
// through the CUDA emulator against the CPU ops of csrc/ops/cpu/optim_cpu.cpp.
//
// Bit for bit: the unscaled gradients written back (one IEEE division), the
// step counters, a skipped step (nothing written), the scatter and the chunk
// count. Within a tolerance: the updates, whose fp32 arithmetic the CPU's
// vector loops may contract into FMAs (and nvcc does on the GPU; the
// emulated kernels are compiled without contraction). Each of Adam's moments
// is two products and a sum, so they agree within 2u of the sum of the
// terms' magnitudes (u = 2^-24); the parameter within an ulp of itself plus
// 16u of the update (sqrt, two divisions, the eps sum, the product with the
// step size, each within u on either side); a 16-bit parameter or moment may
// then round to the neighbouring value, one unit roundoff of its type.
#include <fusetrain/ops/optim.h>

#include <ATen/ATen.h>

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kernel_test.h"
#include "optim_kernels.h"

namespace {

using fusetrain::kernels::AdamScalars;
using fusetrain::kernels::AdamTensors;
using fusetrain::kernels::SgdScalars;
using fusetrain::kernels::SgdTensors;
using kernel_test::float_type;
using kernel_test::unit_roundoff;

constexpr double kU = 0x1p-24;
constexpr int64_t kChunk = 65536;
constexpr int kMaxBlocks = 3;

// Sizes with vector tails (not a multiple of 4), a chunk edge and several
// chunks; each tensor of a list is placed at its own misalignment.
const std::vector<int64_t> kSizes = {1, 5, 4099, kChunk + 3, 278011};

std::vector<void*> pointers(const std::vector<at::Tensor>& list, size_t n) {
  std::vector<void*> out(n, nullptr);
  for (size_t i = 0; i < list.size(); ++i) out[i] = list[i].data_ptr();
  return out;
}

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& list) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : list) out.push_back(kernel_test::copy_in_place_of(t));
  return out;
}

// |got - want| <= tol elementwise, with the worst element in the message.
void require_close(const at::Tensor& got, const at::Tensor& want, const at::Tensor& tol,
                   const std::string& what) {
  const at::Tensor diff = (got.to(at::kDouble) - want.to(at::kDouble)).abs();
  const at::Tensor excess = diff - tol;
  const int64_t worst = excess.argmax().item<int64_t>();
  INFO(what << ": element " << worst << " of " << got.numel() << ": "
            << got.to(at::kDouble)[worst].item<double>() << " vs "
            << want.to(at::kDouble)[worst].item<double>() << ", tolerance "
            << tol.expand_as(diff)[worst].item<double>());
  REQUIRE((excess <= 0).all().item<bool>());
}

// One rounding to a 16-bit type may pick the other neighbour: a relative
// unit roundoff of the type, and at least fp16's subnormal spacing (applied
// as an absolute floor by storage_floor).
double storage_rounding(at::ScalarType dtype) {
  return dtype == at::kFloat ? 0.0 : 2 * unit_roundoff(dtype);
}
double storage_floor(at::ScalarType dtype) { return dtype == at::kHalf ? 0x1p-24 : 0.0; }

// ------------------------------------------------------------------- Adam

struct AdamCase {
  const char* name;
  at::ScalarType dtype;
  bool master;
  bool amsgrad;
  bool maximize;
  bool decoupled;
  double weight_decay;
  bool grad_scale;
  at::ScalarType lr_tensor;  // kFloat / kDouble: a device lr; kByte: the host's
};

struct AdamState {
  std::vector<at::Tensor> param, grad, m, v, vmax, master, step;
};

AdamState adam_state(const AdamCase& c, const std::vector<int64_t>& sizes, double grad_mult,
                     bool misaligned) {
  AdamState s;
  const at::ScalarType state = c.master ? at::kFloat : c.dtype;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int64_t off = misaligned ? static_cast<int64_t>(i % 7) + 1 : 0;
    auto place = [&](const at::Tensor& t) { return kernel_test::at_offset(t, off); };
    const at::Tensor p = at::randn({sizes[i]});
    s.param.push_back(place(p.to(c.dtype)));
    s.grad.push_back(place((at::randn({sizes[i]}) * grad_mult).to(c.dtype)));
    s.m.push_back(place((at::randn({sizes[i]}) * 0.1).to(state)));
    s.v.push_back(place((at::rand({sizes[i]}) * 0.01).to(state)));
    if (c.amsgrad) s.vmax.push_back(place((at::rand({sizes[i]}) * 0.012).to(state)));
    if (c.master) s.master.push_back(place(p));
    s.step.push_back(at::full({1}, static_cast<float>(i % 3)));
  }
  return s;
}

AdamState copy_state(const AdamState& s) {
  return {clones(s.param), clones(s.grad),   clones(s.m),   clones(s.v),
          clones(s.vmax),  clones(s.master), clones(s.step)};
}

// The scalars as csrc/ops/cuda/optim_cuda.cpp forms them.
AdamScalars adam_scalars(const fusetrain::ops::AdamHyper& h, const float* grad_scale,
                         const float* found_inf, const at::Tensor& lr_tensor) {
  AdamScalars s{};
  s.lr = h.lr;
  s.beta1 = h.beta1;
  s.beta2 = h.beta2;
  s.weight_decay = static_cast<float>(h.weight_decay);
  s.eps = static_cast<float>(h.eps);
  s.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  s.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  s.amsgrad = h.amsgrad;
  s.maximize = h.maximize;
  s.decoupled_weight_decay = h.decoupled_weight_decay;
  s.grad_scale = grad_scale;
  s.found_inf = found_inf;
  s.lr_device = lr_tensor.defined()
                    ? fusetrain::kernels::DeviceScalar{lr_tensor.data_ptr(),
                                                       lr_tensor.scalar_type() == at::kDouble}
                    : fusetrain::kernels::DeviceScalar{nullptr, false};
  s.weight_decay64 = h.weight_decay;
  return s;
}

void adam_on_emulator(const AdamCase& c, AdamState& s, const fusetrain::ops::AdamHyper& h,
                      const float* grad_scale, const float* found_inf,
                      const at::Tensor& lr_tensor) {
  const size_t n = s.param.size();
  const auto p = pointers(s.param, n), g = pointers(s.grad, n), m = pointers(s.m, n),
             v = pointers(s.v, n), vmax = pointers(s.vmax, n), master = pointers(s.master, n),
             step = pointers(s.step, n);
  std::vector<int64_t> numel;
  for (const at::Tensor& t : s.param) numel.push_back(t.numel());
  const AdamTensors tensors{p.data(),      g.data(),    m.data(),     v.data(),
                            vmax.data(),   master.data(), step.data(), numel.data(),
                            static_cast<int>(n)};
  REQUIRE_LAUNCH(fusetrain::kernels::launch_fused_adam(
      float_type(c.dtype), c.master, tensors, adam_scalars(h, grad_scale, found_inf, lr_tensor),
      kMaxBlocks, nullptr));
}

void adam_on_cpu(AdamState& s, const fusetrain::ops::AdamHyper& h, const at::Tensor& grad_scale,
                 const at::Tensor& found_inf, const at::Tensor& lr_tensor) {
  auto opt = [](const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; };
  fusetrain::ops::fused_adamw_(s.param, s.grad, s.m, s.v, s.vmax, s.master, s.step, h,
                               opt(grad_scale), opt(found_inf), opt(lr_tensor));
}

void require_adam_close(const AdamCase& c, const AdamState& got, const AdamState& want,
                        const AdamState& before, const fusetrain::ops::AdamHyper& h, double lr) {
  const at::ScalarType state = c.master ? at::kFloat : c.dtype;
  for (size_t i = 0; i < got.param.size(); ++i) {
    CAPTURE(i, got.param[i].numel());
    REQUIRE_BITS_EQUAL(got.step[i], want.step[i]);
    REQUIRE_BITS_EQUAL(got.grad[i], want.grad[i]);
    const at::Tensor g = want.grad[i].to(at::kDouble).abs();
    const at::Tensor m0 = before.m[i].to(at::kDouble).abs();
    const at::Tensor v0 = before.v[i].to(at::kDouble).abs();
    const at::Tensor p0 = (c.master ? before.master[i] : before.param[i]).to(at::kDouble).abs();
    // The gradient with its L2 term, bounded in magnitude.
    const at::Tensor gl2 = g + (c.decoupled ? 0.0 : h.weight_decay) * p0;
    const double rs = storage_rounding(state);
    const at::Tensor m1 = want.m[i].to(at::kDouble).abs();
    const at::Tensor v1 = want.v[i].to(at::kDouble).abs();
    require_close(got.m[i], want.m[i],
                  2 * kU * (h.beta1 * m0 + (1 - h.beta1) * gl2) + rs * m1 + storage_floor(state),
                  "exp_avg");
    require_close(got.v[i], want.v[i],
                  3 * kU * (h.beta2 * v0 + (1 - h.beta2) * gl2 * gl2) + rs * v1 + storage_floor(state),
                  "exp_avg_sq");
    if (c.amsgrad) {
      require_close(got.vmax[i], want.vmax[i],
                    3 * kU * (h.beta2 * v0 + (1 - h.beta2) * gl2 * gl2) + rs * v1 +
                        storage_floor(state),
                    "max_exp_avg_sq");
    }
    // The parameter moves by step_size * m / denom (after the decay): its
    // error is step_size / denom times m's absolute error, which
    // cancellation in m does not shrink, plus a few u of the move itself
    // (sqrt, two divisions, the eps sum, v's error halved by the sqrt), plus
    // the roundings of the decay product and the final difference.
    const at::Tensor t = want.step[i].to(at::kDouble);
    const at::Tensor step_size = lr / (1 - at::pow(h.beta1, t));
    const at::Tensor bc2 = at::sqrt(1 - at::pow(h.beta2, t));
    const at::Tensor second = (c.amsgrad ? want.vmax[i] : want.v[i]).to(at::kDouble);
    const at::Tensor denom = second.sqrt() / bc2 + h.eps;
    const at::Tensor dm = 2 * kU * (h.beta1 * m0 + (1 - h.beta1) * gl2);
    const at::Tensor move = step_size * m1 / denom;
    const at::Tensor p1 = (c.master ? want.master[i] : want.param[i]).to(at::kDouble).abs();
    const at::Tensor p_tol =
        2 * kU * (p1 + p0) + step_size / denom * (dm + rs * m1) + (12 * kU + rs) * move;
    if (c.master) require_close(got.master[i], want.master[i], p_tol, "master");
    require_close(got.param[i], want.param[i],
                  p_tol + storage_rounding(c.dtype) * p1 + storage_floor(c.dtype), "param");
  }
}

}  // namespace

TEST_CASE("fused Adam kernel matches the CPU op", "[kernels][optim][adam]") {
  at::manual_seed(6);
  const AdamCase c = GENERATE(
      AdamCase{"fp32 AdamW", at::kFloat, false, false, false, true, 0.01, false, at::kByte},
      AdamCase{"fp32 Adam L2, amsgrad, maximize", at::kFloat, false, true, true, false, 0.1, false,
               at::kByte},
      AdamCase{"fp32, scaled grads, float lr tensor", at::kFloat, false, false, false, true, 0.01,
               true, at::kFloat},
      AdamCase{"bf16 params, fp32 masters", at::kBFloat16, true, false, false, true, 0.01, true,
               at::kByte},
      AdamCase{"fp16 params, fp32 masters, amsgrad, double lr tensor", at::kHalf, true, true,
               false, true, 0.05, false, at::kDouble},
      AdamCase{"bf16 params and moments", at::kBFloat16, false, false, false, false, 0.0, false,
               at::kByte},
      AdamCase{"fp16 params and moments, scaled", at::kHalf, false, false, true, true, 0.01, true,
               at::kByte});
  const bool misaligned = GENERATE(false, true);
  CAPTURE(c.name, misaligned);

  fusetrain::ops::AdamHyper h;
  h.lr = 3e-3;
  h.weight_decay = c.weight_decay;
  h.amsgrad = c.amsgrad;
  h.maximize = c.maximize;
  h.decoupled_weight_decay = c.decoupled;
  const float scale_value = 1024.f;
  AdamState want = adam_state(c, kSizes, c.grad_scale ? scale_value : 1.0, misaligned);
  for (int step = 0; step < 2; ++step) {
    CAPTURE(step);
    const AdamState before = copy_state(want);
    AdamState got = copy_state(want);
    const at::Tensor grad_scale = c.grad_scale ? at::full({1}, scale_value) : at::Tensor();
    const at::Tensor lr_tensor =
        c.lr_tensor == at::kByte ? at::Tensor() : at::full({1}, 1e-2 * (step + 1), c.lr_tensor);
    const at::Tensor lr_tensor_cpu = lr_tensor.defined() ? lr_tensor.clone() : at::Tensor();
    adam_on_emulator(c, got, h, c.grad_scale ? grad_scale.data_ptr<float>() : nullptr, nullptr,
                     lr_tensor);
    adam_on_cpu(want, h, grad_scale, at::Tensor(), lr_tensor_cpu);
    const double lr = lr_tensor.defined() ? lr_tensor.item<double>() : h.lr;
    require_adam_close(c, got, want, before, h, lr);
    // The next step starts from the same state on both sides.
    want = copy_state(got);
    for (at::Tensor& g : want.grad) g.normal_().mul_(c.grad_scale ? scale_value : 1.f);
  }
}

TEST_CASE("fused Adam kernel skips the step on found_inf, counters included",
          "[kernels][optim][adam]") {
  const AdamCase c{"bf16 masters", at::kBFloat16, true, true, false, true, 0.01, true, at::kByte};
  AdamState s = adam_state(c, {3, 70000}, 1.0, true);
  const AdamState before = copy_state(s);
  const float scale = 2.f;
  const float found_inf = 1.f;
  fusetrain::ops::AdamHyper h;
  h.amsgrad = true;
  adam_on_emulator(c, s, h, &scale, &found_inf, at::Tensor());
  for (size_t i = 0; i < s.param.size(); ++i) {
    REQUIRE_BITS_EQUAL(s.param[i], before.param[i]);
    REQUIRE_BITS_EQUAL(s.grad[i], before.grad[i]);  // not unscaled either
    REQUIRE_BITS_EQUAL(s.m[i], before.m[i]);
    REQUIRE_BITS_EQUAL(s.v[i], before.v[i]);
    REQUIRE_BITS_EQUAL(s.vmax[i], before.vmax[i]);
    REQUIRE_BITS_EQUAL(s.master[i], before.master[i]);
    REQUIRE_BITS_EQUAL(s.step[i], before.step[i]);
  }
}

TEST_CASE("fused AMSGrad keeps a NaN max_exp_avg_sq, as the CPU op's std::max does",
          "[kernels][optim][adam]") {
  // max(vmax, v) with a NaN vmax is NaN in torch (and so is the step it
  // takes); fmaxf would return v and hide the NaN. NaNs on the vector path
  // and in a scalar tail, aligned and not.
  at::manual_seed(9);
  const AdamCase c{"fp32 amsgrad", at::kFloat, false, true, false, true, 0.01, false, at::kByte};
  const bool misaligned = GENERATE(false, true);
  CAPTURE(misaligned);
  AdamState want = adam_state(c, {37, 4099}, 1.0, misaligned);
  for (at::Tensor& t : want.vmax) {
    t[3] = std::numeric_limits<float>::quiet_NaN();
    t[t.numel() - 1] = std::numeric_limits<float>::quiet_NaN();
  }
  AdamState got = copy_state(want);
  fusetrain::ops::AdamHyper h;
  h.amsgrad = true;
  adam_on_emulator(c, got, h, nullptr, nullptr, at::Tensor());
  adam_on_cpu(want, h, at::Tensor(), at::Tensor(), at::Tensor());
  for (size_t i = 0; i < got.vmax.size(); ++i) {
    CAPTURE(i);
    CHECK(at::equal(got.vmax[i].isnan(), want.vmax[i].isnan()));
    CHECK(at::equal(got.param[i].isnan(), want.param[i].isnan()));
    CHECK(got.vmax[i].isnan().sum().item<int64_t>() == 2);
  }
}

TEST_CASE("fused Adam kernel over more tensors than a parameter block or a step block holds",
          "[kernels][optim][adam]") {
  // 4100 one-element tensors: 10 multi-tensor launches of <= 440 tensors and
  // two step-counter launches of <= 3998 counters.
  at::manual_seed(7);
  const AdamCase c{"fp32", at::kFloat, false, false, false, true, 0.01, false, at::kByte};
  const std::vector<int64_t> sizes(4100, 1);
  AdamState want = adam_state(c, sizes, 1.0, false);
  const AdamState before = copy_state(want);
  AdamState got = copy_state(want);
  fusetrain::ops::AdamHyper h;
  const int64_t launches = cuda_emu::counts().launches;
  adam_on_emulator(c, got, h, nullptr, nullptr, at::Tensor());
  CHECK(cuda_emu::counts().launches - launches == 12);
  adam_on_cpu(want, h, at::Tensor(), at::Tensor(), at::Tensor());
  require_adam_close(c, got, want, before, h, h.lr);
}

// -------------------------------------------------------------------- SGD

TEST_CASE("fused SGD kernel matches the CPU op", "[kernels][optim][sgd]") {
  at::manual_seed(8);
  struct SgdCase {
    const char* name;
    at::ScalarType dtype;
    bool master;
    double momentum, dampening, weight_decay;
    bool nesterov, maximize, grad_scale;
    at::ScalarType lr_tensor;
  };
  const SgdCase c = GENERATE(
      SgdCase{"fp32 plain", at::kFloat, false, 0.0, 0.0, 0.0, false, false, false, at::kByte},
      SgdCase{"fp32 momentum, dampening, wd", at::kFloat, false, 0.9, 0.1, 1e-2, false, false,
              true, at::kByte},
      SgdCase{"fp32 nesterov, maximize, float lr", at::kFloat, false, 0.9, 0.0, 0.0, true, true,
              false, at::kFloat},
      SgdCase{"bf16 masters, momentum", at::kBFloat16, true, 0.9, 0.0, 1e-3, false, false, true,
              at::kByte},
      SgdCase{"fp16 params and buffers, nesterov", at::kHalf, false, 0.8, 0.0, 0.0, true, false,
              false, at::kByte});
  const bool misaligned = GENERATE(false, true);
  CAPTURE(c.name, misaligned);
  const bool has_buffer = c.momentum != 0.0;
  const at::ScalarType state = c.master ? at::kFloat : c.dtype;
  const float scale_value = 512.f;

  std::vector<at::Tensor> p, g, b, master;
  for (size_t i = 0; i < kSizes.size(); ++i) {
    const int64_t off = misaligned ? static_cast<int64_t>(i % 7) + 1 : 0;
    const at::Tensor p32 = at::randn({kSizes[i]});
    p.push_back(kernel_test::at_offset(p32.to(c.dtype), off));
    g.push_back(kernel_test::at_offset(
        (at::randn({kSizes[i]}) * (c.grad_scale ? scale_value : 1.f)).to(c.dtype), off));
    if (has_buffer) b.push_back(kernel_test::at_offset(at::randn({kSizes[i]}).to(state), off));
    if (c.master) master.push_back(kernel_test::at_offset(p32, off));
  }
  fusetrain::ops::SgdHyper h;
  h.lr = 0.05;
  h.momentum = c.momentum;
  h.dampening = c.dampening;
  h.weight_decay = c.weight_decay;
  h.nesterov = c.nesterov;
  h.maximize = c.maximize;
  for (const bool first : {true, false}) {
    CAPTURE(first);
    std::vector<at::Tensor> gp = clones(p), gg = clones(g), gb = clones(b), gm = clones(master);
    std::vector<at::Tensor> cp = clones(p), cg = clones(g), cb = clones(b), cm = clones(master);
    const at::Tensor grad_scale = c.grad_scale ? at::full({1}, scale_value) : at::Tensor();
    const at::Tensor lr_tensor =
        c.lr_tensor == at::kByte ? at::Tensor() : at::full({1}, 0.02, c.lr_tensor);
    const size_t n = p.size();
    const auto pp = pointers(gp, n), pg = pointers(gg, n), pb = pointers(gb, n),
               pm = pointers(gm, n);
    std::vector<int64_t> numel;
    for (const at::Tensor& t : p) numel.push_back(t.numel());
    SgdScalars s{};
    s.lr = static_cast<float>(h.lr);
    s.momentum = static_cast<float>(h.momentum);
    s.weight_decay = static_cast<float>(h.weight_decay);
    s.lr_device = lr_tensor.defined()
                      ? fusetrain::kernels::DeviceScalar{lr_tensor.data_ptr(), false}
                      : fusetrain::kernels::DeviceScalar{nullptr, false};
    s.one_minus_dampening = static_cast<float>(1.0 - h.dampening);
    s.nesterov = h.nesterov;
    s.maximize = h.maximize;
    s.is_first_step = first;
    s.has_buffer = has_buffer;
    s.grad_scale = c.grad_scale ? grad_scale.data_ptr<float>() : nullptr;
    s.found_inf = nullptr;
    REQUIRE_LAUNCH(fusetrain::kernels::launch_fused_sgd(
        float_type(c.dtype), c.master,
        SgdTensors{pp.data(), pg.data(), pb.data(), pm.data(), numel.data(), static_cast<int>(n)},
        s, kMaxBlocks, nullptr));
    auto opt = [](const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; };
    fusetrain::ops::fused_sgd_(cp, cg, cb, cm, h, first, opt(grad_scale), std::nullopt,
                               opt(lr_tensor));
    const double lr = lr_tensor.defined() ? lr_tensor.item<double>() : h.lr;
    for (size_t i = 0; i < n; ++i) {
      CAPTURE(i, kSizes[i]);
      REQUIRE_BITS_EQUAL(gg[i], cg[i]);
      // The step direction's error (the buffer's two products and sum, which
      // cancellation does not shrink; nesterov's extra product and sum), then
      // lr times it and the roundings of the product and the difference.
      const at::Tensor p0 = (c.master ? master[i] : p[i]).to(at::kDouble).abs();
      const at::Tensor grad = cg[i].to(at::kDouble).abs() + h.weight_decay * p0;
      at::Tensor step = grad;
      at::Tensor dstep = kU * grad;
      if (has_buffer) {
        const at::Tensor b1 = cb[i].to(at::kDouble).abs();
        const at::Tensor db = 2 * kU * (h.momentum * b[i].to(at::kDouble).abs() + grad);
        require_close(gb[i], cb[i], db + storage_rounding(state) * b1 + storage_floor(state),
                      "momentum_buffer");
        step = h.nesterov ? grad + h.momentum * b1 : b1;
        dstep = h.nesterov ? kU * grad + h.momentum * db + 2 * kU * step : db;
      }
      const at::Tensor p1 = (c.master ? cm[i] : cp[i]).to(at::kDouble).abs();
      const at::Tensor tol = 2 * kU * (p1 + p0) + lr * (dstep + 2 * kU * step);
      if (c.master) require_close(gm[i], cm[i], tol, "master");
      require_close(gp[i], cp[i], tol + storage_rounding(c.dtype) * p1 + storage_floor(c.dtype),
                    "param");
    }
  }
}

// ---------------------------------------------------------------- L2 norm

TEST_CASE("sum-of-squares kernels: per-chunk partials in order and per-tensor sums",
          "[kernels][optim][norm]") {
  at::manual_seed(9);
  const at::ScalarType dtype = GENERATE(at::kFloat, at::kHalf, at::kBFloat16, at::kDouble);
  const bool misaligned = GENERATE(false, true);
  // Many tensors (1400: two multi-tensor launches) or the size classes.
  const bool many = GENERATE(false, true);
  CAPTURE(dtype, misaligned, many);
  std::vector<int64_t> sizes = kSizes;
  sizes.insert(sizes.begin() + 2, 0);  // an empty tensor among them
  if (many) {
    sizes.clear();
    for (int i = 0; i < 1400; ++i) sizes.push_back(1 + (i * 53) % 400);
  }
  std::vector<at::Tensor> tensors;
  int64_t chunks = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    tensors.push_back(kernel_test::at_offset(at::randn({sizes[i]}).to(dtype),
                                             misaligned ? static_cast<int64_t>(i % 7) + 1 : 0));
    chunks += fusetrain::kernels::chunks_of(sizes[i]);
  }
  const bool dbl = dtype == at::kDouble;
  const at::ScalarType acc = dbl ? at::kDouble : at::kFloat;
  at::Tensor partials = at::full({chunks}, -1.0, acc);
  at::Tensor per_tensor = at::full({static_cast<int64_t>(sizes.size())}, -1.0, acc);
  const auto ptrs = pointers(tensors, tensors.size());
  REQUIRE_LAUNCH(fusetrain::kernels::launch_sum_squares(
      float_type(dtype), ptrs.data(), sizes.data(), static_cast<int>(sizes.size()),
      partials.data_ptr(), per_tensor.data_ptr(), kMaxBlocks, nullptr));

  // Reference sums in float64. The kernel's accumulation (fp32, or fp64 for
  // double) errs by at most (terms a thread sums + the tree's depth) units of
  // its precision, relative to the sum of squares: a chunk is 512 threads of
  // up to 128 terms and a 9-level tree; a tensor's chunks are 256 threads and
  // an 8-level tree.
  const double u = dbl ? 0x1p-53 : kU;
  const auto [total, norms] = fusetrain::ops::multi_tensor_l2norm(tensors, true);
  int64_t chunk = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    CAPTURE(i, sizes[i]);
    const at::Tensor x = tensors[i].to(at::kDouble);
    for (int64_t start = 0; start < sizes[i]; start += kChunk, ++chunk) {
      const double want =
          x.narrow(0, start, std::min(kChunk, sizes[i] - start)).square().sum().item<double>();
      CHECK(std::abs(partials[chunk].item<double>() - want) <= (128 + 9 + 2) * u * want);
    }
    const double want = x.square().sum().item<double>();
    const int64_t tensor_chunks = fusetrain::kernels::chunks_of(sizes[i]);
    const double tol = (128 + 9 + 2 + static_cast<double>(tensor_chunks) / 256 + 8) * u * want;
    CHECK(std::abs(per_tensor[i].item<double>() - want) <= tol);
    // Against the CPU op's float32 norms: one more float32 rounding.
    const double norm = std::sqrt(per_tensor[i].item<double>());
    CHECK(std::abs(norm - norms[i].item<double>()) <= tol / (2 * std::max(norm, 1e-300)) + 2 * kU * norm);
  }
  CHECK(chunk == chunks);
}

TEST_CASE("chunks_of counts 64K-element chunks", "[kernels][optim][norm]") {
  CHECK(fusetrain::kernels::chunks_of(0) == 0);
  CHECK(fusetrain::kernels::chunks_of(1) == 1);
  CHECK(fusetrain::kernels::chunks_of(kChunk) == 1);
  CHECK(fusetrain::kernels::chunks_of(kChunk + 1) == 2);
  CHECK(fusetrain::kernels::chunks_of(int64_t{1} << 40) == (int64_t{1} << 24));
}

TEST_CASE("scatter kernels place every value, over more indices than one launch holds",
          "[kernels][optim][norm]") {
  // 8100 > the 7995 indices of one parameter block: two launches.
  const int n = GENERATE(1, 37, 8100);
  CAPTURE(n);
  std::vector<int64_t> where(n);
  for (int i = 0; i < n; ++i) where[i] = (static_cast<int64_t>(i) * 7919) % (2 * n + 1);
  const at::Tensor srcf = at::randn({n});
  const at::Tensor srcd = at::randn({n}, at::kDouble);
  at::Tensor dstf = at::full({2 * n + 1}, -1.f);
  at::Tensor dstd = at::full({2 * n + 1}, -1.0, at::kDouble);
  REQUIRE_LAUNCH(fusetrain::kernels::launch_scatter(srcf.data_ptr<float>(), where.data(), n,
                                                    dstf.data_ptr<float>(), nullptr));
  REQUIRE_LAUNCH(fusetrain::kernels::launch_scatter(srcd.data_ptr<double>(), where.data(), n,
                                                    dstd.data_ptr<double>(), nullptr));
  at::Tensor wantf = at::full({2 * n + 1}, -1.f);
  at::Tensor wantd = at::full({2 * n + 1}, -1.0, at::kDouble);
  const at::Tensor index = at::tensor(where, at::kLong);
  wantf.index_put_({index}, srcf);
  wantd.index_put_({index}, srcd);
  REQUIRE_BITS_EQUAL(dstf, wantf);
  REQUIRE_BITS_EQUAL(dstd, wantd);
}

// Tests of the mixed-precision core from C++: the ops against torch's own
// (at::_amp_foreach_non_finite_check_and_unscale_, at::_amp_update_scale_),
// the GradScaler against training without a scaler, the Policy and autocast
// guards, and keep_float32. CUDA cases ([cuda]) compare the CUDA kernels with
// torch's CPU results and skip with a message where there is no GPU.
#include <fusetrain/fusetrain.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <torch/cuda.h>
#include <torch/serialize.h>
#include <torch/torch.h>

#include <catch2/catch.hpp>

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_test.h"

namespace {

using Catch::Matchers::Contains;
using fusetrain::amp::GradScaler;
using fusetrain::amp::GradScalerOptions;
using fusetrain::amp::Policy;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ------------------------------------------------------------------ helpers

// Same dtype, shape and bytes (so NaN payloads and signed zeros count too).
bool bit_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor ac = a.cpu().contiguous();
  const at::Tensor bc = b.cpu().contiguous();
  return std::memcmp(ac.const_data_ptr(), bc.const_data_ptr(), ac.nbytes()) == 0;
}

// The raw bits of a tensor's elements, as integers (for failure messages).
at::Tensor bits_of(const at::Tensor& t) {
  const at::Tensor c = t.cpu().contiguous().reshape(-1);
  switch (c.element_size()) {
    case 2:
      return c.view(at::kShort).to(at::kLong);
    case 4:
      return c.view(at::kInt).to(at::kLong);
    default:
      return c.view(at::kLong);
  }
}

// For failure messages: how many elements differ in their bits, and the first.
std::string describe_difference(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined() || a.sizes() != b.sizes() ||
      a.scalar_type() != b.scalar_type()) {
    return "shapes or dtypes differ";
  }
  const at::Tensor x = bits_of(a), y = bits_of(b);
  const at::Tensor differ = x != y;
  const int64_t count = differ.sum().item<int64_t>();
  std::ostringstream out;
  out << count << " of " << x.numel() << " elements differ";
  if (count > 0) {
    const int64_t i = differ.nonzero()[0][0].item<int64_t>();
    const at::Tensor av = a.cpu().contiguous().reshape(-1), bv = b.cpu().contiguous().reshape(-1);
    out << "; first at " << i << ": " << av[i].item<double>() << " (bits " << std::hex
        << x[i].item<int64_t>() << ") vs " << bv[i].item<double>() << " (bits "
        << y[i].item<int64_t>() << ")" << std::dec;
  }
  return out.str();
}

// Bit-equal except that any NaN equals any NaN: torch's own CPU kernel
// writes bf16 NaNs as 0x7fc0 in its scalar tail and 0xffff in its vector
// body, so NaN payloads carry no meaning. Everything else, -0.0 and
// subnormals included, must match bit for bit.
bool same_values(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor nan_a = a.cpu().contiguous().reshape(-1).isnan();
  const at::Tensor nan_b = b.cpu().contiguous().reshape(-1).isnan();
  return at::equal(nan_a, nan_b) && (bits_of(a) == bits_of(b)).logical_or(nan_a).all().item<bool>();
}

// All parameters as one flat tensor.
at::Tensor flat(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> parts;
  for (const auto& t : tensors) parts.push_back(t.reshape(-1));
  return at::cat(parts);
}

bool all_bit_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!bit_equal(a[i], b[i])) return false;
  }
  return true;
}

at::Generator generator(uint64_t seed) { return at::detail::createCPUGenerator(seed); }

// Values over most of the dtype's range: normal numbers of many magnitudes,
// subnormals and zeros, none overflowing the dtype.
at::Tensor make_random_values(int64_t n, at::ScalarType dtype, uint64_t seed) {
  auto gen = generator(seed);
  int64_t lo = -130, hi = 100;                // float32 / bfloat16: subnormals below 2^-126
  if (dtype == at::kHalf) lo = -27, hi = 12;  // |x| <= ~6 * 2^11 < 65504
  if (dtype == at::kDouble) lo = -300, hi = 300;
  const at::Tensor mantissa = at::randn({n}, gen, at::kDouble);
  const at::Tensor exponent = at::randint(lo, hi, {n}, gen, at::kDouble);
  return (mantissa * at::exp2(exponent)).to(dtype);
}

// The same, memoized: the unscale tests build hundreds of lists from a few
// sizes, and generating the data would otherwise dominate their run time.
at::Tensor random_values(int64_t n, at::ScalarType dtype, uint64_t seed) {
  static std::map<std::tuple<int64_t, at::ScalarType, uint64_t>, at::Tensor> cache;
  const auto key = std::make_tuple(n, dtype, seed);
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, make_random_values(n, dtype, seed)).first;
  return it->second.clone();
}

// How a gradient sits in memory.
enum class Layout {
  kContiguous,
  kOffset,      // a slice starting `offset` elements into a buffer: misaligned
  kTransposed,  // 2-D, dense but not contiguous
  kStrided,     // every other element of the last dimension: not dense
};

struct Spec {
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  Layout layout = Layout::kContiguous;
  int64_t offset = 1;
};

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

// The buffer a gradient of this spec lives in.
std::vector<int64_t> base_shape(const Spec& s) {
  switch (s.layout) {
    case Layout::kContiguous:
      return s.shape;
    case Layout::kOffset:
      return {numel_of(s.shape) + 2 * s.offset};
    case Layout::kTransposed:
      return {s.shape.at(1), s.shape.at(0)};
    case Layout::kStrided: {
      std::vector<int64_t> b = s.shape;
      b.back() *= 2;
      return b;
    }
  }
  return s.shape;
}

at::Tensor view_of(const at::Tensor& base, const Spec& s) {
  switch (s.layout) {
    case Layout::kContiguous:
      return base;
    case Layout::kOffset:
      return base.slice(0, s.offset, s.offset + numel_of(s.shape)).view(s.shape);
    case Layout::kTransposed:
      return base.t();
    case Layout::kStrided:
      return base.slice(-1, 0, base.size(-1), 2);
  }
  return base;
}

// The element at row-major position `index` of `t`, as a writable 0-d view.
at::Tensor element(const at::Tensor& t, int64_t index) {
  std::vector<int64_t> idx(t.dim());
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    idx[d] = index % t.size(d);
    index /= t.size(d);
  }
  at::Tensor e = t;
  for (int64_t i : idx) e = e.select(0, i);
  return e;
}

// Gradients built from specs: the views under test, the buffers they live in,
// and which buffer elements lie outside the views (poisoned with inf/NaN, so
// an op that reads them reports an overflow and one that writes them shows).
struct GradList {
  std::vector<at::Tensor> bases;
  std::vector<at::Tensor> views;
  std::vector<at::Tensor> outside;  // bool masks over bases (CPU)
};

// The CPU buffers and guard masks of a list, memoized (see random_values).
const GradList& grad_template(const std::vector<Spec>& specs, uint64_t seed) {
  static std::map<std::string, GradList> cache;
  std::ostringstream key;
  key << seed % 4;
  for (const Spec& s : specs) {
    key << ';' << s.dtype << ',' << static_cast<int>(s.layout) << ',' << s.offset;
    for (int64_t d : s.shape) key << ',' << d;
  }
  auto it = cache.find(key.str());
  if (it != cache.end()) return it->second;
  GradList g;
  for (size_t i = 0; i < specs.size(); ++i) {
    const Spec& s = specs[i];
    const auto shape = base_shape(s);
    at::Tensor base = random_values(numel_of(shape), s.dtype, seed % 4 + 4 * i).view(shape);
    at::Tensor covered = at::zeros(shape, at::kBool);
    view_of(covered, s).fill_(true);
    const at::Tensor outside = covered.logical_not();
    // Alternate inf and NaN over the guard elements.
    const at::Tensor parity = at::ones({numel_of(shape)}, at::kBool);
    parity.slice(0, 1, parity.numel(), 2).fill_(false);
    base.masked_fill_(outside.logical_and(parity.view(shape)), kInf);
    base.masked_fill_(outside.logical_and(parity.view(shape).logical_not()), kNaN);
    g.bases.push_back(base);
    g.outside.push_back(outside);
  }
  return cache.emplace(key.str(), std::move(g)).first->second;
}

// A fresh copy of the list's gradients on `device`.
GradList make_grads(const std::vector<Spec>& specs, uint64_t seed,
                    const at::Device& device = at::kCPU) {
  const GradList& t = grad_template(specs, seed);
  GradList g;
  for (size_t i = 0; i < specs.size(); ++i) {
    at::Tensor base = t.bases[i].to(device, /*non_blocking=*/false, /*copy=*/true);
    g.views.push_back(view_of(base, specs[i]));
    g.bases.push_back(base);
    g.outside.push_back(t.outside[i]);
  }
  return g;
}

struct Injection {
  size_t tensor;
  int64_t index;  // row-major position in the view; negative counts from the end
  float value;
};

void inject(GradList& g, const std::vector<Injection>& injections) {
  for (const auto& inj : injections) {
    const at::Tensor& v = g.views.at(inj.tensor);
    const int64_t index = inj.index < 0 ? v.numel() + inj.index : inj.index;
    element(v, index).fill_(inj.value);
  }
}

at::Tensor scalar_float(float v, const at::Device& device = at::kCPU) {
  return at::full({1}, v, at::TensorOptions().dtype(at::kFloat).device(device));
}

// Runs fusetrain's op on `device` and torch's CPU op on identical data and
// requires bit-equal results: data, guards (untouched) and found_inf.
void check_unscale(const std::vector<Spec>& specs, float inv_scale,
                   const std::vector<Injection>& injections, uint64_t seed,
                   const at::Device& device = at::kCPU, float found_init = 0.f) {
  GradList ours = make_grads(specs, seed, device);
  GradList ref = make_grads(specs, seed);
  inject(ours, injections);
  inject(ref, injections);
  std::vector<at::Tensor> pristine;
  for (const auto& b : ref.bases) pristine.push_back(b.clone());

  at::Tensor found = scalar_float(found_init, device);
  at::Tensor found_ref = scalar_float(found_init);
  fusetrain::ops::non_finite_check_and_unscale_(ours.views, found, scalar_float(inv_scale, device));
  at::_amp_foreach_non_finite_check_and_unscale_(ref.views, found_ref, scalar_float(inv_scale));

  const float expected_found = (found_init != 0.f || !injections.empty()) ? 1.f : 0.f;
  CAPTURE(inv_scale, injections.size(), found_init, device.str());
  REQUIRE(found.item<float>() == expected_found);
  REQUIRE(bit_equal(found, found_ref));
  for (size_t i = 0; i < specs.size(); ++i) {
    CAPTURE(i, specs[i].dtype, specs[i].shape, static_cast<int>(specs[i].layout));
    const at::Tensor got = ours.bases[i].cpu();
    const bool same = same_values(got, ref.bases[i]);
    INFO((same ? std::string() : "vs torch: " + describe_difference(got, ref.bases[i])));
    REQUIRE(same);
    REQUIRE(
        bit_equal(got.masked_select(ours.outside[i]), pristine[i].masked_select(ours.outside[i])));
    if (inv_scale == 1.f) REQUIRE(bit_equal(got, pristine[i]));
  }
}

const std::vector<at::ScalarType> kFloatTypes = {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble};
const std::vector<int64_t> kOddSizes = {278011, 1, 7, 65537};

// The lists every unscale test runs through, for one dtype.
std::vector<std::vector<Spec>> unscale_lists(at::ScalarType dt) {
  std::vector<std::vector<Spec>> lists;
  for (int64_t n : kOddSizes) {
    lists.push_back({{dt, {n}}});
    lists.push_back({{dt, {n}, Layout::kOffset, 1}});
  }
  lists.push_back({{dt, {331, 17}, Layout::kTransposed}});
  lists.push_back({{dt, {9, 1031}, Layout::kStrided}});
  // Several layouts and sizes in one call.
  lists.push_back({{dt, {65537}},
                   {dt, {7}, Layout::kOffset, 3},
                   {dt, {1}},
                   {dt, {0}},
                   {dt, {129, 65}, Layout::kTransposed},
                   {dt, {278011}, Layout::kOffset, 1},
                   {dt, {5, 33}, Layout::kStrided}});
  return lists;
}

// Injections for a list: none, inf at the last element of the last tensor,
// NaN at index 0 of the first, and -inf / NaN in the middle of a big one.
std::vector<std::vector<Injection>> injection_sets(const std::vector<Spec>& list) {
  std::vector<std::vector<Injection>> sets = {{}};
  size_t last = list.size() - 1;
  while (numel_of(list[last].shape) == 0) --last;
  sets.push_back({{last, -1, kInf}});
  sets.push_back({{0, 0, kNaN}});
  size_t big = 0;
  for (size_t i = 0; i < list.size(); ++i) {
    if (numel_of(list[i].shape) > numel_of(list[big].shape)) big = i;
  }
  const int64_t mid = numel_of(list[big].shape) / 2;
  sets.push_back({{big, mid, -kInf}, {big, -1, kNaN}});
  return sets;
}

// Sets the intra-op thread count for a scope.
struct ThreadCount {
  int previous = at::get_num_threads();
  explicit ThreadCount(int n) { at::set_num_threads(n); }
  ~ThreadCount() { at::set_num_threads(previous); }
};

// The broad sweep runs single-threaded: its hundreds of small reference ops
// would otherwise spend most of their time in OpenMP barriers on a busy
// machine. Threads get their own test ("... with one thread and with many").
void check_all_unscale_cases(const at::Device& device) {
  const ThreadCount one(1);
  for (const auto dt : kFloatTypes) {
    uint64_t seed = 1;
    for (const auto& list : unscale_lists(dt)) {
      for (const auto& injections : injection_sets(list)) {
        for (float inv : {1.f / 65536.f, 1.f / 3.f, 1.f, 3.f}) {
          check_unscale(list, inv, injections, ++seed, device);
        }
      }
    }
  }
}

// Many tensors of mixed dtypes and layouts, some empty, in one call.
std::vector<Spec> many_tensors(uint64_t seed) {
  std::mt19937 rng(seed);
  std::vector<Spec> specs;
  for (int i = 0; i < 300; ++i) {
    const auto dt = kFloatTypes[i % kFloatTypes.size()];
    const int64_t n = std::uniform_int_distribution<int64_t>(0, 5000)(rng);
    if (n > 40 && i % 5 == 0) {
      specs.push_back({dt, {n / 8, 8}, Layout::kTransposed});
    } else if (i % 3 == 0) {
      specs.push_back({dt, {n}, Layout::kOffset, 1 + i % 7});
    } else {
      specs.push_back({dt, {n}});
    }
  }
  return specs;
}

// ------------------------------------------------------- the scale update

struct ScaleState {
  at::Tensor scale, growth, overflow;
  explicit ScaleState(float init, const at::Device& device = at::kCPU)
      : scale(at::full({}, init, at::TensorOptions().dtype(at::kFloat).device(device))),
        growth(at::zeros({}, at::TensorOptions().dtype(at::kInt).device(device))),
        overflow(at::zeros({}, at::TensorOptions().dtype(at::kInt).device(device))) {}
  void update(float found_inf, const fusetrain::ops::ScaleUpdateOptions& o) {
    const at::Tensor found = at::full({}, found_inf, scale.options());
    fusetrain::ops::update_scale_(scale, growth, overflow, found, o);
  }
};

fusetrain::ops::ScaleUpdateOptions scale_options(double growth_factor, double backoff_factor,
                                                 int64_t interval, double max_scale = INFINITY,
                                                 int64_t hysteresis = 0) {
  fusetrain::ops::ScaleUpdateOptions o;
  o.growth_factor = growth_factor;
  o.backoff_factor = backoff_factor;
  o.growth_interval = interval;
  o.max_scale = max_scale;
  o.hysteresis = hysteresis;
  return o;
}

// A random overflow sequence: 0 for a clean step, else one of the non-zero
// values a summed found_inf can hold.
std::vector<float> found_sequence(size_t n, double p, uint64_t seed) {
  std::mt19937 rng(seed);
  std::bernoulli_distribution overflow(p);
  std::vector<float> seq;
  const float values[] = {1.f, 2.f, 3.f, kNaN};
  for (size_t i = 0; i < n; ++i) seq.push_back(overflow(rng) ? values[rng() % 4] : 0.f);
  return seq;
}

// ------------------------------------------------------------ training

struct NetImpl : torch::nn::Module {
  NetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(8, 16))),
        fc2(register_module("fc2", torch::nn::Linear(16, 4))) {}
  at::Tensor forward(const at::Tensor& x) { return fc2->forward(torch::tanh(fc1->forward(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Net);

Net make_net(uint64_t seed, const at::Device& device = at::kCPU) {
  torch::manual_seed(seed);
  Net net;
  net->to(device);
  return net;
}

std::vector<at::Tensor> params_of(const torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

// The optimizer's per-parameter state (SGD momentum, Adam moments and step).
std::vector<at::Tensor> optimizer_state(torch::optim::Optimizer& opt) {
  std::vector<at::Tensor> out;
  for (auto& group : opt.param_groups()) {
    for (auto& p : group.params()) {
      const auto it = opt.state().find(p.unsafeGetTensorImpl());
      if (it == opt.state().end()) {
        out.emplace_back();
        continue;
      }
      if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(it->second.get())) {
        out.push_back(adam->exp_avg().clone());
        out.push_back(adam->exp_avg_sq().clone());
        out.push_back(at::scalar_tensor(adam->step(), at::kLong));
      } else if (auto* sgd = dynamic_cast<torch::optim::SGDParamState*>(it->second.get())) {
        out.push_back(sgd->momentum_buffer().defined() ? sgd->momentum_buffer().clone()
                                                       : at::Tensor());
      } else {
        FAIL("unexpected optimizer state type");
      }
    }
  }
  return out;
}

std::pair<at::Tensor, at::Tensor> batch(int step, const at::Device& device = at::kCPU) {
  auto gen = generator(1000 + step);
  return {at::randn({32, 8}, gen).to(device), at::randn({32, 4}, gen).to(device)};
}

at::Tensor loss_of(Net& net, int step, const at::Device& device = at::kCPU) {
  const auto [x, y] = batch(step, device);
  return torch::mse_loss(net->forward(x), y);
}

using OptimizerFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;

// Trains two identical nets, one with the scaler (power-of-two scales, fp32
// gradients) and one without, and requires bit-identical parameters and
// optimizer state after every step. At `overflow_steps` the scaled net gets
// an inf/NaN gradient: that step (and only it) must be skipped, the scale
// halved; the reference net skips the same step.
void train_side_by_side(const OptimizerFactory& make_optimizer, const std::set<int>& overflow_steps,
                        const at::Device& device, int steps = 24) {
  Net ref = make_net(7, device);
  Net net = make_net(7, device);
  REQUIRE(all_bit_equal(params_of(*ref), params_of(*net)));
  auto ref_opt = make_optimizer(ref->parameters());
  auto opt = make_optimizer(net->parameters());
  const int64_t interval = 3;
  GradScaler scaler(device.type(),
                    GradScalerOptions().init_scale(1024.0).growth_interval(interval));

  double expected_scale = 1024.0;
  int64_t clean_run = 0;
  for (int step = 0; step < steps; ++step) {
    CAPTURE(step);
    const bool overflow = overflow_steps.count(step) > 0;

    ref_opt->zero_grad();
    loss_of(ref, step, device).backward();
    if (!overflow) ref_opt->step();

    opt->zero_grad();
    scaler.scale(loss_of(net, step, device)).backward();
    if (overflow) {
      const at::NoGradGuard no_grad;
      element(net->fc2->weight.grad(), step % 5).fill_(step % 2 ? kInf : kNaN);
    }
    const auto params_before = params_of(*net);
    const auto state_before = optimizer_state(*opt);
    scaler.step(*opt);
    REQUIRE(scaler.step_was_skipped() == overflow);
    REQUIRE(scaler.found_inf().defined());
    REQUIRE((scaler.found_inf().item<float>() != 0.f) == overflow);
    const auto report = GradScaler::overflow_report(net->named_parameters());
    if (overflow) {
      REQUIRE(report == std::vector<std::string>{"fc2.weight"});
      REQUIRE(all_bit_equal(params_of(*net), params_before));
      REQUIRE(all_bit_equal(optimizer_state(*opt), state_before));
    } else {
      REQUIRE(report.empty());
    }
    scaler.update();

    if (overflow) {
      expected_scale *= 0.5;
      clean_run = 0;
    } else if (++clean_run == interval) {
      expected_scale *= 2.0;
      clean_run = 0;
    }
    REQUIRE(scaler.get_scale() == expected_scale);
    INFO("params vs unscaled training: " << describe_difference(flat(params_of(*net)),
                                                                flat(params_of(*ref))));
    REQUIRE(all_bit_equal(params_of(*net), params_of(*ref)));
    REQUIRE(all_bit_equal(optimizer_state(*opt), optimizer_state(*ref_opt)));
  }
}

std::unique_ptr<torch::optim::Optimizer> make_sgd(std::vector<at::Tensor> params) {
  return std::make_unique<torch::optim::SGD>(
      params, torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-3));
}

std::unique_ptr<torch::optim::Optimizer> make_adam(std::vector<at::Tensor> params) {
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
}

// A stand-in for a fused optimizer: it takes the scale and the overflow flag
// as tensors and does the unscale and skip itself.
class ScalingSGD : public torch::optim::SGD, public fusetrain::amp::AmpScalingOptimizer {
 public:
  using torch::optim::SGD::SGD;

  void set_amp_scaling(std::optional<at::Tensor> grad_scale,
                       std::optional<at::Tensor> found_inf) override {
    grad_scale_ = std::move(grad_scale);
    found_inf_ = std::move(found_inf);
  }

  at::Tensor step(LossClosure closure = nullptr) override {
    seen_grad_scale = grad_scale_;
    seen_found_inf = found_inf_;
    ++steps;
    // The test reads the flag on the host; a real fused optimizer would not.
    if (found_inf_ && found_inf_->item<float>() != 0.f) return {};
    if (grad_scale_) {
      const at::NoGradGuard no_grad;
      for (auto& group : param_groups()) {
        for (auto& p : group.params()) {
          if (p.grad().defined()) p.grad().div_(*grad_scale_);
        }
      }
    }
    return torch::optim::SGD::step(closure);
  }

  bool cleared() const { return !grad_scale_ && !found_inf_; }

  std::optional<at::Tensor> seen_grad_scale, seen_found_inf;
  int steps = 0;

 private:
  std::optional<at::Tensor> grad_scale_, found_inf_;
};

std::set<std::string> keys_of(const c10::impl::GenericDict& d) {
  std::set<std::string> keys;
  for (const auto& entry : d) keys.insert(entry.key().toStringRef());
  return keys;
}

void require_same_state(const c10::impl::GenericDict& a, const c10::impl::GenericDict& b) {
  REQUIRE(keys_of(a) == keys_of(b));
  for (const auto& entry : a) {
    const auto& key = entry.key().toStringRef();
    CAPTURE(key);
    const c10::IValue& va = entry.value();
    const c10::IValue vb = b.at(key);
    REQUIRE(va.tagKind() == vb.tagKind());
    if (va.isDouble()) REQUIRE(va.toDouble() == vb.toDouble());
    if (va.isInt()) REQUIRE(va.toInt() == vb.toInt());
  }
}

// A fresh directory, removed when the test ends. POSIX calls, not
// std::filesystem: libtorch.so exports its own copy of some std::filesystem
// symbols (remove_all among them), and calls that bind to it crash.
struct TempDir {
  std::string path;
  TempDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = std::string(tmp && *tmp ? tmp : "/tmp") + "/fusetrain-test-XXXXXX";
    REQUIRE(mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    for (const auto& name : entries()) std::remove((path + "/" + name).c_str());
    rmdir(path.c_str());
  }
  std::string operator/(const std::string& name) const { return path + "/" + name; }
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    if (DIR* d = opendir(path.c_str())) {
      while (const dirent* e = readdir(d)) {
        const std::string name = e->d_name;
        if (name != "." && name != "..") names.push_back(name);
      }
      closedir(d);
    }
    std::sort(names.begin(), names.end());
    return names;
  }
};

// Restores autocast and the global policy whatever a test leaves behind.
struct AutocastStateRestorer {
  bool cpu = at::autocast::is_autocast_enabled(at::kCPU);
  at::ScalarType cpu_dtype = at::autocast::get_autocast_dtype(at::kCPU);
  Policy policy = fusetrain::amp::global_policy();
  ~AutocastStateRestorer() {
    at::autocast::set_autocast_enabled(at::kCPU, cpu);
    at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype);
    fusetrain::amp::set_global_policy(policy);
  }
};

at::Tensor matmul_probe(const at::Device& device = at::kCPU) {
  const auto o = at::TensorOptions().dtype(at::kFloat).device(device);
  return torch::matmul(at::ones({4, 4}, o), at::ones({4, 4}, o));
}

}  // namespace

// ======================================================= non_finite_check_and_unscale_

TEST_CASE("non_finite_check_and_unscale_ is bit-equal to torch's CPU op", "[ops][unscale]") {
  check_all_unscale_cases(at::kCPU);
}

TEST_CASE("non_finite_check_and_unscale_ on many mixed tensors matches torch", "[ops][unscale]") {
  const auto specs = many_tensors(3);
  for (float inv : {1.f / 1024.f, 0.3f}) {
    check_unscale(specs, inv, {}, 11);
    check_unscale(specs, inv, {{299, -1, kInf}}, 12);
    check_unscale(specs, inv, {{1, 0, kNaN}, {150, 3, -kInf}}, 13);
  }
}

TEST_CASE("non_finite_check_and_unscale_ never clears found_inf", "[ops][unscale]") {
  // The caller zeroes found_inf; the op only ever sets it (several calls, one flag).
  const std::vector<Spec> list = {{at::kFloat, {1000}}, {at::kHalf, {77}, Layout::kOffset, 1}};
  check_unscale(list, 0.5f, {}, 5, at::kCPU, /*found_init=*/1.f);
  check_unscale(list, 1.f, {}, 6, at::kCPU, /*found_init=*/1.f);
}

TEST_CASE("non_finite_check_and_unscale_ runs with one thread and with many", "[ops][unscale]") {
  for (int n : {1, 2, 4}) {
    const ThreadCount threads(n);
    for (const auto dt : kFloatTypes) {
      CAPTURE(n, dt);
      const std::vector<Spec> list = {
          {dt, {278011}}, {dt, {65537}, Layout::kOffset, 1}, {dt, {129, 517}, Layout::kTransposed}};
      check_unscale(list, 1.f / 3.f, {}, 21);
      check_unscale(list, 1.f / 3.f, {{0, -1, kInf}}, 22);  // in the last chunk
      check_unscale(list, 1.f, {{2, 40000, kNaN}}, 23);
    }
  }
}

TEST_CASE("non_finite_check_and_unscale_ rejects bad arguments", "[ops][unscale][errors]") {
  at::Tensor found = scalar_float(0.f);
  const at::Tensor inv = scalar_float(0.5f);
  const at::Tensor good = at::ones({5});

  SECTION("found_inf of the wrong dtype") {
    at::Tensor found_double = at::zeros({1}, at::kDouble);
    REQUIRE_THROWS_WITH(fusetrain::ops::non_finite_check_and_unscale_({good}, found_double, inv),
                        Contains("found_inf") && Contains("Float"));
  }
  SECTION("inv_scale of the wrong dtype or size") {
    REQUIRE_THROWS_WITH(
        fusetrain::ops::non_finite_check_and_unscale_({good}, found, at::ones({1}, at::kHalf)),
        Contains("inv_scale"));
    REQUIRE_THROWS_WITH(fusetrain::ops::non_finite_check_and_unscale_({good}, found, at::ones({2})),
                        Contains("inv_scale"));
  }
  SECTION("an integer tensor in the list is named by its index, nothing is modified") {
    at::Tensor first = at::ones({5});
    const at::Tensor ints = at::ones({3}, at::kInt);
    REQUIRE_THROWS_WITH(fusetrain::ops::non_finite_check_and_unscale_({first, ints}, found, inv),
                        Contains("self[1]") && Contains("Int"));
    REQUIRE(bit_equal(first, at::ones({5})));
    REQUIRE(found.item<float>() == 0.f);
  }
  SECTION("tensors on mixed devices") {
    const at::Tensor meta = at::ones({5}, at::TensorOptions().device(at::kMeta));
    REQUIRE_THROWS_WITH(fusetrain::ops::non_finite_check_and_unscale_({good, meta}, found, inv),
                        Contains("self[1]") && Contains("meta"));
    REQUIRE_THROWS_WITH(
        fusetrain::ops::non_finite_check_and_unscale_({good}, found, inv.to(at::kMeta)),
        Contains("inv_scale") && Contains("meta"));
  }
  SECTION("a sparse tensor") {
    const at::Tensor sparse = at::ones({4}).to_sparse();
    REQUIRE_THROWS(fusetrain::ops::non_finite_check_and_unscale_({good, sparse}, found, inv));
  }
}

// ================================================================ update_scale_

TEST_CASE("update_scale_ follows torch's _amp_update_scale_ exactly", "[ops][update]") {
  const auto defaults = scale_options(2.0, 0.5, 2000);
  REQUIRE(std::isinf(defaults.max_scale));
  REQUIRE(defaults.hysteresis == 0);
  uint64_t seed = 0;
  for (int64_t interval : {1, 2, 3, 7, 50}) {
    for (double growth : {2.0, 1.5, 3.0}) {
      for (double backoff : {0.5, 0.25, 0.9}) {
        for (double p : {0.0, 0.05, 0.5}) {
          // 2^126: growth must stop short of inf, as torch's does.
          for (float init : {65536.f, 3.f, std::ldexp(1.f, 126)}) {
            CAPTURE(interval, growth, backoff, p, init);
            ScaleState ours(init);
            at::Tensor scale = at::full({}, init, at::kFloat);
            at::Tensor tracker = at::zeros({}, at::kInt);
            const auto o = scale_options(growth, backoff, interval);
            int mismatch = -1;
            const auto seq = found_sequence(300, p, ++seed);
            for (size_t i = 0; i < seq.size() && mismatch < 0; ++i) {
              ours.update(seq[i], o);
              at::_amp_update_scale_(scale, tracker, at::full({}, seq[i], at::kFloat), growth,
                                     backoff, interval);
              if (!bit_equal(ours.scale, scale) || !bit_equal(ours.growth, tracker) ||
                  ours.overflow.item<int>() != 0) {
                mismatch = static_cast<int>(i);
              }
            }
            INFO("first mismatch at step " << mismatch << ": scale " << ours.scale.item<float>()
                                           << " vs " << scale.item<float>() << ", tracker "
                                           << ours.growth.item<int>() << " vs "
                                           << tracker.item<int>());
            REQUIRE(mismatch == -1);
            REQUIRE(std::isfinite(ours.scale.item<float>()));
          }
        }
      }
    }
  }
}

TEST_CASE("update_scale_ caps growth at max_scale", "[ops][update]") {
  SECTION("power-of-two cap") {
    ScaleState s(1024.f);
    const auto o = scale_options(2.0, 0.5, 1, /*max_scale=*/8192.0);
    std::vector<float> seen;
    for (int i = 0; i < 5; ++i) {
      s.update(0.f, o);
      seen.push_back(s.scale.item<float>());
    }
    REQUIRE(seen == std::vector<float>{2048.f, 4096.f, 8192.f, 8192.f, 8192.f});
    s.update(1.f, o);
    REQUIRE(s.scale.item<float>() == 4096.f);
  }
  SECTION("a cap that is not a power of two is reached exactly") {
    ScaleState s(1024.f);
    const auto o = scale_options(2.0, 0.5, 2, /*max_scale=*/5000.0);
    for (int i = 0; i < 10; ++i) s.update(0.f, o);
    REQUIRE(s.scale.item<float>() == 5000.f);
    REQUIRE(s.growth.item<int>() == 0);
  }
}

TEST_CASE("update_scale_ hysteresis tolerates overflows before backing off", "[ops][update]") {
  // Documented in csrc/ops/amp.h: each overflow counts; the (hysteresis+1)-th
  // since the last back-off or growth backs off. Any overflow resets growth.
  const auto o = scale_options(2.0, 0.5, 3, INFINITY, /*hysteresis=*/2);
  ScaleState s(1024.f);
  struct Expect {
    float found, scale;
    int growth, overflow;
  };
  const std::vector<Expect> table = {
      {1, 1024, 0, 1}, {1, 1024, 0, 2}, {1, 512, 0, 0},   // third overflow backs off
      {0, 512, 1, 0},  {0, 512, 2, 0},  {1, 512, 0, 1},   // tolerated, growth reset
      {0, 512, 1, 1},  {0, 512, 2, 1},  {0, 1024, 0, 0},  // growth resets both
      {1, 1024, 0, 1}, {1, 1024, 0, 2}, {0, 1024, 1, 2}, {1, 512, 0, 0}, {1, 512, 0, 1},
  };
  for (size_t i = 0; i < table.size(); ++i) {
    CAPTURE(i);
    s.update(table[i].found, o);
    REQUIRE(s.scale.item<float>() == table[i].scale);
    REQUIRE(s.growth.item<int>() == table[i].growth);
    REQUIRE(s.overflow.item<int>() == table[i].overflow);
  }

  SECTION("hysteresis 0 backs off on every overflow, as torch") {
    ScaleState t(1024.f);
    const auto o0 = scale_options(2.0, 0.5, 3);
    for (float expected : {512.f, 256.f, 128.f}) {
      t.update(1.f, o0);
      REQUIRE(t.scale.item<float>() == expected);
      REQUIRE(t.overflow.item<int>() == 0);
    }
  }
}

TEST_CASE("update_scale_ rejects bad arguments", "[ops][update][errors]") {
  ScaleState s(1024.f);
  const at::Tensor found = at::zeros({}, at::kFloat);
  const auto o = scale_options(2.0, 0.5, 10);
  at::Tensor float_tracker = at::zeros({}, at::kFloat);
  REQUIRE_THROWS_WITH(fusetrain::ops::update_scale_(s.scale, float_tracker, s.overflow, found, o),
                      Contains("growth_tracker"));
  REQUIRE_THROWS_WITH(
      fusetrain::ops::update_scale_(s.scale, s.growth, s.overflow, at::zeros({}, at::kInt), o),
      Contains("found_inf"));
  REQUIRE_THROWS_WITH(fusetrain::ops::update_scale_(s.scale, s.growth, s.overflow, found,
                                                    scale_options(1.0, 0.5, 10)),
                      Contains("growth_factor"));
  REQUIRE_THROWS_WITH(fusetrain::ops::update_scale_(s.scale, s.growth, s.overflow, found,
                                                    scale_options(2.0, 1.0, 10)),
                      Contains("backoff_factor"));
  REQUIRE_THROWS_WITH(fusetrain::ops::update_scale_(s.scale, s.growth, s.overflow, found,
                                                    scale_options(2.0, 0.5, 0)),
                      Contains("growth_interval"));
  REQUIRE_THROWS_WITH(fusetrain::ops::update_scale_(s.scale, s.growth, s.overflow, found,
                                                    scale_options(2.0, 0.5, 10, INFINITY, -1)),
                      Contains("hysteresis"));
  REQUIRE_THROWS_WITH(
      fusetrain::ops::update_scale_(s.scale, s.growth, s.overflow, found.to(at::kMeta), o),
      Contains("found_inf") && Contains("meta"));
  REQUIRE(s.scale.item<float>() == 1024.f);
}

// ================================================================== GradScaler

TEST_CASE("GradScaler training with SGD is bit-identical to training without it", "[scaler]") {
  train_side_by_side(make_sgd, {}, at::kCPU);
}

TEST_CASE("GradScaler training with Adam is bit-identical to training without it", "[scaler]") {
  train_side_by_side(make_adam, {}, at::kCPU);
}

TEST_CASE("GradScaler skips exactly the steps with inf/NaN gradients", "[scaler]") {
  SECTION("SGD") { train_side_by_side(make_sgd, {4, 5, 11}, at::kCPU); }
  SECTION("Adam") { train_side_by_side(make_adam, {0, 6, 7, 15}, at::kCPU); }
}

TEST_CASE("GradScaler: unscale_ then clip then step equals unscaled training", "[scaler]") {
  Net ref = make_net(3);
  Net net = make_net(3);
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  GradScaler scaler(at::kCPU, GradScalerOptions().init_scale(65536.0));
  const auto key = reinterpret_cast<GradScaler::OptimizerKey>(&opt);
  for (int step = 0; step < 5; ++step) {
    ref_opt.zero_grad();
    loss_of(ref, step).backward();
    std::vector<at::Tensor> ref_grads;
    for (const auto& p : ref->parameters()) ref_grads.push_back(p.grad().clone());
    torch::nn::utils::clip_grad_norm_(ref->parameters(), 0.05);
    ref_opt.step();

    opt.zero_grad();
    scaler.scale(loss_of(net, step)).backward();
    REQUIRE(scaler.stage(key) == fusetrain::amp::OptState::kReady);
    scaler.unscale_(opt);
    REQUIRE(scaler.stage(key) == fusetrain::amp::OptState::kUnscaled);
    // Before the step the gradients are exactly the unscaled ones.
    REQUIRE(all_bit_equal(fusetrain::amp::optimizer_grads(opt), ref_grads));
    torch::nn::utils::clip_grad_norm_(net->parameters(), 0.05);
    scaler.step(opt);  // must not unscale a second time
    REQUIRE(scaler.stage(key) == fusetrain::amp::OptState::kStepped);
    scaler.update();
    REQUIRE(scaler.stage(key) == fusetrain::amp::OptState::kReady);
    REQUIRE(all_bit_equal(params_of(*net), params_of(*ref)));
  }
}

TEST_CASE("GradScaler hands the scale to optimizers that unscale themselves", "[scaler]") {
  Net ref = make_net(5);
  Net net = make_net(5);
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.5));
  ScalingSGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.5));
  GradScaler scaler(at::kCPU, GradScalerOptions().init_scale(4096.0).growth_interval(2));
  for (int step = 0; step < 8; ++step) {
    CAPTURE(step);
    const bool overflow = step == 3;
    const bool unscale_first = step == 5;
    ref_opt.zero_grad();
    loss_of(ref, step).backward();
    if (!overflow) ref_opt.step();

    opt.zero_grad();
    scaler.scale(loss_of(net, step)).backward();
    if (overflow) element(net->fc1->bias.grad(), 2).fill_(kInf);
    if (unscale_first) scaler.unscale_(opt);
    const auto grads_before = fusetrain::amp::optimizer_grads(opt);
    std::vector<at::Tensor> grads_copy;
    for (const auto& g : grads_before) grads_copy.push_back(g.clone());
    const double scale = scaler.get_scale();
    scaler.step(opt);
    REQUIRE(opt.steps == step + 1);
    REQUIRE(opt.cleared());
    REQUIRE(opt.seen_found_inf.has_value());
    REQUIRE((opt.seen_found_inf->item<float>() != 0.f) == overflow);
    if (unscale_first) {
      REQUIRE_FALSE(opt.seen_grad_scale.has_value());
    } else {
      REQUIRE(opt.seen_grad_scale.has_value());
      REQUIRE(opt.seen_grad_scale->item<double>() == scale);
    }
    if (overflow) {
      // The scaler itself left the gradients alone: the optimizer skipped.
      REQUIRE(all_bit_equal(fusetrain::amp::optimizer_grads(opt), grads_copy));
      REQUIRE(GradScaler::overflow_report(net->named_parameters()) ==
              std::vector<std::string>{"fc1.bias"});
    }
    REQUIRE(scaler.step_was_skipped() == overflow);
    scaler.update();
    REQUIRE(all_bit_equal(params_of(*net), params_of(*ref)));
  }
}

TEST_CASE("GradScaler with two optimizers skips only the one that overflowed", "[scaler]") {
  Net a = make_net(1), b = make_net(2), b_ref = make_net(2);
  torch::optim::SGD opt_a(a->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD opt_b(b->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD opt_b_ref(b_ref->parameters(), torch::optim::SGDOptions(0.1));
  GradScaler scaler(at::kCPU, GradScalerOptions().init_scale(256.0));

  opt_b_ref.zero_grad();
  loss_of(b_ref, 0).backward();
  opt_b_ref.step();

  const auto a_before = params_of(*a);
  opt_a.zero_grad();
  opt_b.zero_grad();
  scaler.scale(loss_of(a, 0) + loss_of(b, 0)).backward();
  element(a->fc1->weight.grad(), 0).fill_(kNaN);
  scaler.step(opt_a);
  REQUIRE(scaler.step_was_skipped());
  scaler.step(opt_b);
  REQUIRE_FALSE(scaler.step_was_skipped());
  scaler.update();
  REQUIRE(all_bit_equal(params_of(*a), a_before));
  REQUIRE(all_bit_equal(params_of(*b), params_of(*b_ref)));
  REQUIRE(scaler.get_scale() == 128.0);  // backed off once, not once per optimizer
  REQUIRE(scaler.step_was_skipped());    // update()'s combined flag
}

TEST_CASE("GradScaler's max_scale and hysteresis options drive the scale update", "[scaler]") {
  Net net = make_net(2);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01));
  GradScaler scaler(
      at::kCPU,
      GradScalerOptions().init_scale(1024.0).growth_interval(1).max_scale(4096.0).hysteresis(1));
  const auto iterate = [&](bool overflow) {
    opt.zero_grad();
    scaler.scale(loss_of(net, 0)).backward();
    if (overflow) element(net->fc1->weight.grad(), 0).fill_(kInf);
    scaler.step(opt);
    REQUIRE(scaler.step_was_skipped() == overflow);
    scaler.update();
    return scaler.get_scale();
  };
  REQUIRE(iterate(false) == 2048.0);
  REQUIRE(iterate(false) == 4096.0);
  REQUIRE(iterate(false) == 4096.0);  // capped
  REQUIRE(iterate(true) == 4096.0);   // first overflow tolerated (its step still skipped)
  REQUIRE(scaler.state_dict().at("_overflow_tracker").toInt() == 1);
  REQUIRE(iterate(true) == 2048.0);  // the second backs off
  REQUIRE(scaler.state_dict().at("_overflow_tracker").toInt() == 0);
  REQUIRE(iterate(false) == 4096.0);
}

TEST_CASE("GradScaler raises torch's errors for misuse", "[scaler][errors]") {
  Net net = make_net(1);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  GradScaler scaler(at::kCPU);

  SECTION("unscale_ or step before scale()") {
    loss_of(net, 0).backward();
    REQUIRE_THROWS_WITH(scaler.unscale_(opt), Contains("not initialized"));
    REQUIRE_THROWS_WITH(scaler.step(opt), Contains("not initialized"));
  }
  scaler.scale(loss_of(net, 0)).backward();
  SECTION("unscale_ twice") {
    scaler.unscale_(opt);
    REQUIRE_THROWS_WITH(
        scaler.unscale_(opt),
        Contains("unscale_() has already been called on this optimizer since the last update()"));
  }
  SECTION("step twice") {
    scaler.step(opt);
    REQUIRE_THROWS_WITH(scaler.step(opt),
                        Contains("step() has already been called since the last update()"));
  }
  SECTION("unscale_ after step") {
    scaler.step(opt);
    REQUIRE_THROWS_WITH(scaler.unscale_(opt), Contains("unscale_() is being called after step()"));
  }
  SECTION("update with nothing recorded") {
    REQUIRE_THROWS_WITH(scaler.update(), Contains("No inf checks were recorded prior to update"));
  }
  SECTION("a fresh iteration after update() is allowed") {
    scaler.step(opt);
    scaler.update();
    opt.zero_grad();
    scaler.scale(loss_of(net, 1)).backward();
    REQUIRE_NOTHROW(scaler.unscale_(opt));
    REQUIRE_NOTHROW(scaler.step(opt));
    REQUIRE_NOTHROW(scaler.update());
  }
  SECTION("load_state_dict with an empty dict") {
    const c10::impl::GenericDict empty(c10::StringType::get(), c10::AnyType::get());
    REQUIRE_THROWS_WITH(scaler.load_state_dict(empty), Contains("The source state dict is empty"));
  }
  SECTION("outputs on another device") {
    REQUIRE_THROWS_WITH(scaler.scale(at::ones({2}, at::TensorOptions().device(at::kMeta))),
                        Contains("meta"));
  }
  SECTION("bad gradients are named by index and leave everything untouched") {
    const auto key = reinterpret_cast<GradScaler::OptimizerKey>(&opt);
    const at::Tensor good = at::full({3}, 8.f);
    REQUIRE_THROWS_WITH(scaler.unscale_grads_(key, {good, at::ones({2}, at::kInt)}),
                        Contains("parameter 1"));
    REQUIRE_THROWS_WITH(
        scaler.unscale_grads_(
            key, {at::Tensor(), good, at::ones({2}, at::TensorOptions().device(at::kMeta))}),
        Contains("parameter 2") && Contains("meta"));
    REQUIRE(bit_equal(good, at::full({3}, 8.f)));
    REQUIRE(scaler.stage(key) == fusetrain::amp::OptState::kReady);
    REQUIRE_NOTHROW(scaler.unscale_(opt));
  }
  SECTION("update(new_scale)") {
    scaler.step(opt);
    scaler.update(1024.0);
    REQUIRE(scaler.get_scale() == 1024.0);
    scaler.update(at::full({1}, 512.f));
    REQUIRE(scaler.get_scale() == 512.0);
    REQUIRE_THROWS(scaler.update(at::full({2}, 512.f)));
    REQUIRE_THROWS(scaler.update(at::full({1}, 512.f, at::TensorOptions().device(at::kMeta))));
  }
}

TEST_CASE("GradScaler disabled or without a device passes everything through", "[scaler]") {
  Net net = make_net(1);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  GradScaler off(at::kCPU, GradScalerOptions().enabled(false));
  REQUIRE_FALSE(off.is_enabled());
  const at::Tensor loss = loss_of(net, 0);
  REQUIRE(off.scale(loss).is_same(loss));
  REQUIRE(off.get_scale() == 1.0);
  loss.backward();
  const auto before = params_of(*net);
  off.step(opt);
  REQUIRE_FALSE(all_bit_equal(params_of(*net), before));
  REQUIRE_NOTHROW(off.update());
  REQUIRE(off.state_dict().size() == 0);

  if (!torch::cuda::is_available()) {
    GradScaler cuda(at::kCUDA);
    REQUIRE_FALSE(cuda.is_enabled());
  }
  REQUIRE_THROWS(GradScaler(at::kCPU, GradScalerOptions().growth_factor(1.0)));
  REQUIRE_THROWS(GradScaler(at::kCPU, GradScalerOptions().backoff_factor(1.5)));
  REQUIRE_THROWS(GradScaler(at::kMeta));
}

TEST_CASE("GradScaler state_dict has torch's keys and round-trips", "[scaler][state]") {
  const std::set<std::string> torch_keys = {"scale", "growth_factor", "backoff_factor",
                                            "growth_interval", "_growth_tracker"};
  GradScaler fresh(at::kCPU);
  REQUIRE(keys_of(fresh.state_dict()) == torch_keys);
  REQUIRE(fresh.state_dict().at("scale").toDouble() == 65536.0);
  REQUIRE(fresh.state_dict().at("growth_factor").toDouble() == 2.0);
  REQUIRE(fresh.state_dict().at("backoff_factor").toDouble() == 0.5);
  REQUIRE(fresh.state_dict().at("growth_interval").toInt() == 2000);
  REQUIRE(fresh.state_dict().at("_growth_tracker").toInt() == 0);

  // A scaler some way into training: scale grown once, tracker at 2.
  Net net = make_net(1);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01));
  GradScaler trained(at::kCPU, GradScalerOptions().init_scale(512.0).growth_interval(3));
  for (int step = 0; step < 5; ++step) {
    opt.zero_grad();
    trained.scale(loss_of(net, step)).backward();
    trained.step(opt);
    trained.update();
  }
  const auto state = trained.state_dict();
  REQUIRE(keys_of(state) == torch_keys);
  REQUIRE(state.at("scale").toDouble() == 1024.0);
  REQUIRE(state.at("_growth_tracker").toInt() == 2);
  REQUIRE(state.at("growth_interval").toInt() == 3);

  SECTION("into a fresh scaler") {
    GradScaler other(at::kCPU);
    other.load_state_dict(state);
    require_same_state(other.state_dict(), state);
    REQUIRE(other.get_scale() == 1024.0);
    REQUIRE(other.get_growth_interval() == 3);
    // One more clean step grows the scale: the tracker came along.
    opt.zero_grad();
    other.scale(loss_of(net, 9)).backward();
    other.step(opt);
    other.update();
    REQUIRE(other.get_scale() == 2048.0);
  }
  SECTION("into a scaler already in use") {
    GradScaler other(at::kCPU, GradScalerOptions().init_scale(8.0));
    other.scale(at::ones({1}));
    other.load_state_dict(state);
    require_same_state(other.state_dict(), state);
    REQUIRE(other.scale_tensor().item<float>() == 1024.f);
  }
  SECTION("max_scale and hysteresis travel with extra keys") {
    GradScaler with(at::kCPU, GradScalerOptions().max_scale(1 << 20).hysteresis(2));
    auto extra = torch_keys;
    extra.insert({"max_scale", "hysteresis", "_overflow_tracker"});
    REQUIRE(keys_of(with.state_dict()) == extra);
    GradScaler other(at::kCPU);
    other.load_state_dict(with.state_dict());
    REQUIRE(other.get_max_scale() == double(1 << 20));
    REQUIRE(other.get_hysteresis() == 2);
  }
}

TEST_CASE("GradScaler save() writes atomically and load() restores", "[scaler][state]") {
  TempDir dir;
  const std::string path = dir / "scaler.pt";
  GradScaler a(at::kCPU, GradScalerOptions().init_scale(2048.0).growth_interval(7).hysteresis(1));
  a.scale(at::ones({1}));
  a.save(path);
  REQUIRE(dir.entries() == std::vector<std::string>{"scaler.pt"});

  GradScaler b(at::kCPU);
  b.load(path);
  require_same_state(b.state_dict(), a.state_dict());
  REQUIRE(b.get_scale() == 2048.0);
  REQUIRE(b.get_hysteresis() == 1);

  // Saving over an existing file replaces it whole.
  a.update(4096.0);
  a.save(path);
  REQUIRE(dir.entries() == std::vector<std::string>{"scaler.pt"});
  GradScaler c(at::kCPU);
  c.load(path);
  REQUIRE(c.get_scale() == 4096.0);

  // A failed save leaves nothing behind; loading a missing file or a non-dict throws.
  REQUIRE_THROWS(a.save(dir / "missing/scaler.pt"));
  REQUIRE_THROWS(c.load(dir / "absent.pt"));
  const auto bytes = torch::pickle_save(c10::IValue(int64_t{3}));
  {
    std::ofstream out(dir / "int.pt", std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  REQUIRE_THROWS_WITH(c.load(dir / "int.pt"), Contains("dict"));
  REQUIRE(dir.entries() == std::vector<std::string>{"int.pt", "scaler.pt"});
}

// ====================================================================== Policy

TEST_CASE("Policy names and dtypes", "[policy]") {
  REQUIRE(Policy::names() ==
          std::vector<std::string>{"float32", "mixed_float16", "mixed_bfloat16", "mixed_float8"});
  const Policy f32("float32"), f16("mixed_float16"), bf16("mixed_bfloat16");
  REQUIRE(f32.compute_dtype() == at::kFloat);
  REQUIRE(f16.compute_dtype() == at::kHalf);
  REQUIRE(bf16.compute_dtype() == at::kBFloat16);
  for (const auto& p : {f32, f16, bf16}) REQUIRE(p.variable_dtype() == at::kFloat);
  REQUIRE_FALSE(f32.is_mixed());
  REQUIRE(bf16.is_mixed());
  REQUIRE(bf16.name() == "mixed_bfloat16");
  REQUIRE(Policy() == f32);
  REQUIRE(f16 != bf16);
  REQUIRE_THROWS_AS(Policy("float16"), c10::ValueError);
  REQUIRE_THROWS_WITH(Policy("float16"), Contains("float16") && Contains("\"float32\"") &&
                                             Contains("\"mixed_float16\"") &&
                                             Contains("\"mixed_bfloat16\""));

  const AutocastStateRestorer restore;
  REQUIRE(fusetrain::amp::global_policy() == f32);
  fusetrain::amp::set_global_policy(bf16);
  REQUIRE(fusetrain::amp::global_policy() == bf16);
}

TEST_CASE("AutocastGuard on CPU computes in the policy's dtype and restores state",
          "[policy][autocast]") {
  const AutocastStateRestorer restore;
  REQUIRE_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  REQUIRE(matmul_probe().scalar_type() == at::kFloat);
  {
    const fusetrain::amp::AutocastGuard guard(at::kCPU, Policy("mixed_bfloat16"));
    REQUIRE(at::autocast::is_autocast_enabled(at::kCPU));
    REQUIRE(matmul_probe().scalar_type() == at::kBFloat16);
    {
      const fusetrain::amp::AutocastGuard f16(at::kCPU, Policy("mixed_float16"));
      REQUIRE(matmul_probe().scalar_type() == at::kHalf);
    }
    REQUIRE(at::autocast::get_autocast_dtype(at::kCPU) == at::kBFloat16);
    REQUIRE(matmul_probe().scalar_type() == at::kBFloat16);
    {
      const fusetrain::amp::AutocastGuard off(at::kCPU, Policy("float32"));
      REQUIRE_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
      REQUIRE(matmul_probe().scalar_type() == at::kFloat);
    }
    REQUIRE(matmul_probe().scalar_type() == at::kBFloat16);
    {
      const fusetrain::amp::Float32Guard island;
      REQUIRE(matmul_probe().scalar_type() == at::kFloat);
    }
    REQUIRE(matmul_probe().scalar_type() == at::kBFloat16);
  }
  REQUIRE_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  REQUIRE(matmul_probe().scalar_type() == at::kFloat);

  SECTION("the global policy is the default") {
    fusetrain::amp::set_global_policy(Policy("mixed_bfloat16"));
    const fusetrain::amp::AutocastGuard guard(at::kCPU);
    REQUIRE(matmul_probe().scalar_type() == at::kBFloat16);
  }
  SECTION("weights updated between regions are not served stale from the cast cache") {
    torch::nn::Linear lin(4, 4);
    const at::Tensor x = at::ones({2, 4});
    at::Tensor first;
    {
      const fusetrain::amp::AutocastGuard guard(at::kCPU, Policy("mixed_bfloat16"));
      first = lin->forward(x);
      REQUIRE(first.scalar_type() == at::kBFloat16);
    }
    {
      const at::NoGradGuard no_grad;
      lin->weight.add_(1.0);
    }
    const fusetrain::amp::AutocastGuard guard(at::kCPU, Policy("mixed_bfloat16"));
    const at::Tensor second = lin->forward(x);
    const at::Tensor expected = torch::nn::functional::linear(
        x.to(at::kBFloat16), lin->weight.to(at::kBFloat16), lin->bias.to(at::kBFloat16));
    REQUIRE(bit_equal(second, expected));
    REQUIRE_FALSE(bit_equal(second, first));
  }
  SECTION("a policy the device cannot run is an error, not a fall-back") {
    if (!torch::cuda::is_available()) {
      REQUIRE_THROWS_WITH(fusetrain::amp::AutocastGuard(at::kCUDA, Policy("mixed_float16")),
                          Contains("mixed_float16") && Contains("CUDA is not available"));
      REQUIRE_FALSE(at::autocast::is_autocast_enabled(at::kCUDA));
    }
  }
}

TEST_CASE("keep_float32 runs a module in float32 under autocast, keeping its names",
          "[policy][keep_float32]") {
  const AutocastStateRestorer restore;
  torch::manual_seed(0);
  torch::nn::Linear inner(6, 3);
  auto head = fusetrain::amp::keep_float32(inner);

  std::vector<std::string> inner_keys, head_keys;
  for (const auto& p : inner->named_parameters()) inner_keys.push_back(p.key());
  for (const auto& p : head->named_parameters()) head_keys.push_back(p.key());
  REQUIRE(head_keys == std::vector<std::string>{"weight", "bias"});
  REQUIRE(head_keys == inner_keys);
  REQUIRE(head->named_parameters()["weight"].is_same(inner->weight));
  REQUIRE(head->named_parameters()["bias"].is_same(inner->bias));

  struct Parent : torch::nn::Module {
    explicit Parent(std::shared_ptr<fusetrain::amp::Float32Impl<torch::nn::Linear>> h)
        : head(register_module("head", std::move(h))) {}
    std::shared_ptr<fusetrain::amp::Float32Impl<torch::nn::Linear>> head;
  };
  Parent parent(head);
  std::set<std::string> parent_keys;
  for (const auto& p : parent.named_parameters()) parent_keys.insert(p.key());
  REQUIRE(parent_keys == std::set<std::string>{"head.weight", "head.bias"});

  const at::Tensor x = at::randn({5, 6});
  const at::Tensor reference = inner->forward(x);  // float32, no autocast
  const fusetrain::amp::AutocastGuard guard(at::kCPU, Policy("mixed_bfloat16"));
  REQUIRE(inner->forward(x).scalar_type() == at::kBFloat16);
  const at::Tensor y = head->forward(x);
  REQUIRE(y.scalar_type() == at::kFloat);
  REQUIRE(bit_equal(y, reference));
  // Low-precision inputs are cast up, whether passed as rvalues or lvalues;
  // autocast is back on afterwards.
  REQUIRE(head->forward(x.to(at::kBFloat16)).scalar_type() == at::kFloat);
  at::Tensor x_bf16 = x.to(at::kBFloat16);
  const at::Tensor from_bf16 = head->forward(x_bf16);
  REQUIRE(from_bf16.scalar_type() == at::kFloat);
  {
    const fusetrain::amp::Float32Guard off;
    REQUIRE(bit_equal(from_bf16, inner->forward(x_bf16.to(at::kFloat))));
  }
  REQUIRE(x_bf16.scalar_type() == at::kBFloat16);  // the caller's tensor is not changed
  REQUIRE(at::autocast::is_autocast_enabled(at::kCPU));
  REQUIRE(matmul_probe().scalar_type() == at::kBFloat16);
  // Gradients reach the wrapped module's parameters.
  head->forward(x).sum().backward();
  REQUIRE(inner->weight.grad().defined());
  REQUIRE(inner->weight.grad().scalar_type() == at::kFloat);
}

// ======================================================================== CUDA

TEST_CASE("CUDA non_finite_check_and_unscale_ is bit-equal to torch's CPU op",
          "[cuda][ops][unscale]") {
  REQUIRE_CUDA();
  check_all_unscale_cases(at::kCUDA);
  // Every misalignment of a 16-byte pack, for each element size.
  for (const auto dt : kFloatTypes) {
    for (int64_t offset = 1; offset < 8; ++offset) {
      check_unscale({{dt, {4099}, Layout::kOffset, offset}}, 0.25f, {}, 100 + offset, at::kCUDA);
      check_unscale({{dt, {4099}, Layout::kOffset, offset}}, 0.25f, {{0, -1, kInf}}, 200 + offset,
                    at::kCUDA);
    }
  }
  const auto specs = many_tensors(4);
  check_unscale(specs, 1.f / 1024.f, {}, 31, at::kCUDA);
  check_unscale(specs, 1.f / 1024.f, {{299, -1, kNaN}}, 32, at::kCUDA);
  check_unscale(specs, 1.f, {{7, 0, kInf}}, 33, at::kCUDA);
  check_unscale({{at::kHalf, {1000}}}, 0.5f, {}, 34, at::kCUDA, /*found_init=*/1.f);
  // Large enough that many blocks share one tensor.
  check_unscale(
      {{at::kBFloat16, {(1 << 24) + 3}}, {at::kFloat, {(1 << 22) + 1}, Layout::kOffset, 1}},
      1.f / 3.f, {{0, (1 << 23) + 5, kInf}}, 35, at::kCUDA);
}

TEST_CASE("CUDA update_scale_ matches the CPU op", "[cuda][ops][update]") {
  REQUIRE_CUDA();
  uint64_t seed = 0;
  for (int64_t hysteresis : {0, 1, 3}) {
    for (double max_scale : {double(INFINITY), 1e6, 65536.0}) {
      for (double p : {0.0, 0.1, 0.5}) {
        for (float init : {65536.f, std::ldexp(1.f, 126)}) {
          CAPTURE(hysteresis, max_scale, p, init);
          const auto o = scale_options(2.0, 0.5, 3, max_scale, hysteresis);
          ScaleState cpu(init), gpu(init, at::kCUDA);
          const auto seq = found_sequence(200, p, ++seed);
          for (size_t i = 0; i < seq.size(); ++i) {
            cpu.update(seq[i], o);
            gpu.update(seq[i], o);
            if (!bit_equal(cpu.scale, gpu.scale) || !bit_equal(cpu.growth, gpu.growth) ||
                !bit_equal(cpu.overflow, gpu.overflow)) {
              FAIL("CPU and CUDA differ at step " << i);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("CUDA GradScaler training is bit-identical and skips overflow steps", "[cuda][scaler]") {
  REQUIRE_CUDA();
  train_side_by_side(make_sgd, {}, at::kCUDA);
  train_side_by_side(make_adam, {2, 9}, at::kCUDA);
}

TEST_CASE("CUDA GradScaler unscales bf16 and fp16 gradients like the CPU", "[cuda][scaler]") {
  REQUIRE_CUDA();
  for (const auto dt : {at::kBFloat16, at::kHalf}) {
    CAPTURE(dt);
    for (bool overflow : {false, true}) {
      std::vector<at::Tensor> cpu_params, gpu_params;
      for (int64_t n : kOddSizes) {
        at::Tensor p = at::zeros({n}, dt).requires_grad_();
        p.mutable_grad() = random_values(n, dt, n);
        if (overflow && n == 7) element(p.mutable_grad(), 6).fill_(kInf);
        at::Tensor q =
            at::zeros({n}, at::TensorOptions().dtype(dt).device(at::kCUDA)).requires_grad_();
        q.mutable_grad() = p.grad().to(at::kCUDA);
        cpu_params.push_back(p);
        gpu_params.push_back(q);
      }
      torch::optim::SGD cpu_opt(cpu_params, torch::optim::SGDOptions(0.1));
      torch::optim::SGD gpu_opt(gpu_params, torch::optim::SGDOptions(0.1));
      GradScaler cpu_scaler(at::kCPU, GradScalerOptions().init_scale(3.0));
      GradScaler gpu_scaler(at::kCUDA, GradScalerOptions().init_scale(3.0));
      cpu_scaler.scale(at::ones({1}));
      gpu_scaler.scale(at::ones({1}, at::kCUDA));
      cpu_scaler.unscale_(cpu_opt);
      gpu_scaler.unscale_(gpu_opt);
      for (size_t i = 0; i < cpu_params.size(); ++i) {
        REQUIRE(bit_equal(cpu_params[i].grad(), gpu_params[i].grad()));
      }
      cpu_scaler.step(cpu_opt);
      gpu_scaler.step(gpu_opt);
      REQUIRE(gpu_scaler.step_was_skipped() == overflow);
      REQUIRE(cpu_scaler.step_was_skipped() == overflow);
      gpu_scaler.update();
      REQUIRE(gpu_scaler.get_scale() == (overflow ? 1.5 : 3.0));
    }
  }
}

TEST_CASE("CUDA AutocastGuard and keep_float32", "[cuda][policy]") {
  REQUIRE_CUDA();
  const bool prev = at::autocast::is_autocast_enabled(at::kCUDA);
  {
    const fusetrain::amp::AutocastGuard guard(at::kCUDA, Policy("mixed_float16"));
    REQUIRE(matmul_probe(at::kCUDA).scalar_type() == at::kHalf);
    torch::nn::Linear inner(8, 2);
    inner->to(at::kCUDA);
    auto head = fusetrain::amp::keep_float32(inner);
    REQUIRE(head->forward(at::randn({3, 8}, at::kCUDA)).scalar_type() == at::kFloat);
    REQUIRE(matmul_probe(at::kCUDA).scalar_type() == at::kHalf);
  }
  {
    const fusetrain::amp::AutocastGuard guard(at::kCUDA, Policy("mixed_bfloat16"));
    REQUIRE(matmul_probe(at::kCUDA).scalar_type() == at::kBFloat16);
  }
  REQUIRE(at::autocast::is_autocast_enabled(at::kCUDA) == prev);
  REQUIRE(matmul_probe(at::kCUDA).scalar_type() == at::kFloat);
}

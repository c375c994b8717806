// Tests of fusetrain::optim::FusedAdamW and FusedSGD from C++: against
// torch::optim::AdamW / SGD on a small torch::nn model, driven by
// amp::GradScaler with an injected overflow, with bf16 params and fp32 master
// weights, and through torch::save / torch::load. CUDA cases ([cuda]) compare
// with the CPU and skip with a message where there is no GPU.
//
// Tolerance against torch (as in tests/python/test_optim.py): elementwise
// rtol plus rtol * max|expected| absolute. The two sides compute the same
// update in a different order (ulp-level differences per step), and a purely
// relative tolerance means nothing for weights near zero.
#include <fusetrain/fusetrain.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/cuda.h>
#include <torch/serialize.h>
#include <torch/torch.h>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_test.h"

namespace {

using fusetrain::amp::GradScaler;
using fusetrain::amp::GradScalerOptions;
using fusetrain::optim::FusedAdamW;
using fusetrain::optim::FusedAdamWOptions;
using fusetrain::optim::FusedAdamWParamState;
using fusetrain::optim::FusedSGD;
using fusetrain::optim::FusedSGDOptions;
using fusetrain::optim::FusedSGDParamState;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int kSteps = 20;

// ------------------------------------------------------------------ helpers

struct OptimNetImpl : torch::nn::Module {
  OptimNetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(12, 33))),
        fc2(register_module("fc2", torch::nn::Linear(33, 5))) {}
  at::Tensor forward(const at::Tensor& x) { return fc2->forward(torch::tanh(fc1->forward(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(OptimNet);

OptimNet make_optim_net(uint64_t seed, at::ScalarType dtype = at::kFloat,
                        at::Device device = at::kCPU) {
  torch::manual_seed(seed);
  OptimNet net;
  net->to(device, dtype);
  return net;
}

std::vector<at::Tensor> params_of(const torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

// The batch of step `step`: the same for every model.
std::pair<at::Tensor, at::Tensor> batch(int step, at::ScalarType dtype = at::kFloat,
                                        at::Device device = at::kCPU) {
  auto gen = at::detail::createCPUGenerator(1000 + step);
  at::Tensor x = at::randn({8, 12}, gen).to(device, dtype);
  at::Tensor y = at::randn({8, 5}, gen).to(device, dtype);
  return {x, y};
}

at::Tensor loss_of(OptimNet& net, int step) {
  const auto dtype = net->fc1->weight.scalar_type();
  const auto [x, y] = batch(step, dtype, net->fc1->weight.device());
  return torch::mse_loss(net->forward(x).to(at::kFloat), y.to(at::kFloat));
}

bool bit_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor ac = a.cpu().contiguous(), bc = b.cpu().contiguous();
  return std::memcmp(ac.const_data_ptr(), bc.const_data_ptr(), ac.nbytes()) == 0;
}

bool all_bit_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!bit_equal(a[i], b[i])) return false;
  }
  return true;
}

// |actual - expected| <= rtol * |expected| + rtol * max|expected|, elementwise.
void require_tracks(const at::Tensor& actual, const at::Tensor& expected, double rtol,
                    const std::string& what) {
  REQUIRE(actual.sizes() == expected.sizes());
  const at::Tensor a = actual.detach().cpu().to(at::kDouble);
  const at::Tensor e = expected.detach().cpu().to(at::kDouble);
  const double atol = rtol * e.abs().max().item<double>();
  const at::Tensor excess = (a - e).abs() - (e.abs() * rtol + atol);
  const double worst = excess.max().item<double>();
  INFO(what << ": max |diff| " << (a - e).abs().max().item<double>() << ", allowed " << atol
            << " + " << rtol << " * |expected|; worst excess " << worst);
  REQUIRE(worst <= 0.0);
}

// Copies net's gradients into other's parameters (both optimizers then see
// exactly the same gradients), converted to other's dtype.
void copy_grads(OptimNet& from, OptimNet& to) {
  auto src = from->parameters();
  auto dst = to->parameters();
  REQUIRE(src.size() == dst.size());
  for (size_t i = 0; i < src.size(); ++i) {
    dst[i].mutable_grad() = src[i].grad().detach().to(dst[i].scalar_type()).clone();
  }
}

FusedAdamWParamState& adam_state(torch::optim::Optimizer& opt, const at::Tensor& p) {
  return static_cast<FusedAdamWParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
}

FusedSGDParamState& sgd_state(torch::optim::Optimizer& opt, const at::Tensor& p) {
  return static_cast<FusedSGDParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
}

// Every state tensor of a FusedAdamW, cloned, in parameter order.
std::vector<at::Tensor> adam_state_tensors(FusedAdamW& opt, OptimNet& net) {
  std::vector<at::Tensor> out;
  for (const auto& p : net->parameters()) {
    auto it = opt.state().find(p.unsafeGetTensorImpl());
    if (it == opt.state().end()) continue;
    const auto& s = static_cast<FusedAdamWParamState&>(*it->second);
    for (const at::Tensor& t :
         {s.step(), s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq(), s.master_param()}) {
      out.push_back(t.defined() ? t.clone() : t);
    }
  }
  return out;
}

std::vector<at::Tensor> sgd_state_tensors(FusedSGD& opt, OptimNet& net) {
  std::vector<at::Tensor> out;
  for (const auto& p : net->parameters()) {
    auto it = opt.state().find(p.unsafeGetTensorImpl());
    if (it == opt.state().end()) continue;
    const auto& s = static_cast<FusedSGDParamState&>(*it->second);
    for (const at::Tensor& t : {s.momentum_buffer(), s.master_param()}) {
      out.push_back(t.defined() ? t.clone() : t);
    }
  }
  return out;
}

// Two param groups (fc1 and fc2) with their own options.
template <typename Options>
std::vector<torch::optim::OptimizerParamGroup> two_groups(OptimNet& net, const Options& first,
                                                          const Options& second) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(net->fc1->parameters(), std::make_unique<Options>(first));
  groups.emplace_back(net->fc2->parameters(), std::make_unique<Options>(second));
  return groups;
}

// --------------------------------------------------------- against torch

TEST_CASE("FusedAdamW follows torch::optim::AdamW on a small model", "[optim][adamw]") {
  const bool amsgrad = GENERATE(false, true);
  const bool maximize = GENERATE(false, true);
  CAPTURE(amsgrad, maximize);
  OptimNet net = make_optim_net(1), ref = make_optim_net(1);
  FusedAdamW ours(
      two_groups(net, FusedAdamWOptions(1e-2).weight_decay(0.1).amsgrad(amsgrad).maximize(maximize),
                 FusedAdamWOptions(3e-3).weight_decay(0.0).amsgrad(amsgrad).maximize(maximize)));
  // torch's C++ AdamW has no maximize: it gets the negated gradients instead.
  torch::optim::AdamW theirs(
      two_groups(ref, torch::optim::AdamWOptions(1e-2).weight_decay(0.1).amsgrad(amsgrad),
                 torch::optim::AdamWOptions(3e-3).weight_decay(0.0).amsgrad(amsgrad)));
  for (int step = 0; step < kSteps; ++step) {
    ours.zero_grad();
    loss_of(net, step).backward();
    theirs.zero_grad();
    copy_grads(net, ref);
    if (maximize) {
      for (auto& p : ref->parameters()) p.mutable_grad().neg_();
    }
    ours.step();
    theirs.step();
  }
  const auto a = net->parameters(), b = ref->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    require_tracks(a[i], b[i], 1e-6, "param " + std::to_string(i));
    const auto& s = adam_state(ours, a[i]);
    REQUIRE(s.step().item<float>() == kSteps);
    const auto& t =
        static_cast<torch::optim::AdamWParamState&>(*theirs.state().at(b[i].unsafeGetTensorImpl()));
    require_tracks(s.exp_avg(), t.exp_avg(), 1e-6, "exp_avg " + std::to_string(i));
    require_tracks(s.exp_avg_sq(), t.exp_avg_sq(), 1e-6, "exp_avg_sq " + std::to_string(i));
    REQUIRE(s.max_exp_avg_sq().defined() == amsgrad);
  }
}

TEST_CASE("Param groups added later keep their options, as in torch::optim", "[optim]") {
  // torch 2.15's Optimizer::add_param_group gives a group of an optimizer
  // outside torch the defaults alone (Note [torch compat], compat.h).
  OptimNet net = make_optim_net(4);
  FusedAdamW adamw(net->fc1->parameters(), FusedAdamWOptions(1e-2).weight_decay(0.1));
  adamw.add_param_group(torch::optim::OptimizerParamGroup(
      net->fc2->parameters(),
      std::make_unique<FusedAdamWOptions>(FusedAdamWOptions(3e-3).weight_decay(0.0).amsgrad(true))));
  REQUIRE(adamw.param_groups().size() == 2);
  const auto& added = static_cast<const FusedAdamWOptions&>(adamw.param_groups()[1].options());
  CHECK(added.lr() == 3e-3);
  CHECK(added.weight_decay() == 0.0);
  CHECK(added.amsgrad());
  const auto& first = static_cast<const FusedAdamWOptions&>(adamw.param_groups()[0].options());
  CHECK(first.lr() == 1e-2);
  CHECK(first.weight_decay() == 0.1);

  FusedSGD sgd(net->fc1->parameters(), FusedSGDOptions(0.05));
  sgd.add_param_group(torch::optim::OptimizerParamGroup(
      net->fc2->parameters(), std::make_unique<FusedSGDOptions>(FusedSGDOptions(0.01).momentum(0.9))));
  const auto& sgd_added = static_cast<const FusedSGDOptions&>(sgd.param_groups()[1].options());
  CHECK(sgd_added.lr() == 0.01);
  CHECK(sgd_added.momentum() == 0.9);
}

TEST_CASE("FusedAdamW in Adam mode (L2 decay) follows torch::optim::Adam", "[optim][adamw]") {
  OptimNet net = make_optim_net(2), ref = make_optim_net(2);
  FusedAdamW ours(net->parameters(),
                  FusedAdamWOptions(1e-2).weight_decay(0.05).decoupled_weight_decay(false));
  torch::optim::Adam theirs(ref->parameters(), torch::optim::AdamOptions(1e-2).weight_decay(0.05));
  for (int step = 0; step < kSteps; ++step) {
    ours.zero_grad();
    loss_of(net, step).backward();
    theirs.zero_grad();
    copy_grads(net, ref);
    ours.step();
    theirs.step();
  }
  const auto a = net->parameters(), b = ref->parameters();
  for (size_t i = 0; i < a.size(); ++i)
    require_tracks(a[i], b[i], 1e-6, "param " + std::to_string(i));
}

TEST_CASE("FusedSGD follows torch::optim::SGD on a small model", "[optim][sgd]") {
  struct Case {
    const char* name;
    double momentum, dampening, weight_decay;
    bool nesterov;
  };
  const Case c =
      GENERATE(Case{"plain", 0.0, 0.0, 0.0, false}, Case{"momentum", 0.9, 0.0, 0.0, false},
               Case{"dampening", 0.9, 0.3, 0.01, false}, Case{"nesterov", 0.9, 0.0, 0.02, true});
  CAPTURE(c.name);
  OptimNet net = make_optim_net(3), ref = make_optim_net(3);
  auto ours_opts = [&](double lr) {
    return FusedSGDOptions(lr)
        .momentum(c.momentum)
        .dampening(c.dampening)
        .weight_decay(c.weight_decay)
        .nesterov(c.nesterov);
  };
  auto ref_opts = [&](double lr) {
    return torch::optim::SGDOptions(lr)
        .momentum(c.momentum)
        .dampening(c.dampening)
        .weight_decay(c.weight_decay)
        .nesterov(c.nesterov);
  };
  FusedSGD ours(two_groups(net, ours_opts(0.05), ours_opts(0.01)), ours_opts(0.05));
  torch::optim::SGD theirs(two_groups(ref, ref_opts(0.05), ref_opts(0.01)), ref_opts(0.05));
  for (int step = 0; step < kSteps; ++step) {
    ours.zero_grad();
    loss_of(net, step).backward();
    theirs.zero_grad();
    copy_grads(net, ref);
    ours.step();
    theirs.step();
  }
  const auto a = net->parameters(), b = ref->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    require_tracks(a[i], b[i], 1e-6, "param " + std::to_string(i));
    if (c.momentum != 0) {
      const auto& t =
          static_cast<torch::optim::SGDParamState&>(*theirs.state().at(b[i].unsafeGetTensorImpl()));
      require_tracks(sgd_state(ours, a[i]).momentum_buffer(), t.momentum_buffer(), 1e-6,
                     "momentum_buffer " + std::to_string(i));
    }
  }
}

TEST_CASE("Fused optimizers leave params without gradients alone", "[optim]") {
  OptimNet net = make_optim_net(4);
  FusedAdamW adam(net->parameters(), FusedAdamWOptions(1e-2));
  FusedSGD sgd(net->parameters(), FusedSGDOptions(1e-2).momentum(0.9));
  loss_of(net, 0).backward();
  net->fc2->bias.mutable_grad() = at::Tensor();
  const at::Tensor before = net->fc2->bias.detach().clone();
  adam.step();
  sgd.step();
  REQUIRE(bit_equal(net->fc2->bias, before));
  REQUIRE(adam.state().count(net->fc2->bias.unsafeGetTensorImpl()) == 0);
  REQUIRE_FALSE(bit_equal(net->fc2->weight, params_of(*make_optim_net(4))[2]));
}

TEST_CASE("Fused optimizers call the closure once and return its loss", "[optim]") {
  OptimNet net = make_optim_net(5);
  FusedAdamW opt(net->parameters(), FusedAdamWOptions(1e-2));
  int calls = 0;
  const at::Tensor loss = opt.step([&] {
    ++calls;
    REQUIRE(at::GradMode::is_enabled());
    opt.zero_grad();
    at::Tensor l = loss_of(net, 0);
    l.backward();
    return l;
  });
  REQUIRE(calls == 1);
  REQUIRE(loss.defined());
  REQUIRE(adam_state(opt, net->fc1->weight).step().item<float>() == 1.f);
}

// ------------------------------------------------------------ GradScaler

TEST_CASE("GradScaler-driven FusedAdamW: overflow skips the step, else equals unscaled training",
          "[optim][scaler]") {
  OptimNet net = make_optim_net(6), ref = make_optim_net(6);
  FusedAdamW opt(net->parameters(), FusedAdamWOptions(1e-2).weight_decay(0.1).amsgrad(true));
  FusedAdamW ref_opt(ref->parameters(), FusedAdamWOptions(1e-2).weight_decay(0.1).amsgrad(true));
  GradScaler scaler(at::kCPU, GradScalerOptions().init_scale(1024.0).growth_interval(4));
  for (int step = 0; step < kSteps; ++step) {
    CAPTURE(step);
    const bool overflow = step == 0 || step == 7;  // state just created, and later
    opt.zero_grad();
    scaler.scale(loss_of(net, step)).backward();
    if (overflow) {
      const at::NoGradGuard no_grad;
      net->fc1->weight.grad()[3][4].fill_(kInf);
    }
    const auto params_before = params_of(*net);
    const auto state_before = adam_state_tensors(opt, net);
    scaler.step(opt);
    scaler.update();
    if (overflow) {
      REQUIRE(all_bit_equal(params_of(*net), params_before));
      if (step > 0) REQUIRE(all_bit_equal(adam_state_tensors(opt, net), state_before));
      for (const auto& p : net->parameters()) {
        auto it = opt.state().find(p.unsafeGetTensorImpl());
        if (it != opt.state().end()) {
          REQUIRE(adam_state(opt, p).step().item<float>() == (step == 0 ? 0.f : 6.f));
        }
      }
    } else {
      ref_opt.zero_grad();
      loss_of(ref, step).backward();
      ref_opt.step();
    }
    // Power-of-two scale, unscaled in the kernel: exactly the unscaled run.
    REQUIRE(all_bit_equal(params_of(*net), params_of(*ref)));
  }
  REQUIRE(all_bit_equal(adam_state_tensors(opt, net), adam_state_tensors(ref_opt, ref)));
  REQUIRE(adam_state(opt, net->fc1->weight).step().item<float>() == kSteps - 2);
}

TEST_CASE("GradScaler-driven FusedSGD skips an overflowing step", "[optim][scaler]") {
  OptimNet net = make_optim_net(7), ref = make_optim_net(7);
  FusedSGD opt(net->parameters(), FusedSGDOptions(0.05).momentum(0.9));
  FusedSGD ref_opt(ref->parameters(), FusedSGDOptions(0.05).momentum(0.9));
  GradScaler scaler(at::kCPU, GradScalerOptions().init_scale(256.0));
  for (int step = 0; step < 8; ++step) {
    CAPTURE(step);
    const bool overflow = step == 4;
    opt.zero_grad();
    scaler.scale(loss_of(net, step)).backward();
    if (overflow) {
      const at::NoGradGuard no_grad;
      net->fc2->bias.grad()[1].fill_(-kInf);
    }
    const auto before = sgd_state_tensors(opt, net);
    scaler.step(opt);
    scaler.update();
    if (overflow) {
      REQUIRE(all_bit_equal(sgd_state_tensors(opt, net), before));
    } else {
      ref_opt.zero_grad();
      loss_of(ref, step).backward();
      ref_opt.step();
    }
    REQUIRE(all_bit_equal(params_of(*net), params_of(*ref)));
  }
}

// -------------------------------------------------------- master weights

TEST_CASE("FusedAdamW with bf16 params and fp32 master weights tracks the fp32 run",
          "[optim][master]") {
  OptimNet low = make_optim_net(8, at::kBFloat16);
  OptimNet f32 = make_optim_net(8, at::kBFloat16);
  f32->to(at::kFloat);  // exactly the bf16 values
  OptimNet ref = make_optim_net(8, at::kBFloat16);
  ref->to(at::kFloat);
  FusedAdamW ours(low->parameters(),
                  FusedAdamWOptions(1e-2).weight_decay(0.1).master_weights(true));
  FusedAdamW ours32(f32->parameters(), FusedAdamWOptions(1e-2).weight_decay(0.1));
  torch::optim::AdamW theirs(ref->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  for (int step = 0; step < kSteps; ++step) {
    CAPTURE(step);
    ours.zero_grad();
    loss_of(low, step).backward();
    ours32.zero_grad();
    theirs.zero_grad();
    copy_grads(low, f32);  // the bf16 gradients, exactly, in fp32
    copy_grads(low, ref);
    ours.step();
    ours32.step();
    theirs.step();
    for (const auto& p : low->parameters()) {
      const auto& s = adam_state(ours, p);
      REQUIRE(p.scalar_type() == at::kBFloat16);
      REQUIRE(s.master_param().scalar_type() == at::kFloat);
      REQUIRE(s.exp_avg().scalar_type() == at::kFloat);
      // The param is exactly its master rounded to bf16.
      REQUIRE(bit_equal(p, s.master_param().to(at::kBFloat16)));
    }
  }
  const auto a = low->parameters(), b = f32->parameters(), c = ref->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    const at::Tensor master = adam_state(ours, a[i]).master_param();
    // fp32 maths on the same gradients: our fp32 run bit for bit, torch's
    // within the fp32 tolerance.
    REQUIRE(bit_equal(master, b[i]));
    require_tracks(master, c[i], 1e-6, "master " + std::to_string(i));
  }
}

TEST_CASE("FusedSGD with bf16 params and fp32 master weights", "[optim][master]") {
  OptimNet low = make_optim_net(9, at::kBFloat16);
  OptimNet f32 = make_optim_net(9, at::kBFloat16);
  f32->to(at::kFloat);
  FusedSGD ours(low->parameters(),
                FusedSGDOptions(0.05).momentum(0.9).nesterov(true).master_weights(true));
  FusedSGD ours32(f32->parameters(), FusedSGDOptions(0.05).momentum(0.9).nesterov(true));
  for (int step = 0; step < kSteps; ++step) {
    ours.zero_grad();
    loss_of(low, step).backward();
    ours32.zero_grad();
    copy_grads(low, f32);
    ours.step();
    ours32.step();
  }
  const auto a = low->parameters(), b = f32->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    const auto& s = sgd_state(ours, a[i]);
    REQUIRE(s.momentum_buffer().scalar_type() == at::kFloat);
    REQUIRE(bit_equal(s.master_param(), b[i]));
    REQUIRE(bit_equal(a[i], s.master_param().to(at::kBFloat16)));
  }
}

// ------------------------------------------------------ save and load

TEST_CASE("FusedAdamW survives torch::save / torch::load and continues identically",
          "[optim][serialize]") {
  const bool master = GENERATE(false, true);
  CAPTURE(master);
  const at::ScalarType dtype = master ? at::kBFloat16 : at::kFloat;
  OptimNet net = make_optim_net(10, dtype);
  const auto opts = FusedAdamWOptions(1e-2).weight_decay(0.1).amsgrad(true).master_weights(master);
  FusedAdamW opt(net->parameters(), opts);
  for (int step = 0; step < 5; ++step) {
    opt.zero_grad();
    loss_of(net, step).backward();
    opt.step();
  }
  std::stringstream file;
  torch::save(opt, file);

  OptimNet resumed = make_optim_net(99, dtype);
  {
    const at::NoGradGuard no_grad;
    auto dst = resumed->parameters();
    auto src = net->parameters();
    for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(src[i]);
  }
  FusedAdamW opt2(resumed->parameters(), FusedAdamWOptions(0.5));  // options come from the file
  torch::load(opt2, file);
  const auto& loaded = static_cast<const FusedAdamWOptions&>(opt2.param_groups()[0].options());
  REQUIRE(loaded.lr() == 1e-2);
  REQUIRE(loaded.amsgrad());
  REQUIRE(loaded.master_weights() == master);
  REQUIRE(all_bit_equal(adam_state_tensors(opt2, resumed), adam_state_tensors(opt, net)));
  for (const auto& p : resumed->parameters()) {
    const auto& s = adam_state(opt2, p);
    REQUIRE(s.step().scalar_type() == at::kFloat);
    REQUIRE(s.exp_avg().scalar_type() == at::kFloat);
    REQUIRE(s.master_param().defined() == master);
  }
  for (int step = 5; step < 10; ++step) {
    opt.zero_grad();
    loss_of(net, step).backward();
    opt.step();
    opt2.zero_grad();
    loss_of(resumed, step).backward();
    opt2.step();
  }
  REQUIRE(all_bit_equal(params_of(*resumed), params_of(*net)));
  REQUIRE(all_bit_equal(adam_state_tensors(opt2, resumed), adam_state_tensors(opt, net)));
}

TEST_CASE("FusedSGD survives torch::save / torch::load and continues identically",
          "[optim][serialize]") {
  OptimNet net = make_optim_net(11);
  FusedSGD opt(net->parameters(), FusedSGDOptions(0.05).momentum(0.9).dampening(0.1));
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    loss_of(net, step).backward();
    opt.step();
  }
  std::stringstream file;
  torch::save(opt, file);
  OptimNet resumed = make_optim_net(11);
  {
    const at::NoGradGuard no_grad;
    auto dst = resumed->parameters();
    auto src = net->parameters();
    for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(src[i]);
  }
  FusedSGD opt2(resumed->parameters(), FusedSGDOptions(0.5));
  torch::load(opt2, file);
  REQUIRE(all_bit_equal(sgd_state_tensors(opt2, resumed), sgd_state_tensors(opt, net)));
  for (int step = 3; step < 8; ++step) {
    opt.zero_grad();
    loss_of(net, step).backward();
    opt.step();
    opt2.zero_grad();
    loss_of(resumed, step).backward();
    opt2.step();
  }
  REQUIRE(all_bit_equal(params_of(*resumed), params_of(*net)));
}

TEST_CASE("Fused optimizers reject invalid options", "[optim][errors]") {
  OptimNet net = make_optim_net(12);
  REQUIRE_THROWS_WITH(FusedAdamW(net->parameters(), FusedAdamWOptions(-1.0)),
                      Catch::Matchers::Contains("invalid learning rate"));
  REQUIRE_THROWS_WITH(
      FusedAdamW(net->parameters(), FusedAdamWOptions(1e-3).betas(std::make_tuple(1.0, 0.999))),
      Catch::Matchers::Contains("beta parameter at index 0"));
  REQUIRE_THROWS_WITH(FusedSGD(net->parameters(), FusedSGDOptions(0.1).nesterov(true)),
                      Catch::Matchers::Contains("Nesterov momentum requires"));
}

TEST_CASE("Fused optimizer ops reject a step counter shared by two parameters", "[optim][errors]") {
  // Two parameters sharing one step tensor would count twice per step on the
  // CPU and lose increments on CUDA (one thread per counter).
  const std::vector<at::Tensor> params{at::zeros({3}), at::zeros({5})};
  const std::vector<at::Tensor> grads{at::ones({3}), at::ones({5})};
  std::vector<at::Tensor> m{at::zeros({3}), at::zeros({5})}, v{at::zeros({3}), at::zeros({5})};
  const at::Tensor shared = at::zeros({}, at::kFloat);
  REQUIRE_THROWS_WITH(
      fusetrain::ops::fused_adamw_(params, grads, m, v, {}, {}, {shared, shared},
                                   fusetrain::ops::AdamHyper{}),
      Catch::Matchers::Contains("state_steps[0] and state_steps[1] are the same step counter"));
  // Distinct counters (views of one buffer at different offsets included) are fine.
  const at::Tensor buffer = at::zeros({2}, at::kFloat);
  fusetrain::ops::fused_adamw_(params, grads, m, v, {}, {}, {buffer[0], buffer[1]},
                               fusetrain::ops::AdamHyper{});
  REQUIRE(buffer.equal(at::ones({2})));
}

// ------------------------------------------------------------------ CUDA

TEST_CASE("CUDA FusedAdamW with bf16 params and fp32 masters matches the CPU", "[cuda][optim]") {
  REQUIRE_CUDA();
  const at::Device cuda(at::kCUDA);
  OptimNet cpu = make_optim_net(13, at::kBFloat16);
  OptimNet gpu = make_optim_net(13, at::kBFloat16, cuda);
  const auto opts = FusedAdamWOptions(1e-2).weight_decay(0.1).amsgrad(true).master_weights(true);
  FusedAdamW opt_cpu(cpu->parameters(), opts), opt_gpu(gpu->parameters(), opts);
  GradScaler scaler(at::kCUDA, GradScalerOptions().init_scale(512.0));
  for (int step = 0; step < 10; ++step) {
    CAPTURE(step);
    opt_gpu.zero_grad();
    scaler.scale(loss_of(gpu, step)).backward();
    const bool overflow = step == 4;
    if (overflow) {
      const at::NoGradGuard no_grad;
      gpu->fc1->bias.grad()[0].fill_(kInf);
    }
    // The CPU run gets the GPU's unscaled gradients.
    auto g = gpu->parameters(), c = cpu->parameters();
    const double scale = scaler.get_scale();
    for (size_t i = 0; i < g.size(); ++i) {
      c[i].mutable_grad() = (g[i].grad().to(at::kFloat) / scale).to(at::kBFloat16).cpu();
    }
    const auto before = params_of(*gpu);
    scaler.step(opt_gpu);
    scaler.update();
    if (overflow) {
      REQUIRE(all_bit_equal(params_of(*gpu), before));
      continue;
    }
    opt_cpu.step();
    for (size_t i = 0; i < g.size(); ++i) {
      const at::Tensor mg = adam_state(opt_gpu, g[i]).master_param();
      REQUIRE(bit_equal(g[i], mg.to(at::kBFloat16)));
      require_tracks(mg, adam_state(opt_cpu, c[i]).master_param(), 1e-5,
                     "master " + std::to_string(i));
    }
  }
  REQUIRE(adam_state(opt_gpu, gpu->fc1->weight).step().item<float>() == 9.f);
}

TEST_CASE("CUDA fused AdamW counts every step counter once, over several launches",
          "[cuda][optim]") {
  REQUIRE_CUDA();
  // More counters than one launch's parameter block holds (3998), so the
  // increment runs as several launches; a skipped step leaves them all.
  constexpr int kParams = 4500;
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA);
  std::vector<at::Tensor> params, grads, m, v, steps;
  for (int i = 0; i < kParams; ++i) {
    params.push_back(at::zeros({1 + i % 3}, f32));
    grads.push_back(at::ones({1 + i % 3}, f32));
    m.push_back(at::zeros({1 + i % 3}, f32));
    v.push_back(at::zeros({1 + i % 3}, f32));
    steps.push_back(at::full({}, static_cast<float>(i % 7), f32));
  }
  const at::Tensor found_inf = at::zeros({1}, f32);
  fusetrain::ops::fused_adamw_(params, grads, m, v, {}, {}, steps, fusetrain::ops::AdamHyper{},
                               std::nullopt, found_inf);
  found_inf.fill_(1.f);
  fusetrain::ops::fused_adamw_(params, grads, m, v, {}, {}, steps, fusetrain::ops::AdamHyper{},
                               std::nullopt, found_inf);
  const at::Tensor got = at::stack(steps).cpu();
  const at::Tensor want = at::arange(kParams, at::kFloat).remainder(7) + 1;
  REQUIRE(got.equal(want));
  const at::Tensor shared = at::zeros({}, f32);
  REQUIRE_THROWS_WITH(
      fusetrain::ops::fused_adamw_({params[0], params[1]}, {grads[0], grads[1]}, {m[0], m[1]},
                                   {v[0], v[1]}, {}, {}, {shared, shared},
                                   fusetrain::ops::AdamHyper{}),
      Catch::Matchers::Contains("the same step counter"));
}

TEST_CASE("CUDA multi_tensor_l2norm accumulates float64 tensors in double", "[cuda][optim]") {
  REQUIRE_CUDA();
  // Squares of 1e-25 underflow to zero in float and squares of 1e30
  // overflow it, yet both norms are ordinary float32 values: a float
  // accumulation returns 0 and inf where the double one (the CPU reference)
  // returns sqrt(n) * |x|. Odd sizes span several 64K chunks.
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  at::manual_seed(0);
  const std::vector<at::Tensor> cpu = {(at::rand({278011}, f64) + 1) * 1e-25,
                                       (at::rand({70001}, f64) + 1) * 1e30,
                                       at::randn({131073}, f64)};
  std::vector<at::Tensor> gpu;
  for (const auto& t : cpu) gpu.push_back(t.cuda());
  for (const auto& [first, count] : {std::pair<size_t, size_t>{0, 1}, {1, 1}, {0, 3}}) {
    CAPTURE(first, count);
    const std::vector<at::Tensor> c(cpu.begin() + first, cpu.begin() + first + count);
    const std::vector<at::Tensor> g(gpu.begin() + first, gpu.begin() + first + count);
    const auto [total_cpu, per_cpu] = fusetrain::ops::multi_tensor_l2norm(c, true);
    const auto [total_gpu, per_gpu] = fusetrain::ops::multi_tensor_l2norm(g, true);
    const double expected = at::cat(c).pow(2).sum().sqrt().item<double>();
    REQUIRE(std::isfinite(total_gpu.item<float>()));
    REQUIRE(total_gpu.item<float>() > 0);
    // Both accumulate in double (different orders: ~1e-16 relative) and
    // round once to float32: within one float32 ulp of each other.
    REQUIRE(std::abs(total_gpu.item<float>() - expected) <= 1.2e-7 * expected);
    REQUIRE(at::allclose(per_gpu.cpu(), per_cpu, 1.2e-7, 0));
  }
  // A mixed group (float32 with float64) accumulates in double too.
  const std::vector<at::Tensor> mixed = {gpu[0], gpu[2].to(at::kFloat)};
  const auto [total_mixed, per_mixed] = fusetrain::ops::multi_tensor_l2norm(mixed, true);
  REQUIRE(per_mixed[0].item<float>() > 0);
  REQUIRE(std::isfinite(total_mixed.item<float>()));
}

}  // namespace

// fusetrain::graph::FusedSteps: K steps per execution equal K unfused steps.
#include <fusetrain/fusetrain.h>

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include "cuda_test.h"

namespace {

struct Run {
  torch::nn::Linear model{nullptr};
  std::unique_ptr<fusetrain::optim::FusedAdamW> opt;
  fusetrain::graph::StepFn step;
};

Run make_run() {
  torch::manual_seed(0);
  Run r;
  r.model = torch::nn::Linear(8, 3);
  r.opt = std::make_unique<fusetrain::optim::FusedAdamW>(r.model->parameters(),
                                                         fusetrain::optim::FusedAdamWOptions(1e-2));
  auto model = r.model;
  auto* opt = r.opt.get();
  r.step = [model, opt](const std::vector<at::Tensor>& b) mutable {
    auto loss = torch::mse_loss(model->forward(b[0]), b[1]);
    loss.backward();
    opt->step();
    opt->zero_grad();
    return loss.detach();
  };
  return r;
}

std::vector<std::vector<at::Tensor>> batches(int n) {
  torch::manual_seed(1);
  std::vector<std::vector<at::Tensor>> out;
  for (int i = 0; i < n; ++i) out.push_back({torch::randn({4, 8}), torch::randn({4, 3})});
  return out;
}

}  // namespace

TEST_CASE("FusedSteps on the CPU equals unfused steps", "[graph]") {
  const auto data = batches(10);
  Run ref = make_run();
  std::vector<at::Tensor> ref_losses;
  for (const auto& b : data) ref_losses.push_back(ref.step(b));

  Run fused_run = make_run();
  fusetrain::graph::FusedStepsOptions options;
  options.steps_per_execution = 4;
  fusetrain::graph::FusedSteps fused(fused_run.step, data[0], options);
  std::vector<at::Tensor> losses;
  for (size_t i = 0; i < data.size(); i += 4) {
    std::vector<std::vector<at::Tensor>> chunk(data.begin() + i,
                                               data.begin() + std::min(i + 4, data.size()));
    losses.push_back(fused.run(chunk));
  }
  CHECK(torch::equal(torch::cat(losses), torch::stack(ref_losses)));
  CHECK(torch::equal(fused_run.model->weight, ref.model->weight));
  CHECK_FALSE(fused.captured());
}

TEST_CASE("FusedSteps rejects dynamic shapes naming the batch", "[graph]") {
  Run r = make_run();
  fusetrain::graph::FusedStepsOptions options;
  options.steps_per_execution = 2;
  fusetrain::graph::FusedSteps fused(r.step, {torch::randn({4, 8}), torch::randn({4, 3})}, options);
  CHECK_THROWS_WITH(fused.run({{torch::randn({4, 8}), torch::randn({4, 3})},
                               {torch::randn({5, 8}), torch::randn({5, 3})}}),
                    Catch::Contains("batch 1 tensor 0 has shape [5, 8]"));
  CHECK_THROWS_WITH(fused.run({}), Catch::Contains("takes 1 to 2 batches"));
  // Same shapes, another device (meta: a second device on any machine), as
  // the header promises and the Python face checks.
  const auto meta = torch::TensorOptions().device(torch::kMeta);
  CHECK_THROWS_WITH(fused.run({{torch::randn({4, 8}), torch::empty({4, 3}, meta)}}),
                    Catch::Contains("batch 0 tensor 1 is Float on meta but the sample is Float on cpu"));
  CHECK_THROWS_WITH(fused.run({{torch::randn({4, 8}, torch::kDouble), torch::randn({4, 3})}}),
                    Catch::Contains("batch 0 tensor 0 is Double on cpu but the sample is Float"));
}

namespace {

// Two identical Linear models: one stepped with float learning rates, one
// with a device-side lr tensor holding the same doubles.
template <typename Opt, typename Options>
void check_lr_tensor_equals_float_lr(Options options, const torch::Device& device) {
  torch::manual_seed(3);
  torch::nn::Linear a(16, 5), b(16, 5);
  a->to(device);
  b->to(device);
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < a->parameters().size(); ++i) b->parameters()[i].copy_(a->parameters()[i]);
  }
  Options big = options;
  big.lr(123.0);  // ignored while the lr tensor is set
  Opt opt_a(a->parameters(), options), opt_b(b->parameters(), big);
  const at::Tensor lr = torch::full({}, options.lr(), torch::dtype(torch::kDouble).device(device));
  opt_b.set_lr_tensor(lr);
  for (int step = 0; step < 6; ++step) {
    const double value = options.lr() * (step < 3 ? 1.0 : 0.5);
    for (auto& group : opt_a.param_groups()) group.options().set_lr(value);
    lr.fill_(value);
    const at::Tensor x = torch::randn({8, 16}, device);
    for (auto* m : {&a, &b}) (*m)->forward(x).square().mean().backward();
    opt_a.step();
    opt_b.step();
    opt_a.zero_grad();
    opt_b.zero_grad();
  }
  for (size_t i = 0; i < a->parameters().size(); ++i) {
    CHECK(torch::equal(a->parameters()[i].cpu(), b->parameters()[i].cpu()));
  }
}

}  // namespace

TEST_CASE("set_lr_tensor steps like the float learning rate, bit for bit", "[graph][optim]") {
  using namespace fusetrain::optim;
  check_lr_tensor_equals_float_lr<FusedAdamW>(FusedAdamWOptions(1e-2).weight_decay(0.1), torch::kCPU);
  check_lr_tensor_equals_float_lr<FusedSGD>(FusedSGDOptions(1e-2).momentum(0.9).weight_decay(0.01),
                                            torch::kCPU);
  if (torch::cuda::is_available()) {
    check_lr_tensor_equals_float_lr<FusedAdamW>(FusedAdamWOptions(1e-2).weight_decay(0.1), torch::kCUDA);
  }
  torch::nn::Linear m(2, 2);
  FusedAdamW opt(m->parameters());
  CHECK_THROWS_WITH(opt.set_lr_tensor(torch::ones({2}, torch::kDouble)),
                    Catch::Contains("the lr tensor must hold one element"));
  CHECK_THROWS_WITH(opt.set_lr_tensor(torch::ones({}, torch::kInt)),
                    Catch::Contains("must be float64 or float32"));
}

TEST_CASE("FusedSteps captures a CUDA graph equal to eager steps", "[graph][cuda]") {
  REQUIRE_CUDA();
  auto run = [](bool graph) {
    torch::manual_seed(0);
    torch::nn::Linear model(8, 3);
    model->to(torch::kCUDA);
    fusetrain::optim::FusedAdamW opt(model->parameters(), fusetrain::optim::FusedAdamWOptions(1.0));
    const at::Tensor lr = torch::zeros({}, torch::dtype(torch::kDouble).device(torch::kCUDA));
    opt.set_lr_tensor(lr);
    fusetrain::amp::GradScaler scaler(torch::kCUDA,
                                      fusetrain::amp::GradScalerOptions().init_scale(1024.0).growth_interval(3));
    fusetrain::graph::StepFn step = [&](const std::vector<at::Tensor>& b) {
      lr.copy_(b[2]);  // the schedule is an input of the step
      opt.zero_grad(/*set_to_none=*/false);
      const at::Tensor loss = torch::mse_loss(model->forward(b[0]), b[1]);
      scaler.scale(loss).backward();
      scaler.step(opt);
      scaler.update();
      return loss.detach();
    };
    torch::manual_seed(1);
    std::vector<std::vector<at::Tensor>> data;
    for (int i = 0; i < 48; ++i) {
      const double value = 1e-2 / (1 + i / 8);
      data.push_back({torch::randn({4, 8}, torch::kCUDA), torch::randn({4, 3}, torch::kCUDA),
                      torch::full({}, value, torch::dtype(torch::kDouble).device(torch::kCUDA))});
    }
    fusetrain::graph::FusedStepsOptions o;
    o.steps_per_execution = 8;
    o.use_cuda_graph = graph;
    fusetrain::graph::FusedSteps fused(step, data[0], o);
    std::vector<at::Tensor> losses;
    for (size_t i = 0; i < data.size(); i += 8) {
      losses.push_back(fused.run({data.begin() + i, data.begin() + i + 8}));
    }
    CHECK(fused.captured() == graph);
    return std::make_pair(torch::cat(losses).cpu(), model->weight.detach().cpu());
  };
  const auto eager = run(false);
  const auto graph = run(true);
  CHECK(torch::allclose(graph.first, eager.first, 1e-5, 1e-6));
  CHECK(torch::allclose(graph.second, eager.second, 1e-5, 1e-6));
}

TEST_CASE("FusedSteps names a host sync that stops capture", "[graph][cuda]") {
  REQUIRE_CUDA();
  const at::Tensor x = torch::randn({4}, torch::kCUDA);
  fusetrain::graph::FusedStepsOptions o;
  o.steps_per_execution = 2;
  o.warmup_executions = 0;
  fusetrain::graph::FusedSteps fused(
      [](const std::vector<at::Tensor>& b) {
        const at::Tensor s = b[0].sum();
        (void)s.item<float>();  // a host sync
        return s;
      },
      {x}, o);
  CHECK_THROWS_WITH(fused.run({{x}, {x}}), Catch::Contains("host synchronisation"));
  // The failed capture ended: the device still works.
  CHECK(torch::equal((x * 2).cpu(), x.cpu() * 2));
}

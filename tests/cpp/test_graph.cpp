// fusetrain::graph::FusedSteps: K steps per execution equal K unfused steps.
#include <fusetrain/fusetrain.h>

#include <catch2/catch.hpp>
#include <torch/torch.h>

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
}

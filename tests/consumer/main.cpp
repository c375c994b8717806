// A LibTorch program using an installed fusetrain: a few mixed-precision
// training steps with GradScaler and a Policy. Exits non-zero on any failure.
#include <fusetrain/fusetrain.h>

#include <torch/torch.h>

#include <cmath>
#include <iostream>
#include <limits>

namespace {

int failures = 0;

void expect(bool ok, const char* what) {
  if (!ok) {
    std::cerr << "consumer: FAILED: " << what << "\n";
    ++failures;
  }
}

}  // namespace

int main() try {
  namespace amp = fusetrain::amp;
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(16, 32), torch::nn::ReLU(),
                              torch::nn::Linear(32, 1));
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05));
  amp::GradScaler scaler(torch::kCPU,
                         amp::GradScalerOptions().init_scale(1024.0).growth_interval(2));
  const amp::Policy policy("mixed_bfloat16");
  expect(policy.compute_dtype() == torch::kBFloat16, "policy compute dtype");

  const auto x = torch::randn({64, 16});
  const auto y = x.sum(1, /*keepdim=*/true);
  double first_loss = 0, last_loss = 0;
  for (int step = 0; step < 20; ++step) {
    optimizer.zero_grad();
    torch::Tensor loss;
    {
      const amp::AutocastGuard autocast(torch::kCPU, policy);
      const auto out = model->forward(x);
      expect(out.scalar_type() == torch::kBFloat16, "autocast output dtype");
      loss = torch::mse_loss(out.to(torch::kFloat), y);
    }
    scaler.scale(loss).backward();
    if (step == 5)
      model->ptr(0)->parameters()[0].grad().view(-1)[0].fill_(
          std::numeric_limits<float>::infinity());
    scaler.step(optimizer);
    expect(scaler.step_was_skipped() == (step == 5), "step skipped exactly on overflow");
    scaler.update();
    if (step == 0) first_loss = loss.item<double>();
    last_loss = loss.item<double>();
  }
  // Grown every 2 clean steps, halved once: 1024 * 2^(5/2=2) / 2 * 2^(14/2=7).
  expect(scaler.get_scale() == 1024.0 * 4 / 2 * 128, "scale after growth and one back-off");
  expect(std::isfinite(last_loss) && last_loss < first_loss, "loss decreases");
  expect(scaler.state_dict().contains("_growth_tracker"), "state_dict keys");

  std::cout << "consumer: fusetrain " << fusetrain::version() << ", scale " << scaler.get_scale()
            << ", loss " << first_loss << " -> " << last_loss << "\n";
  if (failures == 0) std::cout << "consumer: OK\n";
  return failures == 0 ? 0 : 1;
} catch (const std::exception& e) {
  std::cerr << "consumer: exception: " << e.what() << "\n";
  return 1;
}

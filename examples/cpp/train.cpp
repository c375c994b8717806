// Mixed-precision data-parallel training in LibTorch with fusetrain: an MLP
// learns labels made by a fixed random teacher, under autocast (a Policy),
// with the GradScaler, FusedAdamW and DistributedDataParallel.
//
//   ./train [steps] [policy]                         one process (policy: mixed_float16)
//   torchrun --nproc_per_node 2 --no-python ./train  two ranks (or set RANK,
//                                                    WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
//
// CPU ranks talk through gloo (with a shared-memory allreduce on one host),
// CUDA ranks through NCCL. Exits non-zero on an error.
#include <fusetrain/fusetrain.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>

namespace amp = fusetrain::amp;
namespace dist = fusetrain::dist;

int main(int argc, char** argv) try {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 300;
  const amp::Policy policy(argc > 2 ? argv[2] : "mixed_float16");

  // torchrun's environment; none means a single process.
  const auto env = dist::Environment::from_env();
  const int rank = env ? env->rank : 0;
  const torch::Device device = torch::cuda::is_available()
                                   ? torch::Device(torch::kCUDA, env ? env->local_rank : 0)
                                   : torch::Device(torch::kCPU);
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  if (env) {
    dist::ProcessGroupOptions options;
    options.device_type = device.type();  // gloo for CPUs, NCCL for GPUs
    group = dist::init_process_group(*env, options);
  }

  torch::manual_seed(0);  // the same teacher everywhere; DDP broadcasts rank 0's model
  const auto teacher = torch::randn({64, 10}).to(device);
  torch::nn::Sequential net(torch::nn::Linear(64, 512), torch::nn::ReLU(), torch::nn::Linear(512, 512),
                            torch::nn::ReLU(), torch::nn::Linear(512, 10));
  net->to(device);
  std::optional<dist::DistributedDataParallel<torch::nn::Sequential>> ddp;
  if (group) ddp.emplace(net, group);  // checks shapes, broadcasts, then averages gradients

  fusetrain::optim::FusedAdamW opt(net->parameters(), fusetrain::optim::FusedAdamWOptions(1e-3));
  // Loss scaling matters for float16; with bfloat16 it never overflows.
  amp::GradScaler scaler(device.type(),
                         amp::GradScalerOptions().enabled(policy.compute_dtype() == torch::kHalf));
  torch::manual_seed(1 + rank);  // each rank draws its own batches

  torch::Tensor first, last;
  const int tenth = std::max(1, steps / 10);
  const auto start = std::chrono::steady_clock::now();
  for (int step = 0; step < steps; ++step) {
    const auto x = torch::randn({128, 64}, device);
    const auto y = x.matmul(teacher).argmax(1);
    torch::Tensor loss;
    {
      const amp::AutocastGuard autocast(device.type(), policy);
      const auto logits = ddp ? ddp->forward(x) : net->forward(x);
      loss = torch::nn::functional::cross_entropy(logits, y);
    }
    scaler.scale(loss).backward();  // with DDP, gradients are averaged when it returns
    scaler.unscale_(opt);           // clip the unscaled gradients
    torch::nn::utils::clip_grad_norm_(net->parameters(), 1.0);
    scaler.step(opt);  // FusedAdamW takes the scale and overflow flag on the device
    scaler.update();
    opt.zero_grad();
    // Mean losses of the first and last tenth of the run, summed on the device.
    const auto l = loss.detach().to(torch::kFloat);
    if (step < tenth) first = first.defined() ? first + l : l;
    if (step >= steps - tenth) last = last.defined() ? last + l : l;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  std::vector<at::Tensor> summary{torch::stack({first, last}) / tenth};
  if (group) {
    group->allreduce(summary)->wait();
    summary[0] /= env->world_size;
  }
  const auto s = summary[0].cpu();
  if (rank == 0) {
    std::cout << "cpp (" << policy.name() << ", " << (env ? env->world_size : 1)
              << " ranks): loss " << s[0].item<double>() << " -> " << s[1].item<double>() << ", "
              << steps / seconds << " steps/s, scale " << scaler.get_scale() << "\n";
  }
  return 0;
} catch (const std::exception& e) {
  std::cerr << "train: " << e.what() << "\n";
  return 1;
}

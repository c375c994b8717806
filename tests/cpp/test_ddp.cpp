// Tests of fusetrain::dist from C++: the pure bucketing function, state_dict
// and the process group on one rank in this process, and multi-process runs
// over gloo on loopback (2 and 3 ranks): training equal to one process on
// the full batch (from diverged initial parameters), no_sync accumulation,
// mismatched shapes raising on every rank, and a rank that dies making the
// others fail within the group's timeout. NCCL with world size 1 ([cuda])
// skips without a GPU.
//
// Multi-process runs: the test binary re-executes itself (/proc/self/exe,
// posix_spawn: nothing runs between fork and exec, so libtorch's thread
// pools in this process do not matter) selecting the hidden test case
// "ddp_worker" with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT and the
// scenario in the environment. Each rank checks its own results with
// REQUIRE, so a failing rank exits non-zero; the parent waits with a
// deadline, kills every rank past it, and fails with each rank's log.
#include <fusetrain/fusetrain.h>

#include <torch/cuda.h>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cuda_test.h"

extern char** environ;

namespace {

using Catch::Matchers::Contains;
namespace dist = fusetrain::dist;
using Clock = std::chrono::steady_clock;

constexpr int kGroupTimeoutMs = 10000;    // every worker's process group
constexpr double kLaunchDeadlineS = 120;  // a whole spawned world, start-up included
constexpr double kTol = 1e-6;

// ------------------------------------------------------------------ helpers

double max_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(
        worst,
        (a[i].detach().to(at::kDouble) - b[i].detach().to(at::kDouble)).abs().max().item<double>());
  }
  return worst;
}

std::vector<at::Tensor> grads_of(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.grad().clone());
  return out;
}

// Uneven layer sizes; with the options of uneven_options() three buckets:
// [[5, 4, 3], [2], [1, 0]] (reverse order, the first one ~1 KB).
torch::nn::Sequential make_net(uint64_t seed, int64_t out_features = 5) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(7, 300), torch::nn::Tanh(),
                               torch::nn::Linear(300, 41), torch::nn::Tanh(),
                               torch::nn::Linear(41, out_features));
}

dist::DDPOptions uneven_options() {
  return dist::DDPOptions().first_bucket_cap_mb(0.001).bucket_cap_mb(0.02);
}

// The global batch of a step, the same on every rank.
std::pair<at::Tensor, at::Tensor> batch(int step, int64_t n, int64_t d_in, int64_t d_out) {
  torch::manual_seed(7000 + step);
  auto x = torch::randn({n, d_in});
  auto y = torch::randn({n, d_out});
  return {x, y};
}

at::Tensor shard(const at::Tensor& t, int rank, int world) {
  const int64_t n = t.size(0) / world;
  return t.narrow(0, rank * n, n);
}

// ------------------------------------------------------------ process spawn

struct RankOutcome {
  int exit_code = -1;  // the exit status, or 128 + signal
  std::string log;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string tail(const std::string& text, size_t n = 4000) {
  return text.size() <= n ? text : "..." + text.substr(text.size() - n);
}

std::string self_exe() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  REQUIRE(n > 0);
  return std::string(buf, static_cast<size_t>(n));
}

// Spawns `world` copies of this binary running the hidden "ddp_worker" test
// with `scenario`; waits for all of them until the deadline, then kills the
// rest. A rendezvous lost to another process taking the port first is retried
// on a fresh port.
std::vector<RankOutcome> spawn_world(int world, const std::string& scenario) {
  for (int attempt = 0;; ++attempt) {
    char dir_template[] = "/tmp/fusetrain_ddp_XXXXXX";
    REQUIRE(::mkdtemp(dir_template) != nullptr);
    const std::string dir = dir_template;
    const int port = dist::free_port();

    std::vector<std::string> base_env;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string kv = *e;
      const std::string key = kv.substr(0, kv.find('='));
      if (key == "RANK" || key == "WORLD_SIZE" || key == "LOCAL_RANK" || key == "MASTER_ADDR" ||
          key == "MASTER_PORT" || key == "FUSETRAIN_DDP_SCENARIO")
        continue;
      base_env.push_back(kv);
    }
    base_env.push_back("WORLD_SIZE=" + std::to_string(world));
    base_env.push_back("MASTER_ADDR=127.0.0.1");
    base_env.push_back("MASTER_PORT=" + std::to_string(port));
    base_env.push_back("FUSETRAIN_DDP_SCENARIO=" + scenario);
    base_env.push_back("OMP_NUM_THREADS=1");

    std::vector<pid_t> pids;
    std::vector<std::string> logs;
    for (int rank = 0; rank < world; ++rank) {
      std::vector<std::string> env = base_env;
      env.push_back("RANK=" + std::to_string(rank));
      env.push_back("LOCAL_RANK=" + std::to_string(rank));
      std::vector<char*> envp;
      for (auto& kv : env) envp.push_back(kv.data());
      envp.push_back(nullptr);
      std::string exe = self_exe(), name = "ddp_worker";
      std::vector<char*> argv{exe.data(), name.data(), nullptr};

      logs.push_back(dir + "/rank" + std::to_string(rank) + ".log");
      posix_spawn_file_actions_t actions;
      posix_spawn_file_actions_init(&actions);
      posix_spawn_file_actions_addopen(&actions, 1, logs.back().c_str(),
                                       O_WRONLY | O_CREAT | O_TRUNC, 0644);
      posix_spawn_file_actions_adddup2(&actions, 1, 2);
      pid_t pid = -1;
      const int rc = posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv.data(), envp.data());
      posix_spawn_file_actions_destroy(&actions);
      if (rc != 0) {
        for (pid_t p : pids) ::kill(p, SIGKILL), ::waitpid(p, nullptr, 0);
        FAIL("posix_spawn failed: " << rc);
      }
      pids.push_back(pid);
    }

    std::vector<RankOutcome> out(world);
    std::vector<bool> done(world, false);
    const auto deadline = Clock::now() + std::chrono::duration<double>(kLaunchDeadlineS);
    int remaining = world;
    while (remaining > 0 && Clock::now() < deadline) {
      for (int r = 0; r < world; ++r) {
        if (done[r]) continue;
        int status = 0;
        if (::waitpid(pids[r], &status, WNOHANG) == pids[r]) {
          done[r] = true;
          --remaining;
          out[r].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::vector<int> hung;
    for (int r = 0; r < world; ++r) {
      if (done[r]) continue;
      hung.push_back(r);
      ::kill(pids[r], SIGKILL);
      int status = 0;
      ::waitpid(pids[r], &status, 0);
      out[r].exit_code = 128 + SIGKILL;
    }
    bool port_taken = false;
    for (int r = 0; r < world; ++r) {
      out[r].log = read_file(logs[r]);
      port_taken |= out[r].log.find("ddress already in use") != std::string::npos;
      std::remove(logs[r].c_str());
    }
    ::rmdir(dir.c_str());
    if (port_taken && attempt < 2) continue;
    if (!hung.empty()) {
      std::ostringstream msg;
      msg << "ranks still running after " << kLaunchDeadlineS << " s were killed:";
      for (int r : hung) msg << ' ' << r;
      for (int r = 0; r < world; ++r) msg << "\n--- rank " << r << " log:\n" << tail(out[r].log);
      FAIL(msg.str());
    }
    return out;
  }
}

// Every rank exited with its expected code (0 unless `expected` says).
void require_exit_codes(const std::vector<RankOutcome>& out,
                        const std::map<int, int>& expected = {}) {
  for (size_t r = 0; r < out.size(); ++r) {
    const auto it = expected.find(static_cast<int>(r));
    const int want = it == expected.end() ? 0 : it->second;
    INFO("rank " << r << " of " << out.size() << " log:\n" << tail(out[r].log));
    REQUIRE(out[r].exit_code == want);
  }
}

// ------------------------------------------------------------ worker scenarios
// Run on every rank; REQUIRE failures make the rank exit non-zero.

// 12 SGD-momentum steps from diverged initial parameters (seed 100 + rank):
// equal to one process training rank 0's initial model on the full batch.
void worker_equivalence(const c10::intrusive_ptr<c10d::ProcessGroup>& group, int rank, int world) {
  auto net = make_net(100 + rank);
  auto ref = make_net(100);
  if (rank != 0) REQUIRE(max_diff(net->parameters(), ref->parameters()) > 0);
  dist::DistributedDataParallel<torch::nn::Sequential> ddp(net, group, uneven_options());
  REQUIRE(max_diff(net->parameters(), ref->parameters()) == 0);  // rank 0's, bit for bit
  const std::vector<std::vector<size_t>> expected_layout{{5, 4, 3}, {2}, {1, 0}};
  REQUIRE(ddp.reducer().bucket_indices() == expected_layout);

  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD opt_ref(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int step = 0; step < 12; ++step) {
    auto [x, y] = batch(step, 8 * world, 7, 5);
    opt.zero_grad();
    torch::mse_loss(ddp.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
    opt.step();
    opt_ref.zero_grad();
    torch::mse_loss(ref->forward(x), y).backward();
    opt_ref.step();
  }
  REQUIRE(max_diff(net->parameters(), make_net(100)->parameters()) > 1e-2);  // it trained
  const double err = max_diff(net->parameters(), ref->parameters());
  INFO("rank " << rank << ": max |ddp - single process| = " << err);
  REQUIRE(err <= kTol);

  // A bare torch::nn::Linear holder: one bucket.
  torch::manual_seed(5 + rank);
  torch::nn::Linear lin(6, 3);
  torch::manual_seed(5);
  torch::nn::Linear lin_ref(6, 3);
  dist::DistributedDataParallel<torch::nn::Linear> ddp_lin(lin, group);
  REQUIRE(ddp_lin.reducer().bucket_indices().size() == 1);
  torch::optim::SGD o1(lin->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD o2(lin_ref->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 10; ++step) {
    auto [x, y] = batch(100 + step, 4 * world, 6, 3);
    o1.zero_grad();
    torch::mse_loss(ddp_lin.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
    o1.step();
    o2.zero_grad();
    torch::mse_loss(lin_ref->forward(x), y).backward();
    o2.step();
  }
  REQUIRE(max_diff(lin->parameters(), lin_ref->parameters()) <= kTol);
}

// Uneven inputs: rank r has 5 + 3r batches and trains under join(). Equal
// to one process that, at each step, averages the gradients of the ranks
// that still have a batch over the initial world size (or over those ranks,
// without divide_by_initial_world_size); every rank ends with that model.
// With throw_on_early_termination every rank throws once rank 0 is out.
void worker_join(const c10::intrusive_ptr<c10d::ProcessGroup>& group, int rank, int world) {
  auto count = [](int r) { return 5 + 3 * r; };
  for (const bool initial : {true, false}) {
    CAPTURE(initial);
    auto net = make_net(100 + rank);
    auto ref = make_net(100);
    dist::DistributedDataParallel<torch::nn::Sequential> ddp(net, group, uneven_options());
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD opt_ref(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    {
      auto join = ddp.join(dist::JoinOptions().divide_by_initial_world_size(initial));
      for (int step = 0; step < count(rank); ++step) {
        auto [x, y] = batch(step, 6 * world, 7, 5);
        opt.zero_grad();
        torch::mse_loss(ddp.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
        opt.step();
      }
      join->finish();
    }
    for (int step = 0; step < count(world - 1); ++step) {
      auto [x, y] = batch(step, 6 * world, 7, 5);
      opt_ref.zero_grad();
      int active = 0;
      for (int r = 0; r < world; ++r) {
        if (step >= count(r)) continue;
        ++active;
        torch::mse_loss(ref->forward(shard(x, r, world)), shard(y, r, world)).backward();
      }
      const torch::NoGradGuard no_grad;
      for (auto& p : ref->parameters()) p.mutable_grad().div_(initial ? world : active);
      opt_ref.step();
    }
    REQUIRE(max_diff(net->parameters(), ref->parameters()) <= kTol);
  }
  auto net = make_net(100 + rank);
  dist::DistributedDataParallel<torch::nn::Sequential> ddp(net, group, uneven_options());
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05));
  auto join = ddp.join(dist::JoinOptions().throw_on_early_termination(true));
  int steps = 0;
  bool threw = false;
  try {
    for (int step = 0; step < count(rank); ++step) {
      auto [x, y] = batch(step, 6 * world, 7, 5);
      opt.zero_grad();
      torch::mse_loss(ddp.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
      opt.step();
      ++steps;
    }
    join->finish();
  } catch (const c10::Error& e) {
    threw = std::string(e.what()).find("exhausted") != std::string::npos;
  }
  REQUIRE(threw);
  REQUIRE(steps == count(0));
}

// k micro-batches per rank, the first k-1 inside no_sync(): equal to one
// process on the whole batch; inside the guard the gradients are local.
void worker_no_sync(const c10::intrusive_ptr<c10d::ProcessGroup>& group, int rank, int world) {
  constexpr int k = 3, b = 4;
  auto net = make_net(100);
  auto ref = make_net(100);
  auto local = make_net(100);
  dist::DistributedDataParallel<torch::nn::Sequential> ddp(net, group, uneven_options());
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD opt_ref(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int step = 0; step < 10; ++step) {
    auto [x, y] = batch(step, world * k * b, 7, 5);
    const at::Tensor xs = shard(x, rank, world), ys = shard(y, rank, world);
    opt.zero_grad();
    {
      auto guard = ddp.no_sync();
      REQUIRE_FALSE(ddp.reducer().require_sync());
      for (int j = 0; j < k - 1; ++j) {
        (torch::mse_loss(ddp.forward(xs.narrow(0, j * b, b)), ys.narrow(0, j * b, b)) / k)
            .backward();
      }
    }
    REQUIRE(ddp.reducer().require_sync());
    if (step == 0) {
      for (int j = 0; j < k - 1; ++j) {
        (torch::mse_loss(local->forward(xs.narrow(0, j * b, b)), ys.narrow(0, j * b, b)) / k)
            .backward();
      }
      REQUIRE(max_diff(grads_of(net->parameters()), grads_of(local->parameters())) == 0);
    }
    (torch::mse_loss(ddp.forward(xs.narrow(0, (k - 1) * b, b)), ys.narrow(0, (k - 1) * b, b)) / k)
        .backward();
    opt.step();
    opt_ref.zero_grad();
    torch::mse_loss(ref->forward(x), y).backward();
    opt_ref.step();
  }
  const double err = max_diff(net->parameters(), ref->parameters());
  INFO("rank " << rank << ": max |no_sync accumulation - one large batch| = " << err);
  REQUIRE(err <= kTol);
}

// The last rank's output layer has 6 outputs, the others' 5: every rank
// raises, naming the parameter, long before the group's timeout.
// ZeRO stage 1 and 2 (fusetrain::optim::ZeroRedundancyOptimizer over
// FusedAdamW, max_grad_norm folded) for 20 steps against unsharded DDP +
// FusedAdamW clipped the trainer's way: parameters within 1e-6; per-rank
// state about total / N; the consolidated state equals the unsharded one,
// and shard_state() of it resumes the run exactly.
void worker_zero(const c10::intrusive_ptr<c10d::ProcessGroup>& group, int rank, int world) {
  namespace optim = fusetrain::optim;
  const auto adam = optim::FusedAdamWOptions(1e-2);
  auto ref = make_net(3);
  dist::DistributedDataParallel<torch::nn::Sequential> ref_ddp(ref, group, uneven_options());
  optim::FusedAdamW ref_opt(ref->parameters(), adam);
  constexpr double kClip = 0.5;
  auto train = [&](auto& ddp, torch::optim::Optimizer& opt, int from, int to, bool clip) {
    for (int step = from; step < to; ++step) {
      auto [x, y] = batch(step, 4 * world, 7, 5);
      opt.zero_grad();
      torch::mse_loss(ddp.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
      if (clip) {  // the unsharded reference clips as the trainer does
        std::vector<at::Tensor> grads;
        for (const auto& p : ddp.module()->parameters()) grads.push_back(p.grad());
        const at::Tensor norm = std::get<0>(fusetrain::ops::multi_tensor_l2norm(grads));
        const at::Tensor coef = (kClip / (norm + 1e-6)).clamp_max(1.0);
        for (auto& g : grads) g.mul_(coef);
      }
      opt.step();
    }
  };
  train(ref_ddp, ref_opt, 0, 20, true);
  auto ref25 = make_net(3);  // 5 steps further, for the resharded runs
  dist::DistributedDataParallel<torch::nn::Sequential> ref25_ddp(ref25, group, uneven_options());
  optim::FusedAdamW ref25_opt(ref25->parameters(), adam);
  train(ref25_ddp, ref25_opt, 0, 25, true);
  int64_t full_state = 0;
  for (const auto& item : ref_opt.state()) {
    const auto& s = static_cast<const optim::FusedAdamWParamState&>(*item.second);
    full_state += (s.exp_avg().numel() + s.exp_avg_sq().numel()) * 4;
  }
  for (const bool stage2 : {false, true}) {
    INFO("stage " << (stage2 ? 2 : 1));
    auto net = make_net(3);
    dist::DistributedDataParallel<torch::nn::Sequential> ddp(
        net, group, uneven_options().shard_gradients(stage2));
    auto opt = optim::ZeroRedundancyOptimizer::adamw(
        {torch::optim::OptimizerParamGroup(net->parameters())}, adam, group,
        optim::ZeroOptions().max_grad_norm(kClip), stage2 ? &ddp.reducer() : nullptr);
    train(ddp, *opt, 0, 20, false);
    REQUIRE(max_diff(net->parameters(), ref->parameters()) <= kTol);
    if (stage2) {
      for (const auto& p : net->parameters()) REQUIRE_FALSE(p.grad().defined());
    }
    // The ranks' states add up to the whole, each within one padded piece per bucket.
    const int64_t mine = opt->local_state_bytes();
    const auto buckets = static_cast<int64_t>(opt->shards().layout().buckets().size());
    REQUIRE(mine < full_state / world + 8 * dist::kShardAlignment * buckets);
    std::vector<at::Tensor> total{at::full({1}, static_cast<double>(mine), at::kDouble)};
    group->allreduce(total)->wait();
    REQUIRE(total[0].item<double>() == static_cast<double>(full_state));
    // Consolidated on every rank: FusedAdamW's own state over the whole parameters.
    opt->consolidate_state(-1);
    const auto params = net->parameters();
    const auto ref_params = ref->parameters();
    REQUIRE(opt->state().size() == ref_opt.state().size());
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& a = static_cast<const optim::FusedAdamWParamState&>(
          *opt->state().at(params[i].unsafeGetTensorImpl()));
      const auto& b = static_cast<const optim::FusedAdamWParamState&>(
          *ref_opt.state().at(ref_params[i].unsafeGetTensorImpl()));
      REQUIRE(a.exp_avg().sizes() == b.exp_avg().sizes());
      REQUIRE(max_diff({a.exp_avg(), a.exp_avg_sq(), a.step()}, {b.exp_avg(), b.exp_avg_sq(), b.step()}) <= kTol);
    }
    // Resharded from the consolidated copy, training goes on as before.
    opt->shard_state();
    REQUIRE(opt->state().empty());
    REQUIRE(opt->local_state_bytes() == mine);
    train(ddp, *opt, 20, 25, false);
    REQUIRE(max_diff(net->parameters(), ref25->parameters()) <= kTol);
  }
}

// Parameters of odd sizes (3, 5, 7, 1, 33, 2, 129 elements), in float32 and
// again in bfloat16: one bucket per dtype, whose pieces cut through some.
struct MixedImpl : torch::nn::Module {
  MixedImpl() {
    torch::manual_seed(11);
    for (const auto dtype : {at::kFloat, at::kBFloat16}) {
      for (const int64_t n : {3, 5, 7, 1, 33, 2, 129}) {
        const std::string name = std::string(dtype == at::kFloat ? "f" : "b") + std::to_string(n);
        weights.push_back(register_parameter(name, torch::randn({n}).to(dtype)));
      }
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor loss = torch::zeros({});
    for (const auto& w : weights)
      loss = loss + (w.to(at::kFloat) - x.narrow(0, 0, w.numel())).square().mean();
    return loss;
  }
  std::vector<at::Tensor> weights;
};
TORCH_MODULE(Mixed);

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// Note [Aligned bucket offsets]: every view an optimizer steps through is
// 16-byte aligned (the CUDA optimizers' vector path needs it): param.grad with
// gradient_as_bucket_view; ZeRO stage 1's parameter and gradient slices with
// parameters_as_bucket_view; stage 2's gradient slices of the pieces. And the
// padding changes no result: 3 AdamW steps of each equal unsharded DDP with
// copied gradients (float32 within kTol; bfloat16 bit for bit where the
// reductions add in the same order, Note [Sharded optimizer state]).
void worker_aligned(const c10::intrusive_ptr<c10d::ProcessGroup>& group, int rank, int world) {
  namespace optim = fusetrain::optim;
  const auto adam = optim::FusedAdamWOptions(1e-2);
  auto input = [&](int step) {
    torch::manual_seed(500 + 10 * step + rank);
    return torch::randn({129});
  };
  auto train = [&](auto& ddp, torch::optim::Optimizer& opt, const std::function<void()>& check) {
    for (int step = 0; step < 3; ++step) {
      // Not opt.zero_grad(): libtorch's detaches the gradients in place,
      // which bucket views refuse.
      for (auto& p : ddp.module()->parameters()) p.mutable_grad().reset();
      ddp.forward(input(step)).backward();
      check();
      opt.step();
    }
  };
  Mixed ref;
  dist::DistributedDataParallel<Mixed> ref_ddp(ref, group);
  REQUIRE(ref_ddp.reducer().bucket_indices().size() == 2);
  optim::FusedAdamW ref_opt(ref->parameters(), adam);
  train(ref_ddp, ref_opt, [] {});
  const auto float_params = [](const Mixed& m) {
    return std::vector<at::Tensor>(m->weights.begin(), m->weights.begin() + 7);
  };
  const auto bf16_params = [](const Mixed& m) {
    return std::vector<at::Tensor>(m->weights.begin() + 7, m->weights.end());
  };
  const bool same_sums = world == 2 || dist::uses_shared_memory(group);
  {
    INFO("DDP, gradient_as_bucket_view");
    Mixed net;
    dist::DistributedDataParallel<Mixed> ddp(net, group,
                                             dist::DDPOptions().gradient_as_bucket_view(true));
    optim::FusedAdamW opt(net->parameters(), adam);
    train(ddp, opt, [&] {
      for (const auto& p : net->parameters()) {
        REQUIRE(p.grad().storage().unsafeGetStorageImpl() != p.storage().unsafeGetStorageImpl());
        REQUIRE(aligned16(p.grad()));
      }
    });
    REQUIRE(max_diff(net->parameters(), ref->parameters()) == 0);
  }
  for (const bool stage2 : {false, true}) {
    INFO("stage " << (stage2 ? 2 : 1));
    Mixed net;
    dist::DistributedDataParallel<Mixed> ddp(
        net, group, dist::DDPOptions().gradient_as_bucket_view(!stage2).shard_gradients(stage2));
    auto opt = optim::ZeroRedundancyOptimizer::adamw(
        {torch::optim::OptimizerParamGroup(net->parameters())}, adam, group,
        optim::ZeroOptions().parameters_as_bucket_view(true), stage2 ? &ddp.reducer() : nullptr);
    const auto& shards = opt->shards();
    // Some parameter is cut between two ranks (a slice starting inside it).
    bool cut = false;
    for (int r = 0; r < world; ++r) {
      for (const auto& s : shards.layout().slices_of(r)) cut |= s.begin > 0;
    }
    REQUIRE(cut);
    train(ddp, *opt, [&] {
      for (const auto& t : shards.param_slices()) REQUIRE(aligned16(t));
      const auto grads =
          stage2 ? shards.slices_of_pieces(ddp.reducer().grad_pieces()) : shards.grad_slices();
      REQUIRE(grads.size() == shards.slices().size());
      for (const auto& g : grads) {
        REQUIRE(g.defined());
        REQUIRE(aligned16(g));
      }
    });
    REQUIRE(max_diff(float_params(net), float_params(ref)) <= kTol);
    if (!stage2 || same_sums) REQUIRE(max_diff(bf16_params(net), bf16_params(ref)) == 0);
  }
}

void worker_mismatch(const c10::intrusive_ptr<c10d::ProcessGroup>& group, int rank, int world) {
  auto net = make_net(1, rank == world - 1 ? 6 : 5);
  const auto t0 = Clock::now();
  REQUIRE_THROWS_WITH(dist::DistributedDataParallel<torch::nn::Sequential>(net, group),
                      Contains("\"4.weight\"") && Contains("[5, 41]") && Contains("[6, 41]") &&
                          Contains("rank " + std::to_string(world - 1)));
  REQUIRE(std::chrono::duration<double>(Clock::now() - t0).count() < kGroupTimeoutMs / 2000.0);
}

// The last rank exits in the middle of step 3's backward (after the first
// buckets' allreduces started); the others' backward must throw an error
// naming the failed allreduce within the group's timeout.
void worker_dead(const c10::intrusive_ptr<c10d::ProcessGroup>& group, int rank, int world) {
  auto net = make_net(100);
  dist::DistributedDataParallel<torch::nn::Sequential> ddp(net, group, uneven_options());
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05));
  for (int step = 0; step < 6; ++step) {
    auto [x, y] = batch(step, 8 * world, 7, 5);
    opt.zero_grad();
    if (step == 3 && rank == world - 1) {
      // The first layer's weight gets its gradient last.
      net->parameters()[0].register_hook([](const at::Tensor&) -> at::Tensor {
        std::fflush(nullptr);
        std::_Exit(7);
      });
    }
    auto loss = torch::mse_loss(ddp.forward(shard(x, rank, world)), shard(y, rank, world));
    if (step < 3) {
      loss.backward();
      opt.step();
      continue;
    }
    const auto t0 = Clock::now();
    REQUIRE_THROWS_WITH(loss.backward(),
                        Contains("DistributedDataParallel") && Contains("allreduce"));
    const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
    INFO("rank " << rank << " failed after " << waited << " s");
    REQUIRE(waited <= kGroupTimeoutMs / 1000.0 + 5);
    // Skip the group's destructors: their peer is gone.
    std::fflush(nullptr);
    std::_Exit(0);
  }
  FAIL("rank " << rank << " trained past the dead rank");
}

// Note [Shared-memory allreduce]: the group of ranks on one host reduces
// dense CPU tensors through shared memory. Every dtype and op it takes, at
// sizes around the chunk (one 2 MiB slot a rank) and the cache-line split of
// a chunk among the ranks, against torch's own ops applied in rank order
// (16-bit types in float32, rounded once), bit for bit; and what it hands to
// gloo (AVG) is gloo's as before.
void worker_shared_memory(const c10::intrusive_ptr<c10d::ProcessGroup>& group, int rank,
                          int world) {
  REQUIRE(dist::uses_shared_memory(group));
  using Op = c10d::ReduceOp;
  const auto apply = [](Op::RedOpType op, const at::Tensor& a, const at::Tensor& b) {
    switch (op) {
      case Op::SUM: return a + b;
      case Op::PRODUCT: return a * b;
      case Op::MIN: return at::minimum(a, b);
      case Op::AVG: return a + b;  // divided at the end
      default: return at::maximum(a, b);
    }
  };
  // Rank r's input: the same on every rank for a given (r, n, dtype, op).
  const auto input = [](int r, int64_t n, at::ScalarType dtype, Op::RedOpType op) {
    at::Generator gen = at::detail::createCPUGenerator(1000 * r + n % 997 + 7 * op);
    if (at::isIntegralType(dtype, false)) {
      const int64_t hi = op == Op::PRODUCT ? 4 : 100000;
      return at::randint(-hi, hi, {n}, gen, at::TensorOptions().dtype(dtype));
    }
    at::Tensor x = at::randn({n}, gen, at::TensorOptions().dtype(at::kDouble));
    if (op == Op::PRODUCT) x = x.abs().add_(0.5);  // products stay in range
    if (n > 5) x[n / 3] = r == 1 ? std::nan("") : 1.0;  // a NaN on one rank
    return x.to(dtype);
  };
  const int64_t chunk_floats = (2 << 20) / 4;
  const std::vector<int64_t> sizes{1, 5, 17, 4099, chunk_floats - 3, chunk_floats + 17,
                                   2 * chunk_floats + 1000};
  for (at::ScalarType dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kInt, at::kLong}) {
    const bool narrow = dtype == at::kBFloat16 || dtype == at::kHalf;
    for (Op::RedOpType op : {Op::SUM, Op::PRODUCT, Op::MIN, Op::MAX, Op::AVG}) {
      if (op == Op::AVG && at::isIntegralType(dtype, false)) continue;  // gloo's error, below
      for (int64_t n : sizes) {
        INFO("dtype " << dtype << ", op " << static_cast<int>(op) << ", " << n << " elements");
        at::Tensor expected = input(0, n, dtype, op);
        if (narrow) expected = expected.to(at::kFloat);
        for (int r = 1; r < world; ++r) {
          const at::Tensor x = input(r, n, dtype, op);
          expected = apply(op, expected, narrow ? x.to(at::kFloat) : x);
        }
        expected = expected.to(dtype);
        if (op == Op::AVG) expected.div_(world);  // gloo's AVG: the sum, divided in place
        std::vector<at::Tensor> t{input(rank, n, dtype, op)};
        c10d::AllreduceOptions opts;
        opts.reduceOp = op;
        group->allreduce(t, opts)->wait();
        REQUIRE(t[0].dtype() == expected.dtype());
        // Equal, NaN where expected has NaN (equal_nan compares the bits of
        // everything else exactly at zero tolerance).
        REQUIRE(at::allclose(t[0], expected, 0.0, 0.0, /*equal_nan=*/true));
      }
    }
  }
  // Empty; a strided view reduces its own elements only (gloo's TCP path
  // reduces the first numel() elements of memory instead); AVG of integers
  // is gloo's error still.
  std::vector<at::Tensor> empty{at::empty({0})};
  group->allreduce(empty)->wait();
  at::Tensor base = at::full({10}, static_cast<float>(rank + 1));
  std::vector<at::Tensor> strided{base.slice(0, 0, 10, 2)};
  group->allreduce(strided)->wait();
  REQUIRE(at::equal(base.slice(0, 0, 10, 2), at::full({5}, world * (world + 1) / 2.0F)));
  REQUIRE(at::equal(base.slice(0, 1, 10, 2), at::full({5}, static_cast<float>(rank + 1))));
  c10d::AllreduceOptions avg;
  avg.reduceOp = Op::AVG;
  std::vector<at::Tensor> ints{at::ones({4}, at::kLong)};
  REQUIRE_THROWS(group->allreduce(ints, avg)->wait());
}

// A rank that exits before an allreduce: the others fail at once, naming it,
// and every later allreduce fails alike.
void worker_shared_memory_dead(const c10::intrusive_ptr<c10d::ProcessGroup>& group, int rank,
                               int world) {
  REQUIRE(dist::uses_shared_memory(group));
  std::vector<at::Tensor> t{at::ones({1000})};
  group->allreduce(t)->wait();
  if (rank == world - 1) {
    std::fflush(nullptr);
    std::_Exit(7);
  }
  const auto t0 = Clock::now();
  REQUIRE_THROWS_WITH(group->allreduce(t)->wait(),
                      Contains("lost rank " + std::to_string(world - 1)) && Contains("exited"));
  REQUIRE(std::chrono::duration<double>(Clock::now() - t0).count() < kGroupTimeoutMs / 1000.0 / 2);
  REQUIRE_THROWS_WITH(group->allreduce(t)->wait(), Contains("exited"));
  // Stay a while: a survivor that left early would be the rank another one
  // names as lost.
  std::this_thread::sleep_for(std::chrono::seconds(1));
  std::fflush(nullptr);
  std::_Exit(0);  // skip the group's teardown: a peer is gone
}

}  // namespace

// ------------------------------------------------------------------- worker

TEST_CASE("ddp_worker", "[.ddp_worker]") {
  const char* scenario = std::getenv("FUSETRAIN_DDP_SCENARIO");
  if (scenario == nullptr) return;  // only meaningful when spawned by the tests below
  torch::set_num_threads(1);
  const auto env = dist::Environment::from_env();
  REQUIRE(env.has_value());
  dist::ProcessGroupOptions options;
  options.backend = "gloo";
  options.timeout = std::chrono::milliseconds(kGroupTimeoutMs);
  // "<scenario>/gloo": every collective over gloo's TCP, none through shared memory.
  std::string name = scenario;
  const std::string gloo_only = "/gloo";
  if (name.size() > gloo_only.size() && name.compare(name.size() - gloo_only.size(), gloo_only.size(), gloo_only) == 0) {
    name.resize(name.size() - gloo_only.size());
    options.shared_memory = false;
  }
  auto group = dist::init_process_group(*env, options);
  REQUIRE(dist::uses_shared_memory(group) == options.shared_memory);
  if (name == "equivalence") {
    worker_equivalence(group, env->rank, env->world_size);
  } else if (name == "no_sync") {
    worker_no_sync(group, env->rank, env->world_size);
  } else if (name == "mismatch") {
    worker_mismatch(group, env->rank, env->world_size);
  } else if (name == "dead") {
    worker_dead(group, env->rank, env->world_size);
  } else if (name == "zero") {
    worker_zero(group, env->rank, env->world_size);
  } else if (name == "aligned") {
    worker_aligned(group, env->rank, env->world_size);
  } else if (name == "join") {
    worker_join(group, env->rank, env->world_size);
  } else if (name == "shared_memory") {
    worker_shared_memory(group, env->rank, env->world_size);
  } else if (name == "shared_memory_dead") {
    worker_shared_memory_dead(group, env->rank, env->world_size);
  } else {
    FAIL("unknown scenario " << name);
  }
  // Every rank done with every collective before any leaves (a peer's
  // teardown must not break a collective still in flight).
  std::vector<at::Tensor> token{at::zeros({1})};
  group->allreduce(token)->wait();
}

// -------------------------------------------------------------- multi-process

TEST_CASE("DDP over gloo equals one process on the full batch, from diverged parameters",
          "[dist][ddp]") {
  for (int world : {2, 3}) {
    for (const std::string transport : {"", "/gloo"}) {
      INFO("world size " << world << (transport.empty() ? ", shared memory" : ", gloo only"));
      require_exit_codes(spawn_world(world, "equivalence" + transport));
    }
  }
}

TEST_CASE("DDP no_sync accumulation equals one large batch", "[dist][ddp]") {
  for (int world : {2, 3}) {
    INFO("world size " << world);
    require_exit_codes(spawn_world(world, "no_sync"));
  }
}

TEST_CASE("DDP join(): uneven inputs equal one process, every rank ends with the same model",
          "[dist][ddp]") {
  for (int world : {2, 3}) {
    INFO("world size " << world);
    require_exit_codes(spawn_world(world, "join"));
  }
}

TEST_CASE("ZeroRedundancyOptimizer stages 1 and 2 equal unsharded DDP; state is total / N",
          "[dist][zero]") {
  for (int world : {2, 3}) {
    INFO("world size " << world);
    require_exit_codes(spawn_world(world, "zero"));
  }
}

TEST_CASE("Optimizer views of DDP buckets and ZeRO shards are 16-byte aligned, results unchanged",
          "[dist][ddp][zero]") {
  for (int world : {2, 3}) {
    for (const std::string transport : {"", "/gloo"}) {
      INFO("world size " << world << (transport.empty() ? ", shared memory" : ", gloo only"));
      require_exit_codes(spawn_world(world, "aligned" + transport));
    }
  }
}

TEST_CASE("ShardLayout: equal padded pieces per bucket, parameters split at their edges",
          "[zero]") {
  // float32. Bucket 0: params 2 (10) and 0 (7) at 12 (16-byte aligned) = 19
  // elements; bucket 1: param 1 (40).
  const dist::ShardLayout layout({7, 40, 10}, {4, 4, 4}, {{2, 0}, {1}}, 3);
  const int64_t a = dist::kShardAlignment;
  REQUIRE(layout.bucket_numel(0) == 19);
  REQUIRE(layout.piece_numel(0) == a);  // ceil(19 / 3) = 7, rounded up to the alignment
  REQUIRE(layout.piece_numel(1) == ((40 + 2) / 3 + a - 1) / a * a);
  REQUIRE(layout.offset_of(2) == 0);
  REQUIRE(layout.offset_of(0) == 12);
  // Every element of every parameter is owned exactly once, in order.
  std::vector<std::vector<int>> owner{std::vector<int>(7, -1), std::vector<int>(40, -1),
                                      std::vector<int>(10, -1)};
  for (int r = 0; r < 3; ++r) {
    for (const auto& s : layout.slices_of(r)) {
      REQUIRE(s.length > 0);
      REQUIRE(s.piece_offset + s.length <= layout.piece_numel(s.bucket));
      REQUIRE(layout.offset_of(s.param) + s.begin == r * layout.piece_numel(s.bucket) + s.piece_offset);
      for (int64_t e = s.begin; e < s.begin + s.length; ++e) {
        REQUIRE(owner[s.param][e] == -1);
        owner[s.param][e] = r;
      }
    }
  }
  for (const auto& o : owner) {
    for (int r : o) REQUIRE(r >= 0);
  }
  // 19 elements in pieces of 16: rank 0 owns all of param 2 and 4 of param 0
  // (the 2 padding elements between them belong to no slice).
  const auto r0 = layout.slices_of(0);
  REQUIRE(r0[0].param == 2);
  REQUIRE(r0[0].length == 10);
  REQUIRE(r0[1].param == 0);
  REQUIRE(r0[1].length == 4);
  REQUIRE(r0[1].piece_offset == 12);
  REQUIRE_THROWS_WITH(dist::ShardLayout({3, 4}, {4, 4}, {{0}}, 2), Contains("in no bucket"));
  REQUIRE_THROWS_WITH(dist::ShardLayout({3, 4}, {4, 2}, {{0, 1}}, 2),
                      Contains("mixes element sizes"));
}

TEST_CASE("ShardLayout: every slice starts 16-byte aligned in its piece, bucket and parameter",
          "[zero]") {
  // Odd sizes in every element size, cut by 1 to 5 ranks: the alignment the
  // fused optimizers' vector path needs on every rank's views.
  const std::vector<int64_t> odd{3, 5, 7, 1, 33, 2, 129, 0, 17};
  for (const int64_t size : {1, 2, 4, 8}) {
    std::vector<int64_t> numels, sizes;
    std::vector<std::vector<size_t>> buckets(2);
    for (size_t k = 0; k < odd.size(); ++k) {
      numels.push_back(odd[k]);
      sizes.push_back(size);
      buckets[k % 2].push_back(k);
    }
    for (int world = 1; world <= 5; ++world) {
      INFO(size << "-byte elements, world " << world);
      const dist::ShardLayout layout(numels, sizes, buckets, world);
      for (size_t i = 0; i < numels.size(); ++i) REQUIRE(layout.offset_of(i) * size % 16 == 0);
      int64_t owned = 0;
      for (int r = 0; r < world; ++r) {
        for (const auto& s : layout.slices_of(r)) {
          REQUIRE(s.piece_offset * size % 16 == 0);
          REQUIRE(s.begin * size % 16 == 0);
          REQUIRE((layout.offset_of(s.param) + s.begin) * size % 16 == 0);
          REQUIRE(layout.offset_of(s.param) + s.begin ==
                  r * layout.piece_numel(s.bucket) + s.piece_offset);
          owned += s.length;
        }
      }
      REQUIRE(owned == std::accumulate(odd.begin(), odd.end(), int64_t{0}));
    }
  }
}

TEST_CASE("Ranks on one host allreduce through shared memory: every dtype and op, bit for bit",
          "[dist][shm]") {
  for (int world : {2, 3}) {
    INFO("world size " << world);
    require_exit_codes(spawn_world(world, "shared_memory"));
  }
}

TEST_CASE("Shared-memory allreduce: a rank that exits fails the others at once, naming it",
          "[dist][shm]") {
  for (int world : {2, 3}) {
    INFO("world size " << world);
    require_exit_codes(spawn_world(world, "shared_memory_dead"), {{world - 1, 7}});
  }
}

TEST_CASE("DDP with mismatched parameter shapes raises on every rank", "[dist][ddp]") {
  for (int world : {2, 3}) {
    INFO("world size " << world);
    require_exit_codes(spawn_world(world, "mismatch"));
  }
}

TEST_CASE("DDP: a rank that dies makes the others fail within the timeout", "[dist][ddp]") {
  for (int world : {2, 3}) {
    INFO("world size " << world);
    const auto t0 = Clock::now();
    require_exit_codes(spawn_world(world, "dead"), {{world - 1, 7}});
    REQUIRE(std::chrono::duration<double>(Clock::now() - t0).count() < kLaunchDeadlineS);
  }
}

// ------------------------------------------------------------- one process

namespace {

std::vector<at::Tensor> tensors_of_sizes(const std::vector<std::pair<int64_t, at::ScalarType>>& s) {
  std::vector<at::Tensor> out;
  for (const auto& [n, dtype] : s) out.push_back(at::empty({n}, at::TensorOptions().dtype(dtype)));
  return out;
}

using Layout = std::vector<std::vector<size_t>>;

}  // namespace

TEST_CASE("compute_bucket_offsets: each parameter 16-byte aligned, gaps under 16 bytes",
          "[dist][ddp]") {
  using dist::compute_bucket_offsets;
  using Offsets = std::vector<int64_t>;
  // float32 (4 elements to 16 bytes), bfloat16 (8), uint8 (16), float64 (2),
  // complex128 (16-byte elements: no padding); the last entry is the end.
  REQUIRE(compute_bucket_offsets({3, 5, 7}, 4) == Offsets{0, 4, 12, 19});
  REQUIRE(compute_bucket_offsets({3, 5, 7}, 2) == Offsets{0, 8, 16, 23});
  REQUIRE(compute_bucket_offsets({3, 5, 7}, 1) == Offsets{0, 16, 32, 39});
  REQUIRE(compute_bucket_offsets({3, 5, 7}, 8) == Offsets{0, 4, 10, 17});
  REQUIRE(compute_bucket_offsets({3, 5, 7}, 16) == Offsets{0, 3, 8, 15});
  // Already aligned sizes: no padding, the layout of end-to-end parameters.
  REQUIRE(compute_bucket_offsets({4, 8, 12}, 4) == Offsets{0, 4, 12, 24});
  // An empty parameter takes no room.
  REQUIRE(compute_bucket_offsets({3, 0, 1}, 4) == Offsets{0, 4, 4, 5});
  REQUIRE(compute_bucket_offsets({}, 4) == Offsets{0});
  const std::vector<int64_t> odd{1, 3, 5, 7, 9, 11, 13, 278011, 2, 17};
  for (const int64_t size : {1, 2, 4, 8, 16}) {
    const Offsets o = compute_bucket_offsets(odd, size);
    REQUIRE(o.size() == odd.size() + 1);
    REQUIRE(o.back() == o[odd.size() - 1] + odd.back());
    for (size_t k = 0; k < odd.size(); ++k) {
      INFO(size << "-byte elements, parameter " << k);
      REQUIRE(o[k] * size % 16 == 0);
      if (k > 0) {
        const int64_t gap = (o[k] - o[k - 1] - odd[k - 1]) * size;
        REQUIRE(gap >= 0);
        REQUIRE(gap < 16);
      }
    }
  }
  CHECK_THROWS_WITH(compute_bucket_offsets({3}, 0), Contains("element_size"));
}

TEST_CASE("compute_bucket_assignment", "[dist][ddp]") {
  using dist::compute_bucket_assignment;
  const auto f = at::kFloat, d = at::kDouble;
  // Reverse order, one bucket when everything fits.
  REQUIRE(compute_bucket_assignment(tensors_of_sizes({{10, f}, {10, f}, {10, f}, {10, f}}), 1 << 20,
                                    1 << 20) == Layout{{3, 2, 1, 0}});
  // First cap (80 bytes: exactly two 40-byte params), then the cap (120 bytes).
  REQUIRE(compute_bucket_assignment(
              tensors_of_sizes({{10, f}, {10, f}, {10, f}, {10, f}, {10, f}, {10, f}}), 80, 120) ==
          Layout{{5, 4}, {3, 2, 1}, {0}});
  REQUIRE(compute_bucket_assignment(tensors_of_sizes({{10, f}, {10, f}, {10, f}, {10, f}}), 79,
                                    1 << 20) == Layout{{3}, {2, 1, 0}});
  // A parameter larger than the cap gets a bucket of its own.
  REQUIRE(compute_bucket_assignment(tensors_of_sizes({{10, f}, {100, f}, {10, f}, {10, f}}), 80,
                                    80) == Layout{{3, 2}, {1}, {0}});
  // A dtype change starts a new bucket.
  REQUIRE(compute_bucket_assignment(tensors_of_sizes({{10, f}, {10, f}, {10, d}, {10, f}}), 1 << 20,
                                    1 << 20) == Layout{{3}, {2}, {1, 0}});
  REQUIRE(compute_bucket_assignment({}, 80, 80).empty());
  // An explicit order (the rebuild after the first backward): same caps.
  const auto four = tensors_of_sizes({{10, f}, {10, f}, {10, f}, {10, f}});
  REQUIRE(compute_bucket_assignment(four, 80, 120, {1, 0, 3, 2}) == Layout{{1, 0}, {3, 2}});
  CHECK_THROWS_WITH(compute_bucket_assignment(four, 80, 120, {1, 0, 3}), Contains("3 entries"));
  CHECK_THROWS_WITH(compute_bucket_assignment(four, 80, 120, {1, 1, 3, 2}),
                    Contains("not a permutation"));
}

TEST_CASE("Environment::from_env reads the torchrun variables", "[dist][ddp]") {
  // Only checks parsing of values handed in; the variables are restored after.
  const char* names[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                         "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"};
  std::map<std::string, std::string> saved;
  for (const char* n : names) {
    if (const char* v = std::getenv(n)) saved[n] = v;
    ::unsetenv(n);
  }
  REQUIRE_FALSE(dist::Environment::from_env().has_value());
  ::setenv("RANK", "2", 1);
  ::setenv("WORLD_SIZE", "4", 1);
  ::setenv("MASTER_PORT", "12345", 1);
  auto env = dist::Environment::from_env();
  REQUIRE(env.has_value());
  CHECK(env->rank == 2);
  CHECK(env->world_size == 4);
  CHECK(env->local_rank == 2);
  CHECK(env->master_addr == "127.0.0.1");
  CHECK(env->master_port == 12345);
  CHECK_FALSE(env->agent_store);
  CHECK(env->restart_count == 0);
  ::setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);  // torchrun's agent hosts the store
  CHECK(dist::Environment::from_env()->agent_store);
  ::setenv("TORCHELASTIC_RESTART_COUNT", "3", 1);  // torchrun restarted the group 3 times
  CHECK(dist::Environment::from_env()->restart_count == 3);
  ::setenv("TORCHELASTIC_RESTART_COUNT", "-1", 1);
  CHECK_THROWS_WITH(dist::Environment::from_env(), Contains("TORCHELASTIC_RESTART_COUNT"));
  ::unsetenv("TORCHELASTIC_RESTART_COUNT");
  ::setenv("RANK", "4", 1);
  CHECK_THROWS_WITH(dist::Environment::from_env(), Contains("RANK"));
  ::setenv("RANK", "x1", 1);
  CHECK_THROWS_WITH(dist::Environment::from_env(), Contains("RANK"));
  for (const char* n : names) ::unsetenv(n);
  for (const auto& [k, v] : saved) ::setenv(k.c_str(), v.c_str(), 1);
}

TEST_CASE("gloo binds the address that routes to the master, or GLOO_SOCKET_IFNAME's interfaces",
          "[dist]") {
  std::string saved;
  const bool had = std::getenv("GLOO_SOCKET_IFNAME") != nullptr;
  if (had) saved = std::getenv("GLOO_SOCKET_IFNAME");
  ::unsetenv("GLOO_SOCKET_IFNAME");
  // A loopback master is reached from a loopback address, whatever the
  // hostname resolves to; 127.0.0.2 is a different address of lo.
  CHECK(dist::local_address_towards("127.0.0.2", 29500) == "127.0.0.1");
  auto t = dist::gloo_transport_for("127.0.0.1", 29500);
  CHECK(t.interfaces.empty());
  CHECK(t.address == "127.0.0.1");
  CHECK_THROWS_WITH(dist::local_address_towards("no-such-host.invalid", 1),
                    Contains("MASTER_ADDR=no-such-host.invalid"));
  ::setenv("GLOO_SOCKET_IFNAME", "eth0,,ib1", 1);  // torch splits at commas, empty names dropped
  t = dist::gloo_transport_for("127.0.0.1", 29500);
  CHECK(t.interfaces == std::vector<std::string>{"eth0", "ib1"});
  CHECK_THAT(t.describe(), Contains("eth0,ib1"));
  ::setenv("GLOO_SOCKET_IFNAME", ",", 1);
  CHECK_THROWS_WITH(dist::gloo_transport_for("127.0.0.1", 29500), Contains("GLOO_SOCKET_IFNAME"));
  ::unsetenv("GLOO_SOCKET_IFNAME");
  if (had) ::setenv("GLOO_SOCKET_IFNAME", saved.c_str(), 1);
}

TEST_CASE("StoreHost serves only the address it is given", "[dist]") {
  const dist::StoreHost host(std::chrono::seconds(5), "127.0.0.2", 0);
  REQUIRE(host.port() > 0);
  c10d::TCPStoreOptions client;
  client.port = static_cast<std::uint16_t>(host.port());
  client.isServer = false;
  client.waitWorkers = false;
  client.timeout = std::chrono::seconds(5);
  c10d::TCPStore joined("127.0.0.2", client);
  joined.set("k", std::vector<uint8_t>{1, 2});
  CHECK(joined.get("k") == std::vector<uint8_t>{1, 2});
  // Not on every interface: 127.0.0.1 (same lo, same port) refuses.
  client.timeout = std::chrono::milliseconds(1500);
  CHECK_THROWS(c10d::TCPStore("127.0.0.1", client));
  // The port is taken while the host lives.
  CHECK_THROWS_WITH(dist::StoreHost(std::chrono::seconds(1), "127.0.0.2", host.port()),
                    Contains("cannot host the rendezvous store"));
}

TEST_CASE("DDP on one gloo rank: state_dict keys carry module., module() is the model",
          "[dist][ddp]") {
  dist::Environment env;
  env.master_port = dist::free_port();
  dist::ProcessGroupOptions options;
  options.timeout = std::chrono::milliseconds(kGroupTimeoutMs);
  auto group = dist::init_process_group(env, options);
  auto net = torch::nn::Sequential(torch::nn::Linear(4, 3), torch::nn::BatchNorm1d(3));
  dist::DistributedDataParallel<torch::nn::Sequential> ddp(net, group);
  REQUIRE(ddp.module().ptr() == net.ptr());
  const auto sd = ddp.state_dict();
  std::vector<std::string> expected;
  for (const auto& p : net->named_parameters()) expected.push_back("module." + p.key());
  for (const auto& b : net->named_buffers()) expected.push_back("module." + b.key());
  REQUIRE(sd.keys() == expected);
  REQUIRE(sd["module.0.weight"].data_ptr() == net->named_parameters()["0.weight"].data_ptr());
  // World size 1: training equals plain training bit for bit.
  auto plain = torch::nn::Sequential(torch::nn::Linear(4, 3), torch::nn::BatchNorm1d(3));
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < plain->parameters().size(); ++i)
      plain->parameters()[i].copy_(net->parameters()[i]);
  }
  torch::optim::SGD o1(net->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD o2(plain->parameters(), torch::optim::SGDOptions(0.1));
  // CPU parameters: no side stream; nothing timed before the first backward.
  REQUIRE_FALSE(ddp.stream().has_value());
  REQUIRE(std::isnan(ddp.reducer().last_exposed_comm_seconds()));
  for (int step = 0; step < 5; ++step) {
    auto [x, y] = batch(step, 8, 4, 3);
    o1.zero_grad();
    torch::mse_loss(ddp.forward(x), y).backward();
    o1.step();
    o2.zero_grad();
    torch::mse_loss(plain->forward(x), y).backward();
    o2.step();
  }
  REQUIRE(max_diff(net->parameters(), plain->parameters()) == 0);
  const double exposed = ddp.reducer().last_exposed_comm_seconds();
  REQUIRE(exposed >= 0);
  REQUIRE(exposed < 10);
}

TEST_CASE("DDP over NCCL, world size 1, equals plain training", "[dist][ddp][cuda]") {
  REQUIRE_CUDA();
  REQUIRE(dist::nccl_available());  // every CUDA build has NCCL
  dist::Environment env;
  env.master_port = dist::free_port();
  dist::ProcessGroupOptions options;
  options.device_type = c10::DeviceType::CUDA;  // "auto" picks NCCL
  options.timeout = std::chrono::milliseconds(60000);
  auto group = dist::init_process_group(env, options);
  auto net = make_net(100);
  auto plain = make_net(100);
  net->to(torch::kCUDA);
  plain->to(torch::kCUDA);
  dist::DistributedDataParallel<torch::nn::Sequential> ddp(net, group, uneven_options());
  torch::optim::SGD o1(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD o2(plain->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int step = 0; step < 8; ++step) {
    auto [x, y] = batch(step, 16, 7, 5);
    x = x.cuda();
    y = y.cuda();
    o1.zero_grad();
    torch::mse_loss(ddp.forward(x), y).backward();
    o1.step();
    o2.zero_grad();
    torch::mse_loss(plain->forward(x), y).backward();
    o2.step();
  }
  torch::cuda::synchronize();
  REQUIRE(max_diff(net->parameters(), plain->parameters()) == 0);
}

TEST_CASE("DDP over NCCL captured by FusedSteps equals eager steps", "[dist][ddp][graph][cuda]") {
  // Note [DDP and CUDA graphs]: DDP constructed (and stepped) on the legacy
  // default stream; the reducer's side stream lets the backward be captured.
  REQUIRE_CUDA();
  REQUIRE(dist::nccl_available());
  dist::Environment env;
  env.master_port = dist::free_port();
  dist::ProcessGroupOptions options;
  options.device_type = c10::DeviceType::CUDA;
  options.timeout = std::chrono::milliseconds(60000);
  auto group = dist::init_process_group(env, options);
  std::vector<std::vector<at::Tensor>> data;
  for (int step = 0; step < 48; ++step) {
    auto [x, y] = batch(step, 16, 7, 5);
    data.push_back({x.cuda(), y.cuda()});
  }
  auto run = [&](bool graph) {
    auto net = make_net(100);
    net->to(torch::kCUDA);
    dist::DistributedDataParallel<torch::nn::Sequential> ddp(net, group, uneven_options());
    REQUIRE(ddp.stream().has_value());
    REQUIRE(*ddp.stream() != c10::Stream(c10::Stream::DEFAULT, ddp.stream()->device()));
    fusetrain::optim::FusedAdamW opt(net->parameters(), fusetrain::optim::FusedAdamWOptions(1e-2));
    fusetrain::amp::GradScaler scaler(torch::kCUDA,
                                      fusetrain::amp::GradScalerOptions().init_scale(1024.0).growth_interval(3));
    fusetrain::graph::StepFn step = [&](const std::vector<at::Tensor>& b) {
      opt.zero_grad(/*set_to_none=*/false);
      const at::Tensor loss = torch::mse_loss(ddp.forward(b[0]), b[1]);
      scaler.scale(loss).backward();
      scaler.step(opt);
      scaler.update();
      return loss.detach();
    };
    fusetrain::graph::FusedStepsOptions o;
    o.steps_per_execution = 4;
    o.use_cuda_graph = graph;
    fusetrain::graph::FusedSteps fused(step, data[0], o);
    std::vector<at::Tensor> losses;
    for (size_t i = 0; i < data.size(); i += 4) {
      losses.push_back(fused.run({data.begin() + i, data.begin() + i + 4}));
    }
    torch::cuda::synchronize();
    CHECK(fused.captured() == graph);
    // The last backward that ran on the host was the captured one: not timed.
    const double exposed = ddp.reducer().last_exposed_comm_seconds();
    if (graph) {
      CHECK(std::isnan(exposed));
    } else {
      CHECK(exposed >= 0);
      CHECK(exposed < 10);
    }
    std::vector<at::Tensor> params;
    for (const auto& p : net->parameters()) params.push_back(p.detach().cpu());
    return std::make_pair(torch::cat(losses).cpu(), params);
  };
  const auto eager = run(false);
  const auto graph = run(true);
  CHECK(torch::allclose(graph.first, eager.first, 1e-5, 1e-6));
  REQUIRE(max_diff(graph.second, eager.second) <= 1e-5);
}

TEST_CASE("C++ communication hooks on one gloo rank: names, errors, training", "[dist][ddp][hooks]") {
  dist::Environment env;
  env.master_port = dist::free_port();
  dist::ProcessGroupOptions options;
  options.timeout = std::chrono::milliseconds(kGroupTimeoutMs);
  auto group = dist::init_process_group(env, options);
  CHECK(dist::comm_hook_from_name("none", group) == nullptr);
  CHECK(dist::comm_hook_from_name("fp16", group)->name() == "fp16");
  CHECK(dist::comm_hook_from_name("powersgd", group, 2, 10)->name() == "powersgd");
  CHECK_THROWS_WITH(dist::comm_hook_from_name("int8", group),
                    Catch::Contains("choose none, allreduce, fp16, bf16 or powersgd"));
  CHECK_THROWS_WITH(dist::powersgd_hook(group, dist::PowerSGDOptions().start_powerSGD_iter(1)),
                    Catch::Contains("start_powerSGD_iter` > 1"));
  CHECK_THROWS_WITH(dist::compress_hook(group, at::kFloat), Catch::Contains("float16 or bfloat16"));

  // World size 1: every hook's average is the gradient itself (PowerSGD
  // once it compresses: a rank-r approximation of it), and a model trains.
  for (const std::string name : {"allreduce", "fp16", "bf16", "powersgd"}) {
    CAPTURE(name);
    auto net = make_net(3);
    dist::DistributedDataParallel<torch::nn::Sequential> ddp(net, group, uneven_options());
    ddp.register_comm_hook(dist::comm_hook_from_name(name, group, 2, 3));
    CHECK_THROWS_WITH(ddp.register_comm_hook(dist::allreduce_hook(group)),
                      Catch::Contains("can only be called once"));
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    std::vector<float> losses;
    for (int step = 0; step < 10; ++step) {
      auto [x, y] = batch(0, 16, 7, 5);  // one batch, to see the loss fall
      opt.zero_grad();
      const at::Tensor loss = torch::mse_loss(ddp.forward(x), y);
      loss.backward();
      if (name != "powersgd" && step == 0) {
        // Before any step the model is make_net(3)'s: gradients as without DDP.
        auto plain = make_net(3);
        torch::mse_loss(plain->forward(x), y).backward();
        const double tol = name == "allreduce" ? 0 : 1e-2;  // 16-bit round trip: 2^-8 relative
        for (size_t i = 0; i < plain->parameters().size(); ++i) {
          const at::Tensor g = plain->parameters()[i].grad();
          CHECK((net->parameters()[i].grad() - g).abs().max().item<double>() <=
                tol * g.abs().max().item<double>());
        }
      }
      opt.step();
      losses.push_back(loss.item<float>());
    }
    CHECK(losses.back() < 0.9f * losses.front());
  }
  auto net = make_net(3);
  dist::DistributedDataParallel<torch::nn::Sequential> late(net, group, uneven_options());
  auto [x, y] = batch(0, 16, 7, 5);
  torch::mse_loss(late.forward(x), y).backward();
  CHECK_THROWS_WITH(late.register_comm_hook(dist::allreduce_hook(group)),
                    Catch::Contains("before the first forward"));
}

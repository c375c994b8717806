// The training run and `fusetrain eval`.
//
// Note [Bitwise resumption]
// A resumed CPU run ends with the same parameters, bit for bit, as an
// uninterrupted one, because everything a step depends on is either in the
// checkpoint or a function of the step number:
//  - model parameters and buffers, optimizer moments, step counts and master
//    weights, and the loss scaler's state are saved and restored exactly;
//  - the learning rate is a function of the step;
//  - the data order is a function of (data.seed, epoch), and a step's batch
//    of its position in the epoch (BatchSampler);
//  - the random streams (dropout) are reseeded at every step from
//    (train.seed, rank, step), so no generator state has to travel between
//    ranks; the generator's state at save time is stored as well;
//  - logging, progress, evaluation and checkpointing read values but never
//    change the training state, and host synchronisation points
//    (steps_per_execution) change only when values are read.
// On CUDA with steps_per_execution > 1 the steps of an execution replay one
// CUDA graph: the learning rate comes from a device tensor written inside
// the graph, and random draws (dropout) follow one stream per execution,
// seeded from its first step; resumption stays exact at execution bounds.
#include "train.h"

#include "checkpoint.h"
#include "data.h"
#include "models.h"
#include "metrics.h"
#include "progress.h"

#include <fusetrain/amp/grad_scaler.h>
#include <fusetrain/amp/policy.h>
#include <fusetrain/graph/fused_steps.h>
#include <fusetrain/ops/optim.h>
#include <fusetrain/optim/fused.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <ATen/Parallel.h>
#include <torch/cuda.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <iostream>
#include <mutex>
#include <sstream>

namespace fusetrain::trainer {

namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kFormatVersion = 1;

// ------------------------------------------------------------------ helpers

at::Tensor scalar(int64_t v) { return at::scalar_tensor(v, at::kLong); }
at::Tensor scalar(double v) { return at::scalar_tensor(v, at::kDouble); }

at::Device device_of(const Config& config, int local_rank) {
  if (config.get_string("runtime.device") == "cuda") return at::Device(at::kCUDA, local_rank);
  return at::Device(at::kCPU);
}

/// Cross-entropy in float32 (a float32 island), logits [N, C] or [N, T, V].
at::Tensor loss_of(const at::Tensor& logits, const at::Tensor& targets,
                   at::Reduction::Reduction reduction = at::Reduction::Mean) {
  const amp::Float32Guard float32;
  const at::Tensor flat = logits.to(at::kFloat).reshape({-1, logits.size(-1)});
  return at::cross_entropy_loss(flat, targets.reshape({-1}), {}, reduction);
}

struct EvalResult {
  double loss = 0.0;
  double accuracy = 0.0;
  int64_t count = 0;
};

/// Test loss and accuracy (next-token accuracy for token data) over the
/// whole split, each rank taking a contiguous part; logits gathered into
/// `logits_out` (single process) when given.
EvalResult evaluate(ModelImpl& model, const Split& test, const Distributed& world,
                    const amp::Policy& policy, c10::DeviceType device_type, int64_t batch,
                    std::vector<at::Tensor>* logits_out = nullptr) {
  const bool was_training = model.is_training();
  model.eval();
  at::NoGradGuard no_grad;
  // Batch-norm statistics as rank 0 has them (the checkpoint's).
  world.broadcast_(model.buffers());
  const auto [begin, end] = eval_shard(test.size(), world.world_size(), world.rank());
  const at::Tensor sums =
      at::zeros({3}, at::TensorOptions().dtype(at::kDouble).device(test.inputs.device()));
  for (int64_t i = begin; i < end; i += batch) {
    const int64_t n = std::min(batch, end - i);
    const at::Tensor x = test.inputs.narrow(0, i, n);
    const at::Tensor y = test.targets.narrow(0, i, n);
    at::Tensor logits;
    {
      const amp::AutocastGuard autocast(device_type, policy);
      logits = model.forward(x);
    }
    const at::Tensor flat = logits.to(at::kFloat).reshape({-1, logits.size(-1)});
    const at::Tensor targets = y.reshape({-1});
    sums[0].add_(loss_of(logits, y, at::Reduction::Sum));
    sums[1].add_(flat.argmax(1).eq(targets).sum());
    sums[2].add_(targets.numel());
    if (logits_out != nullptr) logits_out->push_back(logits.to(at::kFloat).cpu());
  }
  world.allreduce_sum_(sums);
  const at::Tensor host = sums.cpu();
  const double* s = host.const_data_ptr<double>();
  if (was_training) model.train();
  EvalResult r;
  r.count = static_cast<int64_t>(s[2]);
  r.loss = r.count ? s[0] / s[2] : 0.0;
  r.accuracy = r.count ? s[1] / s[2] : 0.0;
  return r;
}

// ------------------------------------------------------------------ trainer

class Trainer {
 public:
  Trainer(const Config& config, const RunPlan& plan, const Distributed& world)
      : config_(config),
        plan_(plan),
        world_(world),
        device_(device_of(config, world.local_rank())),
        policy_(config.get_string("precision.policy")),
        rank0_(world.rank() == 0) {}

  int run();

 private:
  void build();
  void restore(const std::string& path);
  TensorDict snapshot();
  void save_checkpoint(const std::string& reason);
  double lr_at(int64_t step) const;
  void reseed(int64_t step);
  /// One step's inputs: the micro-batches' sample indices and the learning
  /// rate on the device, and the step number on the CPU.
  std::vector<at::Tensor> step_batch(int64_t step);
  /// One optimizer step over `batch` (see step_batch); returns its loss.
  at::Tensor step_body(const std::vector<at::Tensor>& batch);
  /// Steps [first, first + n): one fused execution when K > 1.
  void run_steps(int64_t first, int64_t n);
  void prepare_fused_steps(int64_t k);
  void clip_gradients();
  void log_window(int64_t step);
  /// Evaluates and writes an eval record; at an epoch's end (else for
  /// train.eval_every) also closes the epoch's training statistics.
  void end_epoch(int64_t step, bool epoch_end = true);
  /// The record's validation keys: val_loss, then val_accuracy
  /// (classification) or val_bits_per_token (and val_bits_per_byte for bytes).
  void add_validation(Record& record) const;
  void open_metrics();
  double elapsed_s() const;
  void write_metrics(const Record& record);
  void say(const std::string& text) {
    if (rank0_) progress_->line(text);
  }

  Config config_;
  RunPlan plan_;
  const Distributed& world_;
  at::Device device_;
  amp::Policy policy_;
  bool rank0_;

  Dataset data_;
  Model model_;
  std::unique_ptr<optim::FusedOptimizer> optimizer_;
  std::unique_ptr<amp::GradScaler> scaler_;
  std::unique_ptr<ParallelModel> parallel_;
  std::unique_ptr<BatchSampler> sampler_;
  std::unique_ptr<Progress> progress_;
  MetricsLog metrics_;
  // steps_per_execution > 1: K steps per execution, captured as a CUDA graph
  // on CUDA (graph_mode_), where the optimizer reads lr_device_.
  std::unique_ptr<graph::FusedSteps> fused_;
  bool graph_mode_ = false;
  at::Tensor lr_device_;

  int64_t step_ = 0;
  int64_t start_step_ = 0;
  int64_t total_steps_ = 0;
  int64_t steps_per_epoch_ = 0;
  int64_t skipped_before_ = 0;
  std::vector<at::Tensor> trainable_;
  // Device-side accumulators, read only at host synchronisation points.
  at::Tensor window_loss_;
  at::Tensor epoch_loss_;
  at::Tensor skipped_;
  int64_t window_steps_ = 0;
  int64_t epoch_steps_ = 0;
  double window_seconds_ = 0.0;
  double epoch_seconds_ = 0.0;
  Clock::time_point segment_start_;
  Clock::time_point run_start_;
  std::string last_checkpoint_;
  EvalResult last_eval_;
};

void Trainer::build() {
  const int64_t seed = config_.get_int("train.seed");
  torch::manual_seed(static_cast<uint64_t>(seed));
  data_ = load_dataset(config_, device_);
  model_ = make_model(config_, data_);
  model_->to(device_);
  if (config_.get_bool("precision.master_weights")) {
    cast_for_master_weights(model_, policy_.compute_dtype());
  }

  // Weight decay on weight matrices and kernels only: decaying biases and
  // normalisation scales towards zero only hurts.
  std::vector<at::Tensor> decay, no_decay;
  for (const auto& p : model_->parameters()) {
    if (!p.requires_grad()) continue;
    trainable_.push_back(p);
    (p.dim() >= 2 ? decay : no_decay).push_back(p);
  }
  const double lr = config_.get_float("optimizer.lr");
  const double wd = config_.get_float("optimizer.weight_decay");
  const bool master = config_.get_bool("precision.master_weights");
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (config_.get_string("optimizer.name") == "adamw") {
    optim::FusedAdamWOptions o(lr);
    o.betas({config_.get_float("optimizer.beta1"), config_.get_float("optimizer.beta2")})
        .eps(config_.get_float("optimizer.eps"))
        .weight_decay(wd)
        .master_weights(master);
    optim::FusedAdamWOptions o0 = o;
    o0.weight_decay(0.0);
    groups.emplace_back(decay, std::make_unique<optim::FusedAdamWOptions>(o));
    groups.emplace_back(no_decay, std::make_unique<optim::FusedAdamWOptions>(o0));
    optimizer_ = std::make_unique<optim::FusedAdamW>(std::move(groups), o);
  } else {
    optim::FusedSGDOptions o(lr);
    o.momentum(config_.get_float("optimizer.momentum"))
        .nesterov(config_.get_bool("optimizer.nesterov"))
        .weight_decay(wd)
        .master_weights(master);
    if (o.nesterov() && o.momentum() <= 0) {
      throw config_.error("optimizer.nesterov", "needs optimizer.momentum > 0");
    }
    optim::FusedSGDOptions o0 = o;
    o0.weight_decay(0.0);
    groups.emplace_back(decay, std::make_unique<optim::FusedSGDOptions>(o));
    groups.emplace_back(no_decay, std::make_unique<optim::FusedSGDOptions>(o0));
    optimizer_ = std::make_unique<optim::FusedSGD>(std::move(groups), o);
  }

  // Loss scaling only for float16: bfloat16 has float32's exponent range.
  amp::GradScalerOptions so;
  so.enabled(policy_.compute_dtype() == at::kHalf)
      .init_scale(config_.get_float("precision.init_scale"))
      .growth_interval(config_.get_int("precision.growth_interval"));
  scaler_ = std::make_unique<amp::GradScaler>(device_.type(), so);

  const int64_t batch = config_.get_int("data.batch_size");
  const int64_t per_epoch = data_.random_windows ? data_.samples_per_epoch : data_.train.size();
  steps_per_epoch_ = per_epoch / batch;
  if (steps_per_epoch_ == 0) {
    throw config_.error("data.batch_size", "is larger than the " + std::to_string(per_epoch) +
                                               (data_.random_windows ? " windows of an epoch"
                                                                     : " training samples"));
  }
  const int64_t max_steps = config_.get_int("train.max_steps");
  total_steps_ = max_steps > 0 ? max_steps : config_.get_int("train.epochs") * steps_per_epoch_;
  const auto data_seed = static_cast<uint64_t>(config_.get_int("data.seed"));
  const int64_t accum = config_.get_int("train.grad_accum");
  sampler_ = std::make_unique<BatchSampler>(
      data_.random_windows
          ? BatchSampler::random_windows(data_.train.size(), data_.samples_per_epoch, batch,
                                         world_.world_size(), world_.rank(), accum, data_seed, device_)
          : BatchSampler(data_.train.size(), batch, world_.world_size(), world_.rank(), accum,
                         data_seed, device_));

  const auto acc = at::TensorOptions().dtype(at::kFloat).device(device_);
  window_loss_ = at::zeros({1}, acc);
  epoch_loss_ = at::zeros({1}, acc);
  skipped_ = at::zeros({1}, acc);
}

// ------------------------------------------------------------------ checkpoints

TensorDict Trainer::snapshot() {
  TensorDict d;
  d.emplace_back("meta.format", scalar(kFormatVersion));
  d.emplace_back("config.yaml", text_tensor(config_.to_yaml()));
  d.emplace_back("config.name", text_tensor(config_.name()));
  d.emplace_back("trainer.step", scalar(step_));
  d.emplace_back("trainer.epoch", scalar(step_ / steps_per_epoch_));
  d.emplace_back("trainer.step_in_epoch", scalar(step_ % steps_per_epoch_));
  d.emplace_back("trainer.steps_per_epoch", scalar(steps_per_epoch_));
  d.emplace_back("trainer.batch_size", scalar(config_.get_int("data.batch_size")));
  d.emplace_back("trainer.world_size", scalar(static_cast<int64_t>(world_.world_size())));
  d.emplace_back("trainer.skipped",
                 scalar(skipped_before_ + static_cast<int64_t>(skipped_.item<float>())));
  d.emplace_back("data.mean", scalar(data_.mean));
  d.emplace_back("data.std", scalar(data_.std));
  // What load_checkpoint.py needs to rebuild a model on the user's data.
  d.emplace_back("data.input_shape", at::tensor(data_.input_shape, at::kLong));
  d.emplace_back("data.num_classes", at::scalar_tensor(data_.num_classes, at::kLong));
  d.emplace_back("rng.seed", scalar(config_.get_int("train.seed")));
  d.emplace_back("rng.cpu_state", at::detail::getDefaultCPUGenerator().get_state());
  for (const auto& p : model_->named_parameters()) d.emplace_back("model." + p.key(), p.value());
  for (const auto& b : model_->named_buffers()) d.emplace_back("model." + b.key(), b.value());

  const bool adamw = config_.get_string("optimizer.name") == "adamw";
  d.emplace_back("optim.name", text_tensor(config_.get_string("optimizer.name")));
  auto& state = optimizer_->state();
  for (const auto& p : model_->named_parameters()) {
    const auto it = state.find(p.value().unsafeGetTensorImpl());
    if (it == state.end()) continue;
    const std::string k = "optim." + p.key() + ".";
    auto put = [&](const char* field, const at::Tensor& t) {
      if (t.defined()) d.emplace_back(k + field, t);
    };
    if (adamw) {
      const auto& s = static_cast<const optim::FusedAdamWParamState&>(*it->second);
      put("step", s.step());
      put("exp_avg", s.exp_avg());
      put("exp_avg_sq", s.exp_avg_sq());
      put("max_exp_avg_sq", s.max_exp_avg_sq());
      put("master_param", s.master_param());
    } else {
      const auto& s = static_cast<const optim::FusedSGDParamState&>(*it->second);
      put("momentum_buffer", s.momentum_buffer());
      put("master_param", s.master_param());
    }
  }
  for (const auto& item : scaler_->state_dict()) {
    const c10::IValue& v = item.value();
    d.emplace_back("scaler." + item.key().toStringRef(),
                   v.isInt() ? scalar(v.toInt()) : scalar(v.toDouble()));
  }
  return d;
}

void Trainer::save_checkpoint(const std::string& reason) {
  if (!rank0_) return;
  const auto t0 = Clock::now();
  make_dirs(checkpoint_dir(plan_.run_dir));
  const std::string path =
      checkpoint_dir(plan_.run_dir) + "/" + format("step_%08ld.pt", static_cast<long>(step_));
  write_checkpoint(path, snapshot());
  last_checkpoint_ = path;
  // Keep the newest keep_checkpoints files; the one just written is among them.
  auto all = checkpoints_in(plan_.run_dir);
  const auto keep = static_cast<size_t>(config_.get_int("output.keep_checkpoints"));
  for (size_t i = 0; i + keep < all.size(); ++i) std::remove(all[i].second.c_str());
  if (reason != "quiet") {
    say(format("checkpoint %s (%s, %.1f s)", path.c_str(), reason.c_str(),
               std::chrono::duration<double>(Clock::now() - t0).count()));
  }
}

void Trainer::restore(const std::string& path) {
  const TensorDict ckpt = read_checkpoint(path);
  auto entry = [&](const std::string& k) -> const at::Tensor& {
    return checkpoint_entry(ckpt, k, path);
  };
  if (entry("meta.format").item<int64_t>() != kFormatVersion) {
    throw CheckpointError("checkpoint " + path + " has format " +
                          std::to_string(entry("meta.format").item<int64_t>()) + "; this build reads " +
                          std::to_string(kFormatVersion));
  }
  at::NoGradGuard no_grad;
  // Model: every parameter and buffer, with its shape; nothing extra.
  size_t model_entries = 0;
  for (const auto& item : ckpt) model_entries += item.first.rfind("model.", 0) == 0;
  size_t expected = 0;
  auto load = [&](const std::string& name, at::Tensor target) {
    ++expected;
    const std::string k = "model." + name;
    if (!has_entry(ckpt, k)) {
      throw CheckpointError("checkpoint " + path + " does not fit the configured model: it has no " +
                            name + " (was it written with other model.* settings?)");
    }
    const at::Tensor& t = entry(k);
    if (t.sizes() != target.sizes()) {
      std::ostringstream msg;
      msg << "checkpoint " << path << " does not fit the configured model: " << name
          << " has shape " << t.sizes() << " there and " << target.sizes()
          << " here (was it written with other model.* settings?)";
      throw CheckpointError(msg.str());
    }
    target.copy_(t);
  };
  for (const auto& p : model_->named_parameters()) load(p.key(), p.value());
  for (const auto& b : model_->named_buffers()) load(b.key(), b.value());
  if (model_entries != expected) {
    throw CheckpointError("checkpoint " + path + " holds " + std::to_string(model_entries) +
                          " model tensors but the configured model has " + std::to_string(expected) +
                          " (was it written with other model.* settings?)");
  }

  const std::string name = tensor_text(entry("optim.name"));
  if (name != config_.get_string("optimizer.name")) {
    throw config_.error("optimizer.name", "the checkpoint " + path + " was written with optimizer.name=" +
                                              name + "; its state cannot be resumed by another optimizer");
  }
  auto own = [&](const at::Tensor& t) { return t.to(device_, /*non_blocking=*/false, /*copy=*/true); };
  auto field = [&](const std::string& k) { return has_entry(ckpt, k) ? own(entry(k)) : at::Tensor(); };
  auto& state = optimizer_->state();
  for (const auto& p : model_->named_parameters()) {
    const std::string k = "optim." + p.key() + ".";
    if (name == "adamw") {
      if (!has_entry(ckpt, k + "exp_avg")) continue;
      auto s = std::make_unique<optim::FusedAdamWParamState>();
      s->step(field(k + "step"));
      s->exp_avg(field(k + "exp_avg"));
      s->exp_avg_sq(field(k + "exp_avg_sq"));
      s->max_exp_avg_sq(field(k + "max_exp_avg_sq"));
      s->master_param(field(k + "master_param"));
      state[p.value().unsafeGetTensorImpl()] = std::move(s);
    } else {
      if (!has_entry(ckpt, k + "momentum_buffer") && !has_entry(ckpt, k + "master_param")) continue;
      auto s = std::make_unique<optim::FusedSGDParamState>();
      s->momentum_buffer(field(k + "momentum_buffer"));
      s->master_param(field(k + "master_param"));
      state[p.value().unsafeGetTensorImpl()] = std::move(s);
    }
  }

  if (scaler_->is_enabled() && has_entry(ckpt, "scaler.scale")) {
    c10::impl::GenericDict sd(c10::StringType::get(), c10::AnyType::get());
    for (const auto& [k, t] : ckpt) {
      if (k.rfind("scaler.", 0) != 0) continue;
      const std::string key = k.substr(7);
      if (t.scalar_type() == at::kLong) {
        sd.insert(key, c10::IValue(t.item<int64_t>()));
      } else {
        sd.insert(key, c10::IValue(t.item<double>()));
      }
    }
    scaler_->load_state_dict(sd);
  }

  step_ = entry("trainer.step").item<int64_t>();
  skipped_before_ = entry("trainer.skipped").item<int64_t>();
  if (entry("trainer.batch_size").item<int64_t>() != config_.get_int("data.batch_size")) {
    say("warning: the checkpoint was written with data.batch_size=" +
        std::to_string(entry("trainer.batch_size").item<int64_t>()) +
        "; with another batch size the data order differs from the original run's");
  }
  at::Generator cpu_gen = at::detail::getDefaultCPUGenerator();
  cpu_gen.set_state(entry("rng.cpu_state"));
}

// ------------------------------------------------------------------ the step

double Trainer::lr_at(int64_t step) const {
  const double peak = config_.get_float("optimizer.lr");
  const int64_t warmup = config_.get_int("schedule.warmup_steps");
  if (step < warmup) return peak * static_cast<double>(step + 1) / static_cast<double>(warmup);
  if (config_.get_string("schedule.decay") == "none") return peak;
  const double min_ratio = config_.get_float("schedule.min_lr_ratio");
  const double progress = static_cast<double>(step - warmup) /
                          static_cast<double>(std::max<int64_t>(1, total_steps_ - warmup));
  const double pi = std::acos(-1.0);
  return peak * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + std::cos(pi * std::min(1.0, progress))));
}

void Trainer::reseed(int64_t step) {
  // See Note [Bitwise resumption]: one stream per (seed, rank, step).
  const uint64_t seed = mix_seed(mix_seed(static_cast<uint64_t>(config_.get_int("train.seed"))) ^
                                 mix_seed(static_cast<uint64_t>(world_.rank()) << 40 ^
                                          static_cast<uint64_t>(step)));
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(seed);
  }
  if (device_.is_cuda()) {
    at::Generator gen = at::globalContext().defaultGenerator(device_);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(seed);
  }
}

void Trainer::clip_gradients() {
  // The norm is of the true gradients: unscale first when scaling.
  if (scaler_->is_enabled()) scaler_->unscale_(*optimizer_);
  std::vector<at::Tensor> grads;
  for (const auto& p : trainable_) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  if (grads.empty()) return;
  const at::Tensor norm = std::get<0>(ops::multi_tensor_l2norm(grads));
  // No host sync: the coefficient stays on the device. An inf norm gives 0,
  // and a scaled step with inf gradients is skipped anyway.
  const at::Tensor coef = (config_.get_float("train.clip_grad_norm") / (norm + 1e-6)).clamp_max(1.0);
  for (auto& g : grads) g.mul_(coef);
}

std::vector<at::Tensor> Trainer::step_batch(int64_t step) {
  const int64_t epoch = step / steps_per_epoch_;
  const int64_t in_epoch = step % steps_per_epoch_;
  const int64_t accum = config_.get_int("train.grad_accum");
  std::vector<at::Tensor> batch;
  for (int64_t m = 0; m < accum; ++m) batch.push_back(sampler_->indices(epoch, in_epoch, m));
  // A fill kernel on the device, not a copy from the host.
  batch.push_back(at::scalar_tensor(lr_at(step), at::TensorOptions().dtype(at::kDouble).device(device_)));
  batch.push_back(scalar(step));
  return batch;
}

at::Tensor Trainer::step_body(const std::vector<at::Tensor>& batch) {
  const int64_t accum = config_.get_int("train.grad_accum");
  if (graph_mode_) {
    // Inside a CUDA graph host values are frozen: the optimizer reads the
    // learning rate from lr_device_, written here from this step's input.
    lr_device_.copy_(batch[accum]);
  } else {
    const int64_t step = batch[accum + 1].item<int64_t>();  // a CPU tensor: no sync
    const double lr = lr_at(step);
    for (auto& group : optimizer_->param_groups()) group.options().set_lr(lr);
    reseed(step);
  }
  optimizer_->zero_grad(/*set_to_none=*/true);
  at::Tensor step_loss = at::zeros({1}, window_loss_.options());
  for (int64_t m = 0; m < accum; ++m) {
    const at::Tensor& idx = batch[m];
    const at::Tensor x = data_.train.inputs.index_select(0, idx);
    const at::Tensor y = data_.train.targets.index_select(0, idx);
    // Gradients are averaged across ranks on the last micro-batch only.
    const std::shared_ptr<void> local_only = m + 1 < accum ? parallel_->no_sync() : nullptr;
    at::Tensor logits;
    {
      const amp::AutocastGuard autocast(device_.type(), policy_);
      logits = parallel_->forward(x);
    }
    const at::Tensor loss = loss_of(logits, y);
    const at::Tensor scaled = scaler_->scale(accum > 1 ? loss / static_cast<double>(accum) : loss);
    scaled.backward();
    step_loss.add_(loss.detach().reshape({1}), 1.0 / static_cast<double>(accum));
  }
  window_loss_.add_(step_loss);
  epoch_loss_.add_(step_loss);
  if (config_.get_float("train.clip_grad_norm") > 0) clip_gradients();
  scaler_->step(*optimizer_);
  if (scaler_->is_enabled()) skipped_.add_(scaler_->found_inf().ne(0).reshape({1}));
  scaler_->update();
  return step_loss;
}

void Trainer::prepare_fused_steps(int64_t k) {
  graph_mode_ = device_.is_cuda() && k > 1 && config_.get_bool("train.cuda_graphs");
  if (graph_mode_) {
    // No autocast cast cache across a capture (torch's advice for graphs):
    // each weight is cast once per forward anyway.
    at::autocast::set_autocast_cache_enabled(false);
    lr_device_ = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device_));
    optimizer_->set_lr_tensor(lr_device_);
  }
  if (k == 1) return;
  graph::FusedStepsOptions o;
  o.steps_per_execution = k;
  o.use_cuda_graph = graph_mode_;  // warm-up: FusedSteps' default, >= 11 eager steps
  fused_ = std::make_unique<graph::FusedSteps>(
      [this](const std::vector<at::Tensor>& batch) { return step_body(batch); }, step_batch(step_),
      o);
}

void Trainer::run_steps(int64_t first, int64_t n) {
  // With DDP on a device the steps (eager, captured, replayed) run on the
  // reducer's side stream, the one its gradient accumulators run on.
  const std::shared_ptr<void> on_stream = parallel_->on_ddp_stream();
  if (!fused_) {
    for (int64_t s = first; s < first + n; ++s) step_body(step_batch(s));
    return;
  }
  std::vector<std::vector<at::Tensor>> batches;
  for (int64_t s = first; s < first + n; ++s) batches.push_back(step_batch(s));
  // A graph replays its random draws from the generator's state at launch:
  // one stream per execution, a function of its first step.
  if (graph_mode_) reseed(first);
  fused_->run(batches);
}

// ------------------------------------------------------------------ metrics

void Trainer::open_metrics() {
  if (rank0_) metrics_.open(plan_.run_dir + "/metrics.jsonl", start_step_);
}

void Trainer::write_metrics(const Record& record) {
  if (rank0_) metrics_.write(record);
}

double Trainer::elapsed_s() const {
  return std::chrono::duration<double>(Clock::now() - run_start_).count();
}

void Trainer::log_window(int64_t step) {
  const at::Tensor sum = window_loss_.clone();
  world_.allreduce_sum_(sum);
  const double loss = sum.item<double>() / static_cast<double>(window_steps_ * world_.world_size());
  const double rate = static_cast<double>(window_steps_ * config_.get_int("data.batch_size")) /
                      std::max(1e-9, window_seconds_);
  const double lr = lr_at(step - 1);
  const double scale = scaler_->get_scale();
  const int64_t skipped = skipped_before_ + static_cast<int64_t>(skipped_.item<float>());
  const int64_t epoch = (step - 1) / steps_per_epoch_ + 1;
  write_metrics(Record{{"kind", "train"}, {"step", step}, {"epoch", epoch}, {"loss", loss},
                       {"lr", lr}, {"scale", scale}, {"skipped", skipped},
                       {"samples_per_s", rate}, {"accuracy", nullptr}, {"time_s", elapsed_s()}});
  if (rank0_ && !progress_->is_bar()) {
    say(format("  step %ld/%ld  loss %.4f  lr %.3g  %.0f samples/s", static_cast<long>(step),
               static_cast<long>(total_steps_), loss, lr, rate));
  }
  window_loss_.zero_();
  window_steps_ = 0;
  window_seconds_ = 0.0;
}

void Trainer::add_validation(Record& record) const {
  record["val_loss"] = last_eval_.loss;
  if (!data_.is_tokens) {
    record["val_accuracy"] = last_eval_.accuracy;
    return;
  }
  const double bits = last_eval_.loss / std::log(2.0);
  record["val_bits_per_token"] = bits;
  if (data_.byte_vocab) record["val_bits_per_byte"] = bits;
}

void Trainer::end_epoch(int64_t step, bool epoch_end) {
  const at::Tensor sum = epoch_loss_.clone();
  world_.allreduce_sum_(sum);
  const double loss = sum.item<double>() / static_cast<double>(std::max<int64_t>(1, epoch_steps_) * world_.world_size());
  const double rate = static_cast<double>(epoch_steps_ * config_.get_int("data.batch_size")) /
                      std::max(1e-9, epoch_seconds_);
  last_eval_ = evaluate(*model_, data_.test, world_, policy_, device_.type(),
                        config_.get_int("data.eval_batch_size"));
  const int64_t epoch = (step - 1) / steps_per_epoch_ + 1;
  const int64_t epochs = (total_steps_ + steps_per_epoch_ - 1) / steps_per_epoch_;
  const double lr = lr_at(step - 1);
  const double scale = scaler_->get_scale();
  const int64_t skipped = skipped_before_ + static_cast<int64_t>(skipped_.item<float>());
  if (epoch_end) {
    say(format("epoch %ld/%ld  loss %.4f  test loss %.4f  accuracy %.2f%%  %.0f samples/s  lr %.2e  "
               "scale %g  skipped %ld  (%s)",
               static_cast<long>(epoch), static_cast<long>(epochs), loss, last_eval_.loss,
               100.0 * last_eval_.accuracy, rate, lr, scale, static_cast<long>(skipped),
               duration_text(epoch_seconds_).c_str()));
  } else {
    say(format("  step %ld/%ld  validation loss %.4f  accuracy %.2f%%", static_cast<long>(step),
               static_cast<long>(total_steps_), last_eval_.loss, 100.0 * last_eval_.accuracy));
  }
  Record record{{"kind", "eval"}, {"step", step}, {"epoch", epoch}, {"loss", loss}, {"lr", lr},
                {"scale", scale}, {"skipped", skipped}, {"samples_per_s", rate},
                {"accuracy", last_eval_.accuracy}, {"test_loss", last_eval_.loss}};
  add_validation(record);
  record["time_s"] = elapsed_s();
  write_metrics(record);
  if (!epoch_end) return;
  epoch_loss_.zero_();
  epoch_steps_ = 0;
  epoch_seconds_ = 0.0;
}

// ------------------------------------------------------------------ run

int Trainer::run() {
  run_start_ = Clock::now();
  install_stop_handlers();
  const std::string& mode = config_.get_string("output.progress");
  progress_ = std::make_unique<Progress>(mode == "bar" || (mode == "auto" && ::isatty(STDOUT_FILENO)));
  build();
  if (!plan_.checkpoint.empty()) restore(plan_.checkpoint);
  start_step_ = step_;
  if (rank0_) {
    prepare_run_dir(config_, plan_);
    open_metrics();
  }
  dist::DDPOptions ddp;
  parallel_ = std::make_unique<ParallelModel>(
      model_, world_, ddp, config_.get_string("parallel.comm_hook"),
      config_.get_int("parallel.powersgd_rank"), config_.get_int("parallel.powersgd_start_iter"));

  const int64_t batch = config_.get_int("data.batch_size");
  const int64_t epochs = (total_steps_ + steps_per_epoch_ - 1) / steps_per_epoch_;
  say(format("fusetrain train: %s -> %s", config_.name().empty() ? "config" : config_.name().c_str(),
             plan_.run_dir.c_str()));
  say(format("  model %s (%ld parameters), %s: %ld train / %ld test samples",
             config_.get_string("model.name").c_str(), static_cast<long>(count_parameters(model_)),
             data_.description.c_str(), static_cast<long>(data_.train.size()),
             static_cast<long>(data_.test.size())));
  say(format("  %d rank%s on %s (%s), %d intra-op thread%s each; %s, %s, batch %ld (%ld per rank%s), "
             "%ld epoch%s = %ld steps",
             world_.world_size(), world_.world_size() == 1 ? "" : "s", device_.str().c_str(),
             world_.is_distributed() ? (device_.is_cuda() ? "nccl" : "gloo") : "no group",
             at::get_num_threads(), at::get_num_threads() == 1 ? "" : "s", policy_.name().c_str(),
             config_.get_string("optimizer.name").c_str(), static_cast<long>(batch),
             static_cast<long>(batch / world_.world_size()),
             config_.get_int("train.grad_accum") > 1
                 ? format(", %ld micro-batches", static_cast<long>(config_.get_int("train.grad_accum"))).c_str()
                 : "",
             static_cast<long>(epochs), epochs == 1 ? "" : "s", static_cast<long>(total_steps_)));
  if (start_step_ > 0) {
    say(format("  resumed from %s at step %ld (epoch %ld, batch %ld)", plan_.checkpoint.c_str(),
               static_cast<long>(start_step_), static_cast<long>(start_step_ / steps_per_epoch_ + 1),
               static_cast<long>(start_step_ % steps_per_epoch_)));
  }

  if (step_ >= total_steps_) {
    say(format("the checkpoint is at step %ld, the end of this run (%ld steps): nothing to train",
               static_cast<long>(step_), static_cast<long>(total_steps_)));
    return 0;
  }
  const int64_t k = config_.get_int("train.steps_per_execution");
  const int64_t log_every = config_.get_int("train.log_every");
  const int64_t ckpt_every = config_.get_int("output.checkpoint_every");
  const int64_t eval_every = config_.get_int("train.eval_every");
  int64_t last_eval_step = step_;
  int64_t last_log = step_, last_ckpt = step_;
  segment_start_ = Clock::now();
  const at::Tensor stop_flag = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device_));
  prepare_fused_steps(k);
  while (step_ < total_steps_) {
    // Host synchronisation points: every K steps of an epoch and at its end.
    // All decisions that involve collectives depend on the step alone, so
    // every rank takes them at the same point.
    const int64_t in_epoch = step_ % steps_per_epoch_;
    const int64_t n = std::min({k - in_epoch % k, steps_per_epoch_ - in_epoch, total_steps_ - step_});
    run_steps(step_, n);
    step_ += n;
    window_steps_ += n;
    epoch_steps_ += n;
    const bool epoch_end = step_ % steps_per_epoch_ == 0 || step_ == total_steps_;
    if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
    const auto now = Clock::now();
    const double elapsed = std::chrono::duration<double>(now - segment_start_).count();
    window_seconds_ += elapsed;
    epoch_seconds_ += elapsed;

    stop_flag.fill_(stop_requested() ? 1.0 : 0.0);
    world_.allreduce_max_(stop_flag);
    const bool stop = stop_flag.item<float>() > 0;

    if (rank0_ && progress_->is_bar()) {
      const int64_t in_epoch = (step_ - 1) % steps_per_epoch_ + 1;
      const double rate = static_cast<double>(epoch_steps_ * batch) / std::max(1e-9, epoch_seconds_);
      const double eta = static_cast<double>((steps_per_epoch_ - in_epoch) * batch) / std::max(1.0, rate);
      progress_->bar(bar_text((step_ - 1) / steps_per_epoch_ + 1, epochs, in_epoch, steps_per_epoch_,
                              epoch_loss_.item<float>() / static_cast<double>(std::max<int64_t>(1, epoch_steps_)),
                              rate, eta),
                     epoch_end);
    }
    if (step_ / log_every > last_log / log_every || step_ == total_steps_) {
      log_window(step_);
      last_log = step_;
    }
    if (epoch_end && !stop) {
      end_epoch(step_);
    } else if (eval_every > 0 && step_ / eval_every > last_eval_step / eval_every && !stop) {
      end_epoch(step_, /*epoch_end=*/false);
    }
    if (eval_every > 0) last_eval_step = step_;
    if (stop) {
      save_checkpoint("interrupted");
      say(format("interrupted at step %ld: continue with  fusetrain train --resume %s",
                 static_cast<long>(step_), last_checkpoint_.c_str()));
      world_.barrier();
      return 130;
    }
    if (ckpt_every > 0 && step_ / ckpt_every > last_ckpt / ckpt_every && step_ < total_steps_) {
      save_checkpoint("every " + std::to_string(ckpt_every) + " steps");
      last_ckpt = step_;
    }
    segment_start_ = Clock::now();
  }
  save_checkpoint("final");
  say(format("done: %ld steps in %s; test accuracy %.2f%%, test loss %.4f; checkpoint %s",
             static_cast<long>(total_steps_ - start_step_),
             duration_text(std::chrono::duration<double>(Clock::now() - run_start_).count()).c_str(),
             100.0 * last_eval_.accuracy, last_eval_.loss, last_checkpoint_.c_str()));
  world_.barrier();
  return 0;
}

}  // namespace

// ------------------------------------------------------------------ public

void check_before_start(const Config& config, int world_size, int local_world_size) {
  const int64_t batch = config.get_int("data.batch_size");
  const int64_t accum = config.get_int("train.grad_accum");
  if (batch % (world_size * accum) != 0) {
    throw config.error("data.batch_size",
                       "must be divisible by the world size " + std::to_string(world_size) +
                           (accum > 1 ? " x train.grad_accum " + std::to_string(accum) : "") +
                           " (each rank takes an equal share of every global batch)");
  }
  const bool cuda = config.get_string("runtime.device") == "cuda";
  if (cuda) {
    if (!torch::cuda::is_available()) {
      throw config.error("runtime.device", "no CUDA device is visible to this process "
                                           "(fusetrain info lists the devices); use --device cpu");
    }
    const int gpus = static_cast<int>(torch::cuda::device_count());
    if (local_world_size > gpus) {
      throw config.error("runtime.nproc", std::to_string(local_world_size) +
                                              " processes on this host need as many GPUs, and " +
                                              std::to_string(gpus) + " are visible (NCCL takes one GPU per rank)");
    }
  }
  const amp::Policy policy(config.get_string("precision.policy"));
  const c10::DeviceType type = cuda ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
  if (policy.is_mixed()) {
    const auto dtypes = amp::autocast_dtypes(type);
    if (std::find(dtypes.begin(), dtypes.end(), policy.compute_dtype()) == dtypes.end()) {
      std::string have;
      for (auto d : dtypes) have += std::string(have.empty() ? "" : ", ") + c10::toString(d);
      throw config.error("precision.policy", std::string(c10::DeviceTypeName(type, true)) +
                                                 " here cannot compute in " + c10::toString(policy.compute_dtype()) +
                                                 " (it autocasts to: " + (have.empty() ? "nothing" : have) +
                                                 "); use float32 or another mixed policy");
    }
  } else if (config.get_bool("precision.master_weights")) {
    throw config.error("precision.master_weights",
                       "needs a mixed policy (precision.policy=mixed_float16 or mixed_bfloat16)");
  }
  const std::string& model = config.get_string("model.name");
  const std::string& data = config.get_string("data.name");
  const bool tokens = data == "text" || data == "tokens" || data == "synthetic_tokens" ||
                      (data == "synthetic" && model == "gpt");
  if (model == "torchscript") {
    const std::string& path = config.get_string("model.path");
    if (path.empty()) throw config.error("model.path", "model.name=torchscript needs the module's file");
    if (!is_file(path)) throw config.error("model.path", "no such file");
  } else if ((model == "gpt") != tokens) {
    throw config.error("model.name", model == "gpt"
                                         ? "gpt trains on tokens: set data.name=tokens, text or synthetic"
                                         : model + " trains on images or feature vectors: set data.name=fashion_mnist, tensors or synthetic");
  }
  check_data_available(config);
}

int threads_for(const Config& config, int local_world_size) {
  const int64_t t = config.get_int("runtime.threads");
  if (t > 0) return static_cast<int>(t);
  return std::max(1, available_cores() / std::max(1, local_world_size));
}

int run_training(const Config& config, const RunPlan& plan, const Distributed& world) {
  Trainer trainer(config, plan, world);
  return trainer.run();
}

int run_eval(const std::string& checkpoint, const std::vector<std::string>& overrides,
             const std::string& predictions_path) {
  Config config = config_from_checkpoint(checkpoint);
  for (const auto& o : overrides) config.apply_override(o);
  check_before_start(config, 1, 1);
  const at::Device device = device_of(config, 0);
  const amp::Policy policy(config.get_string("precision.policy"));
  const Dataset data = load_dataset(config, device);
  Model model = make_model(config, data);
  model->to(device);
  const TensorDict ckpt = read_checkpoint(checkpoint);
  {
    at::NoGradGuard no_grad;
    for (const auto& p : model->named_parameters()) {
      p.value().copy_(checkpoint_entry(ckpt, "model." + p.key(), checkpoint));
    }
    for (const auto& b : model->named_buffers()) {
      b.value().copy_(checkpoint_entry(ckpt, "model." + b.key(), checkpoint));
    }
  }
  std::vector<at::Tensor> logits;
  const auto t0 = Clock::now();
  const EvalResult r = evaluate(*model, data.test, Distributed(), policy, device.type(),
                                config.get_int("data.eval_batch_size"),
                                predictions_path.empty() ? nullptr : &logits);
  std::cout << format("%s (step %ld): test loss %.4f  accuracy %.2f%%  (%ld %s, %s, %s)\n",
                      checkpoint.c_str(),
                      static_cast<long>(checkpoint_entry(ckpt, "trainer.step", checkpoint).item<int64_t>()),
                      r.loss, 100.0 * r.accuracy, static_cast<long>(r.count),
                      data.is_tokens ? "tokens" : "samples", policy.name().c_str(),
                      duration_text(std::chrono::duration<double>(Clock::now() - t0).count()).c_str());
  if (!predictions_path.empty()) {
    // The inputs as the model saw them (normalised images, or token ids), so
    // the predictions can be checked against a rebuilt model.
    write_checkpoint(predictions_path, {{"logits", at::cat(logits)},
                                        {"targets", data.test.targets.cpu()},
                                        {"inputs", data.test.inputs.cpu()}});
    std::cout << "predictions: " << predictions_path << "\n";
  }
  return 0;
}

}  // namespace fusetrain::trainer

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
//    (steps_per_execution, train.sync_every; Note [Host synchronisation
//    points]) change only when values are read.
// On CUDA with steps_per_execution > 1 the steps of an execution replay one
// CUDA graph: the learning rate comes from a device tensor written inside
// the graph, and random draws (dropout) follow one stream per execution,
// seeded from its first step; resumption stays exact at execution bounds.
#include "train.h"

#include "checkpoint.h"
#include "data.h"
#include "evaluate.h"
#include "format.h"
#include "loader.h"
#include "hf_models.h"
#include "models.h"
#include "metrics.h"
#include "progress.h"
#include "state.h"

#include <fusetrain/amp/grad_scaler.h>
#include <fusetrain/amp/float8_linear.h>
#include <fusetrain/amp/policy.h>
#include <fusetrain/graph/fused_steps.h>
#include <fusetrain/ops/optim.h>
#include <fusetrain/optim/fused.h>
#include <fusetrain/optim/zero.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <ATen/Parallel.h>
#include <torch/cuda.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <cstdio>
#include <mutex>

namespace fusetrain::trainer {

namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kFormatVersion = 1;

// Note [Host synchronisation points]
// On a device the host enqueues steps ahead of the GPU and waits for it only
// where the loop reads a value: at a logging step, an evaluation (an epoch's
// end, train.eval_every), a checkpoint, and a stop check (Ctrl-C,
// train.max_time_s). Between them executions are launched back to back. A
// sync point is a decision every rank must take at the same step (each
// holds collectives), so it depends on the step alone, and on the stop-check
// cadence S, which every rank takes from the same allreduced values:
//  - train.sync_every N > 0: S = N, a check when the step reaches or passes a
//    multiple of N (at the end of an execution; executions are aligned to
//    the epoch);
//  - train.sync_every 0 (the default): S is measured. Every sync point ends
//    with the stop check, an allreduce (max) of [interrupted, out of time,
//    this rank's cost of a check, its time per step since the last sync
//    point]. The cost of a check is the host time from the device having
//    drained to the next launch (the device idles that long), measured at
//    the points that were nothing but a stop check, the least of the last
//    kCheckCostSamples (a preempted check is not its cost); the time per step
//    is the wall time of those steps, device drained at both ends. From the
//    reduced values every rank computes the same next S =
//    ceil(cost / (kStopCheckShare x step)): the fewest steps over which a
//    check costs under 1% of the time. S starts at 1 (nothing is measured
//    yet) and follows the run (warm-up steps are slow, so S starts small).
// Every sync point also checks for a stop (the allreduce is small next to
// the sync it joins), so stops happen at sync points only, on every rank at
// the same step, and a checkpoint there resumes exactly. Window and epoch
// times are measured between sync points, where the device has drained
// (host time stamps elsewhere would measure only enqueueing); the progress
// bar is redrawn at sync points.
constexpr double kStopCheckShare = 0.01;
constexpr size_t kCheckCostSamples = 4;

/// train.sync_every=0's steps between stop checks (Note [Host
/// synchronisation points]): the fewest over which one check, costing
/// `check_s`, takes under kStopCheckShare of the steps' time (`step_s` each).
int64_t stop_check_cadence(double check_s, double step_s) {
  if (!(check_s > 0) || !(step_s > 0)) return 1;
  const double steps = std::ceil(check_s / (kStopCheckShare * step_s));
  return static_cast<int64_t>(std::clamp(steps, 1.0, 1e9));
}

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
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
  // The resumed checkpoint when build() already read it (a gpt2 or llama is
  // built from its config.json); restore() takes it rather than read again.
  TensorDict resume_checkpoint_;
  TensorDict snapshot();
  void save_checkpoint(const std::string& reason);
  double lr_at(int64_t step) const;
  void reseed(int64_t step);
  /// One step's inputs: per micro-batch its inputs and targets (from the
  /// loader) or its sample indices (gathered in the step); the learning rate
  /// on the device; the step number on the CPU.
  std::vector<at::Tensor> step_batch(int64_t step);
  /// A batch of step_batch's shapes that takes nothing from the loader.
  std::vector<at::Tensor> sample_batch();
  /// data.prefetch, -1 resolved: 2 on a device, 0 on the CPU.
  int64_t prefetch() const {
    const int64_t p = config_.get_int("data.prefetch");
    return p >= 0 ? p : (device_.is_cpu() ? 0 : 2);
  }
  /// Whether a step's batch holds the micro-batches' tensors (from the
  /// loader, or gathered and augmented before the step) rather than their
  /// sample indices (gathered inside the step, which may be a CUDA graph).
  bool batch_holds_data() const { return loader_ != nullptr || augment_.enabled(); }
  /// Tensors per micro-batch in a step's batch: 2 with data, else 1.
  int64_t micro_slots() const { return batch_holds_data() ? 2 : 1; }
  /// One optimizer step over `batch` (see step_batch); returns its loss.
  at::Tensor step_body(const std::vector<at::Tensor>& batch);
  /// Steps [first, first + n): one fused execution when K > 1.
  void run_steps(int64_t first, int64_t n);
  void prepare_fused_steps(int64_t k);
  /// Clips the gradients to train.clip_grad_norm; returns their norm (of the
  /// unscaled gradients), undefined when there are none.
  at::Tensor clip_gradients();
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

  // Note [Weight EMA]
  // train.ema_decay = d > 0 keeps a float32 average of the model's floating
  // state (parameters and batch-norm statistics): a_t = d a_{t-1} + (1 - d) w_t
  // after every optimizer step, from a_0 = 0 at ema_start_ (step 0, or the
  // step a run without one was resumed at). The weights it stands for are
  // the debiased a_t / (1 - d^t), as Adam debiases its moments: no warm-up
  // schedule, and the update is one constant-weight foreach lerp per step,
  // which a CUDA graph can hold. Every rank keeps the same average (the same
  // weights, the same ops); evaluation swaps the debiased average into the
  // model and back.
  void init_ema();
  void update_ema();
  /// Runs `fn` with the debiased average in the model's tensors.
  template <typename Fn>
  auto with_ema_weights(Fn&& fn);
  std::vector<std::string> ema_names_;
  std::vector<at::Tensor> ema_live_;  // the model's tensors the average follows
  std::vector<at::Tensor> ema_;       // a_t, float32
  int64_t ema_start_ = 0;
  EvalResult last_ema_eval_;

  // Note [Non-finite steps]
  // train.nonfinite (error, skip, ignore). A step is non-finite when its loss
  // is, on any rank, or (without loss scaling) its gradients' norm is; under
  // float16 loss scaling a non-finite gradient is the scaler's overflow, and
  // the scaler skips it as torch's does. error and skip both skip such a
  // step on the device, through the same found_inf flag the scaler's steps
  // use (the optimizer's state and the weights unchanged; skip also puts the
  // model's buffers, batch-norm statistics, back): nothing is read on the
  // host per step. The count and the first such step ride in the stop
  // flags allreduced at each host synchronisation point, so error stops at
  // the first of those after the step, before any evaluation or checkpoint:
  // the newest checkpoint is the last good one.
  enum class NonFinite { kError, kSkip, kIgnore };
  NonFinite nonfinite_mode_ = NonFinite::kError;
  bool checks_nonfinite() const { return nonfinite_mode_ != NonFinite::kIgnore; }
  /// float64 on the device: [non-finite steps, -(the first one), -(the first
  /// whose loss was non-finite on this rank)], -inf where there is none.
  at::Tensor nonfinite_;
  /// The agreed count of non-finite steps at the latest sync point, and the
  /// count the latest log line reported.
  int64_t nonfinite_steps_ = 0;
  int64_t nonfinite_logged_ = 0;
  /// skip: the model's buffers, put back after a skipped step.
  std::vector<at::Tensor> buffers_;
  /// The gradients' L2 norm (undefined when there are none).
  at::Tensor grad_norm() const;
  /// error: says what went wrong at `step` (0-based) on rank 0 and returns
  /// the exit code every rank returns.
  int fail_nonfinite(int64_t step);
  /// Where training sample `i` is in its file (data.path).
  std::string sample_names(const at::Tensor& index) const;

  Config config_;
  RunPlan plan_;
  const Distributed& world_;
  at::Device device_;
  amp::Policy policy_;
  bool rank0_;

  Dataset data_;
  Model model_;
  std::unique_ptr<optim::FusedOptimizer> optimizer_;
  // parallel.shard: optimizer_ is this ZeroRedundancyOptimizer.
  optim::ZeroRedundancyOptimizer* zero_ = nullptr;
  void shard_optimizer(bool gradients);
  std::unique_ptr<amp::GradScaler> scaler_;
  std::unique_ptr<ParallelModel> parallel_;
  std::unique_ptr<BatchSampler> sampler_;
  // data.prefetch > 0: the batches come from a background thread.
  std::unique_ptr<BatchLoader> loader_;
  Augmentation augment_;  // data.random_crop_padding, data.random_hflip
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
  // The losses: [sum, steps counted] (a non-finite loss is not counted).
  at::Tensor window_loss_;
  at::Tensor epoch_loss_;
  at::Tensor skipped_;
  int64_t window_steps_ = 0;
  int64_t epoch_steps_ = 0;
  double window_seconds_ = 0.0;
  double epoch_seconds_ = 0.0;
  // Since the last sync point (Note [Host synchronisation points]).
  Clock::time_point segment_start_;
  int64_t segment_steps_ = 0;
  // The loop's host synchronisations, for the run's summary.
  int64_t sync_points_ = 0;
  // Steps between stop checks, and this rank's latest costs of a check alone
  // (0: not measured).
  int64_t check_every_ = 1;
  std::array<double, kCheckCostSamples> check_costs_{};
  size_t next_check_cost_ = 0;
  // The last agreed (allreduced) cost of a check and time per step.
  double agreed_check_s_ = 0.0;
  double agreed_step_s_ = 0.0;
  /// The least measured cost of a check alone on this rank (0: none yet).
  double check_cost() const;
  Clock::time_point run_start_;
  std::string last_checkpoint_;
  EvalResult last_eval_;
};

void Trainer::build() {
  const int64_t seed = config_.get_int("train.seed");
  torch::manual_seed(static_cast<uint64_t>(seed));
  // With the loader the training data stays in host memory (a device needs
  // room only for the batches in flight).
  const bool loader = prefetch() > 0;
  const at::Device data_device = loader ? at::Device(at::kCPU) : device_;
  data_ = load_dataset(config_, device_, data_device);
  augment_ = augmentation_from(config_, data_);
  // A resumed gpt2 or llama is built from the config.json its checkpoint
  // keeps, without reading model.pretrained again (restore() loads it all).
  if (!plan_.checkpoint.empty() && is_hf_model(config_.get_string("model.name"))) {
    resume_checkpoint_ = read_checkpoint(plan_.checkpoint);
  }
  model_ = make_model(config_, data_, stored_hf_config(resume_checkpoint_));
  model_->to(device_);
  if (config_.get_bool("precision.master_weights")) {
    cast_for_master_weights(model_, policy_.compute_dtype());
  }
  if (wants_channels_last(config_)) model_->use_channels_last();
  init_ema();

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
                                         world_.world_size(), world_.rank(), accum, data_seed,
                                         data_device)
          : BatchSampler(data_.train.size(), batch, world_.world_size(), world_.rank(), accum,
                         data_seed, data_device));

  const auto acc = at::TensorOptions().dtype(at::kFloat).device(device_);
  window_loss_ = at::zeros({2}, acc);
  epoch_loss_ = at::zeros({2}, acc);
  skipped_ = at::zeros({1}, acc);
  const std::string& nonfinite = config_.get_string("train.nonfinite");
  nonfinite_mode_ = nonfinite == "skip"     ? NonFinite::kSkip
                    : nonfinite == "ignore" ? NonFinite::kIgnore
                                            : NonFinite::kError;
  const double none = -std::numeric_limits<double>::infinity();
  nonfinite_ = at::tensor({0.0, none, none}, at::kDouble).to(device_);
  if (nonfinite_mode_ == NonFinite::kSkip) {
    for (const auto& b : model_->buffers()) buffers_.push_back(b);
  }
}

// ------------------------------------------------------------------ checkpoints

TensorDict Trainer::snapshot() {
  TensorDict d;
  d.emplace_back("meta.format", scalar_entry(kFormatVersion));
  d.emplace_back("config.yaml", text_tensor(config_.to_yaml()));
  d.emplace_back("config.name", text_tensor(config_.name()));
  // gpt2, llama: the config.json that `export --hf` writes back.
  if (const auto* hf = hf_config_of(*model_)) d.emplace_back("meta.hf_config", text_tensor(hf->dump()));
  d.emplace_back("trainer.step", scalar_entry(step_));
  d.emplace_back("trainer.epoch", scalar_entry(step_ / steps_per_epoch_));
  d.emplace_back("trainer.step_in_epoch", scalar_entry(step_ % steps_per_epoch_));
  d.emplace_back("trainer.steps_per_epoch", scalar_entry(steps_per_epoch_));
  d.emplace_back("trainer.batch_size", scalar_entry(config_.get_int("data.batch_size")));
  d.emplace_back("trainer.world_size", scalar_entry(static_cast<int64_t>(world_.world_size())));
  d.emplace_back("trainer.skipped",
                 scalar_entry(skipped_before_ + static_cast<int64_t>(skipped_.item<float>())));
  d.emplace_back("data.mean", scalar_entry(data_.mean));
  d.emplace_back("data.std", scalar_entry(data_.std));
  // What load_checkpoint.py needs to rebuild a model on the user's data.
  d.emplace_back("data.input_shape", at::tensor(data_.input_shape, at::kLong));
  d.emplace_back("data.num_classes", at::scalar_tensor(data_.num_classes, at::kLong));
  d.emplace_back("rng.seed", scalar_entry(config_.get_int("train.seed")));
  d.emplace_back("rng.cpu_state", at::detail::getDefaultCPUGenerator().get_state());
  put_model(d, model_);
  put_optimizer(d, model_, *optimizer_, config_.get_string("optimizer.name"));
  put_scaler(d, *scaler_);
  if (!ema_.empty()) {
    d.emplace_back("ema.start_step", scalar_entry(ema_start_));
    for (size_t i = 0; i < ema_.size(); ++i) d.emplace_back("ema." + ema_names_[i], ema_[i]);
  }
  return d;
}

void Trainer::save_checkpoint(const std::string& reason) {
  // Sharded state comes to rank 0 first: a collective, on every rank.
  if (zero_ != nullptr) zero_->consolidate_state(0);
  if (!rank0_) return;
  const auto t0 = Clock::now();
  make_dirs(checkpoint_dir(plan_.run_dir));
  const std::string path =
      checkpoint_dir(plan_.run_dir) + "/" + fmt::format("step_{:08d}.pt", step_);
  write_checkpoint(path, snapshot());
  if (zero_ != nullptr) zero_->state().clear();  // the unsharded copy is not kept
  last_checkpoint_ = path;
  // Keep the newest keep_checkpoints files; the one just written is among them.
  auto all = checkpoints_in(plan_.run_dir);
  const auto keep = static_cast<size_t>(config_.get_int("output.keep_checkpoints"));
  for (size_t i = 0; i + keep < all.size(); ++i) std::remove(all[i].second.c_str());
  if (reason != "quiet") {
    say(fmt::format("checkpoint {} ({}, {:.1f} s)", path, reason,
                    std::chrono::duration<double>(Clock::now() - t0).count()));
  }
}

void Trainer::restore(const std::string& path) {
  const TensorDict ckpt = resume_checkpoint_.empty() ? read_checkpoint(path) : std::move(resume_checkpoint_);
  resume_checkpoint_.clear();
  auto entry = [&](const std::string& k) -> const at::Tensor& {
    return checkpoint_entry(ckpt, k, path);
  };
  if (entry("meta.format").item<int64_t>() != kFormatVersion) {
    throw CheckpointError("checkpoint " + path + " has format " +
                          std::to_string(entry("meta.format").item<int64_t>()) + "; this build reads " +
                          std::to_string(kFormatVersion));
  }
  load_model(ckpt, path, model_);
  load_optimizer(ckpt, path, model_, *optimizer_, config_, device_);
  load_scaler(ckpt, *scaler_);

  step_ = entry("trainer.step").item<int64_t>();
  skipped_before_ = entry("trainer.skipped").item<int64_t>();
  if (entry("trainer.batch_size").item<int64_t>() != config_.get_int("data.batch_size")) {
    say("warning: the checkpoint was written with data.batch_size=" +
        std::to_string(entry("trainer.batch_size").item<int64_t>()) +
        "; with another batch size the data order differs from the original run's");
  }
  at::Generator cpu_gen = at::detail::getDefaultCPUGenerator();
  cpu_gen.set_state(entry("rng.cpu_state"));
  if (!ema_.empty()) {
    const auto start = std::find_if(ckpt.begin(), ckpt.end(),
                                    [](const auto& kv) { return kv.first == "ema.start_step"; });
    if (start == ckpt.end()) {
      ema_start_ = step_;  // a_0 = 0 here: the average starts now
      say(fmt::format("warning: {} has no weight average; train.ema_decay starts one at step {}", path,
                      step_));
    } else {
      ema_start_ = start->second.item<int64_t>();
      for (size_t i = 0; i < ema_.size(); ++i) ema_[i].copy_(entry("ema." + ema_names_[i]));
    }
  }
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

// The optimizer built (and maybe restored) unsharded becomes a
// ZeroRedundancyOptimizer with the same groups; a restored state moves over
// and is sharded, so a checkpoint resumes whatever parallel.shard it was
// written with.
void Trainer::shard_optimizer(bool gradients) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (auto& g : optimizer_->param_groups()) groups.emplace_back(g.params(), g.options().clone());
  optim::ZeroOptions zo;
  // The all-gather lands in the parameters: no pack and unpack copies.
  zo.max_grad_norm(config_.get_float("train.clip_grad_norm")).parameters_as_bucket_view(true);
  dist::Reducer* reducer = gradients ? parallel_->reducer() : nullptr;
  std::unique_ptr<optim::ZeroRedundancyOptimizer> zero;
  if (config_.get_string("optimizer.name") == "adamw") {
    zero = optim::ZeroRedundancyOptimizer::adamw(
        std::move(groups), static_cast<const optim::FusedAdamWOptions&>(optimizer_->defaults()),
        world_.group(), zo, reducer);
  } else {
    zero = optim::ZeroRedundancyOptimizer::sgd(
        std::move(groups), static_cast<const optim::FusedSGDOptions&>(optimizer_->defaults()),
        world_.group(), zo, reducer);
  }
  for (auto& item : optimizer_->state()) zero->state()[item.first] = std::move(item.second);
  zero->shard_state();
  zero_ = zero.get();
  optimizer_ = std::move(zero);
}

at::Tensor Trainer::grad_norm() const {
  std::vector<at::Tensor> grads;
  for (const auto& p : trainable_) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  if (grads.empty()) return {};
  return std::get<0>(ops::multi_tensor_l2norm(grads));
}

at::Tensor Trainer::clip_gradients() {
  // The norm is of the true gradients: unscale first when scaling.
  if (scaler_->is_enabled()) scaler_->unscale_(*optimizer_);
  const at::Tensor norm = grad_norm();
  if (!norm.defined()) return norm;
  // No host sync: the coefficient stays on the device. An inf norm gives 0,
  // and a step with non-finite gradients is skipped anyway.
  const at::Tensor coef = (config_.get_float("train.clip_grad_norm") / (norm + 1e-6)).clamp_max(1.0);
  for (const auto& p : trainable_) {
    if (p.grad().defined()) p.grad().mul_(coef);
  }
  return norm;
}

std::vector<at::Tensor> Trainer::step_batch(int64_t step) {
  const int64_t epoch = step / steps_per_epoch_;
  const int64_t in_epoch = step % steps_per_epoch_;
  const int64_t accum = config_.get_int("train.grad_accum");
  std::vector<at::Tensor> batch;
  if (loader_) {
    for (auto& micro : loader_->take(step)) {
      batch.push_back(std::move(micro.inputs));
      batch.push_back(std::move(micro.targets));
    }
  } else if (augment_.enabled()) {
    // Without the loader: the same gather and augmentation, here (an image
    // batch is small; on a device the loader, its default, does this).
    for (int64_t m = 0; m < accum; ++m) {
      const at::Tensor idx = sampler_->indices(epoch, in_epoch, m);
      at::Tensor x = data_.train.inputs.index_select(0, idx.to(data_.train.inputs.device()))
                         .to(at::kCPU)
                         .contiguous();
      augment_images_(x, idx, epoch, augment_);
      batch.push_back(x.to(device_));
      batch.push_back(data_.train.targets.index_select(0, idx.to(data_.train.targets.device())));
    }
  } else {
    for (int64_t m = 0; m < accum; ++m) batch.push_back(sampler_->indices(epoch, in_epoch, m));
  }
  // A fill kernel on the device, not a copy from the host.
  batch.push_back(at::scalar_tensor(lr_at(step), at::TensorOptions().dtype(at::kDouble).device(device_)));
  batch.push_back(scalar_entry(step));
  if (checks_nonfinite()) {
    // The step on the device too, for the non-finite record (a CUDA graph
    // replays host values as captured).
    batch.push_back(at::scalar_tensor(static_cast<double>(step),
                                      at::TensorOptions().dtype(at::kDouble).device(device_)));
  }
  return batch;
}

std::vector<at::Tensor> Trainer::sample_batch() {
  if (!batch_holds_data()) return step_batch(step_);
  const int64_t micro = config_.get_int("data.batch_size") / world_.world_size() /
                        config_.get_int("train.grad_accum");
  std::vector<at::Tensor> batch;
  for (int64_t m = 0; m < config_.get_int("train.grad_accum"); ++m) {
    batch.push_back(data_.train.inputs.narrow(0, 0, micro).to(device_));
    batch.push_back(data_.train.targets.narrow(0, 0, micro).to(device_));
  }
  batch.push_back(at::scalar_tensor(0.0, at::TensorOptions().dtype(at::kDouble).device(device_)));
  batch.push_back(scalar_entry(step_));
  if (checks_nonfinite()) {
    batch.push_back(at::scalar_tensor(static_cast<double>(step_),
                                      at::TensorOptions().dtype(at::kDouble).device(device_)));
  }
  return batch;
}

at::Tensor Trainer::step_body(const std::vector<at::Tensor>& batch) {
  const int64_t accum = config_.get_int("train.grad_accum");
  const int64_t lr_slot = accum * micro_slots();
  if (graph_mode_) {
    // Inside a CUDA graph host values are frozen: the optimizer reads the
    // learning rate from lr_device_, written here from this step's input.
    lr_device_.copy_(batch[lr_slot]);
  } else {
    const int64_t step = batch[lr_slot + 1].item<int64_t>();  // a CPU tensor: no sync
    const double lr = lr_at(step);
    for (auto& group : optimizer_->param_groups()) group.options().set_lr(lr);
    reseed(step);
  }
  optimizer_->zero_grad(/*set_to_none=*/true);
  std::vector<at::Tensor> kept;  // skip: the buffers before this step's forwards
  kept.reserve(buffers_.size());
  for (const auto& b : buffers_) kept.push_back(b.detach().clone());
  at::Tensor step_loss = at::zeros({1}, window_loss_.options());
  for (int64_t m = 0; m < accum; ++m) {
    at::Tensor x, y;
    if (batch_holds_data()) {
      x = batch[2 * m];
      y = batch[2 * m + 1];
    } else {
      x = data_.train.inputs.index_select(0, batch[m]);
      y = data_.train.targets.index_select(0, batch[m]);
    }
    // Gradients are averaged across ranks on the last micro-batch only.
    const std::shared_ptr<void> local_only = m + 1 < accum ? parallel_->no_sync() : nullptr;
    at::Tensor loss;
    {
      // The loss in float32 (a float32 island, or the fused head's fp32
      // cross-entropy) whatever the autocast dtype.
      const amp::AutocastGuard autocast(device_.type(), policy_);
      loss = parallel_->forward(x, y, config_.get_float("train.label_smoothing"));
    }
    const at::Tensor scaled = scaler_->scale(accum > 1 ? loss / static_cast<double>(accum) : loss);
    scaled.backward();
    step_loss.add_(loss.detach().reshape({1}), 1.0 / static_cast<double>(accum));
  }
  // (A sharded optimizer clips in its step, from the global norm of the shards.)
  at::Tensor norm;
  if (config_.get_float("train.clip_grad_norm") > 0 && zero_ == nullptr) norm = clip_gradients();
  if (!checks_nonfinite()) {
    window_loss_.narrow(0, 0, 1).add_(step_loss);
    window_loss_.narrow(0, 1, 1).add_(1);
    epoch_loss_.narrow(0, 0, 1).add_(step_loss);
    epoch_loss_.narrow(0, 1, 1).add_(1);
    scaler_->step(*optimizer_);
  } else {
    // Note [Non-finite steps]
    const at::Tensor loss_bad = step_loss.isfinite().logical_not();
    at::Tensor bad = loss_bad;
    const at::Tensor counted = at::cat({step_loss.masked_fill(loss_bad, 0), loss_bad.logical_not()});
    window_loss_.add_(counted);
    epoch_loss_.add_(counted);
    if (scaler_->is_enabled()) {
      scaler_->step(*optimizer_);  // a non-finite loss makes non-finite gradients: found_inf
    } else {
      if (!norm.defined()) norm = grad_norm();
      if (norm.defined()) bad = bad.logical_or(norm.isfinite().logical_not().reshape({1}));
      struct Clear {
        optim::FusedOptimizer* opt;
        ~Clear() { opt->set_amp_scaling(std::nullopt, std::nullopt); }
      } clear{optimizer_.get()};
      optimizer_->set_amp_scaling(std::nullopt, bad.to(at::kFloat));
      scaler_->step(*optimizer_);
    }
    const at::Tensor minus_step = batch[lr_slot + 2].reshape({1}).neg();
    const double none = -std::numeric_limits<double>::infinity();
    nonfinite_.narrow(0, 0, 1).add_(bad);
    auto keep_first = [&](int64_t slot, const at::Tensor& flag) {
      at::Tensor first = nonfinite_.narrow(0, slot, 1);
      first.copy_(at::maximum(first, at::where(flag, minus_step, none)));
    };
    keep_first(1, bad);
    keep_first(2, loss_bad);
    const at::Tensor skipped = bad.reshape({});
    for (size_t i = 0; i < buffers_.size(); ++i) {
      buffers_[i].detach().copy_(at::where(skipped, kept[i], buffers_[i].detach()));
    }
  }
  if (scaler_->is_enabled()) skipped_.add_(scaler_->found_inf().ne(0).reshape({1}));
  scaler_->update();
  update_ema();
  return step_loss;
}

void Trainer::init_ema() {
  if (config_.get_float("train.ema_decay") <= 0) return;
  auto follow = [&](const std::string& name, const at::Tensor& t) {
    if (!at::isFloatingType(t.scalar_type())) return;  // e.g. num_batches_tracked
    ema_names_.push_back(name);
    ema_live_.push_back(t);
    ema_.push_back(at::zeros(t.sizes(), t.options().dtype(at::kFloat)));
  };
  for (const auto& p : model_->named_parameters()) follow(p.key(), p.value());
  for (const auto& b : model_->named_buffers()) follow(b.key(), b.value());
}

void Trainer::update_ema() {
  if (ema_.empty()) return;
  const at::NoGradGuard no_grad;
  std::vector<at::Tensor> live;
  live.reserve(ema_live_.size());
  for (const at::Tensor& t : ema_live_) live.push_back(t.detach().to(at::kFloat));
  // a += (1 - d) (w - a), i.e. a = d a + (1 - d) w.
  at::_foreach_lerp_(ema_, live, 1.0 - config_.get_float("train.ema_decay"));
}

template <typename Fn>
auto Trainer::with_ema_weights(Fn&& fn) {
  const at::NoGradGuard no_grad;
  const double d = config_.get_float("train.ema_decay");
  const double debias = 1.0 - std::pow(d, static_cast<double>(step_ - ema_start_));
  std::vector<at::Tensor> kept;
  kept.reserve(ema_live_.size());
  for (size_t i = 0; i < ema_live_.size(); ++i) {
    kept.push_back(ema_live_[i].detach().clone());
    ema_live_[i].detach().copy_(debias > 0 ? ema_[i] / debias : ema_live_[i]);
  }
  auto result = fn();
  for (size_t i = 0; i < ema_live_.size(); ++i) ema_live_[i].detach().copy_(kept[i]);
  return result;
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
      [this](const std::vector<at::Tensor>& batch) { return step_body(batch); }, sample_batch(), o);
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

// ------------------------------------------------------------------ non-finite steps

std::string Trainer::sample_names(const at::Tensor& index) const {
  const at::Tensor rows = data_.train.rows.defined()
                              ? data_.train.rows.index_select(0, index.to(data_.train.rows.device()))
                              : index;
  const at::Tensor host = rows.to(at::kCPU, at::kLong).contiguous();
  const int64_t n = host.numel();
  const int64_t* v = host.const_data_ptr<int64_t>();
  constexpr int64_t kShown = 8;
  std::string list;
  for (int64_t i = 0; i < std::min(n, kShown); ++i) list += (i ? ", " : "") + std::to_string(v[i]);
  if (n > kShown) list += fmt::format(", ... ({} in all)", n);
  const std::string what = data_.is_tokens ? (n == 1 ? "the window at token" : "the windows at tokens")
                                           : (n == 1 ? "sample" : "samples");
  const std::string& path = config_.get_string("data.path");
  return fmt::format("{} {} of {}", what, list,
                     config_.get_string("data.name") == "synthetic" || path.empty() ? data_.description
                                                                                     : path);
}

int Trainer::fail_nonfinite(int64_t step) {
  loader_.reset();  // its thread uses the sampler asked below
  const int64_t epoch = step / steps_per_epoch_;
  const int64_t in_epoch = step % steps_per_epoch_;
  const at::Tensor mine = nonfinite_.cpu();
  const double first_loss = mine[2].item<double>();
  std::string report;
  if (std::isfinite(first_loss) && static_cast<int64_t>(-first_loss) == step) {
    std::vector<at::Tensor> parts;
    for (int64_t m = 0; m < config_.get_int("train.grad_accum"); ++m) {
      parts.push_back(sampler_->indices(epoch, in_epoch, m).to(at::kCPU));
    }
    const at::Tensor index = at::cat(parts);
    report = fmt::format("the loss on rank {} was not finite; its batch is {}", world_.rank(),
                         sample_names(index));
    const at::Tensor x = data_.train.inputs.index_select(0, index.to(data_.train.inputs.device()));
    if (at::isFloatingType(x.scalar_type())) {
      const at::Tensor bad_rows = x.isfinite().logical_not().flatten(1).any(1).to(at::kCPU);
      const at::Tensor culprits = index.masked_select(bad_rows);
      report += culprits.numel() > 0
                    ? fmt::format("; the cause: the inputs of {} hold NaN or inf", sample_names(culprits))
                    : std::string("; its inputs are finite, so the forward overflowed (a learning "
                                  "rate too high? float16 without loss scaling?)");
    }
  }
  const std::vector<std::string> reports = world_.allgather_text(report);
  if (rank0_) {
    std::string why;
    for (const auto& r : reports) {
      if (!r.empty()) why += "; " + r;
    }
    if (why.empty()) {
      why = "; the losses were finite, the gradients were not (an overflow in the backward: a "
            "lower optimizer.lr or train.clip_grad_norm may help)";
    }
    const std::string newest =
        !last_checkpoint_.empty()   ? "the newest checkpoint is " + last_checkpoint_
        : !plan_.checkpoint.empty() ? "the newest checkpoint is " + plan_.checkpoint + ", resumed from"
                                    : "no checkpoint was written";
    if (progress_->is_bar()) progress_->line("");
    std::cerr << fmt::format(
                     "fusetrain train: error: a non-finite loss or gradient norm at step {} of {} "
                     "(epoch {}, batch {} of {}){}. Stopped at step {} with no checkpoint written "
                     "after the step before it; {}. train.nonfinite=skip skips such steps instead, "
                     "ignore trains on.",
                     step + 1, total_steps_, epoch + 1, in_epoch + 1, steps_per_epoch_, why, step_, newest)
              << std::endl;
  }
  world_.barrier();
  return 1;
}

// ------------------------------------------------------------------ metrics

void Trainer::open_metrics() {
  if (rank0_) metrics_.open(plan_.run_dir + "/metrics.jsonl", start_step_);
}

void Trainer::write_metrics(const Record& record) {
  if (rank0_) metrics_.write(record);
}

double Trainer::check_cost() const {
  double least = 0.0;
  for (const double c : check_costs_) {
    if (c > 0 && (least == 0.0 || c < least)) least = c;
  }
  return least;
}

double Trainer::elapsed_s() const {
  return std::chrono::duration<double>(Clock::now() - run_start_).count();
}

void Trainer::log_window(int64_t step) {
  const at::Tensor sum = window_loss_.clone();
  world_.allreduce_sum_(sum);
  const at::Tensor host_sum = sum.cpu();
  const double loss = host_sum[0].item<double>() / std::max(1.0, host_sum[1].item<double>());
  const double rate = static_cast<double>(window_steps_ * config_.get_int("data.batch_size")) /
                      std::max(1e-9, window_seconds_);
  const double lr = lr_at(step - 1);
  const double scale = scaler_->get_scale();
  const int64_t skipped = skipped_before_ + static_cast<int64_t>(skipped_.item<float>());
  const int64_t epoch = (step - 1) / steps_per_epoch_ + 1;
  Record record{{"kind", "train"}, {"step", step}, {"epoch", epoch}, {"loss", loss},
                {"lr", lr}, {"scale", scale}, {"skipped", skipped},
                {"samples_per_s", rate}, {"accuracy", nullptr}, {"time_s", elapsed_s()}};
  if (nonfinite_mode_ == NonFinite::kSkip) record["nonfinite"] = nonfinite_steps_;
  write_metrics(record);
  const std::string nonfinite =
      nonfinite_steps_ > nonfinite_logged_
          ? fmt::format("  ({} non-finite step{} skipped, {} in all)", nonfinite_steps_ - nonfinite_logged_,
                        nonfinite_steps_ - nonfinite_logged_ == 1 ? "" : "s", nonfinite_steps_)
          : "";
  nonfinite_logged_ = nonfinite_steps_;
  if (rank0_ && !progress_->is_bar()) {
    say(fmt::format("  step {}/{}  loss {:.4f}  lr {:.3g}  {:.0f} samples/s{}", step, total_steps_, loss,
                    lr, rate, nonfinite));
  } else if (!nonfinite.empty()) {
    say(fmt::format("  step {}/{}:{}", step, total_steps_, nonfinite));
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
  const at::Tensor host_sum = sum.cpu();
  const double loss = host_sum[0].item<double>() / std::max(1.0, host_sum[1].item<double>());
  const double rate = static_cast<double>(epoch_steps_ * config_.get_int("data.batch_size")) /
                      std::max(1e-9, epoch_seconds_);
  last_eval_ = evaluate(*model_, data_.test, world_, policy_, device_.type(),
                        config_.get_int("data.eval_batch_size"));
  if (!ema_.empty()) {
    last_ema_eval_ = with_ema_weights([&] {
      return evaluate(*model_, data_.test, world_, policy_, device_.type(),
                      config_.get_int("data.eval_batch_size"));
    });
  }
  const std::string ema_text =
      ema_.empty() ? "" : fmt::format(" (EMA {:.2f}%)", 100.0 * last_ema_eval_.accuracy);
  const int64_t epoch = (step - 1) / steps_per_epoch_ + 1;
  const int64_t epochs = (total_steps_ + steps_per_epoch_ - 1) / steps_per_epoch_;
  const double lr = lr_at(step - 1);
  const double scale = scaler_->get_scale();
  const int64_t skipped = skipped_before_ + static_cast<int64_t>(skipped_.item<float>());
  if (epoch_end) {
    say(fmt::format("epoch {}/{}  loss {:.4f}  test loss {:.4f}  accuracy {:.2f}%{}  {:.0f} samples/s  "
                    "lr {:.2e}  scale {:g}  skipped {}  ({})",
                    epoch, epochs, loss, last_eval_.loss, 100.0 * last_eval_.accuracy, ema_text, rate,
                    lr, scale, skipped, duration_text(epoch_seconds_)));
  } else {
    say(fmt::format("  step {}/{}  validation loss {:.4f}  accuracy {:.2f}%", step, total_steps_,
                    last_eval_.loss, 100.0 * last_eval_.accuracy));
  }
  Record record{{"kind", "eval"}, {"step", step}, {"epoch", epoch}, {"loss", loss}, {"lr", lr},
                {"scale", scale}, {"skipped", skipped}, {"samples_per_s", rate},
                {"accuracy", last_eval_.accuracy}, {"test_loss", last_eval_.loss}};
  if (nonfinite_mode_ == NonFinite::kSkip) record["nonfinite"] = nonfinite_steps_;
  add_validation(record);
  if (!ema_.empty()) {
    if (!data_.is_tokens) record["ema_accuracy"] = last_ema_eval_.accuracy;
    record["ema_test_loss"] = last_ema_eval_.loss;
  }
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
  if (!plan_.resume_note.empty()) say(plan_.resume_note);
  build();
  if (!plan_.checkpoint.empty()) restore(plan_.checkpoint);
  start_step_ = step_;
  if (rank0_) {
    prepare_run_dir(config_, plan_);
    open_metrics();
  }
  const std::string& shard = config_.get_string("parallel.shard");
  if (shard == "gradients" && config_.get_string("parallel.comm_hook") != "none") {
    throw config_.error("parallel.shard", "gradients reduce-scatters the buckets itself; it takes "
                        "no parallel.comm_hook");
  }
  dist::DDPOptions ddp;
  ddp.shard_gradients(shard == "gradients" && world_.is_distributed());
  parallel_ = std::make_unique<ParallelModel>(
      model_, world_, ddp, config_.get_string("parallel.comm_hook"),
      config_.get_int("parallel.powersgd_rank"), config_.get_int("parallel.powersgd_start_iter"));
  if (shard != "none" && device_.is_cuda() && config_.get_int("train.steps_per_execution") > 1 &&
      config_.get_bool("train.cuda_graphs")) {
    // The sharded step's collectives have not been captured on a GPU yet.
    throw config_.error("parallel.shard", "is not yet supported with CUDA graphs (steps_per_execution "
                        "> 1 on cuda); set train.cuda_graphs=false");
  }
  if (shard != "none" && world_.is_distributed()) shard_optimizer(shard == "gradients");

  const int64_t batch = config_.get_int("data.batch_size");
  const int64_t epochs = (total_steps_ + steps_per_epoch_ - 1) / steps_per_epoch_;
  say(fmt::format("fusetrain train: {} -> {}", config_.name().empty() ? "config" : config_.name(),
                  plan_.run_dir));
  say(fmt::format("  model {} ({} parameters{}), {}: {} train / {} test samples",
                  config_.get_string("model.name"), count_parameters(model_),
                  model_->channels_last() ? ", channels_last" : "", data_.description,
                  data_.train.size(), data_.test.size()));
  if (!data_.is_tokens) say(fmt::format("  classes: {}, {}", data_.num_classes, data_.num_classes_origin));
  for (const auto& warning : data_.warnings) say("  warning: " + warning);
  const int world = world_.world_size();
  const int threads = at::get_num_threads();
  const int64_t accum = config_.get_int("train.grad_accum");
  const std::string& policy_origin = config_.origin("precision.policy");
  if (policy_origin.rfind("auto: ", 0) == 0) {
    say(fmt::format("  precision.policy auto -> {}: {}", policy_.name(), policy_origin.substr(6)));
  }
  say(fmt::format("  {} rank{} on {} ({}), {} intra-op thread{} each; {}, {}, batch {} ({} per rank{}), "
                  "{} epoch{} = {} steps",
                  world, world == 1 ? "" : "s", device_.str(),
                  !world_.is_distributed() ? "no group"
                  : device_.is_cuda()      ? "nccl"
                  : world_.shared_memory() ? "gloo, allreduce through shared memory"
                                           : "gloo",
                  threads,
                  threads == 1 ? "" : "s", policy_.name(), config_.get_string("optimizer.name"), batch,
                  batch / world, accum > 1 ? fmt::format(", {} micro-batches", accum) : "", epochs,
                  epochs == 1 ? "" : "s", total_steps_));
  if (rank0_ && device_.is_cpu()) {
    // The machine's load from other work: measured by the launcher before it
    // started the ranks, or here by a single process (idle meanwhile).
    const char* measured = std::getenv(kBusyCoresEnv);
    const double busy = measured != nullptr          ? std::atof(measured)
                        : !world_.is_distributed() ? busy_cores(std::chrono::milliseconds(250))
                                                   : -1.0;
    const char* local = std::getenv("LOCAL_WORLD_SIZE");
    const int ranks_here = local != nullptr ? std::max(1, std::atoi(local)) : world;
    const std::string warning = thread_load_warning(threads, ranks_here, busy);
    if (!warning.empty()) say("  warning: " + warning);
  }
  if (start_step_ > 0) {
    say(fmt::format("  resumed from {} at step {} (epoch {}, batch {})", plan_.checkpoint, start_step_,
                    start_step_ / steps_per_epoch_ + 1, start_step_ % steps_per_epoch_));
  }

  if (step_ >= total_steps_) {
    say(fmt::format("the checkpoint is at step {}, the end of this run ({} steps): nothing to train",
                    step_, total_steps_));
    return 0;
  }
  const int64_t prefetch = this->prefetch();
  if (prefetch > 0) {
    loader_ = std::make_unique<BatchLoader>(data_.train, *sampler_, steps_per_epoch_,
                                            config_.get_int("train.grad_accum"), step_,
                                            total_steps_, prefetch, device_, augment_);
  }
  const int64_t k = config_.get_int("train.steps_per_execution");
  const int64_t log_every = config_.get_int("train.log_every");
  const int64_t ckpt_every = config_.get_int("output.checkpoint_every");
  const int64_t eval_every = config_.get_int("train.eval_every");
  int64_t last_eval_step = step_;
  int64_t last_log = step_, last_ckpt = step_, last_check = step_;
  const int64_t sync_every = config_.get_int("train.sync_every");
  check_every_ = sync_every > 0 ? sync_every : 1;
  segment_start_ = Clock::now();
  const double max_time = config_.get_float("train.max_time_s");
  // [interrupted, out of time, cost of a stop check (s), time per step (s)],
  // the largest over the ranks: every rank stops, and sets the cadence of
  // the stop checks, at the same step.
  // Then the non-finite steps' count and -(the first), Note [Non-finite steps].
  const at::Tensor stop_flags =
      at::zeros({6}, at::TensorOptions().dtype(at::kDouble).device(device_));
  bool out_of_time = false;
  prepare_fused_steps(k);
  while (step_ < total_steps_) {
    // Executions: every K steps of an epoch and at its end. All decisions
    // that involve collectives depend on the step (and the agreed cadence)
    // alone, so every rank takes them at the same point; see Note [Host
    // synchronisation points].
    const int64_t in_epoch = step_ % steps_per_epoch_;
    const int64_t n = std::min({k - in_epoch % k, steps_per_epoch_ - in_epoch, total_steps_ - step_});
    run_steps(step_, n);
    step_ += n;
    window_steps_ += n;
    epoch_steps_ += n;
    segment_steps_ += n;
    const bool epoch_end = step_ % steps_per_epoch_ == 0 || step_ == total_steps_;
    const bool log = step_ / log_every > last_log / log_every || step_ == total_steps_;
    const bool eval = eval_every > 0 && step_ / eval_every > last_eval_step / eval_every;
    if (eval_every > 0) last_eval_step = step_;
    const bool ckpt =
        ckpt_every > 0 && step_ / ckpt_every > last_ckpt / ckpt_every && step_ < total_steps_;
    const bool check = step_ / check_every_ > last_check / check_every_;
    if (!epoch_end && !log && !eval && !ckpt && !check) continue;  // no value read: run ahead

    if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
    ++sync_points_;
    const auto synced = Clock::now();
    const double elapsed = seconds_between(segment_start_, synced);
    window_seconds_ += elapsed;
    epoch_seconds_ += elapsed;

    const double step_s = elapsed / static_cast<double>(segment_steps_);
    stop_flags.narrow(0, 0, 4).copy_(at::tensor({stop_requested() ? 1.0 : 0.0,
                                                 max_time > 0 && elapsed_s() >= max_time ? 1.0 : 0.0,
                                                 check_cost(), step_s}));
    stop_flags.narrow(0, 4, 2).copy_(nonfinite_.narrow(0, 0, 2));
    world_.allreduce_max_(stop_flags);
    const at::Tensor flags = stop_flags.cpu();
    const double* agreed = flags.const_data_ptr<double>();
    nonfinite_steps_ = static_cast<int64_t>(agreed[4]);
    if (nonfinite_mode_ == NonFinite::kError && std::isfinite(agreed[5])) {
      return fail_nonfinite(static_cast<int64_t>(-agreed[5]));
    }
    const bool stop = agreed[0] > 0;
    out_of_time = agreed[1] > 0 && step_ < total_steps_;
    agreed_check_s_ = agreed[2];
    agreed_step_s_ = agreed[3];
    if (sync_every == 0) check_every_ = stop_check_cadence(agreed_check_s_, agreed_step_s_);
    last_check = step_;
    segment_steps_ = 0;

    if (rank0_ && progress_->is_bar()) {
      const int64_t in_epoch = (step_ - 1) % steps_per_epoch_ + 1;
      const double rate = static_cast<double>(epoch_steps_ * batch) / std::max(1e-9, epoch_seconds_);
      const double eta = static_cast<double>((steps_per_epoch_ - in_epoch) * batch) / std::max(1.0, rate);
      progress_->bar(bar_text((step_ - 1) / steps_per_epoch_ + 1, epochs, in_epoch, steps_per_epoch_,
                              epoch_loss_[0].item<double>() / std::max(1.0, epoch_loss_[1].item<double>()),
                              rate, eta),
                     epoch_end);
    }
    if (log) {
      log_window(step_);
      last_log = step_;
    }
    if (epoch_end && !stop) {
      end_epoch(step_);
    } else if (eval && !stop) {
      end_epoch(step_, /*epoch_end=*/false);
    } else if (out_of_time && !stop) {
      end_epoch(step_, /*epoch_end=*/false);  // the run's final validation
    }
    if (stop) {
      save_checkpoint("interrupted");
      say(fmt::format("interrupted at step {}: continue with  fusetrain train --resume {}", step_,
                      last_checkpoint_));
      world_.barrier();
      return 130;
    }
    if (out_of_time) {
      say(fmt::format("train.max_time_s={:g} s reached at step {} of {}", max_time, step_, total_steps_));
      break;
    }
    if (ckpt) {
      save_checkpoint("every " + std::to_string(ckpt_every) + " steps");
      last_ckpt = step_;
    }
    segment_start_ = Clock::now();
    if (!epoch_end && !log && !eval && !ckpt) {
      // A stop check alone: the device idled from `synced` to the next launch.
      check_costs_[next_check_cost_] = seconds_between(synced, segment_start_);
      next_check_cost_ = (next_check_cost_ + 1) % check_costs_.size();
    }
  }
  save_checkpoint("final");
  say(fmt::format("done: {} steps in {}; test accuracy {:.2f}%, test loss {:.4f}{}; checkpoint {}",
                  step_ - start_step_, duration_text(elapsed_s()), 100.0 * last_eval_.accuracy,
                  last_eval_.loss,
                  ema_.empty() ? ""
                               : fmt::format("; EMA accuracy {:.2f}%, loss {:.4f}",
                                             100.0 * last_ema_eval_.accuracy, last_ema_eval_.loss),
                  last_checkpoint_));
  say(fmt::format("  host: {} synchronisations in {} steps; stop checks every {} step{} ({})",
                  sync_points_, step_ - start_step_, check_every_, check_every_ == 1 ? "" : "s",
                  sync_every > 0 ? "train.sync_every"
                                 : fmt::format("measured: a check {:.0f} us, a step {:.0f} us",
                                               1e6 * agreed_check_s_, 1e6 * agreed_step_s_)));
  if (loader_) {
    say(fmt::format("  data: the steps waited {:.3f} s in all for the loader thread ({} steps ahead)",
                    loader_->wait_seconds(), prefetch));
  }
  if (rank0_ && config_.get_bool("output.curves")) {
    std::string why;
    const std::string image = draw_curves(plan_.run_dir, 120.0, &why);
    say(image.empty() ? "  curves: not drawn: " + why : "  curves: " + image);
  }
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
  const bool plugin = !config.get_string("model.library").empty();
  config.check_model_keys();
  const auto& builtin = builtin_models();
  if (!plugin && std::find(builtin.begin(), builtin.end(), model) == builtin.end()) {
    std::string names;
    for (const auto& n : builtin) names += (names.empty() ? "" : ", ") + n;
    throw config.error("model.name", "is not accepted; accepted values: " + names +
                                         " (built in), or the name a plugin registers, with "
                                         "model.library naming the plugin's file");
  }
  if (!config.get_string("model.pretrained").empty() && (plugin || !is_hf_model(model))) {
    throw config.error("model.pretrained", "reads Hugging Face checkpoints into model.name=gpt2 or llama");
  }
  if (policy.is_float8()) {
    if (model == "torchscript" || plugin || is_hf_model(model)) {
      throw config.error("precision.policy",
                         "mixed_float8 swaps the linear layers of mlp, cnn and gpt; for " + model +
                             " use mixed_bfloat16 (or, in Python, fusetrain.amp.apply_policy)");
    }
    try {
      amp::check_float8_device(cuda ? c10::Device(c10::DeviceType::CUDA, 0) : c10::Device(c10::kCPU));
    } catch (const c10::Error& e) {
      throw config.error("precision.policy", e.what_without_backtrace());
    }
  }
  const std::string& data = config.get_string("data.name");
  const bool tokens = data == "text" || data == "tokens" || data == "synthetic_tokens" ||
                      (data == "synthetic" && is_token_model(model));
  if (model != "torchscript" && !config.get_string("precision.float32_modules").empty()) {
    throw config.error("precision.float32_modules",
                       "names submodules of a TorchScript model (model.name=torchscript); the "
                       "built-in models have precision.float32_head");
  }
  if (model == "torchscript") {
    const std::string& path = config.get_string("model.path");
    if (path.empty()) throw config.error("model.path", "model.name=torchscript needs the module's file");
    if (!is_file(path)) throw config.error("model.path", "no such file");
  } else if (!plugin && is_token_model(model) != tokens) {
    throw config.error("model.name", is_token_model(model)
                                         ? model + " trains on tokens: set data.name=tokens, text or synthetic"
                                         : model + " trains on images or feature vectors: set data.name=fashion_mnist, tensors or synthetic");
  }
  if (plugin && !is_file(config.get_string("model.library"))) {
    throw config.error("model.library", "no such file (build the plugin with fusetrain_add_model_plugin)");
  }
  if (model == "cnn") cnn_convs_per_block(config);  // throws on a count per block that does not fit
  check_data_available(config);
}

void resolve_auto_policy(Config& config) {
  if (config.get_string("precision.policy") != "auto") return;
  const bool cuda = config.get_string("runtime.device") == "cuda";
  if (cuda && !torch::cuda::is_available()) return;
  const amp::Policy best = amp::best_policy(cuda ? c10::DeviceType::CUDA : c10::DeviceType::CPU);
  config.set("precision.policy", best.name(), "auto: " + best.reason());
}

int threads_for(const Config& config, int local_world_size) {
  const int64_t t = config.get_int("runtime.threads");
  if (t > 0) return static_cast<int>(t);
  return std::max(1, available_cores() / std::max(1, local_world_size));
}

at::Device device_of(const Config& config, int local_rank) {
  if (config.get_string("runtime.device") == "cuda") return at::Device(at::kCUDA, local_rank);
  return at::Device(at::kCPU);
}

int run_training(const Config& config, const RunPlan& plan, const Distributed& world) {
  Trainer trainer(config, plan, world);
  return trainer.run();
}

}  // namespace fusetrain::trainer

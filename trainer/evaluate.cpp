#include "evaluate.h"

#include "checkpoint.h"
#include "format.h"
#include "hf_models.h"
#include "progress.h"
#include "state.h"
#include "train.h"

#include <chrono>
#include <iostream>

namespace fusetrain::trainer {

EvalResult evaluate(ModelImpl& model, const Split& split, const Distributed& world,
                    const amp::Policy& policy, c10::DeviceType device_type, int64_t batch,
                    std::vector<at::Tensor>* logits_out) {
  const bool was_training = model.is_training();
  model.eval();
  at::NoGradGuard no_grad;
  // Batch-norm statistics as rank 0 has them (the checkpoint's).
  world.broadcast_(model.buffers());
  const auto [begin, end] = eval_shard(split.size(), world.world_size(), world.rank());
  const at::Tensor sums =
      at::zeros({3}, at::TensorOptions().dtype(at::kDouble).device(split.inputs.device()));
  for (int64_t i = begin; i < end; i += batch) {
    const int64_t n = std::min(batch, end - i);
    const at::Tensor x = split.inputs.narrow(0, i, n);
    const at::Tensor y = split.targets.narrow(0, i, n);
    at::Tensor logits;
    {
      const amp::AutocastGuard autocast(device_type, policy);
      logits = model.forward(x);
    }
    const at::Tensor flat = logits.to(at::kFloat).reshape({-1, logits.size(-1)});
    const at::Tensor targets = y.reshape({-1});
    sums[0].add_(float32_cross_entropy(logits, y, at::Reduction::Sum));
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

int run_eval(const std::string& checkpoint, const std::vector<std::string>& overrides,
             const std::string& predictions_path) {
  Config config = config_from_checkpoint(checkpoint);
  for (const auto& o : overrides) config.apply_override(o);
  resolve_auto_policy(config);
  check_before_start(config, 1, 1);
  const at::Device device = device_of(config, 0);
  const amp::Policy policy(config.get_string("precision.policy"));
  const Dataset data = load_dataset(config, device);
  const TensorDict ckpt = read_checkpoint(checkpoint);
  Model model = make_model(config, data, stored_hf_config(ckpt));
  model->to(device);
  if (wants_channels_last(config)) model->use_channels_last();
  load_model(ckpt, checkpoint, model);
  std::vector<at::Tensor> logits;
  const auto t0 = std::chrono::steady_clock::now();
  const EvalResult r = evaluate(*model, data.test, Distributed(), policy, device.type(),
                                config.get_int("data.eval_batch_size"),
                                predictions_path.empty() ? nullptr : &logits);
  const int64_t step = checkpoint_entry(ckpt, "trainer.step", checkpoint).item<int64_t>();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cout << fmt::format("{} (step {}): test loss {:.4f}  accuracy {:.2f}%  ({} {}, {}, {})\n",
                           checkpoint, step, r.loss, 100.0 * r.accuracy, r.count,
                           data.is_tokens ? "tokens" : "samples", policy.name(),
                           duration_text(seconds));
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

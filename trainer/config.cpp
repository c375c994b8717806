// The configuration schema, YAML reading (yaml-cpp) with file:line in every
// error, command-line overrides and the resolved-config writer.
#include "config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace fusetrain::trainer {

namespace {

constexpr double kInf = 1e300;

KeySpec key(std::string name, KeyType type, std::string def, std::string help,
            std::vector<std::string> choices = {}, double min = -kInf, double max = kInf) {
  return KeySpec{std::move(name), type, std::move(def), std::move(choices), min, max,
                 std::move(help)};
}

std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? sep : "") + parts[i];
  return out;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

std::string section_of(const std::string& k) { return k.substr(0, k.find('.')); }

std::vector<std::string> sections() {
  std::vector<std::string> out;
  for (const auto& s : config_schema()) {
    const std::string sec = section_of(s.key);
    if (std::find(out.begin(), out.end(), sec) == out.end()) out.push_back(sec);
  }
  return out;
}

std::vector<std::string> keys_of_section(const std::string& section) {
  std::vector<std::string> out;
  for (const auto& s : config_schema()) {
    if (section_of(s.key) == section) out.push_back(s.key.substr(section.size() + 1));
  }
  return out;
}

// Edit distance, to suggest the key a typo meant.
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1] ? 1 : 0)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string suggestion(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_d = 3;  // suggest only close misspellings
  for (const auto& c : candidates) {
    const size_t d = edit_distance(word, c);
    if (d < best_d) best_d = d, best = c;
  }
  return best.empty() ? "" : " (did you mean \"" + best + "\"?)";
}

// The shortest text that reads back as `v`, in a form YAML 1.1 readers
// (PyYAML) take for a float too: a dot in the mantissa ("0.0003", "1.0e-08").
std::string canonical_float(double v) {
  char buf[64];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string text = buf;
  if (text.find_first_of(".ni") == std::string::npos) {  // not "inf"/"nan"
    const auto e = text.find('e');
    text.insert(e == std::string::npos ? text.size() : e, ".0");
  }
  return text;
}

// A float key's value as the config shows it (--print-config, config.yaml,
// errors): an integral value as its digits ("600", not "6.0e+02"), any other
// as canonical_float's shortest round trip.
std::string display_float(double v) {
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.0f", v);
    return buf;
  }
  return canonical_float(v);
}

const char* type_name(KeyType t) {
  switch (t) {
    case KeyType::kInt: return "an integer";
    case KeyType::kFloat: return "a number";
    case KeyType::kBool: return "true or false";
    case KeyType::kString: return "a string";
    case KeyType::kIntList: return "a list of integers";
  }
  return "";
}

// A bound as the user would write it: every digit of an integer key's
// (1000000000000000, not 1e+15), the shortest round trip of a float's.
std::string bound_text(const KeySpec& s, double v) {
  if (s.type == KeyType::kInt || s.type == KeyType::kIntList) {
    return std::to_string(static_cast<int64_t>(v));
  }
  return display_float(v);
}

std::string bounds_text(const KeySpec& s) {
  std::ostringstream out;
  if (s.min > -kInf && s.max < kInf) {
    out << " in [" << bound_text(s, s.min) << ", " << bound_text(s, s.max) << "]";
  } else if (s.min > -kInf) {
    out << " >= " << bound_text(s, s.min);
  } else if (s.max < kInf) {
    out << " <= " << bound_text(s, s.max);
  }
  return out.str();
}

std::string accepted_text(const KeySpec& s) {
  if (!s.choices.empty()) return "accepted values: " + join(s.choices, ", ");
  return std::string("accepted: ") + type_name(s.type) + bounds_text(s);
}

bool parse_int(const std::string& text, int64_t& out) {
  const std::string t = (!text.empty() && text[0] == '+') ? text.substr(1) : text;
  if (t.empty()) return false;
  const auto [ptr, ec] = std::from_chars(t.data(), t.data() + t.size(), out);
  return ec == std::errc() && ptr == t.data() + t.size();
}

bool parse_float(const std::string& text, double& out) {
  if (text.empty()) return false;
  char* end = nullptr;
  errno = 0;
  out = std::strtod(text.c_str(), &end);
  return errno == 0 && end == text.c_str() + text.size() && std::isfinite(out);
}

bool parse_bool(const std::string& text, bool& out) {
  std::string t = text;
  std::transform(t.begin(), t.end(), t.begin(), [](unsigned char c) { return std::tolower(c); });
  if (t == "true" || t == "yes" || t == "on" || t == "1") return out = true, true;
  if (t == "false" || t == "no" || t == "off" || t == "0") return out = false, true;
  return false;
}

std::vector<std::string> split_list(const std::string& text) {
  std::string t = trim(text);
  if (t.size() >= 2 && t.front() == '[' && t.back() == ']') t = t.substr(1, t.size() - 2);
  std::vector<std::string> out;
  if (trim(t).empty()) return out;
  std::stringstream ss(t);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(trim(item));
  return out;
}

}  // namespace

// Said in the help of every is_path_key key.
constexpr const char* kPathRule =
    "; a relative path in a config file is relative to that file's directory, one given with "
    "--set to the working directory";

const std::vector<KeySpec>& config_schema() {
  using K = KeyType;
  static const std::vector<KeySpec> schema = {
      key("model.name", K::kString, "cnn",
          "architecture: mlp, cnn, resnet, gpt, gpt2 or llama (Hugging Face's layouts; "
          "model.pretrained loads a checkpoint), torchscript (deprecated: the module in "
          "model.path), or a name a plugin registers (model.library)"),
      key("model.library", K::kString, "",
          "a model plugin: a shared library built with fusetrain_add_model_plugin whose "
          "FUSETRAIN_REGISTER_MODEL registers model.name; its own keys go under model: too" +
              std::string(kPathRule)),
      key("model.pretrained", K::kString, "",
          "gpt2, llama: a Hugging Face model folder (config.json, model.safetensors or "
          "model.safetensors.index.json with its shards) to build the model from and load; "
          "empty: train from scratch, sized by model.*" + std::string(kPathRule)),
      key("model.path", K::kString, "",
          "torchscript (deprecated; use a plugin): a module saved with "
          "torch.jit.save(torch.jit.script(m) or trace); its forward takes a batch of inputs "
          "and returns logits" + std::string(kPathRule)),
      key("model.channels", K::kIntList, "16,32",
          "cnn: output channels of each block (3x3 conv, batch norm, ReLU, 2x2 max pool)", {}, 1,
          4096),
      key("model.convs_per_block", K::kIntList, "1",
          "cnn: 3x3 conv + batch norm + ReLU layers before each block's pooling: one count for "
          "every block, or one per block (as many as model.channels)", {}, 1, 16),
      key("model.channels_last", K::kBool, "true",
          "cnn, resnet: convolution kernels and activations in channels_last layout (faster "
          "oneDNN convolutions; same values and checkpoints; off under parallel.shard)"),
      key("model.fused_batch_norm", K::kBool, "true",
          "cnn, resnet: batch norm + ReLU as one fused op forward and backward on the CPU "
          "(fusetrain::nn::batch_norm_relu; same parameters and checkpoints); torch's ops when "
          "false"),
      key("model.fused_block_ops", K::kBool, "true",
          "gpt, gpt2, llama: layer/RMS norms with the residual add, bias + GELU and SwiGLU as "
          "fusetrain's fused ops (fusetrain::nn::add_layer_norm and friends; same parameters, "
          "checkpoints and loss curve); torch's ops when false"),
      key("model.fused_head_loss", K::kBool, "true",
          "gpt: the head and the training loss as one chunked op "
          "(fusetrain::nn::linear_cross_entropy: the [tokens, vocabulary] logits are never held; "
          "the same loss up to fp32 rounding); the head's logits, then the cross-entropy, when "
          "false"),
      key("model.fused_max_pool", K::kBool, "true",
          "cnn: each 2x2 max pooling through fusetrain's window op on the CPU (a byte per "
          "window instead of int64 indices, no zero-fill or layout copies backward; the same "
          "values and gradients bit for bit); torch's max_pool2d when false"),
      key("model.hidden", K::kIntList, "128",
          "mlp: hidden layer sizes; cnn: fully connected layers before the head", {}, 1, 65536),
      key("model.dropout", K::kFloat, "0", "dropout before the head (mlp, cnn) and in gpt", {},
          0, 0.99),
      key("model.depth", K::kInt, "18", "resnet depth", {"18", "50"}),
      key("model.width", K::kInt, "64", "resnet: channels of the first stage", {}, 1, 4096),
      key("model.n_layer", K::kInt, "4", "gpt: transformer blocks", {}, 1, 1024),
      key("model.n_head", K::kInt, "4", "gpt: attention heads (divides d_model)", {}, 1, 1024),
      key("model.d_model", K::kInt, "128", "gpt: embedding width", {}, 8, 65536),
      key("model.seq_len", K::kInt, "128", "gpt: context length in tokens", {}, 2, 1 << 20),
      key("model.vocab_size", K::kInt, "0",
          "gpt on data.name=tokens: the vocabulary (every id below it; 0: 1 + the largest id); "
          "text: 256", {}, 0, 1 << 24),
      key("model.n_kv_head", K::kInt, "0",
          "llama: key/value heads (grouped-query attention; divides n_head); 0: n_head", {}, 0,
          1024),
      key("model.d_ff", K::kInt, "0",
          "gpt2, llama: the MLP's hidden width; 0: 4 x d_model (gpt2), 8/3 x d_model rounded up "
          "to a multiple of 64 (llama)", {}, 0, 1 << 20),
      key("model.rope_theta", K::kFloat, "10000", "llama: the rotary embeddings' base", {}, 1),
      key("model.norm_eps", K::kFloat, "1e-05", "gpt2, llama: the layer/RMS norms' epsilon", {},
          0, 1),
      key("model.tie_embeddings", K::kBool, "true",
          "gpt2 (always), llama: the head's weight is the token embedding's"),

      key("data.name", K::kString, "fashion_mnist",
          "dataset (tensors: inputs and labels in a .safetensors or torch.save file; tokens: a "
          "file of token ids; text: the bytes of a text file; synthetic: generated images, or "
          "tokens for gpt)",
          {"fashion_mnist", "tensors", "tokens", "text", "synthetic", "synthetic_images",
           "synthetic_tokens"}),
      key("data.path", K::kString, "/usr/share/datasets/fashion-mnist",
          "fashion_mnist: directory of the gzip IDX files; tensors, tokens, text: the file" + std::string(kPathRule)),
      key("data.val_path", K::kString, "",
          "tensors, tokens, text: a separate validation file of the same kind (empty: "
          "data.val_fraction of data.path)" + std::string(kPathRule)),
      key("data.val_fraction", K::kFloat, "0.1",
          "tensors, tokens, text without data.val_path: the share held out for validation "
          "(tensors: a seeded random subset; tokens, text: the end of the stream)", {}, 0.0001,
          0.9),
      key("data.mean", K::kFloat, "0",
          "tensors: inputs are normalised to (x - mean) / std, uint8 inputs after scaling to "
          "[0, 1]", {}),
      key("data.std", K::kFloat, "1", "tensors: see data.mean", {}, 1e-12),
      key("data.token_dtype", K::kString, "uint16", "tokens: width of the ids in the file",
          {"uint16", "uint32"}),
      key("data.context", K::kInt, "0",
          "tokens, text: tokens per training window (0: model.seq_len)", {}, 0, 1 << 20),
      key("data.batch_size", K::kInt, "128",
          "global batch per optimizer step, split over ranks and accumulation micro-batches", {},
          1, 1 << 24),
      key("data.prefetch", K::kInt, "-1",
          "steps whose batches a background thread prepares ahead of the training step, from the "
          "training data in host memory (on CUDA through pinned memory and a copy stream); 0: no "
          "loader thread, the training data on the device and each step gathering its own batch; "
          "-1: 2 on CUDA, 0 on a CPU (where a third thread beside the step's costs more than the "
          "gather it saves)",
          {}, -1, 1024),
      key("data.eval_batch_size", K::kInt, "256", "samples per evaluation forward, per rank", {},
          1, 1 << 24),
      key("data.train_samples", K::kInt, "0",
          "training samples to use (0: all; synthetic: 10000)", {}, 0, 1e12),
      key("data.test_samples", K::kInt, "0", "test samples to use (0: all; synthetic: 2000)", {},
          0, 1e12),
      key("data.seed", K::kInt, "0", "seed of the data order and of synthetic data", {}, 0, 1e15),
      key("data.random_crop_padding", K::kInt, "0",
          "images: pad each training image by this many zero pixels a side and crop it back at a "
          "random offset (per sample, from data.seed; 0: off)", {}, 0, 64),
      key("data.random_hflip", K::kBool, "false",
          "images: mirror each training image left-right with probability 1/2 (per sample, from "
          "data.seed)"),
      key("data.image_size", K::kInt, "32", "synthetic_images: height and width", {}, 4, 4096),
      key("data.channels", K::kInt, "3", "synthetic_images: channels", {}, 1, 4096),
      key("data.num_classes", K::kInt, "0",
          "classes (synthetic: 0 means 10; tensors: every label below it, 0: 1 + the largest "
          "label)", {}, 0, 1 << 20),

      key("train.epochs", K::kInt, "8", "passes over the training set", {}, 1, 1e9),
      key("train.max_steps", K::kInt, "0",
          "optimizer steps of the run (0: epochs x steps per epoch); the schedule follows it", {},
          0, 1e15),
      key("train.max_time_s", K::kFloat, "0",
          "stop after this many seconds of the run (at the next stop check, train.sync_every), "
          "evaluate and write the final checkpoint; the schedule still follows the planned steps "
          "(0: no limit)", {}, 0, 1e9),
      key("train.grad_accum", K::kInt, "1", "micro-batches accumulated per optimizer step", {}, 1,
          1 << 20),
      key("train.steps_per_execution", K::kInt, "1",
          "steps run as one execution (one CUDA graph on cuda); host synchronisations (logging, "
          "evaluation, checkpoints, stop checks) fall on execution bounds", {}, 1, 1 << 20),
      key("train.sync_every", K::kInt, "0",
          "steps between stop checks (Ctrl-C, train.max_time_s), the host synchronisations beside "
          "logging, evaluation and checkpoints, at the first execution bound at or past each "
          "multiple; 0: measured as the run goes, the fewest steps over which a check costs under "
          "1% of their time", {}, 0, 1e15),
      key("train.cuda_graphs", K::kBool, "true",
          "cuda: capture each execution of steps_per_execution > 1 steps as one CUDA graph"),
      key("train.clip_grad_norm", K::kFloat, "0", "clip the global gradient L2 norm (0: off)", {},
          0),
      key("train.ema_decay", K::kFloat, "0",
          "keep an exponential moving average of the weights with this decay per step (0: off), "
          "evaluated beside them (ema_accuracy) and kept in checkpoints", {}, 0, 0.999999),
      key("train.nonfinite", K::kString, "error",
          "a step whose loss or gradient norm is NaN or inf (under float16 loss scaling: whose "
          "loss is; a gradient overflow is the scaler's to skip): error stops the run at the "
          "next host synchronisation (exit 1) naming the step, its samples and the cause, with "
          "no checkpoint written after it; skip skips the step (weights, optimizer state and "
          "batch-norm statistics unchanged) and counts it in the log (nonfinite); ignore trains "
          "on. Checked on the device: no host sync per step",
          {"error", "skip", "ignore"}),
      key("train.label_smoothing", K::kFloat, "0",
          "classification: the training loss's label smoothing (torch's cross_entropy "
          "label_smoothing; evaluation reports the plain loss)", {}, 0, 1),
      key("train.seed", K::kInt, "0", "seed of the initialisation and of dropout", {}, 0, 1e15),
      key("train.log_every", K::kInt, "50", "steps between metrics.jsonl records", {}, 1, 1e15),
      key("train.eval_every", K::kInt, "0",
          "also evaluate every N steps (0: at the end of each epoch only)", {}, 0, 1e15),

      key("optimizer.name", K::kString, "adamw", "fused optimizer", {"adamw", "sgd"}),
      key("optimizer.lr", K::kFloat, "0.001", "peak learning rate", {}, 0),
      key("optimizer.weight_decay", K::kFloat, "0.01",
          "weight decay (decoupled for adamw, L2 for sgd)", {}, 0),
      key("optimizer.beta1", K::kFloat, "0.9", "adamw: first moment decay", {}, 0, 0.999999),
      key("optimizer.beta2", K::kFloat, "0.999", "adamw: second moment decay", {}, 0, 0.999999),
      key("optimizer.eps", K::kFloat, "1e-08", "adamw: denominator epsilon", {}, 0),
      key("optimizer.momentum", K::kFloat, "0.9", "sgd: momentum", {}, 0, 1),
      key("optimizer.nesterov", K::kBool, "false", "sgd: Nesterov momentum"),

      key("schedule.warmup_steps", K::kInt, "0", "linear warm-up steps", {}, 0, 1e15),
      key("schedule.decay", K::kString, "cosine", "decay after the warm-up", {"cosine", "none"}),
      key("schedule.min_lr_ratio", K::kFloat, "0", "final learning rate / peak", {}, 0, 1),

      key("precision.policy", K::kString, "auto",
          "compute precision (auto: mixed_bfloat16 on GPUs with bf16, mixed_float16 on older "
          "ones; on a CPU mixed_bfloat16 with AMX-BF16, or with AVX512-BF16 where a 0.1 s "
          "probe runs bf16 convolutions and matmuls 1.2x faster than float32, else float32; "
          "resolved at start and written to the run's config)",
          {"auto", "float32", "mixed_float16", "mixed_bfloat16", "mixed_float8"}),
      key("precision.fp8_min_features", K::kInt, "1024",
          "mixed_float8: linear layers whose in and out features are both at least this (and "
          "multiples of 16) run their GEMMs in float8; the others in bfloat16", {}, 1, 1e15),
      key("precision.fp8_scaling", K::kString, "delayed",
          "mixed_float8: per-tensor scales from the amax history (delayed) or from each "
          "tensor's own amax (current)",
          {"delayed", "current"}),
      key("precision.fp8_amax_history", K::kInt, "16",
          "mixed_float8, delayed scaling: amaxes kept per tensor", {}, 1, 1024),
      key("precision.master_weights", K::kBool, "false",
          "keep the model in 16 bits with float32 master weights in the optimizer"),
      key("precision.float32_head", K::kBool, "true",
          "run the final layer and the loss in float32 (a float32 island)"),
      key("precision.float32_modules", K::kString, "",
          "model.name=torchscript: submodules (comma-separated names as in the Python module's "
          "named_modules()) whose forward runs in float32 under a mixed policy (float32 islands)"),
      key("precision.init_scale", K::kFloat, "65536", "mixed_float16: initial loss scale", {},
          1e-30),
      key("precision.growth_interval", K::kInt, "2000",
          "mixed_float16: overflow-free steps before the scale doubles", {}, 1, 1e15),

      key("parallel.comm_hook", K::kString, "none",
          "how DDP reduces gradients (none: allreduce in float32; fp16/bf16: compressed to 16 "
          "bits; powersgd: low-rank PowerSGD, whose state a resume starts afresh)",
          {"none", "allreduce", "fp16", "bf16", "powersgd"}),
      key("parallel.shard", K::kString, "none",
          "ZeRO across the data-parallel ranks: shard the optimizer state (optimizer, stage 1) "
          "or the optimizer state and the gradients (gradients, stage 2); none: replicate",
          {"none", "optimizer", "gradients"}),
      key("parallel.shared_memory", K::kBool, "true",
          "ranks that all run on one host allreduce dense CPU tensors through shared memory "
          "instead of gloo's TCP (the same sums; false: gloo for everything)"),
      key("parallel.powersgd_rank", K::kInt, "1", "PowerSGD's matrix approximation rank", {}, 1,
          1e6),
      key("parallel.powersgd_start_iter", K::kInt, "1000",
          "steps of plain allreduce before PowerSGD compresses", {}, 2, 1e15),

      key("runtime.device", K::kString, "cpu", "where to train", {"cpu", "cuda"}),
      key("runtime.nproc", K::kInt, "1", "local data-parallel processes to spawn", {}, 1, 4096),
      key("runtime.threads", K::kInt, "0",
          "intra-op threads per process (0: cores / local processes, at least 1)", {}, 0, 4096),
      key("runtime.nnodes", K::kInt, "1",
          "hosts of the run, each running this launcher with runtime.nproc processes", {}, 1,
          65536),
      key("runtime.node_rank", K::kInt, "0", "this host's index among runtime.nnodes (0 hosts "
          "the rendezvous store)", {}, 0, 65535),
      key("runtime.master_addr", K::kString, "127.0.0.1",
          "address of host 0, where its launcher hosts the rendezvous store (bound to this "
          "address only)"),
      key("runtime.master_port", K::kInt, "0",
          "port of the rendezvous store on host 0 (0: one host picks a free port; several hosts "
          "need it set)", {}, 0, 65535),
      key("runtime.timeout_s", K::kInt, "300",
          "bound on the rendezvous and on every collective, seconds", {}, 1, 1e7),

      key("output.run_dir", K::kString, "",
          "run directory (empty: runs/<config name>-<date>-<time>)" + std::string(kPathRule)),
      key("output.checkpoint_every", K::kInt, "0", "steps between checkpoints (0: at the end only)",
          {}, 0, 1e15),
      key("output.keep_checkpoints", K::kInt, "3", "periodic checkpoints kept (oldest removed)",
          {}, 1, 1e9),
      key("output.progress", K::kString, "auto",
          "progress display (auto: a bar on a terminal, lines otherwise)", {"auto", "bar", "lines"}),
      key("output.curves", K::kBool, "true",
          "at the end, draw curves.png in the run directory with `$FUSETRAIN_PYTHON -m "
          "fusetrain.plot` (python3 when unset; skipped with a note where it cannot run)"),
  };
  return schema;
}

Config::Config() {
  // Through set(), so that defaults are canonical like every other value.
  for (const auto& s : config_schema()) set(s.key, s.default_value, "default");
}

const KeySpec& Config::spec(const std::string& k) const {
  for (const auto& s : config_schema()) {
    if (s.key == k) return s;
  }
  const std::string sec = section_of(k);
  const auto secs = sections();
  if (k.find('.') == std::string::npos ||
      std::find(secs.begin(), secs.end(), sec) == secs.end()) {
    throw UsageError("unknown key \"" + k + "\"" + suggestion(sec, secs) +
                     "; sections: " + join(secs, ", "));
  }
  const std::string rest = k.substr(sec.size() + 1);
  const auto keys = keys_of_section(sec);
  throw UsageError("unknown key \"" + k + "\"" + suggestion(rest, keys) + "; keys of " + sec +
                   ": " + join(keys, ", "));
}

namespace {

// A key a plugin may read: "model.<name>", one level, a plain identifier.
bool is_plugin_key(const std::string& k) {
  if (k.rfind("model.", 0) != 0 || k.size() == 6) return false;
  return std::all_of(k.begin() + 6, k.end(),
                     [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
}

bool in_schema(const std::string& k) {
  return std::any_of(config_schema().begin(), config_schema().end(),
                     [&](const KeySpec& s) { return s.key == k; });
}

}  // namespace

void Config::set(const std::string& k, const std::string& raw, const std::string& origin) {
  if (is_plugin_key(k) && !in_schema(k)) {
    plugin_keys_[k] = trim(raw);
    origins_[k] = origin;
    return;
  }
  const KeySpec* s = nullptr;
  try {
    s = &spec(k);
  } catch (const UsageError& e) {
    throw UsageError(origin + ": " + e.what());
  }
  const std::string text = trim(raw);
  auto bad = [&](const std::string& why) {
    return UsageError(origin + ": " + k + ": \"" + text + "\" " + why + "; " + accepted_text(*s) +
                      " (" + s->help + ")");
  };
  auto check_bounds = [&](double v) {
    if (v < s->min || v > s->max) throw bad("is out of range");
  };
  std::string canonical = text;
  switch (s->type) {
    case KeyType::kInt: {
      int64_t v = 0;
      if (!parse_int(text, v)) throw bad("is not an integer");
      check_bounds(static_cast<double>(v));
      canonical = std::to_string(v);
      break;
    }
    case KeyType::kFloat: {
      double v = 0;
      if (!parse_float(text, v)) throw bad("is not a number");
      check_bounds(v);
      canonical = display_float(v);
      break;
    }
    case KeyType::kBool: {
      bool v = false;
      if (!parse_bool(text, v)) throw bad("is not a boolean");
      canonical = v ? "true" : "false";
      break;
    }
    case KeyType::kString:
      // A relative path is made absolute against the working directory now
      // (a config file's were already made relative to it): the resolved
      // config travels to the ranks in a private file elsewhere and into
      // checkpoints, and must name the same files there.
      if (is_path_key(k) && !text.empty() && std::filesystem::path(text).is_relative()) {
        canonical = std::filesystem::absolute(text).lexically_normal().string();
      }
      break;
    case KeyType::kIntList: {
      const auto items = split_list(text);
      if (items.empty()) throw bad("is an empty list");
      std::vector<std::string> parts;
      for (const auto& item : items) {
        int64_t v = 0;
        if (!parse_int(item, v)) throw bad("holds \"" + item + "\", not an integer");
        check_bounds(static_cast<double>(v));
        parts.push_back(std::to_string(v));
      }
      canonical = join(parts, ",");
      break;
    }
  }
  if (!s->choices.empty() &&
      std::find(s->choices.begin(), s->choices.end(), canonical) == s->choices.end()) {
    throw bad("is not accepted");
  }
  values_[k] = canonical;
  origins_[k] = origin;
}

void Config::apply_override(const std::string& assignment) {
  const auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0) {
    throw UsageError("--set \"" + assignment +
                     "\": expected key=value, e.g. --set optimizer.lr=3e-4");
  }
  set(trim(assignment.substr(0, eq)), assignment.substr(eq + 1), "--set " + assignment);
}

bool is_path_key(const std::string& key) {
  return key == "model.path" || key == "model.library" || key == "model.pretrained" ||
         key == "data.path" || key == "data.val_path" || key == "output.run_dir";
}

Config Config::from_yaml(const std::string& text, const std::string& origin,
                         const std::string& base_dir) {
  Config config;
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw UsageError(origin + ":" + std::to_string(e.mark.line + 1) + ": not valid YAML: " +
                     e.msg);
  }
  if (!root || root.IsNull()) return config;
  auto where = [&](const YAML::Node& n) {
    return origin + ":" + std::to_string(n.Mark().line + 1);
  };
  if (!root.IsMap()) {
    throw UsageError(where(root) + ": expected sections (model:, data:, train:, ...) at the top");
  }
  const auto secs = sections();
  for (const auto& section : root) {
    const std::string sec = section.first.as<std::string>();
    if (std::find(secs.begin(), secs.end(), sec) == secs.end()) {
      throw UsageError(where(section.first) + ": unknown section \"" + sec + "\"" +
                       suggestion(sec, secs) + "; sections: " + join(secs, ", "));
    }
    if (section.second.IsNull()) continue;
    if (!section.second.IsMap()) {
      throw UsageError(where(section.first) + ": section \"" + sec + "\" must hold keys");
    }
    for (const auto& item : section.second) {
      const std::string k = sec + "." + item.first.as<std::string>();
      const YAML::Node& v = item.second;
      std::string value;
      if (v.IsSequence()) {
        std::vector<std::string> parts;
        for (const auto& e : v) {
          if (!e.IsScalar()) throw UsageError(where(e) + ": " + k + ": list items must be values");
          parts.push_back(e.Scalar());
        }
        value = "[" + join(parts, ",") + "]";
      } else if (v.IsScalar() || v.IsNull()) {
        value = v.IsNull() ? "" : v.Scalar();
      } else {
        throw UsageError(where(item.first) + ": " + k + ": expected a value, not a mapping");
      }
      if (!base_dir.empty() && is_path_key(k) && !value.empty() &&
          std::filesystem::path(value).is_relative()) {
        value = (std::filesystem::path(base_dir) / value).lexically_normal().string();
      }
      config.set(k, value, where(item.first));
    }
  }
  return config;
}

Config Config::from_file(const std::string& path) {
  std::ifstream in(path);
  if (!in.good()) {
    throw UsageError("--config " + path + ": cannot open the file (configs/ holds the shipped ones)");
  }
  std::stringstream buf;
  buf << in.rdbuf();
  Config config = from_yaml(buf.str(), path, std::filesystem::path(path).parent_path().string());
  std::string base = path.substr(path.find_last_of('/') + 1);
  config.set_name(base.substr(0, base.find_last_of('.')));
  return config;
}

int64_t Config::get_int(const std::string& k) const {
  int64_t v = 0;
  parse_int(values_.at(spec(k).key), v);
  return v;
}

double Config::get_float(const std::string& k) const {
  double v = 0;
  parse_float(values_.at(spec(k).key), v);
  return v;
}

bool Config::get_bool(const std::string& k) const {
  bool v = false;
  parse_bool(values_.at(spec(k).key), v);
  return v;
}

const std::string& Config::get_string(const std::string& k) const { return values_.at(spec(k).key); }

std::vector<int64_t> Config::get_int_list(const std::string& k) const {
  std::vector<int64_t> out;
  for (const auto& item : split_list(values_.at(spec(k).key))) {
    int64_t v = 0;
    parse_int(item, v);
    out.push_back(v);
  }
  return out;
}

const std::string& Config::origin(const std::string& k) const {
  if (plugin_keys_.count(k)) return origins_.at(k);
  return origins_.at(spec(k).key);
}

std::vector<Config::ModelKey> Config::model_keys() const {
  std::vector<ModelKey> out;
  for (const auto& s : config_schema()) {
    if (section_of(s.key) != "model") continue;
    ModelKey m{s.key.substr(6), {}, origin(s.key)};
    switch (s.type) {
      case KeyType::kInt: m.value = get_int(s.key); break;
      case KeyType::kFloat: m.value = get_float(s.key); break;
      case KeyType::kBool: m.value = get_bool(s.key); break;
      case KeyType::kString: m.value = get_string(s.key); break;
      case KeyType::kIntList: m.value = get_int_list(s.key); break;
    }
    out.push_back(std::move(m));
  }
  for (const auto& [k, text] : plugin_keys_) {
    ModelKey m{k.substr(6), text, origins_.at(k)};
    bool b = false;
    int64_t i = 0;
    double d = 0;
    // As YAML reads a scalar: a number first ("1" is an integer, not true).
    if (parse_int(text, i)) {
      m.value = i;
    } else if (parse_float(text, d)) {
      m.value = d;
    } else if (parse_bool(text, b)) {
      m.value = b;
    } else if (text.find(',') != std::string::npos || (!text.empty() && text.front() == '[')) {
      std::vector<int64_t> list;
      bool ints = true;
      for (const auto& item : split_list(text)) {
        ints = ints && parse_int(item, i);
        list.push_back(i);
      }
      if (ints && !list.empty()) m.value = list;
    }
    out.push_back(std::move(m));
  }
  return out;
}

void Config::check_model_keys() const {
  if (plugin_keys_.empty() || !get_string("model.library").empty()) return;
  const auto& [k, text] = *plugin_keys_.begin();
  try {
    (void)spec(k);
  } catch (const UsageError& e) {
    throw UsageError(origins_.at(k) + ": " + e.what() +
                     " (a plugin's own keys are read when model.library names the plugin)");
  }
}

UsageError Config::error(const std::string& k, const std::string& message) const {
  const auto plugin = plugin_keys_.find(k);
  const std::string& v = plugin != plugin_keys_.end() ? plugin->second : values_.at(spec(k).key);
  return UsageError(k + "=" + v + " (" + origin(k) + "): " + message);
}

std::string Config::to_yaml() const {
  YAML::Emitter out;
  out << YAML::BeginMap;
  for (const auto& sec : sections()) {
    out << YAML::Key << sec << YAML::Value << YAML::BeginMap;
    for (const auto& s : config_schema()) {
      if (section_of(s.key) != sec) continue;
      out << YAML::Key << s.key.substr(sec.size() + 1) << YAML::Value;
      const std::string& v = values_.at(s.key);
      if (s.type == KeyType::kIntList) {
        out << YAML::Flow << YAML::BeginSeq;
        for (const auto& item : split_list(v)) out << item;
        out << YAML::EndSeq;
      } else if (s.type == KeyType::kString) {
        // Quoted, so that a string such as "1" or "" reads back as a string.
        out << YAML::DoubleQuoted << v;
      } else {
        out << v;
      }
    }
    if (sec == "model") {
      for (const auto& [k, v] : plugin_keys_) {
        out << YAML::Key << k.substr(6) << YAML::Value;
        if (!v.empty() && v.front() == '[') {
          out << YAML::Flow << YAML::BeginSeq;
          for (const auto& item : split_list(v)) out << item;
          out << YAML::EndSeq;
        } else {
          out << v;
        }
      }
    }
    out << YAML::EndMap;
  }
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

std::string describe_schema() {
  std::ostringstream out;
  std::string current;
  for (const auto& s : config_schema()) {
    const std::string sec = section_of(s.key);
    if (sec != current) out << "\n" << sec << ":\n", current = sec;
    out << "  " << s.key << " = " << (s.default_value.empty() ? "\"\"" : s.default_value) << "  "
        << s.help << "; " << accepted_text(s) << "\n";
  }
  return out.str();
}

namespace {

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (const unsigned char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

// The shortest text that reads back as `v` (1e-12, not 9.9999999999999998e-13).
std::string json_number(double v) {
  char buf[64];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

const char* json_type(KeyType t) {
  switch (t) {
    case KeyType::kInt: return "int";
    case KeyType::kFloat: return "float";
    case KeyType::kBool: return "bool";
    case KeyType::kString: return "string";
    case KeyType::kIntList: return "int_list";
  }
  return "";
}

// The default in its JSON type; the schema's defaults are checked at start
// (Config()), so they parse.
std::string json_default(const KeySpec& s) {
  switch (s.type) {
    case KeyType::kInt: return s.default_value;
    case KeyType::kFloat: {
      double v = 0;
      parse_float(s.default_value, v);
      return canonical_float(v);  // 1.0, not 1: a float in every JSON reader
    }
    case KeyType::kBool: {
      bool b = false;
      parse_bool(s.default_value, b);
      return b ? "true" : "false";
    }
    case KeyType::kString: return json_string(s.default_value);
    case KeyType::kIntList: return "[" + join(split_list(s.default_value), ", ") + "]";
  }
  return "null";
}

}  // namespace

std::string schema_json() {
  std::ostringstream out;
  out << "{\"keys\": [";
  bool first = true;
  for (const auto& s : config_schema()) {
    out << (first ? "\n" : ",\n") << "  {\"key\": " << json_string(s.key)
        << ", \"section\": " << json_string(section_of(s.key)) << ", \"type\": \""
        << json_type(s.type) << "\", \"default\": " << json_default(s) << ", \"choices\": [";
    for (size_t i = 0; i < s.choices.size(); ++i) out << (i ? ", " : "") << json_string(s.choices[i]);
    out << "], \"min\": " << (s.min > -kInf ? json_number(s.min) : "null")
        << ", \"max\": " << (s.max < kInf ? json_number(s.max) : "null")
        << ", \"help\": " << json_string(s.help) << "}";
    first = false;
  }
  out << "\n]}\n";
  return out.str();
}

}  // namespace fusetrain::trainer

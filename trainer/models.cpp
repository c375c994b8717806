// Model definitions: mlp, cnn, CIFAR-style ResNet-18/50 and a byte-level GPT;
// make_model, which also builds gpt2/llama (hf_models.cpp), TorchScript
// modules and plugins' models.
#include "models.h"

#include "block_ops.h"
#include "evaluate.h"

#include "hf_models.h"
#include "torchscript_model.h"

#include <fusetrain/amp/float8_linear.h>
#include <fusetrain/nn/batch_norm.h>
#include <fusetrain/nn/linear_cross_entropy.h>
#include <fusetrain/nn/max_pool.h>

#include <torch/nn.h>

#include <cmath>

namespace fusetrain::trainer {

namespace nn = torch::nn;

namespace {

at::Tensor batch_norm_act(nn::BatchNorm2dImpl& bn, const at::Tensor& x, bool relu, bool fused) {
  if (fused) return fusetrain::nn::batch_norm_relu(bn, x, relu);
  at::Tensor y = bn.forward(x);
  return relu ? y.relu_() : y;
}

}  // namespace

std::vector<int64_t> cnn_convs_per_block(const Config& config) {
  const size_t blocks = config.get_int_list("model.channels").size();
  std::vector<int64_t> convs = config.get_int_list("model.convs_per_block");
  if (convs.size() == 1) convs.resize(blocks, convs[0]);
  if (convs.size() != blocks) {
    throw config.error("model.convs_per_block", "gives " + std::to_string(convs.size()) + " counts for " +
                                                    std::to_string(blocks) +
                                                    " blocks (model.channels): give one count, or one per block");
  }
  return convs;
}

namespace {

// A linear layer: amp::Float8Linear under precision.policy=mixed_float8 when
// its sizes qualify (precision.fp8_min_features), else torch::nn::Linear.
// Both register "weight" and "bias"; the float8 one adds its scaling buffers.
nn::AnyModule linear_layer(const Config& c, int64_t in, int64_t out) {
  if (c.get_string("precision.policy") == "mixed_float8" &&
      amp::float8_eligible(in, out, c.get_int("precision.fp8_min_features"))) {
    amp::Float8Recipe recipe = amp::Float8Recipe::from_name(c.get_string("precision.fp8_scaling"));
    recipe.amax_history_len = c.get_int("precision.fp8_amax_history");
    return nn::AnyModule(amp::Float8Linear(in, out, /*bias=*/true, recipe));
  }
  return nn::AnyModule(nn::Linear(in, out));
}

int64_t product(const std::vector<int64_t>& v) {
  int64_t p = 1;
  for (int64_t x : v) p *= x;
  return p;
}

// ------------------------------------------------------------------ mlp

class MlpImpl : public ModelImpl {
 public:
  MlpImpl(const Config& c, const Dataset& d) {
    int64_t n = product(d.input_shape);
    layers_->push_back(nn::Flatten());
    for (int64_t h : c.get_int_list("model.hidden")) {
      layers_->push_back(linear_layer(c, n, h));
      layers_->push_back(nn::ReLU());
      n = h;
    }
    if (c.get_float("model.dropout") > 0) layers_->push_back(nn::Dropout(c.get_float("model.dropout")));
    register_module("layers", layers_);
    make_head(n, d.num_classes, c.get_bool("precision.float32_head"));
  }
  at::Tensor forward(const at::Tensor& x) override { return apply_head(layers_->forward(x)); }

 private:
  nn::Sequential layers_;
};

// ------------------------------------------------------------------ cnn

class CnnImpl : public ModelImpl {
 public:
  CnnImpl(const Config& c, const Dataset& d) {
    int64_t in = d.input_shape[0], h = d.input_shape[1], w = d.input_shape[2];
    const std::vector<int64_t> channels = c.get_int_list("model.channels");
    const std::vector<int64_t> convs = cnn_convs_per_block(c);
    for (size_t b = 0; b < channels.size(); ++b) {
      const int64_t ch = channels[b];
      if (h < 2 || w < 2) {
        throw c.error("model.channels", "too many pooling blocks for " + std::to_string(d.input_shape[1]) +
                                            "x" + std::to_string(d.input_shape[2]) + " images");
      }
      for (int64_t k = 0; k < convs[b]; ++k) {
        features_->push_back(nn::Conv2d(nn::Conv2dOptions(k == 0 ? in : ch, ch, 3).padding(1).bias(false)));
        features_->push_back(nn::BatchNorm2d(ch));
        features_->push_back(nn::ReLU());
      }
      features_->push_back(nn::MaxPool2d(2));
      in = ch, h /= 2, w /= 2;
    }
    int64_t n = in * h * w;
    classifier_->push_back(nn::Flatten());
    for (int64_t hidden : c.get_int_list("model.hidden")) {
      classifier_->push_back(linear_layer(c, n, hidden));
      classifier_->push_back(nn::ReLU());
      n = hidden;
    }
    if (c.get_float("model.dropout") > 0) {
      classifier_->push_back(nn::Dropout(c.get_float("model.dropout")));
    }
    register_module("features", features_);
    register_module("classifier", classifier_);
    make_head(n, d.num_classes, c.get_bool("precision.float32_head"));
    set_fused_batch_norm(c.get_bool("model.fused_batch_norm"));
    set_fused_max_pool(c.get_bool("model.fused_max_pool"));
  }
  at::Tensor forward(const at::Tensor& x) override {
    return apply_head(classifier_->forward(forward_features(as_input(x))));
  }

 private:
  // features_->forward(x), with each BatchNorm2d + ReLU pair through
  // batch_norm() and each MaxPool2d through max_pool(): the ReLU module stays
  // in the Sequential, so the layers keep their indices (features.N.*) in
  // checkpoints.
  at::Tensor forward_features(at::Tensor x) {
    for (auto it = features_->begin(); it != features_->end(); ++it) {
      if (auto* pool = it->ptr()->as<nn::MaxPool2dImpl>()) {
        x = max_pool(*pool, x);
        continue;
      }
      auto* bn = it->ptr()->as<nn::BatchNorm2dImpl>();
      if (bn == nullptr) {
        x = it->forward(x);
        continue;
      }
      const auto next = std::next(it);
      const bool relu = next != features_->end() && next->ptr()->as<nn::ReLUImpl>() != nullptr;
      x = batch_norm(*bn, x, relu);
      if (relu) it = next;
    }
    return x;
  }

  nn::Sequential features_;
  nn::Sequential classifier_;
};

// ------------------------------------------------------------------ resnet

nn::Conv2d conv(int64_t in, int64_t out, int64_t k, int64_t stride) {
  return nn::Conv2d(nn::Conv2dOptions(in, out, k).stride(stride).padding(k / 2).bias(false));
}

nn::Sequential shortcut(int64_t in, int64_t out, int64_t stride) {
  if (stride == 1 && in == out) return nullptr;
  return nn::Sequential(conv(in, out, 1, stride), nn::BatchNorm2d(out));
}

class BasicBlockImpl : public nn::Module {
 public:
  static constexpr int64_t kExpansion = 1;
  BasicBlockImpl(int64_t in, int64_t planes, int64_t stride)
      : conv1(register_module("conv1", conv(in, planes, 3, stride))),
        bn1(register_module("bn1", nn::BatchNorm2d(planes))),
        conv2(register_module("conv2", conv(planes, planes, 3, 1))),
        bn2(register_module("bn2", nn::BatchNorm2d(planes))),
        downsample(shortcut(in, planes, stride)) {
    if (downsample) register_module("downsample", downsample);
  }
  at::Tensor forward(at::Tensor x, bool fused) {
    at::Tensor out = batch_norm_act(*bn1, conv1(x), true, fused);
    out = batch_norm_act(*bn2, conv2(out), false, fused);
    return out.add_(downsample ? downsample->forward(x) : x).relu_();
  }
  // Declared in registration order (members initialise in this order).
  nn::Conv2d conv1;
  nn::BatchNorm2d bn1;
  nn::Conv2d conv2;
  nn::BatchNorm2d bn2;
  nn::Sequential downsample;
};
TORCH_MODULE(BasicBlock);

class BottleneckImpl : public nn::Module {
 public:
  static constexpr int64_t kExpansion = 4;
  BottleneckImpl(int64_t in, int64_t planes, int64_t stride)
      : conv1(register_module("conv1", conv(in, planes, 1, 1))),
        bn1(register_module("bn1", nn::BatchNorm2d(planes))),
        conv2(register_module("conv2", conv(planes, planes, 3, stride))),
        bn2(register_module("bn2", nn::BatchNorm2d(planes))),
        conv3(register_module("conv3", conv(planes, planes * kExpansion, 1, 1))),
        bn3(register_module("bn3", nn::BatchNorm2d(planes * kExpansion))),
        downsample(shortcut(in, planes * kExpansion, stride)) {
    if (downsample) register_module("downsample", downsample);
  }
  at::Tensor forward(at::Tensor x, bool fused) {
    at::Tensor out = batch_norm_act(*bn1, conv1(x), true, fused);
    out = batch_norm_act(*bn2, conv2(out), true, fused);
    out = batch_norm_act(*bn3, conv3(out), false, fused);
    return out.add_(downsample ? downsample->forward(x) : x).relu_();
  }
  nn::Conv2d conv1;
  nn::BatchNorm2d bn1;
  nn::Conv2d conv2;
  nn::BatchNorm2d bn2;
  nn::Conv2d conv3;
  nn::BatchNorm2d bn3;
  nn::Sequential downsample;
};
TORCH_MODULE(Bottleneck);

// ResNet for 32x32 inputs (He et al.'s CIFAR variant of the ImageNet
// networks): a 3x3 stem without max pooling, four stages, global pooling.
class ResNetImpl : public ModelImpl {
 public:
  ResNetImpl(const Config& c, const Dataset& d) {
    const int64_t depth = c.get_int("model.depth");
    const int64_t width = c.get_int("model.width");
    const std::vector<int64_t> blocks =
        depth == 18 ? std::vector<int64_t>{2, 2, 2, 2} : std::vector<int64_t>{3, 4, 6, 3};
    const int64_t expansion = depth == 18 ? BasicBlockImpl::kExpansion : BottleneckImpl::kExpansion;
    conv1_ = register_module("conv1", conv(d.input_shape[0], width, 3, 1));
    bn1_ = register_module("bn1", nn::BatchNorm2d(width));
    int64_t in = width;
    for (int stage = 0; stage < 4; ++stage) {
      const int64_t planes = width << stage;
      nn::Sequential layer;
      for (int64_t b = 0; b < blocks[stage]; ++b) {
        const int64_t stride = (stage > 0 && b == 0) ? 2 : 1;
        if (depth == 18) {
          layer->push_back(BasicBlock(in, planes, stride));
        } else {
          layer->push_back(Bottleneck(in, planes, stride));
        }
        in = planes * expansion;
      }
      layers_.push_back(register_module("layer" + std::to_string(stage + 1), layer));
    }
    make_head(in, d.num_classes, c.get_bool("precision.float32_head"));
    set_fused_batch_norm(c.get_bool("model.fused_batch_norm"));
  }
  at::Tensor forward(const at::Tensor& x) override {
    at::Tensor out = batch_norm(*bn1_, conv1_(as_input(x)), true);
    for (auto& layer : layers_) {
      for (auto& block : *layer) {
        if (auto* basic = block.ptr()->as<BasicBlockImpl>()) {
          out = basic->forward(out, fused_batch_norm());
        } else {
          out = block.ptr()->as<BottleneckImpl>()->forward(out, fused_batch_norm());
        }
      }
    }
    return apply_head(out.mean({2, 3}));
  }

 private:
  nn::Conv2d conv1_{nullptr};
  nn::BatchNorm2d bn1_{nullptr};
  std::vector<nn::Sequential> layers_;
};

// ------------------------------------------------------------------ gpt

class GptBlockImpl : public nn::Module {
 public:
  GptBlockImpl(const Config& c, int64_t d, int64_t heads, double dropout)
      : ln1(nn::LayerNormOptions({d})),
        qkv(linear_layer(c, d, 3 * d)),
        proj(linear_layer(c, d, d)),
        ln2(nn::LayerNormOptions({d})),
        fc(linear_layer(c, d, 4 * d)),
        fc_proj(linear_layer(c, 4 * d, d)),
        heads_(heads),
        dropout_(dropout) {
    // Registered in this order: it is the order of the parameters (and of
    // the initialisation's random draws).
    register_module("ln1", ln1);
    register_module("qkv", qkv.ptr());
    register_module("proj", proj.ptr());
    register_module("ln2", ln2);
    register_module("fc", fc.ptr());
    register_module("fc_proj", fc_proj.ptr());
  }

  // No batch or sequence sizes taken from x (only the width, a constant of
  // the model): a trace of it runs on any batch and length.
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x + dropout(proj.forward(attention(ln1(x))));
    return h + dropout(fc_proj.forward(at::gelu(fc.forward(ln2(h)))));
  }

  // The same block through the fused ops (model.fused_block_ops): `branch`,
  // the previous block's output not yet added to the residual stream (or
  // undefined), is added by ln1 in its pass; returns the residual stream
  // and this block's own pending branch. fc's bias is added by the GELU.
  std::pair<at::Tensor, at::Tensor> forward_fused(const at::Tensor& residual,
                                                  const at::Tensor& branch) {
    // Under autocast the norms write the GEMMs' dtype (not for float8
    // layers, which quantise from the float32 input).
    const bool plain = fc.ptr()->as<nn::LinearImpl>() != nullptr;
    const auto gemm_dtype = plain ? gemm_input_dtype(residual) : std::nullopt;
    const Normed a = add_layer_norm(branch, residual, *ln1, gemm_dtype);
    const Normed m = add_layer_norm(dropout(proj.forward(attention(a.out))), a.residual, *ln2,
                                    gemm_dtype);
    // fc's bias on the GELU in float32; in bf16 the erf GELU is compute-bound
    // and torch's (after a GEMM that adds the bias) is as fast on a CPU
    // (docs/benchmarks.md), so it stays torch's there.
    at::Tensor hidden;
    if (plain && !gemm_dtype.has_value()) {
      auto& linear = *fc.ptr()->as<nn::LinearImpl>();
      hidden = fusetrain::nn::gelu(at::linear(m.out, linear.weight), "none", linear.bias);
    } else {
      hidden = at::gelu(fc.forward(m.out));
    }
    return {m.residual, dropout(fc_proj.forward(hidden))};
  }

  nn::LayerNorm ln1;
  nn::AnyModule qkv, proj;
  nn::LayerNorm ln2;
  nn::AnyModule fc, fc_proj;

 private:
  at::Tensor dropout(const at::Tensor& x) {
    return dropout_ > 0 ? at::dropout(x, dropout_, is_training()) : x;
  }
  at::Tensor attention(const at::Tensor& normed) {
    const int64_t d = normed.size(2);
    const at::Tensor qkv_out =
        qkv.forward(normed).unflatten(-1, {3, heads_, d / heads_}).permute({2, 0, 3, 1, 4});
    const at::Tensor y = at::scaled_dot_product_attention(
        qkv_out[0], qkv_out[1], qkv_out[2], /*attn_mask=*/{}, is_training() ? dropout_ : 0.0,
        /*is_causal=*/true);
    return y.transpose(1, 2).flatten(2);
  }
  int64_t heads_;
  double dropout_;
};
TORCH_MODULE(GptBlock);

class GptImpl : public ModelImpl {
 public:
  GptImpl(const Config& c, const Dataset& d) {
    const int64_t dm = c.get_int("model.d_model");
    const int64_t heads = c.get_int("model.n_head");
    if (dm % heads != 0) {
      throw c.error("model.n_head", "must divide model.d_model=" + std::to_string(dm));
    }
    seq_len_ = c.get_int("model.seq_len");
    tok_emb_ = register_module("tok_emb", nn::Embedding(d.num_classes, dm));
    pos_emb_ = register_parameter("pos_emb", at::randn({seq_len_, dm}) * 0.02);
    for (int64_t i = 0; i < c.get_int("model.n_layer"); ++i) {
      blocks_->push_back(GptBlock(c, dm, heads, c.get_float("model.dropout")));
    }
    register_module("blocks", blocks_);
    ln_f_ = register_module("ln_f", nn::LayerNorm(nn::LayerNormOptions({dm})));
    make_head(dm, d.num_classes, c.get_bool("precision.float32_head"));
    fused_head_loss_ = c.get_bool("model.fused_head_loss");
    fused_block_ops_ = c.get_bool("model.fused_block_ops");
    // GPT-2's initialisation: N(0, 0.02) weights, zero biases, and residual
    // projections scaled down by the depth so the residual stream's variance
    // does not grow with it.
    at::NoGradGuard no_grad;
    const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(blocks_->size()));
    for (auto& p : named_parameters()) {
      const std::string& name = p.key();
      if (name.find("ln") != std::string::npos || name == "pos_emb") continue;
      if (name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0) {
        p.value().zero_();
      } else if (name.find("proj.weight") != std::string::npos) {
        p.value().normal_(0.0, residual_std);
      } else {
        p.value().normal_(0.0, 0.02);
      }
    }
  }

  at::Tensor forward(const at::Tensor& idx) override { return apply_head(features(embed(idx))); }

  using ModelImpl::forward;
  // model.fused_head_loss: the head and the loss as one chunked op.
  at::Tensor forward(const at::Tensor& idx, const at::Tensor& targets,
                     double label_smoothing) override {
    if (!fused_head_loss_) return ModelImpl::forward(idx, targets, label_smoothing);
    return head_loss(features(embed(idx)), targets, label_smoothing);
  }

  // The positions' rows gathered by index rather than narrowed to the
  // input's length (a size a trace would freeze): the same values; not used
  // for training, whose gradient would sum over the batch in another order.
  at::Tensor forward_for_trace(const at::Tensor& idx) override {
    const UnfusedScope unfused(fused_block_ops_);
    const at::Tensor positions = at::ones_like(idx).cumsum(1) - 1;
    return apply_head(features(tok_emb_(idx) + at::embedding(pos_emb_, positions)));
  }

 private:
  // The tokens' and their positions' embeddings.
  at::Tensor embed(const at::Tensor& idx) {
    const int64_t t = idx.size(1);
    TORCH_CHECK(t <= seq_len_, "gpt: sequence of ", t, " tokens is longer than model.seq_len=",
                seq_len_);
    return tok_emb_(idx) + pos_emb_.narrow(0, 0, t);
  }

  // The head's input: the blocks and the final layer norm.
  at::Tensor features(at::Tensor x) {
    if (fused_block_ops_) {
      at::Tensor branch;
      for (const auto& block : *blocks_) {
        std::tie(x, branch) = block->as<GptBlockImpl>()->forward_fused(x, branch);
      }
      return add_layer_norm(branch, x, *ln_f_, std::nullopt).out;
    }
    for (const auto& block : *blocks_) x = block->as<GptBlockImpl>()->forward(x);
    return ln_f_(x);
  }

  bool fused_head_loss_ = true;
  bool fused_block_ops_ = true;
  int64_t seq_len_ = 0;
  nn::Embedding tok_emb_{nullptr};
  at::Tensor pos_emb_;
  nn::ModuleList blocks_;
  nn::LayerNorm ln_f_{nullptr};
};

}  // namespace

const std::vector<std::string>& builtin_models() {
  static const std::vector<std::string> names = {"mlp", "cnn", "resnet", "gpt", "gpt2", "llama", "torchscript"};
  return names;
}

bool is_token_model(const std::string& name) { return name == "gpt" || is_hf_model(name); }

ModelConfig model_config(const Config& config) {
  ModelConfig m;
  for (auto& key : config.model_keys()) m.set(key.name, std::move(key.value), key.origin);
  m.set_float32_head(config.get_bool("precision.float32_head"));
  m.set_precision_policy(config.get_string("precision.policy"));
  return m;
}

DatasetInfo dataset_info(const Dataset& data) {
  DatasetInfo d;
  d.num_classes = data.num_classes;
  d.input_shape = data.input_shape;
  d.is_tokens = data.is_tokens;
  d.description = data.description;
  return d;
}

namespace {

// A plugin's model from model.library: loaded, built by its factory (whose
// errors name the model), and refused when it registers nothing to train.
Model make_plugin_model(const Config& config, const Dataset& data) {
  const std::string& name = config.get_string("model.name");
  load_model_library(config.get_string("model.library"), name);
  const ModelFactory* factory = find_registered_model(name);
  Model model;
  try {
    model = (*factory)(model_config(config), dataset_info(data));
  } catch (const UsageError&) {
    throw;
  } catch (const std::exception& e) {
    throw config.error("model.name", "the plugin's factory failed: " + std::string(e.what()));
  }
  if (!model) throw config.error("model.name", "the plugin's factory returned no model");
  if (model->parameters().empty()) {
    throw config.error("model.name", "the plugin's model registers no parameters: nothing to train "
                                     "(register_parameter / register_module)");
  }
  return model;
}

}  // namespace

Model make_model(const Config& config, const Dataset& data, const std::string& hf_config_json) {
  const std::string& name = config.get_string("model.name");
  if (!config.get_string("model.library").empty()) return make_plugin_model(config, data);
  if (name == "torchscript") return load_torchscript_model(config, data);
  if (is_token_model(name) && !data.is_tokens) {
    throw config.error("model.name", name + " needs token data (data.name=tokens, text or synthetic)");
  }
  if (!is_token_model(name) && data.is_tokens) {
    throw config.error("model.name", name + " needs images or feature vectors (data.name="
                                            "fashion_mnist, tensors or synthetic), not " +
                                            config.get_string("data.name"));
  }
  if ((name == "cnn" || name == "resnet") && data.input_shape.size() != 3) {
    throw config.error("model.name", name + " needs images [C, H, W] (or [H, W]); the inputs are " +
                                         c10::str(c10::IntArrayRef(data.input_shape)) +
                                         " per sample: use model.name=mlp");
  }
  if (is_hf_model(name) && !hf_config_json.empty()) {
    return make_hf_model(config, nlohmann::json::parse(hf_config_json), dataset_info(data),
                         /*load_pretrained=*/false);
  }
  if (is_hf_model(name)) return make_hf_model(config, hf_config(config, data.num_classes), dataset_info(data));
  if (name == "mlp") return std::make_shared<MlpImpl>(config, data);
  if (name == "cnn") return std::make_shared<CnnImpl>(config, data);
  if (name == "resnet") return std::make_shared<ResNetImpl>(config, data);
  return std::make_shared<GptImpl>(config, data);
}

void cast_for_master_weights(const Model& model, at::ScalarType dtype) {
  for (const auto& m : model->modules(/*include_self=*/false)) {
    if (model->is_weight_layer(*m) || is_torchscript_weight_layer(*m)) m->to(dtype);
  }
}

bool wants_channels_last(const Config& config) {
  const std::string& name = config.get_string("model.name");
  return config.get_bool("model.channels_last") && (name == "cnn" || name == "resnet") &&
         config.get_string("parallel.shard") == "none";
}

int64_t count_parameters(const Model& model) {
  int64_t n = 0;
  for (const auto& p : model->parameters()) n += p.numel();
  return n;
}

}  // namespace fusetrain::trainer

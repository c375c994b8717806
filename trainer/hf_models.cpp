// Hugging Face's GPT-2 and Llama in C++ (see hf_models.h). The arithmetic
// follows transformers' modeling_gpt2.py and modeling_llama.py step for step:
// the tests compare logits with transformers' on the same weights.
#include "hf_models.h"

#include "block_ops.h"

#include "checkpoint.h"
#include "data_files.h"

#include <torch/nn.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <unistd.h>

namespace fusetrain::trainer {

namespace nn = torch::nn;
namespace fs = std::filesystem;
using json = nlohmann::json;

bool is_hf_model(const std::string& name) { return name == "gpt2" || name == "llama"; }

// ------------------------------------------------------------ config.json

namespace {

std::string read_text(const fs::path& path, const std::string& what) {
  std::ifstream in(path);
  if (!in.good()) throw UsageError(what + ": cannot read " + path.string());
  std::stringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

json parse_json(const std::string& text, const std::string& where) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw UsageError(where + ": not valid JSON: " + e.what());
  }
}

// A config.json value: `key` of `hf`, or `fallback` where absent or null.
template <typename T>
T get(const json& hf, const std::string& key, const T& fallback, const std::string& where) {
  const auto it = hf.find(key);
  if (it == hf.end() || it->is_null()) return fallback;
  try {
    return it->get<T>();
  } catch (const json::exception&) {
    throw UsageError(where + ": \"" + key + "\" is " + it->dump() + ", which fusetrain cannot read here");
  }
}

template <typename T>
T require(const json& hf, const std::string& key, const std::string& where) {
  if (!hf.contains(key) || hf.at(key).is_null()) {
    throw UsageError(where + ": \"" + key + "\" is missing");
  }
  return get<T>(hf, key, T{}, where);
}

int64_t llama_default_ff(int64_t d) { return ((8 * d + 2) / 3 + 63) / 64 * 64; }

json scratch_config(const Config& c, const std::string& family, int64_t vocab) {
  const int64_t d = c.get_int("model.d_model");
  const int64_t heads = c.get_int("model.n_head");
  const int64_t ff = c.get_int("model.d_ff");
  const double dropout = c.get_float("model.dropout");
  if (d % heads != 0) throw c.error("model.n_head", "must divide model.d_model=" + std::to_string(d));
  json hf;
  if (family == "gpt2") {
    hf = {{"architectures", {"GPT2LMHeadModel"}},
          {"model_type", "gpt2"},
          {"vocab_size", vocab},
          {"n_positions", c.get_int("model.seq_len")},
          {"n_embd", d},
          {"n_layer", c.get_int("model.n_layer")},
          {"n_head", heads},
          {"n_inner", ff > 0 ? json(ff) : json(nullptr)},
          {"activation_function", "gelu_new"},
          {"resid_pdrop", dropout},
          {"embd_pdrop", dropout},
          {"attn_pdrop", dropout},
          {"layer_norm_epsilon", c.get_float("model.norm_eps")},
          {"initializer_range", 0.02},
          {"tie_word_embeddings", true}};
    return hf;
  }
  const int64_t kv = c.get_int("model.n_kv_head") ? c.get_int("model.n_kv_head") : heads;
  if (heads % kv != 0) {
    throw c.error("model.n_kv_head", "must divide model.n_head=" + std::to_string(heads));
  }
  hf = {{"architectures", {"LlamaForCausalLM"}},
        {"model_type", "llama"},
        {"vocab_size", vocab},
        {"hidden_size", d},
        {"intermediate_size", ff > 0 ? ff : llama_default_ff(d)},
        {"num_hidden_layers", c.get_int("model.n_layer")},
        {"num_attention_heads", heads},
        {"num_key_value_heads", kv},
        {"head_dim", d / heads},
        {"max_position_embeddings", c.get_int("model.seq_len")},
        {"rms_norm_eps", c.get_float("model.norm_eps")},
        {"rope_theta", c.get_float("model.rope_theta")},
        {"hidden_act", "silu"},
        {"attention_bias", false},
        {"mlp_bias", false},
        {"attention_dropout", dropout},
        {"initializer_range", 0.02},
        {"tie_word_embeddings", c.get_bool("model.tie_embeddings")}};
  return hf;
}

}  // namespace

json hf_config(const Config& c, int64_t vocab) {
  const std::string& family = c.get_string("model.name");
  const std::string& dir = c.get_string("model.pretrained");
  if (dir.empty()) return scratch_config(c, family, vocab);
  const std::string key = "model.pretrained=" + dir;
  if (!fs::is_directory(dir)) throw UsageError(key + ": no such folder");
  const fs::path file = fs::path(dir) / "config.json";
  if (!fs::is_regular_file(file)) {
    throw UsageError(key + ": no config.json in the folder (a Hugging Face model folder holds "
                           "config.json and model.safetensors, as save_pretrained writes them)");
  }
  json hf = parse_json(read_text(file, key), file.string());
  if (!hf.is_object()) throw UsageError(file.string() + ": expected a JSON object");
  const std::string type = get<std::string>(hf, "model_type", "", file.string());
  if (type != family) {
    throw UsageError(file.string() + ": \"model_type\": \"" + type + "\" is not model.name=" + family +
                     (is_hf_model(type) ? ": set model.name=" + type
                                        : "; fusetrain reads the Hugging Face families gpt2 and llama"));
  }
  const int64_t hf_vocab = require<int64_t>(hf, "vocab_size", file.string());
  if (vocab > hf_vocab) {
    throw UsageError("data.path=" + c.get_string("data.path") + ": token id " + std::to_string(vocab - 1) +
                     " is not below " + file.string() + "'s \"vocab_size\": " + std::to_string(hf_vocab) +
                     " (tokenize with the model's own tokenizer; data.token_dtype=" +
                     c.get_string("data.token_dtype") + " must be the width the ids were written in)");
  }
  return hf;
}

// ------------------------------------------------------------ layers

namespace {

// transformers' Conv1D: a linear layer whose weight is stored [in, out].
class Conv1DImpl : public nn::Module {
 public:
  Conv1DImpl(int64_t in, int64_t out) {
    weight = register_parameter("weight", at::empty({in, out}));
    bias = register_parameter("bias", at::zeros({out}));
  }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor y = at::addmm(bias, x.reshape({-1, x.size(-1)}), weight);
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = weight.size(1);
    return y.view(shape);
  }
  at::Tensor weight, bias;
};
TORCH_MODULE(Conv1D);

// transformers' LlamaRMSNorm: normalised in float32, then the weight times
// the input's dtype (which promotes back to the weight's dtype).
class RMSNormImpl : public nn::Module {
 public:
  RMSNormImpl(int64_t d, double eps) : eps_(eps) { weight = register_parameter("weight", at::ones({d})); }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor x32 = x.to(at::kFloat);
    const at::Tensor normed = x32 * at::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps_);
    return weight * normed.to(x.scalar_type());
  }
  at::Tensor weight;
  double eps() const { return eps_; }

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

at::Tensor drop(const at::Tensor& x, double p, bool training) {
  return p > 0 && training ? at::dropout(x, p, true) : x;
}

// Common to both families: the config, the tied or separate head and its
// fused loss.
class HfModelImpl : public ModelImpl {
 public:
  HfModelImpl(json hf, bool float32_head, bool fused_head_loss)
      : hf_(std::move(hf)), float32_head_(float32_head), fused_head_loss_(fused_head_loss) {}

  const json& hf() const { return hf_; }

  /// model.fused_block_ops: the blocks through fusetrain's fused ops.
  void set_fused_block_ops(bool fused) { fused_block_ops_ = fused; }

  // A traced model (export --torchscript) must load without libfusetrain:
  // torch's ops only.
  at::Tensor forward_for_trace(const at::Tensor& idx) override {
    const UnfusedScope unfused(fused_block_ops_);
    return forward(idx);
  }

  at::Tensor forward(const at::Tensor& idx) override {
    const at::Tensor h = features(idx);
    if (!tied_) return apply_head(h);
    if (float32_head_) {
      const amp::Float32Guard float32;
      return at::linear(h.to(at::kFloat), embedding_weight().to(at::kFloat));
    }
    return at::linear(h, embedding_weight());
  }

  using ModelImpl::forward;
  at::Tensor forward(const at::Tensor& idx, const at::Tensor& targets, double label_smoothing) override {
    if (!fused_head_loss_) return ModelImpl::forward(idx, targets, label_smoothing);
    const at::Tensor h = features(idx);
    if (!tied_) return head_loss(h, targets, label_smoothing);
    return linear_loss(h, embedding_weight(), {}, targets, label_smoothing, float32_head_);
  }

 protected:
  // The final hidden states [B, T, d] (after the last norm).
  virtual at::Tensor features(const at::Tensor& idx) = 0;
  virtual at::Tensor embedding_weight() = 0;

  json hf_;
  bool float32_head_;
  bool fused_head_loss_;
  bool fused_block_ops_ = true;
  bool tied_ = true;
};

// ------------------------------------------------------------ GPT-2

class Gpt2BlockImpl : public nn::Module {
 public:
  Gpt2BlockImpl(int64_t d, int64_t heads, int64_t inner, double eps, double attn_p, double resid_p)
      : heads_(heads), attn_p_(attn_p), resid_p_(resid_p) {
    ln_1 = register_module("ln_1", nn::LayerNorm(nn::LayerNormOptions({d}).eps(eps)));
    auto attn = register_module("attn", std::make_shared<nn::Module>());
    c_attn = attn->register_module("c_attn", Conv1D(d, 3 * d));
    attn_proj = attn->register_module("c_proj", Conv1D(d, d));
    ln_2 = register_module("ln_2", nn::LayerNorm(nn::LayerNormOptions({d}).eps(eps)));
    auto mlp = register_module("mlp", std::make_shared<nn::Module>());
    c_fc = mlp->register_module("c_fc", Conv1D(d, inner));
    mlp_proj = mlp->register_module("c_proj", Conv1D(inner, d));
  }

  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor h = x + drop(attention(ln_1(x)), resid_p_, is_training());
    const at::Tensor m = mlp_proj(at::gelu(c_fc(ln_2(h)), "tanh"));
    return h + drop(m, resid_p_, is_training());
  }

  // Through the fused ops, as GptBlockImpl::forward_fused (models.cpp):
  // `branch` is the previous block's output, added to the residual by ln_1.
  std::pair<at::Tensor, at::Tensor> forward_fused(const at::Tensor& residual,
                                                  const at::Tensor& branch) {
    const auto gemm_dtype = gemm_input_dtype(residual);
    const Normed a = add_layer_norm(branch, residual, *ln_1, gemm_dtype);
    const Normed m = add_layer_norm(drop(attention(a.out), resid_p_, is_training()), a.residual,
                                    *ln_2, gemm_dtype);
    // c_fc without its bias, which the GELU adds.
    const at::Tensor x2 = m.out.reshape({-1, m.out.size(-1)});
    std::vector<int64_t> shape(m.out.sizes().begin(), m.out.sizes().end());
    shape.back() = c_fc->weight.size(1);
    const at::Tensor hidden =
        fusetrain::nn::gelu(at::mm(x2, c_fc->weight).view(shape), "tanh", c_fc->bias);
    return {m.residual, drop(mlp_proj(hidden), resid_p_, is_training())};
  }

  nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  Conv1D c_attn{nullptr}, attn_proj{nullptr}, c_fc{nullptr}, mlp_proj{nullptr};

 private:
  // [B, T, 3, H, hd] -> 3 x [B, H, T, hd], attention, back to [B, T, d] and c_proj.
  at::Tensor attention(const at::Tensor& normed) {
    const int64_t d = normed.size(-1);
    const at::Tensor qkv =
        c_attn(normed).unflatten(-1, {3, heads_, d / heads_}).permute({2, 0, 3, 1, 4});
    const at::Tensor y = at::scaled_dot_product_attention(
        qkv[0], qkv[1], qkv[2], {}, is_training() ? attn_p_ : 0.0, /*is_causal=*/true);
    return attn_proj(y.transpose(1, 2).flatten(2));
  }
  int64_t heads_;
  double attn_p_, resid_p_;
};
TORCH_MODULE(Gpt2Block);

class Gpt2Impl : public HfModelImpl {
 public:
  Gpt2Impl(const json& hf, bool float32_head, bool fused_head_loss)
      : HfModelImpl(hf, float32_head, fused_head_loss) {
    const std::string where = "gpt2 config.json";
    const int64_t d = require<int64_t>(hf, "n_embd", where);
    const int64_t heads = require<int64_t>(hf, "n_head", where);
    const int64_t layers = require<int64_t>(hf, "n_layer", where);
    const int64_t vocab = require<int64_t>(hf, "vocab_size", where);
    positions_ = require<int64_t>(hf, "n_positions", where);
    const int64_t inner = get<int64_t>(hf, "n_inner", 4 * d, where);
    const double eps = get<double>(hf, "layer_norm_epsilon", 1e-5, where);
    embd_p_ = get<double>(hf, "embd_pdrop", 0.1, where);
    const std::string act = get<std::string>(hf, "activation_function", "gelu_new", where);
    if (act != "gelu_new" && act != "gelu_pytorch_tanh") {
      throw UsageError(where + ": \"activation_function\": \"" + act +
                       "\": fusetrain's gpt2 runs GPT-2's gelu_new (tanh approximation)");
    }
    if (d % heads != 0) throw UsageError(where + ": \"n_head\" does not divide \"n_embd\"");
    for (const char* unsupported : {"scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"}) {
      if (get<bool>(hf, unsupported, false, where)) {
        throw UsageError(where + ": \"" + std::string(unsupported) + "\": true is not supported");
      }
    }
    if (!get<bool>(hf, "scale_attn_weights", true, where)) {
      throw UsageError(where + ": \"scale_attn_weights\": false is not supported");
    }
    tied_ = get<bool>(hf, "tie_word_embeddings", true, where);
    auto t = register_module("transformer", std::make_shared<nn::Module>());
    wte_ = t->register_module("wte", nn::Embedding(vocab, d));
    wpe_ = t->register_module("wpe", nn::Embedding(positions_, d));
    for (int64_t i = 0; i < layers; ++i) {
      h_->push_back(Gpt2Block(d, heads, inner, eps, get<double>(hf, "attn_pdrop", 0.1, where),
                              get<double>(hf, "resid_pdrop", 0.1, where)));
    }
    t->register_module("h", h_);
    ln_f_ = t->register_module("ln_f", nn::LayerNorm(nn::LayerNormOptions({d}).eps(eps)));
    if (!tied_) make_head(d, vocab, float32_head, "lm_head", /*bias=*/false);
    // transformers' _init_weights: N(0, initializer_range) weights, zero
    // biases, c_proj scaled by 1/sqrt(2 n_layer).
    at::NoGradGuard no_grad;
    const double std = get<double>(hf, "initializer_range", 0.02, where);
    for (auto& p : named_parameters()) {
      const std::string& name = p.key();
      if (name.find(".ln_") != std::string::npos) continue;
      if (name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0) {
        p.value().zero_();
      } else if (name.find("c_proj.weight") != std::string::npos) {
        p.value().normal_(0.0, std / std::sqrt(2.0 * static_cast<double>(layers)));
      } else {
        p.value().normal_(0.0, std);
      }
    }
  }

  bool is_weight_layer(const nn::Module& m) const override {
    return dynamic_cast<const Conv1DImpl*>(&m) || ModelImpl::is_weight_layer(m);
  }

 protected:
  at::Tensor features(const at::Tensor& idx) override {
    const int64_t t = idx.size(1);
    TORCH_CHECK(t <= positions_, "gpt2: a sequence of ", t, " tokens is longer than n_positions=",
                positions_);
    at::Tensor x = wte_(idx) + wpe_->weight.narrow(0, 0, t);
    x = drop(x, embd_p_, is_training());
    if (fused_block_ops_) {
      at::Tensor branch;
      for (const auto& block : *h_) {
        std::tie(x, branch) = block->as<Gpt2BlockImpl>()->forward_fused(x, branch);
      }
      return add_layer_norm(branch, x, *ln_f_, std::nullopt).out;
    }
    for (const auto& block : *h_) x = block->as<Gpt2BlockImpl>()->forward(x);
    return ln_f_(x);
  }
  at::Tensor embedding_weight() override { return wte_->weight; }

 private:
  int64_t positions_ = 0;
  double embd_p_ = 0;
  nn::Embedding wte_{nullptr}, wpe_{nullptr};
  nn::ModuleList h_;
  nn::LayerNorm ln_f_{nullptr};
};

// ------------------------------------------------------------ Llama

struct LlamaSizes {
  int64_t d, heads, kv_heads, head_dim, inner;
  double eps, attn_p;
  bool attn_bias, mlp_bias;
};

// transformers' rotate_half: (x1, x2) -> (-x2, x1) over the halves.
at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({x.narrow(-1, half, half).neg(), x.narrow(-1, 0, half)}, -1);
}

class LlamaLayerImpl : public nn::Module {
 public:
  explicit LlamaLayerImpl(const LlamaSizes& s) : s_(s) {
    auto linear = [](int64_t in, int64_t out, bool bias) {
      return nn::Linear(nn::LinearOptions(in, out).bias(bias));
    };
    input_layernorm = register_module("input_layernorm", RMSNorm(s.d, s.eps));
    auto attn = register_module("self_attn", std::make_shared<nn::Module>());
    q_proj = attn->register_module("q_proj", linear(s.d, s.heads * s.head_dim, s.attn_bias));
    k_proj = attn->register_module("k_proj", linear(s.d, s.kv_heads * s.head_dim, s.attn_bias));
    v_proj = attn->register_module("v_proj", linear(s.d, s.kv_heads * s.head_dim, s.attn_bias));
    o_proj = attn->register_module("o_proj", linear(s.heads * s.head_dim, s.d, s.attn_bias));
    post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(s.d, s.eps));
    auto mlp = register_module("mlp", std::make_shared<nn::Module>());
    gate_proj = mlp->register_module("gate_proj", linear(s.d, s.inner, s.mlp_bias));
    up_proj = mlp->register_module("up_proj", linear(s.d, s.inner, s.mlp_bias));
    down_proj = mlp->register_module("down_proj", linear(s.inner, s.d, s.mlp_bias));
  }

  // cos, sin: [T, head_dim] in the attention's dtype.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    const at::Tensor h = x + attention(input_layernorm(x), cos, sin, /*fused=*/false);
    const at::Tensor m = post_attention_layernorm(h);
    return h + down_proj(at::silu(gate_proj(m)) * up_proj(m));
  }

  // Through the fused ops (as GptBlockImpl::forward_fused in models.cpp):
  // `branch`, the previous layer's output, is added by input_layernorm.
  std::pair<at::Tensor, at::Tensor> forward_fused(const at::Tensor& residual,
                                                  const at::Tensor& branch, const at::Tensor& cos,
                                                  const at::Tensor& sin) {
    const auto gemm_dtype = gemm_input_dtype(residual);
    const Normed a = add_rms_norm(branch, residual, input_layernorm->weight,
                                  input_layernorm->eps(), gemm_dtype);
    const Normed m = add_rms_norm(attention(a.out, cos, sin, /*fused=*/true), a.residual,
                                  post_attention_layernorm->weight,
                                  post_attention_layernorm->eps(), gemm_dtype);
    return {m.residual, down_proj(fusetrain::nn::swiglu(gate_proj(m.out), up_proj(m.out)))};
  }

  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};

 private:
  // Rotary q and k, attention and o_proj of the normed input [B, T, d];
  // `fused`: the rotation in one pass of fusetrain's op.
  at::Tensor attention(const at::Tensor& h_in, const at::Tensor& cos, const at::Tensor& sin,
                       bool fused) {
    const int64_t b = h_in.size(0), t = h_in.size(1);
    at::Tensor q = q_proj(h_in).view({b, t, s_.heads, s_.head_dim}).transpose(1, 2);
    at::Tensor k = k_proj(h_in).view({b, t, s_.kv_heads, s_.head_dim}).transpose(1, 2);
    const at::Tensor v = v_proj(h_in).view({b, t, s_.kv_heads, s_.head_dim}).transpose(1, 2);
    if (fused) {
      std::tie(q, k) = fusetrain::nn::apply_rotary(q, k, cos, sin);
    } else {
      const at::Tensor c = cos.to(q.scalar_type()), sn = sin.to(q.scalar_type());
      q = q * c + rotate_half(q) * sn;
      k = k * c + rotate_half(k) * sn;
    }
    const at::Tensor y = at::scaled_dot_product_attention(
        q, k, v, {}, is_training() ? s_.attn_p : 0.0, /*is_causal=*/true, /*scale=*/std::nullopt,
        /*enable_gqa=*/s_.kv_heads != s_.heads);
    return o_proj(y.transpose(1, 2).reshape({b, t, s_.heads * s_.head_dim}));
  }

  LlamaSizes s_;
};
TORCH_MODULE(LlamaLayer);

class LlamaImpl : public HfModelImpl {
 public:
  LlamaImpl(const json& hf, bool float32_head, bool fused_head_loss)
      : HfModelImpl(hf, float32_head, fused_head_loss) {
    const std::string where = "llama config.json";
    LlamaSizes s{};
    s.d = require<int64_t>(hf, "hidden_size", where);
    s.heads = require<int64_t>(hf, "num_attention_heads", where);
    s.kv_heads = get<int64_t>(hf, "num_key_value_heads", s.heads, where);
    s.head_dim = get<int64_t>(hf, "head_dim", s.d / s.heads, where);
    s.inner = require<int64_t>(hf, "intermediate_size", where);
    s.eps = get<double>(hf, "rms_norm_eps", 1e-6, where);
    s.attn_p = get<double>(hf, "attention_dropout", 0.0, where);
    s.attn_bias = get<bool>(hf, "attention_bias", false, where);
    s.mlp_bias = get<bool>(hf, "mlp_bias", false, where);
    const int64_t layers = require<int64_t>(hf, "num_hidden_layers", where);
    const int64_t vocab = require<int64_t>(hf, "vocab_size", where);
    if (s.heads % s.kv_heads != 0) {
      throw UsageError(where + ": \"num_key_value_heads\" does not divide \"num_attention_heads\"");
    }
    if (s.head_dim % 2 != 0) throw UsageError(where + ": \"head_dim\" must be even (rotary pairs)");
    const std::string act = get<std::string>(hf, "hidden_act", "silu", where);
    if (act != "silu") {
      throw UsageError(where + ": \"hidden_act\": \"" + act + "\": fusetrain's llama runs SwiGLU (silu)");
    }
    // The rotary base: transformers 5's "rope_parameters", or 4's "rope_theta"
    // and "rope_scaling"; only the default (unscaled) rotation is supported.
    theta_ = get<double>(hf, "rope_theta", 10000.0, where);
    for (const char* key : {"rope_parameters", "rope_scaling"}) {
      const auto it = hf.find(key);
      if (it == hf.end() || it->is_null()) continue;
      if (!it->is_object()) throw UsageError(where + ": \"" + key + "\" is not an object");
      const std::string type = get<std::string>(*it, "rope_type", get<std::string>(*it, "type", "default", where), where);
      if (type != "default") {
        throw UsageError(where + ": \"" + std::string(key) + "\" has rope_type \"" + type +
                         "\"; fusetrain's llama runs the default rotary embedding only");
      }
      theta_ = get<double>(*it, "rope_theta", theta_, where);
    }
    head_dim_ = s.head_dim;
    tied_ = get<bool>(hf, "tie_word_embeddings", false, where);
    auto model = register_module("model", std::make_shared<nn::Module>());
    embed_tokens_ = model->register_module("embed_tokens", nn::Embedding(vocab, s.d));
    for (int64_t i = 0; i < layers; ++i) layers_->push_back(LlamaLayer(s));
    model->register_module("layers", layers_);
    norm_ = model->register_module("norm", RMSNorm(s.d, s.eps));
    if (!tied_) make_head(s.d, vocab, float32_head, "lm_head", /*bias=*/false);
    at::NoGradGuard no_grad;
    const double std = get<double>(hf, "initializer_range", 0.02, where);
    for (auto& p : named_parameters()) {
      const std::string& name = p.key();
      if (name.find("norm.") != std::string::npos) continue;
      if (name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0) {
        p.value().zero_();
      } else {
        p.value().normal_(0.0, std);
      }
    }
  }

 protected:
  at::Tensor features(const at::Tensor& idx) override {
    const int64_t t = idx.size(1);
    // transformers' LlamaRotaryEmbedding: float32 angles (autocast off),
    // cos and sin of [freqs, freqs].
    at::Tensor cos, sin;
    {
      const amp::Float32Guard float32;
      const auto opts = at::TensorOptions().dtype(at::kFloat).device(idx.device());
      const at::Tensor inv_freq =
          1.0 / at::pow(theta_, at::arange(0, head_dim_, 2, opts.dtype(at::kLong)).to(at::kFloat) /
                                    static_cast<double>(head_dim_));
      const at::Tensor freqs = at::outer(at::arange(t, opts), inv_freq);
      const at::Tensor emb = at::cat({freqs, freqs}, -1);
      cos = emb.cos();
      sin = emb.sin();
    }
    at::Tensor x = embed_tokens_(idx);
    if (fused_block_ops_) {
      at::Tensor branch;
      for (const auto& layer : *layers_) {
        std::tie(x, branch) = layer->as<LlamaLayerImpl>()->forward_fused(x, branch, cos, sin);
      }
      return add_rms_norm(branch, x, norm_->weight, norm_->eps(), std::nullopt).out;
    }
    for (const auto& layer : *layers_) x = layer->as<LlamaLayerImpl>()->forward(x, cos, sin);
    return norm_(x);
  }
  at::Tensor embedding_weight() override { return embed_tokens_->weight; }

 private:
  double theta_ = 10000.0;
  int64_t head_dim_ = 0;
  nn::Embedding embed_tokens_{nullptr};
  nn::ModuleList layers_;
  RMSNorm norm_{nullptr};
};

// ------------------------------------------------------------ safetensors

// The tensors of a Hugging Face folder: model.safetensors, or the shards
// model.safetensors.index.json maps each name to. Returns name -> (tensor, file).
std::map<std::string, std::pair<at::Tensor, std::string>> read_hf_weights(const std::string& dir) {
  const fs::path single = fs::path(dir) / "model.safetensors";
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  std::vector<std::string> files;
  if (fs::is_regular_file(single)) {
    files.push_back(single.string());
  } else if (fs::is_regular_file(index)) {
    const json map = parse_json(read_text(index, "model.pretrained"), index.string());
    if (!map.contains("weight_map") || !map.at("weight_map").is_object()) {
      throw UsageError(index.string() + ": no \"weight_map\" object");
    }
    std::set<std::string> shards;
    for (const auto& [name, file] : map.at("weight_map").items()) shards.insert(file.get<std::string>());
    for (const auto& shard : shards) {
      const fs::path p = fs::path(dir) / shard;
      if (!fs::is_regular_file(p)) {
        throw UsageError(index.string() + ": names the shard " + shard + ", which is not in the folder");
      }
      files.push_back(p.string());
    }
  } else {
    throw UsageError("model.pretrained=" + dir +
                     ": neither model.safetensors nor model.safetensors.index.json is in the folder "
                     "(save_pretrained writes them; .bin weights are not read)");
  }
  std::map<std::string, std::pair<at::Tensor, std::string>> out;
  for (const auto& f : files) {
    for (auto& [name, t] : read_tensor_file(f, "model.pretrained")) out[name] = {t, f};
  }
  return out;
}

void load_weights(ModelImpl& model, const std::string& dir, const std::string& family) {
  auto weights = read_hf_weights(dir);
  // GPT-2's original checkpoints name its tensors without "transformer.".
  const std::string base = family == "gpt2" ? "transformer." : "";
  at::NoGradGuard no_grad;
  for (auto& p : model.named_parameters()) {
    const std::string& name = p.key();
    auto it = weights.find(name);
    if (it == weights.end() && !base.empty() && name.rfind(base, 0) == 0) {
      it = weights.find(name.substr(base.size()));
    }
    if (it == weights.end()) {
      throw UsageError("model.pretrained=" + dir + ": the tensor \"" + name +
                       "\" is missing from the checkpoint's safetensors (a " + family + " with this "
                       "config.json needs it)");
    }
    const at::Tensor& t = it->second.first;
    if (t.sizes() != p.value().sizes()) {
      throw UsageError(it->second.second + ": the tensor \"" + it->first + "\" has shape " +
                       c10::str(t.sizes()) + "; config.json makes it " + c10::str(p.value().sizes()));
    }
    if (!at::isFloatingType(t.scalar_type())) {
      throw UsageError(it->second.second + ": the tensor \"" + it->first + "\" is " +
                       c10::toString(t.scalar_type()) + ", not floating point");
    }
    p.value().copy_(t);
  }
}

void write_safetensors(const fs::path& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  json header = json::object();
  header["__metadata__"] = {{"format", "pt"}};
  int64_t offset = 0;
  std::vector<at::Tensor> data;
  for (const auto& [name, t] : tensors) {
    const at::Tensor c = t.detach().to(at::kCPU, at::kFloat).contiguous();
    const int64_t bytes = c.numel() * static_cast<int64_t>(c.element_size());
    header[name] = {{"dtype", "F32"}, {"shape", c.sizes().vec()}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(c);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::ofstream out(path, std::ios::binary);
  uint64_t n = text.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto& c : data) {
    out.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.numel() * c.element_size()));
  }
  out.flush();
  if (!out.good()) throw std::runtime_error("cannot write " + path.string());
}

}  // namespace

Model make_hf_model(const Config& config, const json& hf, const DatasetInfo& data, bool load_pretrained) {
  const std::string& family = config.get_string("model.name");
  const bool float32_head = config.get_bool("precision.float32_head");
  const bool fused = config.get_bool("model.fused_head_loss");
  Model model;
  if (family == "gpt2") {
    model = std::make_shared<Gpt2Impl>(hf, float32_head, fused);
  } else {
    model = std::make_shared<LlamaImpl>(hf, float32_head, fused);
  }
  std::static_pointer_cast<HfModelImpl>(model)->set_fused_block_ops(
      config.get_bool("model.fused_block_ops"));
  const int64_t t = data.input_shape.empty() ? 0 : data.input_shape[0];
  const std::string positions = family == "gpt2" ? "n_positions" : "max_position_embeddings";
  const int64_t max_t = get<int64_t>(hf, positions, 1 << 30, "config.json");
  if (t > max_t) {
    throw config.error("model.seq_len", "windows of " + std::to_string(t) + " tokens are longer than the "
                                        "model's \"" + positions + "\": " + std::to_string(max_t));
  }
  const std::string& dir = config.get_string("model.pretrained");
  if (!dir.empty() && load_pretrained) load_weights(*model, dir, family);
  return model;
}

std::string stored_hf_config(const TensorDict& checkpoint) {
  return has_entry(checkpoint, "meta.hf_config")
             ? tensor_text(checkpoint_entry(checkpoint, "meta.hf_config", "checkpoint"))
             : std::string();
}

const json* hf_config_of(const ModelImpl& model) {
  const auto* hf = dynamic_cast<const HfModelImpl*>(&model);
  return hf ? &hf->hf() : nullptr;
}

std::string export_hf(const std::string& checkpoint, const std::string& out) {
  const TensorDict ckpt = read_checkpoint(checkpoint);
  if (!has_entry(ckpt, "meta.hf_config")) {
    throw UsageError("--checkpoint " + checkpoint + ": not a gpt2 or llama run (export --hf writes "
                     "Hugging Face's families; use --state-dict for other models)");
  }
  json hf = parse_json(tensor_text(checkpoint_entry(ckpt, "meta.hf_config", checkpoint)), checkpoint);
  hf["torch_dtype"] = "float32";  // transformers 4's key
  hf["dtype"] = "float32";        // and 5's
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [key, t] : ckpt) {
    if (key.rfind("model.", 0) != 0) continue;
    tensors.emplace_back(key.substr(6), t);
  }
  fs::path target(out);
  if (!target.has_filename()) target = target.parent_path();  // "out/"
  // Only an earlier export (config.json and model.safetensors, nothing
  // else) is replaced: never a model folder with its tokenizer, nor any other.
  if (fs::exists(target)) {
    bool export_only = fs::is_directory(target) && fs::is_regular_file(target / "config.json");
    if (export_only) {
      for (const auto& e : fs::directory_iterator(target)) {
        const std::string name = e.path().filename().string();
        export_only = export_only && (name == "config.json" || name == "model.safetensors");
      }
    }
    if (!export_only) {
      throw UsageError("--hf " + out + ": exists and is not an earlier export (config.json and "
                       "model.safetensors only); choose a new path");
    }
  }
  const fs::path tmp =
      target.parent_path() / ("." + target.filename().string() + ".tmp-" + std::to_string(::getpid()));
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  {
    std::ofstream cfg(tmp / "config.json");
    cfg << hf.dump(2) << "\n";
    if (!cfg.good()) throw std::runtime_error("cannot write " + (tmp / "config.json").string());
  }
  write_safetensors(tmp / "model.safetensors", tensors);
  if (fs::exists(target)) fs::remove_all(target);
  fs::rename(tmp, target);
  return std::to_string(tensors.size()) + " tensors, " + hf.value("model_type", std::string("?"));
}

}  // namespace fusetrain::trainer

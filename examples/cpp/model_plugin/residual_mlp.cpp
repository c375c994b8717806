// A model plugin: a residual MLP classifier for images or feature vectors,
// registered as `model.name: residual_mlp`. Its own keys (model.block_width,
// model.blocks, model.expansion, model.layer_norm) come from the run's
// config like the trainer's; the head is the trainer's (make_head), so
// precision.float32_head makes it a float32 island, and the training loss
// is the fused linear cross-entropy (head_loss), which never holds the logits.
#include <fusetrain/trainer/model.h>

#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/normalization.h>

#include <memory>

namespace ft = fusetrain::trainer;
namespace nn = torch::nn;

namespace {

// x + W2 relu(W1 norm(x)): a pre-norm residual block.
class ResidualBlockImpl : public nn::Module {
 public:
  ResidualBlockImpl(int64_t width, int64_t hidden, bool layer_norm) {
    if (layer_norm) norm_ = register_module("norm", nn::LayerNorm(nn::LayerNormOptions({width})));
    up_ = register_module("up", nn::Linear(width, hidden));
    down_ = register_module("down", nn::Linear(hidden, width));
  }
  at::Tensor forward(const at::Tensor& x) {
    return x + down_(up_(norm_ ? norm_(x) : x).relu());
  }

 private:
  nn::LayerNorm norm_{nullptr};
  nn::Linear up_{nullptr}, down_{nullptr};
};
TORCH_MODULE(ResidualBlock);

class ResidualMlpImpl : public ft::ModelImpl {
 public:
  ResidualMlpImpl(const ft::ModelConfig& config, const ft::DatasetInfo& data) {
    if (data.is_tokens) {
      throw ft::UsageError("residual_mlp classifies images or feature vectors, not tokens");
    }
    const int64_t width = config.get_int("block_width", 128);
    const int64_t blocks = config.get_int("blocks", 2);
    const int64_t expansion = config.get_int("expansion", 2);
    if (width < 1) throw config.error("block_width", "must be at least 1");
    if (blocks < 0) throw config.error("blocks", "must not be negative");
    stem_ = register_module("stem", nn::Linear(data.features(), width));
    for (int64_t i = 0; i < blocks; ++i) {
      blocks_->push_back(ResidualBlock(width, expansion * width, config.get_bool("layer_norm", true)));
    }
    register_module("blocks", blocks_);
    dropout_ = config.get_float("dropout");  // a trainer key: model.dropout
    make_head(width, data.num_classes, config.float32_head());
  }

  at::Tensor forward(const at::Tensor& x) override { return apply_head(features(x)); }

  // The loss without the logits: the head and the cross-entropy in one op.
  using ft::ModelImpl::forward;
  at::Tensor forward(const at::Tensor& x, const at::Tensor& targets, double label_smoothing) override {
    return head_loss(features(x), targets, label_smoothing);
  }

 private:
  at::Tensor features(const at::Tensor& x) {
    at::Tensor h = stem_(x.flatten(1)).relu();
    for (const auto& block : *blocks_) h = block->as<ResidualBlockImpl>()->forward(h);
    return dropout_ > 0 ? at::dropout(h, dropout_, is_training()) : h;
  }

  nn::Linear stem_{nullptr};
  nn::ModuleList blocks_;
  double dropout_ = 0.0;
};

}  // namespace

FUSETRAIN_REGISTER_MODEL("residual_mlp", [](const ft::ModelConfig& config, const ft::DatasetInfo& data) {
  return std::make_shared<ResidualMlpImpl>(config, data);
});

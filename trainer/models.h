// The trainer's models: mlp, cnn (conv, batch norm, pooling), resnet
// (ResNet-18/50 for 32x32 images) and gpt (a small decoder-only transformer
// over bytes). Each ends in a linear "head" that runs in float32 under mixed
// precision when precision.float32_head is set (a float32 island).
//
// Parameter names are part of the checkpoint format: python/fusetrain/
// load_checkpoint.py rebuilds mlp and cnn with the same names and shapes.
#pragma once

#include "config.h"
#include "data.h"

#include <fusetrain/amp/float32_module.h>

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <memory>
#include <string>

namespace fusetrain::trainer {

/// A classifier or language model: forward() returns logits, [N, classes]
/// or [N, T, vocabulary].
class ModelImpl : public torch::nn::Module {
 public:
  virtual at::Tensor forward(const at::Tensor& x) = 0;
  /// The same function written without sizes taken from `x` (which a trace
  /// would freeze): what `fusetrain export --torchscript` traces. Models
  /// whose forward already takes none keep forward().
  virtual at::Tensor forward_for_trace(const at::Tensor& x) { return forward(x); }
  /// The training loss of `x` against `targets`: the mean cross-entropy in
  /// float32 with torch's label smoothing. By default forward(x), then
  /// float32_cross_entropy of the logits; gpt with model.fused_head_loss
  /// computes it from the head's input without the logits (head_loss).
  virtual at::Tensor forward(const at::Tensor& x, const at::Tensor& targets,
                             double label_smoothing);

  /// model.channels_last: the 4-D parameters and buffers (convolution
  /// kernels) in channels_last layout, and forward() takes its images in it
  /// (a copy of an NCHW batch; a view of a one-channel one, whose memory is
  /// the same in both layouts). oneDNN's convolutions, batch norm and
  /// pooling run faster on it (bench/bench_trainer.py); the values, names
  /// and shapes are unchanged, so checkpoints are the same.
  void use_channels_last();
  bool channels_last() const { return channels_last_; }

  /// model.fused_batch_norm: each batch norm + ReLU pair (and a batch norm
  /// alone) runs as fusetrain::nn::batch_norm_relu, one fused op each way on
  /// the CPU; torch's ops where off. Same parameters, buffers and names.
  /// `fusetrain export` turns it off: the traced module is plain torch.
  void set_fused_batch_norm(bool fused) { fused_batch_norm_ = fused; }
  /// model.fused_max_pool: each max pooling over non-overlapping windows runs
  /// as fusetrain::nn::max_pool2d (Note [Window max pool]): the same values
  /// and gradients bit for bit, with fewer passes on the CPU. Off for export.
  void set_fused_max_pool(bool fused) { fused_max_pool_ = fused; }

 protected:
  /// x as the first layer takes it: channels_last under use_channels_last().
  at::Tensor as_input(const at::Tensor& x) const;
  /// Registers the final layer as "head", in float32 when `float32`.
  void make_head(int64_t in, int64_t out, bool float32);
  at::Tensor apply_head(const at::Tensor& x);
  /// The mean cross-entropy of the head applied to `features` [..., in]
  /// against `targets` [...] by fusetrain::nn::linear_cross_entropy, over
  /// chunks of rows without the [rows, classes] logits (Note [Chunked linear
  /// cross-entropy]); in float32 when the head is a float32 island, else in
  /// the autocast dtype. float32, like float32_cross_entropy.
  at::Tensor head_loss(const at::Tensor& features, const at::Tensor& targets,
                       double label_smoothing);
  /// bn(x), then a ReLU when `relu`: fused or torch's (set_fused_batch_norm).
  at::Tensor batch_norm(torch::nn::BatchNorm2dImpl& bn, const at::Tensor& x, bool relu) const;
  bool fused_batch_norm() const { return fused_batch_norm_; }
  /// pool(x): fusetrain's window max pool or the module (set_fused_max_pool).
  at::Tensor max_pool(torch::nn::MaxPool2dImpl& pool, const at::Tensor& x) const;

 private:
  bool channels_last_ = false;
  bool fused_batch_norm_ = false;
  bool fused_max_pool_ = false;
  torch::nn::Linear head_{nullptr};
  std::shared_ptr<amp::Float32Impl<torch::nn::Linear>> head32_;
};

using Model = std::shared_ptr<ModelImpl>;

/// Builds the model the config names (model.*) for the dataset's shapes.
/// Parameters are initialised from the current default generator.
Model make_model(const Config& config, const Dataset& data);

/// model.convs_per_block as one count per block of model.channels (a single
/// count stands for every block); a usage error when the counts do not match.
std::vector<int64_t> cnn_convs_per_block(const Config& config);

/// For precision.master_weights: casts the weights of convolutions, linear
/// layers and embeddings to `dtype`; normalisation layers and the head stay
/// float32 (the optimizer keeps float32 master copies of the rest).
void cast_for_master_weights(const Model& model, at::ScalarType dtype);

int64_t count_parameters(const Model& model);

/// Whether the config's model runs in channels_last: model.channels_last on
/// a cnn or resnet, unless ZeRO shards it (parallel.shard: its pieces take
/// contiguous parameters).
bool wants_channels_last(const Config& config);

}  // namespace fusetrain::trainer

// The trainer's models: mlp, cnn (conv, batch norm, pooling), resnet
// (ResNet-18/50 for 32x32 images), gpt (a small decoder-only transformer
// over bytes), the Hugging Face families gpt2 and llama (hf_models.h), a
// TorchScript module, and a plugin's (model.library). Each derives from
// <fusetrain/trainer/model.h>'s ModelImpl; the built-in ones end in a linear
// "head" that runs in float32 under mixed precision when
// precision.float32_head is set (a float32 island).
//
// Parameter names are part of the checkpoint format: python/fusetrain/
// load_checkpoint.py rebuilds mlp and cnn with the same names and shapes.
#pragma once

#include "config.h"
#include "data.h"

#include <fusetrain/trainer/model.h>

#include <memory>
#include <string>

namespace fusetrain::trainer {


/// Builds the model the config names (model.*) for the dataset's shapes:
/// a built-in one, or a plugin's from model.library. Parameters are
/// initialised from the current default generator.
///
/// `hf_config_json`, for gpt2 and llama: the config.json a checkpoint keeps
/// ("meta.hf_config"). Given (a resume, an eval), the model is built from it
/// and model.pretrained is neither read nor loaded: the checkpoint's tensors
/// replace the weights, and the folder may have moved since.
Model make_model(const Config& config, const Dataset& data, const std::string& hf_config_json = "");

/// model.convs_per_block as one count per block of model.channels (a single
/// count stands for every block); a usage error when the counts do not match.
std::vector<int64_t> cnn_convs_per_block(const Config& config);

/// For precision.master_weights: casts the model's weight layers
/// (ModelImpl::is_weight_layer: convolutions, linear layers and embeddings)
/// to `dtype`; normalisation layers and the head stay float32 (the optimizer
/// keeps float32 master copies of the rest).
void cast_for_master_weights(const Model& model, at::ScalarType dtype);

int64_t count_parameters(const Model& model);

/// The config's model.* keys as a plugin's factory receives them, with
/// precision.float32_head and precision.policy.
ModelConfig model_config(const Config& config);

/// The dataset's description as a model's factory receives it.
DatasetInfo dataset_info(const Dataset& data);

/// The built-in model names (model.name without model.library).
const std::vector<std::string>& builtin_models();

/// Whether model.name trains on tokens (gpt, gpt2, llama): a synthetic
/// dataset is then token windows.
bool is_token_model(const std::string& name);

/// Whether the config's model runs in channels_last: model.channels_last on
/// a cnn or resnet, unless ZeRO shards it (parallel.shard: its pieces take
/// contiguous parameters).
bool wants_channels_last(const Config& config);

}  // namespace fusetrain::trainer

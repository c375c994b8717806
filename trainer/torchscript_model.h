// The user's own model: a TorchScript module (torch.jit.script or trace, then
// torch.jit.save, in Python) trained by the C++ trainer like a built-in one.
//
// The module's parameters and buffers are registered, as the same tensors,
// on a torch::nn::Module tree that mirrors its submodules, so everything the
// trainer does to a model (the optimizer's in-place steps, moves to the
// device, master-weight casts, DDP's broadcasts, checkpoint restores) acts
// on the TorchScript module itself, and the names are the Python module's
// state_dict keys.
#pragma once

#include "models.h"

#include <string>

namespace fusetrain::trainer {

/// Loads model.path and checks, with one forward on two training samples,
/// that forward(x) takes the data's batch and returns logits [N, classes]
/// (or [N, T, vocabulary] for tokens); every failure is a UsageError naming
/// model.path and what the module did.
Model load_torchscript_model(const Config& config, const Dataset& data);

/// Whether `module` (a part of a model from load_torchscript_model) is a
/// convolution, linear layer or embedding: what precision.master_weights
/// keeps in 16 bits.
bool is_torchscript_weight_layer(const torch::nn::Module& module);

/// Writes the model.* tensors of `checkpoint` into the TorchScript module
/// at `module_path` and saves it to `out` (torch.jit.load reads it).
void export_torchscript(const std::string& checkpoint, const std::string& module_path,
                        const std::string& out);

/// A built-in model (mlp, cnn, resnet, gpt) of `checkpoint`, with its trained
/// tensors, as a TorchScript module traced in eval mode (batch norm on its
/// running statistics, no dropout) under the state-dict names of
/// python/fusetrain/load_checkpoint.py's modules; saved atomically to `out`.
/// The trace takes no sizes from its input: any batch (and, for gpt, any
/// length up to model.seq_len) runs. Returns a line describing it.
std::string export_traced_torchscript(const std::string& checkpoint, const std::string& out);

}  // namespace fusetrain::trainer

// What a checkpoint holds of a run's training state, to a TensorDict and
// back: the model's parameters and buffers ("model.<name>"), the fused
// optimizer's per-parameter state ("optim.<name>.<field>": AdamW's step,
// moments and master weights, SGD's momentum and master weights, under the
// parameter's name so that resumption does not depend on parameter order)
// and the loss scaler ("scaler.<key>"). Loading checks the model's names and
// shapes and the optimizer's kind, and names the file in every error.
#pragma once

#include "checkpoint.h"
#include "config.h"
#include "models.h"

#include <fusetrain/amp/grad_scaler.h>
#include <fusetrain/optim/fused.h>

#include <ATen/ATen.h>

#include <string>

namespace fusetrain::trainer {

/// Appends "model.<name>" for every parameter and buffer.
void put_model(TensorDict& d, const Model& model);

/// Copies every "model.*" entry of `ckpt` (read from `path`) into the model;
/// CheckpointError when a tensor is missing, has another shape, or the
/// checkpoint holds tensors the model does not have.
void load_model(const TensorDict& ckpt, const std::string& path, const Model& model);

/// Appends "optim.name" (`name`: adamw or sgd) and the optimizer's state of
/// every parameter that has some.
void put_optimizer(TensorDict& d, const Model& model, optim::FusedOptimizer& optimizer,
                   const std::string& name);

/// Restores the state put_optimizer wrote onto `device`; a UsageError on
/// the config's optimizer.name when the checkpoint's optimizer is another.
void load_optimizer(const TensorDict& ckpt, const std::string& path, const Model& model,
                    optim::FusedOptimizer& optimizer, const Config& config,
                    const at::Device& device);

/// Appends "scaler.<key>" for the scaler's state_dict().
void put_scaler(TensorDict& d, amp::GradScaler& scaler);

/// Restores the scaler's state when it is enabled and the checkpoint has one.
void load_scaler(const TensorDict& ckpt, amp::GradScaler& scaler);

}  // namespace fusetrain::trainer

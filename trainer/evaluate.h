// Evaluation: the loss every step takes (cross-entropy in float32), the
// validation pass over a split shared out among the ranks, and the
// `fusetrain eval` command.
#pragma once

#include "data.h"
#include "launch.h"
#include "models.h"

#include <fusetrain/amp/policy.h>

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fusetrain::trainer {

// float32_cross_entropy: <fusetrain/trainer/model.h>.

struct EvalResult {
  double loss = 0.0;      // mean cross-entropy, nats
  double accuracy = 0.0;  // top-1 (next-token accuracy for tokens)
  int64_t count = 0;      // samples (tokens for token data)
};

/// The loss and accuracy over the whole of `split`, each rank of `world`
/// taking a contiguous part and the sums all-reduced, in eval mode under
/// `policy`, with rank 0's buffers (batch-norm statistics); the model's
/// training mode is restored. Logits (float32, CPU) are appended to
/// `logits_out` when given (single process).
EvalResult evaluate(ModelImpl& model, const Split& split, const Distributed& world,
                    const amp::Policy& policy, c10::DeviceType device_type, int64_t batch,
                    std::vector<at::Tensor>* logits_out = nullptr);

/// `fusetrain eval`: loads the checkpoint's model and evaluates it on the
/// test split (config from the checkpoint, then `overrides`); writes the
/// logits and targets to `predictions_path` when it is not empty.
int run_eval(const std::string& checkpoint, const std::vector<std::string>& overrides,
             const std::string& predictions_path);

}  // namespace fusetrain::trainer

// The training run: precision, optimizer, schedule, the step loop with
// gradient accumulation, clipping and steps-per-execution, evaluation,
// metrics, progress, checkpoints and resumption; and `fusetrain eval`.
#pragma once

#include "config.h"
#include "launch.h"
#include "run_dir.h"

#include <string>
#include <vector>

namespace fusetrain::trainer {

/// Checks that need no data and no group: world size against the batch,
/// the device, its GPU count and precision support, the dataset's presence.
/// Raises UsageError naming the key.
void check_before_start(const Config& config, int world_size, int local_world_size);

/// Intra-op threads for a process sharing the machine with `local_world_size` ranks.
int threads_for(const Config& config, int local_world_size);

/// Trains as one rank of `world`. Returns 0, or 130 when stopped by a signal
/// (after saving a checkpoint).
int run_training(const Config& config, const RunPlan& plan, const Distributed& world);

/// `fusetrain eval`: loads the checkpoint's model and evaluates it on the
/// test split (config from the checkpoint, then `overrides`); writes the
/// logits and targets to `predictions_path` when it is not empty.
int run_eval(const std::string& checkpoint, const std::vector<std::string>& overrides,
             const std::string& predictions_path);

}  // namespace fusetrain::trainer

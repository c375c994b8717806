// The training run: precision, optimizer, schedule, and the step loop with
// gradient accumulation, clipping, steps-per-execution, the time budget and
// stop signals, deciding when to log, evaluate and checkpoint. What it calls
// lives beside it: data.h and loader.h (batches), models.h and
// torchscript_model.h, evaluate.h, state.h and checkpoint.h (what a
// checkpoint holds, and the file), run_dir.h, metrics.h, progress.h.
#pragma once

#include "config.h"
#include "launch.h"
#include "run_dir.h"

#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace fusetrain::trainer {

/// Checks that need no data and no group: world size against the batch,
/// the device, its GPU count and precision support, the dataset's presence.
/// Raises UsageError naming the key.
void check_before_start(const Config& config, int world_size, int local_world_size);

/// precision.policy=auto becomes amp::best_policy() of runtime.device (its
/// reason kept as the key's origin); other values stay. A CUDA run with no
/// GPU visible keeps "auto" for check_before_start to report.
void resolve_auto_policy(Config& config);

/// Intra-op threads for a process sharing the machine with `local_world_size` ranks.
int threads_for(const Config& config, int local_world_size);

/// Trains as one rank of `world`. Returns 0, or 130 when stopped by a signal
/// (after saving a checkpoint).
int run_training(const Config& config, const RunPlan& plan, const Distributed& world);

/// The device of local rank `local_rank` for runtime.device.
at::Device device_of(const Config& config, int local_rank);

}  // namespace fusetrain::trainer

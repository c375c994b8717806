// The training run: precision, optimizer, schedule, the step loop with
// gradient accumulation, clipping and steps-per-execution, evaluation,
// metrics, progress, checkpoints and resumption; and `fusetrain eval`.
#pragma once

#include "config.h"
#include "launch.h"

#include <string>
#include <vector>

namespace fusetrain::trainer {

/// Where a run writes and what it resumes from, decided before any work.
struct RunPlan {
  std::string run_dir;
  /// Checkpoint to resume from ("" for a fresh start); already verified.
  std::string checkpoint;
};

/// Resolves output.run_dir (a new runs/<config name>-<date>-<time> when
/// empty) and `resume` ("", "auto" or a path) into a plan, and stores the
/// run directory in `config`. The checkpoint, if any, is read and verified
/// here, so a corrupt one fails before anything is written.
RunPlan plan_run(Config& config, const std::string& resume);

/// Keys whose values may differ between the ranks of one run: where a host
/// keeps its data, its thread count and display, its place in the launch.
const std::vector<std::string>& per_host_keys();

/// Every rank's configuration must be the same but for per_host_keys():
/// compared across the group before any data is read, a difference is a
/// UsageError on every rank naming the key and the ranks.
void check_same_config(const Config& config, const Distributed& world);

/// plan_run for a group: rank 0 plans (its run directory and checkpoint),
/// every rank takes that plan, and checks it can read the checkpoint. A
/// failure on any rank fails every rank with its message.
RunPlan agree_on_plan(Config& config, const std::string& resume, const Distributed& world);

/// The configuration stored in a checkpoint written by the trainer.
Config config_from_checkpoint(const std::string& path);

/// Checks that need no data and no group: world size against the batch,
/// the device, its GPU count and precision support, the dataset's presence.
/// Raises UsageError naming the key.
void check_before_start(const Config& config, int world_size, int local_world_size);

/// Creates the run directory and writes the resolved config (rank 0 / launcher).
void prepare_run_dir(const Config& config, const RunPlan& plan);

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

// Run directories and checkpoints on disk, and the plan of a run: where it
// writes (output.run_dir, or a new runs/<config>-<date>-<time>) and what it
// resumes from (--resume PATH or auto), decided before any work and agreed
// across the ranks of a group.
#pragma once

#include "config.h"
#include "launch.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fusetrain::trainer {

bool is_dir(const std::string& path);
bool is_file(const std::string& path);
/// Creates `path` and its parents; an error names the directory.
void make_dirs(const std::string& path);
/// The names in a directory, sorted (empty when it does not exist).
std::vector<std::string> list_dir(const std::string& path);
std::string parent_of(const std::string& path);
std::string base_of(const std::string& path);
/// Writes a temporary file beside `path`, then renames it over `path`.
void write_text_atomically(const std::string& path, const std::string& text);

std::string checkpoint_dir(const std::string& run_dir);
/// The checkpoints (exactly step_<N>.pt) of a run directory, oldest step first.
std::vector<std::pair<int64_t, std::string>> checkpoints_in(const std::string& run_dir);
/// The newest runs/<name>-* directory ("" if none), and a new one's name.
std::string newest_run_dir(const std::string& name);
std::string new_run_dir(const std::string& name);

/// Where a run writes and what it resumes from, decided before any work.
struct RunPlan {
  std::string run_dir;
  /// Checkpoint to resume from ("" for a fresh start); already verified.
  std::string checkpoint;
  /// What --resume auto found, for the first line of the run's output ("" without it).
  std::string resume_note;
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

/// Creates the run directory and writes the resolved config (rank 0 / launcher).
void prepare_run_dir(const Config& config, const RunPlan& plan);

}  // namespace fusetrain::trainer

// metrics.jsonl: one JSON object per line (nlohmann-json), written by rank 0
// as the run goes; a resumed run first drops the records past its
// checkpoint, which it writes again, so no step appears twice.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <fstream>
#include <string>

namespace fusetrain::trainer {

/// Records keep their keys in the order they were set.
using Record = nlohmann::ordered_json;

class MetricsLog {
 public:
  /// Opens `path` for appending, keeping only the records whose "step" is at
  /// most `keep_through_step` (0: an empty file); the rewrite is atomic.
  void open(const std::string& path, int64_t keep_through_step);
  /// Appends one line and flushes it. NaN and infinities are written as null.
  void write(const Record& record);
  bool is_open() const { return out_.is_open(); }

 private:
  std::ofstream out_;
};

/// Draws RUN_DIR/curves.png from its metrics.jsonl by running `python -m
/// fusetrain.plot RUN_DIR` (`python`: $FUSETRAIN_PYTHON, else the .venv beside
/// the build tree that holds this executable, else python3), for at
/// most `timeout_s`. Returns the image's path, or "" with `why` saying what
/// went wrong (no Python, no fusetrain or matplotlib there, a timeout).
std::string draw_curves(const std::string& run_dir, double timeout_s, std::string* why);

}  // namespace fusetrain::trainer

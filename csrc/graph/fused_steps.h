// Step fusion (Keras' steps_per_execution): several training steps per
// execution, with no host synchronisation between them. On CUDA the K steps
// are captured once as a CUDA graph reading a ring of K static input buffers
// and replayed, one launch per execution; on the CPU they run back to back.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <vector>

namespace fusetrain::graph {

/// One training step: takes a batch (its tensors), returns a tensor (the
/// loss, or stacked metrics) that stays on the device.
using StepFn = std::function<at::Tensor(const std::vector<at::Tensor>& batch)>;

struct FusedStepsOptions {
  int64_t steps_per_execution = 1;
  /// Executions run eagerly before capture (they allocate optimizer state and
  /// workspaces; DDP needs >= 11 eager iterations before capture, a
  /// Float8Linear >= 1 to seed its scaling state). -1: the fewest executions
  /// holding 11 steps, and at least 2.
  int64_t warmup_executions = -1;
  /// Capture CUDA graphs when the batches are on a CUDA device.
  bool use_cuda_graph = true;
};

/// Runs `step` K times per call:
///
///   fusetrain::graph::FusedSteps fused(step, sample_batch, {.steps_per_execution = 16});
///   at::Tensor losses = fused.run(batches);   // [K] losses, read once per execution
///
/// Every batch must match `sample_batch` in count, shapes, dtypes and device
/// (an error names the batch, the tensor and both shapes otherwise). The
/// results equal K unfused calls of `step`.
class FusedSteps {
 public:
  FusedSteps(StepFn step, const std::vector<at::Tensor>& sample_batch, FusedStepsOptions options);
  ~FusedSteps();

  /// Runs one step per batch (1..K batches; fewer than K run eagerly) and
  /// returns the step outputs stacked along a new first dimension.
  at::Tensor run(const std::vector<std::vector<at::Tensor>>& batches);

  /// Drops the captured graph (e.g. after changing the learning rate, which
  /// a graph holds as a constant); the next full execution captures again.
  void reset();

  bool captured() const;
  int64_t steps_per_execution() const { return options_.steps_per_execution; }

 private:
  at::Tensor run_eager(const std::vector<std::vector<at::Tensor>>& batches);
  /// Captures K steps over static copies of `batches` (CUDA builds only).
  void capture(const std::vector<std::vector<at::Tensor>>& batches);
  void check_batch(const std::vector<at::Tensor>& batch, size_t index) const;

  StepFn step_;
  std::vector<at::Tensor> sample_;
  FusedStepsOptions options_;
  int64_t executions_ = 0;
  struct Graph;
  std::unique_ptr<Graph> graph_;
};

}  // namespace fusetrain::graph

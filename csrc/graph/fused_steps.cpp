// Step fusion: K steps per execution, captured as one CUDA graph on CUDA and
// run back to back (no host sync between them) on the CPU.
#include <fusetrain/graph/fused_steps.h>

#include <c10/util/Exception.h>

#ifdef FUSETRAIN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <string>
#include <utility>

namespace fusetrain::graph {

struct FusedSteps::Graph {
#ifdef FUSETRAIN_WITH_CUDA
  at::cuda::CUDAGraph graph;
#endif
  std::vector<std::vector<at::Tensor>> inputs;  // K static batches
  at::Tensor outputs;                           // [K, ...] written by the replay
};

namespace {

// Eager iterations torch's DDP needs before a capture (its reducer rebuilds
// buckets and settles its hooks during the first ones).
constexpr int64_t kDdpWarmupSteps = 11;

// Why a capture failed, from the error it raised, and what to do.
[[maybe_unused]] std::string capture_failure(const std::string& what) {
  // The first line of the error, without torch's backtrace.
  const std::string first = what.substr(0, what.find('\n'));
  std::string cause;
  if (what.find("Run one eager training step before capturing") != std::string::npos) {
    // fusetrain::amp::Float8Linear: a layer would seed its delayed scaling in the graph.
    cause = "a Float8Linear has not run an eager training step yet (set warmup_executions >= 1)";
  } else if (what.find("capturable") != std::string::npos) {
    cause = "the optimizer is not capturable (use fusetrain::optim::FusedAdamW or FusedSGD, which "
            "read the loss scale, the overflow flag, the step counts and, with set_lr_tensor, the "
            "learning rate on the device)";
  } else if (what.find("capturing") != std::string::npos ||
             what.find("StreamCapture") != std::string::npos ||
             what.find("not permitted") != std::string::npos) {
    cause = "a host synchronisation inside the step (.item(), printing a tensor, copying to the "
            "CPU, a GradScaler step with an optimizer that does not take the scale on the device, "
            "or a data-dependent shape such as nonzero or boolean indexing)";
  } else {
    cause = "an operation that cannot be captured";
  }
  return "FusedSteps: the step cannot be captured as a CUDA graph: " + cause + ". The error was: " +
         first + "\nRun with use_cuda_graph = false to train without capture.";
}

}  // namespace

FusedSteps::FusedSteps(StepFn step, const std::vector<at::Tensor>& sample_batch,
                       FusedStepsOptions options)
    : step_(std::move(step)), sample_(sample_batch), options_(options) {
  TORCH_CHECK_VALUE(step_ != nullptr, "FusedSteps: step is empty");
  TORCH_CHECK_VALUE(options.steps_per_execution >= 1,
                    "FusedSteps: steps_per_execution must be >= 1, got ",
                    options.steps_per_execution);
  TORCH_CHECK_VALUE(options.warmup_executions >= -1,
                    "FusedSteps: warmup_executions must be >= 0 (or -1: automatic), got ",
                    options.warmup_executions);
  if (options_.warmup_executions == -1) {
    const int64_t k = options_.steps_per_execution;
    options_.warmup_executions = std::max<int64_t>(2, (kDdpWarmupSteps + k - 1) / k);
  }
  TORCH_CHECK_VALUE(!sample_.empty(), "FusedSteps: sample_batch holds no tensor");
}

FusedSteps::~FusedSteps() = default;

void FusedSteps::check_batch(const std::vector<at::Tensor>& batch, size_t index) const {
  TORCH_CHECK_VALUE(batch.size() == sample_.size(), "FusedSteps: batch ", index, " has ",
                    batch.size(), " tensors but the sample batch has ", sample_.size());
  for (size_t t = 0; t < batch.size(); ++t) {
    TORCH_CHECK_VALUE(batch[t].sizes() == sample_[t].sizes(), "FusedSteps: batch ", index,
                      " tensor ", t, " has shape ", batch[t].sizes(), " but the sample has ",
                      sample_[t].sizes(),
                      "; fused steps need static shapes (drop or pad the last partial batch)");
    TORCH_CHECK_VALUE(
        batch[t].scalar_type() == sample_[t].scalar_type() && batch[t].device() == sample_[t].device(),
        "FusedSteps: batch ", index, " tensor ", t, " is ", batch[t].scalar_type(), " on ",
        batch[t].device(), " but the sample is ", sample_[t].scalar_type(), " on ",
        sample_[t].device());
  }
}

at::Tensor FusedSteps::run_eager(const std::vector<std::vector<at::Tensor>>& batches) {
  std::vector<at::Tensor> outs;
  outs.reserve(batches.size());
  for (const auto& b : batches) outs.push_back(step_(b));
  return at::stack(outs);
}

#ifdef FUSETRAIN_WITH_CUDA
void FusedSteps::capture(const std::vector<std::vector<at::Tensor>>& batches) {
  auto g = std::make_unique<Graph>();
  for (const auto& b : batches) {
    std::vector<at::Tensor> copy;
    for (const auto& t : b) copy.push_back(t.clone());
    g->inputs.push_back(std::move(copy));
  }
  // Capture on a side stream (the current stream may be the legacy default
  // stream, which cannot be captured); the caller's stream waits for it.
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream();
  at::cuda::CUDAEvent inputs_ready;  // the static inputs' copies come before capture
  inputs_ready.record(caller);
  inputs_ready.block(side);
  const auto pool = at::cuda::graph_pool_handle();
  const c10::DeviceIndex device = side.device_index();
  // What CUDAGraph::capture_end skips when cudaStreamEndCapture fails: the
  // allocators would stay in capture mode for the rest of the process.
  auto abandon = [&] {
    try {
      c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool);
    } catch (const std::exception&) {
      return;  // capture_end got past it; the graph's reset() releases the pool
    }
    try {
      at::getHostAllocator(at::kCUDA)->end_allocate_to_pool(pool);
    } catch (const std::exception&) {
    }
    c10::cuda::CUDACachingAllocator::releasePool(device, pool);
  };
  {
    const c10::cuda::CUDAStreamGuard on_side(side);
    // Thread-local: CUDA calls of other threads (a data loader pinning
    // memory) neither break the capture nor fail because of it.
    g->graph.capture_begin(pool, cudaStreamCaptureModeThreadLocal);
    try {
      std::vector<at::Tensor> outs;
      for (const auto& b : g->inputs) outs.push_back(step_(b));
      g->outputs = at::stack(outs);
    } catch (const std::exception& e) {
      // End the capture whatever happened (an invalidated capture fails to
      // end; that error says less than the first one), then explain.
      try {
        g->graph.capture_end();
      } catch (const std::exception&) {
        abandon();
      }
      TORCH_CHECK(false, capture_failure(e.what()));
    }
    try {
      g->graph.capture_end();
    } catch (const std::exception& e) {
      abandon();
      TORCH_CHECK(false, capture_failure(e.what()));
    }
  }
  at::cuda::CUDAEvent captured;
  captured.record(side);
  captured.block(caller);
  graph_ = std::move(g);
}
#endif

bool FusedSteps::captured() const { return graph_ != nullptr; }

void FusedSteps::reset() { graph_.reset(); }

at::Tensor FusedSteps::run(const std::vector<std::vector<at::Tensor>>& batches) {
  const int64_t k = options_.steps_per_execution;
  TORCH_CHECK_VALUE(!batches.empty() && static_cast<int64_t>(batches.size()) <= k,
                    "FusedSteps: run() takes 1 to ", k, " batches, got ", batches.size());
  for (size_t i = 0; i < batches.size(); ++i) check_batch(batches[i], i);
  const bool cuda = sample_[0].is_cuda() && options_.use_cuda_graph;
  if (!cuda || static_cast<int64_t>(batches.size()) < k || executions_ < options_.warmup_executions) {
    ++executions_;
    return run_eager(batches);
  }
#ifdef FUSETRAIN_WITH_CUDA
  // The batches' device, whatever the current one is: a capture on another
  // device's stream would record nothing and replay nothing.
  const c10::cuda::CUDAGuard device_guard(sample_[0].device());
  if (!graph_) capture(batches);
  for (size_t i = 0; i < batches.size(); ++i) {
    for (size_t t = 0; t < batches[i].size(); ++t) {
      graph_->inputs[i][t].copy_(batches[i][t], /*non_blocking=*/true);
    }
  }
  graph_->graph.replay();
  ++executions_;
  return graph_->outputs.clone();
#else
  TORCH_CHECK(false, "FusedSteps: CUDA batches need a CUDA build of fusetrain");
#endif
}

}  // namespace fusetrain::graph

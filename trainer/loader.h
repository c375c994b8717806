// The background batch loader: a thread that prepares the batches of the
// coming steps while the current one computes, so the step never waits for
// its data.
//
// Contract:
//  - The batches are exactly those an inline gather would give: step s of a
//    run takes, for each micro-batch m, the samples the BatchSampler names
//    for (epoch, step in epoch, m), so results are bitwise the same with the
//    loader on or off, and a resumed run starts the loader at its step.
//  - The training split stays in host memory. On a CPU a micro-batch is an
//    index_select there; on a device it is gathered into pinned host memory
//    and copied with a non-blocking copy on a stream of its own, and take()
//    makes the caller's current stream wait for that copy (no host sync).
//  - At most `depth` prepared steps are held; the thread sleeps when the
//    queue is full and stops (joined) when the loader is destroyed.
//  - An error on the thread is rethrown by the next take().
#pragma once

#include "data.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace fusetrain::trainer {

class BatchLoader {
 public:
  /// One micro-batch: inputs and targets on the training device.
  struct Micro {
    at::Tensor inputs;
    at::Tensor targets;
  };

  /// Prepares steps [first, last) of a run with `steps_per_epoch` steps per
  /// epoch and `grad_accum` micro-batches per step, the images augmented by
  /// `augment` (on this thread). `train` and `sampler` are on the CPU; the
  /// batches go to `device`.
  BatchLoader(Split train, BatchSampler sampler, int64_t steps_per_epoch, int64_t grad_accum,
              int64_t first, int64_t last, int64_t depth, at::Device device,
              Augmentation augment = {});
  ~BatchLoader();
  BatchLoader(const BatchLoader&) = delete;
  BatchLoader& operator=(const BatchLoader&) = delete;

  /// The micro-batches of `step`, which must be the next step in order;
  /// blocks until the thread has it, then orders the caller's current stream
  /// after its copy.
  std::vector<Micro> take(int64_t step);

  /// Seconds take() has spent waiting for the thread (the data stalls).
  double wait_seconds() const { return wait_seconds_; }

 private:
  struct Prepared {
    int64_t step;
    std::vector<Micro> micros;
    std::optional<c10::Event> copied;  // devices only: the copies' completion
  };
  void work();
  Prepared prepare(int64_t step);
  at::Tensor gather(const at::Tensor& source, const at::Tensor& index) const;

  Split train_;
  BatchSampler sampler_;
  int64_t steps_per_epoch_;
  int64_t grad_accum_;
  Augmentation augment_;
  int64_t next_take_;
  int64_t last_;
  size_t depth_;
  at::Device device_;
  std::optional<c10::Stream> copy_stream_;

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Prepared> ready_;
  std::exception_ptr error_;
  bool stop_ = false;
  double wait_seconds_ = 0.0;
  std::thread thread_;  // last: started once everything above exists
};

}  // namespace fusetrain::trainer

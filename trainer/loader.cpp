#include "loader.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <utility>

namespace fusetrain::trainer {

BatchLoader::BatchLoader(Split train, BatchSampler sampler, int64_t steps_per_epoch,
                         int64_t grad_accum, int64_t first, int64_t last, int64_t depth,
                         at::Device device, Augmentation augment)
    : train_(std::move(train)),
      sampler_(std::move(sampler)),
      steps_per_epoch_(steps_per_epoch),
      grad_accum_(grad_accum),
      augment_(augment),
      next_take_(first),
      last_(last),
      depth_(static_cast<size_t>(std::max<int64_t>(1, depth))),
      device_(device) {
  TORCH_CHECK(train_.inputs.device().is_cpu() && train_.targets.device().is_cpu(),
              "BatchLoader: the training split must be in host memory");
  if (!device_.is_cpu()) {
    copy_stream_ = c10::impl::VirtualGuardImpl(device_.type()).getStreamFromGlobalPool(device_);
  }
  thread_ = std::thread([this] { work(); });
}

BatchLoader::~BatchLoader() {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

at::Tensor BatchLoader::gather(const at::Tensor& source, const at::Tensor& index) const {
  const int64_t n = index.numel();
  std::vector<int64_t> shape = source.sizes().vec();
  shape[0] = n;
  at::TensorOptions options = source.options();
  if (!device_.is_cpu()) options = options.pinned_memory(true);
  at::Tensor out = at::empty(shape, options);
  // Rows of the split are contiguous (a contiguous tensor, or the windows a
  // token stream's unfold gives): one memcpy each, on this thread alone (an
  // ATen gather here would start an OpenMP team of its own beside the
  // step's).
  const at::Tensor row0 = source.select(0, 0);
  if (!row0.is_contiguous()) return at::index_select_out(out, source, 0, index);
  const size_t row_bytes = static_cast<size_t>(row0.numel()) * source.element_size();
  const auto* base = static_cast<const char*>(source.const_data_ptr());
  const size_t stride_bytes = static_cast<size_t>(source.stride(0)) * source.element_size();
  auto* dst = static_cast<char*>(out.data_ptr());
  const int64_t* idx = index.const_data_ptr<int64_t>();
  const int64_t rows = source.size(0);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(idx[i] >= 0 && idx[i] < rows, "BatchLoader: sample index ", idx[i],
                " outside the split's ", rows, " samples");
    std::memcpy(dst + static_cast<size_t>(i) * row_bytes, base + static_cast<size_t>(idx[i]) * stride_bytes,
                row_bytes);
  }
  return out;
}

BatchLoader::Prepared BatchLoader::prepare(int64_t step) {
  Prepared p{step, {}, std::nullopt};
  const int64_t epoch = step / steps_per_epoch_;
  const int64_t in_epoch = step % steps_per_epoch_;
  for (int64_t m = 0; m < grad_accum_; ++m) {
    const at::Tensor idx = sampler_.indices(epoch, in_epoch, m).contiguous();
    Micro micro{gather(train_.inputs, idx), gather(train_.targets, idx)};
    augment_images_(micro.inputs, idx, epoch, augment_);
    if (copy_stream_) {
      // From pinned memory: the copy is asynchronous, and the pinned block
      // is not reused before it completes (the host allocator records it).
      micro.inputs = micro.inputs.to(device_, /*non_blocking=*/true);
      micro.targets = micro.targets.to(device_, /*non_blocking=*/true);
    }
    p.micros.push_back(std::move(micro));
  }
  if (copy_stream_) {
    p.copied.emplace(device_.type());
    p.copied->record(*copy_stream_);
  }
  return p;
}

void BatchLoader::work() {
  try {
    // All of this thread's device work on the copy stream, a non-blocking
    // one: nothing on the legacy default stream, which would order itself
    // after (and so break) a CUDA graph capture on the training thread.
    std::optional<c10::StreamGuard> on_copy_stream;
    if (copy_stream_) on_copy_stream.emplace(*copy_stream_);
    const at::NoGradGuard no_grad;
    for (int64_t step = next_take_; step < last_; ++step) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        changed_.wait(lock, [&] { return stop_ || ready_.size() < depth_; });
        if (stop_) return;
      }
      Prepared p = prepare(step);
      {
        const std::lock_guard<std::mutex> lock(mutex_);
        ready_.push_back(std::move(p));
      }
      changed_.notify_all();
    }
  } catch (...) {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      error_ = std::current_exception();
    }
    changed_.notify_all();
  }
}

std::vector<BatchLoader::Micro> BatchLoader::take(int64_t step) {
  TORCH_CHECK(step == next_take_, "BatchLoader: step ", step, " taken, but the next one is ",
              next_take_);
  TORCH_CHECK(step < last_, "BatchLoader: step ", step, " is past the run's last step ", last_ - 1);
  Prepared p{0, {}, std::nullopt};
  {
    const auto t0 = std::chrono::steady_clock::now();
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return !ready_.empty() || error_ != nullptr; });
    if (ready_.empty()) std::rethrow_exception(error_);
    p = std::move(ready_.front());
    ready_.pop_front();
    wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  changed_.notify_all();
  ++next_take_;
  if (p.copied) {
    // The caller's stream waits for the copies, and the caching allocator
    // keeps the device memory until that stream is done with it.
    const c10::impl::VirtualGuardImpl impl(device_.type());
    const c10::Stream current = impl.getStream(device_);
    p.copied->block(current);
    for (const Micro& m : p.micros) {
      impl.recordDataPtrOnStream(m.inputs.storage().data_ptr(), current);
      impl.recordDataPtrOnStream(m.targets.storage().data_ptr(), current);
    }
  }
  return std::move(p.micros);
}

}  // namespace fusetrain::trainer

// The DDP reducer (Note [Bucketed gradient reduction] in ddp.h), the shape
// check and the rank-0 broadcast.
#include <fusetrain/dist/ddp.h>

#include <fusetrain/compat.h>
#include <fusetrain/dist/comm_hooks.h>
#include <fusetrain/dist/zero.h>

#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#ifdef FUSETRAIN_WITH_CUDA
#include <c10/cuda/CUDAGraphsC10Utils.h>
#endif

#include <chrono>
#include <cmath>
#include <exception>
#include <limits>
#include <mutex>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

namespace fusetrain::dist {

namespace {

using Clock = std::chrono::steady_clock;

at::Device collective_device(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                             const std::vector<at::Tensor>& tensors) {
  // NCCL groups take CUDA tensors, gloo groups CPU ones.
  if (!tensors.empty() && tensors[0].is_cuda()) return tensors[0].device();
  return at::Device(at::kCPU);
}

void wait_or_throw(const c10::intrusive_ptr<c10d::Work>& work, const char* what) {
  try {
    work->wait();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "DistributedDataParallel: ", what,
                " failed (a rank may have exited or timed out): ", e.what());
  }
}

// Whether work queued now on `device`'s current stream is being captured
// into a CUDA graph (then nothing can be timed).
bool capturing(const at::Device& device) {
#ifdef FUSETRAIN_WITH_CUDA
  if (device.is_cuda()) {
    return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
  }
#endif
  return false;
}

std::string shape_str(at::IntArrayRef s) {
  std::ostringstream out;
  out << s;
  return out.str();
}

}  // namespace

std::vector<std::vector<size_t>> compute_bucket_assignment(const std::vector<at::Tensor>& params,
                                                           size_t first_cap_bytes,
                                                           size_t cap_bytes,
                                                           const std::vector<size_t>& order) {
  std::vector<size_t> sequence = order;
  if (sequence.empty()) {
    for (size_t k = params.size(); k-- > 0;) sequence.push_back(k);
  }
  TORCH_CHECK(sequence.size() == params.size(), "compute_bucket_assignment: the order has ",
              sequence.size(), " entries for ", params.size(), " parameters");
  std::vector<char> seen(params.size(), 0);
  std::vector<std::vector<size_t>> buckets;
  size_t bytes = 0;
  for (const size_t k : sequence) {
    TORCH_CHECK(k < params.size() && !seen[k], "compute_bucket_assignment: the order is not a "
                "permutation of the ", params.size(), " parameters (entry ", k, ")");
    seen[k] = 1;
    const at::Tensor& p = params[k];
    const size_t size = static_cast<size_t>(p.numel()) * p.element_size();
    bool fresh = buckets.empty();
    if (!fresh) {
      const at::Tensor& head = params[buckets.back().front()];
      const size_t cap = buckets.size() == 1 ? first_cap_bytes : cap_bytes;
      fresh = head.scalar_type() != p.scalar_type() || head.device() != p.device() ||
              bytes + size > cap;
    }
    if (fresh) {
      buckets.emplace_back();
      bytes = 0;
    }
    buckets.back().push_back(k);
    bytes += size;
  }
  return buckets;
}

std::vector<int64_t> compute_bucket_offsets(const std::vector<int64_t>& numels,
                                            int64_t element_size) {
  TORCH_CHECK(element_size > 0, "compute_bucket_offsets: element_size must be positive, got ",
              element_size);
  // Elements per aligned step: 4 float32, 8 bfloat16; 1 for 16-byte elements.
  const int64_t step = std::max<int64_t>(1, kBucketAlignmentBytes / element_size);
  std::vector<int64_t> offsets;
  offsets.reserve(numels.size() + 1);
  int64_t end = 0;
  for (size_t k = 0; k < numels.size(); ++k) {
    TORCH_CHECK(numels[k] >= 0, "compute_bucket_offsets: parameter ", k, " has ", numels[k],
                " elements");
    const int64_t offset = (end + step - 1) / step * step;
    offsets.push_back(offset);
    end = offset + numels[k];
  }
  offsets.push_back(end);
  return offsets;
}

void verify_param_shapes(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                         const std::vector<at::Tensor>& params,
                         const std::vector<std::string>& names) {
  // Signature: [count, (ndim, sizes...)...] allgathered after its length.
  std::vector<int64_t> sig{static_cast<int64_t>(params.size())};
  for (const auto& p : params) {
    sig.push_back(p.dim());
    for (int64_t s : p.sizes()) sig.push_back(s);
  }
  const at::Device device = collective_device(group, params);
  const auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  const int world = group->getSize();
  std::vector<at::Tensor> len_in{at::full({1}, static_cast<int64_t>(sig.size()), opts)};
  std::vector<std::vector<at::Tensor>> len_out(1);
  for (int r = 0; r < world; ++r) len_out[0].push_back(at::empty({1}, opts));
  wait_or_throw(group->allgather(len_out, len_in), "the parameter shape check");
  int64_t longest = 0;
  for (const auto& t : len_out[0]) longest = std::max(longest, t.to(at::kCPU).item<int64_t>());
  at::Tensor mine = at::full({longest}, -1, opts);
  mine.narrow(0, 0, static_cast<int64_t>(sig.size()))
      .copy_(at::tensor(sig, at::TensorOptions().dtype(at::kLong)));
  std::vector<at::Tensor> in{mine};
  std::vector<std::vector<at::Tensor>> out(1);
  for (int r = 0; r < world; ++r) out[0].push_back(at::empty({longest}, opts));
  wait_or_throw(group->allgather(out, in), "the parameter shape check");
  const at::Tensor ref = out[0][0].to(at::kCPU);
  const int64_t* r0 = ref.const_data_ptr<int64_t>();
  for (int r = 1; r < world; ++r) {
    const at::Tensor other = out[0][r].to(at::kCPU);
    const int64_t* o = other.const_data_ptr<int64_t>();
    TORCH_CHECK(r0[0] == o[0], "DistributedDataParallel: rank 0 has ", r0[0],
                " parameters but rank ", r, " has ", o[0],
                "; every rank must build the same model");
    int64_t pos = 1;
    for (int64_t i = 0; i < r0[0]; ++i) {
      const int64_t nd0 = r0[pos], nd1 = o[pos];
      bool same = nd0 == nd1;
      for (int64_t d = 0; same && d < nd0; ++d) same = r0[pos + 1 + d] == o[pos + 1 + d];
      if (!same) {
        std::vector<int64_t> s0(r0 + pos + 1, r0 + pos + 1 + nd0);
        std::vector<int64_t> s1(o + pos + 1, o + pos + 1 + nd1);
        TORCH_CHECK(false, "DistributedDataParallel: parameter ", i, " (\"",
                    i < static_cast<int64_t>(names.size()) ? names[i] : "?", "\") has shape ",
                    shape_str(s0), " on rank 0 but ", shape_str(s1), " on rank ", r,
                    "; every rank must build the same model");
      }
      pos += 1 + nd0;
    }
  }
}

void broadcast_from_rank0(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                          const std::vector<at::Tensor>& tensors) {
  broadcast_from(group, tensors, 0);
}

void broadcast_from(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                    const std::vector<at::Tensor>& tensors, int root) {
  TORCH_CHECK_VALUE(root >= 0 && root < group->getSize(), "broadcast_from: root ", root,
                    " is not a rank of this group of ", group->getSize());
  if (group->getSize() == 1 || tensors.empty()) return;
  at::NoGradGuard no_grad;
  // Coalesced per dtype, in buffers of at most 250 MB (as torch's DDP).
  constexpr int64_t kMaxBytes = 250LL << 20;
  std::unordered_map<int, std::vector<at::Tensor>> by_dtype;
  for (const auto& t : tensors) by_dtype[static_cast<int>(t.scalar_type())].push_back(t);
  for (auto& entry : by_dtype) {
    auto& list = entry.second;
    size_t begin = 0;
    while (begin < list.size()) {
      size_t end = begin;
      int64_t bytes = 0;
      while (end < list.size() && (end == begin || bytes + list[end].nbytes() <= kMaxBytes)) {
        bytes += static_cast<int64_t>(list[end].nbytes());
        ++end;
      }
      std::vector<at::Tensor> flat;
      for (size_t i = begin; i < end; ++i) flat.push_back(list[i].detach().reshape(-1));
      std::vector<at::Tensor> buf{at::cat(flat)};
      c10d::BroadcastOptions opts;
      opts.rootRank = root;
      wait_or_throw(group->broadcast(buf, opts), "broadcasting one rank's parameters");
      int64_t offset = 0;
      for (size_t i = begin; i < end; ++i) {
        const int64_t n = list[i].numel();
        list[i].detach().copy_(buf[0].narrow(0, offset, n).view(list[i].sizes()));
        offset += n;
      }
      begin = end;
    }
  }
}

// ------------------------------------------------------------------ Reducer

struct Reducer::Impl : public std::enable_shared_from_this<Reducer::Impl> {
  struct Bucket {
    std::vector<size_t> params;
    // Note [Aligned bucket offsets]: each parameter's; numel: the end of the last.
    std::vector<int64_t> offsets;
    int64_t numel = 0;
    at::Tensor gaps;    // sharded: the padding between parameters (indices), if any
    at::Tensor buffer;  // flat, in the communication dtype
    size_t pending = 0;
    c10::intrusive_ptr<c10d::Work> work;  // without a hook
    // With a hook (Note [Communication hooks]): the bucket as GradBucket
    // describes it, and the hook's future of this backward.
    std::vector<size_t> hook_offsets, hook_lengths;
    std::vector<c10::IntArrayRef> hook_sizes;
    std::vector<at::Tensor> hook_params;
    c10::intrusive_ptr<c10::ivalue::Future> future;
    at::Tensor pooled;  // sharded: the pooled buffer whose front is `buffer`
    at::Tensor fresh;   // sharded, accumulating: this backward's reduced piece
  };

  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  DDPOptions options;
  std::vector<Bucket> buckets;
  std::vector<size_t> bucket_of, slot_of;
  // shard_gradients (ZeRO stage 2): per bucket, this rank's piece of the
  // averaged gradients (the parameters' dtype), where the reduce-scatter
  // lands when that is comm_dtype, and the piece length.
  std::vector<at::Tensor> pieces, comm_pieces;
  std::vector<int64_t> piece_numel;
  // CPU (gloo): an allreduce of the bucket stands for its reduce-scatter
  // (Note [Sharded optimizer state]).
  bool shard_by_allreduce = false;
  // The pieces hold gradients no zero_grad_pieces() has cleared: the next
  // synchronised backward adds to them (accumulating is that backward's
  // copy of it), as autograd adds into p.grad.
  bool pieces_hold_grads = false, accumulating = false;
  std::vector<char> has_grad;  // per parameter: a gradient is in the pieces
  // The full buckets' buffers between backward passes: those in flight,
  // one filling, and one more.
  BufferPool bucket_buffers{kShardBucketsInFlight + 2};
  std::vector<compat::NodeHandle> accumulators;
  std::vector<uintptr_t> hook_keys;
  // Device parameters: the accumulators' side stream (Note [DDP and CUDA
  // graphs]) and the two events that time the exposed communication.
  std::optional<c10::Stream> stream;
  std::optional<c10::Event> ready_event, done_event;
  bool device_timed = false;  // the last backward recorded both events

  std::shared_ptr<c10d::CommHookInterface> hook;
  bool hook_has_one_collective = false;  // fusetrain's allreduce / compression hooks
  bool started = false;          // a prepare_for_backward has run
  double divide_factor = 0.0;    // set_divide_factor; 0: the world size

  std::mutex mutex;
  // Bucket rebuild (Note [Bucketed gradient reduction]): the order gradients
  // became ready in during the first synchronised backward.
  bool rebuilt = false;
  std::vector<size_t> ready_order;
  bool armed = false;
  bool require_sync = true;
  bool finalize_queued = false;
  size_t next_bucket = 0;
  std::vector<char> ready;
  at::Tensor local_used;  // int32 [num params], for find_unused_parameters
  Clock::time_point last_ready{};
  double exposed_seconds = std::numeric_limits<double>::quiet_NaN();

  // The divisions around the allreduce; a hook averages by itself.
  double world() const {
    return divide_factor > 0 ? divide_factor : static_cast<double>(group->getSize());
  }
  double pre_divide() const {
    if (hook) return 1.0;
    const double f = options.gradient_predivide_factor();
    return f == 1.0 ? world() : f;
  }
  double post_divide() const {
    if (hook) return 1.0;
    const double f = options.gradient_predivide_factor();
    return f == 1.0 ? 1.0 : world() / f;
  }

  std::vector<std::vector<size_t>> assignment_for(const std::vector<size_t>& order) const {
    return compute_bucket_assignment(
        params, static_cast<size_t>(options.first_bucket_cap_mb() * (1 << 20)),
        static_cast<size_t>(options.bucket_cap_mb() * (1 << 20)), order);
  }

  bool sharded() const { return options.shard_gradients(); }

  void build_buckets(const std::vector<std::vector<size_t>>& assignment) {
    buckets.clear();
    bucket_of.assign(params.size(), 0);
    slot_of.assign(params.size(), 0);
    pieces.clear();
    comm_pieces.clear();
    piece_numel.clear();
    if (sharded()) {
      has_grad.assign(params.size(), 0);
      shard_by_allreduce = gloo_collectives(params.front(), group);
      std::vector<int64_t> numels, element_sizes;
      for (const auto& p : params) {
        numels.push_back(p.numel());
        element_sizes.push_back(static_cast<int64_t>(p.element_size()));
      }
      const ShardLayout layout(numels, element_sizes, assignment, group->getSize());
      for (size_t b = 0; b < assignment.size(); ++b) {
        const at::Tensor& head = params[assignment[b].front()];
        piece_numel.push_back(layout.piece_numel(b));
        pieces.push_back(at::zeros({layout.piece_numel(b)}, head.options()));
        const auto comm = options.comm_dtype();
        comm_pieces.push_back(comm && *comm != head.scalar_type() && !shard_by_allreduce
                                  ? at::empty({layout.piece_numel(b)}, head.options().dtype(*comm))
                                  : at::Tensor());
      }
    }
    for (size_t b = 0; b < assignment.size(); ++b) {
      Bucket bucket;
      bucket.params = assignment[b];
      // Note [Aligned bucket offsets]: in the parameters' dtype, as the shard
      // layout's (sharded, both must agree).
      std::vector<int64_t> numels;
      for (const size_t i : bucket.params) numels.push_back(params[i].numel());
      std::vector<int64_t> offsets = compute_bucket_offsets(
          numels, static_cast<int64_t>(params[bucket.params.front()].element_size()));
      bucket.numel = offsets.back();
      offsets.pop_back();
      for (size_t s = 0; s < bucket.params.size(); ++s) {
        const size_t i = bucket.params[s];
        bucket_of[i] = b;
        slot_of[i] = s;
        bucket.hook_offsets.push_back(static_cast<size_t>(offsets[s]));
        bucket.hook_lengths.push_back(static_cast<size_t>(params[i].numel()));
        bucket.hook_sizes.push_back(params[i].sizes());
        bucket.hook_params.push_back(params[i]);
      }
      bucket.offsets = std::move(offsets);
      if (sharded()) {
        // The buffer exists only from the bucket's first gradient to the end
        // of its reduce-scatter (ensure_buffer), in pooled memory that held
        // other values: the padding is zeroed there, through these indices.
        std::vector<int64_t> padding;
        for (size_t s = 0; s + 1 < bucket.params.size(); ++s) {
          for (int64_t e = bucket.offsets[s] + numels[s]; e < bucket.offsets[s + 1]; ++e) {
            padding.push_back(e);
          }
        }
        if (!padding.empty()) {
          bucket.gaps = at::tensor(padding, at::TensorOptions().dtype(at::kLong))
                            .to(params[bucket.params.front()].device());
        }
      } else {
        bucket.buffer = at::zeros({bucket.numel}, buffer_options(bucket));
      }
      buckets.push_back(std::move(bucket));
    }
  }

  at::TensorOptions buffer_options(const Bucket& bucket) const {
    const at::Tensor& head = params[bucket.params.front()];
    return head.options().dtype(options.comm_dtype().value_or(head.scalar_type()));
  }

  // Sharded: bucket b's flat buffer padded to world * piece, padding (the
  // gaps between parameters and the tail) zeroed.
  void ensure_buffer(size_t b) {
    Bucket& bucket = buckets[b];
    if (bucket.buffer.defined()) return;
    const int64_t total = bucket.numel;
    const int64_t padded = piece_numel[b] * group->getSize();
    bucket.pooled = bucket_buffers.take(padded, buffer_options(bucket));
    bucket.buffer = bucket.pooled.narrow(0, 0, padded);
    if (padded > total) bucket.buffer.narrow(0, total, padded - total).zero_();
    if (bucket.gaps.defined()) bucket.buffer.index_fill_(0, bucket.gaps, 0);
  }

  // Parameter i's gradient in its bucket. Unsharded, in the parameter's own
  // layout where it is dense (a channels_last convolution weight), as torch's
  // reducer: the gradient autograd writes comes in that layout, so the copy
  // into the bucket runs in memory order and a bucket-view gradient is laid
  // out as the optimizer walks it. Sharded buckets keep the logical order the
  // shards assume (ZeroRedundancyOptimizer takes contiguous parameters).
  at::Tensor view_of(size_t i) {
    if (sharded()) ensure_buffer(bucket_of[i]);
    const Bucket& b = buckets[bucket_of[i]];
    const at::Tensor& p = params[i];
    if (!sharded() && !p.is_contiguous() && p.is_non_overlapping_and_dense()) {
      return b.buffer.as_strided(p.sizes(), p.strides(),
                                 b.buffer.storage_offset() + b.offsets[slot_of[i]]);
    }
    return b.buffer.narrow(0, b.offsets[slot_of[i]], p.numel()).view(p.sizes());
  }

  void register_hooks(const std::shared_ptr<Impl>& self) {
    const at::Device device = params.front().device();
    std::optional<c10::StreamGuard> on_side;
    if (!device.is_cpu()) {
      const c10::impl::VirtualGuardImpl guard_impl(device.type());
      stream = guard_impl.getStreamFromGlobalPool(device);
      on_side.emplace(*stream);
      ready_event.emplace(device.type(), c10::EventFlag::BACKEND_DEFAULT);
      done_event.emplace(device.type(), c10::EventFlag::BACKEND_DEFAULT);
    }
    const std::weak_ptr<Impl> weak = self;
    bool warned = false;
    for (size_t i = 0; i < params.size(); ++i) {
      // Made (if new) while the side stream is current: see the note.
      auto acc = torch::autograd::impl::grad_accumulator(params[i]);
      TORCH_CHECK(acc != nullptr, "DistributedDataParallel: parameter ", i, " (\"", names[i],
                  "\") is not a leaf that requires grad");
      if (stream && !warned) {
        const std::optional<c10::Stream> acc_stream = acc->stream();
        const c10::impl::VirtualGuardImpl guard_impl(device.type());
        if (acc_stream && *acc_stream == guard_impl.getDefaultStream(acc_stream->device())) {
          warned = true;
          TORCH_WARN("DistributedDataParallel: the gradient accumulator of parameter ", i,
                     " (\"", names[i], "\") was made on the default stream (a backward ran "
                     "before DDP was constructed), so its backward cannot be captured in a CUDA "
                     "graph; construct DDP before the first backward");
        }
      }
      hook_keys.push_back(acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [weak, i](const torch::autograd::variable_list& outputs,
                    const torch::autograd::variable_list&) {
            if (auto impl = weak.lock()) impl->on_grad_ready(i);
            return outputs;
          })));
      accumulators.push_back(std::move(acc));
    }
  }

  void unregister_hooks() {
    for (size_t i = 0; i < accumulators.size(); ++i) accumulators[i]->del_post_hook(hook_keys[i]);
  }

  // The gradient of parameter i is final for this backward: copy it into its
  // bucket (scaled, cast) and launch every bucket that is complete and next.
  void on_grad_ready(size_t i) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!armed || !require_sync) return;
    if (!finalize_queued) {
      finalize_queued = true;
      const std::weak_ptr<Impl> weak = shared_from_this();
      torch::autograd::Engine::get_default_engine().queue_callback([weak] {
        if (auto impl = weak.lock()) impl->finalize();
      });
    }
    TORCH_CHECK(!ready[i], "DistributedDataParallel: parameter ", i, " (\"", names[i],
                "\") received its gradient twice in one backward; a parameter used in several "
                "forward passes per backward needs no_sync() or a single forward");
    const at::Tensor& grad = params[i].grad();
    at::Tensor view = view_of(i);
    if (grad.defined()) {
      at::NoGradGuard no_grad;
      const double pre = pre_divide();
      if (grad.is_alias_of(view)) {
        if (pre != 1.0) view.mul_(1.0 / pre);
      } else if (pre != 1.0 && view.scalar_type() == grad.scalar_type()) {
        // Divides while copying: one pass over the gradient, as torch's reducer.
        at::mul_out(view, grad, 1.0 / pre);
      } else {
        view.copy_(grad);  // casts to comm_dtype
        if (pre != 1.0) view.mul_(1.0 / pre);
      }
    } else {
      view.zero_();
    }
    // Sharded: the bucket holds it now; only this rank's piece is kept.
    if (sharded() && grad.defined()) params[i].mutable_grad().reset();
    mark_ready(i);
    if (local_used.defined()) local_used.data_ptr<int32_t>()[i] = 1;
    if (!rebuilt && !options.find_unused_parameters()) ready_order.push_back(i);
  }

  void mark_ready(size_t i) {
    ready[i] = 1;
    Bucket& b = buckets[bucket_of[i]];
    if (--b.pending == 0) {
      // The last bucket to complete overwrites what the earlier ones set.
      if (ready_event) {
        device_timed = !capturing(params.front().device());
        if (device_timed) ready_event->record(current_stream());
      } else {
        last_ready = Clock::now();
      }
    }
    launch_ready_buckets();
  }

  // Strictly in index order: every rank issues the same collective sequence.
  void launch_ready_buckets() {
    while (next_bucket < buckets.size() && buckets[next_bucket].pending == 0) {
      Bucket& b = buckets[next_bucket];
      if (hook) {
        // See the note: the previous bucket's reduction is over first.
        if (next_bucket > 0 && !hook_has_one_collective) buckets[next_bucket - 1].future->wait();
        b.future = run_hook(next_bucket, b.buffer);
      } else if (sharded()) {
        if (shard_by_allreduce) {
          std::vector<at::Tensor> tensors{b.buffer};
          b.work = group->allreduce(tensors);
        } else {
          at::Tensor out;
          if (accumulating) {
            b.fresh = at::empty({piece_numel[next_bucket]}, b.buffer.options());
            out = b.fresh;
          } else {
            out = comm_pieces[next_bucket].defined() ? comm_pieces[next_bucket] : pieces[next_bucket];
          }
          b.work = compat::reduce_scatter_single(*group, out, b.buffer);
        }
        // At most kShardBucketsInFlight full buckets stay alive (plus those
        // still filling): the oldest one's reduce-scatter is awaited and its
        // buffer freed. (On gloo this waits on the autograd thread; on NCCL
        // wait() only orders the stream, and the work keeps the buffer
        // until its kernel is done.)
        if (next_bucket >= kShardBucketsInFlight) retire(next_bucket - kShardBucketsInFlight);
      } else {
        std::vector<at::Tensor> tensors{b.buffer};
        b.work = group->allreduce(tensors);
      }
      ++next_bucket;
    }
  }

  c10::intrusive_ptr<c10::ivalue::Future> run_hook(size_t index, const at::Tensor& buffer) {
    const Bucket& b = buckets[index];
    c10d::GradBucket grad_bucket(index, buckets.size(), buffer, b.hook_offsets, b.hook_lengths,
                                 b.hook_sizes, b.hook_params, std::nullopt);
    c10::intrusive_ptr<c10::ivalue::Future> future = hook->runHook(grad_bucket);
    TORCH_CHECK(future, "DistributedDataParallel: the communication hook returned no future for "
                "bucket ", index);
    return future;
  }

  static constexpr size_t kShardBucketsInFlight = 2;

  // Sharded: bucket b's reduce-scatter is done; its full buffer goes.
  void retire(size_t b) {
    Bucket& bucket = buckets[b];
    if (!bucket.work) return;
    wait_or_throw(bucket.work, "a gradient reduce-scatter");
    bucket.work.reset();
    // On a device the wait ordered the current stream after the collective;
    // the buffer was made on the stream the hooks ran on, which may be
    // another: the allocator must not hand it out before this stream's
    // work so far is done (with or without NCCL's own record_stream).
    if (bucket.pooled.is_cuda()) bucket.pooled.record_stream(current_stream());
    if (shard_by_allreduce) {
      const at::Tensor mine =
          bucket.buffer.narrow(0, group->getRank() * piece_numel[b], piece_numel[b]);
      if (accumulating) {
        bucket.fresh = mine.clone();
      } else {
        pieces[b].copy_(mine);
      }
    }
    bucket.buffer = at::Tensor();
    bucket_buffers.give(std::move(bucket.pooled));
  }

  // Waits for bucket b's reduction; the reduced flat tensor (the bucket's
  // buffer unless a hook returned another one; undefined once retired).
  at::Tensor wait_bucket(size_t b) {
    Bucket& bucket = buckets[b];
    if (sharded()) {
      retire(b);
      return bucket.buffer;
    }
    if (!hook) {
      wait_or_throw(bucket.work, "a gradient allreduce");
      return bucket.buffer;
    }
    at::Tensor result;
    try {
      bucket.future->wait();
      result = hook->parseHookResult(bucket.future->value());  // value() rethrows an error
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "DistributedDataParallel: the communication hook failed on bucket ", b,
                  " (a rank may have exited or timed out): ", e.what());
    }
    TORCH_CHECK(result.defined() && result.numel() == bucket.buffer.numel(),
                "DistributedDataParallel: the communication hook's future for bucket ", b,
                " holds ", result.defined() ? result.numel() : 0, " elements, but the bucket has ",
                bucket.buffer.numel(), "; return a future of the reduced bucket.buffer()");
    return result;
  }

  c10::Stream current_stream() const {
    const at::Device device = params.front().device();
    return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
  }

  void prepare(const std::vector<at::Tensor>& outputs) {
    std::lock_guard<std::mutex> lock(mutex);
    started = true;
    armed = require_sync;
    finalize_queued = false;
    next_bucket = 0;
    ready.assign(params.size(), 0);
    for (auto& b : buckets) {
      b.pending = b.params.size();
      b.work.reset();
      b.future.reset();
    }
    if (!armed) return;
    accumulating = sharded() && pieces_hold_grads;
    ready_order.clear();
    if (options.find_unused_parameters()) {
      local_used = at::zeros({static_cast<int64_t>(params.size())}, at::kInt);
      // Parameters whose accumulator the outputs cannot reach get no gradient
      // this iteration: their slots are zeros, ready now.
      std::unordered_set<torch::autograd::Node*> seen;
      std::vector<torch::autograd::Node*> stack;
      for (const auto& out : outputs) {
        if (out.defined() && out.grad_fn()) stack.push_back(out.grad_fn().get());
      }
      while (!stack.empty()) {
        torch::autograd::Node* node = stack.back();
        stack.pop_back();
        if (!seen.insert(node).second) continue;
        for (const auto& edge : node->next_edges()) {
          if (edge.function) stack.push_back(edge.function.get());
        }
      }
      for (size_t i = 0; i < params.size(); ++i) {
        if (seen.count(accumulators[i].get()) == 0) {
          view_of(i).zero_();
          mark_ready(i);
        }
      }
    }
  }

  void finalize() {
    std::unique_lock<std::mutex> lock(mutex);
    if (!armed) return;
    armed = false;
    if (next_bucket < buckets.size()) {
      std::ostringstream missing;
      int shown = 0;
      for (size_t i = 0; i < params.size() && shown < 5; ++i) {
        if (!ready[i]) missing << (shown++ ? ", " : "") << '"' << names[i] << "\" (index " << i << ')';
      }
      TORCH_CHECK(false, "DistributedDataParallel: parameters got no gradient in this backward: ",
                  missing.str(),
                  ". Pass find_unused_parameters=True if some parameters are unused in some "
                  "iterations, or remove them from the model");
    }
    c10::intrusive_ptr<c10d::Work> used_work;
    std::vector<at::Tensor> used;
    if (local_used.defined()) {
      used.push_back(local_used.to(collective_device(group, params)));
      used_work = group->allreduce(used);
    }
    at::Tensor globally_used;
    if (used_work) {
      wait_or_throw(used_work, "the unused-parameter allreduce");
      globally_used = used[0].to(at::kCPU);
    }
    at::NoGradGuard no_grad;
    const double post = post_divide();
    // Bucket by bucket, as torch's reducer: a bucket's gradients are written
    // back while the later buckets' allreduces are still running.
    for (size_t b = 0; b < buckets.size(); ++b) {
      const at::Tensor reduced = wait_bucket(b);
      if (!sharded() && !reduced.is_same(buckets[b].buffer)) {
        buckets[b].buffer.copy_(reduced.view(-1));
      }
      if (b + 1 == buckets.size()) {
        if (!done_event) {
          exposed_seconds = std::chrono::duration<double>(Clock::now() - last_ready).count();
        } else if (device_timed) {
          done_event->record(current_stream());  // the waits are on this stream
        }
      }
      if (sharded()) {
        if (accumulating) {
          at::Tensor add = buckets[b].fresh.to(pieces[b].scalar_type());
          if (post != 1.0) add.mul_(1.0 / post);
          pieces[b].add_(add);
          if (buckets[b].fresh.is_cuda()) buckets[b].fresh.record_stream(current_stream());
          buckets[b].fresh = at::Tensor();
        } else {
          if (comm_pieces[b].defined()) pieces[b].copy_(comm_pieces[b]);
          if (post != 1.0) pieces[b].mul_(1.0 / post);
        }
        for (const size_t i : buckets[b].params) {
          // Unused on every rank (find_unused_parameters): no gradient, as
          // p.grad stays None unsharded; its slices are not stepped.
          const bool used =
              !globally_used.defined() || globally_used.const_data_ptr<int32_t>()[i] != 0;
          has_grad[i] = (accumulating && has_grad[i]) || used;
        }
        continue;
      }
      for (const size_t i : buckets[b].params) {
        if (globally_used.defined() && globally_used.const_data_ptr<int32_t>()[i] == 0) continue;
        at::Tensor view = view_of(i);
        if (post != 1.0) view.mul_(1.0 / post);
        at::Tensor param = params[i];
        const bool same_dtype = view.scalar_type() == param.scalar_type();
        if (options.gradient_as_bucket_view() && same_dtype) {
          if (!param.grad().defined() || !param.grad().is_alias_of(view)) param.mutable_grad() = view;
        } else if (param.grad().defined()) {
          param.mutable_grad().copy_(view);
        } else {
          param.mutable_grad() = view.to(param.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
        }
      }
    }
    if (sharded()) pieces_hold_grads = true;
    if (!rebuilt && !options.find_unused_parameters()) rebuild_buckets();
  }

  // Once, after the first synchronised backward: buckets in the order the
  // gradients became ready in, rank 0's order on every rank (the layouts must
  // agree for the allreduces to match).
  void rebuild_buckets() {
    rebuilt = true;
    // A rank that joined before its first backward (Note [Uneven inputs])
    // has no order of its own; it proposes the current one (rank 0's wins).
    std::vector<size_t> proposal = ready_order;
    if (proposal.size() != params.size()) {
      proposal.clear();
      for (const auto& b : buckets) proposal.insert(proposal.end(), b.params.begin(), b.params.end());
    }
    std::vector<int64_t> order64(proposal.begin(), proposal.end());
    std::vector<at::Tensor> order{
        at::tensor(order64, at::TensorOptions().dtype(at::kLong))
            .to(collective_device(group, params))};
    if (group->getSize() > 1) {
      c10d::BroadcastOptions opts;
      opts.rootRank = 0;
      wait_or_throw(group->broadcast(order, opts), "broadcasting the gradient ready order");
    }
    const at::Tensor agreed = order[0].to(at::kCPU);
    std::vector<size_t> sequence(params.size());
    for (size_t k = 0; k < sequence.size(); ++k) {
      sequence[k] = static_cast<size_t>(agreed.const_data_ptr<int64_t>()[k]);
    }
    const auto assignment = assignment_for(sequence);
    if (assignment == current_assignment()) return;
    // Gradients that live in the old buckets (gradient_as_bucket_view) move
    // to their new views.
    std::vector<at::Tensor> moved(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& g = params[i].grad();
      if (g.defined() && g.is_alias_of(view_of(i))) moved[i] = g;
    }
    std::vector<Bucket> old = std::move(buckets);
    build_buckets(assignment);
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      if (!moved[i].defined()) continue;
      at::Tensor view = view_of(i);
      view.copy_(moved[i]);
      params[i].mutable_grad() = view;
    }
  }

  void shadow() {
    std::lock_guard<std::mutex> lock(mutex);
    // Scheduled in order, then waited for, as a backward does.
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures;
    for (size_t b = 0; b < buckets.size(); ++b) {
      if (sharded()) {
        at::Tensor zeros = at::zeros({piece_numel[b] * group->getSize()},
                                     buffer_options(buckets[b]));
        if (shard_by_allreduce) {
          std::vector<at::Tensor> tensors{zeros};
          works.push_back(group->allreduce(tensors));
        } else {
          at::Tensor out = at::empty({piece_numel[b]}, zeros.options());
          works.push_back(compat::reduce_scatter_single(*group, out, zeros));
        }
        continue;
      }
      at::Tensor zeros = at::zeros_like(buckets[b].buffer);
      if (hook) {
        if (b > 0 && !hook_has_one_collective) futures.back()->wait();
        futures.push_back(run_hook(b, zeros));
      } else {
        std::vector<at::Tensor> tensors{zeros};
        works.push_back(group->allreduce(tensors));
      }
    }
    for (const auto& w : works) wait_or_throw(w, "a joined rank's gradient allreduce");
    for (size_t b = 0; b < futures.size(); ++b) {
      futures[b]->wait();
      TORCH_CHECK(!futures[b]->hasError(), "DistributedDataParallel: the communication hook "
                  "failed on a joined rank's bucket ", b, ": ", futures[b]->tryRetrieveErrorMessage());
    }
    if (options.find_unused_parameters()) {
      std::vector<at::Tensor> used{at::zeros({static_cast<int64_t>(params.size())},
                                             at::TensorOptions().dtype(at::kInt).device(
                                                 collective_device(group, params)))};
      wait_or_throw(group->allreduce(used), "a joined rank's unused-parameter allreduce");
    } else if (!rebuilt) {
      rebuild_buckets();
    }
  }

  std::vector<std::vector<size_t>> current_assignment() const {
    std::vector<std::vector<size_t>> out;
    for (const auto& b : buckets) out.push_back(b.params);
    return out;
  }
};

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                 c10::intrusive_ptr<c10d::ProcessGroup> group, DDPOptions options)
    : impl_(std::make_shared<Impl>()) {
  TORCH_CHECK_VALUE(!params.empty(), "DistributedDataParallel: the module has no parameters "
                    "that require grad");
  TORCH_CHECK_VALUE(names.size() == params.size(), "Reducer: ", params.size(),
                    " parameters but ", names.size(), " names");
  TORCH_CHECK_VALUE(options.bucket_cap_mb() > 0, "bucket_cap_mb must be > 0, got ",
                    options.bucket_cap_mb());
  TORCH_CHECK_VALUE(options.gradient_predivide_factor() > 0,
                    "gradient_predivide_factor must be > 0, got ",
                    options.gradient_predivide_factor());
  impl_->params = std::move(params);
  impl_->names = std::move(names);
  impl_->group = std::move(group);
  impl_->options = options;
  // The shard layout must stay what the optimizer's state was made for.
  impl_->rebuilt = options.shard_gradients();
  if (impl_->group->getSize() > 1) {
    // Every rank shards alike, or reduce-scatters would meet allreduces.
    std::vector<at::Tensor> flag{
        at::full({1}, options.shard_gradients() ? 1 : 0, at::TensorOptions().dtype(at::kInt))
            .to(collective_device(impl_->group, impl_->params))};
    wait_or_throw(impl_->group->allreduce(flag), "the shard_gradients agreement");
    const int sharding = flag[0].to(at::kCPU).item<int>();
    TORCH_CHECK_VALUE(sharding == 0 || sharding == impl_->group->getSize(),
                      "DistributedDataParallel: shard_gradients is ", options.shard_gradients(),
                      " on this rank (", impl_->group->getRank(), ") but set on ", sharding,
                      " of ", impl_->group->getSize(), " ranks; every rank must pass the same");
  }
  impl_->build_buckets(impl_->assignment_for({}));
  impl_->register_hooks(impl_);
}

Reducer::~Reducer() { impl_->unregister_hooks(); }

void Reducer::prepare_for_backward(const std::vector<at::Tensor>& outputs) {
  impl_->prepare(outputs);
}

void Reducer::register_comm_hook(std::shared_ptr<c10d::CommHookInterface> hook) {
  TORCH_CHECK_VALUE(hook != nullptr, "register_comm_hook: the hook is null");
  std::lock_guard<std::mutex> lock(impl_->mutex);
  // torch's reducer's words.
  TORCH_CHECK(!impl_->hook,
              "register_comm_hook or register_builtin_comm_hook can only be called once.");
  TORCH_CHECK(!impl_->started, "DistributedDataParallel: register_comm_hook must be called before "
              "the first forward pass (training has started with the default allreduce)");
  TORCH_CHECK_VALUE(!impl_->options.comm_dtype().has_value(),
                    "DistributedDataParallel: comm_dtype is a compression hook of its own; pass "
                    "comm_dtype or register a communication hook, not both");
  TORCH_CHECK_VALUE(impl_->options.gradient_predivide_factor() == 1.0,
                    "DistributedDataParallel: a communication hook averages the gradients itself; "
                    "gradient_predivide_factor must stay 1 with a hook");
  TORCH_CHECK_VALUE(!impl_->options.shard_gradients(),
                    "DistributedDataParallel: shard_gradients reduce-scatters the buckets itself; "
                    "it takes no communication hook");
  const auto* ours = dynamic_cast<const CommHook*>(hook.get());
  impl_->hook_has_one_collective = ours != nullptr && ours->issues_one_collective();
  impl_->hook = std::move(hook);
}

bool Reducer::has_comm_hook() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->hook != nullptr;
}

void Reducer::set_divide_factor(double factor) {
  TORCH_CHECK_VALUE(factor >= 0, "set_divide_factor: the factor must be > 0 (or 0 for the world "
                    "size), got ", factor);
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->divide_factor = factor;
}

void Reducer::shadow_synchronized_backward() { impl_->shadow(); }

void Reducer::set_require_sync(bool require) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->require_sync = require;
}

bool Reducer::require_sync() const { return impl_->require_sync; }

std::vector<std::vector<size_t>> Reducer::bucket_indices() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->current_assignment();
}

double Reducer::last_exposed_comm_seconds() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  if (!impl_->done_event) return impl_->exposed_seconds;
  if (!impl_->device_timed || !impl_->done_event->was_marked_for_recording()) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  impl_->done_event->synchronize();
  return impl_->ready_event->elapsedTime(*impl_->done_event) / 1e3;  // ms
}

std::optional<c10::Stream> Reducer::stream() const { return impl_->stream; }

std::vector<at::Tensor> Reducer::grad_pieces() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->pieces;
}

bool Reducer::shard_gradients() const { return impl_->options.shard_gradients(); }

std::vector<bool> Reducer::has_gradient() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return std::vector<bool>(impl_->has_grad.begin(), impl_->has_grad.end());
}

void Reducer::zero_grad_pieces() {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->pieces_hold_grads = false;
  std::fill(impl_->has_grad.begin(), impl_->has_grad.end(), 0);
}

const std::vector<at::Tensor>& Reducer::parameters() const { return impl_->params; }

const c10::intrusive_ptr<c10d::ProcessGroup>& Reducer::process_group() const {
  return impl_->group;
}

// ------------------------------------------------------------------ JoinContext

JoinContext::JoinContext(Reducer& reducer, c10::intrusive_ptr<c10d::ProcessGroup> group,
                         std::vector<at::Tensor> params, std::vector<at::Tensor> buffers,
                         JoinOptions options, std::function<void()> on_close)
    : reducer_(reducer),
      group_(std::move(group)),
      params_(std::move(params)),
      buffers_(std::move(buffers)),
      options_(options),
      on_close_(std::move(on_close)) {}

JoinContext::~JoinContext() {
  if (!finished_ && std::uncaught_exceptions() == 0) {
    try {
      finish();
    } catch (const std::exception& e) {
      TORCH_WARN("DistributedDataParallel: join() could not finish: ", e.what());
    }
  }
  if (on_close_) on_close_();
}

// [ranks training (one-hot) | ranks synchronising this backward | stop], summed.
at::Tensor JoinContext::handshake(bool training, bool require_sync, bool stop) {
  const int world = group_->getSize();
  at::Tensor flags = at::zeros({world + 2}, at::kFloat);
  float* f = flags.data_ptr<float>();
  if (training) f[group_->getRank()] = 1.f;
  f[world] = training && require_sync ? 1.f : 0.f;
  f[world + 1] = stop ? 1.f : 0.f;
  std::vector<at::Tensor> tensors{flags.to(collective_device(group_, params_))};
  wait_or_throw(group_->allreduce(tensors), "join()'s handshake");
  return tensors[0].to(at::kCPU);
}

namespace {

// The highest rank flagged in flags[0, world), or -1.
int highest_flagged(const at::Tensor& flags, int world) {
  const float* f = flags.const_data_ptr<float>();
  for (int r = world - 1; r >= 0; --r) {
    if (f[r] > 0) return r;
  }
  return -1;
}

}  // namespace

void JoinContext::before_forward(bool require_sync, const std::vector<at::Tensor>& buffers) {
  TORCH_CHECK(!finished_, "DistributedDataParallel: a training forward after join's finish()");
  const int world = group_->getSize();
  const at::Tensor h = handshake(/*training=*/true, require_sync, /*stop=*/false);
  if (h.const_data_ptr<float>()[world + 1] != 0) {
    finished_ = true;  // every rank leaves the protocol here
    reducer_.set_divide_factor(0.0);
    // torch's Join's words.
    TORCH_CHECK(false, "Detected at least one rank that exhausted inputs. Throwing across all ranks.");
  }
  const double training = h.narrow(0, 0, world).sum().item<double>();
  reducer_.set_divide_factor(options_.divide_by_initial_world_size() ? 0.0 : training);
  if (!buffers.empty()) {
    at::NoGradGuard no_grad;
    broadcast_from(group_, buffers, highest_flagged(h, world));
  }
}

void JoinContext::finish() {
  if (finished_) return;
  finished_ = true;
  const int world = group_->getSize();
  bool last = true;
  while (true) {
    const at::Tensor h = handshake(false, false, options_.throw_on_early_termination());
    const int root = highest_flagged(h, world);
    if (root < 0) break;  // every rank has finished
    TORCH_CHECK(!options_.throw_on_early_termination(), "Rank ", group_->getRank(),
                " exhausted all inputs.");
    last = false;
    if (!buffers_.empty()) {
      at::NoGradGuard no_grad;
      broadcast_from(group_, buffers_, root);
    }
    if (h.const_data_ptr<float>()[world] > 0) reducer_.shadow_synchronized_backward();
  }
  reducer_.set_divide_factor(0.0);
  // The last rank to finish trained on every step: its model is everyone's.
  at::Tensor mine = at::zeros({world}, at::kFloat);
  if (last) mine.data_ptr<float>()[group_->getRank()] = 1.f;
  std::vector<at::Tensor> votes{mine.to(collective_device(group_, params_))};
  wait_or_throw(group_->allreduce(votes), "join()'s choice of the final model");
  std::vector<at::Tensor> state = params_;
  state.insert(state.end(), buffers_.begin(), buffers_.end());
  at::NoGradGuard no_grad;
  broadcast_from(group_, state, highest_flagged(votes[0].to(at::kCPU), world));
}

}  // namespace fusetrain::dist

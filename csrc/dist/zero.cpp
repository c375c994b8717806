#include <fusetrain/dist/zero.h>

#include <fusetrain/compat.h>
#include <fusetrain/dist/ddp.h>
#include <fusetrain/dist/shared_memory.h>
#include <fusetrain/ops/amp.h>
#include <fusetrain/ops/optim.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <limits>
#include <map>

namespace fusetrain::dist {

namespace {

void wait_for(const c10::intrusive_ptr<c10d::Work>& work, const char* what) {
  try {
    work->wait();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "ZeroRedundancyOptimizer: ", what,
                " failed (a rank may have exited or timed out): ", e.what());
  }
}

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

}  // namespace

bool gloo_collectives(const at::Tensor& t, const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  return !t.is_cuda() && !uses_shared_memory(group);
}

// ------------------------------------------------------------- BufferPool

at::Tensor BufferPool::take(int64_t numel, const at::TensorOptions& options) {
  if (options.device().is_cpu()) {
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->numel() >= numel && it->scalar_type() == options.dtype().toScalarType() &&
          (best == free_.end() || it->numel() < best->numel())) {
        best = it;
      }
    }
    if (best != free_.end()) {
      at::Tensor t = std::move(*best);
      free_.erase(best);
      return t;
    }
  }
  return at::empty({numel}, options);
}

void BufferPool::give(at::Tensor buffer) {
  if (!buffer.defined() || !buffer.device().is_cpu() || capacity_ == 0) return;
  free_.push_back(std::move(buffer));
  if (free_.size() > capacity_) {
    auto smallest = std::min_element(free_.begin(), free_.end(), [](const auto& a, const auto& b) {
      return a.numel() < b.numel();
    });
    free_.erase(smallest);
  }
}

// ------------------------------------------------------------ ShardLayout

ShardLayout::ShardLayout(const std::vector<int64_t>& numels,
                         const std::vector<int64_t>& element_sizes,
                         std::vector<std::vector<size_t>> buckets, int world_size)
    : world_(world_size), numels_(numels), buckets_(std::move(buckets)) {
  TORCH_CHECK(world_ >= 1, "ShardLayout: world_size must be positive, got ", world_);
  TORCH_CHECK(element_sizes.size() == numels_.size(), "ShardLayout: ", element_sizes.size(),
              " element sizes for ", numels_.size(), " parameters");
  offset_.assign(numels_.size(), -1);
  bucket_of_.assign(numels_.size(), 0);
  for (size_t b = 0; b < buckets_.size(); ++b) {
    std::vector<int64_t> sizes;
    for (const size_t i : buckets_[b]) {
      TORCH_CHECK(i < numels_.size() && offset_[i] < 0, "ShardLayout: parameter ", i,
                  " is out of range or in two buckets");
      TORCH_CHECK(element_sizes[i] == element_sizes[buckets_[b].front()], "ShardLayout: bucket ", b,
                  " mixes element sizes (parameter ", i, ")");
      offset_[i] = 0;  // claimed
      bucket_of_[i] = b;
      sizes.push_back(numels_[i]);
    }
    // The reducer's offsets (Note [Aligned bucket offsets]).
    const std::vector<int64_t> offsets =
        compute_bucket_offsets(sizes, buckets_[b].empty() ? 1 : element_sizes[buckets_[b].front()]);
    for (size_t s = 0; s < buckets_[b].size(); ++s) offset_[buckets_[b][s]] = offsets[s];
    const int64_t total = offsets.back();
    bucket_numel_.push_back(total);
    piece_numel_.push_back(round_up((total + world_ - 1) / world_, kShardAlignment));
  }
  for (size_t i = 0; i < numels_.size(); ++i) {
    TORCH_CHECK(offset_[i] >= 0, "ShardLayout: parameter ", i, " is in no bucket");
  }
}

std::vector<ShardSlice> ShardLayout::slices_of(int rank) const {
  TORCH_CHECK(rank >= 0 && rank < world_, "ShardLayout: rank ", rank, " is not in [0, ", world_,
              ")");
  std::vector<ShardSlice> out;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const int64_t lo = rank * piece_numel_[b];
    const int64_t hi = lo + piece_numel_[b];
    for (const size_t i : buckets_[b]) {
      const int64_t begin = std::max(lo, offset_[i]);
      const int64_t end = std::min(hi, offset_[i] + numels_[i]);
      if (begin >= end) continue;
      out.push_back({i, b, begin - offset_[i], end - begin, begin - lo});
    }
  }
  return out;
}

// ------------------------------------------------------ ShardedParameters

ShardedParameters::ShardedParameters(std::vector<at::Tensor> params,
                                     std::vector<std::vector<size_t>> buckets,
                                     c10::intrusive_ptr<c10d::ProcessGroup> group,
                                     bool parameters_as_bucket_view)
    : params_(std::move(params)), group_(std::move(group)) {
  TORCH_CHECK(group_, "ZeroRedundancyOptimizer: no process group");
  rank_ = group_->getRank();
  std::vector<int64_t> numels;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    TORCH_CHECK(p.is_contiguous(), "ZeroRedundancyOptimizer: parameter ", i, " (shape ", p.sizes(),
                ") is not contiguous; its shards are flat views of it. Make it "
                "contiguous (e.g. without channels_last) before constructing the optimizer");
    numels.push_back(p.numel());
  }
  for (const auto& bucket : buckets) {
    TORCH_CHECK(!bucket.empty(), "ZeroRedundancyOptimizer: an empty bucket");
    for (const size_t i : bucket) {
      TORCH_CHECK(i < params_.size(), "ZeroRedundancyOptimizer: bucket index ", i,
                  " is out of range");
      const at::Tensor& head = params_[bucket.front()];
      TORCH_CHECK(
          params_[i].scalar_type() == head.scalar_type() && params_[i].device() == head.device(),
          "ZeroRedundancyOptimizer: a bucket mixes dtypes or devices (parameter ", i, ")");
    }
  }
  std::vector<int64_t> element_sizes;
  for (const at::Tensor& p : params_)
    element_sizes.push_back(static_cast<int64_t>(p.element_size()));
  layout_ = ShardLayout(numels, element_sizes, std::move(buckets), group_->getSize());
  if (parameters_as_bucket_view) {
    at::NoGradGuard no_grad;
    for (size_t b = 0; b < layout_.buckets().size(); ++b) {
      const at::Tensor& head = params_[layout_.buckets()[b].front()];
      at::Tensor flat = at::zeros({layout_.piece_numel(b) * layout_.world_size()}, head.options());
      for (const size_t i : layout_.buckets()[b]) {
        at::Tensor view =
            flat.narrow(0, layout_.offset_of(i), params_[i].numel()).view(params_[i].sizes());
        view.copy_(params_[i]);
        params_[i].set_data(view);  // the Parameter object stays; its storage moves
      }
      flat_.push_back(std::move(flat));
    }
  }
  for (const at::Tensor& p : params_) storages_.push_back(p.storage());
  // The buckets in the order the parameters come (the forward's order for
  // most modules), whatever order the bucketing made (the reducer's runs
  // backward).
  for (size_t b = 0; b < layout_.buckets().size(); ++b) gather_order_.push_back(b);
  const auto first = [&](size_t b) {
    const auto& idx = layout_.buckets()[b];
    return *std::min_element(idx.begin(), idx.end());
  };
  std::stable_sort(gather_order_.begin(), gather_order_.end(),
                   [&](size_t a, size_t b) { return first(a) < first(b); });
  slices_ = layout_.slices_of(rank_);
  for (const ShardSlice& s : slices_) {
    param_slices_.push_back(params_[s.param].detach().view(-1).narrow(0, s.begin, s.length));
  }
}

at::Device ShardedParameters::device() const {
  return params_.empty() ? at::Device(at::kCPU) : params_.front().device();
}

std::vector<at::Tensor> ShardedParameters::grad_slices() const {
  std::vector<at::Tensor> out;
  out.reserve(slices_.size());
  for (const ShardSlice& s : slices_) {
    const at::Tensor& g = params_[s.param].grad();
    if (!g.defined()) {
      out.emplace_back();
      continue;
    }
    TORCH_CHECK(g.is_contiguous() && g.sizes() == params_[s.param].sizes(),
                "ZeroRedundancyOptimizer: the gradient of parameter ", s.param,
                " is not contiguous or not shaped like it");
    out.push_back(g.view(-1).narrow(0, s.begin, s.length));
  }
  return out;
}

std::vector<at::Tensor> ShardedParameters::slices_of_pieces(const std::vector<at::Tensor>& pieces,
                                                            const std::vector<bool>& has) const {
  TORCH_CHECK(pieces.size() == layout_.buckets().size(), "ZeroRedundancyOptimizer: ", pieces.size(),
              " gradient pieces for ", layout_.buckets().size(), " buckets");
  std::vector<at::Tensor> out;
  out.reserve(slices_.size());
  TORCH_CHECK(has.empty() || has.size() == params_.size(), "ZeroRedundancyOptimizer: ", has.size(),
              " gradient flags for ", params_.size(), " parameters");
  for (const ShardSlice& s : slices_) {
    if (!has.empty() && !has[s.param]) {
      out.emplace_back();
    } else {
      out.push_back(pieces[s.bucket].narrow(0, s.piece_offset, s.length));
    }
  }
  return out;
}

void ShardedParameters::check_storages() const {
  // This rank's piece is not unpacked: its slices are views of the
  // parameters (of the flat buckets with parameters_as_bucket_view), which
  // the step updated. A parameter given new storage since (p.data = ...)
  // would keep its old values there: an error, raised on every rank (each
  // checks every parameter) before any collective.
  for (size_t i = 0; i < params_.size(); ++i) {
    TORCH_CHECK(params_[i].storage().unsafeGetStorageImpl() == storages_[i].unsafeGetStorageImpl(),
                "ZeroRedundancyOptimizer: parameter ", i, " (shape ", params_[i].sizes(),
                ") has new storage since the optimizer was made (e.g. p.data = ... or a move to "
                "another device or dtype); its shard is a view of the old one. Make the optimizer "
                "after moving or casting the model");
  }
}

std::vector<c10::intrusive_ptr<c10d::Work>> ShardedParameters::gather_into(at::Tensor full,
                                                                           int64_t piece) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  if (gloo_collectives(full, group_)) {
    for (int r = 0; r < layout_.world_size(); ++r) {
      std::vector<at::Tensor> t{full.narrow(0, r * piece, piece)};
      c10d::BroadcastOptions opts;
      opts.rootRank = r;
      works.push_back(group_->broadcast(t, opts));
    }
  } else {
    at::Tensor mine = full.narrow(0, rank_ * piece, piece);  // in place, as NCCL allows
    works.push_back(compat::all_gather_single(*group_, full, mine));
  }
  return works;
}

void ShardedParameters::start_all_gather() {
  TORCH_CHECK(
      !flat_.empty() || layout_.buckets().empty(),
      "ZeroRedundancyOptimizer: overlapping the all-gather with the next forward needs "
      "parameters_as_bucket_view=True (the all-gather then writes the parameters in place)");
  finish_all_gather();
  check_storages();
  at::NoGradGuard no_grad;
  pending_.assign(layout_.buckets().size(), {});
  for (const size_t b : gather_order_) pending_[b] = gather_into(flat_[b], layout_.piece_numel(b));
}

void ShardedParameters::finish_bucket(size_t b) {
  TORCH_CHECK(b < layout_.buckets().size(), "ZeroRedundancyOptimizer: bucket ", b,
              " is out of range");
  if (pending_.empty()) return;
  for (const auto& w : pending_[b]) wait_for(w, "the parameter all-gather");
  pending_[b].clear();
}

void ShardedParameters::finish_all_gather() {
  if (pending_.empty()) return;
  // In the order they were issued: on gloo a later broadcast may wait on an
  // earlier one.
  for (const size_t b : gather_order_) finish_bucket(b);
  pending_.clear();
}

bool ShardedParameters::all_gather_pending() const {
  return std::any_of(pending_.begin(), pending_.end(), [](const auto& w) { return !w.empty(); });
}

void ShardedParameters::all_gather_params() {
  finish_all_gather();
  check_storages();
  at::NoGradGuard no_grad;
  const size_t nb = layout_.buckets().size();
  std::vector<at::Tensor> fulls(nb), pooled(nb);
  std::vector<std::vector<c10::intrusive_ptr<c10d::Work>>> works(nb);
  size_t k = 0;  // the next slice to pack
  auto launch = [&](size_t b) {
    const at::Tensor& head = params_[layout_.buckets()[b].front()];
    const int64_t piece = layout_.piece_numel(b);
    if (flat_.empty()) {
      // This rank's piece, packed where the gather puts it.
      pooled[b] = gather_buffers_.take(piece * layout_.world_size(), head.options());
      fulls[b] = pooled[b].narrow(0, 0, piece * layout_.world_size());
      at::Tensor mine = fulls[b].narrow(0, rank_ * piece, piece);
      // The slices fill the piece in order; only what they leave (the
      // bucket's padding) is zeroed, not the whole piece first.
      int64_t filled = 0;
      for (; k < slices_.size() && slices_[k].bucket == b; ++k) {
        const ShardSlice& s = slices_[k];
        if (s.piece_offset > filled) mine.narrow(0, filled, s.piece_offset - filled).zero_();
        mine.narrow(0, s.piece_offset, s.length).copy_(param_slices_[k]);
        filled = s.piece_offset + s.length;
      }
      if (piece > filled) mine.narrow(0, filled, piece - filled).zero_();
    } else {
      fulls[b] = flat_[b];  // the slices are views of it: this rank's piece is in place
    }
    works[b] = gather_into(fulls[b], piece);
  };
  // Bucket b + 1 is on the wire while bucket b is unpacked, and at most two
  // gather buffers are alive: never a second copy of all the parameters.
  if (nb > 0) launch(0);
  for (size_t b = 0; b < nb; ++b) {
    if (b + 1 < nb) launch(b + 1);
    for (const auto& w : works[b]) wait_for(w, "the parameter all-gather");
    works[b].clear();
    if (flat_.empty()) {  // else the parameters are views of it
      // The other ranks' pieces only: this rank's slices are views of the
      // parameters, which the step has already updated.
      const int64_t piece = layout_.piece_numel(b);
      const int64_t own_lo = rank_ * piece, own_hi = own_lo + piece;
      for (const size_t i : layout_.buckets()[b]) {
        const int64_t lo = layout_.offset_of(i), hi = lo + params_[i].numel();
        const at::Tensor flat = params_[i].detach().view(-1);
        const auto unpack = [&](int64_t from, int64_t to) {
          if (to > from)
            flat.narrow(0, from - lo, to - from).copy_(fulls[b].narrow(0, from, to - from));
        };
        unpack(lo, std::min(hi, own_lo));
        unpack(std::max(lo, own_hi), hi);
      }
    }
    fulls[b] = at::Tensor();
    gather_buffers_.give(std::move(pooled[b]));
  }
}

std::vector<at::Tensor> ShardedParameters::gather(const std::vector<at::Tensor>& per_slice,
                                                  at::ScalarType dtype, int to) const {
  TORCH_CHECK(per_slice.size() == slices_.size(), "ZeroRedundancyOptimizer: gather got ",
              per_slice.size(), " tensors for ", slices_.size(), " slices");
  at::NoGradGuard no_grad;
  const at::Device dev = device();
  // Which parameters any rank has a defined slice for.
  at::Tensor defined =
      at::zeros({static_cast<int64_t>(params_.size())}, at::TensorOptions().dtype(at::kInt));
  for (size_t k = 0; k < slices_.size(); ++k) {
    if (per_slice[k].defined()) defined.data_ptr<int32_t>()[slices_[k].param] = 1;
  }
  {
    std::vector<at::Tensor> t{defined.to(dev)};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::MAX;
    wait_for(group_->allreduce(t, opts), "the state-consolidation allreduce");
    defined = t[0].to(at::kCPU);
  }
  const bool keep = to < 0 || to == rank_;
  std::vector<at::Tensor> out;
  if (keep) out.resize(params_.size());
  size_t k = 0;
  for (size_t b = 0; b < layout_.buckets().size(); ++b) {
    const at::TensorOptions opts = at::TensorOptions().dtype(dtype).device(dev);
    at::Tensor send = at::zeros({layout_.piece_numel(b)}, opts);
    for (; k < slices_.size() && slices_[k].bucket == b; ++k) {
      if (per_slice[k].defined()) {
        TORCH_CHECK(per_slice[k].numel() == slices_[k].length,
                    "ZeroRedundancyOptimizer: ", "gather: slice ", k, " has ", per_slice[k].numel(),
                    " elements, expected ", slices_[k].length);
        send.narrow(0, slices_[k].piece_offset, slices_[k].length).copy_(per_slice[k].reshape(-1));
      }
    }
    at::Tensor full = at::empty({layout_.piece_numel(b) * layout_.world_size()}, opts);
    wait_for(compat::all_gather_single(*group_, full, send), "the state-consolidation all-gather");
    if (!keep) continue;
    for (const size_t i : layout_.buckets()[b]) {
      if (defined.const_data_ptr<int32_t>()[i] == 0) continue;
      out[i] = full.narrow(0, layout_.offset_of(i), params_[i].numel())
                   .view(params_[i].sizes())
                   .to(at::kCPU, /*non_blocking=*/false,
                       /*copy=*/true);  // not a second copy on the device
    }
  }
  return out;
}

std::vector<at::Tensor> ShardedParameters::shard(const std::vector<at::Tensor>& full) const {
  TORCH_CHECK(full.size() == params_.size(), "ZeroRedundancyOptimizer: shard got ", full.size(),
              " tensors for ", params_.size(), " parameters");
  std::vector<at::Tensor> out;
  out.reserve(slices_.size());
  for (const ShardSlice& s : slices_) {
    const at::Tensor& t = full[s.param];
    if (!t.defined()) {
      out.emplace_back();
      continue;
    }
    TORCH_CHECK(t.numel() == params_[s.param].numel(), "ZeroRedundancyOptimizer: state for ",
                "parameter ", s.param, " has ", t.numel(), " elements, the parameter ",
                params_[s.param].numel());
    out.push_back(t.reshape(-1).narrow(0, s.begin, s.length).clone());
  }
  return out;
}

at::Tensor ShardedParameters::global_norm(const std::vector<at::Tensor>& tensors) const {
  at::NoGradGuard no_grad;
  const at::Device dev = device();
  std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (const auto& t : tensors) {
    if (t.defined() && t.numel() > 0) by_dtype[t.scalar_type()].push_back(t);
  }
  at::Tensor sq = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(dev));
  for (const auto& [dtype, list] : by_dtype) {
    const at::Tensor norm = std::get<0>(ops::multi_tensor_l2norm(list));
    sq.add_(norm.square().to(dev));
  }
  std::vector<at::Tensor> t{sq};
  wait_for(group_->allreduce(t), "the gradient-norm allreduce");
  return t[0].sqrt().reshape({});
}

at::Tensor ShardedParameters::any_non_finite(const std::vector<at::Tensor>& tensors) const {
  at::NoGradGuard no_grad;
  const at::Device dev = device();
  at::Tensor found = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(dev));
  const at::Tensor one = at::ones({1}, found.options());
  std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (const auto& t : tensors) {
    if (t.defined() && t.numel() > 0) by_dtype[t.scalar_type()].push_back(t);
  }
  for (const auto& [dtype, list] : by_dtype) ops::non_finite_check_and_unscale_(list, found, one);
  std::vector<at::Tensor> t{found};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::MAX;
  wait_for(group_->allreduce(t, opts), "the overflow-flag allreduce");
  return at::where(t[0] > 0, std::numeric_limits<float>::infinity(), 0.0f).to(at::kFloat);
}

}  // namespace fusetrain::dist

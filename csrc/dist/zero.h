// Sharded optimizer state and gradients (ZeRO stages 1 and 2): the layout
// every rank agrees on, and the collectives that move shards.
//
// Note [Sharded optimizer state]
// The parameters are laid out in buckets (lists of parameter indices of one
// dtype and device, as the reducer's): bucket b is the parameters' elements
// in order, each starting 16-byte aligned as in the reducer's buckets (Note
// [Aligned bucket offsets] in ddp.h), T_b elements to the end of the last,
// padded to N * P_b with P_b = ceil(T_b / N) rounded up to kShardAlignment
// elements. Rank r owns piece r, elements
// [r * P_b, (r + 1) * P_b) of every bucket, so it owns about 1/N of every
// bucket whatever the parameter sizes: a parameter that straddles a piece
// boundary is split between ranks, and its slices are flat views of it.
// Each rank runs the optimizer on its slices only, so its optimizer state
// (moments, fp32 masters) is total / N plus less than one alignment (and
// its share of the padding between parameters) per bucket; the update is
// elementwise, so a slice gets the same bits as the whole parameter would.
// The piece boundaries (multiples of kShardAlignment
// elements, 16 bytes or more in every dtype) and the parameters' offsets
// being 16-byte aligned, every slice starts 16-byte aligned: in the piece,
// in the flat bucket, and in the parameter (given aligned storage), so the
// fused optimizers take their vector path on the shards. The padding between
// parameters belongs to no slice. After the step one all-gather per bucket, in
// bucket order, gives every rank every updated element.
//
// Stage 2 (DDPOptions::shard_gradients): the reducer reduce-scatters each
// bucket instead of allreducing it, so rank r keeps only piece r of the
// averaged gradients (grad_pieces(); the full buckets live only while their
// reduce-scatter runs) and p.grad stays empty. The optimizer then reads its
// gradient slices from those pieces, which is why both stages share this
// layout: the reducer's buckets define it (fixed in stage 2: no rebuild in
// the ready order).
//
// The collectives follow the backend. On CUDA tensors (NCCL) they are the
// ones named above. On CPU tensors (gloo) a bucket's all-gather is N
// broadcasts into the gathered buffer, one from each piece's owner, and its
// reduce-scatter an allreduce of the bucket of which the rank keeps its
// piece: measured on 2 ranks with 18.9 MB pieces (2-core EPYC, loopback),
// gloo's allgather takes 74 ms where the broadcasts take 29 ms, and its
// reduce_scatter 109 ms where the allreduce of the same bucket takes 58 ms.
// (The allreduce's buffer is the bucket padded to N * P_b, so on 3 or more
// ranks gloo's ring may add the ranks' values in another order than
// unsharded DDP's allreduce of the bucket without that tail; on 2 ranks the
// one sum is the same.)
// Ranks on one host whose group allreduces through shared memory (Note
// [Shared-memory allreduce]) take the named collectives again, which that
// backend runs in its segment: its reduce-scatter adds the ranks in rank
// order as its allreduce does, so stage 2 has unsharded DDP's bits on any
// number of ranks there.
//
// Everything here that reads values across ranks (norms, overflow flags,
// state consolidation) is a collective on the group and is issued in the
// same order on every rank.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstdint>
#include <vector>

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace fusetrain::dist {

/// Pieces are padded to a multiple of this many elements (64-byte aligned
/// pieces for float32, vector-width aligned for every dtype).
inline constexpr int64_t kShardAlignment = 16;

/// Whether collectives on `t` over `group` take the gloo forms of the note:
/// CPU tensors, unless the group's CPU backend is the shared-memory one.
bool gloo_collectives(const at::Tensor& t, const c10::intrusive_ptr<c10d::ProcessGroup>& group);

/// Flat buffers kept for reuse, at most `capacity` of them. On the CPU a
/// fresh allocation of tens of MB faults in every page each time (glibc
/// returns such blocks to the kernel when freed); CUDA's caching allocator
/// reuses blocks by itself, so there take() allocates and give() drops.
class BufferPool {
 public:
  explicit BufferPool(size_t capacity) : capacity_(capacity) {}
  /// A buffer of at least `numel` elements of `options` (the smallest
  /// pooled one that fits, else a new one of exactly numel). Use
  /// narrow(0, 0, numel) of it.
  at::Tensor take(int64_t numel, const at::TensorOptions& options);
  /// Back to the pool (the smallest one goes when it is full).
  void give(at::Tensor buffer);

 private:
  size_t capacity_;
  std::vector<at::Tensor> free_;
};

/// One rank's share of one parameter: elements [begin, begin + length) of
/// the flattened parameter, at `piece_offset` in the rank's piece of
/// `bucket`.
struct ShardSlice {
  size_t param = 0;
  size_t bucket = 0;
  int64_t begin = 0;
  int64_t length = 0;
  int64_t piece_offset = 0;
};

/// The layout of Note [Sharded optimizer state]. Pure: unit-tested.
class ShardLayout {
 public:
  ShardLayout() = default;
  /// `numels[i]`, `element_sizes[i]`: parameter i's element count and bytes
  /// per element (one size per bucket); `buckets`: parameter indices per
  /// bucket (every parameter once).
  ShardLayout(const std::vector<int64_t>& numels, const std::vector<int64_t>& element_sizes,
              std::vector<std::vector<size_t>> buckets, int world_size);

  int world_size() const { return world_; }
  size_t num_params() const { return numels_.size(); }
  const std::vector<std::vector<size_t>>& buckets() const { return buckets_; }
  /// Elements of bucket b up to the end of its last parameter (the padding
  /// between parameters included), and per rank piece.
  int64_t bucket_numel(size_t b) const { return bucket_numel_[b]; }
  int64_t piece_numel(size_t b) const { return piece_numel_[b]; }
  /// Offset of parameter i in its bucket (16-byte aligned), and the bucket.
  int64_t offset_of(size_t i) const { return offset_[i]; }
  size_t bucket_of(size_t i) const { return bucket_of_[i]; }
  /// Rank r's slices, in bucket order, then offset (empty slices left out).
  std::vector<ShardSlice> slices_of(int rank) const;

 private:
  int world_ = 1;
  std::vector<int64_t> numels_;
  std::vector<std::vector<size_t>> buckets_;
  std::vector<int64_t> bucket_numel_, piece_numel_, offset_;
  std::vector<size_t> bucket_of_;
};

/// The parameters of one data-parallel group, sharded as the layout says,
/// and the collectives both ZeRO stages use. The Python and C++
/// ZeroRedundancyOptimizer run their local optimizer on param_slices().
class ShardedParameters {
 public:
  /// `params`: contiguous tensors (their slices are flat views). With
  /// `parameters_as_bucket_view` each parameter's storage moves into a flat
  /// buffer per bucket, so the all-gather writes the parameters in place.
  ShardedParameters(std::vector<at::Tensor> params, std::vector<std::vector<size_t>> buckets,
                    c10::intrusive_ptr<c10d::ProcessGroup> group,
                    bool parameters_as_bucket_view = false);

  const ShardLayout& layout() const { return layout_; }
  int rank() const { return rank_; }
  const std::vector<at::Tensor>& params() const { return params_; }
  /// This rank's slices and, in the same order, flat views of the
  /// parameters' elements they cover.
  const std::vector<ShardSlice>& slices() const { return slices_; }
  const std::vector<at::Tensor>& param_slices() const { return param_slices_; }
  /// Views of each slice of p.grad (stage 1); undefined where p.grad is.
  std::vector<at::Tensor> grad_slices() const;
  /// Views of each slice of `pieces` (one flat tensor per bucket, this
  /// rank's piece: the reducer's gradient pieces in stage 2); undefined for
  /// the slices of parameters `has` (when given) says false for.
  std::vector<at::Tensor> slices_of_pieces(const std::vector<at::Tensor>& pieces,
                                           const std::vector<bool>& has = {}) const;

  /// Every rank's updated slices to every rank: one all-gather per bucket,
  /// all issued before the first is unpacked.
  void all_gather_params();

  /// Note [Overlapped all-gather]: with parameters_as_bucket_view, issues
  /// every bucket's all-gather into the parameters (in the order the
  /// parameters come: buckets holding earlier parameters first) and returns
  /// without waiting. Bucket b's parameters hold every rank's update only
  /// after finish_bucket(b) or finish_all_gather(); until then the other
  /// ranks' pieces may be half written. A forward that finishes each bucket
  /// just before it reads the bucket's parameters overlaps the rest of the
  /// communication (on CUDA, finish only orders the current stream after
  /// the collective). A pending all-gather is finished first by the next
  /// start_all_gather() and all_gather_params().
  void start_all_gather();
  /// Waits for bucket b's all-gather; nothing when it is not pending.
  void finish_bucket(size_t b);
  /// Waits for every pending all-gather.
  void finish_all_gather();
  bool all_gather_pending() const;

  /// Full tensors, one per parameter (its shape, `dtype`, on the CPU),
  /// from every rank's `per_slice` tensors (this rank's, in slices() order;
  /// an undefined one counts as zeros). Returned on rank `to` (on every rank
  /// when to < 0); elsewhere the vector is empty. Parameters for which no
  /// rank had a defined slice are undefined in the result.
  std::vector<at::Tensor> gather(const std::vector<at::Tensor>& per_slice, at::ScalarType dtype,
                                 int to) const;
  /// This rank's slices of full per-parameter tensors (`full[i]` shaped like
  /// parameter i, or undefined: then undefined slices), copied.
  std::vector<at::Tensor> shard(const std::vector<at::Tensor>& full) const;

  /// sqrt(sum over ranks of sum_k ||tensors[k]||^2), float32, on the first
  /// tensor's device: the global L2 norm from shard norms (one allreduce).
  at::Tensor global_norm(const std::vector<at::Tensor>& tensors) const;
  /// A one-element float32 tensor that is +inf when any rank's `tensors`
  /// hold an inf or NaN and 0 otherwise (one allreduce; no host sync on CUDA).
  at::Tensor any_non_finite(const std::vector<at::Tensor>& tensors) const;

 private:
  at::Device device() const;
  void check_storages() const;
  // Issues the all-gather of a bucket laid out in `full` (world pieces of
  // `piece` elements, this rank's in place): N broadcasts in the gloo form
  // of the note, else one all_gather_into_tensor.
  std::vector<c10::intrusive_ptr<c10d::Work>> gather_into(at::Tensor full, int64_t piece);

  std::vector<at::Tensor> params_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int rank_ = 0;
  ShardLayout layout_;
  std::vector<ShardSlice> slices_;
  std::vector<at::Tensor> param_slices_;
  // Each parameter's storage when the layout was made: the slices and the
  // unpack rely on it (all_gather_params checks it on every rank).
  std::vector<c10::Storage> storages_;
  std::vector<size_t> gather_order_;  // buckets by their first parameter
  std::vector<std::vector<c10::intrusive_ptr<c10d::Work>>> pending_;  // per bucket, when started
  std::vector<at::Tensor> flat_;  // per bucket, with parameters_as_bucket_view
  BufferPool gather_buffers_{2};  // the all-gather's, without it
};

}  // namespace fusetrain::dist

// Multi-tensor apply: one launch walks many tensors.
//
// Note [Multi-tensor launch layout]
// The tensor list travels in the kernel's parameter block (CUDA >= 12.1 lets it
// be 32 KB on Volta and newer): per tensor its Depth pointers, its length and
// the index of its first 64K-element chunk. A grid sized to fill the device
// strides over the chunks; a block finds the tensor a chunk belongs to by a
// binary search over the chunk offsets. Unlike apex's per-block tables this
// needs no fixed number of blocks per launch, so the grid can fill all 132
// SMs of an H200, and any number of tensors fits in a few launches.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fusetrain::kernels {

constexpr int64_t kChunkSize = 65536;
constexpr int kBlockSize = 512;
// Bytes of kernel parameters we allow ourselves (the limit is 32764).
constexpr int kParamBytes = 32000;

template <int Depth>
struct TensorListMeta {
  // Pointers, lengths and chunk offsets for as many tensors as fit.
  static constexpr int kMaxTensors = (kParamBytes - 256) / (Depth * 8 + 8 + 4 + 4);
  void* ptrs[Depth][kMaxTensors];
  int64_t numel[kMaxTensors];
  int32_t first_chunk[kMaxTensors + 1];
  // Position of each tensor in the caller's list (empty tensors are skipped)
  // and this launch's first chunk among all the caller's chunks: what ops that
  // write per-tensor or per-chunk results index by.
  int32_t index[kMaxTensors];
  int32_t chunk_offset;
  int32_t num_tensors;
};

/// The tensor holding global chunk `chunk` (first_chunk is ascending).
template <int Depth>
__device__ __forceinline__ int find_tensor(const TensorListMeta<Depth>& meta, int32_t chunk) {
  int lo = 0;
  int hi = meta.num_tensors - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (meta.first_chunk[mid] <= chunk) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

/// Calls op(meta, tensor, start, n) for every chunk of every tensor. `op` is a
/// functor taking the chunk's tensor index, first element and element count.
template <int Depth, typename Op>
__global__ void __launch_bounds__(kBlockSize)
    multi_tensor_kernel(const __grid_constant__ TensorListMeta<Depth> meta, Op op) {
  const int32_t total = meta.first_chunk[meta.num_tensors];
  for (int32_t chunk = blockIdx.x; chunk < total; chunk += gridDim.x) {
    const int t = find_tensor(meta, chunk);
    const int64_t start = static_cast<int64_t>(chunk - meta.first_chunk[t]) * kChunkSize;
    const int64_t left = meta.numel[t] - start;
    op(meta, t, start, left < kChunkSize ? left : kChunkSize);
  }
}

/// Host side: packs `n` tensors (ptrs[d][i], numel[i]) into as few launches as
/// the parameter block allows and launches `op` over each, on `stream`.
/// `blocks_per_launch` caps the grid (e.g. 4 x the SM count).
template <int Depth, typename Op>
cudaError_t multi_tensor_apply(void* const* const* ptrs, const int64_t* numel, int n,
                               int blocks_per_launch, cudaStream_t stream, Op op) {
  TensorListMeta<Depth> meta;
  int i = 0;
  int32_t chunks_before = 0;
  while (i < n) {
    meta.num_tensors = 0;
    int32_t chunks = 0;
    for (; i < n && meta.num_tensors < TensorListMeta<Depth>::kMaxTensors; ++i) {
      if (numel[i] == 0) continue;
      const int64_t tensor_chunks = (numel[i] + kChunkSize - 1) / kChunkSize;
      if (static_cast<int64_t>(chunks) + tensor_chunks > INT32_MAX) break;
      const int k = meta.num_tensors++;
      for (int d = 0; d < Depth; ++d) meta.ptrs[d][k] = ptrs[d][i];
      meta.numel[k] = numel[i];
      meta.index[k] = i;
      meta.first_chunk[k] = chunks;
      chunks += static_cast<int32_t>(tensor_chunks);
    }
    if (meta.num_tensors == 0) {
      if (i < n) return cudaErrorInvalidValue;  // one tensor of more than 2^31 chunks
      continue;                                 // only empty tensors were left
    }
    meta.first_chunk[meta.num_tensors] = chunks;
    meta.chunk_offset = chunks_before;
    chunks_before += chunks;
    const int grid = chunks < blocks_per_launch ? chunks : blocks_per_launch;
    multi_tensor_kernel<Depth><<<grid, kBlockSize, 0, stream>>>(meta, op);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace fusetrain::kernels

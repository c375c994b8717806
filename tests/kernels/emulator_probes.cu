// Probe kernels for the CUDA emulator's own tests (test_emulator.cpp): some
// break the execution model on purpose (divergent barriers, deadlocks, bad
// shuffle masks, device asserts), the others use what the model allows and
// plain code gets wrong easily (exited threads at a barrier, divergent
// partial-mask shuffles, 2-D and 3-D grids, shared memory per block) or race
// on purpose to show the two thread orders. Built only for the emulator.
#include "emulator_probes.h"

#include <cstdint>

// The device-side assert, declared as csrc/kernels/cross_entropy_kernels.cu
// does: called directly, it stops the kernel under NDEBUG too.
extern "C" __host__ __device__ void __assert_fail(const char* assertion, const char* file,
                                                  unsigned int line, const char* function) noexcept
    __attribute__((__noreturn__));

namespace emulator_probes {

namespace {

// The statements the tests expect the emulator to name, one per helper, each
// with its line just above it (the tests compare lines, not just files).
constexpr int kBarrierLowLine = __LINE__ + 1;
__device__ void barrier_low() { __syncthreads(); }
constexpr int kBarrierHighLine = __LINE__ + 1;
__device__ void barrier_high() { __syncthreads(); }
constexpr int kDeadlockBarrierLine = __LINE__ + 1;
__device__ void deadlock_barrier() { __syncthreads(); }
constexpr int kDeadlockShuffleLine = __LINE__ + 1;
__device__ float deadlock_shuffle(float v) { return __shfl_xor_sync(0x3u, v, 1); }
constexpr int kShuffleWithoutCallerLine = __LINE__ + 1;
__device__ float shuffle_without_caller(float v) { return __shfl_xor_sync(0x1u, v, 3); }
constexpr int kShuffleOutsideMaskLine = __LINE__ + 1;
__device__ float shuffle_outside_mask(float v) { return __shfl_down_sync(0xffffu, v, 1); }
constexpr int kShuffleOfReturnedLaneLine = __LINE__ + 1;
__device__ float shuffle_of_returned_lane(float v) { return __shfl_xor_sync(0xffu, v, 1); }
constexpr int kShuffleBeyondBlockLine = __LINE__ + 1;
__device__ float shuffle_beyond_block(float v) { return __shfl_xor_sync(0xffffffffu, v, 1); }
constexpr int kMismatchedShuffleALine = __LINE__ + 1;
__device__ float mismatched_shuffle_a(float v) { return __shfl_xor_sync(0x3u, v, 1); }
constexpr int kMismatchedShuffleBLine = __LINE__ + 1;
__device__ float mismatched_shuffle_b(float v) { return __shfl_xor_sync(0x3u, v, 1); }
constexpr int kDeviceAssertLine = __LINE__ + 1;
__device__ void fail_assert() { __assert_fail("probe", __FILE__, __LINE__, __func__); }

// ------------------------------------------------------------ violations

__global__ void divergent_barrier_kernel(int* ran, int divergent_block) {
  if (static_cast<int>(blockIdx.x) == divergent_block && threadIdx.x < 16) {
    barrier_low();
  } else {
    barrier_high();
  }
  ran[blockIdx.x * blockDim.x + threadIdx.x] = 1;
}

// Not a barrier left out by an exited thread (that counts as arrived): lane 1
// is live and stuck in a shuffle that needs lane 0, which is stuck at the
// barrier that needs lane 1.
__global__ void barrier_shuffle_deadlock_kernel(float* out) {
  float v = static_cast<float>(threadIdx.x);
  if (threadIdx.x == 1) v = deadlock_shuffle(v);
  deadlock_barrier();
  out[threadIdx.x] = v;
}

__global__ void faulty_shuffle_kernel(ShuffleFault fault, float* out) {
  const unsigned lane = threadIdx.x % 32;
  float v = static_cast<float>(threadIdx.x);
  switch (fault) {
    case ShuffleFault::kMaskWithoutCaller:
      if (lane == 3) v = shuffle_without_caller(v);
      break;
    case ShuffleFault::kReadOutsideMask:
      if (lane < 16) v = shuffle_outside_mask(v);
      break;
    case ShuffleFault::kReturnedLane:
      if (lane == 7) return;
      if (lane < 8) v = shuffle_of_returned_lane(v);
      break;
    case ShuffleFault::kLaneBeyondBlock:
      v = shuffle_beyond_block(v);
      break;
    case ShuffleFault::kMismatchedShuffles:
      if (lane == 0) v = mismatched_shuffle_a(v);
      if (lane == 1) v = mismatched_shuffle_b(v);
      break;
  }
  out[threadIdx.x] = v;
}

__global__ void device_assert_kernel(int* ran, int failing_block, int failing_thread) {
  if (static_cast<int>(blockIdx.x) == failing_block &&
      static_cast<int>(threadIdx.x) == failing_thread) {
    fail_assert();
  }
  ran[blockIdx.x * blockDim.x + threadIdx.x] = 1;
}

// ------------------------------------------------------ correct patterns

constexpr int kEarlyExitBlock = 64;

__global__ void early_exit_barrier_kernel(int* out, int active) {
  __shared__ int slot[kEarlyExitBlock];
  const int t = static_cast<int>(threadIdx.x);
  if (t >= active) return;
  slot[t] = t + 1;
  __syncthreads();
  const int neighbour = slot[(t + 1) % active];
  __syncthreads();  // a second barrier with the same exited threads
  out[t] = neighbour;
}

__global__ void divergent_warp_sums_kernel(const float* in, bool both_halves, float* half_sum,
                                           float* warp_sum) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  const unsigned lane = threadIdx.x % 32;
  float v = in[i];
  if (both_halves) {
    // Each half-warp reduces with its own mask while the other half does.
    const unsigned half = lane < 16 ? 0x0000ffffu : 0xffff0000u;
    for (int offset = 8; offset > 0; offset /= 2) v += __shfl_xor_sync(half, v, offset);
  } else if (lane < 16) {
    for (int offset = 8; offset > 0; offset /= 2) v += __shfl_xor_sync(0x0000ffffu, v, offset);
  }
  half_sum[i] = v;
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  warp_sum[i] = v;
}

constexpr int kSumBlockX = 16;
constexpr int kSumBlockY = 4;

__global__ void block_sums_3d_kernel(const float* in, int rows, int cols, float* sums,
                                     float* warp_sums) {
  __shared__ float warp_partial[kSumBlockX * kSumBlockY / 32];
  const int row = static_cast<int>(blockIdx.y * blockDim.y + threadIdx.y);
  const int col = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  const float* matrix = in + static_cast<int64_t>(blockIdx.z) * rows * cols;
  float v = row < rows && col < cols ? matrix[static_cast<int64_t>(row) * cols + col] : 0.f;
  // Warps are runs of 32 linear thread indices (x fastest): two rows each.
  const int linear = static_cast<int>(threadIdx.y * blockDim.x + threadIdx.x);
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  // Every lane holds the warp's sum only if lanes are numbered as on a GPU.
  const int64_t padded_rows = static_cast<int64_t>(gridDim.y) * blockDim.y;
  const int64_t padded_cols = static_cast<int64_t>(gridDim.x) * blockDim.x;
  warp_sums[(blockIdx.z * padded_rows + row) * padded_cols + col] = v;
  if (linear % 32 == 0) warp_partial[linear / 32] = v;
  __syncthreads();
  if (linear == 0) {
    float s = 0.f;
    for (float p : warp_partial) s += p;
    sums[(blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x] = s;
  }
}

constexpr int kTile = 32;
constexpr int kTransposeThreads = 256;

__global__ void transpose_kernel(const float* in, int rows, int cols, float* out) {
  __shared__ float tile[kTile][kTile + 1];
  const int tx = static_cast<int>(threadIdx.x) % kTile;
  const int ty = static_cast<int>(threadIdx.x) / kTile;
  const int row0 = static_cast<int>(blockIdx.y) * kTile;
  const int col0 = static_cast<int>(blockIdx.x) * kTile;
  for (int r = ty; r < kTile; r += kTransposeThreads / kTile) {
    if (row0 + r < rows && col0 + tx < cols) {
      tile[r][tx] = in[static_cast<int64_t>(row0 + r) * cols + col0 + tx];
    }
  }
  __syncthreads();
  for (int c = ty; c < kTile; c += kTransposeThreads / kTile) {
    if (col0 + c < cols && row0 + tx < rows) {
      out[static_cast<int64_t>(col0 + c) * rows + row0 + tx] = tile[tx][c];
    }
  }
}

// ------------------------------------------------------- order and memory

__global__ void shared_race_kernel(int* seen, int* sequence, int* next_rank, bool with_barrier) {
  __shared__ int slot;
  if (threadIdx.x == 0) slot = -1;
  __syncthreads();
  if (threadIdx.x == 1) slot = static_cast<int>(blockIdx.x);
  if (with_barrier) __syncthreads();
  if (threadIdx.x == 0) {
    seen[blockIdx.x] = slot;
    // Plain increment: fibers switch only at barriers and shuffles.
    sequence[blockIdx.x] = (*next_rank)++;
  }
}

// A __shared__ variable of a function template: one per instantiation.
template <int kTag>
__device__ int* tagged_slot() {
  __shared__ int slot;
  return &slot;
}

__global__ void shared_per_block_kernel(int* out) {
  __shared__ int block_slot;
  const int b = static_cast<int>(blockIdx.y * gridDim.x + blockIdx.x);
  const int t = static_cast<int>(threadIdx.x);
  if (t == 0) {
    block_slot = b;
    *tagged_slot<1>() = 10 + b;
  }
  if (t == 1) *tagged_slot<2>() = 20 + b;
  __syncthreads();
  int* mine = out + (static_cast<int64_t>(b) * blockDim.x + t) * 3;
  mine[0] = block_slot;
  mine[1] = *tagged_slot<1>();
  mine[2] = *tagged_slot<2>();
}

__global__ void mark_threads_kernel(int* marks) {
  const int64_t block =
      (static_cast<int64_t>(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const int64_t thread =
      (static_cast<int64_t>(threadIdx.z) * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  marks[block * blockDim.x * blockDim.y * blockDim.z + thread] += 1;
}

}  // namespace

std::string where(Site site) {
  int line = 0;
  switch (site) {
    case Site::kBarrierLow:
      line = kBarrierLowLine;
      break;
    case Site::kBarrierHigh:
      line = kBarrierHighLine;
      break;
    case Site::kDeadlockBarrier:
      line = kDeadlockBarrierLine;
      break;
    case Site::kDeadlockShuffle:
      line = kDeadlockShuffleLine;
      break;
    case Site::kShuffleWithoutCaller:
      line = kShuffleWithoutCallerLine;
      break;
    case Site::kShuffleOutsideMask:
      line = kShuffleOutsideMaskLine;
      break;
    case Site::kShuffleOfReturnedLane:
      line = kShuffleOfReturnedLaneLine;
      break;
    case Site::kShuffleBeyondBlock:
      line = kShuffleBeyondBlockLine;
      break;
    case Site::kMismatchedShuffleA:
      line = kMismatchedShuffleALine;
      break;
    case Site::kMismatchedShuffleB:
      line = kMismatchedShuffleBLine;
      break;
    case Site::kDeviceAssert:
      line = kDeviceAssertLine;
      break;
  }
  return std::string(__FILE__) + ":" + std::to_string(line);
}

cudaError_t launch_divergent_barrier(int* ran, int blocks, int divergent_block) {
  divergent_barrier_kernel<<<blocks, 32>>>(ran, divergent_block);
  return cudaGetLastError();
}

cudaError_t launch_barrier_shuffle_deadlock(float* out) {
  barrier_shuffle_deadlock_kernel<<<1, 32>>>(out);
  return cudaGetLastError();
}

cudaError_t launch_faulty_shuffle(ShuffleFault fault, float* out) {
  const int threads = fault == ShuffleFault::kLaneBeyondBlock ? 16 : 32;
  faulty_shuffle_kernel<<<1, threads>>>(fault, out);
  return cudaGetLastError();
}

cudaError_t launch_device_assert(int* ran, int blocks, int failing_block, int failing_thread) {
  device_assert_kernel<<<blocks, 32>>>(ran, failing_block, failing_thread);
  return cudaGetLastError();
}

cudaError_t launch_early_exit_barrier(int* out, int active) {
  early_exit_barrier_kernel<<<1, kEarlyExitBlock>>>(out, active);
  return cudaGetLastError();
}

cudaError_t launch_divergent_warp_sums(const float* in, int warps, bool both_halves,
                                       float* half_sum, float* warp_sum) {
  // Two warps per block, so that a block holds more than one warp's shuffles.
  divergent_warp_sums_kernel<<<warps / 2, 64>>>(in, both_halves, half_sum, warp_sum);
  return cudaGetLastError();
}

cudaError_t launch_block_sums_3d(const float* in, int batch, int rows, int cols, float* sums,
                                 float* warp_sums) {
  const dim3 grid((cols + kSumBlockX - 1) / kSumBlockX, (rows + kSumBlockY - 1) / kSumBlockY,
                  batch);
  block_sums_3d_kernel<<<grid, dim3(kSumBlockX, kSumBlockY)>>>(in, rows, cols, sums, warp_sums);
  return cudaGetLastError();
}

cudaError_t launch_transpose(const float* in, int rows, int cols, float* out) {
  const dim3 grid((cols + kTile - 1) / kTile, (rows + kTile - 1) / kTile);
  transpose_kernel<<<grid, kTransposeThreads>>>(in, rows, cols, out);
  return cudaGetLastError();
}

cudaError_t launch_shared_race(int* seen, int* sequence, int blocks, bool with_barrier) {
  int next_rank = 0;
  shared_race_kernel<<<blocks, 2>>>(seen, sequence, &next_rank, with_barrier);
  return cudaGetLastError();
}

cudaError_t launch_shared_per_block(int* out) {
  shared_per_block_kernel<<<dim3(2, 2), 64>>>(out);
  return cudaGetLastError();
}

cudaError_t launch_mark_threads(int* marks, dim3 grid, dim3 block) {
  mark_threads_kernel<<<grid, block>>>(marks);
  return cudaGetLastError();
}

}  // namespace emulator_probes

// Launchers of the probe kernels of emulator_probes.cu: small kernels that
// keep or break the CUDA execution model on purpose, so that the emulator's
// own tests (test_emulator.cpp) can check what it reports (Note [CUDA
// emulator] in tests/cuda_emulator/emulator.h). They are built only into the
// emulated kernel libraries, never by nvcc. Each launcher returns the launch's
// error (cudaGetLastError), and every pointer is host memory, which is what
// device memory is under the emulator.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

namespace emulator_probes {

/// The statements at which the probes break the model.
enum class Site {
  kBarrierLow,             // __syncthreads of threads 0-15 of the divergent block
  kBarrierHigh,            // __syncthreads of the other threads
  kDeadlockBarrier,        // __syncthreads of every lane but 1
  kDeadlockShuffle,        // lane 1's shuffle, which needs lane 0
  kShuffleWithoutCaller,   // a mask that leaves out the calling lane
  kShuffleOutsideMask,     // a shuffle down that reads past its mask
  kShuffleOfReturnedLane,  // a mask that names a lane that returns
  kShuffleBeyondBlock,     // a full mask in a block of 16 threads
  kMismatchedShuffleA,     // lane 0's shuffle ...
  kMismatchedShuffleB,     // ... and lane 1's, at another line, same mask
  kDeviceAssert,
};

/// "tests/kernels/emulator_probes.cu:LINE" of a site, as the emulator names it.
std::string where(Site site);

// ------------------------------------------------------------ violations

/// `blocks` blocks of 32 threads; in block `divergent_block`, threads 0-15
/// reach another __syncthreads than threads 16-31. Every thread that passes
/// its barrier sets ran[block * 32 + thread] = 1.
cudaError_t launch_divergent_barrier(int* ran, int blocks, int divergent_block);

/// One warp: lane 1 waits in a shuffle with lane 0 while lane 0 (and every
/// other lane) waits at a __syncthreads, which lane 1 never reaches.
cudaError_t launch_barrier_shuffle_deadlock(float* out);

enum class ShuffleFault {
  kMaskWithoutCaller,   // lane 3 alone, mask 0x1
  kReadOutsideMask,     // lanes 0-15, mask 0xffff, shuffle down by 1: lane 15 reads lane 16
  kReturnedLane,        // lanes 0-7, mask 0xff, but lane 7 returns
  kLaneBeyondBlock,     // a block of 16 threads, mask 0xffffffff
  kMismatchedShuffles,  // lanes 0 and 1, mask 0x3, each at a shuffle of its own
};

/// One block (of 32 threads but for kLaneBeyondBlock) with the fault.
cudaError_t launch_faulty_shuffle(ShuffleFault fault, float* out);

/// `blocks` blocks of 32 threads; thread `failing_thread` of block
/// `failing_block` fails a device assert (none when failing_block < 0). Every
/// other thread sets ran[block * 32 + thread] = 1.
cudaError_t launch_device_assert(int* ran, int blocks, int failing_block, int failing_thread);

// ------------------------------------------------------ correct patterns

/// One block of 64 threads of which those >= `active` return at once; the
/// rest pass two barriers and read a neighbour's shared slot:
/// out[t] = (t + 1) % active + 1 for t < active.
cudaError_t launch_early_exit_barrier(int* out, int active);

/// Warp sums over `warps` (even) * 32 values in blocks of two warps, with
/// divergent partial masks first.
/// both_halves: each half-warp reduces over its own mask (0x0000ffff and
/// 0xffff0000) concurrently, then the full warp adds the halves; else only
/// lanes 0-15 reduce (mask 0xffff) before the full-warp reduction.
/// half_sum[i]: the sum over i's half-warp (both_halves), or over lanes 0-15
/// for lanes 0-15 and in[i] itself for the others; warp_sum[i]: the sum of
/// those over the warp.
cudaError_t launch_divergent_warp_sums(const float* in, int warps, bool both_halves,
                                       float* half_sum, float* warp_sum);

/// Block sums of a batch of rows x cols matrices over a 3-D grid
/// (ceil(cols / 16), ceil(rows / 4), batch) of 2-D blocks (16, 4): block
/// (bx, by, bz) sums in[bz][by * 4 + ty][bx * 16 + tx] (zero past the edges)
/// with warp shuffles and a shared array into
/// sums[(bz * gridDim.y + by) * gridDim.x + bx]. A warp is two rows of a
/// block (lanes are linear thread indices, x fastest); every thread also
/// writes its warp's sum to warp_sums[bz][by * 4 + ty][bx * 16 + tx], a
/// batch x (gridDim.y * 4) x (gridDim.x * 16) array.
cudaError_t launch_block_sums_3d(const float* in, int batch, int rows, int cols, float* sums,
                                 float* warp_sums);

/// out (cols x rows) = in (rows x cols) transposed, in 32 x 32 tiles through
/// shared memory: a grid (ceil(cols / 32), ceil(rows / 32)) of 1-D blocks of
/// 256 threads, the layout of a cast+transpose kernel.
cudaError_t launch_transpose(const float* in, int rows, int cols, float* out);

// ------------------------------------------------------- order and memory

/// `blocks` blocks of 2 threads. Thread 1 writes blockIdx.x into a shared
/// slot that holds -1, and thread 0 reads it into seen[blockIdx.x], with a
/// barrier in between or not (a race). sequence[b] is the rank of block b in
/// the order blocks ran.
cudaError_t launch_shared_race(int* seen, int* sequence, int blocks, bool with_barrier);

/// A grid (2, 2) of blocks of 64 threads: thread 0 writes the block's linear
/// index into a __shared__ slot and 10 + that into one of another function,
/// thread 1 writes 20 + it into a slot of a second instantiation of that
/// function; after a barrier every thread t of block b reads them back into
/// out[(b * 64 + t) * 3 + 0, 1, 2].
cudaError_t launch_shared_per_block(int* out);

/// Sets marks[i] += 1 for each thread i of the grid (linear over the grid's
/// blocks, then the block's threads; x fastest). marks may be null for a
/// configuration the launch refuses.
cudaError_t launch_mark_threads(int* marks, dim3 grid, dim3 block);

}  // namespace emulator_probes

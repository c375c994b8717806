// The CUDA kernel language for the host compiler: force-included (g++
// -include) before each kernel source, which rewrite_launches.py has copied
// with its `<<<...>>>` launches turned into cuda_emu::launch calls. nvcc's own
// headers supply the types (dim3, __half, __nv_bfloat16, the float8 types and
// their conversions, which have host implementations); this supplies what
// runs on the device: built-in indices, barriers, shuffles, atomics,
// intrinsics and device asserts (Note [CUDA emulator] in emulator.h).
#pragma once

#include <assert.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>

#include <cstdint>
#include <cstring>

#include "emulator.h"

#define FUSETRAIN_CUDA_EMULATOR 1

namespace cuda_emu::detail {

const uint3& thread_idx();
const uint3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();

void syncthreads(const char* file, int line);

/// The rendezvous behind every shuffle: `value` (the caller's bits) is
/// published, and the bits of lane `source` of the same warp are returned
/// once every lane of `mask` has arrived at the same line.
uint64_t shuffle(const char* what, const char* file, int line, unsigned mask, uint64_t value,
                 int source);

int lane_id();

template <typename T>
T shuffle_as(const char* what, const char* file, int line, unsigned mask, T var, int source) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "a shuffle moves 4 or 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &var, sizeof(T));
  bits = shuffle(what, file, line, mask, bits, source);
  std::memcpy(&var, &bits, sizeof(T));
  return var;
}

// CUDA's rules for lanes outside the caller's group of `width`: a lane that
// would read past its group reads its own value.
template <typename T>
T shfl_xor(const char* file, int line, unsigned mask, T var, int lane_mask, int width = 32) {
  const int lane = lane_id();
  int source = lane ^ lane_mask;
  if (source / width > lane / width) source = lane;
  return shuffle_as("__shfl_xor_sync", file, line, mask, var, source);
}

template <typename T>
T shfl_down(const char* file, int line, unsigned mask, T var, unsigned delta, int width = 32) {
  const int lane = lane_id();
  int source = lane + static_cast<int>(delta);
  if (source / width != lane / width) source = lane;
  return shuffle_as("__shfl_down_sync", file, line, mask, var, source);
}

// The device's __expf is ex2.approx-based (within 2 ulp of exp); the host's
// expf is within an ulp. Tests compare with tolerances that allow for both.
inline float fast_exp(float x) { return expf(x); }

// Rounded products and differences that the compiler must not fuse: the
// emulated kernels are compiled with -ffp-contract=off, and these are calls.
inline double dmul_rn(double a, double b) { return a * b; }
inline double dsub_rn(double a, double b) { return a - b; }

}  // namespace cuda_emu::detail

/// A failed device assert: a sticky cudaErrorAssert naming the kernel, block,
/// thread and line; the launch stops (the calling fiber never resumes).
extern "C" void cuda_emu_device_assert_fail(const char* assertion, const char* file,
                                            unsigned int line, const char* function) noexcept
    __attribute__((__noreturn__));

// Built-in variables (read-only, as in CUDA).
#define threadIdx (::cuda_emu::detail::thread_idx())
#define blockIdx (::cuda_emu::detail::block_idx())
#define blockDim (::cuda_emu::detail::block_dim())
#define gridDim (::cuda_emu::detail::grid_dim())
#define warpSize 32

// One copy per program; blocks run one at a time, so one per running block.
#undef __shared__
#define __shared__ static
#define __launch_bounds__(...)

#define __syncthreads() ::cuda_emu::detail::syncthreads(__FILE__, __LINE__)
#define __shfl_xor_sync(...) ::cuda_emu::detail::shfl_xor(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_down_sync(...) ::cuda_emu::detail::shfl_down(__FILE__, __LINE__, __VA_ARGS__)

#define __expf(x) ::cuda_emu::detail::fast_exp(x)
#define __dmul_rn(a, b) ::cuda_emu::detail::dmul_rn(a, b)
#define __dsub_rn(a, b) ::cuda_emu::detail::dsub_rn(a, b)

// assert() and the kernels' own declaration of glibc's __assert_fail both
// land on the emulator's device assert.
#define __assert_fail cuda_emu_device_assert_fail

#define cudaGetLastError ::cuda_emu::get_last_error
#define cudaPeekAtLastError ::cuda_emu::peek_at_last_error
#define cudaMemsetAsync ::cuda_emu::memset_async

// Integer min/max overloads and atomics of the device library. Fibers switch
// only at barriers and shuffles, so a read-modify-write is atomic as written.
#define CUDA_EMU_MIN_MAX(T)                           \
  inline T max(T a, T b) { return a > b ? a : b; } \
  inline T min(T a, T b) { return a < b ? a : b; }
CUDA_EMU_MIN_MAX(int)
CUDA_EMU_MIN_MAX(unsigned int)
CUDA_EMU_MIN_MAX(long long)
CUDA_EMU_MIN_MAX(unsigned long long)
#undef CUDA_EMU_MIN_MAX

inline unsigned int atomicMax(unsigned int* address, unsigned int value) {
  const unsigned int old = *address;
  if (value > old) *address = value;
  return old;
}

inline float atomicAdd(float* address, float value) {
  const float old = *address;
  *address = old + value;
  return old;
}

// One source for every vector path of the CPU ops (Note [CPU paths]).
//
// Note [SIMD regions]
// libfusetrain is compiled for baseline x86-64. A CPU op's vector loops are
// written once, in a `*_loops.inc` file, against the small vector interface
// of simd_avx2.h / simd_avx512.h (a float vector F of kLanes lanes, its mask
// M, a kLanes-wide double accumulator D, loads and stores of float, bf16 and
// fp16). The op's .cpp includes that file once per ISA, with
// FUSETRAIN_SIMD_ISA set to avx2 or avx512; the file opens a region in which
// every function defined (templates and lambdas too) is compiled for that ISA
// and lives in its own namespace, fusetrain::ops::<anon>::<isa>. So the AVX2
// and AVX-512 loops are the same code, and elementwise ops give the same bits
// on both paths (the compiler contracts the same multiply-adds into FMAs in
// both; the tests check it), while reductions differ only in the order of
// their additions (lane count). Headers are included before a region opens:
// an inline function of a header parsed inside one would be compiled for
// that ISA and could be picked by the linker for a caller on a lesser CPU.
//
//   #define FUSETRAIN_SIMD_LOOPS "optim_loops.inc"  // FUSETRAIN_SIMD_BEGIN ... END inside
//   #include <fusetrain/ops/cpu/simd_each_isa.inc>    // once with avx2, once with avx512
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FUSETRAIN_SIMD_X86 1
#include <immintrin.h>

#define FUSETRAIN_SIMD_TARGET_avx2 "avx2,fma,f16c"
#define FUSETRAIN_SIMD_TARGET_avx512 "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq"

// _Pragma takes a string literal, not a macro: # makes one of the expansion.
#define FUSETRAIN_SIMD_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define FUSETRAIN_SIMD_PUSH(targets) \
  FUSETRAIN_SIMD_PRAGMA(clang attribute push(__attribute__((target(targets))), apply_to = function))
#define FUSETRAIN_SIMD_END _Pragma("clang attribute pop")
#else
#define FUSETRAIN_SIMD_PUSH(targets) \
  _Pragma("GCC push_options") FUSETRAIN_SIMD_PRAGMA(GCC target(targets))
#define FUSETRAIN_SIMD_END _Pragma("GCC pop_options")
#endif

// FUSETRAIN_SIMD_BEGIN(avx2) / FUSETRAIN_SIMD_BEGIN(FUSETRAIN_SIMD_ISA).
#define FUSETRAIN_SIMD_BEGIN(isa) FUSETRAIN_SIMD_BEGIN_I(isa)
#define FUSETRAIN_SIMD_BEGIN_I(isa) FUSETRAIN_SIMD_PUSH(FUSETRAIN_SIMD_TARGET_##isa)

#include <cstdint>

namespace fusetrain::ops::simd {
// Note [Software prefetch]
// Software prefetch kPrefetchBytes ahead of a streaming loop's reads and
// writes. On the 2-vCPU Xeon VMs one core's hardware prefetch streams at
// about 4 GB/s, so a loop that streams from DRAM waits on memory much of the
// time: the cross-entropy forward ran 7.98 ns a 16-lane bf16 vector streamed
// against 4.3 ns in cache, 5.26 ns with this. Prefetches never fault, so
// running past the end of a buffer is harmless; the address is formed as an
// integer, as it may lie outside the buffer.
constexpr uintptr_t kPrefetchBytes = 2048;
inline void prefetch_read(const void* p) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + kPrefetchBytes),
                     0, 3);
}
inline void prefetch_write(const void* p) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + kPrefetchBytes),
                     1, 3);
}
}  // namespace fusetrain::ops::simd
#endif

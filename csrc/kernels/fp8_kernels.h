// Launchers of the float8 quantisation kernels (fusetrain::fp8_quantize_*).
// Pure CUDA: raw pointers, sizes, scalars and a stream; no ATen. Each returns
// the first launch error. Nothing is read back to the host.
#pragma once

#include "amp_kernels.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fusetrain::kernels {

enum class Fp8Type { kE4M3, kE5M2 };

/// Current scaling, two passes over x[0, n):
///   *amax  := max |x|                 (NaN if x holds a NaN)
///   *scale := scale_from_amax(*amax, *scale, fp8_max, margin)   (fp8_scaling.h)
///   out    := saturating cast of x * *scale, round to nearest even.
cudaError_t launch_fp8_quantize_current(FloatType in_type, const void* x, int64_t n,
                                        Fp8Type out_type, uint8_t* out, float* scale,
                                        float* amax, int margin, int max_blocks,
                                        cudaStream_t stream);

/// Delayed scaling, one pass over x[0, n):
///   *scale     := scale_from_amax(max of the finite history[0, len), *scale, ...)
///   history    := history shifted one place up (history[len-1] drops out)
///   history[0] := max |x|
///   out        := saturating cast of x * *scale (the new scale).
cudaError_t launch_fp8_quantize_delayed(FloatType in_type, const void* x, int64_t n,
                                        Fp8Type out_type, uint8_t* out, float* scale,
                                        float* history, int64_t history_len, int margin,
                                        int max_blocks, cudaStream_t stream);

/// Either quantisation above of a row-major matrix x [rows, cols] that also
/// writes its transpose in the same pass over x (Note [Float8 cast +
/// transpose] in fp8_kernels.cu): out [rows, cols] as above, and out_t
/// [cols, padded_rows] row-major with out_t[j * padded_rows + i] = out[i *
/// cols + j] for i < rows and 0 for rows <= i < padded_rows (padded_rows >=
/// rows, else cudaErrorInvalidValue; cols / 64 must fit a grid's y
/// dimension, 65535).
cudaError_t launch_fp8_quantize_current_transpose(FloatType in_type, const void* x, int64_t rows,
                                                  int64_t cols, int64_t padded_rows,
                                                  Fp8Type out_type, uint8_t* out, uint8_t* out_t,
                                                  float* scale, float* amax, int margin,
                                                  int max_blocks, cudaStream_t stream);

cudaError_t launch_fp8_quantize_delayed_transpose(FloatType in_type, const void* x, int64_t rows,
                                                  int64_t cols, int64_t padded_rows,
                                                  Fp8Type out_type, uint8_t* out, uint8_t* out_t,
                                                  float* scale, float* history,
                                                  int64_t history_len, int margin, int max_blocks,
                                                  cudaStream_t stream);

}  // namespace fusetrain::kernels

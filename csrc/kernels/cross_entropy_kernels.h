// Launchers of the fused softmax cross-entropy CUDA kernels. Pure CUDA: raw
// pointers, sizes, scalars and a stream; no ATen. Each returns the launch's
// error code. Semantics: fusetrain::ops::softmax_cross_entropy_forward and
// _backward (csrc/ops/cross_entropy.h); CPU references in
// csrc/ops/cpu/cross_entropy_cpu.cpp.
#pragma once

#include "amp_kernels.h"  // FloatType

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fusetrain::kernels {

/// Logits and targets of one call: `n` rows of `c` contiguous elements of
/// `type`, row i starting at logits + i * row_stride elements; target[i] is a
/// class index in [0, c) or ignore_index. Device pointers.
struct CrossEntropyRows {
  FloatType type;
  const void* logits;
  int64_t row_stride;
  const int64_t* target;
  int64_t n;
  int64_t c;
  int64_t ignore_index;
  float label_smoothing;
};

/// Per row: lse[i] = log-sum-exp of the row and row_loss[i] = its smoothed
/// cross-entropy (0 where ignored). fp32 accumulation, one read of the
/// logits. A target out of range triggers a device-side assert after
/// printing the row; the stream is then unusable, as with torch's nll_loss.
cudaError_t launch_cross_entropy_forward(const CrossEntropyRows& rows, float* row_loss, float* lse,
                                         cudaStream_t stream);

/// One block over the rows: *out = sum of row_loss[0, n), divided by the
/// number of rows whose target is not ignore_index when `mean` (NaN when
/// there is none); and *kept_out = that number (as a float: exact up to
/// 2^24 rows). Either output may be null (row_loss may be too when out is).
cudaError_t launch_cross_entropy_reduce(const float* row_loss, const int64_t* target, int64_t n,
                                        int64_t ignore_index, bool mean, float* out,
                                        float* kept_out, cudaStream_t stream);

/// grad[i, j] = g_i * (softmax_ij - ls / c - (1 - ls) * [j == target[i]]) in
/// the logits' type, rows contiguous (row stride c); zero rows where ignored.
/// g_i = grad_loss[i] when `per_row`, else grad_loss[0], divided by the
/// number of kept rows when `mean`: *kept_rows, the forward's count
/// (launch_cross_entropy_reduce's kept_out), when given; else the rows are
/// counted first into `count_scratch` (one float of device memory), one
/// more launch. The softmax is recomputed from the logits and `lse`;
/// nothing is read back to the host. `grad` may be `rows.logits` itself
/// (with row stride c): the gradient then replaces the logits in place.
cudaError_t launch_cross_entropy_backward(const CrossEntropyRows& rows, const float* grad_loss,
                                          bool per_row, bool mean, const float* kept_rows,
                                          float* count_scratch, const float* lse, void* grad,
                                          cudaStream_t stream);

}  // namespace fusetrain::kernels

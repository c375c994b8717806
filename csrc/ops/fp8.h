// C++ entry points of the float8 quantisation ops (Note [Float8 scaling] in
// csrc/kernels/fp8_scaling.h). They call through the dispatcher, so one call
// serves CPU and CUDA tensors alike; neither syncs with the host, so both can
// be captured in a CUDA graph.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace fusetrain::ops {

/// Current scaling: `amax` (one float32 element) := max |self|;
/// `scale` (one float32 element) := float8_max / amax / 2^margin, kept when
/// amax is 0, inf or NaN; returns `self * scale` cast to `dtype`
/// (float8_e4m3fn or float8_e5m2), saturating finite values to the format's
/// range and rounding to nearest even. Inf and NaN stay inf/NaN (e4m3fn: NaN).
at::Tensor fp8_quantize_current(const at::Tensor& self, at::ScalarType dtype, at::Tensor& scale,
                                at::Tensor& amax, int64_t margin = 0);

/// Delayed scaling: `scale` := the rule above applied to the largest finite
/// entry of `amax_history` (1-D float32, the amaxes of earlier calls, newest
/// first); then the history shifts one place (the oldest entry drops out) and
/// amax_history[0] := max |self|; returns `self * scale` cast as above, one
/// pass over `self`.
at::Tensor fp8_quantize_delayed(const at::Tensor& self, at::ScalarType dtype, at::Tensor& scale,
                                at::Tensor& amax_history, int64_t margin = 0);

/// Either op above for a matrix `self` [rows, cols], also returning its
/// transpose: (q, q_t) with q as above and q_t [cols, padded_rows] of the same
/// dtype, padded_rows = rows rounded up to a multiple of `row_multiple`,
/// q_t[j][i] = q[i][j] for i < rows and zero beyond: the column-major
/// operand of CUDA's _scaled_mm, whose reduced dimension must be a multiple
/// of 16. On CUDA one kernel writes both from one read of self (Note [Float8
/// cast + transpose] in csrc/kernels/fp8_kernels.cu); elsewhere the
/// transpose is a copy of q.
std::tuple<at::Tensor, at::Tensor> fp8_quantize_current_transpose(
    const at::Tensor& self, at::ScalarType dtype, at::Tensor& scale, at::Tensor& amax,
    int64_t margin = 0, int64_t row_multiple = 1);
std::tuple<at::Tensor, at::Tensor> fp8_quantize_delayed_transpose(
    const at::Tensor& self, at::ScalarType dtype, at::Tensor& scale, at::Tensor& amax_history,
    int64_t margin = 0, int64_t row_multiple = 1);

/// rows rounded up to a multiple of row_multiple, after checking that
/// `self` is a matrix and row_multiple positive (`op` names the caller).
int64_t fp8_padded_rows(const char* op, const at::Tensor& self, int64_t row_multiple);

/// The largest finite value of a float8 dtype (448 for e4m3fn, 57344 for e5m2).
float fp8_max(at::ScalarType dtype);

/// Validates either op's arguments (shared by the CPU and CUDA versions);
/// `state` is amax or amax_history, named `state_name` in the message.
void check_fp8_quantize_args(const char* op, const at::Tensor& self, at::ScalarType dtype,
                             const at::Tensor& scale, const at::Tensor& state,
                             const char* state_name, int64_t margin);

}  // namespace fusetrain::ops

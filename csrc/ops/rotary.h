// C++ entry points of the fused rotary position embedding (schemas in
// schemas.cpp): the CPU kernel (cpu/rotary_cpu.cpp), the ATen composition
// elsewhere (generic_transformer.cpp), autograd at the Autograd key
// (autograd/rotary.cpp).
//
// Note [Fused rotary]
// q and k are [..., D] with any leading dimensions (batch, heads and
// positions in either order, any head count: GQA's k has fewer); the first
// R = 2 cos.size(-1) <= D elements of each row rotate, the rest pass through
// (GPT-NeoX's rotary fraction). cos and sin are [..., R/2], broadcastable to
// q.shape[:-1] + [R/2] (e.g. [S, R/2] against [B, H, S, D], [S, 1, R/2]
// against [B, S, H, D]). Pair j of a row is (x[j], x[j + R/2]) in the
// half-split layout (GPT-NeoX, Hugging Face's Llama: rotate_half) or
// (x[2j], x[2j + 1]) interleaved (Meta's Llama, GPT-J):
//   x1' = x1 cos - x2 sin,   x2' = x2 cos + x1 sin,
// fp32 math, one rounding. The gradient is the inverse rotation (sin
// negated) of the output's gradient, the same op with `inverse`. One pass
// reads q and k and writes them (or their rotated copies): none of the
// rotate_half, cat and the three products of the unfused form.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace fusetrain::ops {

/// The rotated copies of q and k (k_out empty without k), contiguous, in
/// their dtypes (float32, float16, bfloat16). cos, sin: float32 or q's dtype.
std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const std::optional<at::Tensor>& k,
                                          const at::Tensor& cos, const at::Tensor& sin,
                                          bool interleaved, bool inverse);

/// The same, in place.
void rotary_(at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& cos,
             const at::Tensor& sin, bool interleaved, bool inverse);

/// Checks shared by every implementation; returns R / 2.
int64_t check_rotary_args(const char* op, const at::Tensor& q, const std::optional<at::Tensor>& k,
                          const at::Tensor& cos, const at::Tensor& sin);

/// Per row of `x` (its elements but the last dimension's, in order), the
/// offset of its cos/sin row in `table` broadcast to x.shape[:-1] + [half]:
/// int64, on x's device.
at::Tensor rotary_row_offsets(const at::Tensor& x, const at::Tensor& table, int64_t half);

}  // namespace fusetrain::ops

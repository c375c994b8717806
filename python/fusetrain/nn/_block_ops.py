"""The fused transformer-block ops as torch's functions: layer and RMS norm
(with the residual add and a second output dtype under their own names),
bias + GELU, SwiGLU and rotary embeddings. Each calls one ``torch.ops.fusetrain`` op whose
backward is registered at the dispatcher's Autograd key, so eager Python,
``torch.compile`` (fullgraph) and C++ share one implementation (Note [Fused
norms], Note [Fused activations] in csrc/ops/).

The ops take float32, float16 and bfloat16; other dtypes (float64) and
DTensor arguments (tensor parallelism; FSDP2 hands modules plain tensors in
forward) go to torch's own functions, as do parameters in a third dtype.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from .. import _C  # noqa: F401  (registers the fusetrain ops)
from .. import _dtensor

_OP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_ShapeArg = Union[int, Sequence[int], torch.Size]


def _shape(normalized_shape: _ShapeArg) -> List[int]:
    if isinstance(normalized_shape, int):
        return [normalized_shape]
    return [int(s) for s in normalized_shape]


def _fused(input: torch.Tensor, *others: Optional[torch.Tensor]) -> bool:
    """Whether the fused op takes these arguments (else torch's function)."""
    if input.dtype not in _OP_DTYPES or _dtensor.is_dtensor(input):
        return False
    for t in others:
        if t is None:
            continue
        if _dtensor.is_dtensor(t) or t.dtype not in (torch.float32, input.dtype):
            return False
    return True


def layer_norm(
    input: torch.Tensor,
    normalized_shape: _ShapeArg,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    *,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``torch.nn.functional.layer_norm(input, normalized_shape, weight,
    bias, eps)``: ``input`` normalised over its last ``normalized_shape``
    dimensions, times ``weight`` plus ``bias`` (each of normalized_shape, or
    None), ``eps`` added to the variance; one pass each way, fp32
    statistics. ``out_dtype`` (keyword) stores the output in another dtype
    (the next GEMM's), rounded once."""
    if not _fused(input, weight, bias):
        out = F.layer_norm(input, _shape(normalized_shape), weight, bias, eps)
        return out if out_dtype is None else out.to(out_dtype)
    return torch.ops.fusetrain.layer_norm(input, _shape(normalized_shape), weight, bias, eps, None,
                                          out_dtype)[0]


def rms_norm(
    input: torch.Tensor,
    normalized_shape: _ShapeArg,
    weight: Optional[torch.Tensor] = None,
    eps: Optional[float] = None,
    *,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``torch.nn.functional.rms_norm(input, normalized_shape, weight,
    eps)``: ``input`` over the root mean square of its last
    ``normalized_shape`` dimensions, times ``weight`` (or None); ``eps`` None
    is the input dtype's machine epsilon, as torch's. One pass each way, fp32
    statistics; ``out_dtype`` as :func:`layer_norm`'s."""
    if not _fused(input, weight):
        out = F.rms_norm(input, _shape(normalized_shape), weight, eps)
        return out if out_dtype is None else out.to(out_dtype)
    return torch.ops.fusetrain.rms_norm(input, _shape(normalized_shape), weight, eps, None,
                                        out_dtype)[0]


def add_layer_norm(
    input: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: _ShapeArg,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    *,
    out_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(layer_norm(s, normalized_shape, weight, bias, eps), s)`` with
    ``s = input + residual`` in one pass: the pre-norm block's residual add
    and norm. ``s`` (the input's dtype) is the next residual; both outputs
    carry gradients; ``out_dtype`` as :func:`layer_norm`'s."""
    if not _fused(input, residual, weight, bias) or residual.dtype != input.dtype:
        s = input + residual
        return layer_norm(s, normalized_shape, weight, bias, eps, out_dtype=out_dtype), s
    out, s, _, _ = torch.ops.fusetrain.layer_norm(input, _shape(normalized_shape), weight, bias,
                                                  eps, residual, out_dtype)
    return out, s


def add_rms_norm(
    input: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: _ShapeArg,
    weight: Optional[torch.Tensor] = None,
    eps: Optional[float] = None,
    *,
    out_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(s, normalized_shape, weight, eps), s)`` with
    ``s = input + residual`` in one pass; ``out_dtype`` as
    :func:`layer_norm`'s."""
    if not _fused(input, residual, weight) or residual.dtype != input.dtype:
        s = input + residual
        return rms_norm(s, normalized_shape, weight, eps, out_dtype=out_dtype), s
    out, s, _ = torch.ops.fusetrain.rms_norm(input, _shape(normalized_shape), weight, eps, residual,
                                             out_dtype)
    return out, s


def gelu(input: torch.Tensor, approximate: str = "none", *,
         bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``torch.nn.functional.gelu`` (``approximate`` ``"none"`` or
    ``"tanh"``), of ``input + bias`` when ``bias`` (keyword; the last
    dimension's) is given: the bias of a linear layer computed without one,
    added in the same pass."""
    if not _fused(input, bias):
        return F.gelu(input if bias is None else input + bias, approximate=approximate)
    return torch.ops.fusetrain.bias_gelu(input, bias, approximate)


def swiglu(a: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.silu(a) * b`` in one pass, fp32 math; without ``b``, ``a``'s last
    dimension holds the gate and up halves (a fused gate_up projection):
    ``F.silu(a[..., :h]) * a[..., h:]``."""
    if not _fused(a, b) or (b is not None and b.dtype != a.dtype):
        gate, up = (a, b) if b is not None else a.chunk(2, dim=-1)
        return F.silu(gate) * up
    return torch.ops.fusetrain.swiglu(a, b)


def apply_rotary(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    inplace: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Rotary position embedding of ``q`` and ``k`` ([..., head_dim], any
    leading layout and head counts) in one pass: pair ``(x1, x2)`` becomes
    ``(x1 cos - x2 sin, x2 cos + x1 sin)``. ``cos`` and ``sin`` are
    ``[..., rotary_dim / 2]`` broadcastable to the rows (``[S, rotary_dim/2]``
    for ``[B, H, S, D]``); ``rotary_dim < head_dim`` rotates the first
    ``rotary_dim`` elements only (GPT-NeoX's rotary_pct). Hugging Face's
    ``[..., head_dim]`` tables (the angles repeated over both halves) are
    taken as they are. Pairs are ``(x[j], x[j + rotary_dim/2])`` (GPT-NeoX,
    Hugging Face's ``rotate_half``) or ``(x[2j], x[2j+1])`` with
    ``interleaved`` (Meta's Llama, GPT-J). ``inplace`` rotates ``q`` and
    ``k`` themselves (not differentiable: refused for tensors that require
    grad). Returns ``(q, k)``; ``k`` may be None."""
    if not interleaved and cos.size(-1) == q.size(-1) and q.size(-1) % 2 == 0:
        half = q.size(-1) // 2  # Hugging Face's cat([freqs, freqs]) tables
        cos, sin = cos[..., :half], sin[..., :half]
    if cos.dtype not in (torch.float32, q.dtype):
        cos, sin = cos.float(), sin.float()
    if inplace:
        if torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad)):
            raise RuntimeError(
                "apply_rotary: inplace=True is not differentiable and q or k requires grad; "
                "use inplace=False (the default), which writes rotated copies in the same one pass")
        torch.ops.fusetrain.rotary_(q, k, cos, sin, interleaved)
        return q, k
    q_out, k_out = torch.ops.fusetrain.rotary(q, k, cos, sin, interleaved)
    return q_out, (k_out if k is not None else None)


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` (a subclass: same arguments, parameters, state
    dict) computed by :func:`fusetrain.nn.functional.layer_norm`."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (a subclass) computed by
    :func:`fusetrain.nn.functional.rms_norm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)

"""Utilities: gradient clipping over fusetrain's multi-tensor norm."""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Union

import torch

from . import _C  # noqa: F401  (registers the ops)

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters: Union[torch.Tensor, Iterable[torch.Tensor]],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach=None,
) -> torch.Tensor:
    """Clips the gradients' total norm in place, like
    ``torch.nn.utils.clip_grad_norm_``, and returns the total norm.

    The 2-norm is one multi-tensor pass with fp32 accumulation (fp64 on the
    CPU) and is returned as float32 whatever the gradients' dtype; the clip
    coefficient is computed and applied on the device, with no host sync
    unless ``error_if_nonfinite`` asks for the check. Other norm types use
    torch's foreach norms, computed in fp32 for 16-bit gradients.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    if len(grads) == 0:
        return torch.tensor(0.0)
    by_device = defaultdict(list)
    for g in grads:
        by_device[g.device].append(g)
    first = grads[0].device
    if norm_type == 2.0:
        squares = [
            torch.ops.fusetrain.multi_tensor_l2norm(gs, False)[0].to(first).square()
            for gs in by_device.values()
        ]
        total_norm = torch.stack(squares).sum().sqrt()
    else:
        # 16-bit gradients' norms in fp32 (torch's, in fp16, overflow: the
        # 1-norm of 100k unit fp16 values is inf); the others in their dtype.
        norms = []
        for gs in by_device.values():
            low = [g for g in gs if g.dtype in (torch.float16, torch.bfloat16)]
            rest = [g for g in gs if g.dtype not in (torch.float16, torch.bfloat16)]
            if rest:
                norms += [n.float().to(first) for n in torch._foreach_norm(rest, norm_type)]
            if low:
                norms += [n.to(first) for n in torch._foreach_norm(low, norm_type, dtype=torch.float32)]
        total_norm = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if error_if_nonfinite and torch.logical_or(total_norm.isnan(), total_norm.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    clip_coef = (max_norm / (total_norm + 1e-6)).clamp_(max=1.0)
    for device, gs in by_device.items():
        # The unscale kernel multiplies in place, and skips the pass when the
        # coefficient is exactly 1; its overflow flag is not needed here.
        unused = torch.zeros((), dtype=torch.float32, device=device)
        torch.ops.fusetrain.non_finite_check_and_unscale_(gs, unused, clip_coef.to(device))
    return total_norm

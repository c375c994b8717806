"""Utilities: gradient clipping over fusetrain's multi-tensor norm."""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, List, Union

import torch

from . import _C  # noqa: F401  (registers the ops)
from . import _dtensor

__all__ = ["clip_grad_norm_"]


def _by_device(tensors: Iterable[torch.Tensor]) -> dict:
    out = defaultdict(list)
    for t in tensors:
        out[t.device].append(t)
    return out


def _local_norm(grads: List[torch.Tensor], norm_type: float, device: torch.device, skip_empty: bool) -> torch.Tensor:
    """The ``norm_type``-norm of plain (local) tensors seen as one vector, a
    0-d float32 tensor on ``device``: the 2-norm by the multi-tensor op, the
    others from torch's per-tensor foreach norms (bit for bit torch's total).
    ``skip_empty`` leaves out empty tensors (a rank's empty shard), whose
    inf-norm has no identity."""
    groups = _by_device(grads).values()
    if norm_type == 2.0:
        squares = [torch.ops.fusetrain.multi_tensor_l2norm(gs, False)[0].to(device).square() for gs in groups]
        return torch.stack(squares).sum().sqrt()
    norms = []
    for gs in groups:
        if skip_empty:
            gs = [g for g in gs if g.numel() > 0]
        # 16-bit gradients' norms in fp32 (torch's, in fp16, overflow: the
        # 1-norm of 100k unit fp16 values is inf); the others in their dtype.
        low = [g for g in gs if g.dtype in (torch.float16, torch.bfloat16)]
        rest = [g for g in gs if g.dtype not in (torch.float16, torch.bfloat16)]
        if rest:
            norms += [n.float().to(device) for n in torch._foreach_norm(rest, norm_type)]
        if low:
            norms += [n.to(device) for n in torch._foreach_norm(low, norm_type, dtype=torch.float32)]
    if not norms:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def total_norm(grads: List[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type``-norm of all of ``grads`` (plain tensors or DTensors)
    seen as one vector; for DTensors, the norm of the whole (unsharded)
    gradients (Note [DTensor: local shards]: each rank's norm over its
    shards, raised to the power p, all-reduced (summed; the maximum for the
    inf-norm) over the mesh dimensions the gradients are sharded on, in
    fp64). A 0-d float32 tensor on the first gradient's (local) device; no
    host sync. Plain gradients alone give torch's arithmetic (bit for bit
    for norms other than 2)."""
    norm_type = float(norm_type)
    first = _dtensor.local(grads[0]).device
    groups = _dtensor.by_groups(grads)
    if list(groups) == [()]:
        return _local_norm(groups[()], norm_type, first, skip_empty=False)
    if not norm_type > 0.0:
        raise NotImplementedError(
            f"clip_grad_norm_: norm_type {norm_type} over sharded DTensor gradients; use a positive p or inf"
        )
    is_max = norm_type == float("inf")
    total = None
    for shard_groups, local_grads in groups.items():
        part = _local_norm(local_grads, norm_type, first, skip_empty=True).double()
        if not is_max:
            part = part.pow(norm_type)
        _dtensor.all_reduce_(part, shard_groups, "max" if is_max else "sum")
        total = part if total is None else (torch.maximum(total, part) if is_max else total + part)
    if not is_max:
        total = total.pow(1.0 / norm_type)
    return total.float()


def clip_grad_norm_(
    parameters: Union[torch.Tensor, Iterable[torch.Tensor]],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach=None,
) -> torch.Tensor:
    """Clips the gradients' total norm in place, like
    ``torch.nn.utils.clip_grad_norm_``, and returns the total norm.

    ``parameters``: a tensor or an iterable of tensors whose ``.grad`` is
    clipped (plain tensors or DTensors, e.g. parameters sharded by FSDP2's
    ``fully_shard``); ``max_norm``: the largest total norm kept;
    ``norm_type``: the p of the p-norm (``inf`` for the largest magnitude);
    ``error_if_nonfinite``: raise when the total norm is inf or NaN (a host
    sync); ``foreach``: accepted for torch's signature.

    The 2-norm is one multi-tensor pass with fp32 accumulation (fp64 on the
    CPU), the partial sums combined in fp64, returned as float32 whatever the
    gradients' dtype; the clip coefficient is computed and applied on the
    device, with no host sync unless ``error_if_nonfinite`` asks for the
    check. Other norm types use torch's foreach norms, computed in fp32 for
    16-bit gradients. For DTensor gradients the norm is over the whole
    unsharded gradients (every rank's shards; Note [DTensor: local shards] in
    ``fusetrain/_dtensor.py``) and is returned as a DTensor replicated on
    their mesh, as torch returns it.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    if len(grads) == 0:
        return torch.tensor(0.0)
    norm = total_norm(grads, norm_type)
    if error_if_nonfinite and torch.logical_or(norm.isnan(), norm.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    clip_coef = (max_norm / (norm + 1e-6)).clamp_(max=1.0)
    for device, gs in _by_device(_dtensor.local_list(grads)).items():
        # The unscale kernel multiplies in place, and skips the pass when the
        # coefficient is exactly 1; its overflow flag is not needed here.
        unused = torch.zeros((), dtype=torch.float32, device=device)
        torch.ops.fusetrain.non_finite_check_and_unscale_(gs, unused, clip_coef.to(device))
    return _dtensor.replicated_like(norm, _dtensor.first_dtensor(grads))

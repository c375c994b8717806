"""DTensor arguments (FSDP2's ``fully_shard``, ``torch.distributed.tensor``):
fusetrain's ops run on the local shards, and the few results that depend on
every shard are reduced across the mesh here.

Note [DTensor: local shards]
Every fusetrain op that takes parameters, gradients or optimizer state is
elementwise over a list of tensors (the optimizer updates, the unscale) or a
sum over its elements (the L2 norm). So the Python faces (``fusetrain.optim``,
``fusetrain.utils.clip_grad_norm_``, ``fusetrain.amp.GradScaler``) hand the
ops the local tensors of DTensor arguments (``to_local()`` under no_grad: the
shard itself, updated in place) and keep their state as DTensors laid out as
the parameter (``zeros_like(param)``), which is what torch's optimizers keep
and what ``torch.distributed.checkpoint`` saves and reshards. The two
quantities that depend on other ranks' shards are reduced explicitly:

- a total norm: each rank's sum of squares (of |g|^p; the maximum for the
  inf-norm) over its shards, all-reduced over the mesh dimensions on which
  the gradients are sharded (not over those on which they are replicated);
- the overflow flag: all-reduced (max) over the whole mesh, so every rank
  skips or steps together and the loss scales stay equal.

Both collectives are queued like any other (no host sync). Why not register
DTensor sharding strategies for the ops, as torch does for its fused and
foreach optimizers: a strategy can say "run on the local shards" for the
elementwise ops, but the norm's and the overflow flag's reductions are not
placements a strategy can express for our schemas (the flag is an in-place
0-d argument), so those would still be explicit code; the strategies would add
DTensor's per-call dispatch (sharding propagation over every tensor of the
lists) to each step, and a second path by which the C++ GradScaler core
reaches the ops. One way in, here, serves optimizers, clipping and scaler
alike, and the ops and C++ faces stay untouched.

A parameter and its gradient and state must agree in mesh and placements
(FSDP2 guarantees it); a mismatch raises rather than updating mismatched
shards. Partial (unreduced) gradients are refused where a norm or an
elementwise update over them would be wrong.
"""

from __future__ import annotations

import sys
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch


def dtensor_type():
    """torch's DTensor class, or None when ``torch.distributed.tensor`` was
    never imported (then no DTensor can exist, and nothing is imported here)."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else getattr(module, "DTensor", None)


def is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor."""
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


def any_dtensor(tensors: Iterable) -> bool:
    """Whether any of ``tensors`` (None entries allowed) is a DTensor."""
    cls = dtensor_type()
    return cls is not None and any(isinstance(t, cls) for t in tensors)


def local(t):
    """The local tensor of a DTensor (the shard itself, not a copy: in-place
    updates reach the DTensor), else ``t`` unchanged (None included). For
    the no-grad updates of optimizers, scaler and clipping: it is what
    ``to_local()`` returns under no_grad, read without autograd's checks,
    once per tensor per step."""
    cls = dtensor_type()
    if cls is not None and isinstance(t, cls):
        return t._local_tensor
    return t


def check_layout(param: torch.Tensor, other: torch.Tensor, what: str, index: int, owner: str) -> None:
    """Raises unless ``other`` (``what`` of parameter ``index``) is laid out
    as ``param``: both plain tensors, or both DTensors on one mesh with the
    same placements. A plain tensor the size of the local shard is accepted
    for a DTensor parameter (a state loaded by hand)."""
    cls = dtensor_type()
    if cls is None:
        return
    p_dt, o_dt = isinstance(param, cls), isinstance(other, cls)
    if p_dt and o_dt:
        if other.device_mesh != param.device_mesh or tuple(other.placements) != tuple(param.placements):
            raise ValueError(
                f"{owner}: parameter {index} is a DTensor with placements {tuple(param.placements)} on "
                f"{param.device_mesh}, but its {what} has {tuple(other.placements)} on {other.device_mesh}; "
                f"redistribute the {what} to the parameter's placements"
            )
    elif p_dt and other.shape != local(param).shape:
        raise ValueError(
            f"{owner}: parameter {index} is a DTensor but its {what} is a plain tensor of shape "
            f"{tuple(other.shape)}, not the local shard's {tuple(local(param).shape)}"
        )
    elif o_dt and not p_dt:
        raise ValueError(
            f"{owner}: parameter {index} is a plain tensor but its {what} is a DTensor; "
            f"keep both plain or both DTensors"
        )


def shard_groups(t, what: str = "gradient") -> Tuple:
    """The process groups of the mesh dimensions over which the DTensor ``t``
    is sharded (a sum over its elements must be all-reduced over each), in
    mesh-dimension order; ``()`` for a plain or fully replicated tensor.
    Partial placements (values not yet reduced) raise."""
    if not is_dtensor(t):
        return ()
    groups = []
    for dim, placement in enumerate(t.placements):
        if placement.is_partial():
            raise ValueError(
                f"a {what} is a DTensor with a Partial placement on mesh dimension {dim} (not yet "
                f"reduced across ranks); its norm and update need the reduced values: redistribute it "
                f"to Shard or Replicate first"
            )
        if placement.is_shard():
            groups.append(t.device_mesh.get_group(dim))
    return tuple(groups)


def mesh_groups(tensors: Iterable) -> List:
    """Every process group of every mesh the DTensors among ``tensors`` live
    on, each once, in order of first appearance (the same on every rank,
    which sees the same parameters in the same order)."""
    cls = dtensor_type()
    out, seen = [], set()
    if cls is None:
        return out
    for t in tensors:
        if isinstance(t, cls):
            mesh = t.device_mesh
            for dim in range(mesh.ndim):
                group = mesh.get_group(dim)
                if id(group) not in seen:
                    seen.add(id(group))
                    out.append(group)
    return out


def all_reduce_(value: torch.Tensor, groups: Sequence, op: str) -> torch.Tensor:
    """All-reduces ``value`` in place over each of ``groups`` in turn ("sum"
    or "max"), which over the dimensions of a mesh is the reduction over the
    whole mesh. Queued on the device like any collective: no host sync."""
    import torch.distributed as dist

    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    for group in groups:
        dist.all_reduce(value, op=reduce_op, group=group)
    return value


def replicated_like(value: torch.Tensor, like) -> torch.Tensor:
    """``value`` (the same on every rank) as a DTensor replicated on the mesh
    of ``like``, the first DTensor among the arguments of the call that made
    it, as torch's functions return for DTensor arguments; plain otherwise."""
    cls = dtensor_type()
    if cls is None or like is None:
        return value
    from torch.distributed.tensor import Replicate

    mesh = like.device_mesh
    return cls.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)


def first_dtensor(tensors: Iterable):
    """The first DTensor among ``tensors``, or None."""
    cls = dtensor_type()
    if cls is None:
        return None
    return next((t for t in tensors if isinstance(t, cls)), None)


def by_groups(tensors: Iterable) -> Dict[Tuple, List[torch.Tensor]]:
    """The local tensors of ``tensors`` keyed by the process groups over which
    their sums must be reduced (``shard_groups``), keys in order of first
    appearance."""
    out: Dict[Tuple, List[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(shard_groups(t), []).append(local(t))
    return out


def local_list(tensors: Sequence) -> List[Optional[torch.Tensor]]:
    """``local`` of each entry (None kept)."""
    return [local(t) for t in tensors]

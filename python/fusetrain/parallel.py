"""DistributedDataParallel with the reducer in C++ (fusetrain::dist::Reducer).

A drop-in for ``torch.nn.parallel.DistributedDataParallel`` over any
``torch.distributed`` process group (gloo on CPUs, NCCL on GPUs)::

    torch.distributed.init_process_group("gloo")
    model = fusetrain.parallel.DistributedDataParallel(model)
    loss_fn(model(x), y).backward()   # gradients averaged when it returns

Gradients are bucketed (about 1 MB first, then ``bucket_cap_mb``, in reverse
parameter order until the first backward, then once more in the order the
gradients became ready in, rank 0's, as torch's reducer does), divided by the
world size while copied into the bucket, and each bucket's allreduce starts
from an autograd hook as soon as its last gradient is ready, overlapping the
rest of the backward pass. Buckets are reduced strictly in order on every
rank.

For CUDA parameters the reducer makes the parameters' gradient accumulators
(which run its hooks) on a side stream of its own, ``.stream``, never the
legacy default stream, so a backward through it can be captured in a CUDA
graph (``fusetrain.fuse_steps``; torch's recipe of constructing DDP inside a
side-stream context, done for you). Construct DDP before the first backward:
an accumulator made earlier keeps the stream it was made on (a warning says
so). Running the steps under ``with torch.cuda.stream(model.stream):`` saves
the cross-stream waits autograd inserts otherwise.

With a GradScaler the allreduce carries any inf/NaN of one rank's gradients
to every rank (a sum with inf or NaN is inf or NaN), so every rank's
``found_inf`` agrees and all skip the same steps without an extra collective.
"""

from __future__ import annotations

import contextlib
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from . import _C

__all__ = ["DistributedDataParallel"]

_COMM_DTYPES = {None: None, torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _tensors_in(value: Any, out: List[torch.Tensor]) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors_in(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors_in(v, out)
    return out


class DistributedDataParallel(torch.nn.Module):
    """Data-parallel wrapper, torch's argument names and defaults, plus
    ``comm_dtype`` (communicate in float16/bfloat16) and
    ``gradient_predivide_factor`` (divide by it before the allreduce and by
    world_size / factor after; default: divide by world_size before).

    At construction parameter shapes are checked across ranks (an error
    naming the first mismatch, on every rank) and parameters and buffers are
    broadcast from rank 0. ``state_dict()`` keys carry the ``module.`` prefix
    and ``.module`` is the wrapped model.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        device_ids: Optional[list] = None,
        output_device=None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        process_group=None,
        bucket_cap_mb: Optional[float] = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        *,
        comm_dtype: Optional[torch.dtype] = None,
        gradient_predivide_factor: float = 1.0,
    ):
        super().__init__()
        if comm_dtype not in _COMM_DTYPES:
            raise ValueError(
                f"comm_dtype must be None, torch.float16, torch.bfloat16 or torch.float32, got {comm_dtype}"
            )
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError("DistributedDataParallel: one device per process; pass device_ids=[rank's device]")
        self.module = module
        self.device_ids = device_ids
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.comm_dtype = comm_dtype
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        if self.process_group is None:
            raise RuntimeError(
                "DistributedDataParallel needs torch.distributed.init_process_group() first "
                "(or a process_group)"
            )
        self.bucket_cap_mb = 25.0 if bucket_cap_mb is None else float(bucket_cap_mb)

        seen = set()
        params, names = [], []
        for name, p in module.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
                names.append(name)
        self._params = params
        with torch.no_grad():
            _C.verify_param_shapes(self.process_group, params, names)
            # Buffers only with broadcast_buffers, as torch's DDP: without it
            # each rank keeps its own (e.g. per-rank statistics).
            state = params + (list(module.buffers()) if broadcast_buffers else [])
            _C.broadcast_from_rank0(self.process_group, state)
        self.reducer = _C.Reducer(
            params,
            names,
            self.process_group,
            bucket_cap_mb=self.bucket_cap_mb,
            first_bucket_cap_mb=1.0,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            comm_dtype=_COMM_DTYPES[comm_dtype],
            gradient_predivide_factor=float(gradient_predivide_factor),
        )
        self.require_backward_grad_sync = True

    def forward(self, *inputs, **kwargs):
        if self.broadcast_buffers:
            buffers = list(self.module.buffers())
            if buffers:
                with torch.no_grad():
                    _C.broadcast_from_rank0(self.process_group, buffers)
        output = self.module(*inputs, **kwargs)
        if torch.is_grad_enabled():
            self.reducer.set_require_sync(self.require_backward_grad_sync)
            self.reducer.prepare_for_backward(_tensors_in(output, []))
        return output

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backward passes inside only accumulate
        local gradients; the first backward after the block synchronises."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def bucket_indices(self) -> List[List[int]]:
        """The bucket layout: parameter indices per bucket, in reduction order."""
        return self.reducer.bucket_indices()

    @property
    def stream(self):
        """The side stream the gradient accumulators and the reducer's hooks
        run on (a ``torch.cuda.Stream`` for CUDA parameters), or None for CPU
        parameters."""
        s = self.reducer.stream()
        if s is None:
            return None
        stream_id, device_index, device_type, name = s
        kind = torch.cuda.Stream if name == "cuda" else torch.Stream
        return kind(stream_id=stream_id, device_index=device_index, device_type=device_type)

    def last_exposed_comm_seconds(self) -> float:
        """Seconds the last synchronised backward waited for allreduces after
        its last bucket was ready (communication not hidden by backward). On
        CPU parameters (gloo) host time; on CUDA (NCCL) device time between
        two events, and the call waits for the second. NaN when the last
        backward was captured in a CUDA graph or none has run."""
        return self.reducer.last_exposed_comm_seconds()

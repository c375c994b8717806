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
rank. Each parameter starts 16-byte aligned in its bucket (fewer than 16
bytes of zeros between parameters; Note [Aligned bucket offsets] in
csrc/dist/ddp.h), so with ``gradient_as_bucket_view=True`` the fused CUDA
optimizers take their vector path over the gradient views.

For CUDA parameters the reducer makes the parameters' gradient accumulators
(which run its hooks) on a side stream of its own, ``.stream``, never the
legacy default stream, so a backward through it can be captured in a CUDA
graph (``fusetrain.fuse_steps``; torch's recipe of constructing DDP inside a
side-stream context, done for you). Construct DDP before the first backward:
an accumulator made earlier keeps the stream it was made on (a warning says
so). Running the steps under ``with torch.cuda.stream(model.stream):`` saves
the cross-stream waits autograd inserts otherwise.

Communication hooks (``register_comm_hook``) take torch's hooks unchanged
(``torch.distributed.algorithms.ddp_comm_hooks``: allreduce, fp16/bf16
compression, PowerSGD): each bucket reaches the hook as a
``torch.distributed.GradBucket``, in bucket order on every rank (Note
[Communication hooks] in csrc/dist/ddp.h). Uneven inputs: ``with
model.join():`` (or ``torch.distributed.algorithms.Join([model, ...])``)
lets ranks that run out of data shadow the collectives of those still
training, as torch's DDP does (Note [Uneven inputs]).

With a GradScaler the allreduce carries any inf/NaN of one rank's gradients
to every rank (a sum with inf or NaN is inf or NaN), so every rank's
``found_inf`` agrees and all skip the same steps without an extra collective.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from . import _C

__all__ = ["DistributedDataParallel", "uses_shared_memory", "shared_memory_collectives"]


# ---------------------------------------------------------------- the "fusetrain" backend
# Note [Shared-memory allreduce] in csrc/dist/shared_memory.h: gloo, with the
# allreduces of dense CPU tensors going through one shared-memory segment
# when every rank of the group is on this host (same boot, network, PID,
# mount and IPC namespaces); across hosts it is gloo alone.


def _create_fusetrain_backend(store, group_rank: int, group_size: int, timeout):
    gloo = dist.ProcessGroupGloo(store, group_rank, group_size, timeout)
    return _C.shared_memory_backend(store, group_rank, group_size, timeout, gloo)


def uses_shared_memory(group: Optional["dist.ProcessGroup"] = None) -> bool:
    """Whether ``group``'s (default: the default group's) CPU collectives go
    through shared memory: ``torch.distributed.init_process_group("fusetrain")``
    (or ``"cpu:fusetrain,cuda:nccl"``) with every rank on this host."""
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    return _C.uses_shared_memory(group)


def shared_memory_collectives(group: Optional["dist.ProcessGroup"] = None) -> Dict[str, int]:
    """How many collectives of each kind ``group`` (default: the default
    group) has run through shared memory, by torch.distributed's names:
    ``all_reduce``, ``all_gather_into_tensor``, ``all_gather``,
    ``reduce_scatter_tensor`` and ``broadcast`` of CPU tensors. Whatever went
    to gloo (other collectives, other dtypes of a reduction, bitwise
    reductions) is not counted; a group that does not use shared memory
    gives ``{}``."""
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    return dict(_C.shared_memory_collectives(group))


if dist.is_available() and "fusetrain" not in dist.Backend.backend_list:
    dist.Backend.register_backend("fusetrain", _create_fusetrain_backend, devices=["cpu"])

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


class _DDPJoinHook(JoinHook):
    """What a joined rank does while others still train (Join's main hook,
    once per iteration of theirs) and when all have joined (post hook)."""

    def __init__(self, ddp: "DistributedDataParallel", divide_by_initial_world_size: bool):
        super().__init__()
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        # The collectives of one training rank's forward, then its backward.
        ddp._sync_buffers(joined=True)
        if ddp._global_requires_backward_sync(joined=True):
            ddp.reducer.shadow_synchronized_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        # The last rank to join trained on every step: its model is everyone's.
        ddp = self.ddp
        root = ddp._find_common_rank(is_last_joiner)
        state = ddp._params + (list(ddp.module.buffers()) if ddp.broadcast_buffers else [])
        with torch.no_grad():
            _C.broadcast_from(ddp.process_group, state, root)


class DistributedDataParallel(torch.nn.Module, Joinable):
    """Data-parallel wrapper, torch's argument names and defaults, plus
    ``comm_dtype`` (communicate in float16/bfloat16),
    ``gradient_predivide_factor`` (divide by it before the allreduce and by
    world_size / factor after; default: divide by world_size before) and
    ``shard_gradients`` (ZeRO stage 2: each bucket is reduce-scattered, every
    rank keeps only its piece of the averaged gradients and ``p.grad`` stays
    None; pair it with a ``fusetrain.optim.ZeroRedundancyOptimizer`` made
    after it over the same parameters, which steps from those pieces; no
    communication hook then).

    At construction parameter shapes are checked across ranks (an error
    naming the first mismatch, on every rank) and parameters and buffers are
    broadcast from rank 0. ``state_dict()`` keys carry the ``module.`` prefix
    and ``.module`` is the wrapped model.

    torch's arguments, as fusetrain takes them:

    - ``module``: the model; its parameters that require gradients are
      synchronised.
    - ``device_ids``: None or a list of this rank's one device (more than one
      is a ``ValueError``: one device per process). ``output_device`` and
      ``dim`` (single-process multi-device scatter/gather in torch) are
      accepted and ignored.
    - ``broadcast_buffers`` (default True): buffers are broadcast from rank 0
      at construction and before every forward; False leaves each rank its
      own.
    - ``process_group``: the group to reduce over (default: the world group;
      ``torch.distributed.init_process_group()`` must have run).
    - ``bucket_cap_mb``: size of every bucket after the first, in MiB
      (default None: 25; the first holds about 1 MiB).
    - ``find_unused_parameters`` (default False): tolerate parameters that
      get no gradient in an iteration (reduced as zeros); without it such a
      parameter is an error naming it.
    - ``gradient_as_bucket_view`` (default False): ``p.grad`` becomes a view
      into its bucket (no copy, less memory).
    - ``check_reduction`` (deprecated in torch) and ``static_graph`` are
      accepted and ignored: the buckets are rebuilt once after the first
      backward either way.
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
        shard_gradients: bool = False,
    ):
        torch.nn.Module.__init__(self)
        Joinable.__init__(self)
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
            shard_gradients=bool(shard_gradients),
        )
        self.shard_gradients = bool(shard_gradients)
        if self.shard_gradients:
            from .zero import _register_gradient_sharding

            _register_gradient_sharding(self, params)
        self.require_backward_grad_sync = True
        self._divide_by_initial_world_size = True

    def forward(self, *inputs, **kwargs):
        """The wrapped module's forward (``self.module(*inputs, **kwargs)``),
        after the buffers' broadcast; with gradients enabled it arms the
        reducer, so the next backward averages the gradients across ranks
        (unless inside ``no_sync``)."""
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            # Tells the ranks that have joined (if any) that this one has not.
            work = Join.notify_join_context(self)
            factor = 0.0  # the world size
            if work is not None and not self._divide_by_initial_world_size:
                work.wait()
                factor = float(work.result()[0].item())  # the ranks still training
            self.reducer.set_divide_factor(factor)
        self._sync_buffers(joined=False)
        if self._join_config.enable:
            self._global_requires_backward_sync(joined=False)
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

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """torch's ``DistributedDataParallel.register_comm_hook``: ``hook(state,
        bucket)`` reduces each bucket of gradients and returns a
        ``torch.futures.Future`` of the reduced ``bucket.buffer()`` (which
        holds this rank's gradients, not yet averaged). Called once per bucket
        per backward, in bucket order; once per model, before the first
        forward. torch's own hooks run unchanged, e.g.::

            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
            state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                           start_powerSGD_iter=10)
            model.register_comm_hook(state, powerSGD.powerSGD_hook)
        """
        if not callable(hook):
            raise TypeError("Communication hook must be callable.")
        sig = inspect.signature(hook)
        bucket = sig.parameters.get("bucket")
        if bucket is not None and bucket.annotation not in (inspect._empty, dist.GradBucket):
            raise ValueError("Communication hook: bucket annotation should be dist.GradBucket.")
        if sig.return_annotation not in (inspect._empty, torch.futures.Future[torch.Tensor]):
            raise ValueError(
                "Communication hook: return annotation should be torch.futures.Future[torch.Tensor]."
            )
        self.reducer.register_comm_hook(state, hook)

    def register_builtin_comm_hook(
        self,
        hook: str,
        *,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        batch_tensors_with_same_shape: bool = False,
    ) -> None:
        """One of fusetrain's C++ hooks, which run without the GIL:
        ``"allreduce"``, ``"fp16"``, ``"bf16"`` (torch's allreduce_hook,
        fp16_compress_hook, bf16_compress_hook) or ``"powersgd"`` (torch's
        powerSGD_hook; its options are PowerSGDState's, and it draws the same
        random initial Qs for the same ``random_seed``, without reseeding
        torch's global generator). Same rules as ``register_comm_hook``.

        ``hook`` is the hook's name; the keyword arguments configure
        ``"powersgd"`` as ``PowerSGDState``'s of the same names (defaults
        included) and are ignored by the other hooks:
        ``matrix_approximation_rank``, ``start_powerSGD_iter``,
        ``min_compression_rate``, ``use_error_feedback``, ``warm_start``,
        ``orthogonalization_epsilon``, ``random_seed`` and
        ``batch_tensors_with_same_shape``."""
        self.reducer.register_builtin_comm_hook(
            hook,
            self.process_group,
            matrix_approximation_rank=int(matrix_approximation_rank),
            start_powerSGD_iter=int(start_powerSGD_iter),
            min_compression_rate=float(min_compression_rate),
            use_error_feedback=bool(use_error_feedback),
            warm_start=bool(warm_start),
            orthogonalization_epsilon=float(orthogonalization_epsilon),
            random_seed=int(random_seed),
            batch_tensors_with_same_shape=bool(batch_tensors_with_same_shape),
        )

    # ------------------------------------------------------------ join

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """torch's ``DistributedDataParallel.join``: a context manager for
        uneven inputs. A rank that leaves the ``with model.join():`` block
        early (out of data) shadows the forward/backward collectives of the
        ranks still training until all have left it; then every rank takes
        the model of the last one to leave. Gradients are averaged over the
        initial world size (joined ranks add zeros) or, with
        ``divide_by_initial_world_size=False``, over the ranks still training.
        With ``throw_on_early_termination`` every rank raises as soon as one
        runs out of data instead; ``enable=False`` makes the block do nothing
        (as torch's). As in torch, join mode reads small
        collectives on the host (the ranks still training with
        ``divide_by_initial_world_size=False``, the source rank of the
        buffers' broadcast, a joined rank's view of who still trains). Not
        with ``shard_gradients`` (the sharded optimizer's all-gathers have no
        shadow on a joined rank)."""
        if self.shard_gradients:
            raise ValueError(
                "DistributedDataParallel.join: not supported with shard_gradients=True (the "
                "ZeroRedundancyOptimizer's all-gathers have no shadow on a joined rank)"
            )
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs) -> JoinHook:
        """The Joinable hook (``divide_by_initial_world_size``, default True)."""
        return _DDPJoinHook(self, divide_by_initial_world_size=kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        """The device of the join collectives (``Joinable``): that of the
        first synchronised parameter."""
        return self._params[0].device

    @property
    def join_process_group(self):
        """The process group of the join collectives (``Joinable``): the
        model's ``process_group``."""
        return self.process_group

    def _find_common_rank(self, candidate: bool) -> int:
        """The highest rank for which `candidate` holds (one allreduce)."""
        rank = torch.tensor([dist.get_rank(self.process_group) if candidate else -1], device=self.join_device)
        dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=self.process_group)
        common = int(rank.item())
        if common < 0:
            raise RuntimeError("DistributedDataParallel: no rank qualified as the source of the model")
        return common

    def _global_requires_backward_sync(self, joined: bool) -> Optional[bool]:
        """One allreduce telling joined ranks whether the ranks still training
        synchronise their gradients this iteration (no_sync: they do not)."""
        flag = torch.tensor([0.0 if joined or not self.require_backward_grad_sync else 1.0], device=self.join_device)
        work = dist.all_reduce(flag, group=self.process_group, async_op=True)
        if not joined:
            return None
        work.wait()
        return bool(flag.item() != 0)

    def _sync_buffers(self, joined: bool) -> None:
        """Buffers from rank 0, or under join from the highest rank still
        training (as torch's DDP)."""
        if not self.broadcast_buffers:
            return
        buffers = list(self.module.buffers())
        if not buffers:
            return
        root = self._find_common_rank(not joined) if self._join_config.enable else 0
        with torch.no_grad():
            _C.broadcast_from(self.process_group, buffers, root)

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

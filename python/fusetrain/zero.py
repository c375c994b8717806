"""ZeroRedundancyOptimizer: optimizer state (ZeRO stage 1) and, with
``DistributedDataParallel(shard_gradients=True)``, gradients (stage 2)
sharded across the data-parallel ranks.

A drop-in for ``torch.distributed.optim.ZeroRedundancyOptimizer``::

    model = fusetrain.parallel.DistributedDataParallel(model)
    opt = fusetrain.optim.ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=fusetrain.optim.FusedAdamW, lr=1e-3)

Unlike torch's, which gives each rank whole parameters, the parameters are
cut into buckets and every rank owns an equal piece of every bucket (Note
[Sharded optimizer state] in csrc/dist/zero.h): per-rank state is total / N
whatever the parameter sizes, the local optimizer runs one fused launch over
flat views of the rank's slices, and an all-gather per bucket gives every
rank the updated parameters. The update is elementwise, so the parameters
are those of the unsharded optimizer.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Type

import torch
import torch.distributed as dist

from . import _C
from .optim import FusedAdamW, _drop_default_master_weights

__all__ = ["ZeroRedundancyOptimizer"]

_BUCKET_CAP_BYTES = 25 << 20  # stage 1's buckets (stage 2 takes the reducer's)

# Parameters whose gradients a DistributedDataParallel(shard_gradients=True)
# reduce-scatters: id(param) -> that DDP (weakly). Read when a
# ZeroRedundancyOptimizer is made over them.
_GRADIENT_SHARDING: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def _register_gradient_sharding(ddp, params) -> None:
    for p in params:
        _GRADIENT_SHARDING[id(p)] = ddp


def _state_dtype(dtypes: List[torch.dtype]) -> torch.dtype:
    """The dtype one all-gather of a state key uses: the owners' dtype when
    they agree, else one that holds each exactly."""
    if len(set(dtypes)) == 1:
        return dtypes[0]
    return torch.float64 if torch.float64 in dtypes else torch.float32


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """torch's ``ZeroRedundancyOptimizer(params, optimizer_class,
    process_group=None, parameters_as_bucket_view=False,
    overlap_with_ddp=False, **defaults)``, with ``optimizer_class``
    defaulting to ``FusedAdamW``.

    - ``optimizer_class``: fusetrain's ``FusedAdamW``/``FusedAdam``/
      ``FusedSGD`` (master weights and ``max_grad_norm`` included: the norm is
      the global one, from every rank's shard) or a torch optimizer; each rank
      runs it over its shard only. ``**defaults`` are its arguments.
    - ``param_groups`` hold the whole parameters (schedulers and
      ``add_param_group`` work as with any optimizer); the local optimizer is
      ``.optim``.
    - Stage 2: construct it after ``DistributedDataParallel(...,
      shard_gradients=True)`` over the same parameters and group; it then
      reads its gradients from the reducer's pieces (``p.grad`` stays None).
      Clip with ``max_grad_norm`` then (there is no ``p.grad`` for
      ``clip_grad_norm_``); ``fusetrain.amp.GradScaler`` handles the
      overflow check on the shards with one small allreduce.
    - ``state_dict()`` is the unsharded state of ``optimizer_class`` (it
      loads into ``torch.optim.AdamW`` and into an unsharded run), available
      on the rank given to ``consolidate_state_dict(to)`` after every rank
      called it. ``load_state_dict`` takes an unsharded state on every rank,
      whatever the world size it was saved with.
    - ``overlap_with_ddp=True`` (torch's DDP communication-hook protocol) is
      not supported: stage 2 overlaps the reduction with backward instead.
    - ``overlap_all_gather=True`` (keyword; needs
      ``parameters_as_bucket_view=True``): ``step`` issues the all-gathers of
      the updated parameters and returns; each module's forward first waits
      for the buckets holding its own parameters, so the communication of
      later buckets overlaps the forward of earlier layers (Note [Overlapped
      all-gather] in csrc/dist/zero.h). A parameter read outside its own
      module's forward before then (a checkpoint saved right after ``step``,
      a weight used functionally by another module) needs
      ``finish_all_gather()`` first; ``step``, ``consolidate_state_dict``,
      ``load_state_dict`` and ``add_param_group`` call it themselves.
    - Not ``Joinable``: uneven inputs (``DistributedDataParallel.join``) are
      refused with ``shard_gradients`` and unsupported in stage 1 (a joined
      rank would miss the all-gathers).
    - After a scaled step, ``p.grad`` (stage 1) holds this rank's slices
      unscaled and the rest as backward left them; stage 2 gradients
      accumulate over synchronised backward passes until ``step`` or
      ``zero_grad``, as ``p.grad`` does.

    Every method that moves state between ranks (``step``,
    ``consolidate_state_dict``, ``load_state_dict``, ``add_param_group``) is a
    collective: call it on every rank.
    """

    def __init__(
        self,
        params,
        optimizer_class: Type[torch.optim.Optimizer] = FusedAdamW,
        process_group: Optional[Any] = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        *,
        overlap_all_gather: bool = False,
        **defaults: Any,
    ):
        if overlap_with_ddp:
            raise ValueError(
                "ZeroRedundancyOptimizer: overlap_with_ddp=True is torch's DDP-hook protocol, which "
                "fusetrain does not implement; use fusetrain.parallel.DistributedDataParallel("
                "shard_gradients=True), which overlaps the gradient reduce-scatter with backward"
            )
        if overlap_all_gather and not parameters_as_bucket_view:
            raise ValueError(
                "ZeroRedundancyOptimizer: overlap_all_gather=True needs parameters_as_bucket_view=True "
                "(the all-gather then writes the parameters in place while the forward runs)"
            )
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
        self._ready = False
        self._optim_defaults = dict(defaults)
        self.max_grad_norm = self._optim_defaults.pop("max_grad_norm", None)
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"Invalid max_grad_norm value: {self.max_grad_norm}")
        self._optim_class = optimizer_class
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        if self.process_group is None:
            raise RuntimeError(
                "ZeroRedundancyOptimizer needs torch.distributed.init_process_group() first (or a process_group)"
            )
        self.global_rank = dist.get_rank(self.process_group)
        self.world_size = dist.get_world_size(self.process_group)
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self.overlap_all_gather = overlap_all_gather
        self._pending: set = set()  # buckets whose all-gather is in flight
        self._forward_hook = None
        super().__init__(params, self._optim_defaults)
        self._all_state_dicts: Optional[dict] = None
        #: Total gradient norm of the latest step (a device tensor) with max_grad_norm.
        self.last_grad_norm: Optional[torch.Tensor] = None
        self._build()
        self._ready = True

    # ------------------------------------------------------------ layout

    def _all_params(self) -> List[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _build(self) -> None:
        """Shards the parameters and makes the local optimizer over this
        rank's slices (the parameter groups' options carried over)."""
        params = self._all_params()
        for i, p in enumerate(params):
            if not p.is_contiguous():
                raise ValueError(
                    f"ZeroRedundancyOptimizer: parameter {i} (shape {tuple(p.shape)}) is not contiguous; "
                    "its shards are flat views of it"
                )
        ddps = {id(_GRADIENT_SHARDING.get(id(p))) for p in params}
        ddp = _GRADIENT_SHARDING.get(id(params[0])) if params else None
        if ddp is not None or len(ddps) > 1:
            if len(ddps) > 1 or {id(p) for p in ddp._params} != {id(p) for p in params}:
                raise ValueError(
                    "ZeroRedundancyOptimizer: with DistributedDataParallel(shard_gradients=True) the "
                    "optimizer must hold exactly that DDP's parameters"
                )
            if ddp.process_group != self.process_group:
                raise ValueError(
                    "ZeroRedundancyOptimizer: the process group differs from that of the "
                    "DistributedDataParallel(shard_gradients=True) over these parameters"
                )
            # Stage 2: the reducer's buckets (indices into the DDP's parameters).
            self._ddp = ddp
            layout_params = list(ddp._params)
            buckets = ddp.bucket_indices()
        else:
            self._ddp = None
            layout_params = params
            buckets = _C.compute_bucket_assignment(params, _BUCKET_CAP_BYTES, _BUCKET_CAP_BYTES, list(range(len(params))))
        stages: List[Any] = [None] * self.world_size
        dist.all_gather_object(stages, 2 if self._ddp is not None else 1, group=self.process_group)
        if len(set(stages)) > 1:
            raise ValueError(
                f"ZeroRedundancyOptimizer: ranks disagree on the stage (per rank: {stages}; 2 = gradients "
                "sharded by DistributedDataParallel(shard_gradients=True)); every rank must shard alike"
            )
        self._shards = _C.ShardedParameters(
            layout_params, buckets, self.process_group, parameters_as_bucket_view=self.parameters_as_bucket_view
        )
        self._bucket_of = {id(layout_params[i]): b for b, idx in enumerate(buckets) for i in idx}
        # The slices: their parameter's index in param_groups order and group.
        index_of = {id(p): i for i, p in enumerate(params)}
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        self._views = list(self._shards.param_slices())
        self._slice_index, self._slice_numel, self._slice_group = [], [], []
        local_groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in self.param_groups
        ]
        for (param, _bucket, _begin, length, _off), view in zip(self._shards.slices(), self._views):
            p = layout_params[param]
            self._slice_index.append(index_of[id(p)])
            self._slice_numel.append(length)
            self._slice_group.append(group_of[id(p)])
            local_groups[group_of[id(p)]]["params"].append(view)
        self._local_groups = [gi for gi, g in enumerate(local_groups) if g["params"]]
        groups = [local_groups[gi] for gi in self._local_groups]
        # A rank that owns no element (more ranks than elements) has no local optimizer.
        self.optim = self._optim_class(groups, **self._optim_defaults) if groups else None
        # A rank that owns no element still answers as the others do: the
        # scaler's path (fused or not) and the groups' defaults come from an
        # instance over a placeholder where it has no local optimizer.
        like = self.optim
        if like is None:
            like = self._optim_class([torch.zeros(1, requires_grad=True)], **self._optim_defaults)
        self._step_supports_amp_scaling = bool(getattr(like, "_step_supports_amp_scaling", False))
        # Options the local optimizer filled in (e.g. betas) show in param_groups, as torch's.
        if self.optim is not None:
            for gi, lg in zip(self._local_groups, self.optim.param_groups):
                for k, v in lg.items():
                    if k != "params":
                        self.param_groups[gi].setdefault(k, v)
        for g in self.param_groups:
            for k, v in like.defaults.items():
                g.setdefault(k, v)

    def _sync_param_groups(self) -> None:
        """The options of param_groups (a scheduler's lr, ...) to the local groups."""
        if self.optim is None:
            return
        for gi, lg in zip(self._local_groups, self.optim.param_groups):
            for k, v in self.param_groups[gi].items():
                if k != "params":
                    lg[k] = v

    def _grad_slices(self) -> List[Optional[torch.Tensor]]:
        if self._ddp is not None:
            reducer = self._ddp.reducer
            return list(self._shards.slices_of_pieces(reducer.grad_pieces(), reducer.has_gradient()))
        params = self._all_params()
        if params and id(params[0]) in _GRADIENT_SHARDING:
            raise RuntimeError(
                "ZeroRedundancyOptimizer: these parameters' gradients are sharded by a "
                "DistributedDataParallel(shard_gradients=True) made after this optimizer; make the "
                "DDP first, then the optimizer"
            )
        return list(self._shards.grad_slices())

    def _amp_gradients(self) -> List[Optional[torch.Tensor]]:
        """The gradients ``fusetrain.amp.GradScaler`` checks and unscales.
        Stage 2: this rank's gradient slices plus one element that is inf
        when any rank's slices overflowed (one small allreduce), so every
        rank's scaler sees the same overflow; stage 1: the whole gradients
        (the same on every rank)."""
        if self._ddp is None:
            return [p.grad for p in self._all_params()]
        grads = self._grad_slices()
        return grads + [self._shards.any_non_finite(grads)]

    # ------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        """The local optimizer's step over this rank's slices, then one
        all-gather per bucket of the updated parameters. A collective.

        ``closure`` (optional, as torch's): re-evaluates the model and returns
        the loss; it runs first, with gradients enabled, and its loss is
        returned (None without one). Other keyword arguments go to the local
        optimizer's ``step``."""
        self.finish_all_gather()  # the step writes this rank's slices, which the gathers read
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = self._grad_slices()
        for view, g in zip(self._views, grads):
            view.grad = g
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if self.max_grad_norm is not None:
            grad_scale = self._clip(grads, grad_scale)
        if self.optim is not None:
            self._sync_param_groups()
            if self._step_supports_amp_scaling:
                self.optim.grad_scale, self.optim.found_inf = grad_scale, found_inf
            try:
                self.optim.step(**kwargs)
            finally:
                if self._step_supports_amp_scaling:
                    del self.optim.grad_scale, self.optim.found_inf
        for view in self._views:  # zero_grad must be able to free the gradients
            view.grad = None
        if self._ddp is not None:  # consumed: the next backward overwrites the pieces
            self._ddp.reducer.zero_grad_pieces()
        if self.overlap_all_gather:
            self._shards.start_all_gather()
            self._pending = set(range(len(self._shards.piece_numels())))
            if self._pending and self._forward_hook is None:
                # A weak reference: the process-wide hook must not keep an
                # optimizer alive that its user has dropped.
                me = weakref.ref(self)

                def hook(module, args):
                    opt = me()
                    if opt is not None:
                        opt._before_forward(module, args)

                self._forward_hook = torch.nn.modules.module.register_module_forward_pre_hook(hook)
        else:
            self._shards.all_gather_params()
        return loss

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        """Every module's forward pre-hook while all-gathers are in flight:
        waits for the buckets of the module's own parameters."""
        for p in module._parameters.values():
            b = self._bucket_of.get(id(p)) if p is not None else None
            if b in self._pending:
                self._shards.finish_bucket(b)
                self._pending.discard(b)
        if not self._pending:
            self._remove_forward_hook()

    def _remove_forward_hook(self) -> None:
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None

    def __del__(self) -> None:
        hook = getattr(self, "_forward_hook", None)
        if hook is not None:
            hook.remove()

    def finish_all_gather(self) -> None:
        """Waits for the all-gathers ``step`` left in flight with
        ``overlap_all_gather=True`` (nothing otherwise): every parameter then
        holds every rank's update."""
        if self._pending:
            self._shards.finish_all_gather()
            self._pending = set()
        self._remove_forward_hook()

    def _clip(self, grads, grad_scale):
        """Folded clipping from the global norm of the gradient shards: a
        divisor for the kernels, or (for an optimizer without amp scaling)
        the gradients multiplied in place."""
        norm = self._shards.global_norm(grads)
        if grad_scale is not None:
            norm = norm / grad_scale.to(norm.device)
        self.last_grad_norm = norm
        coef = (self.max_grad_norm / (norm + 1e-6)).clamp_(max=1.0)
        if not self._step_supports_amp_scaling:
            present = [g for g in grads if g is not None]
            if present:
                torch._foreach_mul_(present, coef.to(present[0].device))
            return grad_scale
        divisor = coef.reciprocal()
        return divisor if grad_scale is None else grad_scale.to(divisor.device) * divisor

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad(set_to_none)`` of the whole parameters' ``p.grad``
        (None with ``set_to_none=True``, the default, else zeros); it also
        clears the shard views' gradients and, in stage 2, the reducer's
        gradient pieces."""
        super().zero_grad(set_to_none)
        for view in self._views:
            view.grad = None
        if getattr(self, "_ddp", None) is not None:
            self._ddp.reducer.zero_grad_pieces()

    # ------------------------------------------------------------ state

    def _gather_state(self, to: int) -> Optional[Dict[int, dict]]:
        """The unsharded state (per parameter index) on rank ``to`` (every
        rank for to < 0), from every rank's local state. A collective."""
        local = self.optim.state if self.optim is not None else {}
        meta: Dict[str, Dict[int, Any]] = {}  # key -> {param index: dtype or scalar value}
        order: List[str] = []
        for k, view in enumerate(self._views):
            for key, val in local.get(view, {}).items():
                if key not in meta:
                    meta[key] = {}
                    order.append(key)
                if isinstance(val, torch.Tensor) and val.dim() > 0:
                    meta[key][self._slice_index[k]] = val.dtype
                else:
                    meta[key][self._slice_index[k]] = val.detach().cpu().clone() if isinstance(val, torch.Tensor) else val
        everyone: List[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, (order, meta), group=self.process_group)
        keys: List[str] = []
        merged: Dict[str, Dict[int, Any]] = {}
        for rank_order, rank_meta in everyone:
            for key in rank_order:
                if key not in merged:
                    keys.append(key)
                    merged[key] = {}
                merged[key].update(rank_meta[key])
        keep = to < 0 or to == self.global_rank
        state: Dict[int, dict] = {}
        params = self._all_params()
        layout_params = list(self._ddp._params) if self._ddp is not None else params
        index_of = {id(p): i for i, p in enumerate(params)}
        for key in keys:
            entries = merged[key]
            dtypes = [v for v in entries.values() if isinstance(v, torch.dtype)]
            if not dtypes:  # a scalar per parameter (step): any owner's
                if keep:
                    for i, v in entries.items():
                        state.setdefault(i, {})[key] = v
                continue
            per_slice = [local.get(view, {}).get(key) for view in self._views]
            full = self._shards.gather(per_slice, _state_dtype(dtypes), to)
            if not keep:
                continue
            for lp, t in zip(layout_params, full):
                i = index_of[id(lp)]
                if t is not None and isinstance(entries.get(i), torch.dtype):
                    state.setdefault(i, {})[key] = t.to(entries[i])
        if not keep:
            return None
        # Keys in the local optimizer's order for every parameter.
        return {i: {k: s[k] for k in keys if k in s} for i, s in sorted(state.items())}

    def _param_groups_state(self) -> List[dict]:
        groups, start = [], 0
        for g in self.param_groups:
            # Saved as the local optimizer saves its own groups (FusedAdamW's rule).
            packed = _drop_default_master_weights({k: v for k, v in g.items() if k != "params"})
            packed["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(packed)
        return groups

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gathers the unsharded optimizer state on rank ``to`` (then
        ``state_dict()`` there). A collective: call it on every rank."""
        self.finish_all_gather()
        self._sync_param_groups()
        state = self._gather_state(to)
        self._all_state_dicts = None if state is None else {"state": state, "param_groups": self._param_groups_state()}

    def state_dict(self) -> Dict[str, Any]:
        """The unsharded state gathered by the latest
        ``consolidate_state_dict(to)`` on this rank (rank ``to``)."""
        if self._all_state_dicts is None:
            raise RuntimeError(
                "Optimizer state has not been consolidated on this rank. Please call "
                "`consolidate_state_dict(to=0)` on all ranks beforehand if you meant to save the global state."
            )
        return self._all_state_dicts

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads an unsharded state (this optimizer's ``state_dict()``, or
        that of ``optimizer_class`` unsharded, saved with any world size):
        each rank keeps its slices. Call it on every rank."""
        self.finish_all_gather()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for i, (g, saved) in enumerate(zip(self.param_groups, groups)):
            if len(g["params"]) != len(saved["params"]):
                raise ValueError(
                    f"loaded state dict contains a parameter group {i} that doesn't match the size of optimizer's group"
                )
        saved_index = {}  # this optimizer's flat index -> saved key
        flat = 0
        for g, saved in zip(self.param_groups, groups):
            for k in saved["params"]:
                saved_index[flat] = k
                flat += 1
            for key, v in saved.items():
                if key != "params":
                    g[key] = v
        source = state_dict["state"]
        params = self._all_params()
        local_state: Dict[int, dict] = {}
        for k, view in enumerate(self._views):
            i = self._slice_index[k]
            src = source.get(saved_index[i])
            if not src:
                continue
            p = params[i]
            begin = self._shards.slices()[k][2]
            entry = {}
            for key, val in src.items():
                # Per-element state has the parameter's size (a 0-dim one
                # too); "step" is one count per parameter whatever its size.
                if key != "step" and isinstance(val, torch.Tensor) and val.numel() == p.numel():
                    entry[key] = val.reshape(-1)[begin : begin + self._slice_numel[k]].clone()
                else:
                    entry[key] = val.clone() if isinstance(val, torch.Tensor) else val
            local_state[k] = entry
        if self.optim is not None:
            self._sync_param_groups()
            local_groups, start = [], 0
            for lg in self.optim.param_groups:
                packed = {key: v for key, v in lg.items() if key != "params"}
                packed["params"] = list(range(start, start + len(lg["params"])))
                start += len(lg["params"])
                local_groups.append(packed)
            # Local optimizer indices follow its groups: slices grouped by param group.
            order = [k for gi in self._local_groups for k, g in enumerate(self._slice_group) if g == gi]
            self.optim.load_state_dict(
                {
                    "state": {pos: local_state[k] for pos, k in enumerate(order) if k in local_state},
                    "param_groups": local_groups,
                }
            )
        self._all_state_dicts = None

    def add_param_group(self, param_group: dict) -> None:
        """Adds ``param_group`` (a dict with ``params`` and optional
        per-group settings, as torch's; e.g. layers unfrozen while
        fine-tuning) and shards again, keeping the existing state. A
        collective once constructed; refused (``ValueError``) in stage 2,
        whose layout is the DistributedDataParallel's."""
        if not getattr(self, "_ready", False):
            super().add_param_group(param_group)
            return
        self.finish_all_gather()
        if self._ddp is not None:
            raise ValueError(
                "ZeroRedundancyOptimizer.add_param_group: with shard_gradients the layout is the "
                "DistributedDataParallel's; make a new DDP and optimizer over the new parameters"
            )
        state = self._gather_state(-1)
        saved = {"state": state, "param_groups": self._param_groups_state()}
        super().add_param_group(param_group)
        self._build()
        saved["param_groups"].append(self._param_groups_state()[-1])
        self.load_state_dict(saved)

    def __repr__(self) -> str:
        name = self._optim_class.__name__
        return f"ZeroRedundancyOptimizer({name}, rank {self.global_rank} of {self.world_size})"

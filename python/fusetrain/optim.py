"""Fused optimizers: FusedAdamW, FusedAdam, FusedSGD.

Drop-ins for ``torch.optim.AdamW`` / ``Adam`` / ``SGD``: same constructor
arguments and defaults, param groups, ``zero_grad``, and state dicts that load
into torch's optimizers and back (keys ``step``, ``exp_avg``, ``exp_avg_sq``,
``max_exp_avg_sq``, ``momentum_buffer``). Each step is one multi-tensor pass
per (device, dtype) group: the fusetrain ops ``fused_adamw_`` / ``fused_sgd_``.

Beyond torch:

- ``master_weights=True``: 16-bit parameters get fp32 master copies (state key
  ``master_param``); moments and the update are fp32 and the parameter receives
  the rounded master in the same pass.
- ``max_grad_norm``: gradient clipping folded into the step: the total norm is
  computed on the device and the clip coefficient divides into the loss scale,
  so unscale + clip + update read each gradient twice and never sync.
- ``_step_supports_amp_scaling = True``: torch's and fusetrain's GradScaler
  hand ``grad_scale`` / ``found_inf`` tensors; an overflow skips the step on the
  device, step counts included. As with torch's fused optimizers, the kernels
  divide the gradients by the scale and write them back, so ``p.grad`` holds
  the unscaled gradient after ``scaler.step(opt)`` (clipped too with
  ``max_grad_norm``, as ``clip_grad_norm_`` leaves it); a skipped step leaves
  the gradients as they were.
- ``lr`` may be a one-element tensor (as in torch): on the parameters' device
  the kernels read it, so a captured CUDA graph (``fusetrain.fuse_steps``)
  follows a schedule that writes into it (``group["lr"].fill_(value)``, which
  torch's LR schedulers do for tensor learning rates).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, List, Optional, Tuple

import torch

from . import _C  # noqa: F401  (registers the ops)
from . import _dtensor
from .utils import total_norm

__all__ = ["FusedAdamW", "FusedAdam", "FusedSGD", "ZeroRedundancyOptimizer"]


def _grad_of(p: torch.Tensor) -> torch.Tensor:
    """p.grad laid out like p, as a plain tensor (a DTensor's local shard;
    Note [DTensor: local shards] in ``fusetrain/_dtensor.py``). The kernels
    walk a parameter and its gradient in memory order, so they need the same
    strides; autograd gives the parameter's layout, but a gradient assigned
    by hand may have another one (torch's optimizers accept it): that one is
    copied into p's layout."""
    g, p = _dtensor.local(p.grad), _dtensor.local(p)
    if g.stride() != p.stride():
        g = torch.empty_like(p, memory_format=torch.preserve_format).copy_(g)
    return g


def _write_back(params: List[torch.Tensor], grads: List[torch.Tensor]) -> None:
    """After a step with a grad_scale the kernels have unscaled ``grads`` in
    place (torch's fused optimizers leave p.grad unscaled too); a gradient
    that was copied into its parameter's layout gets the result back."""
    for p, g in zip(params, grads):
        target = _dtensor.local(p.grad)
        if g is not target:
            target.copy_(g)


def _checked_lr(lr):
    """A float learning rate, or a one-element float tensor kept as it is:
    the kernels read a tensor on the parameters' device, so a CUDA graph
    follows what a scheduler writes into it (``group["lr"].fill_(...)``)."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or not lr.is_floating_point():
            raise ValueError(
                f"Tensor lr must be a 1-element floating point tensor, got shape {tuple(lr.shape)}, {lr.dtype}"
            )
        if float(lr) < 0.0:
            raise ValueError(f"Invalid learning rate: {float(lr)}")
        return lr
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    return lr


def _lr_args(lr, device: torch.device) -> dict:
    """The ``lr`` / ``lr_tensor`` arguments of a fused op on ``device``."""
    if not isinstance(lr, torch.Tensor):
        return {"lr": float(lr)}
    if lr.device.type == "cpu" and device.type != "cpu":
        return {"lr": float(lr)}  # read on the host: no sync, no transfer
    t = lr.reshape(())
    if t.dtype not in (torch.float32, torch.float64):
        t = t.double()
    return {"lr": 0.0, "lr_tensor": t.to(device, non_blocking=True)}


def _per_device(tensor: Optional[torch.Tensor], cache: dict, device: torch.device):
    if tensor is None:
        return None
    if device not in cache:
        cache[device] = tensor.to(device, non_blocking=True)
    return cache[device]


def _drop_default_master_weights(group: dict) -> dict:
    """Removes a saved param group's ``master_weights`` unless it is True, so
    that a state dict without master weights has exactly the keys of the torch
    optimizer it replaces (``FusedAdamW.state_dict``, and ZeRO's consolidated
    state). Returns the group."""
    if not group.get("master_weights", False):
        group.pop("master_weights", None)
    return group


class _FusedOptimizer(torch.optim.Optimizer):
    """What the fused optimizers share: grouping by (device, dtype), the
    scaler handshake, master weights, folded clipping, state-dict dtypes."""

    _state_keys: Tuple[str, ...] = ()

    def __init__(self, params, defaults: dict, master_weights: bool, max_grad_norm):
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"Invalid max_grad_norm value: {max_grad_norm}")
        defaults = dict(defaults, master_weights=master_weights)
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self._step_supports_amp_scaling = True
        #: Total gradient norm of the latest step (a device tensor) when
        #: ``max_grad_norm`` is set.
        self.last_grad_norm: Optional[torch.Tensor] = None

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("master_weights", False)
            group.setdefault("maximize", False)

    @staticmethod
    def _uses_master(group: dict, p: torch.Tensor) -> bool:
        return bool(group["master_weights"]) and p.dtype in (torch.float16, torch.bfloat16)

    def _params_with_grad(self, group: dict):
        out = []
        dtensors = _dtensor.dtensor_type() is not None
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            if torch.is_complex(p):
                raise RuntimeError(f"{type(self).__name__} does not support complex parameters")
            if dtensors:
                # The kernels update local shards elementwise: the gradient's
                # shard must be the parameter's (Note [DTensor: local shards]).
                _dtensor.check_layout(p, p.grad, "gradient", i, type(self).__name__)
            out.append(p)
        return out

    def _clip_scale(self, grad_scale: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Folds clipping into the divisor the kernels apply to the gradients.
        The total norm is over every rank's shards of DTensor gradients."""
        grads = [p.grad for g in self.param_groups for p in self._params_with_grad(g)]
        if not grads:
            return grad_scale
        norm = total_norm(grads, 2.0)
        device = norm.device
        if grad_scale is not None:
            norm = norm / grad_scale.to(device)
        self.last_grad_norm = norm
        coef = (self.max_grad_norm / (norm + 1e-6)).clamp_(max=1.0)
        divisor = coef.reciprocal()
        return divisor if grad_scale is None else grad_scale.to(device) * divisor

    def _step_groups(self):
        """Yields (group, device/dtype bucket of params) for params with grads."""
        for group in self.param_groups:
            buckets = defaultdict(list)
            for p in self._params_with_grad(group):
                buckets[(p.device, p.dtype, self._uses_master(group, p))].append(p)
            for (_, _, master), params in buckets.items():
                yield group, params, master

    @torch.no_grad()
    def step(self, closure=None):
        """Performs a single optimization step (one fused launch per device and
        dtype). ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if self.max_grad_norm is not None:
            grad_scale = self._clip_scale(grad_scale)
        scales, infs = {}, {}
        for group, params, master in self._step_groups():
            device = params[0].device
            self._fused_step(
                group,
                params,
                master,
                _per_device(grad_scale, scales, device),
                _per_device(found_inf, infs, device),
            )
        return loss

    def _fused_step(self, group, params, master, grad_scale, found_inf):
        raise NotImplementedError

    def _master_of(self, p: torch.Tensor, state: dict) -> torch.Tensor:
        if "master_param" not in state:
            state["master_param"] = p.detach().to(torch.float32, copy=True)
        return state["master_param"]

    def state_dict(self) -> dict:
        """torch's optimizer state dict. A group's ``master_weights`` is saved
        only when True: without master weights the state dict has exactly the
        keys of the torch optimizer this one replaces, so that
        ``torch.distributed.checkpoint`` (which loads by key) moves it between
        the two in both directions."""
        state_dict = super().state_dict()
        for group in state_dict["param_groups"]:
            _drop_default_master_weights(group)
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a state dict of this optimizer or of the torch optimizer it
        replaces. Master-weight state stays fp32 (torch's loader would cast it
        to the 16-bit parameter dtype), and step counts become float32 tensors
        on the parameter's device, as the fused kernels read them. The state
        is keyed as the saved groups' ``params`` name it: indices, or the
        parameter names that ``torch.distributed.checkpoint.state_dict``
        (``set_optimizer_state_dict``) uses."""
        source = state_dict["state"]
        saved_keys = [key for saved in state_dict["param_groups"] for key in saved["params"]]
        # A torch optimizer's groups carry no master_weights: keep this
        # optimizer's setting rather than let __setstate__ default it to False.
        masters = [
            saved.get("master_weights", group["master_weights"])
            for group, saved in zip(self.param_groups, state_dict["param_groups"])
        ]
        super().load_state_dict(state_dict)
        for group, master in zip(self.param_groups, masters):
            group["master_weights"] = master
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                src = source.get(saved_keys[index], {}) if index < len(saved_keys) else {}
                index += 1
                if not state:
                    continue
                if "step" in state:
                    state["step"] = torch.as_tensor(
                        state["step"], dtype=torch.float32, device=p.device
                    ).clone()
                if self._uses_master(group, p):
                    for key in (*self._state_keys, "master_param"):
                        if isinstance(src.get(key), torch.Tensor):
                            state[key] = src[key].to(device=p.device, dtype=torch.float32, copy=True)


class FusedAdamW(_FusedOptimizer):
    """AdamW (``torch.optim.AdamW``'s arguments and defaults), fused.

    ``FusedAdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=1e-2, amsgrad=False, *, maximize=False, master_weights=False,
    max_grad_norm=None)``. ``foreach``, ``capturable``, ``differentiable`` and
    ``fused`` are accepted for compatibility: the step is always fused and
    capturable (no host sync); ``differentiable=True`` is refused.
    """

    _state_keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    _decoupled = True

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        master_weights: bool = False,
        max_grad_norm: Optional[float] = None,
    ):
        lr = _checked_lr(lr)
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if differentiable:
            raise ValueError(f"{type(self).__name__} does not support differentiable=True")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=False,
            fused=fused,
        )
        super().__init__(params, defaults, master_weights, max_grad_norm)
        if self._decoupled:
            # As torch's AdamW groups say (torch's Adam reads the key on load).
            for group in self.param_groups:
                group["decoupled_weight_decay"] = True
            self.defaults["decoupled_weight_decay"] = True

    def _fused_step(self, group, params, master, grad_scale, found_inf):
        grads, exp_avgs, exp_avg_sqs, max_sqs, masters, steps = [], [], [], [], [], []
        state_dtype = torch.float32 if master else None
        for p in params:
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=state_dtype, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(
                        p, dtype=state_dtype, memory_format=torch.preserve_format
                    )
            if group["amsgrad"] and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = torch.zeros_like(state["exp_avg_sq"])
            grads.append(_grad_of(p))
            exp_avgs.append(_dtensor.local(state["exp_avg"]))
            exp_avg_sqs.append(_dtensor.local(state["exp_avg_sq"]))
            if group["amsgrad"]:
                max_sqs.append(_dtensor.local(state["max_exp_avg_sq"]))
            if master:
                masters.append(_dtensor.local(self._master_of(p, state)))
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        torch.ops.fusetrain.fused_adamw_(
            _dtensor.local_list(params),
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_sqs,
            masters,
            steps,
            **_lr_args(group["lr"], params[0].device),
            beta1=float(beta1),
            beta2=float(beta2),
            weight_decay=float(group["weight_decay"]),
            eps=float(group["eps"]),
            amsgrad=bool(group["amsgrad"]),
            maximize=bool(group["maximize"]),
            decoupled_weight_decay=self._decoupled_for(group),
            grad_scale=grad_scale,
            found_inf=found_inf,
        )
        if grad_scale is not None:
            _write_back(params, grads)

    def _decoupled_for(self, group) -> bool:
        return self._decoupled


class FusedAdam(FusedAdamW):
    """Adam (``torch.optim.Adam``'s arguments and defaults: ``weight_decay=0``
    as L2 regularisation, or AdamW with ``decoupled_weight_decay=True``), fused.

    ``FusedAdam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=0, amsgrad=False, *, maximize=False,
    decoupled_weight_decay=False, master_weights=False, max_grad_norm=None)``:
    ``params`` the parameters or param groups, ``lr`` a float or a one-element
    tensor, ``betas``, ``eps``, ``amsgrad`` and ``maximize`` as torch's (and
    checked as :class:`FusedAdamW` checks them), ``master_weights`` and
    ``max_grad_norm`` as :class:`FusedAdamW`'s (module docstring).
    ``foreach``, ``capturable``, ``differentiable`` and ``fused`` are accepted
    for compatibility: the step is always fused and capturable (no host
    sync); ``differentiable=True`` is refused."""

    _decoupled = False  # per group, from decoupled_weight_decay

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: Optional[bool] = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        decoupled_weight_decay: bool = False,
        master_weights: bool = False,
        max_grad_norm: Optional[float] = None,
    ):
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            master_weights=master_weights,
            max_grad_norm=max_grad_norm,
        )
        for group in self.param_groups:
            group.setdefault("decoupled_weight_decay", decoupled_weight_decay)
        self.defaults["decoupled_weight_decay"] = decoupled_weight_decay

    def _decoupled_for(self, group) -> bool:
        return bool(group.get("decoupled_weight_decay", False))


class FusedSGD(_FusedOptimizer):
    """SGD (``torch.optim.SGD``'s arguments and defaults), fused.

    ``FusedSGD(params, lr=1e-3, momentum=0, dampening=0, weight_decay=0,
    nesterov=False, *, maximize=False, master_weights=False,
    max_grad_norm=None)``. ``foreach`` and ``fused`` are accepted for
    compatibility (the step is always fused); ``differentiable=True`` is
    refused.
    """

    _state_keys = ("momentum_buffer",)

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        master_weights: bool = False,
        max_grad_norm: Optional[float] = None,
    ):
        lr = _checked_lr(lr)
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        if differentiable:
            raise ValueError("FusedSGD does not support differentiable=True")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
            foreach=foreach,
            differentiable=False,
            fused=fused,
        )
        super().__init__(params, defaults, master_weights, max_grad_norm)

    def _fused_step(self, group, params, master, grad_scale, found_inf):
        momentum = float(group["momentum"])
        # Parameters whose momentum buffer is created now start it from their
        # gradient (torch's clone of the first d_p): a launch of their own.
        # (A first step skipped for overflow leaves a zero buffer; with
        # dampening != 0 the next step then differs from torch's.)
        fresh, running = [], []
        for p in params:
            # (No state entry without momentum or masters, as torch's SGD.)
            if momentum != 0 and self.state[p].get("momentum_buffer") is None:
                self.state[p]["momentum_buffer"] = torch.zeros_like(
                    p, dtype=torch.float32 if master else None, memory_format=torch.preserve_format
                )
                fresh.append(p)
            else:
                running.append(p)
        for subset, first in ((fresh, True), (running, False)):
            if not subset:
                continue
            grads = [_grad_of(p) for p in subset]
            torch.ops.fusetrain.fused_sgd_(
                _dtensor.local_list(subset),
                grads,
                [_dtensor.local(self.state[p]["momentum_buffer"]) for p in subset] if momentum != 0 else [],
                [_dtensor.local(self._master_of(p, self.state[p])) for p in subset] if master else [],
                **_lr_args(group["lr"], subset[0].device),
                momentum=momentum,
                dampening=float(group["dampening"]),
                weight_decay=float(group["weight_decay"]),
                nesterov=bool(group["nesterov"]),
                maximize=bool(group["maximize"]),
                is_first_step=first,
                grad_scale=grad_scale,
                found_inf=found_inf,
            )
            if grad_scale is not None:
                _write_back(subset, grads)


from .zero import ZeroRedundancyOptimizer  # noqa: E402  (it builds on FusedAdamW)

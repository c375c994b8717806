"""Mixed precision: policies, autocast, float32 islands and the GradScaler.

``GradScaler`` is a drop-in for ``torch.amp.GradScaler``: same arguments,
methods, errors and state dict, with the state machine and kernels in C++
(``fusetrain::amp::GradScaler``). On top of torch it unscales bf16 gradients
on CUDA, never syncs with the host for optimizers that take the scale as a
tensor (``_step_supports_amp_scaling``), reports skipped steps and which
parameters overflowed, and offers ``max_scale`` and ``hysteresis``.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections import abc
from enum import Enum
from typing import Any, Iterable, Optional, Sequence, Union

import torch

from . import _C, _dtensor
from ._devices import TPU, autocast_device_types, device_type as _device_type
from .float8 import DEFAULT_FP8_MIN_FEATURES, Float8Linear, Float8Recipe

__all__ = [
    "Policy",
    "best_policy",
    "set_global_policy",
    "global_policy",
    "autocast",
    "keep_float32",
    "apply_policy",
    "GradScaler",
    "OptState",
    "Float8Linear",
    "Float8Recipe",
]


# ----------------------------------------------------------------- policies

_POLICY_DTYPES = {
    "float32": torch.float32,
    "mixed_float16": torch.float16,
    "mixed_bfloat16": torch.bfloat16,
    "mixed_float8": torch.bfloat16,
}


class Policy:
    """A precision policy, Keras' names: what a model computes in and what it
    keeps its variables in.

    - ``"float32"``: compute and variables in float32.
    - ``"mixed_float16"``: compute in float16, variables in float32. Use a
      :class:`GradScaler`: fp16 gradients underflow without loss scaling.
    - ``"mixed_bfloat16"``: compute in bfloat16, variables in float32.
    - ``"mixed_float8"``: ``"mixed_bfloat16"``, plus float8 GEMMs in the
      large ``nn.Linear`` layers that :func:`apply_policy` swaps for
      :class:`Float8Linear` (CUDA compute capability >= 8.9, or the CPU).
    - ``"auto"``: :func:`best_policy` of ``device_type`` (default: CUDA when
      one is visible, else the CPU); the policy takes that name, and
      :attr:`reason` says why.

    ``device_type`` (optional: ``"cpu"``, ``"cuda"``, ``"tpu"`` through
    torch_tpu, any device type torch's autocast supports) is where the policy
    will run: ``"auto"`` resolves for it, a mixed policy whose compute dtype
    its autocast lacks is a ``RuntimeError`` now rather than at the first
    :func:`autocast`, and :func:`autocast` defaults to it.
    """

    def __init__(self, name: str, device_type: Optional[str] = None):
        if isinstance(name, Policy):
            self._name, self._reason = name._name, name._reason
            self._device_type = name._device_type
        elif name == "auto":
            chosen = best_policy(device_type)
            self._name, self._reason = chosen._name, chosen._reason
            self._device_type = None
        elif name in _POLICY_DTYPES:
            self._name, self._reason, self._device_type = name, None, None
        else:
            valid = ", ".join(f'"{n}"' for n in _POLICY_DTYPES)
            raise ValueError(f'unknown precision policy "{name}"; valid names are {valid} and "auto"')
        if device_type is not None:
            self._device_type = _device_type(device_type, "Policy")
            if self.is_mixed:
                _autocast_checked(self._device_type, self.compute_dtype)

    @property
    def name(self) -> str:
        """One of the concrete names ("auto" is resolved)."""
        return self._name

    @property
    def reason(self) -> Optional[str]:
        """Why ``"auto"`` chose this policy; None for a policy named directly."""
        return self._reason

    @property
    def device_type(self) -> Optional[str]:
        """The device type the policy was made for; None if not given."""
        return self._device_type

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype autocast computes in: float16 for ``"mixed_float16"``,
        bfloat16 for ``"mixed_bfloat16"`` and ``"mixed_float8"`` (its
        non-float8 ops), float32 for ``"float32"``."""
        return _POLICY_DTYPES[self._name]

    @property
    def variable_dtype(self) -> torch.dtype:
        """The dtype the variables (parameters) are kept in: float32 under
        every policy."""
        return torch.float32

    @property
    def is_mixed(self) -> bool:
        """True for every policy but ``"float32"``: compute runs under autocast."""
        return self._name != "float32"

    @property
    def is_float8(self) -> bool:
        """True for ``"mixed_float8"``: large Linear layers compute in float8."""
        return self._name == "mixed_float8"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and other._name == self._name

    def __hash__(self) -> int:
        return hash(self._name)

    def __repr__(self) -> str:
        return f'Policy("{self._name}")'


def best_policy(device: Union[torch.device, str, None] = None) -> Policy:
    """The policy that trains fastest on ``device`` at float32's accuracy
    (default: CUDA when visible, else the CPU), with its :attr:`Policy.reason`:

    - CUDA: ``"mixed_bfloat16"`` where the GPU computes bfloat16 (compute
      capability 8.0 or newer), else ``"mixed_float16"``;
    - CPU: ``"mixed_bfloat16"`` with AMX-BF16; with AVX512-BF16 alone where
      a short probe (a convolution and a matmul in both dtypes, about 0.1 s
      once per process) runs bf16 at least 1.2x faster than float32 (on
      some VMs it is slower); else ``"float32"``: without those instructions
      bf16 convolutions and matmuls are emulated, slower than float32;
    - TPU (torch_tpu's ``"tpu"`` device): ``"mixed_bfloat16"``, the TPU's
      native compute type.

    On CPU and CUDA the same choice as the C++ ``fusetrain::amp::best_policy``
    and the trainer's ``precision.policy: auto``.
    """
    device_type = _device_type(device, "best_policy")
    if device_type == TPU:
        name, reason = "mixed_bfloat16", "TPU: bfloat16 is its native matrix-unit type"
    elif device_type in ("cpu", "cuda"):
        name, reason = _C.best_policy(device_type)
    else:
        raise ValueError(
            f"best_policy: no policy for device type {device_type!r} (cpu, cuda or tpu); name a "
            'policy, e.g. Policy("mixed_bfloat16")'
        )
    policy = Policy(name)
    policy._reason = reason
    policy._device_type = device_type
    return policy


_global_policy = Policy("float32")
_policy_lock = threading.Lock()


def set_global_policy(policy: Union[Policy, str]) -> None:
    """Sets the default policy of :func:`autocast` and :func:`apply_policy`."""
    global _global_policy
    with _policy_lock:
        _global_policy = Policy(policy)


def global_policy() -> Policy:
    """The default policy (``Policy("float32")`` until set)."""
    return _global_policy


# ----------------------------------------------------------------- autocast


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_autocast_supported(device_type: str, dtype: torch.dtype) -> None:
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"autocast to {dtype} on cuda was asked for, but CUDA is not available; "
                'use device_type="cpu"'
            )
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise RuntimeError(
                "this GPU does not support bfloat16 autocast; use Policy(\"mixed_float16\")"
            )
    elif device_type == "cpu":
        if dtype not in (torch.bfloat16, torch.float16):
            raise RuntimeError(f"CPU autocast supports bfloat16 and float16, not {dtype}")
    elif not torch.amp.is_autocast_available(device_type):
        raise RuntimeError(f'autocast is not available on device type "{device_type}"')
    elif device_type == torch._C._get_privateuse1_backend_name():
        # An out-of-tree backend (torch_tpu) says which dtypes its autocast runs.
        module = getattr(torch, device_type, None)
        supported = getattr(module, "get_amp_supported_dtype", None)
        if supported is None:
            raise RuntimeError(
                f'autocast on "{device_type}": the backend registered no torch.{device_type} '
                "module with get_amp_supported_dtype(), so torch cannot autocast there"
            )
        dtypes = list(supported())
        if dtype not in dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in dtypes) or "no dtype"
            policies = {torch.bfloat16: "mixed_bfloat16", torch.float16: "mixed_float16"}
            usable = [f'"{policies[d]}"' for d in dtypes if d in policies]
            hint = f"; use Policy({usable[0]})" if usable else ""
            raise RuntimeError(
                f'autocast on "{device_type}" supports {names}, not '
                f'{str(dtype).replace("torch.", "")}{hint}'
            )


_autocast_ok: set = set()  # (device type, dtype) pairs checked (a set: torch.compile traces it)


def _autocast_checked(device_type: str, dtype: torch.dtype) -> bool:
    """Checks once per (device type, dtype) that autocast runs there, and that
    torch would not disable it with a mere warning; raises otherwise."""
    if (device_type, dtype) in _autocast_ok:
        return True
    _check_autocast_supported(device_type, dtype)
    with warnings.catch_warnings():
        # torch disables autocast with only a warning when it cannot run it.
        warnings.filterwarnings("error", message=".*[Dd]isabl.*autocast.*")
        torch.autocast(device_type=device_type, dtype=dtype)
    _autocast_ok.add((device_type, dtype))
    return True


@torch._disable_dynamo
def _outside_dynamo(fn, *args):
    """fn(*args) run by Python, not traced: a graph break under
    torch.compile. Entering and leaving autocast inside a compiled function
    must change torch's autocast state for real (dynamo guards each graph on
    it); dynamo cannot carry a torch.autocast entered in one method and left
    in another. (torch imports dynamo lazily here, at the first compiled call.)"""
    return fn(*args)


class autocast(contextlib.ContextDecorator):
    """Runs the block under ``policy`` (default: the global policy).

    A mixed policy enables ``torch.autocast`` in its compute dtype on
    ``device_type`` (default: ``"cuda"`` when available, else ``"cpu"``; any
    device type torch's autocast supports, ``"tpu"`` through torch_tpu); the
    ``"float32"`` policy disables autocast. A policy the device cannot run is
    a ``RuntimeError``, never a silent fall-back to float32. Also a
    decorator; re-entrant. (A class rather than a generator: entering and
    leaving costs about what ``torch.autocast`` costs, which shows on small
    models.) Under ``torch.compile`` entering and leaving are graph breaks.
    """

    __slots__ = ("_device_type", "_dtype", "_mixed", "_active")

    def __init__(self, policy: Union[Policy, str, None] = None, device_type: Optional[str] = None):
        if policy is None:
            policy = global_policy()
        elif not isinstance(policy, Policy):
            policy = Policy(policy)
        if device_type:
            self._device_type = _device_type(device_type, "autocast")
        else:
            self._device_type = policy.device_type or _default_device_type()
        self._mixed = policy.is_mixed
        self._dtype = policy.compute_dtype
        if self._mixed:
            _autocast_checked(self._device_type, self._dtype)
        self._active = []

    def __enter__(self) -> None:
        if torch.compiler.is_compiling():
            return _outside_dynamo(self._enter)
        return self._enter()

    def __exit__(self, *exc):
        if torch.compiler.is_compiling():
            return _outside_dynamo(self._exit, exc)
        return self._exit(exc)

    def _enter(self) -> None:
        if self._mixed:
            ctx = torch.autocast(device_type=self._device_type, dtype=self._dtype)
        else:
            ctx = torch.autocast(device_type=self._device_type, enabled=False)
        ctx.__enter__()
        self._active.append(ctx)

    def _exit(self, exc):
        return self._active.pop().__exit__(*exc)


# ---------------------------------------------------------- float32 islands


def _cast_float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() and value.dtype != torch.float32 else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_float32(v) for v in value)
    if isinstance(value, dict):
        return {k: _cast_float32(v) for k, v in value.items()}
    return value


class _AutocastHook:
    """A module hook that enters or leaves autocast: run by Python even
    under torch.compile (see _outside_dynamo)."""

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return _outside_dynamo(self._run, *args)
        return self._run(*args)


class _Float32Enter(_AutocastHook):
    """Forward pre-hook: autocast off on every device, inputs to float32."""

    def _run(self, module, args, kwargs):
        stack = module.__dict__.setdefault("_fusetrain_float32_stack", [])
        ctx = contextlib.ExitStack()
        for dev in autocast_device_types():
            if torch.is_autocast_enabled(dev):
                ctx.enter_context(torch.autocast(device_type=dev, enabled=False))
        stack.append(ctx)
        return _cast_float32(args), _cast_float32(kwargs)


class _Float32Exit(_AutocastHook):
    """Forward hook (always called, even when forward raises): restore autocast."""

    def _run(self, module, args, kwargs, output):
        stack = module.__dict__.get("_fusetrain_float32_stack")
        if stack:
            stack.pop().close()
        return None


def keep_float32(module: torch.nn.Module) -> torch.nn.Module:
    """Makes ``module`` a float32 island, like Keras' ``dtype="float32"``
    layer argument: inside an autocast region its forward runs with autocast
    off and its floating-point inputs cast to float32. Parameters and
    state-dict keys are unchanged. Returns ``module``."""
    if getattr(module, "_fusetrain_float32", False):
        return module
    module.register_forward_pre_hook(_Float32Enter(), with_kwargs=True)
    module.register_forward_hook(_Float32Exit(), with_kwargs=True, always_call=True)
    module._fusetrain_float32 = True
    return module


class _PolicyEnter(_AutocastHook):
    def __init__(self, policy: Policy):
        self.policy = policy

    def _run(self, module, args, kwargs):
        stack = module.__dict__.setdefault("_fusetrain_policy_stack", [])
        device_type = next(
            (p.device.type for p in module.parameters() if p.is_floating_point()),
            _default_device_type(),
        )
        ctx = contextlib.ExitStack()
        ctx.enter_context(autocast(self.policy, device_type))
        stack.append(ctx)
        return None


class _PolicyExit(_AutocastHook):
    def _run(self, module, args, kwargs, output):
        stack = module.__dict__.get("_fusetrain_policy_stack")
        if stack:
            stack.pop().close()
        return None


def _swap_float8_linears(model: torch.nn.Module, min_features: int, recipe) -> list:
    """Replaces the eligible nn.Linear submodules of ``model`` by Float8Linear
    (see :func:`apply_policy`); returns their names."""
    islands = [name for name, m in model.named_modules() if getattr(m, "_fusetrain_float32", False)]

    def in_island(name: str) -> bool:
        return any(i == "" or name == i or name.startswith(i + ".") for i in islands)

    swapped = []
    for name, module in list(model.named_modules()):
        if type(module) is not torch.nn.Linear or in_island(name):
            continue
        n_in, n_out = module.in_features, module.out_features
        if min(n_in, n_out) < min_features or n_in % 16 or n_out % 16:
            continue
        owner, _, attr = name.rpartition(".")
        if not attr:
            raise ValueError(
                "apply_policy: the model itself is an nn.Linear; wrap it or use "
                "Float8Linear.from_linear(model)"
            )
        setattr(model.get_submodule(owner), attr, Float8Linear.from_linear(module, recipe))
        swapped.append(name)
    return swapped


def apply_policy(
    model: torch.nn.Module,
    policy: Union[Policy, str, None] = None,
    float32_modules: Iterable[Union[type, str]] = (),
    fp8_min_features: Optional[int] = None,
    recipe: Union[Float8Recipe, str, None] = None,
) -> torch.nn.Module:
    """Applies a precision policy to a model, the Keras way.

    - Floating-point parameters and buffers are kept in the policy's
      variable dtype (float32).
    - Every call of ``model`` runs under :func:`autocast` with the policy, on
      the device of the model's parameters.
    - Submodules matching ``float32_modules`` (module types, or names as in
      ``model.named_modules()``) become float32 islands (:func:`keep_float32`).
    - ``"mixed_float8"`` also replaces every ``torch.nn.Linear`` (the class
      itself, not subclasses) outside the float32 islands whose in and out
      features are both >= ``fp8_min_features`` (default
      ``fusetrain.float8.DEFAULT_FP8_MIN_FEATURES``, 1024) and multiples of 16
      by a :class:`Float8Linear` with the same parameters, scaled by
      ``recipe`` (a :class:`Float8Recipe`, ``"delayed"`` (default) or
      ``"current"``). The others compute in bfloat16. The swapped names are
      in ``model.fusetrain_float8_modules``.

    Returns ``model``. An unknown name is a ``ValueError`` naming it.
    """
    policy = global_policy() if policy is None else Policy(policy)
    if not policy.is_float8 and (fp8_min_features is not None or recipe is not None):
        raise ValueError(
            f"apply_policy: fp8_min_features and recipe apply to the mixed_float8 policy, "
            f"not {policy.name}"
        )
    if fp8_min_features is None:
        fp8_min_features = DEFAULT_FP8_MIN_FEATURES
    if not isinstance(fp8_min_features, int) or fp8_min_features < 1:
        raise ValueError(f"apply_policy: fp8_min_features must be a positive int, got {fp8_min_features!r}")
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != policy.variable_dtype:
            p.data = p.data.to(policy.variable_dtype)
    for name, buf in model.named_buffers():
        if buf.is_floating_point() and buf.dtype != policy.variable_dtype:
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._buffers[attr] = buf.to(policy.variable_dtype)

    selectors = list(float32_modules)
    modules = dict(model.named_modules())
    for sel in selectors:
        if isinstance(sel, str):
            if sel not in modules:
                known = ", ".join(n for n in modules if n) or "(none)"
                raise ValueError(f'float32_modules: no submodule named "{sel}"; the model has {known}')
            keep_float32(modules[sel])
        elif isinstance(sel, type) and issubclass(sel, torch.nn.Module):
            for m in modules.values():
                if isinstance(m, sel):
                    keep_float32(m)
        else:
            raise TypeError(
                f"float32_modules entries must be module types or names, got {sel!r}"
            )

    if policy.is_float8:
        model.fusetrain_float8_modules = _swap_float8_linears(model, fp8_min_features, recipe)

    for hook in getattr(model, "_fusetrain_policy_hooks", ()):
        hook.remove()
    model._fusetrain_policy_hooks = (
        model.register_forward_pre_hook(_PolicyEnter(policy), with_kwargs=True, prepend=True),
        model.register_forward_hook(_PolicyExit(), with_kwargs=True, always_call=True),
    )
    model.fusetrain_policy = policy
    return model


# --------------------------------------------------------------- GradScaler


class OptState(Enum):
    """Where an optimizer is in the current iteration (torch's OptState)."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _grads_of(optimizer: torch.optim.Optimizer) -> list:
    """The optimizer's gradients in param-group order (None kept for the
    indices); sparse ones contribute their values, fp16 ones coalesced first.
    An optimizer that keeps its gradients elsewhere (the sharded
    ZeroRedundancyOptimizer) names them with ``_amp_gradients()``."""
    amp_gradients = getattr(optimizer, "_amp_gradients", None)
    if amp_gradients is not None:
        return list(amp_gradients())
    grads = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            g = param.grad
            if g is not None and g.is_sparse:
                if g.dtype is torch.float16:
                    param.grad = g = g.coalesce()
                g = g._values()
            grads.append(g)
    return grads


def _sharded_flag(grads: list, inv_scale: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The overflow check of gradients some of which are DTensors (Note
    [DTensor: local shards] in ``fusetrain/_dtensor.py``): the unscale op on
    the local shards (multiplying by ``inv_scale`` unless it is 1), its
    per-device flags combined and all-reduced (max) over every mesh the
    gradients live on, so that every rank sees an overflow any rank found.
    Returns a one-element float32 "gradient" on the scale's device, inf when
    some rank overflowed and 0 otherwise, for the C++ core to check in place
    of the gradients: its state machine and records (what ``step`` hands the
    optimizer and ``update`` reads) then hold the agreed flag. No host sync.
    Raises before touching anything for gradients the core would refuse."""
    locals_ = _dtensor.local_list(grads)
    per_device = {}
    device_type = scale.device.type
    for i, g in enumerate(locals_):
        if g is None:
            continue
        if not g.is_floating_point():
            raise RuntimeError(
                f"GradScaler: the gradient of parameter {i} has dtype {g.dtype}; only float32, float16, "
                "bfloat16 and float64 gradients can be unscaled"
            )
        if g.device.type != device_type:
            raise RuntimeError(
                f'GradScaler(device="{device_type}"): the gradient of parameter {i} is on {g.device}; keep '
                f'the parameters on {device_type} or construct the scaler for {g.device.type}'
            )
        per_device.setdefault(g.device, []).append(g)
    found = torch.zeros((), dtype=torch.float32, device=scale.device)
    for device, gs in per_device.items():
        flag = torch.zeros((), dtype=torch.float32, device=device)
        torch.ops.fusetrain.non_finite_check_and_unscale_(gs, flag, inv_scale.to(device, non_blocking=True))
        found = torch.maximum(found, flag.to(scale.device, non_blocking=True))
    _dtensor.all_reduce_(found, _dtensor.mesh_groups(grads), "max")
    return torch.where(found > 0, float("inf"), 0.0).reshape(1)


# Misuse that torch's GradScaler reports with AssertionError (the C++ core
# raises RuntimeError with torch's message; the Python face restores the type).
_TORCH_ASSERTIONS = ("No inf checks were recorded",)


@contextlib.contextmanager
def _torch_assertions():
    try:
        yield
    except RuntimeError as e:
        if str(e).startswith(_TORCH_ASSERTIONS):
            raise AssertionError(str(e).split("\nException raised from")[0]) from None
        raise


class GradScaler:
    """Dynamic loss scaling; a drop-in for ``torch.amp.GradScaler``.

    Arguments as torch's (a value out of range is a ``ValueError``):

    - ``device``: the device type the gradients are on (default ``"cuda"``;
      ``"cpu"``, or any device that holds data, a ``"tpu"`` through
      torch_tpu; ``"meta"`` is a ``ValueError``). An enabled ``"cuda"``
      scaler without CUDA warns and disables itself, as torch's.
    - ``init_scale``: the scale before the first update (default ``2.0**16``;
      must be > 0).
    - ``growth_factor``: what the scale is multiplied by after
      ``growth_interval`` steps without inf/NaN (default 2.0; must be > 1).
    - ``backoff_factor``: what the scale is multiplied by after an overflow
      (default 0.5; must be in (0, 1)).
    - ``growth_interval``: consecutive steps without inf/NaN before the scale
      grows (default 2000; must be > 0).
    - ``enabled``: False turns scaling off (default True): ``scale`` returns
      its argument, ``step`` just calls ``optimizer.step``, ``unscale_`` and
      ``update`` do nothing.

    Beyond torch (keyword-only):

    - ``max_scale``: growth never takes the scale above this (default: no cap).
    - ``hysteresis``: overflows tolerated before backing off the scale; each
      still skips its step (default 0: back off on every overflow, as torch).

    Works on CPU and CUDA, with float32, float16 and bfloat16 gradients. With
    an optimizer that sets ``_step_supports_amp_scaling`` (torch's and
    fusetrain's fused optimizers) ``step`` hands it ``grad_scale`` and
    ``found_inf`` tensors and never syncs with the host.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        max_scale: Optional[float] = None,
        hysteresis: int = 0,
    ) -> None:
        device = str(device)
        if enabled and _device_type(device, "GradScaler") == "cuda" and not torch.cuda.is_available():
            warnings.warn(
                "torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling."
            )
            enabled = False
        self._device = device
        self._core = _C.GradScalerCore(
            device,
            float(init_scale),
            float(growth_factor),
            float(backoff_factor),
            int(growth_interval),
            bool(enabled),
            float("inf") if max_scale is None else float(max_scale),
            int(hysteresis),
        )

    # -------------------------------------------------------- the iteration

    def scale(self, outputs):
        """``outputs * scale``: a tensor, or nested lists/tuples (other
        iterables give a lazy map) of tensors."""
        if not self._core.is_enabled():
            return outputs
        if isinstance(outputs, torch.Tensor):
            return self._core.scale(outputs)

        def apply_scale(val):
            if isinstance(val, torch.Tensor):
                return self._core.scale(val)
            if isinstance(val, abc.Iterable):
                scaled = map(apply_scale, val)
                if isinstance(val, (list, tuple)):
                    return type(val)(scaled)
                return scaled
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply_scale(outputs)

    def _check_initialized(self, funcname: str) -> None:
        if self._core.scale_tensor is None:
            raise AssertionError(
                f"Attempted {funcname} but _scale is None.  This may indicate your script "
                "did not use scaler.scale(loss or outputs) earlier in the iteration."
            )

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides the optimizer's gradients by the scale in place (for
        clipping before ``step``), recording whether any held inf/NaN. At most
        once per optimizer between ``update`` calls. No host sync."""
        if not self._core.is_enabled():
            return
        self._check_initialized("unscale_")
        with torch.no_grad():
            grads = _grads_of(optimizer)
            if _dtensor.any_dtensor(grads):
                self._unscale_sharded(id(optimizer), grads)
            else:
                self._core.unscale_grads_(id(optimizer), grads)

    def _unscale_sharded(self, key: int, grads: list) -> None:
        """``unscale_`` of DTensor gradients: the local shards unscaled, the
        overflow flag agreed across the mesh (``_sharded_flag``)."""
        if self._core.stage(key) != OptState.READY.value:
            self._core.unscale_grads_(key, [])  # raises the core's error for the stage
        scale = self._core.scale_tensor
        # fp32 reciprocal of a double-precision 1/scale, as the core's (and torch's).
        inv_scale = scale.double().reciprocal().float()
        self._core.unscale_grads_(key, [_sharded_flag(grads, inv_scale, scale)])

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """Steps ``optimizer`` unless this iteration's gradients held inf/NaN
        and returns what its ``step`` returned (None when skipped)."""
        if not self._core.is_enabled():
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_initialized("step")
        key = id(optimizer)
        takes_scale = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        with torch.no_grad(), _torch_assertions():
            grads = _grads_of(optimizer)
            if _dtensor.any_dtensor(grads) and self._core.stage(key) == OptState.READY.value:
                # Sharded gradients: the overflow flag agreed across the mesh
                # stands in for them (Note [DTensor: local shards]).
                if takes_scale:
                    scale = self._core.scale_tensor
                    grads = [_sharded_flag(grads, torch.ones_like(scale), scale)]
                else:
                    self._unscale_sharded(key, grads)
                    grads = []
            grad_scale, found_inf = self._core.prepare_step(key, grads, takes_scale)
        if takes_scale:
            optimizer.grad_scale = grad_scale
            optimizer.found_inf = found_inf
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale
                del optimizer.found_inf
        elif not found_inf.item():  # torch's host sync, for optimizers without scale support
            retval = optimizer.step(*args, **kwargs)
        else:
            retval = None
        self._core.mark_stepped(key)
        return retval

    def update(self, new_scale: Union[float, torch.Tensor, None] = None) -> None:
        """Grows or backs off the scale from this iteration's overflow flags,
        on the device; or sets it to ``new_scale``. Resets every optimizer's
        stage for the next iteration."""
        if not self._core.is_enabled():
            return
        self._check_initialized("update")
        if new_scale is None:
            with _torch_assertions():
                self._core.update()
        elif isinstance(new_scale, torch.Tensor):
            reason = (
                "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                "torch.FloatTensor with requires_grad=False."
            )
            if (
                new_scale.device.type != torch.device(self._device).type
                or new_scale.numel() != 1
                or new_scale.requires_grad
            ):
                raise AssertionError(reason)
            self._core.update(new_scale)
        else:
            self._core.update(float(new_scale))

    # ----------------------------------------------------- beyond torch's

    @property
    def found_inf(self) -> Optional[torch.Tensor]:
        """One-element float32 tensor on the scale's device, non-zero when the
        latest ``step`` (or ``update``) saw inf/NaN; None before either."""
        return self._core.found_inf

    def step_was_skipped(self) -> bool:
        """Whether the latest ``step`` was skipped (reads ``found_inf``: a host sync)."""
        return self._core.step_was_skipped()

    def overflow_report(self, named_parameters) -> list:
        """Names of the parameters whose gradients hold inf or NaN, e.g.
        ``scaler.overflow_report(model.named_parameters())`` after a skipped
        step (before ``zero_grad``). One host sync."""
        names, grads = [], []
        for name, param in named_parameters:
            names.append(name)
            grads.append(_dtensor.local(param.grad))  # (a DTensor's: this rank's shard)
        return [names[i] for i in _C.GradScalerCore.non_finite_indices(grads)]

    # ----------------------------------------------------------- accessors

    @property
    def _scale(self) -> Optional[torch.Tensor]:
        return self._core.scale_tensor

    def _get_scale_async(self) -> Optional[torch.Tensor]:
        return self._core.scale_tensor

    def get_scale(self) -> float:
        """The current scale (a host sync); ``init_scale`` before the first
        ``scale``; 1.0 when disabled."""
        return self._core.get_scale()

    def get_growth_factor(self) -> float:
        """The factor the scale grows by (``growth_factor``)."""
        return self._core.get_growth_factor()

    def set_growth_factor(self, new_factor: float) -> None:
        """Sets the growth factor to ``new_factor`` for the next updates
        (unchecked, as torch's)."""
        self._core.set_growth_factor(float(new_factor))

    def get_backoff_factor(self) -> float:
        """The factor the scale backs off by (``backoff_factor``)."""
        return self._core.get_backoff_factor()

    def set_backoff_factor(self, new_factor: float) -> None:
        """Sets the backoff factor to ``new_factor`` for the next updates
        (unchecked, as torch's)."""
        self._core.set_backoff_factor(float(new_factor))

    def get_growth_interval(self) -> int:
        """Steps without inf/NaN before the scale grows (``growth_interval``)."""
        return self._core.get_growth_interval()

    def set_growth_interval(self, new_interval: int) -> None:
        """Sets the growth interval to ``new_interval`` steps for the next
        updates (unchecked, as torch's)."""
        self._core.set_growth_interval(int(new_interval))

    def get_max_scale(self) -> Optional[float]:
        """The cap on the scale (``max_scale``); None when there is none."""
        m = self._core.get_max_scale()
        return None if m == float("inf") else m

    def get_hysteresis(self) -> int:
        """Overflows tolerated before backing off (``hysteresis``)."""
        return self._core.get_hysteresis()

    def is_enabled(self) -> bool:
        """Whether the scaler scales: False when constructed with
        ``enabled=False`` or disabled for want of CUDA."""
        return self._core.is_enabled()

    def _stage(self, optimizer) -> OptState:
        return OptState(self._core.stage(id(optimizer)))

    # ------------------------------------------------------- checkpointing

    def state_dict(self) -> dict:
        """torch's keys (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``), plus ``max_scale`` /
        ``hysteresis`` and ``_overflow_tracker`` when those are on; ``{}`` when
        disabled. Loads into ``torch.amp.GradScaler`` and back."""
        return self._core.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores the scale, factors, interval and trackers from
        ``state_dict`` (a :meth:`state_dict` of this class or of
        ``torch.amp.GradScaler``; ``max_scale``, ``hysteresis`` and
        ``_overflow_tracker`` where it holds them). Values are numbers or
        one-element tensors. An empty dict (saved from a disabled scaler) or a
        missing torch key is a ``RuntimeError``; a disabled scaler ignores the
        call."""
        self._core.load_state_dict(dict(state_dict))

    def __getstate__(self) -> dict:
        if self._core.is_enabled() and self._core.in_iteration():
            raise AssertionError(
                "A GradScaler instance may only be pickled at the beginning of an iteration, "
                "or at the end after scaler.update()."
            )
        return {
            "device": self._device,
            "enabled": self._core.is_enabled(),
            "max_scale": self.get_max_scale(),
            "hysteresis": self.get_hysteresis(),
            "state": self.state_dict(),
            "growth_factor": self.get_growth_factor(),
            "backoff_factor": self.get_backoff_factor(),
            "growth_interval": self.get_growth_interval(),
        }

    def __setstate__(self, state: dict) -> None:
        self._device = state["device"]
        self._core = _C.GradScalerCore(
            state["device"],
            2.0**16,
            state["growth_factor"],
            state["backoff_factor"],
            state["growth_interval"],
            state["enabled"],
            float("inf") if state["max_scale"] is None else state["max_scale"],
            state["hysteresis"],
        )
        if state["state"]:
            self._core.load_state_dict(state["state"])

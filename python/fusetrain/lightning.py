"""PyTorch Lightning with fusetrain: a precision plugin and two DDP strategies.

One line each brings fusetrain to a Lightning ``Trainer``::

    import fusetrain.lightning  # registers "fusetrain_ddp" and "fusetrain_ddp_zero"
    from fusetrain.lightning import FusetrainPrecision

    trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy="fusetrain_ddp",
                                plugins=[FusetrainPrecision("bf16-mixed")])

- :class:`FusetrainPrecision` runs the steps under a ``fusetrain.amp.Policy``
  (what Lightning's ``MixedPrecision`` does with ``torch.autocast``), scales
  the loss with ``fusetrain.amp.GradScaler`` and clips through Lightning's
  ``gradient_clip_val``, folded into the step of fusetrain's fused
  optimizers. With an optimizer that takes the scale as a tensor
  (``_step_supports_amp_scaling``: ``fusetrain.optim.FusedAdamW`` and
  friends, ``torch.optim.AdamW(fused=True)``) a step never syncs with the host.
- ``"fusetrain_ddp"`` (:class:`FusetrainDDPStrategy`) is Lightning's DDP
  strategy with ``fusetrain.parallel.DistributedDataParallel`` (the C++
  reducer, ``comm_dtype``, C++ communication hooks) over the ``"fusetrain"``
  process-group backend on CPUs (shared-memory collectives between the
  processes of a host) and NCCL on GPUs. Lightning's cluster environments
  (torchrun, SLURM, ...) and ``num_nodes`` work as with ``"ddp"``.
- ``"fusetrain_ddp_zero"`` (:class:`FusetrainDDPZeroStrategy`) adds ZeRO:
  gradients reduce-scattered (``shard_gradients=True``) and the optimizer
  returned by ``configure_optimizers`` sharded by
  ``fusetrain.optim.ZeroRedundancyOptimizer``.

``import fusetrain`` never imports Lightning; this module needs it
(``pip install "fusetrain[lightning]"``).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch.nn import Module
from torch.optim import LBFGS, Optimizer

try:
    import lightning.pytorch as pl
except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] != "lightning":
        raise  # Lightning is there but one of its own dependencies is not
    raise ImportError(
        'fusetrain.lightning needs PyTorch Lightning, which is not installed: pip install "fusetrain[lightning]"'
    ) from None
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from . import amp
from .float8 import DEFAULT_FP8_MIN_FEATURES
from .optim import FusedAdamW, FusedSGD
from .parallel import DistributedDataParallel, _tensors_in
from .utils import clip_grad_norm_
from .zero import ZeroRedundancyOptimizer

__all__ = ["FusetrainPrecision", "FusetrainDDPStrategy", "FusetrainDDPZeroStrategy"]

# Lightning's precision names -> fusetrain's policies.
_POLICIES = {
    "bf16-mixed": "mixed_bfloat16",
    "16-mixed": "mixed_float16",
    "32-true": "float32",
    "fp8-mixed": "mixed_float8",
}


def _raw(optimizer: Any) -> Any:
    """The optimizer a ``LightningOptimizer`` wraps (or the optimizer itself)."""
    return getattr(optimizer, "_optimizer", optimizer)


def _takes_scale(optimizer: Any) -> bool:
    """Whether the optimizer unscales in its step, handed the scale as a
    tensor (Lightning's ``_optimizer_handles_unscaling``)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def _folds_clipping(optimizer: Any) -> bool:
    """fusetrain's optimizers clip inside their step (``max_grad_norm``)."""
    return isinstance(optimizer, (FusedAdamW, FusedSGD, ZeroRedundancyOptimizer))


class _DefaultDtype:
    """Tensors created inside get ``dtype`` (torch's default dtype)."""

    def __init__(self, dtype: torch.dtype):
        self._dtype = dtype
        self._previous: List[torch.dtype] = []

    def __enter__(self) -> None:
        self._previous.append(torch.get_default_dtype())
        torch.set_default_dtype(self._dtype)

    def __exit__(self, *exc) -> None:
        torch.set_default_dtype(self._previous.pop())


# =================================================================== precision


class FusetrainPrecision(Precision):
    """Lightning precision plugin over fusetrain's mixed precision.

    Args:
        precision: ``"bf16-mixed"`` (compute in bfloat16, variables in
            float32), ``"16-mixed"`` (float16, with a loss scaler),
            ``"32-true"`` (float32) or ``"fp8-mixed"`` (``"bf16-mixed"`` plus
            float8 GEMMs in the large ``nn.Linear`` layers, fusetrain's
            ``"mixed_float8"`` policy).
        scaler: a ``fusetrain.amp.GradScaler``. ``"16-mixed"`` makes one with
            torch's defaults when none is given; the other precisions use none
            unless given one (fusetrain's scaler also handles bfloat16).
        float32_modules: submodules (types, or names as in
            ``model.named_modules()``) that stay float32 islands
            (``fusetrain.amp.keep_float32``).
        device: the device type the steps autocast on (``"cpu"``,
            ``"cuda"``, ...); default: that of the model's parameters when the
            Trainer connects the plugin (CUDA, where available, before).
        fp8_min_features: ``"fp8-mixed"``: the smallest in/out features of a
            Linear layer that computes in float8 (``fusetrain.amp.apply_policy``).
        fp8_recipe: ``"fp8-mixed"``: the float8 scaling recipe, ``"delayed"``
            (default) or ``"current"``, or a ``fusetrain.amp.Float8Recipe``.

    What it does, against Lightning's ``MixedPrecision``:

    - ``forward_context`` (every training, validation, test and predict
      step) autocasts to the policy's compute dtype, as ``MixedPrecision``
      does (the same forward numerics); ``convert_module`` makes the float32
      islands and the float8 layers of ``fusetrain.amp.apply_policy``;
      ``module_init_context`` creates parameters in float32.
    - With a scaler the loss is scaled before backward and the optimizer
      stepped through ``scaler.step``: steps whose gradients hold inf/NaN are
      skipped and the scale backs off, as Lightning's plugin does (the step
      still counts in ``trainer.global_step``). Optimizers that take the scale
      as a tensor skip on the device, with no host sync; for the others the
      gradients are unscaled before ``on_before_optimizer_step`` and the skip
      reads the overflow flag on the host, as torch's scaler does.
    - ``gradient_clip_val`` (``clip_gradients``): fusetrain's optimizers
      (``FusedAdamW``, ``FusedAdam``, ``FusedSGD``,
      ``ZeroRedundancyOptimizer``) clip by norm inside their step
      (``max_grad_norm`` for that step: one pass less, no unscale pass); other
      optimizers get their gradients unscaled first (also those that unscale
      in their step, which Lightning's plugin refuses to clip) and clipped by
      ``fusetrain.utils.clip_grad_norm_``. Clipping by value unscales and
      calls torch's ``clip_grad_value_``.
    - ``state_dict`` / ``load_state_dict`` carry the scaler's state in
      Lightning's checkpoints (under ``"FusetrainPrecision"``); a checkpoint
      of Lightning's ``MixedPrecision`` restores the scale too.
    """

    def __init__(
        self,
        precision: str = "bf16-mixed",
        *,
        scaler: Optional[amp.GradScaler] = None,
        float32_modules: Optional[Iterable[Union[type, str]]] = None,
        device: Optional[str] = None,
        fp8_min_features: Optional[int] = None,
        fp8_recipe: Union[str, "amp.Float8Recipe", None] = None,
    ) -> None:
        if precision not in _POLICIES:
            valid = ", ".join(repr(p) for p in _POLICIES)
            raise ValueError(f"FusetrainPrecision(precision={precision!r}): precision must be one of {valid}")
        if scaler is not None and not isinstance(scaler, amp.GradScaler):
            raise TypeError(
                f"FusetrainPrecision: scaler must be a fusetrain.amp.GradScaler (torch.amp.GradScaler's "
                f"arguments), got {type(scaler).__qualname__}"
            )
        if scaler is not None and precision == "32-true":
            raise ValueError('FusetrainPrecision("32-true") computes in float32 and takes no scaler')
        if precision != "fp8-mixed" and (fp8_min_features is not None or fp8_recipe is not None):
            raise ValueError(f'FusetrainPrecision: fp8_min_features and fp8_recipe apply to "fp8-mixed", not {precision!r}')
        if fp8_min_features is not None and (not isinstance(fp8_min_features, int) or fp8_min_features < 1):
            raise ValueError(f"FusetrainPrecision: fp8_min_features must be a positive int, got {fp8_min_features!r}")
        self.precision = precision
        self.policy = amp.Policy(_POLICIES[precision])
        self.float32_modules = tuple(float32_modules or ())
        self.fp8_min_features = fp8_min_features
        self.fp8_recipe = fp8_recipe
        self._device = device
        self._own_scaler = scaler is None and precision == "16-mixed"
        if self._own_scaler:
            scaler = amp.GradScaler(device=self.device)
        self.scaler = scaler
        self._checked: set = set()  # device types the policy was checked on
        # Optimizers whose max_grad_norm clip_gradients set for the current
        # step: id -> (optimizer, the value to restore after the step).
        self._folded: Dict[int, Tuple[Any, Optional[float]]] = {}

    @property
    def device(self) -> str:
        """The device type the steps autocast on."""
        if self._device is not None:
            return self._device
        return "cuda" if torch.cuda.is_available() else "cpu"

    # ------------------------------------------------------------ the model

    def convert_module(self, module: Module) -> Module:
        """Applies the policy's module changes in place and returns the
        model: ``float32_modules`` become float32 islands
        (``fusetrain.amp.keep_float32``) and, for ``"fp8-mixed"``, the
        eligible ``nn.Linear`` layers outside them become
        ``fusetrain.amp.Float8Linear`` (``fusetrain.amp.apply_policy``'s rule).
        The parameters stay as they are (float32 from
        :meth:`module_init_context`), as with Lightning's ``MixedPrecision``."""
        modules = dict(module.named_modules())
        for selector in self.float32_modules:
            if isinstance(selector, str):
                if selector not in modules:
                    known = ", ".join(n for n in modules if n) or "(none)"
                    raise ValueError(f'float32_modules: no submodule named "{selector}"; the model has {known}')
                amp.keep_float32(modules[selector])
            elif isinstance(selector, type) and issubclass(selector, Module):
                for m in modules.values():
                    if isinstance(m, selector):
                        amp.keep_float32(m)
            else:
                raise TypeError(f"float32_modules entries must be module types or names, got {selector!r}")
        if self.policy.is_float8:
            min_features = self.fp8_min_features or DEFAULT_FP8_MIN_FEATURES
            module.fusetrain_float8_modules = amp._swap_float8_linears(module, min_features, self.fp8_recipe)
        return module

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        """Tensors created inside are float32 (the policy's variable dtype)."""
        return _DefaultDtype(self.policy.variable_dtype)

    def module_init_context(self) -> contextlib.AbstractContextManager:
        """Parameters created inside (``Trainer.init_module()``) are float32."""
        return self.tensor_init_context()

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Autocast to the policy's compute dtype on :attr:`device` (nothing
        for ``"32-true"``), without the cast cache, as Lightning's
        ``MixedPrecision`` (its workaround for torch's cache handing a
        forward the weights cast under an earlier ``torch.no_grad()``,
        Lightning #20644). A device that cannot autocast to the policy's
        dtype is a ``RuntimeError`` (``fusetrain.amp.Policy``), never a
        silent float32 run."""
        if not self.policy.is_mixed:
            return contextlib.nullcontext()
        device = self.device
        if device not in self._checked:
            amp.Policy(self.policy.name, device_type=device)
            self._checked.add(device)
        return torch.autocast(device, dtype=self.policy.compute_dtype, cache_enabled=False)

    def connect(
        self, model: Module, optimizers: List[Optimizer], lr_schedulers: List[Any]
    ) -> Tuple[Module, List[Optimizer], List[Any]]:
        """Called by the strategy once the model is on its device: the
        autocast device type (unless given) becomes that of ``model``'s first
        floating-point parameter (the scaler made for another device is
        remade for it). ``optimizers`` and ``lr_schedulers`` pass through;
        returns the three as Lightning's ``Precision.connect``."""
        param = next((p for p in model.parameters() if p.is_floating_point()), None)
        if self._device is None and param is not None:
            self._device = param.device.type
            if self._own_scaler and self.scaler._scale is None and self.scaler._device != self._device:
                self.scaler = amp.GradScaler(device=self._device)
        return super().connect(model, optimizers, lr_schedulers)

    # ---------------------------------------------------- backward and step

    def pre_backward(self, tensor: torch.Tensor, module: "pl.LightningModule") -> torch.Tensor:  # type: ignore[override]
        """Scales the loss ``tensor`` (with a scaler) before Lightning's hooks
        see it, then Lightning's ``pre_backward`` of the LightningModule
        ``module``; returns the (scaled) loss."""
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def _unscale(self, optimizer: Any) -> None:
        """Unscales the optimizer's gradients unless already done this step."""
        if self.scaler is not None and self.scaler._stage(optimizer) is amp.OptState.READY:
            self.scaler.unscale_(optimizer)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: "pl.LightningModule",
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Runs the ``closure`` (forward and backward), Lightning's
        ``on_before_optimizer_step`` hooks and clipping, then the step of
        ``optimizer`` (further keyword arguments go to it): through the
        scaler (skipped on overflow, scale updated) when there is one.
        ``model`` is the LightningModule; a ``training_step`` that returned
        None (automatic optimization) steps nothing. LBFGS with a scaler is
        refused (``MisconfigurationException``), as Lightning refuses it."""
        try:
            if self.scaler is None:
                return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
            if isinstance(optimizer, LBFGS):
                raise MisconfigurationException("AMP and the LBFGS optimizer are not compatible.")
            closure_result = closure()
            # A training_step that returned None ran no backward: nothing to step.
            skip = closure_result is None and model.automatic_optimization
            if not skip and not _takes_scale(optimizer):
                # Unscaled before the hooks and clipping see the gradients (as
                # Lightning's plugin); optimizers that take the scale unscale
                # in their step.
                self._unscale(optimizer)
            self._after_closure(model, optimizer)
            if skip:
                return closure_result
            step_output = self.scaler.step(optimizer, **kwargs)
            self.scaler.update()
            return step_output
        finally:
            self._restore_folded()

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clips the gradients of ``optimizer`` to ``clip_val`` (Lightning's
        ``gradient_clip_val``; None or <= 0 clips nothing) by
        ``gradient_clip_algorithm`` (``"norm"``, the default, or
        ``"value"``): by norm inside the step of fusetrain's optimizers, else
        on unscaled gradients here. By value with sharded gradients
        (``"fusetrain_ddp_zero"``) is a ``ValueError``."""
        if clip_val is None or clip_val <= 0:
            return
        optimizer = _raw(optimizer)
        if gradient_clip_algorithm == GradClipAlgorithmType.NORM and _folds_clipping(optimizer):
            self._folded.setdefault(id(optimizer), (optimizer, optimizer.max_grad_norm))
            optimizer.max_grad_norm = float(clip_val)
            return
        if isinstance(optimizer, ZeroRedundancyOptimizer) and optimizer._ddp is not None:
            raise ValueError(
                "FusetrainPrecision: clipping by value needs p.grad, which sharded gradients "
                '(strategy "fusetrain_ddp_zero") do not have; clip by norm (gradient_clip_algorithm="norm")'
            )
        self._unscale(optimizer)
        params = list(self.main_params(optimizer))
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            torch.nn.utils.clip_grad_value_(params, clip_value=clip_val)
        else:
            clip_grad_norm_(params, clip_val)

    def _restore_folded(self) -> None:
        for optimizer, previous in self._folded.values():
            optimizer.max_grad_norm = previous
        self._folded.clear()

    # ------------------------------------------------------- checkpointing

    def state_dict(self) -> Dict[str, Any]:
        """The scaler's state (``{}`` without a scaler)."""
        if self.scaler is not None:
            return self.scaler.state_dict()
        return {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores the scaler's state saved by :meth:`state_dict` (or by
        ``torch.amp.GradScaler``)."""
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)

    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        """A checkpoint saved with Lightning's ``MixedPrecision`` carries its
        scaler under that plugin's name: the scale resumes from it."""
        if self.scaler is not None and type(self).__qualname__ not in checkpoint:
            saved = checkpoint.get("MixedPrecision") or checkpoint.get("native_amp_scaling_state")
            if saved:
                self.scaler.load_state_dict(saved)


# ================================================================== strategies


class _ForwardRedirection(_DDPForwardRedirection):
    """Manual optimization: the backward inside ``training_step`` must not be
    prepared by the forward (``pre_backward`` prepares it), as Lightning does
    for torch's DDP."""

    def on_after_inner_forward(self, wrapper_module: Module, original_module: "pl.LightningModule") -> None:
        if isinstance(wrapper_module, DistributedDataParallel) and not original_module.automatic_optimization:
            wrapper_module.require_backward_grad_sync = False
        else:
            super().on_after_inner_forward(wrapper_module, original_module)

    def on_after_outer_forward(self, wrapper_module: Module, original_module: "pl.LightningModule") -> None:
        if isinstance(wrapper_module, DistributedDataParallel) and not original_module.automatic_optimization:
            wrapper_module.require_backward_grad_sync = True
        else:
            super().on_after_outer_forward(wrapper_module, original_module)


def _averages_by_division(tensor: torch.Tensor, group: Optional[Any]) -> bool:
    """Whether a mean of ``tensor`` over ``group`` is a SUM and a division:
    a CPU tensor over an initialised group whose CPU backend is gloo under
    another name (``"fusetrain"``, ``"cpu:fusetrain,cuda:nccl"``,
    ``"cpu:gloo,cuda:nccl"``). A group named ``"gloo"`` Lightning handles
    itself."""
    dist = torch.distributed
    if tensor.device.type != "cpu" or not (dist.is_available() and dist.is_initialized()):
        return False
    backend = str(dist.get_backend(group))
    if backend == "gloo":
        return False
    cpu = dict(part.split(":", 1) for part in backend.split(",") if ":" in part).get("cpu", backend)
    return cpu in ("fusetrain", "gloo")


def _ddp_arguments() -> set:
    return set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", "module", "device_ids"}


class FusetrainDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` with ``fusetrain.parallel.DistributedDataParallel``;
    ``Trainer(strategy="fusetrain_ddp")``.

    Args:
        comm_dtype: communicate the gradients in ``torch.bfloat16`` or
            ``torch.float16`` (the cast fused into the reducer's copy into the
            bucket); default: their dtype.
        ddp_comm_hook: a communication hook: torch's hooks
            (``torch.distributed.algorithms.ddp_comm_hooks``) with
            ``ddp_comm_state`` and ``ddp_comm_wrapper`` as in Lightning's
            ``DDPStrategy``, or the name of one of fusetrain's C++ hooks
            (``"allreduce"``, ``"fp16"``, ``"bf16"``, ``"powersgd"``), whose
            options (``register_builtin_comm_hook``'s keywords) are then a dict
            in ``ddp_comm_state``. Registered on every device (Lightning's DDP
            registers hooks on CUDA only).
        ddp_comm_state: the hook's state (see ``ddp_comm_hook``).
        ddp_comm_wrapper: a wrapper of a torch hook (e.g. ``fp16_compress_wrapper``).
        process_group_backend: default ``"fusetrain"`` on CPUs (gloo, with
            the CPU collectives of the processes of one host through shared
            memory), the device's default (NCCL) elsewhere.
        **kwargs: Lightning's ``DDPStrategy`` arguments (``timeout``,
            ``start_method``, ``cluster_environment``, ...) and
            ``DistributedDataParallel``'s (``bucket_cap_mb``,
            ``find_unused_parameters``, ``gradient_as_bucket_view``,
            ``gradient_predivide_factor``, ``shard_gradients``, ...).
    """

    def __init__(
        self,
        *,
        comm_dtype: Optional[torch.dtype] = None,
        ddp_comm_hook: Union[Callable, str, None] = None,
        ddp_comm_state: Optional[object] = None,
        ddp_comm_wrapper: Optional[Callable] = None,
        process_group_backend: Optional[str] = None,
        **kwargs: Any,
    ) -> None:
        strategy_args = set(inspect.signature(DDPStrategy.__init__).parameters)
        unknown = [k for k in kwargs if k not in strategy_args and k not in _ddp_arguments()]
        if unknown:
            raise TypeError(
                f"{type(self).__name__}: unknown arguments {unknown}: neither Lightning's DDPStrategy nor "
                "fusetrain.parallel.DistributedDataParallel takes them"
            )
        if isinstance(ddp_comm_hook, str) and ddp_comm_wrapper is not None:
            raise ValueError(f"{type(self).__name__}: ddp_comm_wrapper wraps a Python hook, not the builtin {ddp_comm_hook!r}")
        if isinstance(ddp_comm_hook, str) and not isinstance(ddp_comm_state, (dict, type(None))):
            raise TypeError(
                f"{type(self).__name__}: with the builtin hook {ddp_comm_hook!r}, ddp_comm_state is a dict of "
                "register_builtin_comm_hook's options"
            )
        if comm_dtype is not None:
            kwargs["comm_dtype"] = comm_dtype
        super().__init__(
            ddp_comm_state=ddp_comm_state,
            ddp_comm_hook=ddp_comm_hook,
            ddp_comm_wrapper=ddp_comm_wrapper,
            process_group_backend=process_group_backend,
            **kwargs,
        )
        self._forward_redirection = _ForwardRedirection()

    def _get_process_group_backend(self) -> str:
        if self._process_group_backend:
            return self._process_group_backend
        if self.root_device.type == "cpu":
            return "fusetrain"
        return super()._get_process_group_backend()

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Any = "mean") -> Any:
        """Lightning's ``reduce`` (what ``self.log(..., sync_dist=True)`` calls),
        with a mean over a CPU group done as on ``strategy="ddp"``'s gloo.

        Lightning averages as a SUM then a division only for a group whose
        backend is named ``"gloo"``, and sends ``ReduceOp.AVG`` to any other:
        the ``"fusetrain"`` backend, gloo underneath, cannot average integers
        (Lightning's epoch counters are int64). Here a string ``"mean"`` /
        ``"avg"`` of a CPU tensor over such a group is that SUM and division,
        so the results are those of ``"ddp"`` on the CPU, bit for bit (an
        integer tensor keeps its dtype, the quotient truncated, as there).

        Args:
            tensor: the value to reduce over the ranks, in place (anything
                else is returned as it is).
            group: the process group (default: the world).
            reduce_op: ``"mean"``/``"avg"``, ``"sum"``, ``"max"``, ``"min"``
                or a ``torch.distributed.ReduceOp``, as Lightning's.
        """
        if (isinstance(tensor, torch.Tensor) and isinstance(reduce_op, str)
                and reduce_op.lower() in ("mean", "avg") and _averages_by_division(tensor, group)):
            from lightning.fabric.utilities.distributed import _sync_ddp

            result = _sync_ddp(tensor, group, reduce_op=torch.distributed.ReduceOp.SUM)
            world = torch.distributed.get_world_size(group)
            if not torch.is_floating_point(result):
                return result.copy_(result / world)
            return result.div_(world)
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def _setup_model(self, model: Module) -> DistributedDataParallel:
        """Wraps the LightningModule in fusetrain's ``DistributedDataParallel``."""
        return DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs)

    def _register_ddp_hooks(self) -> None:
        hook = self._ddp_comm_hook
        if hook is None:
            return
        assert isinstance(self.model, DistributedDataParallel)
        if isinstance(hook, str):
            self.model.register_builtin_comm_hook(hook, **(self._ddp_comm_state or {}))
        else:
            _register_ddp_comm_hook(
                model=self.model,
                ddp_comm_state=self._ddp_comm_state,
                ddp_comm_hook=hook,
                ddp_comm_wrapper=self._ddp_comm_wrapper,
            )

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        """Manual optimization: arms the reducer for the backward of
        ``closure_loss`` that ``manual_backward`` runs inside
        ``training_step`` (automatic optimization: the forward armed it)."""
        model = self.model
        if not isinstance(model, DistributedDataParallel):
            return super().pre_backward(closure_loss)
        assert self.lightning_module is not None
        if not self.lightning_module.automatic_optimization and torch.is_grad_enabled():
            model.reducer.set_require_sync(True)
            model.reducer.prepare_for_backward(_tensors_in(closure_loss, []))
        return None

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        """Nothing to do for fusetrain's DDP after the backward of
        ``closure_loss`` (Lightning's DDP flushes torch's static-graph reducer
        here)."""
        if isinstance(self.model, DistributedDataParallel):
            return None
        return super().post_backward(closure_loss)

    def teardown(self) -> None:
        """Unwraps the LightningModule (as Lightning does for torch's DDP)
        and tears the strategy down."""
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Registers ``"fusetrain_ddp"`` in ``strategy_registry``, Lightning's
        ``StrategyRegistry`` (done when ``fusetrain.lightning`` is imported)."""
        strategy_registry.register(
            "fusetrain_ddp",
            cls,
            description="DDP with fusetrain's DistributedDataParallel (C++ reducer) and the fusetrain backend on CPUs",
            override=True,
        )


class FusetrainDDPZeroStrategy(FusetrainDDPStrategy):
    """``"fusetrain_ddp"`` with ZeRO; ``Trainer(strategy="fusetrain_ddp_zero")``.

    The gradients are reduce-scattered (``DistributedDataParallel(...,
    shard_gradients=True)``: each rank keeps its piece, ``p.grad`` stays
    None) and each optimizer ``configure_optimizers`` returns is replaced by a
    ``fusetrain.optim.ZeroRedundancyOptimizer`` of the same class, parameter
    groups and options (its LR schedulers follow), which keeps each rank's
    shard of the optimizer state. The optimizer must hold exactly the
    parameters that train. Checkpoints hold the unsharded optimizer state
    (Lightning consolidates it on rank 0) and load at any world size.
    Gradient clipping works by norm (``gradient_clip_val``), folded into the
    step; hooks that read ``p.grad`` (e.g. gradient-norm logging) see none.

    Args:
        shard_gradients: False keeps whole gradients (ZeRO stage 1: only the
            optimizer state is sharded).
        parameters_as_bucket_view: ``ZeroRedundancyOptimizer``'s option.
        overlap_all_gather: ``ZeroRedundancyOptimizer``'s option (needs
            ``parameters_as_bucket_view``): the parameters' all-gather after
            a step overlaps the next forward.
        **kwargs: :class:`FusetrainDDPStrategy`'s arguments (no
            communication hook with sharded gradients).
    """

    def __init__(
        self,
        *,
        shard_gradients: bool = True,
        parameters_as_bucket_view: bool = False,
        overlap_all_gather: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(shard_gradients=shard_gradients, **kwargs)
        self._zero_kwargs = {
            "parameters_as_bucket_view": parameters_as_bucket_view,
            "overlap_all_gather": overlap_all_gather,
        }

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        """``configure_optimizers``' optimizers of ``trainer``'s LightningModule,
        each replaced by a ``ZeroRedundancyOptimizer`` of its class, groups
        and options, their LR schedulers pointed at the replacement. An
        optimizer that already has state is a ``ValueError``."""
        super().setup_optimizers(trainer)
        sharded = [self._shard(opt) for opt in self.optimizers]
        for old, new in zip(self.optimizers, sharded):
            if new is not old:
                for config in self.lr_scheduler_configs:
                    if getattr(config.scheduler, "optimizer", None) is old:
                        _rebind_scheduler(config.scheduler, new)
        self.optimizers = sharded

    def _shard(self, optimizer: Optimizer) -> Optimizer:
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            return optimizer
        if optimizer.state:
            raise ValueError(
                f"{type(self).__name__}: the optimizer from configure_optimizers already has state; "
                "it is sharded before its first step"
            )
        cls = type(optimizer)
        accepted = set(inspect.signature(cls.__init__).parameters)
        options = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
        if getattr(optimizer, "max_grad_norm", None) is not None:
            options["max_grad_norm"] = optimizer.max_grad_norm
        assert isinstance(self.model, DistributedDataParallel)
        groups = [dict(g) for g in optimizer.param_groups]
        return ZeroRedundancyOptimizer(
            groups,
            optimizer_class=cls,
            process_group=self.model.process_group,
            **self._zero_kwargs,
            **options,
        )

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Registers ``"fusetrain_ddp_zero"`` in ``strategy_registry``,
        Lightning's ``StrategyRegistry`` (done when ``fusetrain.lightning`` is
        imported)."""
        strategy_registry.register(
            "fusetrain_ddp_zero",
            cls,
            description="fusetrain_ddp with sharded gradients and a ZeroRedundancyOptimizer (ZeRO stage 2)",
            override=True,
        )


def _rebind_scheduler(scheduler: Any, optimizer: Optimizer) -> None:
    """Points an LR scheduler made for one optimizer at its replacement.
    torch's schedulers also wrap their optimizer's ``step`` to check that it
    runs before theirs; the replacement's step gets the same marks."""
    scheduler.optimizer = optimizer
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    def tracked_step(*args, **kwargs):
        optimizer._opt_called = True
        return step(*args, **kwargs)

    tracked_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked_step  # type: ignore[method-assign]


FusetrainDDPStrategy.register_strategies(StrategyRegistry)
FusetrainDDPZeroStrategy.register_strategies(StrategyRegistry)

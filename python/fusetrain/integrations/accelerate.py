"""Accelerate: fusetrain's GradScaler as an Accelerator's loss scaler.

``accelerator.prepare(model, fusetrain.optim.FusedAdamW(...), loader)`` needs
nothing from here: Accelerate's scaler hands FusedAdamW the scale and the
overflow flag (``_step_supports_amp_scaling``), and ``clip_grad_norm_``,
``save_state`` / ``load_state`` go through the optimizer's own methods.

What Accelerate lacks is loss scaling on the CPU: with
``mixed_precision="fp16"`` on a CPU it makes no scaler and no autocast (its
``Accelerator.__init__`` requires a non-CPU device for both), so the run is
float32. :func:`use_grad_scaler` gives it fusetrain's scaler, which works on
the CPU, and float16 autocast with it; on GPUs it replaces torch's scaler
(same state dict; adds ``max_scale``, ``hysteresis``, overflow reports).

The module imports without accelerate; :func:`use_grad_scaler` raises an
ImportError naming the extra to install.
"""

from __future__ import annotations

from typing import Optional

from ..amp import GradScaler
from ._require import require

__all__ = ["use_grad_scaler"]


def use_grad_scaler(target, scaler: Optional[GradScaler] = None) -> GradScaler:
    """Makes ``scaler`` (default: ``fusetrain.amp.GradScaler`` on the
    accelerator's device type) the loss scaler of an fp16 run, with float16
    autocast in the forward; returns it.

    Call it before ``accelerator.prepare(...)`` (for a Trainer: before
    ``trainer.train()``): ``prepare`` wraps the model's forward in autocast
    and hands each optimizer the scaler. ``accelerator.backward``,
    ``clip_grad_norm_`` (which unscales first), the optimizer's ``step``,
    ``save_state`` / ``load_state`` and the Trainer's checkpoints
    (``scaler.pt``) then use it.

    Args:
        target: an ``accelerate.Accelerator`` with ``mixed_precision="fp16"``,
            or a ``transformers.Trainer`` with ``fp16=True`` (its
            ``.accelerator`` is used).
        scaler: the scaler to install; any object with
            ``torch.amp.GradScaler``'s methods.
    """
    accelerate = require("accelerate", "accelerate", "fusetrain.integrations.use_grad_scaler")
    accelerator = getattr(target, "accelerator", target)
    if not isinstance(accelerator, accelerate.Accelerator):
        raise TypeError(
            f"use_grad_scaler expects an accelerate.Accelerator or a transformers.Trainer, got {type(target).__name__}"
        )
    if accelerator.mixed_precision != "fp16":
        raise ValueError(
            f"use_grad_scaler: loss scaling is for fp16; the accelerator's mixed_precision is "
            f"{accelerator.mixed_precision!r} (Accelerator(mixed_precision='fp16'), TrainingArguments(fp16=True))"
        )
    kinds = accelerate.utils.DistributedType
    if accelerator.distributed_type not in (kinds.NO, kinds.MULTI_CPU, kinds.MULTI_GPU):
        raise ValueError(
            f"use_grad_scaler: {accelerator.distributed_type} scales the loss itself; "
            "use it with plain or DDP runs (NO, MULTI_CPU, MULTI_GPU)"
        )
    if accelerator._models or accelerator._optimizers:
        raise RuntimeError(
            "use_grad_scaler must run before accelerator.prepare(...) (for a Trainer: before "
            "trainer.train()): prepared models and optimizers keep the scaler and autocast they got"
        )
    if scaler is None:
        scaler = GradScaler(accelerator.device.type)
    accelerator.scaler = scaler
    accelerator.native_amp = True
    return scaler

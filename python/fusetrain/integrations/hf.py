"""Hugging Face Trainer: fusetrain's FusedAdamW built from TrainingArguments.

The Trainer takes any optimizer; these helpers give FusedAdamW exactly the
settings its default AdamW (``optim="adamw_torch_fused"``) would get:
``learning_rate``, ``adam_beta1`` / ``adam_beta2``, ``adam_epsilon``, and
``weight_decay`` on every parameter except those the Trainer's own
``get_decay_parameter_names`` exempts (biases, LayerNorm and RMSNorm weights,
``*norm*`` names), in the same two parameter groups, so checkpoints move
between the two optimizers and the learning-rate schedule drives both alike.

Clipping: the Trainer clips with ``accelerator.clip_grad_norm_`` whenever
``TrainingArguments.max_grad_norm > 0`` (the default is 1.0), before
``optimizer.step()``; that norm is also the ``grad_norm`` it logs. Leave it
there, or set ``max_grad_norm=0`` in the arguments and pass ``max_grad_norm``
here to fold the clip into the fused step (no separate scaling pass over the
gradients; the Trainer still computes the norm it logs). Asking for both
would clip twice, and is refused.

The module imports without transformers (so does the package); the helpers
that need it raise an ImportError naming the extra to install.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from ..optim import FusedAdamW
from ._require import require

__all__ = ["hf_optimizer", "hf_optimizer_cls_and_kwargs"]


def _check_clipping(args, max_grad_norm: Optional[float]) -> None:
    if max_grad_norm is not None and args.max_grad_norm and args.max_grad_norm > 0:
        raise ValueError(
            f"max_grad_norm={max_grad_norm} folds clipping into the step, but "
            f"TrainingArguments.max_grad_norm={args.max_grad_norm} makes the Trainer clip too: "
            "set TrainingArguments(max_grad_norm=0) to clip once, in the optimizer"
        )


def hf_optimizer_cls_and_kwargs(
    args, *, master_weights: bool = False, max_grad_norm: Optional[float] = None
) -> Tuple[type, Dict[str, Any]]:
    """``(FusedAdamW, kwargs)`` for ``Trainer(optimizer_cls_and_kwargs=...)``.

    Args:
        args: the ``transformers.TrainingArguments`` of the run: its
            ``learning_rate``, ``adam_beta1``, ``adam_beta2`` and
            ``adam_epsilon`` become the kwargs (the Trainer puts
            ``weight_decay`` into its two parameter groups itself).
        master_weights: fp32 master copies for 16-bit parameters (a model
            loaded in bfloat16), see ``fusetrain.optim``.
        max_grad_norm: clip in the fused step; only with
            ``TrainingArguments(max_grad_norm=0)`` (module docstring).
    """
    _check_clipping(args, max_grad_norm)
    kwargs: Dict[str, Any] = dict(
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        master_weights=master_weights,
    )
    if max_grad_norm is not None:
        kwargs["max_grad_norm"] = max_grad_norm
    return FusedAdamW, kwargs


def hf_param_groups(args, model: torch.nn.Module) -> List[Dict[str, Any]]:
    """The Trainer's two parameter groups for ``model``: the trainable
    parameters ``Trainer.get_decay_parameter_names`` names, with
    ``args.weight_decay``, then the other trainable ones with none (both
    groups present even when one is empty, as the Trainer makes them)."""
    transformers = require("transformers", "hf", "fusetrain.integrations.hf_optimizer")
    # The Trainer's own rule, so that it stays the Trainer's in every version;
    # the method reads nothing from the instance.
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]


def hf_optimizer(
    args,
    model: torch.nn.Module,
    *,
    master_weights: bool = False,
    max_grad_norm: Optional[float] = None,
) -> FusedAdamW:
    """A FusedAdamW over ``model`` with the settings the Trainer gives its
    default AdamW, for ``Trainer(model, args, optimizers=(opt, None))``.

    Args:
        args: the run's ``transformers.TrainingArguments`` (learning rate,
            betas, epsilon, weight decay; ``optim`` is not read).
        model: the model the Trainer will train (its trainable parameters
            are split into decay and no-decay groups as the Trainer does).
        master_weights: fp32 master copies for 16-bit parameters.
        max_grad_norm: clip in the fused step; only with
            ``TrainingArguments(max_grad_norm=0)`` (module docstring).
    """
    groups = hf_param_groups(args, model)
    cls, kwargs = hf_optimizer_cls_and_kwargs(args, master_weights=master_weights, max_grad_norm=max_grad_norm)
    return cls(groups, **kwargs)

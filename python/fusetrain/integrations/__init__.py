"""fusetrain inside Hugging Face's Trainer and Accelerate.

Both take fusetrain's optimizers as they are (``FusedAdamW`` sets
``_step_supports_amp_scaling``, so a loss scaler hands it the scale and the
overflow flag on the device); the helpers here only translate their settings:

- :func:`hf_optimizer` (``transformers``): a ``FusedAdamW`` built from
  ``TrainingArguments`` with the Trainer's own weight-decay groups, for
  ``Trainer(optimizers=(hf_optimizer(args, model), None))``.
- :func:`hf_optimizer_cls_and_kwargs` (``transformers``): the same settings
  for ``Trainer(optimizer_cls_and_kwargs=...)``.
- :func:`use_grad_scaler` (``accelerate``): fusetrain's ``GradScaler`` as an
  ``Accelerator``'s (or a Trainer's) loss scaler; with ``fp16`` on the CPU,
  where Accelerate itself trains in float32, it turns on float16 autocast and
  loss scaling.

Importing this package or its modules needs neither library; a helper
called without the library it needs raises a one-line ImportError naming the
extra that installs it (``pip install "fusetrain[hf]"`` or
``"fusetrain[accelerate]"``).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["hf_optimizer", "hf_optimizer_cls_and_kwargs", "use_grad_scaler"]

# Public name -> the submodule defining it (imported on first use).
_HOMES = {
    "hf_optimizer": "hf",
    "hf_optimizer_cls_and_kwargs": "hf",
    "use_grad_scaler": "accelerate",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{home}")
    return getattr(module, name)


def __dir__() -> list:
    return sorted(list(globals()) + list(_HOMES))

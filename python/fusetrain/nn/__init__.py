"""Fused neural-network pieces: ``CrossEntropyLoss`` and, in
``fusetrain.nn.functional``, ``softmax_cross_entropy``."""

from __future__ import annotations

from typing import Optional

import torch

from . import functional
from .functional import softmax_cross_entropy

__all__ = ["CrossEntropyLoss", "functional", "softmax_cross_entropy"]


class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """``torch.nn.CrossEntropyLoss`` computed by the fused
    :func:`fusetrain.nn.functional.softmax_cross_entropy`: same constructor
    arguments, attributes and state dict (it is a subclass), a float32 loss.
    Class ``weight`` is not supported and raises NotImplementedError here
    rather than at the first call."""

    def __init__(
        self,
        weight: Optional[torch.Tensor] = None,
        size_average=None,
        ignore_index: int = -100,
        reduce=None,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
    ) -> None:
        if weight is not None:
            raise NotImplementedError(
                "fusetrain.nn.CrossEntropyLoss: weight (class weights) is not supported; "
                "use torch.nn.CrossEntropyLoss for weighted losses"
            )
        super().__init__(None, size_average, ignore_index, reduce, reduction, label_smoothing)

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return softmax_cross_entropy(
            input,
            target,
            weight=self.weight,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
        )

"""Fused neural-network pieces: ``CrossEntropyLoss``,
``LinearCrossEntropyLoss``, ``BatchNormReLU2d``, ``MaxPool2d`` and, in
``fusetrain.nn.functional``, ``softmax_cross_entropy``,
``linear_cross_entropy``, ``batch_norm_relu`` and ``max_pool2d``."""

from __future__ import annotations

from typing import Optional

import torch

from . import functional
from .functional import (
    LinearCrossEntropyOptions,
    batch_norm_relu,
    linear_cross_entropy,
    max_pool2d,
    softmax_cross_entropy,
)

__all__ = [
    "BatchNormReLU2d",
    "CrossEntropyLoss",
    "LinearCrossEntropyLoss",
    "LinearCrossEntropyOptions",
    "MaxPool2d",
    "batch_norm_relu",
    "functional",
    "linear_cross_entropy",
    "max_pool2d",
    "softmax_cross_entropy",
]


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


class LinearCrossEntropyLoss(torch.nn.Module):
    """torch 2.13's ``torch.nn.LinearCrossEntropyLoss``: a ``Linear(in_features,
    num_classes, bias)`` (``self.linear``) and the cross-entropy of its output,
    computed by :func:`fusetrain.nn.functional.linear_cross_entropy` without
    holding the logits. The class ``weight`` is a buffer (``self.weight``,
    None when not given), as in ``CrossEntropyLoss``; the state-dict keys are
    ``linear.weight``, ``linear.bias`` and ``weight``."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        *,
        bias: bool = False,
        device=None,
        dtype=None,
        reduction: str = "mean",
        weight: Optional[torch.Tensor] = None,
        ignore_index: Optional[int] = None,
        label_smoothing: float = 0.0,
        options: Optional[LinearCrossEntropyOptions] = None,
    ) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(in_features, num_classes, bias=bias, device=device, dtype=dtype)
        self.register_buffer("weight", weight)
        self.reduction = reduction
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.options = options

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(
            input,
            self.linear.weight,
            target,
            linear_bias=self.linear.bias,
            weight=self.weight,
            reduction=self.reduction,
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            options=self.options,
        )

    def extra_repr(self) -> str:
        return (f"in_features={self.linear.in_features}, num_classes={self.linear.out_features}, "
                f"bias={self.linear.bias is not None}, reduction={self.reduction!r}")


class BatchNormReLU2d(torch.nn.BatchNorm2d):
    """``torch.nn.BatchNorm2d`` followed by a ReLU, fused
    (:func:`fusetrain.nn.functional.batch_norm_relu`): the same constructor
    arguments, parameters, buffers and state dict (it is a subclass; a
    checkpoint of the BatchNorm2d it replaces loads), ``num_batches_tracked``
    and ``momentum=None`` handled as torch's module handles them. Replaces
    ``nn.BatchNorm2d(c), nn.ReLU()`` in a model. Being a BatchNorm2d, it is
    what tools that rewrite batch norms by type see, and their rewrite
    drops the ReLU (``SyncBatchNorm.convert_sync_batchnorm``,
    ``torch.ao``'s conv + bn fusion): convert before swapping it in."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        # As torch.nn.modules.batchnorm._BatchNorm.forward.
        if self.momentum is None:
            exponential_average_factor = 0.0
        else:
            exponential_average_factor = self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                exponential_average_factor = 1.0 / float(self.num_batches_tracked)
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        tracked = not self.training or self.track_running_stats
        return batch_norm_relu(
            input,
            self.running_mean if tracked else None,
            self.running_var if tracked else None,
            self.weight,
            self.bias,
            bn_training,
            exponential_average_factor,
            self.eps,
        )


class MaxPool2d(torch.nn.MaxPool2d):
    """``torch.nn.MaxPool2d`` through :func:`fusetrain.nn.functional.max_pool2d`:
    the same constructor arguments and attributes (it is a subclass), the
    same values and gradients bit for bit; one pass each way on the CPU where
    the windows do not overlap (``stride`` None or the kernel size, the
    default) in channels_last inputs, or are 2x2 in NCHW ones; torch's op
    otherwise."""

    def forward(self, input: torch.Tensor):
        return max_pool2d(input, self.kernel_size, self.stride, self.padding, self.dilation,
                          ceil_mode=self.ceil_mode, return_indices=self.return_indices)

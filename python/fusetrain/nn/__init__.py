"""Fused neural-network pieces: ``CrossEntropyLoss``, ``BatchNormReLU2d``,
``MaxPool2d`` and, in ``fusetrain.nn.functional``, ``softmax_cross_entropy``,
``batch_norm_relu`` and ``max_pool2d``."""

from __future__ import annotations

from typing import Optional

import torch

from . import functional
from .functional import batch_norm_relu, max_pool2d, softmax_cross_entropy

__all__ = [
    "BatchNormReLU2d",
    "CrossEntropyLoss",
    "MaxPool2d",
    "batch_norm_relu",
    "functional",
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

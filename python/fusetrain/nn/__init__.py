"""Fused neural-network pieces: ``CrossEntropyLoss``,
``LinearCrossEntropyLoss``, ``BatchNormReLU2d``, ``MaxPool2d``, ``LayerNorm``,
``RMSNorm`` and, in ``fusetrain.nn.functional``, ``softmax_cross_entropy``,
``linear_cross_entropy``, ``batch_norm_relu``, ``max_pool2d``,
``layer_norm``, ``rms_norm``, ``add_layer_norm``, ``add_rms_norm``, ``gelu``,
``swiglu`` and ``apply_rotary``."""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import functional
from ._block_ops import LayerNorm, RMSNorm
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
    "LayerNorm",
    "LinearCrossEntropyOptions",
    "MaxPool2d",
    "RMSNorm",
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

    ``ignore_index`` (default -100), ``reduction`` (``"mean"``, default,
    ``"sum"`` or ``"none"``) and ``label_smoothing`` (in [0, 1], default 0)
    are torch's; ``size_average`` and ``reduce`` are torch's deprecated
    spellings of ``reduction``. Class ``weight`` is not supported and raises
    NotImplementedError here rather than at the first call. Targets are
    class indices (class probabilities raise NotImplementedError at the call).
    """

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
        """The loss of the logits ``input`` for the class indices ``target``
        (shapes as :func:`fusetrain.nn.functional.softmax_cross_entropy`)."""
        return softmax_cross_entropy(
            input,
            target,
            weight=self.weight,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
        )


# On torch 2.13+ a subclass of torch's own module (isinstance checks hold);
# on 2.11 and 2.12 of the same base torch's has.
_LinearCrossEntropyLossBase = getattr(torch.nn, "LinearCrossEntropyLoss", torch.nn.modules.loss._WeightedLoss)


class LinearCrossEntropyLoss(_LinearCrossEntropyLossBase):
    """torch's ``torch.nn.LinearCrossEntropyLoss`` (2.13+), computed by
    :func:`fusetrain.nn.functional.linear_cross_entropy`: the same
    constructor, attributes (``num_classes``, ``out_features``,
    ``reduction``, ``ignore_index``, ``label_smoothing``, ``options``),
    parameters and buffers (``linear.weight`` [C * prod(out_features),
    in_features], ``linear.bias`` when ``bias``, the class ``weight``
    buffer), state dict and repr; a subclass of torch's where torch has it.

    ``in_features`` the input's size; ``num_classes`` C; ``out_features``
    (d1, ..., dK) of a K-dimensional loss (default ``()``); ``bias``
    (default False), ``device``, ``dtype`` the linear's; ``weight`` class
    weights of shape (C,) and ``label_smoothing`` in [0, 1], both checked
    here (RuntimeError, as torch); ``reduction``, ``ignore_index`` (None:
    -100) and ``options`` (None: fusetrain's chunked path; a
    :class:`~fusetrain.nn.functional.LinearCrossEntropyOptions`: torch's
    chunked-path semantics) as the functional takes them."""

    __constants__ = ["num_classes", "out_features", "reduction", "ignore_index", "label_smoothing"]

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        *,
        out_features: tuple = (),
        bias: bool = False,
        device=None,
        dtype=None,
        reduction: str = "mean",
        weight: Optional[torch.Tensor] = None,
        ignore_index: Optional[int] = None,
        label_smoothing: float = 0.0,
        options: Optional[LinearCrossEntropyOptions] = None,
    ) -> None:
        # torch's checks and words.
        if weight is not None and weight.shape != (num_classes,):
            raise RuntimeError(f"expected weight shape to be {(num_classes,)}, got {tuple(weight.shape)}")
        if label_smoothing < 0 or label_smoothing > 1.0:
            raise RuntimeError(f"expected label_smoothing to be in range [0, 1], got {label_smoothing}")
        torch.nn.modules.loss._WeightedLoss.__init__(self, weight=weight, size_average=None, reduce=None,
                                                     reduction=reduction)
        self.num_classes = num_classes
        self.out_features = out_features
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        # Linear has 2-D weights: K-dimensional ones are stored flat and
        # reshaped in forward, as torch's.
        self.linear = torch.nn.Linear(in_features, math.prod(out_features, start=num_classes), bias=bias,
                                      device=device, dtype=dtype)
        self.options = options

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss of ``self.linear(input)`` (``input`` [in_features] or
        [N, in_features]) for ``target``, without holding the logits."""
        linear_weight = self.linear.weight.reshape((self.num_classes, *self.out_features,
                                                    self.linear.in_features))
        linear_bias = (None if self.linear.bias is None
                       else self.linear.bias.reshape((self.num_classes, *self.out_features)))
        return linear_cross_entropy(
            input,
            linear_weight,
            target,
            linear_bias=linear_bias,
            weight=self.weight,
            reduction=self.reduction,
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            options=self.options,
        )

    def extra_repr(self) -> str:
        """torch's: the sizes and every loss argument."""
        return (
            f"in_features={self.linear.in_features},"
            f" num_classes={self.num_classes},"
            f" out_features={self.out_features},"
            f" bias={self.linear.bias is not None},"
            f" reduction={self.reduction},"
            f" ignore_index={self.ignore_index},"
            f" label_smoothing={self.label_smoothing},"
            f" options={self.options}"
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
    ``torch.ao``'s conv + bn fusion): convert before swapping it in.

    ``BatchNormReLU2d(num_features, eps=1e-5, momentum=0.1, affine=True,
    track_running_stats=True, device=None, dtype=None)``, torch's arguments:
    ``num_features`` channels, ``eps`` added to the variance, ``momentum`` of
    the running statistics (None: a cumulative average), ``affine`` learnable
    weight and bias, ``track_running_stats`` keeps running statistics (and
    uses them in evaluation), ``device`` and ``dtype`` those of the
    parameters and buffers."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``relu(batch_norm(input))`` of a 4-D ``input`` [N, C, H, W], the
        running statistics updated in training as ``nn.BatchNorm2d`` updates
        them."""
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
    otherwise.

    ``MaxPool2d(kernel_size, stride=None, padding=0, dilation=1,
    return_indices=False, ceil_mode=False)``, torch's arguments:
    ``kernel_size`` the window, ``stride`` its step (None: the kernel size),
    ``padding`` implicit -inf padding on each side, ``dilation`` the spacing
    of a window's elements, ``return_indices`` also returns the indices of
    the maxima, ``ceil_mode`` rounds the output size up. The fused path takes
    no padding, dilation 1, no indices and floor mode
    (:func:`fusetrain.nn.functional.max_pool2d`)."""

    def forward(self, input: torch.Tensor):
        """The pooled ``input`` (and the indices with ``return_indices``)."""
        return max_pool2d(input, self.kernel_size, self.stride, self.padding, self.dilation,
                          ceil_mode=self.ceil_mode, return_indices=self.return_indices)

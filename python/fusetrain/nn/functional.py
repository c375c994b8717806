"""Fused losses and layers: ``softmax_cross_entropy``, a drop-in for
``F.cross_entropy`` with class-index targets; ``batch_norm_relu``,
``F.batch_norm`` followed by a ReLU in one op each way on the CPU; and
``max_pool2d``, ``F.max_pool2d`` with one pass each way on the CPU where the
windows do not overlap.

One pass over the logits forward (online log-sum-exp in fp32) and one
backward (the softmax recomputed from the logits and the saved per-row
log-sum-exp), for float32, float16 and bfloat16 logits on CPU and CUDA,
without an fp32 copy of the [N, C] logits. The loss is float32 whatever the
logits' dtype; the gradient has the logits' dtype. What it does not support
(class weights, probability targets, float64) raises NotImplementedError
rather than computing something else.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Optional

import torch
from torch.autograd.function import once_differentiable
from torch.nn import _reduction

from .. import _C  # noqa: F401  (registers the fusetrain ops)
from .. import _dtensor
from ._block_ops import add_layer_norm, add_rms_norm, apply_rotary, gelu, layer_norm, rms_norm, swiglu

__all__ = [
    "softmax_cross_entropy",
    "cross_entropy",
    "linear_cross_entropy",
    "LinearCrossEntropyOptions",
    "batch_norm_relu",
    "max_pool2d",
    "layer_norm",
    "rms_norm",
    "add_layer_norm",
    "add_rms_norm",
    "gelu",
    "swiglu",
    "apply_rotary",
]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


_FORWARD = torch.ops.fusetrain.softmax_cross_entropy_forward.default
_BACKWARD = torch.ops.fusetrain.softmax_cross_entropy_backward.default


class _SoftmaxCrossEntropy(torch.autograd.Function):
    """[N, C] logits, int64 [N] targets -> loss; saves the logits, targets
    and the per-row log-sum-exp for the backward op.

    The classic form (forward takes ctx): torch 2.11's Function.apply binds
    the arguments of a forward with a separate setup_context through
    inspect.signature on every call, about 75 us on a small CPU, more than
    the whole op on a small batch."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, label_smoothing, reduction):
        loss, lse, kept_rows = _FORWARD(logits, target, ignore_index, label_smoothing, reduction)
        ctx.mark_non_differentiable(lse)
        # kept_rows: the count "mean" divides by, so the backward does not count again.
        ctx.save_for_backward(logits, target, lse, kept_rows)
        ctx.ignore_index = ignore_index
        ctx.label_smoothing = label_smoothing
        ctx.reduction = reduction
        return loss, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, grad_lse):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        logits, target, lse, kept_rows = ctx.saved_tensors
        grad = _BACKWARD(grad_loss.float(), logits, target, lse, ctx.ignore_index, ctx.label_smoothing,
                         ctx.reduction, kept_rows)
        return grad, None, None, None, None


def softmax_cross_entropy(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    size_average: Optional[bool] = None,
    ignore_index: int = -100,
    reduce: Optional[bool] = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """``F.cross_entropy(input, target, ...)`` with class-index targets, fused.

    ``input``: logits of shape [N, C], [C] (unbatched, ``target`` 0-d) or
    [N, C, d1, ...] (``target`` [N, d1, ...]), float32, float16 or bfloat16.
    ``target``: class indices (any integer dtype), or ``ignore_index``.
    ``reduction``: "mean" averages over the targets not ignored (NaN when all
    are, as torch), "sum", or "none" (a loss per target, 0 where ignored).
    ``label_smoothing`` in [0, 1], torch's formula. ``size_average`` and
    ``reduce`` are torch's deprecated spellings of ``reduction``.

    Returns a float32 loss (torch returns the input's dtype). Unsupported:
    ``weight`` and class-probability (floating-point) targets raise
    NotImplementedError. An out-of-range target raises IndexError on CPU and
    a device-side assert on CUDA.
    """
    if weight is not None:
        raise NotImplementedError(
            "softmax_cross_entropy: weight (class weights) is not supported; "
            "use torch.nn.functional.cross_entropy for weighted losses"
        )
    if target.is_floating_point() or target.is_complex():
        raise NotImplementedError(
            "softmax_cross_entropy: target must hold class indices; class-probability "
            f"(floating point) targets are not supported, got target of dtype {target.dtype}"
        )
    if target.dtype == torch.bool:
        raise TypeError("softmax_cross_entropy: target must hold integer class indices, got bool")
    if input.dtype not in _SUPPORTED_DTYPES:
        raise NotImplementedError(
            "softmax_cross_entropy: input must be float32, float16 or bfloat16, "
            f"got {input.dtype}"
        )
    if size_average is not None or reduce is not None:
        reduction = _reduction.legacy_get_string(size_average, reduce)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f'softmax_cross_entropy: reduction must be "mean", "sum" or "none", got "{reduction}"')
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"softmax_cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    if _dtensor.any_dtensor((input, target)):
        dims = input.dim()

        def target_dim(d):  # the classes are dimension 1 (0 when unbatched)
            return None if dims < 2 or d == 1 else (0 if d == 0 else d - 1)

        return _sharded_loss(
            "softmax_cross_entropy", input, target, reduction, ignore_index, None, target_dim,
            lambda x, t, r, _: softmax_cross_entropy(x, t, ignore_index=ignore_index, reduction=r,
                                                     label_smoothing=label_smoothing),
        )

    target = target.long()
    if input.dim() == 1:
        if target.dim() != 0:
            raise ValueError(
                "softmax_cross_entropy: unbatched input of shape [C] needs a 0-d target, "
                f"got target of shape {tuple(target.shape)}"
            )
        loss = _apply(input.unsqueeze(0), target.unsqueeze(0), ignore_index, label_smoothing, reduction)
        return loss.squeeze(0) if reduction == "none" else loss
    if input.dim() == 2:
        return _apply(input, target, ignore_index, label_smoothing, reduction)
    if input.dim() == 0:
        raise ValueError("softmax_cross_entropy: input must have a class dimension, got a 0-d tensor")
    # [N, C, d1, ...]: the classes move last so that every (n, d...) is a row.
    expected = (input.shape[0],) + tuple(input.shape[2:])
    if tuple(target.shape) != expected:
        raise ValueError(
            f"softmax_cross_entropy: for input of shape {tuple(input.shape)} the target must have "
            f"shape {expected}, got {tuple(target.shape)}"
        )
    rows = input.movedim(1, -1).reshape(-1, input.shape[1])
    loss = _apply(rows, target.reshape(-1), ignore_index, label_smoothing, reduction)
    return loss.reshape(target.shape) if reduction == "none" else loss


def _apply(logits, target, ignore_index, label_smoothing, reduction):
    if torch.compiler.is_compiling():
        # Dynamo traces the Python Function (into the two ops); the C++ one
        # is opaque to it.
        loss, _ = _SoftmaxCrossEntropy.apply(logits, target, int(ignore_index), float(label_smoothing),
                                             reduction)
        return loss
    # Eager: the C++ autograd Function (fusetrain::nn::softmax_cross_entropy),
    # the same two ops without Python in the backward: 64 x 512 fp32 logits
    # fwd+bwd took 155 us through _SoftmaxCrossEntropy, of which the ops are 54.
    return _C.softmax_cross_entropy(logits, target, int(ignore_index), float(label_smoothing), reduction)


def _sharded_loss(name, input, target, reduction, ignore_index, class_weight, target_dim, compute):
    """A loss of DTensor ``input`` (logits, or the linear's input) replicated or
    sharded on its rows, computed on the local shards: ``compute(local input,
    local target, reduction, grad_placements)`` is the loss on plain tensors
    (``grad_placements``: those of the gradient of a replicated weight used
    with these rows). ``target_dim(d)``: the target's dimension for input
    dimension d, None where d is not a row dimension (the classes, the
    features). Replicated rows give the loss replicated; rows sharded over
    some mesh dimensions give "none" sharded as the target, "sum" as a Partial
    (sum) DTensor, and "mean" as a Partial (sum) DTensor of each rank's sum
    over the count of targets not ignored on all ranks (class weights
    included), the exact mean (torch's Partial "avg" averages each rank's
    mean). ``full_tensor()`` gives the value; ``backward()`` works on it."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    if not _dtensor.is_dtensor(input):
        raise ValueError(
            f"{name}: the target or a weight is a DTensor but the input is a plain tensor; pass the input "
            "as a DTensor (replicated or sharded on its rows), or call the loss where the weights are plain "
            "tensors (inside the forward of the module that FSDP2 unshards them for)"
        )
    mesh = input.device_mesh
    target_placements, sharded = [], []
    for i, placement in enumerate(input.placements):
        if placement.is_partial():
            raise ValueError(f"{name}: the input is a Partial DTensor (mesh dimension {i}); reduce it first")
        if placement.is_shard():
            d = placement.dim if placement.dim >= 0 else placement.dim + input.dim()
            td = target_dim(d)
            if td is None:
                raise NotImplementedError(
                    f"{name}: the input is sharded on dimension {d} (mesh dimension {i}), which is not a "
                    "batch dimension; shard it on its rows or replicate it (logits sharded on the classes "
                    "are torch.distributed.tensor.parallel.loss_parallel's case)"
                )
            target_placements.append(Shard(td))
            sharded.append(i)
        else:
            target_placements.append(Replicate())
    if _dtensor.is_dtensor(target):
        if target.device_mesh != mesh or tuple(target.placements) != tuple(target_placements):
            raise ValueError(
                f"{name}: the target has placements {tuple(target.placements)} on {target.device_mesh}; "
                f"for this input it needs {tuple(target_placements)} on {mesh}"
            )
        local_target = target.to_local()
    elif sharded:
        raise ValueError(
            f"{name}: the input is sharded on its rows but the target is a plain tensor; pass the target "
            f"as a DTensor with placements {tuple(target_placements)}"
        )
    else:
        local_target = target
    grad_placements = [Partial() if i in sharded else Replicate() for i in range(mesh.ndim)]
    local_input = input.to_local()
    if not sharded:
        loss = compute(local_input, local_target, reduction, grad_placements)
        return DTensor.from_local(loss, mesh, [Replicate()] * mesh.ndim, run_check=False)
    if reduction == "none":
        loss = compute(local_input, local_target, "none", grad_placements)
        return DTensor.from_local(loss, mesh, target_placements, run_check=False,
                                  shape=target.shape, stride=target.stride())
    loss = compute(local_input, local_target, "sum", grad_placements)
    if reduction == "mean":
        kept = local_target != ignore_index
        if class_weight is None:
            denominator = kept.sum().to(torch.float32)
        else:
            safe = torch.where(kept, local_target, 0).long()
            denominator = (class_weight.float()[safe] * kept).sum()
        groups = [mesh.get_group(i) for i in sharded]
        _dtensor.all_reduce_(denominator, groups, "sum")
        loss = (loss.float() / denominator).to(loss.dtype)
    return DTensor.from_local(loss, mesh, [Partial("sum") if i in sharded else Replicate()
                                           for i in range(mesh.ndim)], run_check=False)


# F.cross_entropy's name, for ``import fusetrain.nn.functional as F``.
cross_entropy = softmax_cross_entropy


# ------------------------------------------------- linear + cross-entropy


def _torch_acc_policies() -> tuple:
    """The acc_policy values the environment's torch accepts (2.13 also had
    "balanced"; 2.14 dropped it); torch 2.15's where torch has none."""
    torch_options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if torch_options is None:
        return ("auto", "accurate", "compact")
    try:
        torch_options(acc_policy="balanced")
    except ValueError:
        return ("auto", "accurate", "compact")
    return ("auto", "accurate", "balanced", "compact")


_VALID_ACC_POLICIES = _torch_acc_policies()
_ACC_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclasses.dataclass(slots=True, frozen=True)
class LinearCrossEntropyOptions:
    """How :func:`linear_cross_entropy` computes: torch's
    ``torch.nn.LinearCrossEntropyOptions``, field for field (a torch instance
    is accepted too), and one field of ours. Passing it asks for torch's
    chunked-path semantics; ``options=None`` is fusetrain's chunked path
    (torch's default is its reference, see :func:`linear_cross_entropy`).

    ``allow_retain_graph``: a second ``backward()`` through a "mean" or "sum"
    loss keeps working (the gradients computed in the forward are kept, one
    more gradient-sized allocation a call); False: it raises, as torch's.
    ``batch_chunk_size``: rows per chunk (None: ``chunking_method``'s, or
    one chunk when that is None too).
    ``chunking_method``: ``"auto"`` (fusetrain's rule, chosen by
    measurement: a chunk's logits and their gradient about the memory of the
    input, at least 64 MiB and 512 rows, 2048 on CUDA; an explicit
    ``batch_chunk_size`` wins), ``"aspect_ratio"`` / ``"aspect_ratio:N"``
    (torch's: chunks whose logits match the input in memory, divided by N)
    or None (``batch_chunk_size`` alone). Given both and they disagree:
    ValueError at the call, as torch.
    ``acc_policy``: ``"auto"`` (``"accurate"`` for float16/bfloat16 on the
    CPU, ``"compact"`` elsewhere), ``"accurate"`` (16-bit inputs computed in
    float32: logits, their gradient and the GEMMs) or ``"compact"`` (in the
    inputs' dtype, as eager PyTorch; the weight gradient summed in float32
    either way).
    ``acc_dtype``: None (float32 for 16-bit inputs under ``"auto"``, else the
    input's dtype), float32 for 16-bit inputs, or the input's own dtype
    (computed as ``"compact"``).
    ``gradients_in_forward`` (ours): for "mean" and "sum" losses that need
    gradients, compute them in the forward pass (three GEMMs a chunk, the
    gradients held until the backward) rather than recomputing each chunk's
    logits in the backward (four GEMMs)."""

    allow_retain_graph: bool = False
    batch_chunk_size: Optional[int] = None
    chunking_method: Optional[str] = "auto"
    acc_policy: str = "auto"
    acc_dtype: Optional[torch.dtype] = None
    gradients_in_forward: bool = True

    def __post_init__(self) -> None:
        # torch's checks and words.
        if self.acc_policy not in _VALID_ACC_POLICIES:
            raise ValueError(
                f"invalid acc_policy: {self.acc_policy!r}; expected one of "
                f"{', '.join(map(repr, _VALID_ACC_POLICIES))}"
            )
        if self.chunking_method is not None and self.chunking_method != "auto":
            name, sep, factor = str(self.chunking_method).partition(":")
            if not sep:
                factor = "1"
            if not (name == "aspect_ratio" and factor.isdigit() and int(factor) > 0):
                raise ValueError(f"invalid chunking_method: {self.chunking_method!r}")
        if not (self.batch_chunk_size is None
                or (isinstance(self.batch_chunk_size, int) and self.batch_chunk_size > 0)):
            raise ValueError(f"batch_chunk_size must be positive int or None, got {self.batch_chunk_size!r}")
        if self.acc_dtype is not None and self.acc_dtype not in _ACC_DTYPES:
            raise ValueError(
                f"acc_dtype must be one of {{None, torch.float16, torch.bfloat16, "
                f"torch.float32, torch.float64}}, got {self.acc_dtype!r}. Pass "
                "acc_dtype=None to let the op pick automatically."
            )

    def _plan(self, num_batches: int, in_features: int, num_classes: int, dtype: torch.dtype,
              device_type: str) -> tuple:
        """(rows per chunk, 0 for fusetrain's rule; whether 16-bit inputs
        compute in float32) for one call: torch's ``_adjust``, with "auto"
        chunking fusetrain's rule (fusetrain::nn's resolve, the C++ face's)."""
        sixteen = dtype in (torch.float16, torch.bfloat16)
        policy = self.acc_policy
        if policy == "auto":
            policy = "accurate" if device_type == "cpu" and sixteen else "compact"
        if self.acc_dtype is not None:
            acc = self.acc_dtype
        elif self.acc_policy == "auto" and sixteen and device_type in ("cpu", "cuda"):
            acc = torch.float32
        else:
            acc = dtype
        if acc != dtype and not (sixteen and acc == torch.float32):
            raise RuntimeError(
                "linear_cross_entropy supports float32 acc_dtype with float16/bfloat16 inputs, "
                f"but got {acc} acc_dtype and {dtype} inputs."
            )
        accurate = sixteen and acc == torch.float32 and policy in ("accurate", "balanced")
        method = self.chunking_method
        if method == "auto":
            chunk = 0 if self.batch_chunk_size is None else max(1, min(self.batch_chunk_size, num_batches))
        elif method is not None:
            factor = int(method.split(":", 1)[1]) if ":" in method else 1
            ratio = -(-num_classes // max(in_features, 1))
            target = -(-num_batches // max(ratio, 1))
            chunk = min((1 << (target - 1).bit_length()) // factor, num_batches)
            if self.batch_chunk_size is not None and self.batch_chunk_size != chunk:
                raise ValueError(
                    f"batch_chunk_size (={self.batch_chunk_size}) and chunking_method ('{method}') give "
                    f"different chunk sizes ({self.batch_chunk_size} vs {chunk}); pass only one."
                )
            chunk = max(1, chunk)
        else:
            chunk = max(1, num_batches if self.batch_chunk_size is None
                        else min(self.batch_chunk_size, num_batches))
        return chunk, accurate


def _our_options(options) -> LinearCrossEntropyOptions:
    """``options`` as ours: a torch ``LinearCrossEntropyOptions`` (or any
    object with its fields) converted field by field."""
    if isinstance(options, LinearCrossEntropyOptions):
        return options
    fields = ("allow_retain_graph", "batch_chunk_size", "chunking_method", "acc_policy", "acc_dtype",
              "gradients_in_forward")
    if not all(hasattr(options, f) for f in fields[:5]):
        raise TypeError(
            "linear_cross_entropy: options must be a LinearCrossEntropyOptions (fusetrain's or torch's) "
            f"or None, got {type(options).__name__}"
        )
    return LinearCrossEntropyOptions(**{f: getattr(options, f) for f in fields if hasattr(options, f)})


_LCE_FORWARD = torch.ops.fusetrain.linear_cross_entropy_forward.default
_LCE_BACKWARD = torch.ops.fusetrain.linear_cross_entropy_backward.default


def _lce_chunk_rows(rows: int, in_features: int, classes: int, dtype: torch.dtype, device_type: str) -> int:
    """fusetrain::ops::linear_cross_entropy_chunk_rows in Python (dynamo
    traces it; a test checks that both agree)."""
    element = torch.empty((), dtype=dtype).element_size()
    budget = max(rows * in_features * element, 64 << 20)
    chunk = budget // max(2 * classes * element, 1)
    chunk = max(64, chunk // 64 * 64)
    # The GEMMs' share of a chunk (Note [Chunked linear cross-entropy]).
    chunk = max(chunk, 2048 if device_type == "cuda" else 512)
    return max(1, min(chunk, rows))


class _LinearCrossEntropy(torch.autograd.Function):
    """The two chunked ops as one autograd node (what dynamo traces; eager
    calls take the C++ twin, fusetrain::nn::linear_cross_entropy_chunked).
    The gradients computed in the forward are kept for every backward (under
    torch.compile torch's own forces allow_retain_graph too)."""

    @staticmethod
    def forward(ctx, input, linear_weight, linear_bias, target, weight, ignore_index, label_smoothing,
                reduction, chunk_rows, accurate, grad_mask):
        loss, lse, denominator, gi, gw, gb, grad_scale = _LCE_FORWARD(
            input, linear_weight, linear_bias, target, weight, ignore_index, label_smoothing, reduction,
            chunk_rows, grad_mask, accurate,
        )
        ctx.held = any(grad_mask)
        ctx.has_bias = linear_bias is not None
        ctx.dtype = input.dtype
        if ctx.held:
            # The gradients for a loss gradient of 1 / grad_scale: the backward rescales them.
            ctx.save_for_backward(gi, gw, gb, grad_scale)
        else:
            ctx.save_for_backward(input, linear_weight, linear_bias, target, weight, lse, denominator)
            ctx.args = (ignore_index, label_smoothing, reduction, chunk_rows, accurate)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        need = ctx.needs_input_grad
        if ctx.held:
            gi, gw, gb, grad_scale = ctx.saved_tensors
            g = grad_loss.reshape(()).to(grad_scale.dtype) * grad_scale
            return (((gi * g).to(ctx.dtype) if need[0] else None),
                    ((gw * g).to(ctx.dtype) if need[1] else None),
                    ((gb * g).to(ctx.dtype) if need[2] and ctx.has_bias else None)) + (None,) * 8
        input, linear_weight, linear_bias, target, weight, lse, denominator = ctx.saved_tensors
        ignore_index, label_smoothing, reduction, chunk_rows, accurate = ctx.args
        mask = [need[0], need[1], need[2] and ctx.has_bias]
        gi, gw, gb = _LCE_BACKWARD(grad_loss, input, linear_weight, linear_bias, target, weight, lse,
                                   denominator, ignore_index, label_smoothing, reduction, chunk_rows, mask,
                                   accurate)
        return (gi if mask[0] else None, gw if mask[1] else None, gb if mask[2] else None) + (None,) * 8


def _shape(shape) -> tuple:
    return tuple(int(s) for s in shape)


# The C++ names torch's GEMM dtype check prints.
_GEMM_DTYPE_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
                     torch.bfloat16: "c10::BFloat16"}


def linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: Optional[torch.Tensor] = None,
    weight: Optional[torch.Tensor] = None,
    reduction: str = "mean",
    ignore_index: Optional[int] = None,
    label_smoothing: float = 0.0,
    options: Optional[LinearCrossEntropyOptions] = None,
) -> torch.Tensor:
    """``torch.nn.functional.linear_cross_entropy`` (torch 2.13+), on every
    torch fusetrain supports: ``F.cross_entropy(F.linear(input,
    linear_weight, linear_bias), target, ...)`` without holding the logits.

    The same arguments, defaults, shapes and errors as torch's: ``input``
    [in_features] or [N, in_features]; ``linear_weight`` [C, in_features] or
    [C, d1, ..., dK, in_features] (K-dimensional loss, targets [N, d1, ...]);
    ``linear_bias`` of its leading shape; ``target`` class indices (int64 or
    uint8) or class probabilities of the logits' shape; ``weight`` class
    weights [C]; ``reduction`` "mean", "sum" or "none"; ``ignore_index``
    None means -100 (and must stay None with probabilities);
    ``label_smoothing`` in [0, 1]. float32, float64, float16 and bfloat16;
    under autocast the linear runs in its dtype, as ``F.linear`` would, and
    the loss is float32 (torch's chunked path ignores autocast). The loss has
    the input's dtype otherwise.

    ``options``: a :class:`LinearCrossEntropyOptions` (or torch's) asks for
    torch's chunked-path semantics (its ``acc_policy``, chunking and
    ``allow_retain_graph``). ``options=None`` differs from torch on purpose:
    where torch then computes the reference (every logit held), fusetrain
    takes its chunked path too, at eager PyTorch's precision (16-bit GEMMs
    for 16-bit inputs; float16 on the CPU in float32), with the reference's
    autograd: ``retain_graph=True`` and double backward work (a second
    backward recomputes; ``create_graph=True`` builds the reference's
    graph). Class probabilities and K-dimensional weights take the reference
    (with a warning when ``options`` was given). Rows go in chunks (Note
    [Chunked linear cross-entropy] in ``csrc/ops/linear_cross_entropy.cpp``):
    one GEMM each for the logits, the fused cross-entropy in fp32, the
    gradients summed in fp32, only those that are needed.
    """
    if _dtensor.any_dtensor((input, target, linear_weight, linear_bias, weight)):
        if _dtensor.is_dtensor(weight):
            weight = weight.full_tensor()  # (class weights: [classes], not trained)
        ignore = -100 if ignore_index is None else int(ignore_index)
        return _sharded_loss(
            "linear_cross_entropy", input, target, reduction, ignore, weight,
            lambda d: d if d < input.dim() - 1 else None,
            lambda x, t, r, grad_placements: _local_rows_loss(
                x, _replicated_local(linear_weight, input, grad_placements), t,
                linear_bias=_replicated_local(linear_bias, input, grad_placements), weight=weight,
                reduction=r, ignore_index=ignore_index, label_smoothing=label_smoothing, options=options),
        )
    # torch's checks, in its order and words.
    if input.dim() < 1 or input.dim() > 2:
        raise RuntimeError(f"expected input with dimensionality 1 or 2, got {input.dim()}")
    if linear_weight.dim() < 2:
        raise RuntimeError(f"expected linear_weight with dimensionality at least 2, got {linear_weight.dim()}")
    in_features = input.shape[-1]
    if in_features != linear_weight.shape[-1]:
        raise RuntimeError(
            "expected equal input and linear_weight last dimensions (in_features), "
            f"got {input.shape[-1]} and {linear_weight.shape[-1]}, respectively"
        )
    num_classes = linear_weight.shape[0]
    out_features = _shape(linear_weight.shape[1:-1])
    if linear_bias is not None and _shape(linear_bias.shape) != (num_classes, *out_features):
        raise RuntimeError(
            f"expected linear_bias shape {(num_classes, *out_features)}, got {_shape(linear_bias.shape)}"
        )
    if out_features and input.dim() == 1:
        raise RuntimeError(
            f"K-dimensional loss defined by linear_weight shape {_shape(linear_weight.shape)} requires"
            f" batched input, (N, {in_features}), got unbatched input with shape {_shape(input.shape)}"
        )
    logits_shape = (*_shape(input.shape[:-1]), num_classes, *out_features)
    probabilities = _shape(target.shape) == logits_shape
    if probabilities and ignore_index is not None:
        raise RuntimeError("ignore_index cannot be specified when target contains probabilities")
    ignore_index = -100 if ignore_index is None else int(ignore_index)
    if options is not None:
        options = _our_options(options)
    chunkable = not probabilities and not out_features and not torch.jit.is_tracing()
    # What the chunked path does not take, torch's reference computes or
    # refuses in its own words: a target not of the rows' shape, a negative
    # label_smoothing, a bias or class weights of another kind.
    rows_shape = _shape(input.shape[:-1])
    unusual = (_shape(target.shape) != rows_shape or label_smoothing < 0
               or (weight is not None and not weight.is_floating_point())
               or (linear_bias is not None and linear_bias.dtype != linear_weight.dtype)
               # (torch's reference refuses class weights of another dtype
               # than the logits; under autocast its cross_entropy casts them)
               or (options is None and weight is not None and weight.dtype != input.dtype
                   and not (input.device.type != "meta" and torch.is_autocast_enabled(input.device.type))))
    if not chunkable:
        if options is not None:
            warnings.warn(
                "linear_cross_entropy: ``options`` ignored; the chunked path needs class-index targets, "
                f"out_features == () and no tracing. Got out_features={out_features}, a probability "
                f"target: {probabilities}, tracing={torch.jit.is_tracing()}. The reference computes it, "
                "holding the logits.",
                stacklevel=2,
            )
        return _reference_linear_cross_entropy(input, linear_weight, target, linear_bias, weight, reduction,
                                               ignore_index, label_smoothing, logits_shape)
    if unusual and target.dtype in (torch.int64, torch.uint8):
        return _reference_linear_cross_entropy(input, linear_weight, target, linear_bias, weight, reduction,
                                               ignore_index, label_smoothing, logits_shape)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"{reduction} is not a valid value for reduction")
    if not 0.0 <= label_smoothing <= 1.0:
        raise RuntimeError(f"label_smoothing must be between 0.0 and 1.0. Got: {label_smoothing:g}")
    if target.dtype not in (torch.int64, torch.uint8):
        name = str(target.dtype).removeprefix("torch.")
        names = {"float32": "Float", "float64": "Double", "float16": "Half", "bfloat16": "BFloat16",
                 "int32": "Int", "int16": "Short", "int8": "Char", "bool": "Bool"}
        raise RuntimeError(f"expected target dtype to be Long or Byte, but got {names.get(name, name)}")
    if input.dim() == 2 and (target.dim() != 1 or target.shape[0] != input.shape[0]):
        raise ValueError(
            f"Expected input batch_size ({input.shape[0]}) to match target batch_size "
            f"({target.shape[0] if target.dim() else 0})."
        )
    if input.dim() == 1 and target.dim() != 0:
        raise RuntimeError("0D or 1D target tensor expected, multi-target not supported")
    if weight is not None and (weight.dim() != 1 or weight.numel() != num_classes):
        raise RuntimeError(
            f"weight tensor should be defined either for all {num_classes} classes or no classes but got "
            f"weight tensor of shape: {list(weight.shape)}"
        )
    x, w, b = input, linear_weight, linear_bias
    device_type = input.device.type
    # (Meta tensors have no autocast state to ask about.)
    autocast = device_type != "meta" and torch.is_autocast_enabled(device_type)
    if autocast:
        dtype = torch.get_autocast_dtype(device_type)
        x, w = x.to(dtype), w.to(dtype)
        b = None if b is None else b.to(dtype)
    if x.dtype != w.dtype:
        raise RuntimeError(
            "expected m1 and m2 to have the same dtype, but got: "
            f"{_GEMM_DTYPE_NAMES.get(x.dtype, x.dtype)} != {_GEMM_DTYPE_NAMES.get(w.dtype, w.dtype)}"
        )
    if x.dtype not in _GEMM_DTYPE_NAMES:
        raise RuntimeError(f"linear_cross_entropy: input must be float32, float64, float16 or bfloat16, got {x.dtype}")
    rows = x.unsqueeze(0) if x.dim() == 1 else x
    if options is None:
        chunk, accurate = 0, x.dtype == torch.float16 and device_type == "cpu"
        allow_retain_graph, reference_autograd, in_forward = False, True, True
    else:
        chunk, accurate = options._plan(rows.shape[0], in_features, num_classes, x.dtype, device_type)
        allow_retain_graph, reference_autograd = options.allow_retain_graph, False
        in_forward = options.gradients_in_forward
    flat_target = target.reshape(-1).long()
    if not torch.compiler.is_compiling():
        loss = _C.linear_cross_entropy(rows, w, flat_target, b, weight, reduction, ignore_index,
                                       float(label_smoothing), int(chunk), bool(accurate),
                                       bool(allow_retain_graph), bool(reference_autograd), bool(in_forward))
    else:
        # Dynamo traces this path into the two ops (the C++ Function is opaque to it).
        if chunk <= 0:
            compute = torch.float32 if accurate else x.dtype
            chunk = _lce_chunk_rows(rows.shape[0], in_features, num_classes, compute, device_type)
        grad = in_forward and reduction != "none" and torch.is_grad_enabled()
        mask = [grad and x.requires_grad, grad and w.requires_grad, grad and b is not None and b.requires_grad]
        loss = _LinearCrossEntropy.apply(rows, w, b, flat_target, weight, ignore_index, float(label_smoothing),
                                         reduction, int(chunk), bool(accurate), mask)
    if reduction == "none":
        loss = loss.reshape(target.shape)
    return loss.to(torch.float32 if autocast else x.dtype)


def _local_rows_loss(x, linear_weight, target, *, reduction, **kw):
    """A DTensor's local rows: [..., in_features] flattened to the [N,
    in_features] torch's function takes (a DTensor input may keep its batch
    and sequence dimensions, sharded on either)."""
    if x.dim() <= 2:
        return linear_cross_entropy(x, linear_weight, target, reduction=reduction, **kw)
    loss = linear_cross_entropy(x.reshape(-1, x.shape[-1]), linear_weight, target.reshape(-1),
                                reduction=reduction, **kw)
    return loss.reshape(target.shape) if reduction == "none" else loss


def _reference_linear_cross_entropy(input, linear_weight, target, linear_bias, weight, reduction,
                                    ignore_index, label_smoothing, logits_shape):
    """torch's reference: F.cross_entropy of every logit, the K dimensions
    of a K-dimensional weight after the classes."""
    in_features = input.shape[-1]
    flat = math.prod(logits_shape[input.dim() - 1:])
    w = linear_weight.reshape(flat, in_features)
    b = None if linear_bias is None else linear_bias.reshape(flat)
    logits = torch.nn.functional.linear(input, w, b).reshape(logits_shape)
    return torch.nn.functional.cross_entropy(logits, target, weight=weight, reduction=reduction,
                                             ignore_index=ignore_index, label_smoothing=label_smoothing)


def _replicated_local(weight, input, grad_placements):
    """A linear's weight or bias for the local rows of the DTensor ``input``:
    a plain tensor as it is; a DTensor replicated on input's mesh (gathered
    first when sharded, as FSDP2 keeps it outside its module's forward), its
    gradient declared Partial over the mesh dimensions the rows are sharded
    on (each rank's local rows contribute a part of it)."""
    if not _dtensor.is_dtensor(weight):
        return weight
    from torch.distributed.tensor import Replicate

    mesh = input.device_mesh
    if weight.device_mesh != mesh:
        raise ValueError(
            f"linear_cross_entropy: the weight's mesh {weight.device_mesh} is not the input's {mesh}"
        )
    if any(not p.is_replicate() for p in weight.placements):
        weight = weight.redistribute(mesh, [Replicate()] * mesh.ndim)
    return weight.to_local(grad_placements=grad_placements)


_BN_FORWARD = torch.ops.fusetrain.batch_norm_relu.default
_BN_BACKWARD = torch.ops.fusetrain.batch_norm_relu_backward.default


class _BatchNormRelu(torch.autograd.Function):
    """input [N, C, *] -> relu(batch_norm(input)); saves the input, the output
    (the ReLU's mask) and the statistics used, for the backward op."""

    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, training, momentum, eps, relu):
        out, mean, invstd = _BN_FORWARD(input, weight, bias, running_mean, running_var, training,
                                        momentum, eps, relu)
        ctx.save_for_backward(input, out if relu else None, weight, mean, invstd)
        ctx.training = training
        ctx.relu = relu
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        input, out, weight, mean, invstd = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1],
                ctx.needs_input_grad[2]]
        grad_input, grad_weight, grad_bias = _BN_BACKWARD(grad_out, input, out, weight, mean, invstd,
                                                          ctx.training, ctx.relu, mask)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


def batch_norm_relu(
    input: torch.Tensor,
    running_mean: Optional[torch.Tensor],
    running_var: Optional[torch.Tensor],
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    relu: bool = True,
) -> torch.Tensor:
    """``F.relu(F.batch_norm(input, running_mean, running_var, weight, bias,
    training, momentum, eps))``: the same arguments and semantics, or
    ``F.batch_norm`` alone with ``relu=False``.

    On the CPU, for float32, float16 and bfloat16 inputs of any shape ``[N, C, *]`` and memory format (channels_last included; the output keeps it), with
    weight and statistics in float32 or the input's dtype, one fused op
    forward (the statistics in one pass, then normalisation and ReLU in
    another) and one backward, fp32 math; in training the running statistics
    are updated in place as ``F.batch_norm`` updates them. Elsewhere (CUDA,
    float64) it is torch's ops. Not twice differentiable on the fused path.
    """
    if input.dim() < 2:
        raise ValueError(
            f"batch_norm_relu: input must have a batch and a channel dimension [N, C, ...], "
            f"got shape {tuple(input.shape)}"
        )
    if not input.is_cpu or input.dtype not in _SUPPORTED_DTYPES:
        out = torch.nn.functional.batch_norm(input, running_mean, running_var, weight, bias, training,
                                             momentum, eps)
        return torch.relu_(out) if relu else out
    return _BatchNormRelu.apply(input, weight, bias, running_mean, running_var, bool(training),
                                float(momentum), float(eps), bool(relu))


_POOL_FORWARD = torch.ops.fusetrain.max_pool2d.default
_POOL_BACKWARD = torch.ops.fusetrain.max_pool2d_backward.default


class _MaxPool2d(torch.autograd.Function):
    """[N, C, H, W] -> the maximum of each non-overlapping window; saves the
    input (its shape and layout) and the byte position of each maximum."""

    @staticmethod
    def forward(ctx, input, kernel_size):
        out, argmax = _POOL_FORWARD(input, kernel_size)
        ctx.save_for_backward(input, argmax)
        ctx.kernel_size = kernel_size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        input, argmax = ctx.saved_tensors
        return _POOL_BACKWARD(grad_out, input, argmax, ctx.kernel_size), None


def _pair(x) -> list:
    return [int(x), int(x)] if isinstance(x, int) else [int(v) for v in x]


def max_pool2d(
    input: torch.Tensor,
    kernel_size,
    stride=None,
    padding=0,
    dilation=1,
    ceil_mode: bool = False,
    return_indices: bool = False,
):
    """``F.max_pool2d``: the same arguments, values and gradients, bit for
    bit (ties keep the first maximum of a window, NaNs the last, as torch's).

    On the CPU, for 4-D float32, float16 and bfloat16 inputs, channels_last
    (the output is channels_last too) or contiguous NCHW with 2x2 windows,
    where the windows do not overlap (``stride``
    None or equal to ``kernel_size``, ``padding`` 0, ``dilation`` 1, floor
    mode: ``ceil_mode=False``, at most 256 positions a window) and no indices
    are asked for (``return_indices=False``), one pass
    forward that writes the output and a byte per window (torch writes int64
    indices), and one pass backward that writes every input gradient element
    once (torch zero-fills, copies its inputs to one layout, then scatters).
    Anything else is ``F.max_pool2d``. Not twice differentiable on the fused
    path.
    """
    kernel = _pair(kernel_size)
    windows = (
        not return_indices
        and (stride is None or (isinstance(stride, (list, tuple)) and len(stride) == 0) or _pair(stride) == kernel)
        and _pair(padding) == [0, 0]
        and _pair(dilation) == [1, 1]
        and not ceil_mode
        and len(kernel) == 2
        and kernel[0] * kernel[1] <= 256
    )
    # channels_last: vectors across channels, any window; contiguous NCHW:
    # vectors along the rows for 2x2 windows (other windows go one by one
    # there, slower than torch's NCHW kernel).
    layout = input.dim() == 4 and (
        (input.stride(1) == 1 and input.is_contiguous(memory_format=torch.channels_last))
        or (input.is_contiguous() and kernel == [2, 2]))
    if (not windows or not input.is_cpu or not layout or input.dtype not in _SUPPORTED_DTYPES
            or input.size(2) < kernel[0] or input.size(3) < kernel[1]):
        return torch.nn.functional.max_pool2d(input, kernel_size, stride, padding, dilation,
                                              ceil_mode=ceil_mode, return_indices=return_indices)
    return _MaxPool2d.apply(input, kernel)

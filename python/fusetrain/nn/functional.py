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
import warnings
from typing import Optional

import torch
from torch.autograd.function import once_differentiable
from torch.nn import _reduction

from .. import _C  # noqa: F401  (registers the fusetrain ops)
from .. import _dtensor

__all__ = [
    "softmax_cross_entropy",
    "cross_entropy",
    "linear_cross_entropy",
    "LinearCrossEntropyOptions",
    "batch_norm_relu",
    "max_pool2d",
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


@dataclasses.dataclass
class LinearCrossEntropyOptions:
    """How :func:`linear_cross_entropy` computes (torch 2.13's
    ``torch.nn.LinearCrossEntropyOptions`` fields, and one of ours).

    ``batch_chunk_size``: rows per chunk; None chooses it so that a chunk's
    logits and their gradient take about the memory of the input itself, and
    at least 64 MiB, in multiples of 64 rows; and at least 512 rows (2048 on
    CUDA), so that a chunk's GEMMs outweigh its pass over the fp32 weight
    gradient (read and written once a chunk: a CPU's fp32 run at 50257
    classes is 11% faster at 512 rows than at the 128 the memory rule gives;
    below ~1200 rows that traffic, not the tensor cores, sets an H100's pace).
    ``chunking_method``: ``"auto"`` takes the chunked path wherever it
    applies (class-index targets, a [classes] bias); ``"none"`` is the
    reference, ``F.cross_entropy(F.linear(...))``, holding every logit.
    ``gradients_in_forward`` (ours): for "mean" and "sum" losses that need
    gradients, compute them in the forward pass (three GEMMs a chunk, the
    input and weight gradients held until the backward) rather than
    recomputing each chunk's logits in the backward (four GEMMs)."""

    batch_chunk_size: Optional[int] = None
    chunking_method: str = "auto"
    gradients_in_forward: bool = True

    def __post_init__(self) -> None:
        if self.chunking_method not in ("auto", "none"):
            raise ValueError(
                f'LinearCrossEntropyOptions: chunking_method must be "auto" or "none", got {self.chunking_method!r}'
            )
        if self.batch_chunk_size is not None and int(self.batch_chunk_size) < 1:
            raise ValueError(
                f"LinearCrossEntropyOptions: batch_chunk_size must be at least 1, got {self.batch_chunk_size}"
            )


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
    calls take the C++ twin, fusetrain::nn::linear_cross_entropy)."""

    @staticmethod
    def forward(ctx, input, linear_weight, linear_bias, target, weight, ignore_index, label_smoothing,
                reduction, chunk_rows, with_grad):
        loss, lse, denominator, gi, gw, gb = _LCE_FORWARD(
            input, linear_weight, linear_bias, target, weight, ignore_index, label_smoothing, reduction,
            chunk_rows, with_grad,
        )
        ctx.with_grad = with_grad
        ctx.has_bias = linear_bias is not None
        if with_grad:
            # The gradients for a loss gradient of 1: the backward rescales them.
            ctx.save_for_backward(gi, gw, gb)
        else:
            ctx.save_for_backward(input, linear_weight, linear_bias, target, weight, lse, denominator)
            ctx.args = (ignore_index, label_smoothing, reduction, chunk_rows)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if torch.is_grad_enabled():
            # create_graph=True: the gradients' own gradient through this
            # loss would silently be zero.
            raise RuntimeError(
                "linear_cross_entropy: double backward is not supported (the op is once "
                "differentiable); use F.cross_entropy(F.linear(...)) where second-order "
                "gradients are needed"
            )
        need = ctx.needs_input_grad
        if ctx.with_grad:
            gi, gw, gb = ctx.saved_tensors
            g = grad_loss.reshape(())
            return (gi * g if need[0] else None, gw * g if need[1] else None,
                    gb * g if need[2] and ctx.has_bias else None) + (None,) * 7
        input, linear_weight, linear_bias, target, weight, lse, denominator = ctx.saved_tensors
        ignore_index, label_smoothing, reduction, chunk_rows = ctx.args
        mask = [need[0], need[1], need[2] and ctx.has_bias]
        gi, gw, gb = _LCE_BACKWARD(grad_loss, input, linear_weight, linear_bias, target, weight, lse,
                                   denominator, ignore_index, label_smoothing, reduction, chunk_rows, mask)
        return (gi if mask[0] else None, gw if mask[1] else None, gb if mask[2] else None) + (None,) * 7


def _reference_linear_cross_entropy(input, linear_weight, target, linear_bias, weight, reduction,
                                    ignore_index, label_smoothing):
    """F.cross_entropy(F.linear(...)) with the leading dimensions of input as rows."""
    logits = torch.nn.functional.linear(input, linear_weight, linear_bias)
    if input.dim() == 1:
        return torch.nn.functional.cross_entropy(logits, target, weight=weight, ignore_index=ignore_index,
                                                 reduction=reduction, label_smoothing=label_smoothing)
    rows = logits.reshape(-1, logits.shape[-1])
    flat_target = target.reshape(-1, target.shape[-1]) if target.is_floating_point() else target.reshape(-1)
    loss = torch.nn.functional.cross_entropy(rows, flat_target, weight=weight, ignore_index=ignore_index,
                                             reduction=reduction, label_smoothing=label_smoothing)
    return loss.reshape(input.shape[:-1]) if reduction == "none" else loss


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
    """``F.cross_entropy(F.linear(input, linear_weight, linear_bias), target,
    ...)`` without holding the logits: torch 2.13's
    ``torch.nn.functional.linear_cross_entropy``, on torch 2.11.

    ``input`` [..., in_features] (its leading dimensions are the rows),
    ``linear_weight`` [classes, in_features], ``linear_bias`` [classes] or
    None, all of one floating dtype (under autocast they are cast to its
    dtype, as ``F.linear``'s would be); ``target`` [...] class indices.
    ``weight``, ``reduction``, ``label_smoothing``: ``F.cross_entropy``'s;
    ``ignore_index`` None means -100, as torch maps it. ``options``
    (:class:`LinearCrossEntropyOptions`): None takes the chunked path, unlike
    torch 2.13's reference default (the values are the same; memory and speed
    are why this function exists). The rows go in chunks (Note [Chunked
    linear cross-entropy] in ``csrc/ops/linear_cross_entropy.cpp``): one GEMM
    each for its logits, the fused cross-entropy in fp32, the gradients
    accumulated in fp32. The loss has the linear's dtype (float32 under
    autocast, whose cross_entropy runs in float32). Class-probability
    targets take the reference path with a warning. Double backward raises.
    """
    options = LinearCrossEntropyOptions() if options is None else options
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f'linear_cross_entropy: reduction must be "mean", "sum" or "none", got "{reduction}"')
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"linear_cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    ignore_index = -100 if ignore_index is None else int(ignore_index)
    if _dtensor.any_dtensor((input, target, linear_weight, linear_bias, weight)):
        if _dtensor.is_dtensor(weight):
            weight = weight.full_tensor()  # (class weights: [classes], not trained)
        return _sharded_loss(
            "linear_cross_entropy", input, target, reduction, ignore_index, weight,
            lambda d: d if d < input.dim() - 1 else None,
            lambda x, t, r, grad_placements: linear_cross_entropy(
                x, _replicated_local(linear_weight, input, grad_placements), t,
                linear_bias=_replicated_local(linear_bias, input, grad_placements), weight=weight,
                reduction=r, ignore_index=ignore_index, label_smoothing=label_smoothing, options=options),
        )
    if options.chunking_method == "none" or target.is_floating_point():
        if target.is_floating_point() and options.chunking_method != "none":
            warnings.warn(
                "linear_cross_entropy: class-probability targets take the reference path "
                "(F.cross_entropy(F.linear(...)), every logit held); the chunked path takes class indices",
                stacklevel=2,
            )
        return _reference_linear_cross_entropy(input, linear_weight, target, linear_bias, weight, reduction,
                                               ignore_index, label_smoothing)
    if input.dim() == 0:
        raise ValueError("linear_cross_entropy: input must have a feature dimension, got a 0-d tensor")
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(
            f"linear_cross_entropy: input of shape {tuple(input.shape)} needs target of shape "
            f"{tuple(input.shape[:-1])} (its leading dimensions), got {tuple(target.shape)}"
        )
    if target.dtype == torch.bool or target.is_complex():
        raise TypeError(f"linear_cross_entropy: target must hold integer class indices, got {target.dtype}")
    chunk = options.batch_chunk_size
    if not torch.compiler.is_compiling():
        return _C.linear_cross_entropy(
            input, linear_weight, target, linear_bias, weight, reduction, ignore_index, float(label_smoothing),
            -1 if chunk is None else int(chunk), bool(options.gradients_in_forward),
        )
    # Dynamo traces this path into the two ops (the C++ Function is opaque to it).
    x, w, b = input, linear_weight, linear_bias
    device_type = input.device.type
    # (Meta tensors have no autocast state to ask about.)
    autocast = device_type != "meta" and torch.is_autocast_enabled(device_type)
    if autocast:
        dtype = torch.get_autocast_dtype(device_type)
        x, w = x.to(dtype), w.to(dtype)
        b = None if b is None else b.to(dtype)
    if linear_weight.dim() != 2 or x.shape[-1] != linear_weight.shape[1]:
        raise RuntimeError(
            f"linear_cross_entropy: input of shape {tuple(input.shape)} and linear_weight of shape "
            f"{tuple(linear_weight.shape)} do not agree in in_features"
        )
    rows = x.reshape(-1, x.shape[-1])
    if chunk is None:
        chunk = _lce_chunk_rows(rows.shape[0], rows.shape[1], linear_weight.shape[0], x.dtype, device_type)
    with_grad = (options.gradients_in_forward and reduction != "none" and torch.is_grad_enabled()
                 and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)))
    loss = _LinearCrossEntropy.apply(rows, w, b, target.reshape(-1).long(), weight, ignore_index,
                                     float(label_smoothing), reduction, int(chunk), with_grad)
    if reduction == "none":
        loss = loss.reshape(target.shape)
    return loss.to(torch.float32 if autocast else x.dtype)


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

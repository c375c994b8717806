"""8-bit floating point linear layers: the ``mixed_float8`` policy's GEMMs.

A :class:`Float8Linear` is an ``nn.Linear`` (same parameters and state-dict
keys) whose three GEMMs run in float8 (``torch._scaled_mm`` on CUDA), the
"hybrid" format of Transformer Engine: the input and the weight in e4m3 in the
forward, the output gradient in e5m2 in the backward. The products
accumulate in fp32; on Hopper the forward GEMM uses cuBLAS' fast-accumulation
mode and the two backward GEMMs the exact one, as Transformer Engine and
torchao do. The weight stays an fp32 master; its gradient is fp32. Each
cast also writes the operand's transpose (``fusetrain::fp8_quantize_*_transpose``:
on CUDA one kernel, one read of the operand), the layout the backward GEMMs
take, so the backward makes no transposed or padded copies.

Each of the three operands (input, weight, output gradient) has its own
per-tensor scale, chosen by a :class:`Float8Recipe` (Note [Float8 scaling] in
``csrc/kernels/fp8_scaling.h``)::

    scale = fp8_max / amax / 2**margin      (448 for e4m3, 57344 for e5m2)

- ``"current"`` scaling: ``amax`` is this tensor's own ``max |x|``: two passes
  over it (the amax, then the cast).
- ``"delayed"`` scaling: ``amax`` is the largest of the last
  ``amax_history_len`` amaxes of the operand (the first call seeds the
  history with the current amax); the cast records this call's amax in the
  same pass. An inf/NaN amax is recorded but never used.

Both run on the device without a host sync (``fusetrain::fp8_quantize_*``),
so a step can be captured in a ``fuse_steps`` CUDA graph; with delayed
scaling, after one eager training step (a capture that reaches the seeding
first step is an error: the graph would replay it forever). The scaling state
is two buffers, saved in checkpoints:

- ``fp8_scale`` ``[3]``: the scales last used for input, weight and output
  gradient;
- ``fp8_amax_history`` ``[3, H]``: their amaxes, newest first (``H = 1`` for
  current scaling);
- ``fp8_seeded`` ``[3]`` (uint8): which delayed histories hold data, so a
  resumed run takes exactly the steps the uninterrupted one takes.

Under DistributedDataParallel (``broadcast_buffers=True``, the default) every
rank uses rank 0's scaling state.
"""

from __future__ import annotations

import functools
from typing import Optional, Union

import torch
import torch.nn.functional as F

from . import _C  # noqa: F401  (registers the fusetrain ops)

__all__ = ["Float8Recipe", "Float8Linear", "DEFAULT_FP8_MIN_FEATURES"]

_INPUT, _WEIGHT, _GRAD = 0, 1, 2

#: Default ``fp8_min_features`` of :func:`fusetrain.amp.apply_policy`: a
#: ``Linear`` runs in float8 only when its in and out features both reach it.
#: 1024 follows the published Hopper measurements of torchao's float8
#: training, where tensorwise float8 overtakes bf16 from about K = N = 1024 at
#: large batch; bench/bench_fp8.py measures the crossover on our GPU box.
DEFAULT_FP8_MIN_FEATURES = 1024


class Float8Recipe:
    """How a :class:`Float8Linear` picks its scales.

    Args:
        scaling: ``"delayed"`` (default; Transformer Engine's
            ``DelayedScaling``) or ``"current"``.
        amax_history_len: amaxes kept per operand for delayed scaling
            (default 16); ignored by current scaling.
        margin: binades of head-room below the format's maximum (default 0).
    """

    __slots__ = ("scaling", "amax_history_len", "margin")

    def __init__(self, scaling: str = "delayed", amax_history_len: int = 16, margin: int = 0):
        if scaling not in ("delayed", "current"):
            raise ValueError(f'Float8Recipe: scaling must be "delayed" or "current", got {scaling!r}')
        if not isinstance(amax_history_len, int) or not 1 <= amax_history_len <= 1024:
            raise ValueError(
                f"Float8Recipe: amax_history_len must be an int in [1, 1024], got "
                f"{amax_history_len!r}"
            )
        if not isinstance(margin, int) or not 0 <= margin < 128:
            raise ValueError(f"Float8Recipe: margin must be an int in [0, 128), got {margin!r}")
        self.scaling = scaling
        self.amax_history_len = amax_history_len
        self.margin = margin

    @property
    def history_len(self) -> int:
        """Length of the amax history buffer (1 for current scaling)."""
        return self.amax_history_len if self.scaling == "delayed" else 1

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Float8Recipe) and all(
            getattr(self, k) == getattr(other, k) for k in self.__slots__
        )

    def __hash__(self) -> int:
        return hash((self.scaling, self.amax_history_len, self.margin))

    def __repr__(self) -> str:
        return (
            f'Float8Recipe(scaling="{self.scaling}", amax_history_len={self.amax_history_len}, '
            f"margin={self.margin})"
        )


def _as_recipe(recipe: Union[Float8Recipe, str, None]) -> Float8Recipe:
    if recipe is None:
        return Float8Recipe()
    if isinstance(recipe, str):
        return Float8Recipe(scaling=recipe)
    if isinstance(recipe, Float8Recipe):
        return recipe
    raise TypeError(f'recipe must be a Float8Recipe, "delayed" or "current", got {recipe!r}')


@functools.lru_cache(maxsize=None)
def _check_fp8_device(device: torch.device) -> None:
    """Float8 GEMMs run on the CPU (fp32 GEMMs of the upcast operands) and on CUDA
    GPUs of compute capability 8.9 or newer; anything else is an error, never
    a silent bf16 fall-back."""
    if device.type == "cpu":
        return
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise RuntimeError(
                f"mixed_float8: {torch.cuda.get_device_name(device)} ({device}) has compute "
                f"capability {major}.{minor}; float8 GEMMs need 8.9 (Ada) or 9.0 (Hopper) or "
                f'newer. Use the "mixed_bfloat16" policy on this GPU'
            )
        return
    raise RuntimeError(
        f'mixed_float8: no float8 GEMM for device type "{device.type}" (float8 runs on CUDA '
        f'GPUs of compute capability >= 8.9 and on the CPU); use "mixed_bfloat16"'
    )


#: Raised when a CUDA graph capture reaches a delayed cast that would seed its
#: history: captured, the seeding cast (the tensor's own amax) would replay at
#: every step and delayed scaling would never take over. fusetrain.graph
#: recognises it by "Run one eager training step before capturing".
_UNSEEDED_CAPTURE_ERROR = (
    "Float8Linear: a CUDA graph capture reached the first training step of a layer with "
    "delayed scaling, which casts with the tensor's own amax and seeds the amax history; "
    "captured, that first step would replay at every step and delayed scaling would never "
    "take over. Run one eager training step before capturing (fuse_steps(..., "
    "warmup_executions=1) or more; the default runs 2)"
)


def _capturing(x: torch.Tensor) -> bool:
    """Whether a CUDA graph capture is recording on the current stream of x's
    device (no sync; asked only on a layer's first steps)."""
    if not x.is_cuda:
        return False
    with torch.cuda.device(x.device):
        return torch.cuda.is_current_stream_capturing()


class _Float8State:
    """What the autograd function reads and updates: the scaling buffers, the
    recipe, and per operand whether its delayed history holds data yet (a
    host list, so a step never reads the device to know, mirrored in the
    ``fp8_seeded`` buffer for checkpoints)."""

    __slots__ = ("scale", "history", "seeded_buffer", "seeded", "recipe")

    def __init__(self, scale, history, seeded_buffer, seeded, recipe):
        self.scale, self.history = scale, history
        self.seeded_buffer, self.seeded, self.recipe = seeded_buffer, seeded, recipe

    def quantize(self, x: torch.Tensor, dtype, i: int):
        """The matrix x in float8 with operand i's scale, updating its scale
        and history, and its transpose with the rows padded to _row_multiple
        (``fp8_quantize_*_transpose``: one pass on CUDA): the layouts the
        three GEMMs take."""
        scale, history, margin = self.scale[i : i + 1], self.history[i], self.recipe.margin
        multiple = _row_multiple(x)
        delayed = self.recipe.scaling == "delayed"
        if delayed and self.seeded[i]:
            return torch.ops.fusetrain.fp8_quantize_delayed_transpose(
                x, dtype, scale, history, margin, multiple
            )
        if delayed and _capturing(x):
            # Checked before anything of this call is recorded or flagged.
            raise RuntimeError(_UNSEEDED_CAPTURE_ERROR)
        # Current scaling, and the first delayed call, which seeds history[0].
        q = torch.ops.fusetrain.fp8_quantize_current_transpose(
            x, dtype, scale, history[:1], margin, multiple
        )
        if not self.seeded[i]:
            self.seeded[i] = True
            self.seeded_buffer[i : i + 1].fill_(1)
        return q


def _row_multiple(x: torch.Tensor) -> int:
    """What a transpose's rows are padded to: CUDA's _scaled_mm wants the
    reduced dimension a multiple of 16 (zero columns add nothing); the CPU's
    fp32 GEMM takes any size."""
    return 16 if x.is_cuda else 1


def _scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, *, use_fast_accum: bool):
    """``scale_a * scale_b * (a @ b) + bias`` in ``out_dtype``, ``a`` and ``b``
    float8, fp32 accumulation: ``torch._scaled_mm`` on CUDA, where
    ``use_fast_accum`` picks cuBLAS' fast accumulation (on Hopper partial sums
    keep about 14 bits: the forward GEMM only, see the module doc; the CPU's
    sum is exact either way). On a CPU torch's
    ``_scaled_mm`` is oneDNN's float8 kernel, a reference loop on CPUs without
    float8 instructions (0.5 s for a 1024 x 64 x 256 GEMM on an AVX-512 Xeon),
    so the CPU multiplies the operands upcast to float32 (float8 values and
    their products are exact in float32: the same sum, fp32 accumulation),
    scales the fp32 result, adds the bias and rounds once; autocast is off for
    it. The C++ twin (csrc/amp/float8_linear.cpp) runs the same ATen ops."""
    if a.is_cuda:
        fused_bias = bias is not None and out_dtype != torch.float32
        out = torch._scaled_mm(
            a, b, scale_a=scale_a, scale_b=scale_b,
            bias=bias.to(out_dtype) if fused_bias else None,
            out_dtype=out_dtype, use_fast_accum=use_fast_accum,
        )
        return out + bias.to(out_dtype) if bias is not None and not fused_bias else out
    with torch.autocast(a.device.type, enabled=False):
        out = torch.mm(a.float(), b.float()).mul_(scale_a).mul_(scale_b)
        if bias is not None:
            out.add_(bias.float())
        return out.to(out_dtype)


class _Float8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, state, out_dtype):
        in_features = weight.shape[1]
        qx, qx_t = state.quantize(input.reshape(-1, in_features), torch.float8_e4m3fn, _INPUT)
        qw, qw_t = state.quantize(weight, torch.float8_e4m3fn, _WEIGHT)
        # The dequantisation factors of these casts; the buffers move on.
        inv_x = state.scale[_INPUT].reciprocal()
        inv_w = state.scale[_WEIGHT].reciprocal()
        out = _scaled_mm(qx, qw.t(), inv_x, inv_w, bias, out_dtype, use_fast_accum=True)
        # The backward's GEMMs take the transposes (qx_t [in, tokens] and
        # qw_t [in, out], read column-major), so those are saved.
        ctx.save_for_backward(qx_t, qw_t, inv_x, inv_w)
        ctx.state = state
        ctx.input_shape, ctx.input_dtype = input.shape, input.dtype
        ctx.has_bias = bias is not None
        return out.reshape(*input.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        qx_t, qw_t, inv_x, inv_w = ctx.saved_tensors
        state = ctx.state
        g = grad_output.reshape(-1, qw_t.shape[1])
        qg, qg_t = state.quantize(g, torch.float8_e5m2, _GRAD)
        inv_g = state.scale[_GRAD].reciprocal()
        grad_input = grad_weight = grad_bias = None
        # Both backward GEMMs accumulate exactly (the weight gradient sums
        # over every token of the batch).
        if ctx.needs_input_grad[0]:
            # g [tokens, out] @ w [out, in]: w column-major is qw_t transposed.
            grad_input = _scaled_mm(
                qg, qw_t.t(), inv_g, inv_w, None, ctx.input_dtype, use_fast_accum=False
            ).reshape(ctx.input_shape)
        if ctx.needs_input_grad[1]:
            # g^T [out, tokens] @ x [tokens, in], tokens zero-padded on CUDA.
            grad_weight = _scaled_mm(
                qg_t, qx_t.t(), inv_g, inv_x, None, torch.float32, use_fast_accum=False
            )
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = g.sum(0, dtype=torch.float32)
        return grad_input, grad_weight, grad_bias, None, None


class Float8Linear(torch.nn.Linear):
    """``nn.Linear`` with float8 GEMMs (see the module docstring).

    ``Float8Linear(in_features, out_features, bias=True, device=None,
    dtype=None, recipe=None)``: the constructor of ``torch.nn.Linear``
    (``in_features`` and ``out_features`` the layer's sizes, ``bias`` whether
    it adds one, ``device`` and ``dtype`` those of its parameters) plus
    ``recipe``: a :class:`Float8Recipe`, or ``"delayed"`` / ``"current"`` for
    that recipe's defaults (default None: ``Float8Recipe()``, delayed
    scaling); anything else is a ``TypeError``. Parameters and
    their state-dict keys are ``nn.Linear``'s; the scaling state adds the
    buffers ``fp8_scale``, ``fp8_amax_history`` and ``fp8_seeded``. Loading an ``nn.Linear``
    state dict (without them) starts the scaling state afresh.

    Under autocast the output is in the autocast dtype (bf16 under
    ``mixed_float8``), else in the input's dtype. A float32 island
    (:func:`fusetrain.amp.keep_float32`) runs the plain fp32 ``F.linear``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, recipe: Union[Float8Recipe, str, None] = None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_fp8_state(_as_recipe(recipe), self.weight.device)

    _FP8_BUFFERS = ("fp8_scale", "fp8_amax_history", "fp8_seeded")

    def _init_fp8_state(self, recipe: Float8Recipe, device) -> None:
        self.recipe = recipe
        self.register_buffer("fp8_scale", torch.ones(3, dtype=torch.float32, device=device))
        self.register_buffer(
            "fp8_amax_history",
            torch.zeros(3, recipe.history_len, dtype=torch.float32, device=device),
        )
        self.register_buffer("fp8_seeded", torch.zeros(3, dtype=torch.uint8, device=device))
        self._fp8_seeded = [False, False, False]

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear,
                    recipe: Union[Float8Recipe, str, None] = None) -> "Float8Linear":
        """A Float8Linear sharing ``linear``'s parameters (the same Parameter
        objects, so an optimizer made before still updates them), scaled by
        ``recipe`` (as the constructor's: a :class:`Float8Recipe`,
        ``"delayed"``, ``"current"`` or None for the default). ``linear`` must
        be an ``nn.Linear`` (a ``TypeError`` otherwise)."""
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"Float8Linear.from_linear expects an nn.Linear, got {type(linear).__name__}")
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.training = linear.training
        new._init_fp8_state(_as_recipe(recipe), linear.weight.device)
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``input @ weight.T + bias`` with the GEMM in float8 (``input`` of
        shape ``[..., in_features]``). In training the operands' scales come
        from the recipe and update the layer's scaling state; in evaluation each tensor is
        scaled by its own amax and the state is left alone. Runs on the CPU
        and on CUDA GPUs of compute capability >= 8.9 (in and out features
        multiples of 16 there); elsewhere a ``RuntimeError``."""
        if getattr(self, "_fusetrain_float32", False):
            return F.linear(input, self.weight, self.bias)
        _check_fp8_device(input.device)
        if input.is_cuda and (self.in_features % 16 or self.out_features % 16):
            raise RuntimeError(
                f"Float8Linear({self.in_features}, {self.out_features}): float8 GEMMs on CUDA "
                f"need in and out features that are multiples of 16; keep this layer an "
                f"nn.Linear (apply_policy leaves such layers alone)"
            )
        if self.training:
            state = _Float8State(self.fp8_scale, self.fp8_amax_history, self.fp8_seeded,
                                 self._fp8_seeded, self.recipe)
        else:
            # Evaluation scales each tensor by itself and leaves the training
            # state alone: how often a run evaluates cannot change its steps.
            device = self.fp8_scale.device
            state = _Float8State(
                torch.ones(3, device=device), torch.zeros(3, 1, device=device),
                torch.zeros(3, dtype=torch.uint8, device=device), [True, True, True],
                Float8Recipe("current", margin=self.recipe.margin),
            )
        device_type = input.device.type
        if torch.is_autocast_enabled(device_type):
            out_dtype = torch.get_autocast_dtype(device_type)
        else:
            out_dtype = input.dtype
        return _Float8LinearFunction.apply(input, self.weight, self.bias, state, out_dtype)

    def reset_fp8_state(self) -> None:
        """Scales back to 1, histories emptied (the next call re-seeds them)."""
        with torch.no_grad():
            self.fp8_scale.fill_(1.0)
            self.fp8_amax_history.zero_()
            self.fp8_seeded.zero_()
        self._fp8_seeded = [False, False, False]

    def _apply(self, fn, recurse=True):
        # .to(dtype), .half(), .bfloat16() move the scaling state with the
        # device but keep it float32: the ops compute scales in float32.
        saved = {k: self._buffers[k] for k in self._FP8_BUFFERS[:2]}
        super()._apply(fn, recurse)
        for k, old in saved.items():
            if self._buffers[k].dtype != torch.float32:
                self._buffers[k] = old.to(self._buffers[k].device)
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        fp8_keys = [prefix + k for k in self._FP8_BUFFERS]
        history = state_dict.get(fp8_keys[1])
        if history is not None and tuple(history.shape) != tuple(self.fp8_amax_history.shape):
            error_msgs.append(
                f"size mismatch for {fp8_keys[1]}: copying a history of shape "
                f"{tuple(history.shape)}, this layer's recipe ({self.recipe}) keeps "
                f"{tuple(self.fp8_amax_history.shape)}; make the layer with the recipe the "
                f"checkpoint was trained with"
            )
            return
        before = len(missing_keys)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if not any(k in state_dict for k in fp8_keys):
            # An nn.Linear checkpoint: keep the weights, start the scaling afresh.
            missing_keys[before:] = [k for k in missing_keys[before:] if k not in fp8_keys]
            self.reset_fp8_state()
        else:
            # One read at load time: which histories hold data already.
            self._fp8_seeded = [bool(s) for s in self.fp8_seeded.tolist()]

    def extra_repr(self) -> str:
        """``nn.Linear``'s, with the recipe."""
        return f"{super().extra_repr()}, recipe={self.recipe}"

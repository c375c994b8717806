"""Step fusion: several training steps per execution (Keras'
``steps_per_execution``), with no host synchronisation between them::

    def train_step(x, y):
        with fusetrain.amp.autocast("mixed_bfloat16"):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)            # FusedAdamW: the overflow check stays on the device
        scaler.update()
        opt.zero_grad(set_to_none=False)
        return loss.detach()

    fused = fusetrain.fuse_steps(train_step, (x0, y0), steps_per_execution=16)
    for chunk in chunks_of_16_batches:
        losses = fused(chunk)       # [16] losses on the device
        print(losses.mean().item()) # one host sync per execution

    batches = iter(loader)          # or: the next 16 batches of an iterator
    while True:
        try:
            losses = fused(batches)
        except StopIteration:
            break

On CUDA the K steps are captured once as a CUDA graph that reads a ring of K
static input buffers, and each execution is one graph replay. The first
``warmup_executions`` run eagerly (they allocate optimizer state; DDP needs at
least 11 eager iterations before capture, which the default ensures). What a step reads as a Python
number at capture time is frozen into the graph: give the optimizer a tensor
learning rate (``FusedAdamW(params, lr=torch.tensor(1e-3, device="cuda"))``)
and change it in place between executions, or call ``reset()`` after
changing a float one. On a TPU (torch_tpu's ``"tpu"`` device) the K steps
are compiled together with ``torch.compile`` (the XLA analogue of a CUDA
graph: ``use_compile=True``, the default there), on ``compile_backend``
(default: a dynamo backend registered under the device's name, else
torch.compile's default); no TPU has been reachable where fusetrain is
developed, so that path has run only on the CPU (``use_compile=True,
compile_backend="aot_eager"`` in the tests). Elsewhere the K steps run back
to back. Either way the results equal K unfused calls of the step.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, Callable, List, Optional, Sequence, Union

import torch

__all__ = ["fuse_steps", "FusedSteps"]

_TPU = "tpu"  # torch_tpu's device type (fusetrain.devices)

# Eager iterations torch's DDP needs before a capture.
_DDP_WARMUP_STEPS = 11


def _as_tensors(batch: Any, where: str) -> List[torch.Tensor]:
    items = list(batch) if isinstance(batch, (list, tuple)) else [batch]
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: element {i} is {type(t).__name__}, not a tensor")
    return items


class FusedSteps:
    """``steps_per_execution`` steps of ``step_fn`` per call; see the module doc.

    What :func:`fuse_steps` returns; its arguments are that function's:

    - ``step_fn``: one training step; takes one batch (the tensors of a tuple
      or list batch as separate arguments) and returns a tensor that stays on
      the device.
    - ``sample_batch``: a tensor or a tuple/list of tensors; every batch must
      have its shapes, dtypes and devices (its first tensor's device decides
      CUDA graph or compile).
    - ``steps_per_execution``: K, the steps per call (default 1; must be >= 1).
    - ``warmup_executions`` (keyword): executions run eagerly before the
      capture (default None: enough for 11 eager steps, and at least 2;
      must be >= 0).
    - ``use_cuda_graph`` (keyword, default True): on CUDA, capture the K
      steps as a CUDA graph; False runs them back to back.
    - ``use_compile`` (keyword, default None: True on a TPU, else False):
      compile the K steps with ``torch.compile`` instead (any device).
    - ``compile_backend`` (keyword): ``torch.compile``'s ``backend`` (default
      None: a dynamo backend named after the device type where one is
      registered, else ``"inductor"``).
    """

    def __init__(
        self,
        step_fn: Callable[..., torch.Tensor],
        sample_batch: Any,
        steps_per_execution: int = 1,
        *,
        warmup_executions: Optional[int] = None,
        use_cuda_graph: bool = True,
        use_compile: Optional[bool] = None,
        compile_backend: Union[str, Callable, None] = None,
    ):
        if steps_per_execution < 1:
            raise ValueError(f"steps_per_execution must be >= 1, got {steps_per_execution}")
        if warmup_executions is None:
            # The fewest executions holding 11 eager steps (what DDP needs
            # before a capture), and at least 2.
            warmup_executions = max(2, -(-_DDP_WARMUP_STEPS // steps_per_execution))
        if warmup_executions < 0:
            raise ValueError(f"warmup_executions must be >= 0, got {warmup_executions}")
        self.step_fn = step_fn
        self.steps_per_execution = int(steps_per_execution)
        self.warmup_executions = int(warmup_executions)
        self._sample = _as_tensors(sample_batch, "sample_batch")
        if not self._sample:
            raise ValueError("sample_batch holds no tensor")
        self._tuple = isinstance(sample_batch, (list, tuple))
        device_type = self._sample[0].device.type
        if use_compile is None:
            use_compile = device_type == _TPU
        self.use_compile = bool(use_compile)
        self.compile_backend = compile_backend
        self._cuda = use_cuda_graph and self._sample[0].is_cuda and not self.use_compile
        self._compiled = None
        self._executions = 0
        self._graph = None
        self._static_inputs: List[List[torch.Tensor]] = []
        self._static_outputs = None

    @property
    def captured(self) -> bool:
        """True once the K steps are a CUDA graph or a compiled function."""
        return self._graph is not None or self._compiled is not None

    def reset(self) -> None:
        """Drops the captured graph (or compiled function); the next full
        execution captures (compiles) again."""
        self._graph = None
        self._compiled = None
        self._static_inputs = []
        self._static_outputs = None

    def _check(self, batch: List[torch.Tensor], index: int) -> None:
        if len(batch) != len(self._sample):
            raise ValueError(
                f"batch {index} has {len(batch)} tensors but the sample batch has {len(self._sample)}"
            )
        for t, (a, s) in enumerate(zip(batch, self._sample)):
            if a.shape != s.shape:
                raise ValueError(
                    f"batch {index} tensor {t} has shape {tuple(a.shape)} but the sample has "
                    f"{tuple(s.shape)}; fused steps need static shapes (drop or pad the last "
                    "partial batch)"
                )
            if a.dtype != s.dtype or a.device != s.device:
                raise ValueError(
                    f"batch {index} tensor {t} is {a.dtype} on {a.device} but the sample is "
                    f"{s.dtype} on {s.device}"
                )

    def _call(self, batch: List[torch.Tensor]) -> torch.Tensor:
        return self.step_fn(*batch) if self._tuple else self.step_fn(batch[0])

    def _eager(self, batches: List[List[torch.Tensor]]) -> torch.Tensor:
        return torch.stack([self._call(b) for b in batches])

    def __call__(self, batches: Union[Sequence[Any], Iterator[Any]]) -> torch.Tensor:
        """Runs one step per batch (1 to K batches; fewer than K run eagerly)
        and returns the steps' outputs stacked along a new first dimension,
        on the device, without a host sync. ``batches`` is a sequence of
        batches, or an iterator (a DataLoader's) from which the next K are
        taken; an exhausted iterator raises StopIteration."""
        if isinstance(batches, Iterator):
            batches = list(itertools.islice(batches, self.steps_per_execution))
            if not batches:
                raise StopIteration
        batches = [_as_tensors(b, f"batch {i}") for i, b in enumerate(batches)]
        if not 1 <= len(batches) <= self.steps_per_execution:
            raise ValueError(
                f"a fused execution takes 1 to {self.steps_per_execution} batches, got {len(batches)}"
            )
        for i, b in enumerate(batches):
            self._check(b, i)
        full = len(batches) == self.steps_per_execution
        fused = self._cuda or self.use_compile
        if not fused or not full or self._executions < self.warmup_executions:
            self._executions += 1
            return self._eager(batches)
        if self.use_compile:
            if self._compiled is None:
                backend = _compile_backend(self.compile_backend, self._sample[0].device.type)
                self._compiled = torch.compile(self._unflatten_and_run, backend=backend, dynamic=False)
            self._executions += 1
            return self._compiled(*[t for b in batches for t in b])
        if self._graph is None:
            self._capture(batches)
        for static, batch in zip(self._static_inputs, batches):
            for dst, src in zip(static, batch):
                dst.copy_(src, non_blocking=True)
        self._graph.replay()
        self._executions += 1
        return self._static_outputs.clone()

    def _unflatten_and_run(self, *flat: torch.Tensor) -> torch.Tensor:
        """The K steps over the K batches' tensors passed one after another
        (the compiled function's arguments)."""
        n = len(self._sample)
        return self._eager([list(flat[i : i + n]) for i in range(0, len(flat), n)])

    def _capture(self, batches: List[List[torch.Tensor]]) -> None:
        # On the batches' device, whatever the current one is: a capture on
        # another device's stream would record nothing and replay nothing.
        with torch.cuda.device(self._sample[0].device):
            caller = torch.cuda.current_stream()
            self._static_inputs = [[t.clone() for t in b] for b in batches]
            graph = torch.cuda.CUDAGraph()
            pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream()
            side.wait_stream(caller)
            try:
                # thread_local: CUDA calls of other threads (a DataLoader's
                # pin-memory thread) neither break the capture nor fail.
                with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                    self._static_outputs = torch.stack([self._call(b) for b in self._static_inputs])
            except Exception as e:
                _abandon_capture(caller, pool)
                self.reset()
                raise RuntimeError(_capture_failure(e)) from e
            caller.wait_stream(side)
        self._graph = graph


def _compile_backend(backend: Union[str, Callable, None], device_type: str):
    """``backend``, or where None a dynamo backend registered under the
    device type's name (as an accelerator's package may register one), else
    torch.compile's default."""
    if backend is not None:
        return backend
    from torch._dynamo import list_backends

    return device_type if device_type in list_backends(exclude_tags=()) else "inductor"


def _abandon_capture(caller: torch.cuda.Stream, pool) -> None:
    """What torch skips when ending a failed capture raises: the caller's
    stream back as the current one, the allocator out of capture mode and
    the graph's memory pool released."""
    torch.cuda.set_stream(caller)
    device = torch.cuda.current_device()
    try:
        torch._C._cuda_endAllocateToPool(device, pool)
    except RuntimeError:
        return  # the capture got past it: the graph's own reset releases the pool
    torch._C._cuda_releasePool(device, pool)


def _capture_failure(e: BaseException) -> str:
    """Why a capture failed, from the error it raised, and what to do."""
    # A failed capture_end() while leaving the graph context replaces the
    # first error; read the whole chain and report the first one.
    chain = []
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__context__
    text = " ".join(str(x) for x in chain)
    e = chain[-1]
    if "Run one eager training step before capturing" in text:
        # fusetrain.float8: a layer would seed its delayed scaling in the graph.
        cause = (
            "a Float8Linear with delayed scaling has not run an eager training step yet (pass "
            "warmup_executions >= 1)"
        )
    elif "capturable" in text:
        cause = (
            "the optimizer is not capturable (use fusetrain.optim.FusedAdamW / FusedSGD, which "
            "read the loss scale, the overflow flag and the step counts on the device, or a torch "
            "optimizer with capturable=True)"
        )
    elif any(k in text for k in ("capturing", "StreamCapture", "not permitted")):
        cause = (
            "a host sync in the step (.item(), printing a tensor, copying to the CPU, a GradScaler "
            "with an optimizer that does not take the scale on the device, or a data-dependent "
            "shape such as nonzero or boolean indexing)"
        )
    else:
        cause = "an operation that cannot be captured"
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return (
        f"fuse_steps: the step cannot be captured as a CUDA graph: {cause}. The error was: "
        f"{first}\nPass use_cuda_graph=False to run the steps without capture."
    )


def fuse_steps(
    step_fn: Callable[..., torch.Tensor],
    sample_batch: Any,
    steps_per_execution: int = 1,
    **kwargs,
) -> FusedSteps:
    """Returns a callable that runs ``steps_per_execution`` steps of
    ``step_fn`` per call. ``step_fn`` takes one batch (the tensors of a tuple
    batch as separate arguments) and returns a tensor that stays on the
    device; ``sample_batch`` fixes the shapes. Keywords:

    - ``warmup_executions``: executions run eagerly before the capture
      (default: enough for 11 eager steps, and at least 2; a Float8Linear with
      delayed scaling needs at least 1, which seeds its amax histories);
    - ``use_cuda_graph`` (default True): on CUDA, capture the K steps as a
      CUDA graph;
    - ``use_compile`` (default: True on a TPU, else False): compile the K
      steps with ``torch.compile`` instead (any device);
    - ``compile_backend``: its ``backend`` (default: a dynamo backend named
      after the device type where one is registered, else ``"inductor"``).

    See the module doc."""
    return FusedSteps(step_fn, sample_batch, steps_per_execution, **kwargs)

"""Shared helpers for fusetrain's Python tests.

The GradScaler tests run torch.amp.GradScaler("cpu") and
fusetrain.amp.GradScaler("cpu") side by side; the helpers here build the
identical models, data and comparisons both runs use.

Tests that need a CUDA GPU carry ``@pytest.mark.cuda``: the GPU box selects
exactly those (``pytest -m cuda`` in scripts/gpu_check.sh), and elsewhere the
hook below skips them, so no CUDA test can be left out of either run by its
name. (Tests of the no-CUDA fallback skip where CUDA *is* available instead;
they are CPU tests and carry no marker.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fusetrain
import fusetrain.amp

# Bit patterns of each floating dtype, to compare tensors bit for bit (NaN
# payloads and the sign of zero included), which torch.equal does not.
_INT_OF = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view(_INT_OF[t.dtype]) if t.dtype in _INT_OF else t


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "",
                      nan_payload: bool = True) -> None:
    """Bit-for-bit equality. nan_payload=False lets a NaN match any NaN (torch's
    own bf16 CPU kernels give a NaN 0x7fc0 in their scalar tail but 0xffff in
    their vectorised body, so its payloads carry no meaning there)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    a, e = bits(actual), bits(expected)
    if torch.equal(a, e):
        return
    differ = a != e
    if not nan_payload and actual.is_floating_point():
        differ &= ~(actual.detach().isnan() & expected.detach().isnan()).contiguous()
    if differ.any():
        bad = differ.flatten().nonzero().flatten()
        i = int(bad[0])
        raise AssertionError(
            f"{what}: {bad.numel()} of {a.numel()} elements differ bitwise; first at flat index "
            f"{i}: {actual.detach().flatten()[i].item()!r} != {expected.detach().flatten()[i].item()!r}"
        )


def params_of(model: nn.Module) -> list:
    return [p.detach().clone() for p in model.parameters()]


def assert_params_equal(model_a: nn.Module, model_b: nn.Module, what: str = "") -> None:
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert_bits_equal(a, b, f"{what} parameter {name}")


def optimizer_state_snapshot(optimizer: torch.optim.Optimizer) -> dict:
    """A deep copy of the optimizer's per-parameter state (tensors cloned)."""
    return copy.deepcopy(optimizer.state_dict()["state"])


def assert_state_equal(a: dict, b: dict, what: str = "") -> None:
    assert a.keys() == b.keys(), f"{what}: state keys {a.keys()} != {b.keys()}"
    for k in a:
        assert a[k].keys() == b[k].keys(), f"{what}: state[{k}] keys differ"
        for field in a[k]:
            x, y = a[k][field], b[k][field]
            if isinstance(x, torch.Tensor):
                assert_bits_equal(x, y, f"{what} state[{k}][{field}]")
            else:
                assert x == y, f"{what} state[{k}][{field}]: {x} != {y}"


class MLP(nn.Module):
    def __init__(self, d_in: int = 12, d_hidden: int = 24, d_out: int = 5):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32, **kw) -> nn.Module:
    torch.manual_seed(seed)
    return MLP(**kw).to(dtype)


def make_batches(n: int, seed: int = 1, batch: int = 8, d_in: int = 12, d_out: int = 5,
                 dtype: torch.dtype = torch.float32) -> list:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, d_in, generator=g).to(dtype), torch.randn(batch, d_out, generator=g).to(dtype))
        for _ in range(n)
    ]


NEEDS_CUDA = "needs a CUDA GPU (runs in make gpu-check)"


def pytest_configure(config):
    config.addinivalue_line("markers", f"cuda: the test {NEEDS_CUDA}; skipped without one")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NEEDS_CUDA)
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


# One intra-op thread: these tests use tiny models, and on a busy 2-core
# machine torch's spinning thread pool makes each step ~50x slower. The op
# tests that exercise the parallel CPU kernel ask for threads themselves.
torch.set_num_threads(1)


@pytest.fixture
def intra_op_threads():
    """Runs a test with 2 intra-op threads (the CPU kernels' parallel path)."""
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(1)


SCALERS = {
    "torch": torch.amp.GradScaler,
    "fusetrain": fusetrain.amp.GradScaler,
}


@pytest.fixture(autouse=True)
def _restore_global_policy():
    """Tests that set the global policy leave it as they found it."""
    before = fusetrain.amp.global_policy()
    yield
    fusetrain.amp.set_global_policy(before)


@pytest.fixture(autouse=True)
def _deterministic_seed():
    torch.manual_seed(0)
    yield

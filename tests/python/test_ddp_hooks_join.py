"""fusetrain's DistributedDataParallel with torch's communication hooks and
torch's Join protocol for uneven inputs, against torch's own
DistributedDataParallel doing the same on the same data (gloo, 2 and 3
processes on loopback; ddp_harness runs the ranks).

Hooks: torch's ``allreduce_hook``, ``fp16_compress_hook`` and
``bf16_compress_hook`` run unchanged on fusetrain's buckets; both DDPs hand
each hook the same buckets in the same order and the hook does all the
arithmetic (averaging included), so the parameters must agree bit for bit.
torch's ``powerSGD_hook`` (ranks 1 and 2, error feedback, warm start on and
off) is checked against a one-rank run on the whole batch (sc_powersgd), and
fusetrain's C++ hooks against torch's Python ones, bit for bit.

Join: ranks with 5, 8 (and 6) batches train under ``with model.join():``;
fusetrain's and torch's final parameters must agree on every rank (every
rank ends with the last joiner's model), with the default division by the
initial world size and with ``divide_by_initial_world_size=False``, with
batch-norm buffers, inside ``Join([model, ZeroRedundancyOptimizer])``, and
``throw_on_early_termination`` must raise on every rank at the same step.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddp_harness import findings, launch, worker_main
from test_ddp import Uneven  # 4 buckets at BUCKET_CAP_MB; fc1.weight and fc2.weight worth compressing

BUCKET_CAP_MB = 0.02  # the Uneven model spans 4 buckets
COUNTS = [5, 8, 6]  # batches per rank in the join tests
STEPS = 8


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(17, 33)
        self.bn = nn.BatchNorm1d(33)
        self.fc2 = nn.Linear(33, 7)

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


def _batch(step: int, world: int, rank: int):
    """This rank's shard of the step's global batch (the same on every rank)."""
    g = torch.Generator().manual_seed(4242 + step)
    x, y = torch.randn(6 * world, 17, generator=g), torch.randn(6 * world, 7, generator=g)
    return x[6 * rank : 6 * rank + 6], y[6 * rank : 6 * rank + 6]


def _pair(model: nn.Module, pg, **kw):
    """fusetrain's and torch's DDP over copies of `model`."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from fusetrain.parallel import DistributedDataParallel as DDP

    return (DDP(copy.deepcopy(model), process_group=pg, bucket_cap_mb=BUCKET_CAP_MB, **kw),
            TorchDDP(copy.deepcopy(model), process_group=pg, bucket_cap_mb=BUCKET_CAP_MB, **kw))


def _step(ddp, opt, step, world, rank):
    x, y = _batch(step, world, rank)
    opt.zero_grad()
    loss = F.mse_loss(ddp(x), y)
    loss.backward()
    opt.step()
    return float(loss)


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((x.detach() - y.detach()).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


# ================================================================== hooks


def _hooks(pg):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default

    return {
        "allreduce": default.allreduce_hook,
        "fp16": default.fp16_compress_hook,
        "bf16": default.bf16_compress_hook,
    }


def sc_hooks(pg, rank, world):
    """Each one-collective hook through both DDPs, STEPS SGD-momentum steps."""
    out = {}
    for name, hook in _hooks(pg).items():
        torch.manual_seed(0)
        ours, theirs = _pair(Uneven(), pg)
        ours.register_comm_hook(pg, hook)
        theirs.register_comm_hook(pg, hook)
        o1 = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
        o2 = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9)
        for step in range(STEPS):
            _step(ours, o1, step, world, rank)
            _step(theirs, o2, step, world, rank)
        out[name] = {"diff": _max_diff(ours.module, theirs.module), "buckets": ours.bucket_indices()}
    return out


def _full_batch(step: int, world: int):
    x, y = zip(*(_batch(step, world, r) for r in range(world)))
    return torch.cat(x), torch.cat(y)


def sc_powersgd(pg, rank, world):
    """torch's powerSGD_hook on four buckets through fusetrain's DDP, against
    the same on a one-rank group trained on the whole batch (the same bucket
    layout, so the same random Qs per bucket). One power iteration is linear in the gradient given Q (P = sum_r
    M_r Q, Q' = sum_r M_r^T P), so the approximation depends only on the
    average of the ranks' (error-corrected) gradients, and the average of
    their errors follows the one-rank error: the two trainings are the same
    up to the order of float sums. (torch's own DDP cannot be the reference
    on several ranks: over gloo its PowerSGD fails with a collective
    mismatch, the chained allreduces of one bucket racing the next.)"""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

    from fusetrain.parallel import DistributedDataParallel as DDP

    alone = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    out = {}
    for name, kw in (("rank1", dict(matrix_approximation_rank=1)),
                     ("rank2_cold", dict(matrix_approximation_rank=2, warm_start=False))):
        torch.manual_seed(0)
        model = Uneven()
        ours = DDP(copy.deepcopy(model), process_group=pg, bucket_cap_mb=BUCKET_CAP_MB)
        ref = DDP(copy.deepcopy(model), process_group=alone, bucket_cap_mb=BUCKET_CAP_MB)
        state = powerSGD.PowerSGDState(process_group=pg, start_powerSGD_iter=3, random_seed=5, **kw)
        ours.register_comm_hook(state, powerSGD.powerSGD_hook)
        ref.register_comm_hook(
            powerSGD.PowerSGDState(process_group=alone, start_powerSGD_iter=3, random_seed=5, **kw),
            powerSGD.powerSGD_hook,
        )
        o1 = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
        o2 = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
        # One batch over and over: the loss must fall (fresh random batches
        # would show no trend).
        losses = []
        for _ in range(STEPS):
            losses.append(_step(ours, o1, 0, world, rank))
            x, y = _full_batch(0, world)
            o2.zero_grad()
            F.mse_loss(ref(x), y).backward()
            o2.step()
        scale = max(p.detach().abs().max().item() for p in ref.module.parameters())
        out[name] = {"diff": _max_diff(ours.module, ref.module) / scale, "losses": losses,
                     "buckets": ours.bucket_indices(), "ref_buckets": ref.bucket_indices(), "iter": state.iter,
                     "params": [p.detach().clone() for p in ours.module.parameters()]}
    return out


def sc_builtin_hooks(pg, rank, world):
    """fusetrain's C++ hooks against torch's Python ones, both through
    fusetrain's DDP: the same arithmetic in the same order, so the same bits
    (PowerSGD's random Qs included: the same seeds from the same
    numpy-RandomState sequence); four buckets."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

    from fusetrain.parallel import DistributedDataParallel as DDP

    power = dict(matrix_approximation_rank=2, start_powerSGD_iter=3, random_seed=5)
    cases = {
        "allreduce": (lambda: pg, default.allreduce_hook, {}),
        "fp16": (lambda: pg, default.fp16_compress_hook, {}),
        "bf16": (lambda: pg, default.bf16_compress_hook, {}),
        "powersgd": (lambda: powerSGD.PowerSGDState(process_group=pg, **power), powerSGD.powerSGD_hook, power),
        "powersgd_cold": (
            lambda: powerSGD.PowerSGDState(process_group=pg, **dict(power, warm_start=False)),
            powerSGD.powerSGD_hook,
            dict(power, warm_start=False),
        ),
    }
    out = {}
    for name, (make_state, hook, options) in cases.items():
        torch.manual_seed(0)
        model = Uneven()
        cpp = DDP(copy.deepcopy(model), process_group=pg, bucket_cap_mb=BUCKET_CAP_MB)
        py = DDP(copy.deepcopy(model), process_group=pg, bucket_cap_mb=BUCKET_CAP_MB)
        cpp.register_builtin_comm_hook(name.split("_")[0], **options)
        py.register_comm_hook(make_state(), hook)
        o1 = torch.optim.SGD(cpp.parameters(), lr=0.05, momentum=0.9)
        o2 = torch.optim.SGD(py.parameters(), lr=0.05, momentum=0.9)
        rng_before = torch.get_rng_state()
        for step in range(STEPS):
            _step(cpp, o1, step, world, rank)
        cpp_leaves_rng = torch.equal(torch.get_rng_state(), rng_before)
        for step in range(STEPS):
            _step(py, o2, step, world, rank)
        out[name] = {"diff": _max_diff(cpp.module, py.module), "rng_untouched": cpp_leaves_rng}
    return out


def sc_hook_errors(pg, rank, world):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default

    from fusetrain.parallel import DistributedDataParallel as DDP

    def expect(exc, fn):
        try:
            fn()
        except exc as e:
            return str(e)
        raise AssertionError(f"expected {exc.__name__}")

    out = {}
    ddp = DDP(Uneven(), process_group=pg, bucket_cap_mb=BUCKET_CAP_MB)
    ddp.register_comm_hook(pg, default.allreduce_hook)
    out["twice"] = expect(RuntimeError, lambda: ddp.register_comm_hook(pg, default.allreduce_hook))
    late = DDP(Uneven(), process_group=pg, bucket_cap_mb=BUCKET_CAP_MB)
    x, y = _batch(0, world, rank)
    F.mse_loss(late(x), y).backward()
    out["late"] = expect(RuntimeError, lambda: late.register_comm_hook(pg, default.allreduce_hook))
    fresh = DDP(Uneven(), process_group=pg, bucket_cap_mb=BUCKET_CAP_MB)
    out["not_callable"] = expect(TypeError, lambda: fresh.register_comm_hook(pg, 3))

    def bad(state, bucket: int):
        return None

    out["annotation"] = expect(ValueError, lambda: fresh.register_comm_hook(pg, bad))
    compressed = DDP(Uneven(), process_group=pg, comm_dtype=torch.bfloat16)
    out["comm_dtype"] = expect(ValueError, lambda: compressed.register_comm_hook(pg, default.allreduce_hook))
    return out


# =================================================================== join


def _join_run(ddp, rank, world, count, **join_kw):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    with ddp.join(**join_kw):
        for step in range(count):
            _step(ddp, opt, step, world, rank)
    return [p.detach().clone() for p in ddp.module.parameters()] + [b.clone() for b in ddp.module.buffers()]


def sc_join(pg, rank, world):
    out = {}
    for name, model_cls, kw in (
        ("initial_world", Uneven, {}),
        ("active_ranks", Uneven, {"divide_by_initial_world_size": False}),
        ("batch_norm", WithBatchNorm, {}),
    ):
        torch.manual_seed(0)
        ours, theirs = _pair(model_cls(), pg)
        a = _join_run(ours, rank, world, COUNTS[rank], **kw)
        b = _join_run(theirs, rank, world, COUNTS[rank], **kw)
        out[name] = {"diff": max((x - y).abs().max().item() for x, y in zip(a, b)), "state": a}
    return out


def sc_join_with_zero(pg, rank, world):
    """DDP inside Join([ddp, ZeroRedundancyOptimizer]): two joinables."""
    from torch.distributed.algorithms.join import Join
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def run(ddp):
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, process_group=pg, lr=0.05)
        with Join([ddp, opt]):
            for step in range(COUNTS[rank]):
                _step(ddp, opt, step, world, rank)
        return [p.detach().clone() for p in ddp.module.parameters()]

    torch.manual_seed(0)
    ours, theirs = _pair(Uneven(), pg)
    a, b = run(ours), run(theirs)
    return {"diff": max((x - y).abs().max().item() for x, y in zip(a, b)), "state": a}


def sc_join_throw(pg, rank, world):
    """throw_on_early_termination: every rank raises, at the same step."""

    def run(ddp):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        steps = 0
        try:
            with ddp.join(throw_on_early_termination=True):
                for step in range(COUNTS[rank]):
                    _step(ddp, opt, step, world, rank)
                    steps += 1
        except RuntimeError as e:
            return steps, str(e)
        return steps, None

    torch.manual_seed(0)
    ours, theirs = _pair(Uneven(), pg)
    return {"ours": run(ours), "torch": run(theirs)}


SUITES = {"hooks_join": [sc_hooks, sc_powersgd, sc_builtin_hooks, sc_hook_errors, sc_join, sc_join_with_zero,
                         sc_join_throw]}


# ================================================================== tests

WORLDS = [2, 3]


@pytest.fixture(scope="module", params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def run(request, tmp_path_factory):
    world = request.param
    return world, launch(Path(__file__), world, "hooks_join", tmp_path_factory.mktemp(f"hooks{world}"))


# How far the two DDPs may end apart with three ranks. With two, a sum of two
# values is the same in any order and the runs agree bit for bit. With three,
# gloo's ring adds the ranks' values in an order set by where the buffer's
# chunks fall, and the two DDPs' buffers (the same values, another bucket
# layout after the rebuild) are cut differently: fp32 sums an ulp apart, and
# an ulp flips a 16-bit rounding of the compressed gradient now and then.
# Bound: lr * (the momentum's weights over STEPS, < 6) * max|grad| (< 1 here)
# * the unit roundoff of the communicated dtype (fp32: 1e-6 as elsewhere).
HOOK_TOL_WORLD3 = {"allreduce": 1e-6, "fp16": 0.05 * 6 * 2.0**-11, "bf16": 0.05 * 6 * 2.0**-8}


@pytest.mark.parametrize("hook", ["allreduce", "fp16", "bf16"])
def test_torch_hooks_run_unchanged_and_match_torch_ddp(run, hook):
    world, results = run
    tol = 0.0 if world == 2 else HOOK_TOL_WORLD3[hook]
    for rank, d in enumerate(findings(results, "hooks")):
        assert len(d[hook]["buckets"]) == 4, d[hook]["buckets"]
        assert d[hook]["diff"] <= tol, f"rank {rank}: {hook} through fusetrain's DDP differs from torch's by {d[hook]['diff']}"


@pytest.mark.parametrize("case", ["rank1", "rank2_cold"])
def test_torch_powersgd_over_many_buckets_equals_one_rank_on_the_whole_batch(run, case):
    world, results = run
    found = findings(results, "powersgd")
    for rank, d in enumerate(found):
        c = d[case]
        assert len(c["buckets"]) == 4 and c["iter"] == STEPS
        # Float sums in another order (allreduce vs one batch), through an
        # orthogonalisation each step: bound 1e-5 relative to max|param|.
        assert c["diff"] <= 1e-5, f"rank {rank}: {c['diff']:.2e} relative to the one-rank run"
        assert c["losses"][-1] < c["losses"][0], c["losses"]
        for a, b in zip(c["params"], found[0][case]["params"]):
            assert torch.equal(a, b), f"rank {rank}'s model left rank 0's"


@pytest.mark.parametrize("hook", ["allreduce", "fp16", "bf16", "powersgd", "powersgd_cold"])
def test_cpp_hooks_equal_torchs_python_hooks(run, hook):
    _, results = run
    for rank, d in enumerate(findings(results, "builtin_hooks")):
        assert d[hook]["diff"] == 0.0, f"rank {rank}: the C++ {hook} hook differs by {d[hook]['diff']}"
        assert d[hook]["rng_untouched"], "the C++ hook must leave torch's global generator alone"


def test_hook_registration_errors(run):
    _, results = run
    for d in findings(results, "hook_errors"):
        assert "can only be called once" in d["twice"]
        assert "before the first forward" in d["late"]
        assert "must be callable" in d["not_callable"]
        assert "bucket annotation" in d["annotation"]
        assert "comm_dtype" in d["comm_dtype"]


@pytest.mark.parametrize("case", ["initial_world", "active_ranks", "batch_norm"])
def test_join_uneven_inputs_match_torch(run, case):
    world, results = run
    found = findings(results, "join")
    for rank, d in enumerate(found):
        assert d[case]["diff"] <= (0.0 if world == 2 else 1e-6), (rank, d[case]["diff"])
        # Every rank ends with the last joiner's model.
        for a, b in zip(d[case]["state"], found[0][case]["state"]):
            assert torch.equal(a, b), f"rank {rank} ends with another model than rank 0"


def test_join_with_another_joinable_matches_torch(run):
    world, results = run
    for d in findings(results, "join_with_zero"):
        assert d["diff"] <= (0.0 if world == 2 else 1e-6), d["diff"]


def test_join_throw_on_early_termination_raises_everywhere_like_torch(run):
    world, results = run
    found = findings(results, "join_throw")
    for d in found:
        assert d["ours"][1] is not None and "exhausted" in d["ours"][1], d["ours"]
        assert d["ours"] == d["torch"]
    # Each rank stops at the fewest batches any rank has.
    assert {d["ours"][0] for d in found} == {min(COUNTS[:world])}


if __name__ == "__main__":
    worker_main(sys.argv[1:], SUITES)

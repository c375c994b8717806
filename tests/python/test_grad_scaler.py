"""fusetrain.amp.GradScaler against torch.amp.GradScaler("cpu"), side by side.

Every recipe of torch's "Automatic Mixed Precision examples" page runs twice,
once with each scaler, on identical models and data; parameters, optimizer
state and the scaler's state must match bit for bit wherever the maths is the
same. Then the parts beyond torch: skipped-step reporting, max_scale,
hysteresis, fp16 gradients on CPU, errors that name the parameter at fault.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusetrain.amp as famp
from conftest import (
    SCALERS,
    assert_bits_equal,
    assert_params_equal,
    assert_state_equal,
    make_batches,
    make_model,
    optimizer_state_snapshot,
    params_of,
)

TorchScaler = torch.amp.GradScaler
OurScaler = famp.GradScaler

INF, NAN = float("inf"), float("nan")

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    # fused=True on CPU sets _step_supports_amp_scaling: the scaler must hand
    # it grad_scale / found_inf tensors instead of unscaling itself.
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
}


def snapshot(model, optimizers, scaler) -> dict:
    if not isinstance(optimizers, (list, tuple)):
        optimizers = [optimizers]
    return {
        "params": params_of(model) if not isinstance(model, (list, tuple))
        else [p for m in model for p in params_of(m)],
        "opt_state": [optimizer_state_snapshot(o) for o in optimizers],
        "scale": scaler.get_scale(),
        "state_dict": scaler.state_dict(),
    }


def assert_traces_equal(ours: list, theirs: list) -> None:
    assert len(ours) == len(theirs)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        for i, (pa, pb) in enumerate(zip(a["params"], b["params"])):
            assert_bits_equal(pa, pb, f"step {step}: parameter {i}")
        for sa, sb in zip(a["opt_state"], b["opt_state"]):
            assert_state_equal(sa, sb, f"step {step}: optimizer")
        assert a["scale"] == b["scale"], f"step {step}: scale {a['scale']} != {b['scale']}"
        assert a["state_dict"] == b["state_dict"], f"step {step}: state_dict"
        assert list(a["state_dict"]) == list(b["state_dict"]), f"step {step}: state_dict key order"


def assert_exercised_growth_and_backoff(trace: list) -> None:
    """The recipe must have grown and backed off the scale, or it tests too little."""
    scales = [s["scale"] for s in trace]
    assert any(b > a for a, b in zip(scales, scales[1:])), f"scale never grew: {scales}"
    assert any(b < a for a, b in zip(scales, scales[1:])), f"scale never backed off: {scales}"


def twin(recipe, *args, **kwargs):
    theirs = recipe(TorchScaler, *args, **kwargs)
    ours = recipe(OurScaler, *args, **kwargs)
    assert_traces_equal(ours, theirs)
    return ours


# ------------------------------------------------------------- the recipes
# torch's "Automatic Mixed Precision examples": CPU autocast in bfloat16 for
# the forward pass, float32 parameters (float32 gradients).


def recipe_typical(Scaler, opt_name, steps=9, inject=(4,)):
    model = make_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    scaler = Scaler("cpu", init_scale=2.0**12, growth_interval=2)
    trace = []
    for i, (x, y) in enumerate(make_batches(steps)):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
            loss = F.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        if i in inject:
            model.fc2.weight.grad[1, 3] = INF
        scaler.step(opt)
        scaler.update()
        trace.append(snapshot(model, opt, scaler))
    return trace


def recipe_clipping(Scaler, opt_name, steps=9, inject=(3,)):
    model = make_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    scaler = Scaler("cpu", init_scale=2.0**10, growth_interval=2)
    trace = []
    for i, (x, y) in enumerate(make_batches(steps)):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if i in inject:
            model.fc1.bias.grad[0] = NAN
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
        scaler.step(opt)
        scaler.update()
        trace.append(snapshot(model, opt, scaler))
    return trace


def recipe_accumulation(Scaler, opt_name, steps=12, accumulate=3, inject=(5,)):
    model = make_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    scaler = Scaler("cpu", init_scale=2.0**8, growth_interval=1)
    trace = []
    for i, (x, y) in enumerate(make_batches(steps)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(model(x).float(), y) / accumulate
        scaler.scale(loss).backward()
        if i in inject:
            model.fc2.bias.grad[2] = -INF
        if (i + 1) % accumulate == 0:
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            trace.append(snapshot(model, opt, scaler))
    return trace


def recipe_two_models(Scaler, opt1_name, steps=8, inject=(2,)):
    """One scaler, two models, two losses, two optimizers; overflow only in
    model1's gradients: optimizer0 still steps, optimizer1 skips, the scale
    backs off (per-optimizer inf checks, torch's semantics)."""
    model0, model1 = make_model(seed=0), make_model(seed=1)
    opt0 = torch.optim.SGD(model0.parameters(), lr=0.05, momentum=0.5)
    opt1 = OPTIMIZERS[opt1_name](model1.parameters())
    scaler = Scaler("cpu", init_scale=2.0**9, growth_interval=2)
    trace = []
    for i, (x, y) in enumerate(make_batches(steps)):
        opt0.zero_grad()
        opt1.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out0 = model0(x).float()
            out1 = model1(x).float()
            loss0 = F.mse_loss(2 * out0 + 3 * out1, y)
            loss1 = F.mse_loss(3 * out0 - 5 * out1, y)
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        if i in inject:
            model1.fc1.weight.grad[0, 0] = INF
        scaler.unscale_(opt0)
        torch.nn.utils.clip_grad_norm_(model0.parameters(), max_norm=1.0)
        before0, before1 = params_of(model0), params_of(model1)
        scaler.step(opt0)
        scaler.step(opt1)
        if i in inject:
            assert any(not torch.equal(a, b) for a, b in zip(before0, params_of(model0)))
            for a, b in zip(before1, params_of(model1)):
                assert torch.equal(a, b)
        scaler.update()
        trace.append(snapshot([model0, model1], [opt0, opt1], scaler))
    return trace


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_typical_loop_matches_torch(opt_name):
    assert_exercised_growth_and_backoff(twin(recipe_typical, opt_name))


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_clipping_after_unscale_matches_torch(opt_name):
    assert_exercised_growth_and_backoff(twin(recipe_clipping, opt_name))


@pytest.mark.parametrize("opt_name", ["sgd", "adamw_fused"])
def test_gradient_accumulation_matches_torch(opt_name):
    assert_exercised_growth_and_backoff(twin(recipe_accumulation, opt_name))


@pytest.mark.parametrize("opt1_name", ["adam", "adamw_fused"])
def test_two_models_two_optimizers_matches_torch(opt1_name):
    assert_exercised_growth_and_backoff(twin(recipe_two_models, opt1_name))


# ------------------------------------------- the growth/backoff state machine


def drive(scaler, overflows, n_optimizers=1, which=None, seed=0):
    """Runs scale/backward/step/update once per entry of `overflows` (True:
    an inf in the gradient) and records get_scale() and state_dict() after
    each update."""
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(5, generator=g)) for _ in range(n_optimizers)]
    opts = [torch.optim.SGD([p], lr=0.01) for p in params]
    record = []
    for step, flag in enumerate(overflows):
        for o in opts:
            o.zero_grad()
        loss = sum((p * p).sum() for p in params)
        scaler.scale(loss).backward()
        if flag:
            for k in (which[step] if which is not None else (0,)):
                params[k].grad[step % 5] = INF
        for o in opts:
            scaler.step(o)
        scaler.update()
        record.append((scaler.get_scale(), scaler.state_dict()))
    return record


@pytest.mark.parametrize(
    "growth_factor,backoff_factor,growth_interval",
    [(2.0, 0.5, 1), (2.0, 0.5, 3), (1.5, 0.7, 2), (3.0, 0.25, 5), (1.0001, 0.999, 4)],
)
def test_growth_backoff_sequence_matches_torch(growth_factor, backoff_factor, growth_interval):
    rng = random.Random(growth_interval)
    overflows = [rng.random() < 0.3 for _ in range(40)]
    kw = dict(init_scale=2.0**10, growth_factor=growth_factor, backoff_factor=backoff_factor,
              growth_interval=growth_interval)
    theirs = drive(TorchScaler("cpu", **kw), overflows)
    ours = drive(OurScaler("cpu", **kw), overflows)
    for step, ((sa, da), (sb, db)) in enumerate(zip(ours, theirs)):
        assert sa == sb, f"step {step}: scale {sa} != torch's {sb}"
        assert da == db, f"step {step}: state_dict {da} != torch's {db}"
        assert type(da["_growth_tracker"]) is type(db["_growth_tracker"]) is int


def test_two_optimizers_overflowing_together_back_off_once():
    rng = random.Random(7)
    overflows = [rng.random() < 0.4 for _ in range(30)]
    which = [rng.choice([(0,), (1,), (0, 1)]) for _ in range(30)]
    assert any(len(w) == 2 and f for w, f in zip(which, overflows))
    kw = dict(init_scale=2.0**6, growth_interval=2)
    theirs = drive(TorchScaler("cpu", **kw), overflows, n_optimizers=2, which=which)
    ours = drive(OurScaler("cpu", **kw), overflows, n_optimizers=2, which=which)
    assert ours == theirs


def test_update_with_new_scale_matches_torch():
    scalers = [TorchScaler("cpu", init_scale=8.0, growth_interval=2), OurScaler("cpu", init_scale=8.0, growth_interval=2)]
    for s in scalers:
        drive(s, [False])  # growth tracker at 1
        s.scale(torch.ones(()))
        s.update(1234.5)
        assert s.get_scale() == 1234.5
        s.update(torch.tensor(0.75))  # torch needs a 0-d tensor here
        assert s.get_scale() == 0.75
    assert scalers[0].state_dict() == scalers[1].state_dict()
    # The next update continues torch's state machine from the set scale.
    a, b = (drive(s, [False, False, True]) for s in scalers)
    assert a == b


def test_getters_setters_match_torch():
    t, o = TorchScaler("cpu"), OurScaler("cpu")
    for s in (t, o):
        assert s.get_scale() == 2.0**16  # init_scale before the first scale()
        s.set_growth_factor(3.0)
        s.set_backoff_factor(0.25)
        s.set_growth_interval(7)
        assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (3.0, 0.25, 7)
        assert s.is_enabled()
    assert o.state_dict() == t.state_dict()
    # The new factors govern the next updates.
    assert drive(o, [True] + [False] * 7) == drive(t, [True] + [False] * 7)


def test_scale_of_nested_outputs_matches_torch():
    def outputs():
        return [torch.tensor(1.5), (torch.tensor([2.0, -3.0]), [torch.tensor(0.25, dtype=torch.bfloat16)])]

    a = TorchScaler("cpu", init_scale=4.0).scale(outputs())
    b = OurScaler("cpu", init_scale=4.0).scale(outputs())

    def flatten(v):
        if isinstance(v, torch.Tensor):
            return [v]
        return [x for item in v for x in flatten(item)]

    assert type(b) is list and type(b[1]) is tuple and type(b[1][1]) is list
    for x, y in zip(flatten(b), flatten(a), strict=True):
        assert_bits_equal(x, y, "scaled output")
    # A generator is scaled lazily, as torch does.
    lazy = OurScaler("cpu", init_scale=4.0).scale(t for t in [torch.tensor(1.0), torch.tensor(2.0)])
    assert [float(t) for t in lazy] == [4.0, 8.0]
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        OurScaler("cpu").scale([torch.ones(()), 3.0])


def test_stage_machine_matches_torch():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = OurScaler("cpu")
    assert s._stage(opt) is famp.OptState.READY
    s.scale(model(torch.randn(2, 12)).sum()).backward()
    s.unscale_(opt)
    assert s._stage(opt) is famp.OptState.UNSCALED
    s.step(opt)
    assert s._stage(opt) is famp.OptState.STEPPED
    s.update()
    assert s._stage(opt) is famp.OptState.READY


# --------------------------- power-of-two scales are exact on fp32 gradients


@pytest.mark.parametrize("scaler_name", list(SCALERS))
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_pow2_scaling_gives_bit_identical_training(scaler_name, opt_name):
    """Scaling by 2^k and unscaling by 2^-k is exact in fp32, so training with
    the scaler must equal training without it. (torch's scaler is run too, as
    a check of the premise.)"""
    batches = make_batches(8)
    plain, scaled = make_model(), make_model()
    opt_plain = OPTIMIZERS[opt_name](plain.parameters())
    opt_scaled = OPTIMIZERS[opt_name](scaled.parameters())
    scaler = SCALERS[scaler_name]("cpu", init_scale=2.0**10, growth_interval=2)
    scales = []
    for x, y in batches:
        opt_plain.zero_grad()
        F.mse_loss(plain(x), y).backward()
        opt_plain.step()

        opt_scaled.zero_grad()
        scaler.scale(F.mse_loss(scaled(x), y)).backward()
        scaler.step(opt_scaled)
        scaler.update()
        scales.append(scaler.get_scale())
        assert_params_equal(scaled, plain, f"with scale {scales[-1]}")
        assert_state_equal(optimizer_state_snapshot(opt_scaled), optimizer_state_snapshot(opt_plain))
    assert scales[-1] == 2.0**14, scales  # it grew four times: several scales were used


# ---------------------------------------------- an overflow skips one step


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("poison", [INF, -INF, NAN])
def test_injected_overflow_skips_exactly_that_step(opt_name, poison):
    model = make_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    scaler = OurScaler("cpu", init_scale=2.0**10, growth_interval=100)
    assert scaler.found_inf is None and not scaler.step_was_skipped()
    batches = make_batches(4)

    def forward_backward(x, y):
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(x), y)).backward()

    for x, y in batches[:2]:  # the optimizer state exists before the overflow
        forward_backward(x, y)
        scaler.step(opt)
        assert not scaler.step_was_skipped()
        assert scaler.found_inf.item() == 0.0
        scaler.update()

    params_before, state_before = params_of(model), optimizer_state_snapshot(opt)
    scale_before = scaler.get_scale()
    forward_backward(*batches[2])
    model.fc1.weight.grad[3, 2] = poison
    assert scaler.step(opt) is None
    assert scaler.step_was_skipped()
    assert scaler.found_inf.item() != 0.0
    assert scaler.found_inf.device.type == "cpu"
    assert scaler.overflow_report(model.named_parameters()) == ["fc1.weight"]
    for name, a, b in zip(dict(model.named_parameters()), params_of(model), params_before):
        assert_bits_equal(a, b, f"{name} after a skipped step")
    assert_state_equal(optimizer_state_snapshot(opt), state_before, "after a skipped step")
    scaler.update()
    assert scaler.get_scale() == scale_before * 0.5
    assert scaler.state_dict()["_growth_tracker"] == 0

    # The next iteration steps again.
    forward_backward(*batches[3])
    scaler.step(opt)
    assert not scaler.step_was_skipped()
    assert scaler.overflow_report(model.named_parameters()) == []
    assert any(not torch.equal(a, b) for a, b in zip(params_of(model), params_before))
    scaler.update()
    assert scaler.get_scale() == scale_before * 0.5


def test_overflow_report_names_every_offending_parameter():
    model = make_model()
    extra = nn.Linear(3, 3)  # a parameter without a gradient is not reported
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = OurScaler("cpu")
    scaler.scale(F.mse_loss(model(torch.randn(4, 12)), torch.randn(4, 5))).backward()
    model.fc2.bias.grad[-1] = NAN
    model.fc1.weight.grad[-1, -1] = -INF
    scaler.unscale_(opt)  # the report works after unscale_ too (before step)
    named = list(model.named_parameters()) + list(extra.named_parameters())
    assert scaler.overflow_report(named) == ["fc1.weight", "fc2.bias"]
    scaler.step(opt)
    assert scaler.step_was_skipped()
    assert scaler.overflow_report(iter(named)) == ["fc1.weight", "fc2.bias"]


def test_found_inf_after_update_covers_every_optimizer():
    p0, p1 = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    o0, o1 = torch.optim.SGD([p0], lr=1.0), torch.optim.SGD([p1], lr=1.0)
    s = OurScaler("cpu")
    s.scale((p0 + p1).sum()).backward()
    p0.grad[0] = INF
    s.step(o0)
    assert s.step_was_skipped()
    s.step(o1)
    assert not s.step_was_skipped()  # the latest step: o1's
    s.update()
    assert s.step_was_skipped()  # the iteration as a whole overflowed
    assert torch.equal(p0, torch.ones(3)) and not torch.equal(p1, torch.ones(3))


# ------------------------------------------------ max_scale and hysteresis


def test_max_scale_caps_growth():
    cap = 10000.0  # not a power of two: the cap itself is a reachable scale
    ours = OurScaler("cpu", init_scale=2.0**10, growth_interval=1, max_scale=cap)
    theirs = TorchScaler("cpu", init_scale=2.0**10, growth_interval=1)
    pattern = [False] * 6 + [True] + [False] * 3
    got = [scale for scale, _ in drive(ours, pattern)]
    torch_got = [scale for scale, _ in drive(theirs, pattern)]
    assert got[:3] == torch_got[:3] == [2048.0, 4096.0, 8192.0]  # below the cap: torch's
    assert got == [2048.0, 4096.0, 8192.0, cap, cap, cap, cap / 2, cap, cap, cap]
    assert torch_got[5] == 2.0**16  # what the cap prevented
    assert ours.get_max_scale() == cap
    sd = ours.state_dict()
    assert sd["max_scale"] == cap
    fresh = OurScaler("cpu")
    assert fresh.get_max_scale() is None
    fresh.load_state_dict(sd)
    assert fresh.get_max_scale() == cap
    assert [scale for scale, _ in drive(fresh, [False])] == [cap]


@pytest.mark.parametrize("hysteresis", [1, 3])
def test_hysteresis_tolerates_n_overflows_before_backing_off(hysteresis):
    p = nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.5)
    s = OurScaler("cpu", init_scale=2.0**10, growth_interval=1000, hysteresis=hysteresis)
    assert s.get_hysteresis() == hysteresis
    for k in range(hysteresis + 1):
        before = p.detach().clone()
        opt.zero_grad()
        s.scale(p.sum()).backward()
        p.grad[1] = INF
        s.step(opt)
        assert s.step_was_skipped()
        assert torch.equal(p, before), "a tolerated overflow must still skip the step"
        s.update()
        expected = 2.0**10 if k < hysteresis else 2.0**9
        assert s.get_scale() == expected, f"after overflow {k + 1} of {hysteresis + 1}"
        assert s.state_dict()["_growth_tracker"] == 0


def test_hysteresis_tracker_survives_state_dict_round_trip():
    s = OurScaler("cpu", init_scale=2.0**10, growth_interval=1000, hysteresis=2)
    drive(s, [True])  # one of two tolerated overflows used
    sd = s.state_dict()
    assert sd["_overflow_tracker"] == 1 and sd["hysteresis"] == 2
    for resumed in (OurScaler("cpu"), pickle.loads(pickle.dumps(s))):
        if resumed.state_dict() != sd:
            resumed.load_state_dict(sd)
        assert resumed.get_hysteresis() == 2
        record = drive(resumed, [True, True])
        assert record[0][0] == 2.0**10  # second overflow: still tolerated
        assert record[1][0] == 2.0**9  # third: backs off (a lost tracker would tolerate it)


def test_default_state_dict_keys_equal_torchs():
    t, o = TorchScaler("cpu"), OurScaler("cpu")
    assert list(o.state_dict()) == list(t.state_dict())
    assert list(o.state_dict()) == ["scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"]
    drive(t, [False, True, False])
    drive(o, [False, True, False])
    assert list(o.state_dict()) == list(t.state_dict())
    assert {k: type(v) for k, v in o.state_dict().items()} == {k: type(v) for k, v in t.state_dict().items()}
    assert o.state_dict() == t.state_dict()


# ------------------------------------------------------------ checkpointing

PATTERN_A = [False, False, True, False, False, False, True, False]
PATTERN_B = [False, True, False, False, False, False, False, True, False, False]


@pytest.mark.parametrize("load_before_first_scale", [True, False])
@pytest.mark.parametrize("direction", ["torch->ours", "ours->torch"])
def test_state_dict_interchange_continues_identically(direction, load_before_first_scale):
    src_cls, dst_cls = (TorchScaler, OurScaler) if direction == "torch->ours" else (OurScaler, TorchScaler)
    src = src_cls("cpu", init_scale=2.0**7, growth_factor=1.5, backoff_factor=0.6, growth_interval=3)
    drive(src, PATTERN_A)
    sd = src.state_dict()
    assert sd["_growth_tracker"] != 0  # a mid-interval state, so the tracker matters
    dst = dst_cls("cpu", init_scale=1.0, growth_factor=4.0, backoff_factor=0.9, growth_interval=50)
    if not load_before_first_scale:
        dst.scale(torch.ones(()))  # the live tensors exist: load fills them
    dst.load_state_dict(sd)
    assert dst.state_dict() == sd
    assert dst.get_scale() == src.get_scale()
    assert drive(dst, PATTERN_B) == drive(src, PATTERN_B)


@pytest.mark.parametrize("writer", ["torch", "fusetrain"])
def test_state_dict_through_torch_save_and_load(writer):
    src = SCALERS[writer]("cpu", init_scale=2.0**5, growth_interval=3)
    drive(src, PATTERN_A)
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    for reader in SCALERS.values():
        buf.seek(0)
        sd = torch.load(buf)  # weights_only=True, torch's default
        dst = reader("cpu")
        dst.load_state_dict(sd)
        assert dst.state_dict() == src.state_dict()


def test_cpp_save_file_loads_with_torch_load(tmp_path):
    """The C++ scaler's save() writes a file Python's torch.load reads (with
    torch's default weights_only=True), and its load() reads torch.save's."""
    s = OurScaler("cpu", init_scale=2.0**5, growth_interval=3)
    drive(s, PATTERN_A)
    path = str(tmp_path / "scaler.pt")
    s._core.save(path)
    assert torch.load(path) == s.state_dict()
    assert not os.path.exists(path + ".tmp")

    t = TorchScaler("cpu", init_scale=3.0, growth_interval=5)
    drive(t, [False, False, True, False])
    torch.save(t.state_dict(), path)
    r = OurScaler("cpu")
    r._core.load(path)
    assert r.state_dict() == t.state_dict()


def test_pickle_between_iterations_continues_identically():
    s = OurScaler("cpu", init_scale=2.0**6, growth_factor=1.5, growth_interval=3, hysteresis=1, max_scale=2.0**9)
    drive(s, PATTERN_A)
    clone = pickle.loads(pickle.dumps(s))
    assert clone.state_dict() == s.state_dict()
    assert (clone.get_growth_factor(), clone.get_backoff_factor(), clone.get_growth_interval()) == (1.5, 0.5, 3)
    assert clone.get_max_scale() == 2.0**9 and clone.get_hysteresis() == 1
    assert drive(clone, PATTERN_B) == drive(s, PATTERN_B)

    # After scale() alone (nothing unscaled yet) pickling is still allowed, as in torch.
    s.scale(torch.ones(()))
    pickle.dumps(s)
    disabled = pickle.loads(pickle.dumps(OurScaler("cpu", enabled=False)))
    assert not disabled.is_enabled() and disabled.state_dict() == {}


# -------------------------------------------------------- misuse, as torch


def _iteration(scaler, model):
    scaler.scale(F.mse_loss(model(torch.randn(3, 12)), torch.randn(3, 5))).backward()


def misuse_unscale_twice(s, model, opt):
    _iteration(s, model)
    s.unscale_(opt)
    s.unscale_(opt)


def misuse_unscale_after_step(s, model, opt):
    _iteration(s, model)
    s.step(opt)
    s.unscale_(opt)


def misuse_step_twice(s, model, opt):
    _iteration(s, model)
    s.step(opt)
    s.step(opt)


def misuse_closure(s, model, opt):
    _iteration(s, model)
    s.step(opt, closure=lambda: None)


def misuse_load_empty(s, model, opt):
    s.load_state_dict({})


def misuse_update_without_step(s, model, opt):
    _iteration(s, model)
    s.update()


def misuse_step_without_gradients(s, model, opt):
    s.scale(torch.ones(()))
    s.step(opt)


def misuse_unscale_before_scale(s, model, opt):
    model(torch.randn(3, 12)).sum().backward()
    s.unscale_(opt)


def misuse_step_before_scale(s, model, opt):
    model(torch.randn(3, 12)).sum().backward()
    s.step(opt)


def misuse_update_before_scale(s, model, opt):
    s.update()


def misuse_pickle_mid_iteration(s, model, opt):
    _iteration(s, model)
    s.unscale_(opt)
    pickle.dumps(s)


def misuse_new_scale_two_elements(s, model, opt):
    _iteration(s, model)
    s.step(opt)
    s.update(torch.tensor([1.0, 2.0]))


MISUSES = {
    "unscale_twice": (misuse_unscale_twice, "unscale_() has already been called on this optimizer since the last update()."),
    "unscale_after_step": (misuse_unscale_after_step, "unscale_() is being called after step()."),
    "step_twice": (misuse_step_twice, "step() has already been called since the last update()."),
    "closure": (misuse_closure, "Closure use is not currently supported if GradScaler is enabled."),
    "load_empty": (misuse_load_empty, "The source state dict is empty"),
    "update_without_step": (misuse_update_without_step, "No inf checks were recorded prior to update."),
    "step_without_gradients": (misuse_step_without_gradients, "No inf checks were recorded for this optimizer."),
    "unscale_before_scale": (misuse_unscale_before_scale, "Attempted unscale_ but _scale is None."),
    "step_before_scale": (misuse_step_before_scale, "Attempted step but _scale is None."),
    "update_before_scale": (misuse_update_before_scale, "Attempted update but _scale is None."),
    "pickle_mid_iteration": (misuse_pickle_mid_iteration, "A GradScaler instance may only be pickled at the beginning"),
    "new_scale_two_elements": (misuse_new_scale_two_elements, "new_scale should be a float or a 1-element"),
}


@pytest.mark.parametrize(
    "opt_name,case",
    [(o, c) for o in ("sgd", "adamw_fused") for c in MISUSES
     # torch lets a fused optimizer without gradients step (a no-op); see below
     if (o, c) != ("adamw_fused", "step_without_gradients")],
)
def test_misuse_raises_torchs_error(case, opt_name):
    fn, message = MISUSES[case]
    caught = {}
    for name, Scaler in SCALERS.items():
        model = make_model()
        opt = OPTIMIZERS[opt_name](model.parameters())
        if case == "step_without_gradients":
            opt = OPTIMIZERS[opt_name](make_model(seed=3).parameters())  # no .grad anywhere
        with pytest.raises(Exception) as info:
            fn(Scaler("cpu"), model, opt)
        caught[name] = info.value
    theirs, ours = caught["torch"], caught["fusetrain"]
    assert message in str(theirs), f"the test's idea of torch's message is stale: {theirs}"
    assert type(ours) is type(theirs), f"fusetrain raised {type(ours).__name__}: {ours}; torch {type(theirs).__name__}"
    assert message in str(ours)


def test_fused_optimizer_without_gradients_steps_like_torch():
    """A fused optimizer none of whose parameters got a gradient this
    iteration (a frozen or unused model) steps as a no-op in torch, next to
    another optimizer that does the inf checks."""
    traces = []
    for Scaler in SCALERS.values():
        used, unused = make_model(seed=0), make_model(seed=1)
        opt_used = torch.optim.SGD(used.parameters(), lr=0.1)
        opt_unused = OPTIMIZERS["adamw_fused"](unused.parameters())
        s = Scaler("cpu", init_scale=2.0**6, growth_interval=1)
        for x, y in make_batches(3):
            opt_used.zero_grad()
            s.scale(F.mse_loss(used(x), y)).backward()
            s.step(opt_used)
            s.step(opt_unused)
            s.update()
        traces.append((params_of(used) + params_of(unused), s.state_dict()))
    (pa, sa), (pb, sb) = traces
    assert sa == sb and sa["scale"] == 2.0**9
    for a, b in zip(pa, pb):
        assert_bits_equal(a, b)


def test_state_survives_a_misuse_error():
    """After torch's misuse errors the iteration can still finish, as in torch."""
    traces = []
    for Scaler in SCALERS.values():
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        s = Scaler("cpu", init_scale=2.0**8, growth_interval=1)
        _iteration(s, model)
        s.unscale_(opt)
        with pytest.raises(RuntimeError):
            s.unscale_(opt)
        s.step(opt)
        with pytest.raises(RuntimeError):
            s.step(opt)
        s.update()
        traces.append((params_of(model), s.state_dict()))
    (pa, sa), (pb, sb) = traces
    assert sa == sb
    for a, b in zip(pa, pb):
        assert_bits_equal(a, b)


def test_disabled_scaler_is_a_pass_through_like_torchs():
    results = []
    for Scaler in SCALERS.values():
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        s = Scaler("cpu", enabled=False)
        loss = F.mse_loss(model(torch.randn(3, 12)), torch.randn(3, 5))
        assert s.scale(loss) is loss
        loss.backward()
        s.unscale_(opt)
        s.unscale_(opt)  # no stage machine when disabled
        s.step(opt)
        s.update()
        s.load_state_dict({})
        results.append((s.get_scale(), s.state_dict(), s.is_enabled(), params_of(model)))
    (sa, da, ea, pa), (sb, db, eb, pb) = results
    assert (sa, da, ea) == (sb, db, eb) == (1.0, {}, False)
    for a, b in zip(pa, pb):
        assert_bits_equal(a, b)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA fallback")
def test_cuda_scaler_without_cuda_warns_and_disables_like_torch():
    for Scaler in SCALERS.values():
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            s = Scaler("cuda")
        assert not s.is_enabled()
        assert any("CUDA is not available" in str(x.message) for x in w), Scaler


# ------------------------------------------------------------- bad input


def test_integer_gradient_names_the_parameter_and_changes_nothing():
    a = nn.Parameter(torch.randn(4))
    b = nn.Parameter(torch.randn(2))
    q = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b, q]}], lr=0.1)
    s = OurScaler("cpu", init_scale=8.0)
    s.scale((a.sum() + b.sum()) * 2).backward()
    q.grad = torch.ones(3, dtype=torch.int64)
    grads = [a.grad.clone(), b.grad.clone()]
    for call in (s.unscale_, s.step):
        with pytest.raises(RuntimeError, match=r"parameter 2\b.*Long"):
            call(opt)
        # validated before touching anything: nothing unscaled, stage still READY
        assert torch.equal(a.grad, grads[0]) and torch.equal(b.grad, grads[1])
        assert s._stage(opt) is famp.OptState.READY
    q.grad = None
    s.unscale_(opt)  # and the iteration can go on once the gradient is fixed
    assert torch.equal(a.grad, grads[0] / 8) and torch.equal(b.grad, grads[1] / 8)


def test_gradient_on_another_device_names_the_parameter():
    a = nn.Parameter(torch.randn(4))
    b = nn.Parameter(torch.randn(3))
    m = nn.Parameter(torch.empty(5, device="meta"))
    m.grad = torch.empty(5, device="meta")
    opt = torch.optim.SGD([{"params": [a, b]}, {"params": [m]}], lr=0.1)
    s = OurScaler("cpu", init_scale=4.0)
    s.scale(a.sum() + b.sum()).backward()
    before = [a.grad.clone(), b.grad.clone()]
    with pytest.raises(RuntimeError, match=r"parameter 2 is on meta"):
        s.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"parameter 2 is on meta"):
        s.step(opt)
    assert torch.equal(a.grad, before[0]) and torch.equal(b.grad, before[1])


def test_scale_of_outputs_on_the_wrong_device_is_an_error():
    s = OurScaler("cpu")
    with pytest.raises(RuntimeError, match=r'device="cpu"\).*outputs are on meta'):
        s.scale(torch.ones((), device="meta"))
    with pytest.raises(RuntimeError, match="outputs are on meta"):
        s.scale([torch.ones(()), (torch.ones(2, device="meta"),)])


# ------------------------------------------------ bf16 and fp16 gradients


def test_bf16_gradients_match_torchs_cpu_scaler():
    def recipe(Scaler):
        model = make_model(dtype=torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scaler = Scaler("cpu", init_scale=2.0**8, backoff_factor=0.25, growth_interval=2)
        trace = []
        for i, (x, y) in enumerate(make_batches(8, dtype=torch.bfloat16)):
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(x), y)).backward()
            assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())
            if i == 3:
                model.fc2.weight.grad[0, 0] = NAN
            scaler.step(opt)
            scaler.update()
            trace.append(snapshot(model, opt, scaler))
        return trace

    assert_exercised_growth_and_backoff(twin(recipe))


def test_fp16_gradients_on_cpu():
    """torch's CPU scaler refuses fp16 gradients; ours unscales them, exactly
    as torch's own ops would (the reference loop below), overflowing and
    backing off naturally from a too-large initial scale."""
    model = make_model(dtype=torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    t = TorchScaler("cpu")
    t.scale(F.mse_loss(model(torch.randn(2, 12, dtype=torch.float16)), torch.zeros(2, 5, dtype=torch.float16))).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        t.unscale_(opt)

    batches = make_batches(10, dtype=torch.float16)
    init, interval = 2.0**24, 2

    ref = make_model(dtype=torch.float16)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    scale = torch.full((), init)
    tracker = torch.zeros((), dtype=torch.int32)
    ref_trace = []
    for x, y in batches:
        ref_opt.zero_grad()
        (F.mse_loss(ref(x), y) * scale).backward()
        found = torch.zeros(())
        inv = scale.double().reciprocal().float()
        torch._amp_foreach_non_finite_check_and_unscale_([p.grad for p in ref.parameters()], found, inv)
        if found.item() == 0:
            ref_opt.step()
        torch._amp_update_scale_(scale, tracker, found, 2.0, 0.5, interval)
        ref_trace.append((params_of(ref), scale.item(), int(tracker)))

    ours = make_model(dtype=torch.float16)
    our_opt = torch.optim.SGD(ours.parameters(), lr=0.01)
    s = OurScaler("cpu", init_scale=init, growth_interval=interval)
    skipped = 0
    for step, (x, y) in enumerate(batches):
        our_opt.zero_grad()
        s.scale(F.mse_loss(ours(x), y)).backward()
        assert all(p.grad.dtype == torch.float16 for p in ours.parameters())
        s.step(our_opt)
        skipped += s.step_was_skipped()
        s.update()
        params, scale_ref, tracker_ref = ref_trace[step]
        for a, b in zip(params_of(ours), params):
            assert_bits_equal(a, b, f"step {step}")
        assert s.get_scale() == scale_ref and s.state_dict()["_growth_tracker"] == tracker_ref
    assert skipped > 0, "the initial scale 2^24 should overflow fp16 gradients"
    assert skipped < len(batches), "and the scaler should have backed off until steps succeed"


def test_mixed_dtype_parameters_match_torch():
    """One optimizer over float32, bfloat16 and float64 parameters."""
    def recipe(Scaler):
        torch.manual_seed(0)
        a = nn.Linear(6, 6)
        b = nn.Linear(6, 6).to(torch.bfloat16)
        c = nn.Linear(6, 2).to(torch.float64)
        model = nn.ModuleList([a, b, c])
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scaler = Scaler("cpu", init_scale=2.0**6, growth_interval=2)
        trace = []
        g = torch.Generator().manual_seed(1)
        for i in range(8):
            opt.zero_grad()
            x = torch.randn(5, 6, generator=g)
            out = c(b(a(x).bfloat16()).double())
            scaler.scale(out.pow(2).mean()).backward()
            if i == 4:
                b.weight.grad[0, 0] = INF
            scaler.step(opt)
            scaler.update()
            trace.append(snapshot(model, opt, scaler))
        return trace

    assert_exercised_growth_and_backoff(twin(recipe))


def test_sparse_gradients_match_torch():
    def recipe(Scaler):
        torch.manual_seed(0)
        emb = nn.Embedding(20, 6, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        scaler = Scaler("cpu", init_scale=2.0**6, growth_interval=2)
        trace = []
        g = torch.Generator().manual_seed(3)
        for i in range(6):
            opt.zero_grad()
            idx = torch.randint(0, 20, (9,), generator=g)
            scaler.scale(emb(idx).pow(2).sum() / 3).backward()
            assert emb.weight.grad.is_sparse
            if i == 2:
                emb.weight.grad._values()[0, 0] = INF
            scaler.step(opt)
            scaler.update()
            trace.append(snapshot(emb, opt, scaler))
        return trace

    assert_exercised_growth_and_backoff(twin(recipe))


# ------------------------- optimizers that take the scale as tensors (fused)


class RecordingFusedOptimizer(torch.optim.SGD):
    """Stands in for a fused optimizer: records what the scaler hands it."""

    _step_supports_amp_scaling = True

    def __init__(self, params):
        super().__init__(params, lr=0.1)
        self.seen = []

    def step(self, closure=None):
        self.seen.append((self.grad_scale, self.found_inf.clone()))
        return "stepped"


@pytest.mark.parametrize("unscale_first", [False, True])
def test_fused_optimizer_gets_scale_and_found_inf_tensors(unscale_first, monkeypatch):
    results = {}
    for name, Scaler in SCALERS.items():
        p = nn.Parameter(torch.ones(3))
        opt = RecordingFusedOptimizer([p])
        s = Scaler("cpu", init_scale=2.0**5)
        for inject in (False, True):
            s.scale(p.sum()).backward()
            if inject:
                p.grad[2] = INF
            if unscale_first:
                s.unscale_(opt)
            if name == "fusetrain":
                # no host sync in step for such optimizers: .item() is never called
                with monkeypatch.context() as m:
                    m.setattr(torch.Tensor, "item", lambda self: pytest.fail("host sync in step"))
                    assert s.step(opt) == "stepped"
            else:
                assert s.step(opt) == "stepped"
            assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
            s.update()
            p.grad = None
        results[name] = (opt.seen, s.state_dict())
    (seen_t, sd_t), (seen_o, sd_o) = results["torch"], results["fusetrain"]
    assert sd_o == sd_t
    for (gs_o, fi_o), (gs_t, fi_t) in zip(seen_o, seen_t, strict=True):
        if unscale_first:
            assert gs_o is None and gs_t is None
        else:
            assert isinstance(gs_o, torch.Tensor) and gs_o.dtype == torch.float32
            assert torch.equal(gs_o.reshape(()), gs_t.reshape(()))
        assert isinstance(fi_o, torch.Tensor) and fi_o.dtype == torch.float32
        assert bool(fi_o.item()) == bool(fi_t.item())
    assert [bool(f.item()) for _, f in seen_o] == [False, True]


# ------------------------------------------------------------ CUDA (GPU box)


@pytest.mark.cuda
@pytest.mark.parametrize("opt_name", ["sgd", "adamw_fused"])
def test_cuda_typical_loop_matches_torch(opt_name):
    def recipe(Scaler):
        model = make_model().cuda()
        opt = OPTIMIZERS[opt_name](model.parameters())
        scaler = Scaler("cuda", init_scale=2.0**12, growth_interval=2)
        trace = []
        for i, (x, y) in enumerate(make_batches(8)):
            x, y = x.cuda(), y.cuda()
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            if i == 3:
                model.fc2.weight.grad[1, 3] = INF
            scaler.step(opt)
            scaler.update()
            trace.append(snapshot(model, opt, scaler))
        return trace

    assert_exercised_growth_and_backoff(twin(recipe))


@pytest.mark.cuda
def test_cuda_bf16_gradients_are_unscaled():
    """torch's CUDA unscale has long lacked bf16; ours unscales bf16 grads on the GPU."""
    model = make_model(dtype=torch.bfloat16).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    s = OurScaler("cuda", init_scale=2.0**8)
    x, y = (t.cuda() for t in make_batches(1, dtype=torch.bfloat16)[0])
    s.scale(F.mse_loss(model(x), y)).backward()
    scaled = [p.grad.clone() for p in model.parameters()]
    s.unscale_(opt)
    inv = torch.tensor(2.0**-8, device="cuda")
    for p, g in zip(model.parameters(), scaled):
        assert_bits_equal(p.grad, (g.float() * inv).bfloat16(), "bf16 grad")
    s.step(opt)
    assert not s.step_was_skipped()
    s.update()
    s.scale(F.mse_loss(model(x), y)).backward()
    model.fc1.bias.grad[0] = NAN
    s.step(opt)
    assert s.step_was_skipped()
    assert s.overflow_report(model.named_parameters()) == ["fc1.bias"]

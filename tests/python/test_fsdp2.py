"""fusetrain under FSDP2 (``torch.distributed.fsdp.fully_shard``: DTensor
parameters, gradients and optimizer state), gloo on loopback, 2 and 3 ranks:
the fused optimizers, ``clip_grad_norm_``, the GradScaler, the
cross-entropies and ``torch.distributed.checkpoint``.

How it runs: one launch per world size runs this file as a script, one
process per rank (tests/python/ddp_harness.py: free ports, a 10 s timeout on
every collective, a deadline on the launch, a failing rank fails the test
with its traceback, never a hang). Every rank runs the scenarios below in
order and saves what it found; the pytest tests assert on those findings.

What is compared (Note [DTensor: local shards] in fusetrain/_dtensor.py says
how fusetrain handles DTensors):

- Training (``sc_train``, a matrix of configurations: an MLP and a small
  transformer, ``fully_shard`` per layer and at the root or at the root
  only, ``reshard_after_forward`` True and False, float32, FSDP2's
  ``MixedPrecisionPolicy(param_dtype=bfloat16)``, fusetrain's bf16 autocast,
  and bf16 parameters with ``master_weights=True``; ``max_grad_norm`` on
  and off). Model A trains with ``FusedAdamW``. Each step its sharded
  gradients are also handed to
  (1) an unsharded single-process copy stepped by ``FusedAdamW`` on the
      gathered gradients: the update is elementwise, so the shards must end
      bit for bit equal to it; with ``max_grad_norm`` the total norm is
      summed in another order (per rank, then across ranks), so within a few
      float32 roundings (NORM_ULPS) of it;
  (2) a second sharded model stepped by ``torch.optim.AdamW(fused=True)``
      after ``torch.nn.utils.clip_grad_norm_``: within Note [Trajectory
      tolerance] of test_optim.py (rtol 1e-6 of the largest magnitude; the
      two compute the update in different operation orders); the total norm
      and the clipped gradients (FusedAdamW leaves them in p.grad) within
      NORM_ULPS float32 roundings of torch's.
  For float32, A is also compared with (3) an unsharded single-process model
  trained on the whole batch (its own forward and backward) by
  ``torch.optim.AdamW(fused=True)`` + ``clip_grad_norm_``: the gradients
  differ by the roundings of a batch summed in another order (per rank, then
  the reduce-scatter), so within UNSHARDED_ATOL.
- ``clip_grad_norm_`` on DTensor gradients (2-, inf- and 1-norms) against
  torch's on the same gradients.
- fp16 with ``fusetrain.amp.GradScaler``: an inf written into one rank's
  shard only; every rank skips that step (parameters, state and step counts
  unchanged), backs off the scale alike and steps the next one; through
  ``step`` alone, through ``unscale_`` + ``clip_grad_norm_`` + ``step``, and
  with torch's unfused AdamW (the scaler's own unscale and skip).
- Checkpoints: ``torch.distributed.checkpoint`` save at step k, a fresh
  model and optimizer load it and train on: the end state equals the
  uninterrupted run bit for bit (float32, and bf16 with master weights); the
  checkpoint of FusedAdamW loads into ``torch.optim.AdamW`` and torch's into
  FusedAdamW, state bit for bit.
- The cross-entropies on DTensor logits/inputs, replicated and sharded on the
  batch, against torch's on the whole tensors: losses and gradients.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ddp_harness
from ddp_harness import findings

WORLDS = [2, 3]
STEPS = 3
LR = 1e-2
WEIGHT_DECAY = 0.1
CLIP = 0.05  # below every configuration's gradient norm: clipping is active
U32 = torch.finfo(torch.float32).eps / 2  # float32 unit roundoff
NORM_ULPS = 16  # a norm summed in another order: a few roundings per partial sum
TRACK_RTOL = 1e-6  # Note [Trajectory tolerance] (test_optim.py)
# Model A (sharded) against (3), an unsharded model with its own forward and
# backward: their gradients differ by the roundings of a batch summed in
# another order. Adam divides each gradient by its running RMS, which turns a
# rounding of a gradient that nearly cancels (a LayerNorm bias that feeds a
# bias-free attention projection) into a relative change of the step itself;
# so the bound is on the displacement: a step moves a weight by at most about
# lr, and the two runs agree on it to 2^-10 (measured: at most 2.5e-6, a
# twelfth of the bound, with 3 ranks; 2e-7 on the MLPs).
UNSHARDED_ATOL = STEPS * LR * 2.0**-10

# ===================================================================== models

MLP_IN, MLP_HIDDEN, MLP_OUT = 13, 31, 2  # odd: shards of unequal size; with 3 ranks one empty


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(MLP_IN, MLP_HIDDEN)
        self.fc2 = nn.Linear(MLP_HIDDEN, 17)
        self.fc3 = nn.Linear(17, MLP_OUT)

    def layers(self):
        return [self.fc1, self.fc2, self.fc3]

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


VOCAB, D_MODEL, HEADS, CONTEXT = 29, 12, 2, 6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL, bias=False)  # (a key bias has a zero gradient: Adam would amplify its rounding noise)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.up = nn.Linear(D_MODEL, 20)
        self.down = nn.Linear(20, D_MODEL)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.randn(CONTEXT, D_MODEL) * 0.1)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def layers(self):
        return list(self.blocks)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return MLP() if kind == "mlp" else Transformer()


def shard(model, wrap: str, reshard: bool, mp: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"reshard_after_forward": reshard}
    if mp:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if wrap == "layers":
        for layer in model.layers():
            fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def global_batches(kind: str, world: int, steps: int):
    """The whole batch of each step (4 rows per rank), the same on every rank."""
    g = torch.Generator().manual_seed(123)
    rows = 4 * world
    out = []
    for _ in range(steps):
        if kind == "mlp":
            out.append((torch.randn(rows, MLP_IN, generator=g), torch.randint(0, MLP_OUT, (rows,), generator=g)))
        else:
            tokens = torch.randint(0, VOCAB, (rows, CONTEXT + 1), generator=g)
            out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def local_rows(batch, rank):
    x, y = batch
    return x[4 * rank: 4 * rank + 4], y[4 * rank: 4 * rank + 4]


def loss_of(model, x, y, autocast: bool):
    import fusetrain.amp as famp
    from fusetrain.nn.functional import softmax_cross_entropy

    if x.is_floating_point():
        x = x.to(next(iter(model.parameters())).dtype)  # (bf16 for the bf16 models)
    if autocast:
        with famp.autocast("mixed_bfloat16", device_type="cpu"):
            logits = model(x)
    else:
        logits = model(x)
    return softmax_cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def full(t):
    """The whole tensor of a DTensor (a collective), else t."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def max_rel(a, b) -> float:
    """max |a - b| / max |b| (0 for equal empty tensors)."""
    a, b = a.detach().double(), b.detach().double()
    if b.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def bits_equal(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.detach().contiguous().view(torch.int16 if a.element_size() == 2 else torch.int32),
        b.detach().contiguous().view(torch.int16 if b.element_size() == 2 else torch.int32))


# ================================================================== scenarios

# (name, model, wrap, reshard_after_forward, precision, max_grad_norm)
CONFIGS = [
    ("mlp-layers-reshard-fp32", "mlp", "layers", True, "fp32", None),
    ("mlp-layers-keep-fp32-clip", "mlp", "layers", False, "fp32", CLIP),
    ("mlp-root-reshard-fsdp_bf16-clip", "mlp", "root", True, "fsdp_bf16", CLIP),
    ("mlp-root-keep-autocast_bf16", "mlp", "root", False, "autocast_bf16", None),
    ("mlp-layers-reshard-master_bf16-clip", "mlp", "layers", True, "master_bf16", CLIP),
    ("gpt-layers-reshard-fp32-clip", "gpt", "layers", True, "fp32", CLIP),
    ("gpt-root-keep-fp32", "gpt", "root", False, "fp32", None),
    ("gpt-layers-keep-fsdp_bf16-clip", "gpt", "layers", False, "fsdp_bf16", CLIP),
    ("gpt-layers-reshard-autocast_bf16-clip", "gpt", "layers", True, "autocast_bf16", CLIP),
    ("gpt-root-reshard-master_bf16", "gpt", "root", True, "master_bf16", None),
]


def _train_config(rank, world, kind, wrap, reshard, precision, clip):
    import fusetrain.optim as fo

    master = precision == "master_bf16"
    model = build(kind)
    if master:
        model = model.to(torch.bfloat16)
    plain = copy.deepcopy(model)  # (1): unsharded, FusedAdamW on the gathered gradients
    theirs = copy.deepcopy(model).float()  # (2): sharded, torch's fused AdamW on the same gradients
    alone = copy.deepcopy(model).float()  # (3): unsharded, its own forward and backward (float32 only)
    shard(model, wrap, reshard, mp=precision == "fsdp_bf16")
    shard(theirs, wrap, reshard, mp=False)
    kw = dict(lr=LR, weight_decay=WEIGHT_DECAY)
    ours = fo.FusedAdamW(model.parameters(), max_grad_norm=clip, master_weights=master, **kw)
    ref_plain = fo.FusedAdamW(plain.parameters(), max_grad_norm=clip, master_weights=master, **kw)
    ref_torch = torch.optim.AdamW(theirs.parameters(), fused=True, **kw)
    ref_alone = torch.optim.AdamW(alone.parameters(), fused=True, **kw)
    autocast = precision == "autocast_bf16"
    out = {"norm_err": [], "grad_err": [], "losses": []}
    for batch in global_batches(kind, world, STEPS):
        x, y = local_rows(batch, rank)
        loss = loss_of(model, x, y, autocast)
        loss.backward()
        out["losses"].append(float(loss.detach()))
        for p, q, r in zip(model.parameters(), theirs.parameters(), plain.parameters()):
            q.grad = p.grad.detach().float().clone()
            r.grad = full(p.grad).clone()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(theirs.parameters(), clip)
        ours.step()
        ref_plain.step()
        ref_torch.step()
        if clip is not None:
            out["norm_err"].append(max_rel(ours.last_grad_norm, full(norm)))
            # FusedAdamW leaves the clipped gradients in p.grad, as clip_grad_norm_ does.
            out["grad_err"].append(max(max_rel(full(p.grad).float(), full(q.grad))
                                       for p, q in zip(model.parameters(), theirs.parameters())))
        if precision == "fp32":
            ref_alone.zero_grad()
            xs, ys = batch
            logits = alone(xs)
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ys.reshape(-1)).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(alone.parameters(), clip)
            ref_alone.step()
        for o in (ours, ref_plain, ref_torch):
            o.zero_grad(set_to_none=True)
    ps = [full(p.detach()) for p in model.parameters()]
    if master:
        # The 16-bit parameters are their fp32 masters rounded; the masters
        # track torch's float32 run.
        masters = [full(ours.state[p]["master_param"]) for p in model.parameters()]
        out["params_are_rounded_masters"] = all(bits_equal(p, m.to(p.dtype)) for p, m in zip(ps, masters))
        out["masters_equal_unsharded"] = all(bits_equal(m, ref_plain.state[r]["master_param"])
                                             for m, r in zip(masters, plain.parameters()))
        tracked = masters
    else:
        tracked = ps
    out["params_equal_unsharded"] = all(bits_equal(p, r.detach()) for p, r in zip(ps, plain.parameters()))
    out["params_err_unsharded"] = max(max_rel(p.float(), r.float()) for p, r in zip(ps, plain.parameters()))
    out["params_err_torch"] = max(max_rel(t, full(q.detach())) for t, q in zip(tracked, theirs.parameters()))
    if precision == "fp32":
        out["params_err_alone"] = max(float((p - q.detach()).abs().max()) for p, q in zip(ps, alone.parameters()))
    # The state is sharded like the parameters (what checkpoints reshard).
    state = ours.state[next(iter(model.parameters()))]
    out["state_placements"] = [str(getattr(state[k], "placements", None)) for k in ("exp_avg", "exp_avg_sq")]
    out["param_placements"] = str(next(iter(model.parameters())).placements)
    out["step_count"] = float(state["step"])
    return out


def sc_train(pg, rank, world):
    return {name: _train_config(rank, world, *cfg) for name, *cfg in CONFIGS}


def sc_clip(pg, rank, world):
    """fusetrain.utils.clip_grad_norm_ on DTensor gradients against the
    norm of the whole gradients computed in float64, and against torch's
    clip_grad_norm_ where torch computes it (with 3 ranks the last one holds
    an empty shard of fc3.bias, on which torch's inf-norm raises)."""
    import fusetrain.optim as fo
    import fusetrain.utils as fu

    out = {}
    for norm_type in (2.0, float("inf"), 1.0):
        ours, theirs = shard(build("mlp"), "layers", True, False), shard(build("mlp"), "layers", True, False)
        x, y = local_rows(global_batches("mlp", world, 1)[0], rank)
        for m in (ours, theirs):
            loss_of(m, x * (1 + rank), y, False).backward()
        grads = [full(p.grad).double() for p in ours.parameters()]
        exact = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]), norm_type)
        coef = min(CLIP / (float(exact) + 1e-6), 1.0)
        n_ours = fu.clip_grad_norm_(ours.parameters(), CLIP, norm_type=norm_type)
        out[f"norm{norm_type}"] = {
            "type": type(n_ours).__name__,
            "placements": str(getattr(n_ours, "placements", None)),
            "norm_err": max_rel(full(n_ours), exact),
            "grad_err": max(max_rel(full(p.grad), g * coef) for p, g in zip(ours.parameters(), grads)),
        }
        if norm_type != float("inf") or world == 2:
            n_ref = torch.nn.utils.clip_grad_norm_(theirs.parameters(), CLIP, norm_type=norm_type)
            out[f"norm{norm_type}"]["torch_norm_err"] = max_rel(full(n_ours), full(n_ref))
    # FusedSGD(max_grad_norm) against SGD after clip_grad_norm_: SGD's step
    # is proportional to the clipped gradient.
    ours, theirs = shard(build("gpt"), "layers", True, False), shard(build("gpt"), "layers", True, False)
    o = fo.FusedSGD(ours.parameters(), lr=0.1, momentum=0.9, max_grad_norm=CLIP)
    t = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)
    for batch in global_batches("gpt", world, STEPS):
        x, y = local_rows(batch, rank)
        for m in (ours, theirs):
            loss_of(m, x, y, False).backward()
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), CLIP)
        o.step()
        t.step()
        o.zero_grad()
        t.zero_grad()
    out["sgd_params_err"] = max(max_rel(full(p.detach()), full(q.detach()))
                                for p, q in zip(ours.parameters(), theirs.parameters()))
    return out


def _scaler_run(rank, world, mode, reference=False):
    """fp16 on an FSDP2 MLP (FSDP2's MixedPrecisionPolicy(param_dtype=
    float16) for "fused", fusetrain's autocast otherwise) with
    fusetrain.amp.GradScaler; at step 1 an inf goes into the last rank's
    shard of fc2.weight only. ``reference=True``: the same training with
    no inf, that leaves out step 1 and sets the scale the skip leaves
    (``update(new_scale=...)``)."""
    import fusetrain.amp as famp
    import fusetrain.optim as fo
    import fusetrain.utils as fu
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build("mlp")
    if mode == "fused":
        for layer in model.layers():
            fully_shard(layer, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
    else:
        shard(model, "layers", True, False)
    if mode == "torch_adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    else:
        opt = fo.FusedAdamW(model.parameters(), lr=LR)
    scaler = famp.GradScaler("cpu", init_scale=2.0**10)
    out = {"skipped": [], "scales": [], "found_inf": [], "steps": []}
    for k, batch in enumerate(global_batches("mlp", world, 3)):
        if reference and k == 1:
            scaler.update(new_scale=2.0**9)
            continue
        x, y = local_rows(batch, rank)
        opt.zero_grad(set_to_none=True)
        with famp.autocast("mixed_float16" if mode != "fused" else "float32", device_type="cpu"):
            logits = model(x)
        scaler.scale(F.cross_entropy(logits.float(), y)).backward()
        if k == 1 and rank == world - 1:
            model.fc2.weight.grad.to_local()[0, 0] = float("inf")
        before = [p.detach().to_local().clone() for p in model.parameters()]
        if mode == "unscale_clip":
            scaled = [p.grad.to_local().clone() for p in model.parameters()]
            scaler.unscale_(opt)
            if k == 0:  # divided by the scale, a power of two: exactly
                inv = 1.0 / scaler.get_scale()
                out["unscaled_exactly"] = all(bits_equal(p.grad.to_local(), g * inv)
                                              for p, g in zip(model.parameters(), scaled))
            fu.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        if not reference:
            out["skipped"].append(all(torch.equal(b, p.detach().to_local())
                                      for b, p in zip(before, model.parameters())))
            out["scales"].append(scaler.get_scale())
            out["found_inf"].append(float(scaler.found_inf))
            out["steps"].append(float(opt.state[model.fc1.weight]["step"]))
    out["params"] = [full(p.detach()) for p in model.parameters()]
    return out


def sc_scaler(pg, rank, world):
    out = {}
    for mode in ("fused", "unscale_clip", "torch_adamw"):
        run, ref = _scaler_run(rank, world, mode), _scaler_run(rank, world, mode, reference=True)
        # The skipped step changed nothing: the run is the reference, bit for bit.
        run["equals_unscaled_run"] = all(bits_equal(a, b) for a, b in zip(run.pop("params"), ref["params"]))
        out[mode] = run
    return out


def _checkpoint_run(rank, world, ckpt: Path, master: bool, save_at=None, resume=False, optimizer="ours"):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import fusetrain.optim as fo

    model = build("mlp")
    if resume:
        for p in model.parameters():  # not the initial values: the checkpoint must be what counts
            p.data.normal_()
    if master:
        model = model.to(torch.bfloat16)
    shard(model, "layers", True, False)
    if optimizer == "ours":
        opt = fo.FusedAdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, master_weights=master,
                            max_grad_norm=1.0)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    batches = global_batches("mlp", world, 5)
    start = 0
    if resume:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(ckpt))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = save_at
    for k in range(start, len(batches)):
        if k == save_at and not resume:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(ckpt))
        x, y = local_rows(batches[k], rank)
        loss_of(model, x, y, False).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def _state_of(model, opt) -> list:
    """Each parameter's state as whole tensors, in parameter order."""
    out = []
    for p in model.parameters():
        s = opt.state[p]
        out.append({k: full(v).detach().clone() for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


def sc_checkpoint(pg, rank, world):
    ckpt = Path.cwd() / f"ckpt_w{world}"
    out = {}
    for master in (False, True):
        tag = "master" if master else "fp32"
        straight, so = _checkpoint_run(rank, world, ckpt / f"{tag}_unused", master)
        _checkpoint_run(rank, world, ckpt / tag, master, save_at=2)
        resumed, ro = _checkpoint_run(rank, world, ckpt / tag, master, save_at=2, resume=True)
        out[tag] = {
            "params_equal": all(bits_equal(full(p.detach()), full(q.detach()))
                                for p, q in zip(straight.parameters(), resumed.parameters())),
            "state_equal": all(a.keys() == b.keys() and all(bits_equal(a[k], b[k]) for k in a)
                               for a, b in zip(_state_of(straight, so), _state_of(resumed, ro))),
            "keys": sorted(_state_of(resumed, ro)[0].keys()),
        }
    # Ours -> torch.optim.AdamW and torch's -> ours: the state as loaded is
    # the state as saved, bit for bit (step counts as values).
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import fusetrain.optim as fo

    for src, dst in (("ours", "torch"), ("torch", "ours")):
        path = ckpt / f"{src}_to_{dst}"
        _checkpoint_run(rank, world, path, False, save_at=3, optimizer=src)
        model = shard(build("mlp"), "layers", True, False)
        if dst == "ours":
            opt = fo.FusedAdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=1.0)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        loaded = _state_of(model, opt)
        # What was saved: a run of the source optimizer stopped at step 3.
        src_model, src_opt = _stopped_run(rank, world, 3, src)
        expected = _state_of(src_model, src_opt)
        out[f"{src}_to_{dst}"] = {
            "state_equal": all(
                all(bits_equal(a[k].float() if k == "step" else a[k], b[k].float() if k == "step" else b[k])
                    for k in ("step", "exp_avg", "exp_avg_sq"))
                for a, b in zip(loaded, expected)),
            "params_equal": all(bits_equal(full(p.detach()), full(q.detach()))
                                for p, q in zip(model.parameters(), src_model.parameters())),
            "placements": str(opt.state[next(iter(model.parameters()))]["exp_avg"].placements),
        }
    return out


def _stopped_run(rank, world, steps, optimizer):
    """The first ``steps`` steps of _checkpoint_run's training."""
    import fusetrain.optim as fo

    model = shard(build("mlp"), "layers", True, False)
    if optimizer == "ours":
        opt = fo.FusedAdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=1.0)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    for batch in global_batches("mlp", world, 5)[:steps]:
        x, y = local_rows(batch, rank)
        loss_of(model, x, y, False).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def sc_cross_entropy(pg, rank, world):
    """The fused cross-entropies on DTensor inputs (a 1-D mesh of every
    rank), replicated and sharded on the batch, against torch's on the whole
    tensors: the loss (full_tensor()) and the gradients."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    from fusetrain.nn.functional import linear_cross_entropy, softmax_cross_entropy

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(7)
    rows, classes, features = 5 * world + 1, 11, 9  # uneven shards
    logits = torch.randn(rows, classes, generator=g)
    target = torch.randint(0, classes, (rows,), generator=g)
    target[::4] = -100  # some ignored
    x = torch.randn(2, rows, features, generator=g)
    target3 = torch.randint(0, classes, (2, rows), generator=g)
    target3[0, ::3] = -100
    w = torch.randn(classes, features, generator=g) * 0.3
    b = torch.randn(classes, generator=g) * 0.1
    out = {}
    for placement in ("replicate", "shard"):
        pl = [Replicate()] if placement == "replicate" else [Shard(0)]
        for reduction in ("mean", "sum", "none"):
            ref_in = logits.clone().requires_grad_()
            ref = F.cross_entropy(ref_in, target, reduction=reduction, label_smoothing=0.1)
            ref.backward(torch.ones_like(ref))
            dt = distribute_tensor(logits, mesh, pl).requires_grad_()
            loss = softmax_cross_entropy(dt, distribute_tensor(target, mesh, pl), reduction=reduction,
                                         label_smoothing=0.1)
            loss.backward(torch.ones_like(loss)) if reduction == "none" else loss.backward()
            out[f"ce-{placement}-{reduction}"] = {
                "loss_err": max_rel(full(loss), ref),
                "grad_err": max_rel(full(dt.grad), ref_in.grad),
                "grad_placements": str(dt.grad.placements),
            }
        # linear cross-entropy: [2, rows, features] sharded on its rows (dim 1),
        # the weight a replicated DTensor, the bias FSDP2-like sharded on dim 0.
        pl3 = [Replicate()] if placement == "replicate" else [Shard(1)]
        for reduction in ("mean", "sum"):
            ref_x, ref_w, ref_b = (t.clone().requires_grad_() for t in (x, w, b))
            ref = F.cross_entropy(F.linear(ref_x, ref_w, ref_b).reshape(-1, classes), target3.reshape(-1),
                                  reduction=reduction)
            ref.backward()
            dx = distribute_tensor(x, mesh, pl3).requires_grad_()
            dw = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
            db = distribute_tensor(b, mesh, [Shard(0)]).requires_grad_()
            loss = linear_cross_entropy(dx, dw, distribute_tensor(target3, mesh, pl3), linear_bias=db,
                                        reduction=reduction)
            loss.backward()
            out[f"lce-{placement}-{reduction}"] = {
                "loss_err": max_rel(full(loss), ref),
                "grad_err": max(max_rel(full(dx.grad), ref_x.grad), max_rel(full(dw.grad), ref_w.grad),
                                max_rel(full(db.grad), ref_b.grad)),
            }
    return out


def sc_errors(pg, rank, world):
    """A gradient laid out unlike its parameter is refused with a message."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    import fusetrain.optim as fo

    mesh = init_device_mesh("cpu", (world,))
    p = nn.Parameter(distribute_tensor(torch.ones(6, 4), mesh, [Shard(0)]))
    p.grad = distribute_tensor(torch.ones(6, 4), mesh, [Replicate()])
    try:
        fo.FusedAdamW([p]).step()
        message = None
    except ValueError as e:
        message = str(e)
    return {"message": message}


def sc_block_ops(pg, rank, world):
    """The fused transformer-block modules and functions under fully_shard
    (issue 52): a small block of Linear, fusetrain.nn.LayerNorm, bias + GELU,
    fusetrain.nn.RMSNorm and SwiGLU, each layer sharded, trained 3 steps with
    torch's AdamW on every rank's slice of the batch, against the same block
    of torch's modules unsharded on the whole batch; and a DTensor input
    (replicated) to layer_norm, which goes to torch's function."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor, init_device_mesh

    import fusetrain.nn as fnn
    from fusetrain.nn import functional as FF

    class Block(nn.Module):
        def __init__(self, fused):
            super().__init__()
            self.up = nn.Linear(16, 64, bias=False)
            self.up_bias = nn.Parameter(torch.zeros(64))
            self.ln = (fnn.LayerNorm if fused else nn.LayerNorm)(64)
            self.rms = (fnn.RMSNorm if fused else nn.RMSNorm)(32, eps=1e-6)
            self.down = nn.Linear(32, 4)
            self.fused = fused

        def forward(self, x):
            h = self.up(x)
            h = FF.gelu(h, "tanh", bias=self.up_bias) if self.fused else F.gelu(h + self.up_bias, approximate="tanh")
            h = self.ln(h)
            h = FF.swiglu(h) if self.fused else F.silu(h[..., :32]) * h[..., 32:]
            return self.down(self.rms(h))

    torch.manual_seed(0)
    ours, ref = Block(True), Block(False)
    ref.load_state_dict(ours.state_dict())
    for m in (ours.up, ours.ln, ours.rms, ours.down):
        fully_shard(m)
    fully_shard(ours)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x, y = torch.randn(4 * world, 16, generator=g), torch.randn(4 * world, 4, generator=g)
        for model, opt, xs, ys in ((ours, opt_ours, x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]),
                                   (ref, opt_ref, x, y)):
            opt.zero_grad()
            F.mse_loss(model(xs), ys).backward()
            opt.step()
    ref_params = dict(ref.named_parameters())
    err = max(max_rel(full(p).detach(), ref_params[n].detach()) for n, p in ours.named_parameters())
    mesh = init_device_mesh("cpu", (world,))
    xd = distribute_tensor(torch.randn(3, 64, generator=g), mesh, [Replicate()])
    out = FF.layer_norm(xd, 64)
    dtensor_ok = bool(torch.allclose(full(out), F.layer_norm(full(xd), [64]), atol=1e-6))
    return {"param_err": err, "dtensor_ok": dtensor_ok}


# The checkpoint scenarios run in a launch of their own: a failing
# torch.distributed.checkpoint call can abort the ranks' gloo (and so every
# later scenario of its launch).
SUITES = {
    "core": [sc_train, sc_clip, sc_scaler, sc_cross_entropy, sc_errors, sc_block_ops],
    "checkpoint": [sc_checkpoint],
}


# ===================================================================== tests


@pytest.fixture(scope="module", params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def core(request, tmp_path_factory):
    world = request.param
    results = ddp_harness.launch(Path(__file__), world, "core", tmp_path_factory.mktemp(f"fsdp2_w{world}"))
    return world, results


@pytest.fixture(scope="module", params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def checkpoints(request, tmp_path_factory):
    world = request.param
    results = ddp_harness.launch(Path(__file__), world, "checkpoint", tmp_path_factory.mktemp(f"fsdp2_ckpt_w{world}"))
    return world, results


@pytest.mark.parametrize("config", [c[0] for c in CONFIGS])
def test_fused_adamw_on_fsdp2_matches_unsharded_and_torch(core, config):
    world, results = core
    clip = dict((c[0], c[5]) for c in CONFIGS)[config]
    precision = dict((c[0], c[4]) for c in CONFIGS)[config]
    for rank, all_configs in enumerate(findings(results, "train")):
        d = all_configs[config]
        assert d["param_placements"] == "(Shard(dim=0),)"
        assert d["state_placements"] == ["(Shard(dim=0),)"] * 2, "state not sharded like the parameters"
        assert d["step_count"] == STEPS
        # (1) the unsharded FusedAdamW on the same gradients
        if clip is None:
            assert d["params_equal_unsharded"], (rank, d["params_err_unsharded"])
        else:
            assert d["params_err_unsharded"] <= NORM_ULPS * U32 * STEPS, (rank, d["params_err_unsharded"])
        if precision == "master_bf16":
            assert d["params_are_rounded_masters"]
            if clip is None:
                assert d["masters_equal_unsharded"]
        # (2) torch's fused AdamW + clip_grad_norm_ on the same sharded gradients
        assert d["params_err_torch"] <= TRACK_RTOL, (rank, d["params_err_torch"])
        if clip is not None:
            assert max(d["norm_err"]) <= NORM_ULPS * U32, (rank, d["norm_err"])
            # (bf16 parameters: FusedAdamW writes the clipped gradient back rounded to bf16)
            grad_u = torch.finfo(torch.bfloat16).eps / 2 if precision == "master_bf16" else 0.0
            assert max(d["grad_err"]) <= NORM_ULPS * U32 + grad_u, (rank, d["grad_err"])
        # (3) the unsharded model on the whole batch, torch's optimizer
        if precision == "fp32":
            assert d["params_err_alone"] <= UNSHARDED_ATOL, (rank, d["params_err_alone"])
    losses = [d[config]["losses"] for d in findings(results, "train")]
    assert all(len(x) == STEPS for x in losses)


@pytest.mark.parametrize("norm", ["norm2.0", "norminf", "norm1.0"])
def test_clip_grad_norm_over_all_shards_matches_torch(core, norm):
    world, results = core
    for rank, d in enumerate(findings(results, "clip")):
        e = d[norm]
        assert e["type"] == "DTensor" and e["placements"] == "(Replicate(),)", e
        assert e["norm_err"] <= NORM_ULPS * U32, (rank, e)
        assert e["grad_err"] <= NORM_ULPS * U32, (rank, e)
        if norm != "norminf" or world == 2:
            assert e["torch_norm_err"] <= NORM_ULPS * U32, (rank, e)


def test_fused_sgd_max_grad_norm_matches_torch_clip_and_sgd(core):
    world, results = core
    for rank, d in enumerate(findings(results, "clip")):
        assert d["sgd_params_err"] <= TRACK_RTOL, (rank, d["sgd_params_err"])


@pytest.mark.parametrize("mode", ["fused", "unscale_clip", "torch_adamw"])
def test_grad_scaler_inf_on_one_shard_skips_on_every_rank(core, mode):
    world, results = core
    runs = [d[mode] for d in findings(results, "scaler")]
    for rank, d in enumerate(runs):
        assert d["skipped"] == [False, True, False], (rank, d)
        assert d["found_inf"][1] != 0 and d["found_inf"][0] == 0 and d["found_inf"][2] == 0, (rank, d)
        assert d["scales"] == [2.0**10, 2.0**9, 2.0**9], (rank, d)
        assert d["steps"] == [1.0, 1.0, 2.0], (rank, d)
        assert d["equals_unscaled_run"], rank
        if mode == "unscale_clip":
            assert d["unscaled_exactly"], rank


@pytest.mark.parametrize("tag", ["fp32", "master"])
def test_checkpoint_resume_equals_uninterrupted_run(checkpoints, tag):
    world, results = checkpoints
    for rank, d in enumerate(findings(results, "checkpoint")):
        e = d[tag]
        assert e["params_equal"] and e["state_equal"], (rank, e)
        assert e["keys"] == sorted(["exp_avg", "exp_avg_sq", "step"] + (["master_param"] if tag == "master" else []))


@pytest.mark.parametrize("direction", ["ours_to_torch", "torch_to_ours"])
def test_checkpoint_loads_across_torch_adamw(checkpoints, direction):
    world, results = checkpoints
    for rank, d in enumerate(findings(results, "checkpoint")):
        e = d[direction]
        assert e["state_equal"] and e["params_equal"], (rank, e)
        assert e["placements"] == "(Shard(dim=0),)"


def test_cross_entropies_on_dtensor_inputs(core):
    world, results = core
    for rank, d in enumerate(findings(results, "cross_entropy")):
        assert len(d) == 10
        for name, e in d.items():
            # (sums over the rows in another order: a few roundings)
            assert e["loss_err"] <= NORM_ULPS * U32, (rank, name, e)
            assert e["grad_err"] <= NORM_ULPS * U32, (rank, name, e)
            if "grad_placements" in e:
                want = "(Replicate(),)" if "replicate" in name else "(Shard(dim=0),)"
                assert e["grad_placements"] == want, (rank, name, e)


def test_mismatched_gradient_layout_is_refused(core):
    world, results = core
    for d in findings(results, "errors"):
        assert d["message"] is not None and "redistribute" in d["message"], d


if __name__ == "__main__":
    ddp_harness.worker_main(sys.argv[1:], SUITES)


def test_fused_block_ops_under_fully_shard(core):
    """Sharded, the fused modules train as torch's unsharded ones: the
    parameters after 3 AdamW steps within float32 rounding of the gradients'
    sums over ranks (a few hundred ulps after Adam's division by sqrt(v));
    a DTensor input falls back to torch's function."""
    world, results = core
    for rank, d in enumerate(findings(results, "block_ops")):
        assert d["dtensor_ok"], (rank, d)
        assert d["param_err"] <= 1e-4, (rank, d)

"""fusetrain.optim.ZeroRedundancyOptimizer (ZeRO stage 1) and
DistributedDataParallel(shard_gradients=True) (stage 2) over gloo, 2 and 3
processes on loopback, against the unsharded DDP + fused optimizer on the
same data.

The runs go through ddp_harness (one launch per world runs this file as a
script, every rank runs the suite's scenarios in order on a fresh gloo group,
the tests assert on the findings; deadlines and timeouts: never a hang).

References and tolerances:
- the unsharded run (fusetrain DDP + the same fused optimizer, every rank
  holding all state) is the reference. The update is elementwise, so a
  slice gets the operations of the whole parameter; float32 parameters must
  agree within 1e-6 (the issue's bound; parameters are ~0.1), bfloat16
  parameters with fp32 master weights bit for bit;
- with clipping the global norm is summed in another order (shard norms,
  then an allreduce), so it differs from the unsharded one by a few float32
  roundings: the parameters within 1e-6 still;
- state bytes per rank are measured from the local optimizer's state
  tensors: total / N plus less than kShardAlignment (16) elements per bucket.
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

FP32_TOL = 1e-6
ALIGN = 16  # dist::kShardAlignment
SMALL_BUCKETS = 40_000  # bytes: the model below then spans several stage-1 buckets
STEPS = 20


class Odd(nn.Module):
    """Odd sizes that divide by neither 2 nor 3 (10 143 parameters)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(13, 97)
        self.fc2 = nn.Linear(97, 89)
        self.fc3 = nn.Linear(89, 5)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


D_IN, D_OUT = 13, 5


def _batch(step, n, seed=7):
    g = torch.Generator().manual_seed(seed * 100003 + step)
    return torch.randn(n, D_IN, generator=g), torch.randn(n, D_OUT, generator=g)


def _shard(t, rank, world):
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


def _flat(tensors):
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return Odd().to(dtype)


def _train(pg, rank, world, *, stage, optimizer="adamw", dtype=torch.float32, master=False,
           max_grad_norm=None, accum=1, scaler=None, poison_step=None, steps=STEPS,
           start_state=None, torch_ddp=False, bucket_view=False, lr=1e-2):
    """``steps`` steps of one configuration; stage 0 is the unsharded
    reference. Returns the model, the optimizer and per-step facts."""
    import fusetrain.amp
    import fusetrain.optim as fo
    import fusetrain.zero
    from fusetrain.parallel import DistributedDataParallel as DDP

    fusetrain.zero._BUCKET_CAP_BYTES = SMALL_BUCKETS
    model = _model(dtype)
    if torch_ddp:
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=pg)
    else:
        ddp = DDP(model, process_group=pg, shard_gradients=stage == 2, bucket_cap_mb=0.02)
    cls = fo.FusedAdamW if optimizer == "adamw" else fo.FusedSGD
    kwargs = dict(lr=lr, master_weights=master, max_grad_norm=max_grad_norm)
    if optimizer == "sgd":
        kwargs["momentum"] = 0.9
    if stage == 0:
        opt = cls(model.parameters(), **kwargs)
    else:
        opt = fo.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, process_group=pg,
                                         parameters_as_bucket_view=bucket_view, **kwargs)
    if start_state is not None:
        opt.load_state_dict(start_state)
    scaler = fusetrain.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=4) if scaler else None
    facts = {"grad_none": [], "skipped": [], "scale": []}
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accum):
            x, y = _batch(step * accum + micro, 4 * world)
            xs, ys = _shard(x, rank, world).to(dtype), _shard(y, rank, world).to(dtype)
            if poison_step == step and rank == world - 1:
                xs[0, 0] = float("inf")  # this rank's gradients only
            last = micro == accum - 1
            ctx = ddp.no_sync() if not last else torch.enable_grad()
            with ctx:
                loss = F.mse_loss(ddp(xs).float(), ys.float())
                (scaler.scale(loss) if scaler else loss).backward()
        facts["grad_none"].append(all(p.grad is None for p in model.parameters()))
        before = _flat(model.parameters())
        if scaler:
            scaler.step(opt)
            scaler.update()
            facts["scale"].append(scaler.get_scale())
        else:
            opt.step()
        facts["skipped"].append(bool(torch.equal(before, _flat(model.parameters()))))
    return model, opt, facts


def _compare(pg, rank, world, **kw):
    ref, _, ref_facts = _train(pg, rank, world, stage=0, **kw)
    out = {"ref_moved": float((_flat(ref.parameters()) - _flat(_model(kw.get("dtype", torch.float32)).parameters())).abs().max())}
    for stage in (1, 2):
        model, opt, facts = _train(pg, rank, world, stage=stage, **kw)
        a, b = _flat(model.parameters()), _flat(ref.parameters())
        out[stage] = {
            "max_diff": float((a - b).abs().max()),
            "equal": bool(torch.equal(a, b)),
            "facts": facts,
        }
    out["ref_facts"] = ref_facts
    return out


# ================================================================== scenarios


def sc_fp32_adamw(pg, rank, world):
    return _compare(pg, rank, world)


def sc_fp32_sgd(pg, rank, world):
    return _compare(pg, rank, world, optimizer="sgd")


def sc_bf16_master(pg, rank, world):
    return _compare(pg, rank, world, dtype=torch.bfloat16, master=True)


def sc_clipping(pg, rank, world):
    return _compare(pg, rank, world, max_grad_norm=0.05)


def sc_no_sync(pg, rank, world):
    return _compare(pg, rank, world, accum=3, steps=8)


def sc_scaler_skip(pg, rank, world):
    return _compare(pg, rank, world, scaler=True, poison_step=5, steps=12)


def sc_bf16_grads(pg, rank, world):
    from fusetrain import _C
    from fusetrain.parallel import DistributedDataParallel as DDP

    x, y = _batch(3, 4 * world)
    xs, ys = _shard(x, rank, world).bfloat16(), _shard(y, rank, world)
    full, abs_sum = [], []
    for sharded in (False, True):
        model = _model(torch.bfloat16)
        ddp = DDP(model, process_group=pg, shard_gradients=sharded, bucket_cap_mb=0.02)
        F.mse_loss(ddp(xs).float(), ys).backward()
        if not sharded:
            grads = [p.grad.reshape(-1).double() for p in model.parameters()]
            # sum_i |g_i| / N from every rank's local gradient (fp64)
            local = _model(torch.bfloat16)
            F.mse_loss(local(xs).float(), ys).backward()
            a = torch.cat([p.grad.reshape(-1).double().abs() / world for p in local.parameters()])
            torch.distributed.all_reduce(a, group=pg)
            abs_sum = a
            full = torch.cat(grads)
            continue
        pieces = ddp.reducer.grad_pieces()
        layout = [b for b in ddp.bucket_indices()]
        sizes = [p.numel() for p in model.parameters()]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        u = 2.0**-8
        excess = 0.0
        for b, (piece, idx) in enumerate(zip(pieces, layout)):
            # The bucket as the reducer lays it out (Note [Aligned bucket
            # offsets]: parameters at 16-byte aligned offsets, zeros between);
            # this rank's piece is elements [rank * P, (rank + 1) * P) of it.
            offsets = _C.compute_bucket_offsets([sizes[i] for i in idx], 2)
            flat_ref = torch.zeros(offsets[-1], dtype=torch.float64)
            flat_abs = torch.zeros(offsets[-1], dtype=torch.float64)
            for i, o in zip(idx, offsets):
                flat_ref[o : o + sizes[i]] = full[starts[i] : starts[i] + sizes[i]]
                flat_abs[o : o + sizes[i]] = abs_sum[starts[i] : starts[i] + sizes[i]]
            P = piece.numel()
            lo, hi = rank * P, min((rank + 1) * P, flat_ref.numel())
            if lo >= hi:
                continue
            mine = piece[: hi - lo].double()
            bound = 2 * (world - 1) * u * flat_abs[lo:hi] + u * flat_ref[lo:hi].abs() + 1e-30
            excess = max(excess, float(((mine - flat_ref[lo:hi]).abs() / bound).max()))
    return {"excess": excess}


def sc_aligned_views(pg, rank, world):
    """Note [Aligned bucket offsets]: every slice the local optimizer steps
    (the parameters' with parameters_as_bucket_view; the gradients', of
    gradient_as_bucket_view's p.grad in stage 1 and of the reducer's pieces in
    stage 2) starts 16-byte aligned, for the odd sizes of Odd in float32 and
    bfloat16."""
    import fusetrain.optim as fo
    import fusetrain.zero
    from fusetrain.parallel import DistributedDataParallel as DDP

    fusetrain.zero._BUCKET_CAP_BYTES = SMALL_BUCKETS
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for stage in (1, 2):
            model = _model(dtype)
            ddp = DDP(model, process_group=pg, shard_gradients=stage == 2, gradient_as_bucket_view=stage == 1,
                      bucket_cap_mb=0.02)
            opt = fo.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=fo.FusedAdamW, process_group=pg,
                                             parameters_as_bucket_view=True, lr=1e-2)
            x, y = _batch(0, 4 * world)
            opt.zero_grad()
            F.mse_loss(ddp(_shard(x, rank, world).to(dtype)).float(), _shard(y, rank, world)).backward()
            grads = opt._grad_slices()
            views = list(opt._views) + [g for g in grads if g is not None]
            out[f"{dtype}/stage{stage}"] = {
                "views": len(views),
                "grads": sum(g is not None for g in grads),
                "misaligned": sum(v.data_ptr() % 16 != 0 for v in views),
                "cut": any(begin > 0 for _p, _b, begin, _n, _o in opt._shards.slices()),
            }
            opt.step()
    return out


def sc_bucket_view(pg, rank, world):
    ref, _, _ = _train(pg, rank, world, stage=0)
    model, _, _ = _train(pg, rank, world, stage=1, bucket_view=True)
    return {"max_diff": float((_flat(model.parameters()) - _flat(ref.parameters())).abs().max())}


def sc_torch_ddp(pg, rank, world):
    """Stage 1 under torch's DistributedDataParallel."""
    ref, _, _ = _train(pg, rank, world, stage=0)
    model, _, _ = _train(pg, rank, world, stage=1, torch_ddp=True)
    return {"max_diff": float((_flat(model.parameters()) - _flat(ref.parameters())).abs().max())}


def _state_bytes(opt):
    return sum(t.numel() * t.element_size() for s in opt.optim.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def sc_memory(pg, rank, world):
    """Per-rank optimizer-state bytes (stage 1 and 2) and gradient bytes
    (stage 2) from the tensors that hold them, against the unsharded ones."""
    out = {}
    ref, ref_opt, _ = _train(pg, rank, world, stage=0, steps=2, dtype=torch.bfloat16, master=True)
    out["full_state"] = sum(t.numel() * t.element_size() for s in ref_opt.state.values() for t in s.values()
                            if isinstance(t, torch.Tensor) and t.dim() > 0)
    out["full_grads"] = sum(p.grad.numel() * p.grad.element_size() for p in ref.parameters())
    for stage in (1, 2):
        model, opt, _ = _train(pg, rank, world, stage=stage, steps=2, dtype=torch.bfloat16, master=True)
        out[stage] = {"state": _state_bytes(opt), "buckets": len(opt._shards.piece_numels())}
        if stage == 2:
            # A backward without a step: what the rank holds of the gradients.
            x, y = _batch(99, 4 * world)
            opt.zero_grad()
            ddp = opt._ddp
            F.mse_loss(ddp(_shard(x, rank, world).bfloat16()).float(), _shard(y, rank, world)).backward()
            out[stage]["grads"] = sum(t.numel() * t.element_size() for t in ddp.reducer.grad_pieces())
            out[stage]["p_grad_bytes"] = sum(p.grad.numel() * p.grad.element_size()
                                             for p in model.parameters() if p.grad is not None)
    return out


def sc_state_to_torch(pg, rank, world):
    """consolidate_state_dict(0) then state_dict() on rank 0: the unsharded
    FusedAdamW state, which loads into torch.optim.AdamW and then steps as
    the unsharded run does."""
    import fusetrain.optim as fo

    ref, ref_opt, _ = _train(pg, rank, world, stage=0, steps=6)
    out = {}
    for stage in (1, 2):
        model, opt, _ = _train(pg, rank, world, stage=stage, steps=6)
        opt.consolidate_state_dict(to=0)
        if rank != 0:
            try:
                opt.state_dict()
                out[stage] = {"raised": False}
            except RuntimeError as e:
                out[stage] = {"raised": "consolidated" in str(e)}
            continue
        # Copies: torch's load_state_dict keeps the very tensors it is given.
        sd = copy.deepcopy(opt.state_dict())
        want = copy.deepcopy(ref_opt.state_dict())
        same_keys = sd["state"].keys() == want["state"].keys() and all(
            list(sd["state"][i].keys()) == list(want["state"][i].keys()) for i in want["state"])
        diff = max(float((sd["state"][i][k].double() - want["state"][i][k].double()).abs().max())
                   for i in want["state"] for k in want["state"][i])
        groups_same = [{k: v for k, v in g.items()} for g in sd["param_groups"]] == want["param_groups"]
        # Into torch's AdamW: one more step there equals one more unsharded step.
        m_t = copy.deepcopy(model)
        t_opt = torch.optim.AdamW(m_t.parameters(), lr=1e-2)
        t_opt.load_state_dict(sd)
        m_f = copy.deepcopy(ref)
        f_opt = fo.FusedAdamW(m_f.parameters(), lr=1e-2)
        f_opt.load_state_dict(want)
        x, y = _batch(1234, 8)
        for m, o in ((m_t, t_opt), (m_f, f_opt)):
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
            o.step()
        out[stage] = {
            "same_keys": same_keys,
            "diff": diff,
            "groups_same": groups_same,
            "torch_step_diff": float((_flat(m_t.parameters()) - _flat(m_f.parameters())).abs().max()),
        }
    return out


def sc_unsharded_into_sharded(pg, rank, world):
    """An unsharded state (a FusedAdamW of 10 steps, the same on every rank)
    loaded into a sharded run that then takes 10 more: equals 20 unsharded."""
    _, ref10_opt, _ = _train(pg, rank, world, stage=0, steps=10)
    ref20, _, _ = _train(pg, rank, world, stage=0, steps=20)
    out = {}
    for stage in (1, 2):
        # The model at step 10, then 10 more steps from the loaded state.
        m10, _, _ = _train(pg, rank, world, stage=0, steps=10)
        import fusetrain.optim as fo
        from fusetrain.parallel import DistributedDataParallel as DDP

        ddp = DDP(m10, process_group=pg, shard_gradients=stage == 2, bucket_cap_mb=0.02)
        opt = fo.ZeroRedundancyOptimizer(m10.parameters(), optimizer_class=fo.FusedAdamW, process_group=pg, lr=1e-2)
        opt.load_state_dict(ref10_opt.state_dict())
        for step in range(10, 20):
            opt.zero_grad()
            x, y = _batch(step, 4 * world)
            F.mse_loss(ddp(_shard(x, rank, world)), _shard(y, rank, world)).backward()
            opt.step()
        out[stage] = float((_flat(m10.parameters()) - _flat(ref20.parameters())).abs().max())
    return out


def _unsharded_vs_sharded(pg, rank, world, make_opt, steps, before_step=None, after_step=None):
    """The largest parameter difference between ``steps`` steps with
    ``make_opt(params, False, pg)`` and with ``make_opt(params, True, pg)`` (fusetrain
    DDP, the data of _batch). ``before_step(step, model, opt, ddp)`` may
    return a new DDP; ``after_step(opt)`` runs after each step."""
    from fusetrain.parallel import DistributedDataParallel as DDP

    results = []
    for sharded in (False, True):
        model = _model()
        model.fc1.requires_grad_(before_step is None)
        ddp = DDP(model, process_group=pg)
        opt = make_opt([p for p in model.parameters() if p.requires_grad], sharded, pg)
        for step in range(steps):
            if before_step is not None:
                ddp = before_step(step, model, opt, ddp)
            opt.zero_grad()
            x, y = _batch(step, 4 * world)
            F.mse_loss(ddp(_shard(x, rank, world)), _shard(y, rank, world)).backward()
            opt.step()
            if after_step is not None:
                after_step(opt)
        results.append(_flat(model.parameters()))
    return {"max_diff": float((results[0] - results[1]).abs().max())}


def _adamw(cls=None):
    import fusetrain.optim as fo

    cls = cls or fo.FusedAdamW

    def make(params, sharded, pg):
        if not sharded:
            return cls(params, lr=1e-2)
        return fo.ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=pg, lr=1e-2)

    return make


def sc_lr_scheduler(pg, rank, world):
    """A scheduler on the ZeRO optimizer's param_groups drives the local one."""
    scheds = {}

    def after(opt):
        scheds.setdefault(id(opt), torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3)).step()

    return _unsharded_vs_sharded(pg, rank, world, _adamw(), 6, after_step=after)


def sc_torch_optimizer(pg, rank, world):
    """optimizer_class=torch.optim.AdamW: each rank runs torch's AdamW on its
    slices; the parameters are those of unsharded torch AdamW."""
    return _unsharded_vs_sharded(pg, rank, world, _adamw(torch.optim.AdamW), 10)


def sc_add_param_group(pg, rank, world):
    """A group added after 5 steps (an unfrozen layer): the existing state
    is kept, and the run equals the unsharded one doing the same."""

    def unfreeze(step, model, opt, ddp):
        if step != 5:
            return ddp
        model.fc1.requires_grad_(True)
        opt.add_param_group({"params": list(model.fc1.parameters()), "lr": 3e-3})
        return torch.nn.parallel.DistributedDataParallel(model, process_group=pg)

    return _unsharded_vs_sharded(pg, rank, world, _adamw(), 10, before_step=unfreeze)


class WithUnusedAndScalar(nn.Module):
    """A 0-dim parameter (a learned scale, as CLIP's logit_scale) and a
    layer no rank ever uses (find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        self.body = Odd()
        self.scale = nn.Parameter(torch.tensor(0.7))
        self.never = nn.Linear(5, 5)

    def forward(self, x):
        return self.body(x) * self.scale


def sc_review_cases(pg, rank, world):
    """Gradient accumulation without no_sync (two synchronised backward
    passes per step), a layer unused on every rank (find_unused_parameters:
    no gradient, so no weight decay either), a 0-dim parameter through
    consolidate -> load_state_dict -> more steps: stage 1 and 2 equal the
    unsharded run."""
    import fusetrain.optim as fo
    from fusetrain.parallel import DistributedDataParallel as DDP

    def run(stage, steps, state=None, start=None):
        torch.manual_seed(0)
        model = WithUnusedAndScalar()
        if start is not None:
            model.load_state_dict(start)
        ddp = DDP(model, process_group=pg, shard_gradients=stage == 2, find_unused_parameters=True,
                  bucket_cap_mb=0.02)
        # SGD: linear in the gradients, so the other rounding of an
        # accumulated sum (avg(g1) + avg(g2) here, avg(avg(g1) + g2) through
        # unsharded DDP) stays at rounding level (Adam's normalisation would
        # magnify it where a gradient is near zero); weight decay would move
        # a parameter stepped without a gradient.
        kw = dict(lr=1e-2, momentum=0.9, weight_decay=1e-2)
        opt = (fo.FusedSGD(model.parameters(), **kw) if stage == 0 else
               fo.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=fo.FusedSGD,
                                          process_group=pg, **kw))
        if state is not None:
            opt.load_state_dict(copy.deepcopy(state))
        for step in range(steps):
            opt.zero_grad()
            for micro in range(2):  # both synchronised: the gradients add up
                x, y = _batch(100 + 2 * step + micro, 4 * world)
                F.mse_loss(ddp(_shard(x, rank, world)), _shard(y, rank, world)).backward()
            opt.step()
        return model, opt

    out = {}
    ref, ref_opt = run(0, 4)
    ref_state = copy.deepcopy(ref_opt.state_dict())
    ref8, _ = run(0, 4, ref_state, ref.state_dict())
    for stage in (1, 2):
        model, opt = run(stage, 4)
        opt.consolidate_state_dict(to=0)
        everyone = [None] * world
        torch.distributed.all_gather_object(everyone, opt.state_dict() if rank == 0 else None, group=pg)
        # the unsharded state of 4 steps, loaded again, for 4 more steps
        model8, _ = run(stage, 4, everyone[0], model.state_dict())
        out[stage] = {
            "diff4": float((_flat(model.parameters()) - _flat(ref.parameters())).abs().max()),
            "diff8": float((_flat(model8.parameters()) - _flat(ref8.parameters())).abs().max()),
            "never_moved": float((model.never.weight - _model_never()).abs().max()),
        }
    out["ref_never_moved"] = float((ref.never.weight - _model_never()).abs().max())
    return out


def sc_overlap(pg, rank, world):
    """overlap_all_gather=True (bucket views): the same parameters as the
    synchronous all-gather after every step, stage 1 and 2; step returns
    with the gathers in flight, each module's forward finds its own
    parameters complete (checked against the synchronous run in a pre-hook
    that runs after the optimizer's), and the forward leaves none pending."""
    import fusetrain.optim as fo
    import fusetrain.zero
    from fusetrain.parallel import DistributedDataParallel as DDP

    fusetrain.zero._BUCKET_CAP_BYTES = SMALL_BUCKETS
    out = {}
    for stage in (1, 2):
        runs = {}
        for overlap in (False, True):
            model = _model()
            ddp = DDP(model, process_group=pg, shard_gradients=stage == 2, bucket_cap_mb=0.02)
            opt = fo.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=fo.FusedAdamW, process_group=pg,
                                             parameters_as_bucket_view=True, overlap_all_gather=overlap, lr=1e-2)
            names = {id(p): n for n, p in model.named_parameters()}
            reference = runs[False]["per_step"] if overlap else None
            now = {"step": 0}
            facts = {"pending_after_step": [], "pending_after_forward": [], "checked": 0, "stale": 0}

            def check(module, args):
                # Registered after the optimizer's global hook, so it runs
                # after it: the module's own parameters must hold the
                # synchronous run's values after the previous step.
                if reference is None or now["step"] == 0:
                    return
                for p in module.parameters(recurse=False):
                    facts["checked"] += 1
                    if not torch.equal(p.detach(), reference[now["step"] - 1][names[id(p)]]):
                        facts["stale"] += 1

            handles = [m.register_forward_pre_hook(check) for m in model.modules()]
            per_step = []
            for step in range(6):
                now["step"] = step
                opt.zero_grad()
                x, y = _batch(step, 4 * world)
                pred = ddp(_shard(x, rank, world))
                facts["pending_after_forward"].append(opt._shards.all_gather_pending())
                F.mse_loss(pred, _shard(y, rank, world)).backward()
                opt.step()
                facts["pending_after_step"].append(opt._shards.all_gather_pending())
                if not overlap:
                    per_step.append({n: p.detach().clone() for n, p in model.named_parameters()})
            opt.finish_all_gather()
            for h in handles:
                h.remove()
            runs[overlap] = {"per_step": per_step, "final": _flat(model.parameters()), "facts": facts}
        out[stage] = {
            "equal": bool(torch.equal(runs[False]["final"], runs[True]["final"])),
            "facts": runs[True]["facts"],
            "sync_facts": runs[False]["facts"],
        }
    # The process-wide forward hook lives while gathers are pending, and
    # goes with an optimizer its user drops.
    import gc

    from torch.nn.modules import module as nn_module

    before = len(nn_module._global_forward_pre_hooks)
    model = _model()
    opt = fo.ZeroRedundancyOptimizer(model.parameters(), process_group=pg, parameters_as_bucket_view=True,
                                     overlap_all_gather=True, lr=1e-2)
    x, y = _batch(0, 4 * world)
    F.mse_loss(model(_shard(x, rank, world)), _shard(y, rank, world)).backward()
    opt.step()
    hooked = len(nn_module._global_forward_pre_hooks) - before
    opt.finish_all_gather()  # (a collective's wait: every rank, before the drop)
    opt.step()
    del opt
    gc.collect()
    out["hooks"] = (hooked, len(nn_module._global_forward_pre_hooks) - before)
    try:
        fo.ZeroRedundancyOptimizer(_model().parameters(), process_group=pg, overlap_all_gather=True)
        out["refused_without_view"] = None
    except ValueError as e:
        out["refused_without_view"] = str(e)
    return out


def sc_new_storage(pg, rank, world):
    """A parameter given new storage after the optimizer was made (p.data =
    ...): its shard would be a view of the old storage, so the step raises,
    naming the parameter, on every rank (none waits in a collective)."""
    model, opt, _ = _train(pg, rank, world, stage=1, steps=1)
    model.fc2.weight.data = model.fc2.weight.data.clone()
    x, y = _batch(0, 4 * world)
    F.mse_loss(model(_shard(x, rank, world)), _shard(y, rank, world)).backward()
    try:
        opt.step()
        return None
    except RuntimeError as e:
        return str(e)


def _model_never():
    torch.manual_seed(0)
    return WithUnusedAndScalar().never.weight.detach()


def sc_rank_without_elements(pg, rank, world):
    """A model of 7 elements: with 16-element pieces only rank 0 owns any.
    With a loss scaler and an overflow on the last rank every rank takes the
    same path (no hang) and the run equals the unsharded one."""
    import fusetrain.amp
    import fusetrain.optim as fo
    from fusetrain.parallel import DistributedDataParallel as DDP

    out = {}
    for stage in (0, 1, 2):
        torch.manual_seed(0)
        model = nn.Linear(3, 1)  # 4 parameters ... plus a bias: 4 elements
        model2 = nn.Linear(1, 3)  # 6 more
        net = nn.Sequential(model, model2)
        ddp = DDP(net, process_group=pg, shard_gradients=stage == 2)
        opt = (fo.FusedAdamW(net.parameters(), lr=1e-2) if stage == 0 else
               fo.ZeroRedundancyOptimizer(net.parameters(), optimizer_class=fo.FusedAdamW, process_group=pg, lr=1e-2))
        scaler = fusetrain.amp.GradScaler("cpu", init_scale=2.0**8)
        for step in range(5):
            x = torch.randn(4, 3, generator=torch.Generator().manual_seed(step * 10 + rank))
            if step == 2 and rank == world - 1:
                x[0, 0] = float("inf")
            opt.zero_grad()
            scaler.scale(ddp(x).square().mean()).backward()
            scaler.step(opt)
            scaler.update()
        out[stage] = {"params": _flat(net.parameters()), "scale": scaler.get_scale(),
                      "owns": len(opt._views) if stage else None}
    return {
        "diff": max(float((out[s]["params"] - out[0]["params"]).abs().max()) for s in (1, 2)),
        "scales": [out[s]["scale"] for s in (0, 1, 2)],
        "owns": out[1]["owns"],
    }


def sc_mismatched_settings(pg, rank, world):
    """shard_gradients on rank 0 only: an error on every rank at construction."""
    from fusetrain.parallel import DistributedDataParallel as DDP

    try:
        DDP(_model(), process_group=pg, shard_gradients=rank == 0)
        return {"raised": False}
    except ValueError as e:
        return {"raised": True, "message": str(e)}


def sc_save_for_resume(pg, rank, world):
    """World 2 saves the consolidated state after 10 steps (stage 2)."""
    model, opt, _ = _train(pg, rank, world, stage=2, steps=10)
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, os.environ["FT_ZERO_SAVE"])
    return {}


def sc_resume_other_world(pg, rank, world):
    """World 3 resumes world 2's consolidated stage-2 state with stage 1 for
    10 more steps; the reference resumes the same state unsharded."""
    import fusetrain.optim as fo
    from fusetrain.parallel import DistributedDataParallel as DDP

    out = {}
    for stage in (0, 1):
        saved = torch.load(os.environ["FT_ZERO_SAVE"], weights_only=False)  # fresh: loads alias it
        model = _model()
        model.load_state_dict(saved["model"])
        ddp = DDP(model, process_group=pg)
        opt = (fo.FusedAdamW(model.parameters(), lr=1e-2) if stage == 0 else
               fo.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=fo.FusedAdamW, process_group=pg, lr=1e-2))
        opt.load_state_dict(saved["opt"])
        for step in range(10, 20):
            opt.zero_grad()
            x, y = _batch(step, 4 * world)
            F.mse_loss(ddp(_shard(x, rank, world)), _shard(y, rank, world)).backward()
            opt.step()
        out[stage] = _flat(model.parameters())
    return {"max_diff": float((out[0] - out[1]).abs().max()), "moved": float((out[0] - _flat(_model().parameters())).abs().max())}


def sc_nccl_world1(pg, rank, world):
    """NCCL, one GPU: stage 1 and 2 (bf16 parameters, fp32 masters, folded
    clipping, fp16-style loss scaling with one overflow) equal the unsharded
    run bit for bit; the CUDA paths of the all-gather, the reduce-scatter,
    the shard norm and the overflow flag."""
    import fusetrain.amp
    import fusetrain.optim as fo
    from fusetrain.parallel import DistributedDataParallel as DDP

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    out = {}
    for stage in (0, 1, 2):
        torch.manual_seed(0)
        model = Odd().to(dev, torch.bfloat16)
        ddp = DDP(model, device_ids=[0], process_group=pg, shard_gradients=stage == 2, bucket_cap_mb=0.02)
        kw = dict(lr=1e-2, master_weights=True, max_grad_norm=0.05)
        opt = (fo.FusedAdamW(model.parameters(), **kw) if stage == 0 else
               fo.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=fo.FusedAdamW, process_group=pg, **kw))
        scaler = fusetrain.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=4)
        skipped = []
        for step in range(12):
            x, y = (t.to(dev) for t in _batch(step, 8))
            x = x.bfloat16()
            if step == 5:
                x[0, 0] = float("inf")
            opt.zero_grad()
            scaler.scale(F.mse_loss(ddp(x).float(), y)).backward()
            scaler.step(opt)
            scaler.update()
            skipped.append(bool(scaler.found_inf.item()))
        torch.cuda.synchronize()
        out[stage] = {"params": _flat(model.parameters()).cpu(), "skipped": skipped, "scale": scaler.get_scale()}
    return {
        "equal": {s: bool(torch.equal(out[0]["params"], out[s]["params"])) for s in (1, 2)},
        "skipped": {s: out[s]["skipped"] for s in (0, 1, 2)},
        "scale": {s: out[s]["scale"] for s in (0, 1, 2)},
    }


def sc_shm_collectives(pg, rank, world):
    """Which collectives stage 1 and 2 ran through the shared-memory
    segment: the reduce-scatter and the all-gather, not gloo's forms."""
    from fusetrain.parallel import shared_memory_collectives

    counts = {}
    for stage in (1, 2):
        before = shared_memory_collectives(pg)
        _train(pg, rank, world, stage=stage, steps=3)
        after = shared_memory_collectives(pg)
        counts[stage] = {k: after[k] - before.get(k, 0) for k in after}
    return counts


SUITES = {
    "core": [sc_fp32_adamw, sc_fp32_sgd, sc_bf16_master, sc_bf16_grads, sc_clipping, sc_no_sync, sc_scaler_skip,
             sc_aligned_views, sc_bucket_view, sc_torch_ddp, sc_memory, sc_state_to_torch, sc_unsharded_into_sharded,
             sc_lr_scheduler, sc_torch_optimizer, sc_add_param_group, sc_review_cases,
             sc_rank_without_elements, sc_mismatched_settings, sc_new_storage, sc_overlap],
    "save": [sc_save_for_resume],
    "resume": [sc_resume_other_world],
    "nccl": [sc_nccl_world1],
    "shm": [sc_fp32_adamw, sc_bf16_master, sc_bf16_grads, sc_scaler_skip, sc_shm_collectives, sc_overlap],
}


def launch(world, suite, workdir, **kw):
    return ddp_harness.launch(Path(__file__), world, suite, workdir, **kw)


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def core(request, tmp_path_factory):
    world = request.param
    return world, launch(world, "core", tmp_path_factory.mktemp(f"zero_w{world}"))


def _check_equivalence(core, name, bitwise=False):
    world, results = core
    for d in findings(results, name):
        assert d["ref_moved"] > 1e-3, "the reference did not train"
        for stage in (1, 2):
            if bitwise:
                assert d[stage]["equal"], f"stage {stage} differs from unsharded by {d[stage]['max_diff']}"
            assert d[stage]["max_diff"] <= FP32_TOL, (stage, d[stage]["max_diff"])
    return findings(results, name)


def test_stage1_and_2_fp32_adamw_equal_unsharded(core):
    for d in _check_equivalence(core, "fp32_adamw"):
        assert all(d[2]["facts"]["grad_none"]), "stage 2 left p.grad set"
        assert not any(d[1]["facts"]["grad_none"])


def test_stage1_and_2_sgd_momentum_equal_unsharded(core):
    _check_equivalence(core, "fp32_sgd")


def test_bf16_master_weights_same_bits_as_unsharded(core):
    """Same bits, except stage 2 on 3 ranks: its buckets are padded to 3
    equal pieces, and the ring allreduce gloo runs on a buffer of another
    length cuts it into other chunks, so it adds the three ranks' bf16
    gradients in another order for some elements (on 2 ranks the one sum is
    commutative). A reduced gradient may then differ by the roundings of the
    sum (test_bf16_reduce_scatter_within_rounding), and Adam, which
    normalises, turns that into parameter differences of up to lr where a
    gradient is near zero: no bitwise claim there."""
    world, results = core
    for d in findings(results, "bf16_master"):
        assert d["ref_moved"] > 1e-3
        assert d[1]["equal"], f"stage 1 differs from unsharded by {d[1]['max_diff']}"
        if world == 2:
            assert d[2]["equal"], f"stage 2 differs from unsharded by {d[2]['max_diff']}"


def test_bf16_reduce_scatter_within_rounding(core):
    """Stage 2's reduced bf16 gradient pieces against unsharded DDP's
    allreduced gradients, one backward from the same parameters: two sums of
    N terms in different orders differ by at most 2 (N - 1) u sum_i |g_i|
    (u = 2^-8 for bf16, the g_i the ranks' pre-divided gradients), plus the
    final rounding. On 2 ranks they are equal."""
    world, results = core
    for d in findings(results, "bf16_grads"):
        assert d["excess"] <= (0.0 if world == 2 else 1.0), d


def test_clipping_uses_the_global_norm(core):
    _check_equivalence(core, "clipping")


def test_no_sync_accumulation(core):
    _check_equivalence(core, "no_sync")


def test_scaler_overflow_on_one_rank_skips_everywhere(core):
    for d in _check_equivalence(core, "scaler_skip"):
        for stage in (1, 2):
            f = d[stage]["facts"]
            assert f["skipped"][5] and not any(f["skipped"][:5]), f["skipped"]
            assert f["scale"] == d["ref_facts"]["scale"], (f["scale"], d["ref_facts"]["scale"])


def test_parameters_as_bucket_view(core):
    for d in findings(core[1], "bucket_view"):
        assert d["max_diff"] <= FP32_TOL


def test_optimizer_views_are_16_byte_aligned(core):
    """The fused CUDA optimizers vectorise only over 16-byte aligned arrays."""
    world, results = core
    data = findings(results, "aligned_views")
    for key in data[0]:
        for rank, d in enumerate(data):
            assert d[key]["misaligned"] == 0, f"rank {rank}, {key}: {d[key]}"
        assert sum(d[key]["grads"] for d in data) > 0, key
        assert any(d[key]["cut"] for d in data), f"{key}: no parameter is cut between ranks"


def test_stage1_under_torch_ddp(core):
    for d in findings(core[1], "torch_ddp"):
        assert d["max_diff"] <= FP32_TOL


def test_state_and_gradient_bytes_fall_as_one_over_n(core):
    world, results = core
    for d in findings(results, "memory"):
        for stage in (1, 2):
            state, buckets = d[stage]["state"], d[stage]["buckets"]
            # masters + two moments, all fp32: 12 bytes per element, a rank
            # holds at most one padded piece per bucket
            assert state < d["full_state"] / world + 12 * ALIGN * buckets, (stage, state, d["full_state"])
        grads = d[2]["grads"]
        assert d[2]["p_grad_bytes"] == 0
        assert d["full_grads"] / world <= grads < d["full_grads"] / world + 2 * ALIGN * d[2]["buckets"]
    for stage in (1, 2):  # and the ranks' states add up to the whole
        assert sum(d[stage]["state"] for d in findings(results, "memory")) == findings(results, "memory")[0]["full_state"]


def test_consolidated_state_is_unsharded_and_loads_into_torch_adamw(core):
    world, results = core
    data = findings(results, "state_to_torch")
    for stage in (1, 2):
        d0 = data[0][stage]
        assert d0["same_keys"] and d0["groups_same"]
        assert d0["diff"] <= FP32_TOL
        assert d0["torch_step_diff"] <= FP32_TOL
        for d in data[1:]:
            assert d[stage]["raised"], "state_dict() off rank `to` must raise"


def test_unsharded_state_loads_into_a_sharded_run(core):
    for d in findings(core[1], "unsharded_into_sharded"):
        assert d[1] <= FP32_TOL and d[2] <= FP32_TOL, d


def test_lr_scheduler_drives_the_local_optimizer(core):
    for d in findings(core[1], "lr_scheduler"):
        assert d["max_diff"] <= FP32_TOL


def test_torch_optimizer_class(core):
    for d in findings(core[1], "torch_optimizer"):
        assert d["max_diff"] <= FP32_TOL


def test_add_param_group_keeps_state(core):
    for d in findings(core[1], "add_param_group"):
        assert d["max_diff"] <= FP32_TOL


def test_accumulation_unused_layer_and_0dim_parameter(core):
    for d in findings(core[1], "review_cases"):
        assert d["ref_never_moved"] == 0.0  # unsharded: no gradient, no step
        for stage in (1, 2):
            assert d[stage]["never_moved"] == 0.0, (stage, d[stage])
            assert d[stage]["diff4"] <= FP32_TOL and d[stage]["diff8"] <= FP32_TOL, (stage, d[stage])


def _check_overlap(results):
    for rank, d in enumerate(findings(results, "overlap")):
        for stage in (1, 2):
            facts = d[stage]["facts"]
            assert d[stage]["equal"], f"rank {rank}, stage {stage}: overlapped parameters differ"
            assert all(facts["pending_after_step"]), f"stage {stage}: step waited for the all-gather"
            assert not any(facts["pending_after_forward"]), f"stage {stage}: the forward left gathers pending"
            assert facts["checked"] > 0 and facts["stale"] == 0, (stage, facts)
            assert not any(d[stage]["sync_facts"]["pending_after_step"])
        assert "parameters_as_bucket_view" in (d["refused_without_view"] or "")
        assert d["hooks"] == (1, 0), d["hooks"]


def test_overlapped_all_gather_equals_the_synchronous_one(core):
    _check_overlap(core[1])


def test_overlapped_all_gather_on_shared_memory(shm):
    _check_overlap(shm[1])


def test_a_parameter_with_new_storage_is_an_error_on_every_rank(core):
    for error in findings(core[1], "new_storage"):
        assert error is not None and "new storage" in error and "parameter 2" in error, error


def test_a_rank_that_owns_nothing_takes_the_same_path(core):
    world, results = core
    data = findings(results, "rank_without_elements")
    assert data[0]["owns"] > 0 and all(d["owns"] == 0 for d in data[1:])
    for d in data:
        assert d["diff"] <= FP32_TOL
        assert d["scales"][0] == d["scales"][1] == d["scales"][2] == 2.0**7  # one overflow: halved


def test_mismatched_shard_settings_fail_on_every_rank(core):
    for d in findings(core[1], "mismatched_settings"):
        assert d["raised"] and "shard_gradients" in d["message"], d


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def shm(request, tmp_path_factory):
    """The same runs on the "fusetrain" backend (gloo with the shared-memory
    collectives in front, Note [Shared-memory allreduce])."""
    world = request.param
    return world, launch(world, "shm", tmp_path_factory.mktemp(f"zero_shm_w{world}"), backend="fusetrain")


def test_on_shared_memory_stages_1_and_2_have_unsharded_bits_on_any_world(shm):
    """The segment's reduce-scatter adds the ranks in rank order, as its
    allreduce does, so here even 3 ranks give unsharded DDP's bits: fp32,
    bf16 with master weights, the reduced bf16 gradients themselves, and a
    skipped step."""
    world, results = shm
    for name in ("fp32_adamw", "bf16_master", "scaler_skip"):
        for rank, d in enumerate(findings(results, name)):
            assert d["ref_moved"] > 1e-3, "the reference did not train"
            for stage in (1, 2):
                assert d[stage]["equal"], f"{name}, rank {rank}: stage {stage} differs by {d[stage]['max_diff']}"
    for d in findings(results, "scaler_skip"):
        for stage in (1, 2):
            assert d[stage]["facts"]["skipped"] == d["ref_facts"]["skipped"]
            assert any(d[stage]["facts"]["skipped"])
    for d in findings(results, "bf16_grads"):
        assert d["excess"] == 0.0, d


def test_on_shared_memory_the_shards_move_through_the_segment(shm):
    world, results = shm
    steps = 3  # sc_shm_collectives
    for rank, counts in enumerate(findings(results, "shm_collectives")):
        assert counts[1].get("all_reduce", 0) >= steps, counts
        assert counts[2].get("reduce_scatter_tensor", 0) >= steps, counts
        for stage in (1, 2):
            assert counts[stage].get("all_gather_into_tensor", 0) >= steps, counts


def test_resume_with_another_world_size_and_stage(tmp_path, monkeypatch):
    monkeypatch.setenv("FT_ZERO_SAVE", str(tmp_path / "state.pt"))
    findings(launch(2, "save", tmp_path / "w2"), "save_for_resume")
    (d, *_) = findings(launch(3, "resume", tmp_path / "w3"), "resume_other_world")
    assert d["moved"] > 1e-3
    assert d["max_diff"] <= FP32_TOL


@pytest.mark.cuda
def test_nccl_world_size_1(tmp_path):
    import torch.distributed as dist

    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("needs a GPU and torch with NCCL")
    (d,) = findings(launch(1, "nccl", tmp_path, backend="nccl"), "nccl_world1")
    assert d["equal"][1] and d["equal"][2], d["equal"]
    assert d["skipped"][1] == d["skipped"][0] == d["skipped"][2] and d["skipped"][0][5], d["skipped"]
    assert d["scale"][1] == d["scale"][0] == d["scale"][2]


def test_overlap_with_ddp_is_refused():
    import fusetrain.optim as fo

    # Raised before anything else, so no process group is needed.
    with pytest.raises(ValueError, match="overlap_with_ddp"):
        fo.ZeroRedundancyOptimizer([torch.zeros(3, requires_grad=True)], overlap_with_ddp=True)


if __name__ == "__main__":
    ddp_harness.worker_main(sys.argv[1:], SUITES)

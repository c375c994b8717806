"""fusetrain.lightning with the real PyTorch Lightning on the CPU, 2 processes:
FusetrainPrecision and the "fusetrain_ddp" / "fusetrain_ddp_zero" strategies
against Lightning's own strategy="ddp" with its MixedPrecision plugin, on the
same model, data and initial weights.

How it runs: one launch of 2 processes (this file as a script, through
ddp_harness.launch: a TCPStore hosted by the test process on a port the
kernel picks, a deadline after which every rank is killed and the test fails
with the logs) runs every Trainer.fit of the RUNS list in order; each rank
saves what each fit found (final weights, per-step records, the checkpoint's
scaler state) and the tests compare fits. Each fit gets a process group of
its own (under a prefix of the shared store), made with the backend the
strategy itself chooses, and destroyed after the fit. The ranks see
torchrun's environment (Lightning's TorchElasticEnvironment), for some fits
with num_nodes=2 x devices=1, for one SLURM's (SLURMEnvironment). The
example's smoke test starts examples/lightning_train.py as a user does, so
Lightning's own launcher and process-group set-up run there.

What "the same" means (tolerances, per the design notes: low precision is
judged against torch's own error relative to a float32 reference):
- bit for bit where the maths is the same: fusetrain_ddp + FusetrainPrecision
  + torch.optim.AdamW against ddp + Lightning's MixedPrecision + the same
  AdamW (same autocast, the same gradient average for 2 ranks, same
  optimizer), in bf16, in fp16 with an injected inf and with manual
  optimization; a resumed run against the uninterrupted one; ZeRO against
  the unsharded optimizer; bf16 gradient communication by torch's hook,
  fusetrain's C++ hook and comm_dtype against each other;
- fusetrain's fused optimizers (FusedAdamW, FusedSGD: a few ulps from torch's
  per step): the distance (L2 over all weights) to a float32 run of the same
  configuration is at most twice that of Lightning's bf16/fp16 run.

Every fit runs 2 epochs of 4 steps per rank (batch 16 a rank).
"""

from __future__ import annotations

import argparse
import faulthandler
import math
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
EXAMPLE = ROOT / "examples" / "lightning_train.py"
LOGGING = HERE / "lightning_logging.py"

WORLD = 2
STEPS_PER_EPOCH = 4
EPOCHS = 2
BATCH = 16  # per rank
INJECT_AT = 2  # the global step whose loss rank 0 multiplies by inf
CLIP = 0.05  # gradient_clip_val of the clipping fits: well below the gradients' norm
PG_TIMEOUT_S = 30.0
DEADLINE_S = 420.0  # the whole launch (21 fits, process start-up), on a busy 2-core machine
EXAMPLE_TIMEOUT_S = 240.0
MIN_FALL = 0.02  # the example's loss falls by this fraction at least (as test_examples.py asks)

# ===================================================================== the model


def _model_class():
    """The LightningModule (defined here so the file imports without Lightning)."""
    import lightning.pytorch as pl
    import torch.nn.functional as F
    from torch import nn

    import fusetrain.optim

    class RecordingFusedAdamW(fusetrain.optim.FusedAdamW):
        """Records whether each step was handed the loss scale as a tensor
        (the scaler's sync-free path)."""

        def step(self, closure=None):
            self.took_scale = getattr(self, "took_scale", [])
            self.took_scale.append(getattr(self, "grad_scale", None) is not None)
            return super().step(closure)

    class Net(pl.LightningModule):
        def __init__(self, optimizer: str = "adamw", inject_inf_at=None, skip_step_at=None, manual=False):
            super().__init__()
            self.automatic_optimization = not manual
            self.net = nn.Sequential(nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 48), nn.GELU(), nn.Linear(48, 5))
            self.optimizer_name = optimizer
            self.inject_inf_at = inject_inf_at
            self.skip_step_at = skip_step_at
            self.losses = []

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.losses.append(float(loss.detach()))
            if self.inject_inf_at == self.global_step and self.global_rank == 0:
                loss = loss * float("inf")
            if not self.automatic_optimization:
                optimizer = self.optimizers()
                optimizer.zero_grad()
                self.manual_backward(loss)
                optimizer.step()
                return None
            return loss

        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
            # The float32 reference of the overflow runs: the step the others
            # skip for overflow is left out here (its backward still runs).
            if self.skip_step_at is not None and self.global_step == self.skip_step_at:
                self.skip_step_at = None
                optimizer_closure()
                return
            optimizer.step(closure=optimizer_closure)

        def configure_optimizers(self):
            name = self.optimizer_name
            if name == "adamw":
                return torch.optim.AdamW(self.parameters(), lr=1e-2)
            if name == "fused_adamw":
                return RecordingFusedAdamW(self.parameters(), lr=1e-2)
            if name == "sgd":
                return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)
            if name == "fused_sgd":
                return fusetrain.optim.FusedSGD(self.parameters(), lr=0.5, momentum=0.9)
            raise ValueError(name)

    return Net


def _loader():
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(1234)
    n = WORLD * STEPS_PER_EPOCH * BATCH
    x = torch.randn(n, 16, generator=g)
    teacher = torch.randn(16, 5, generator=g)
    y = (x @ teacher).argmax(dim=1)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


# ===================================================================== the fits
# name -> Trainer.fit arguments. Order matters: a resumed fit reads the
# checkpoint of an earlier one.

RUNS = [
    # bf16, AdamW
    dict(name="ref32_adamw", strategy="ddp", precision="32-true", optimizer="adamw"),
    dict(name="lt_bf16_adamw", strategy="ddp", precision="bf16-mixed", optimizer="adamw"),
    dict(name="ft_bf16_adamw", strategy="fusetrain_ddp", ours="bf16-mixed", optimizer="adamw"),
    dict(name="ft_bf16_fused", strategy="fusetrain_ddp", ours="bf16-mixed", optimizer="fused_adamw",
         layout="nodes"),
    # ZeRO (SLURM's environment, num_nodes=2), saved after epoch 0 and resumed
    dict(name="ft_zero_bf16_fused", strategy="fusetrain_ddp_zero", ours="bf16-mixed", optimizer="fused_adamw",
         layout="slurm", checkpoint=True),
    dict(name="ft_zero_resumed", strategy="fusetrain_ddp_zero", ours="bf16-mixed", optimizer="fused_adamw",
         resume="ft_zero_bf16_fused"),
    # gradient accumulation (2) and clipping, SGD with momentum (clipping
    # changes its updates; Adam's are nearly invariant to a gradient's scale)
    dict(name="ref32_sgd_clip", strategy="ddp", precision="32-true", optimizer="sgd", accumulate=2, clip=CLIP),
    dict(name="lt_bf16_sgd_clip", strategy="ddp", precision="bf16-mixed", optimizer="sgd", accumulate=2, clip=CLIP),
    dict(name="ft_bf16_fused_sgd_clip", strategy="fusetrain_ddp", ours="bf16-mixed", optimizer="fused_sgd",
         accumulate=2, clip=CLIP),
    dict(name="ft_bf16_sgd_clip", strategy="fusetrain_ddp", ours="bf16-mixed", optimizer="sgd",
         accumulate=2, clip=CLIP),
    # fp16 with an inf injected at step INJECT_AT: the step is skipped
    dict(name="ref32_adamw_skip", strategy="ddp", precision="32-true", optimizer="adamw", skip_step_at=INJECT_AT),
    dict(name="lt_fp16_inf_adamw", strategy="ddp", lightning_fp16=True, optimizer="adamw", inject=True),
    dict(name="ft_fp16_inf_adamw", strategy="fusetrain_ddp", ours="16-mixed", optimizer="adamw", inject=True),
    dict(name="ft_fp16_inf_fused", strategy="fusetrain_ddp", ours="16-mixed", optimizer="fused_adamw",
         inject=True, checkpoint=True),
    dict(name="ft_fp16_resumed", strategy="fusetrain_ddp", ours="16-mixed", optimizer="fused_adamw",
         resume="ft_fp16_inf_fused"),
    # gradients communicated in bf16 three ways: torch's Python hook (and the
    # same through Lightning's ddp_comm_wrapper), fusetrain's C++ hook, comm_dtype
    dict(name="ft_bf16_hook_python", strategy="fusetrain_ddp", ours="bf16-mixed", optimizer="adamw",
         strategy_kwargs=dict(ddp_comm_hook="torch:bf16_compress_hook")),
    dict(name="ft_bf16_hook_wrapper", strategy="fusetrain_ddp", ours="bf16-mixed", optimizer="adamw",
         strategy_kwargs=dict(ddp_comm_hook="torch:allreduce_hook", ddp_comm_wrapper="torch:bf16_compress_wrapper")),
    dict(name="ft_bf16_hook_builtin", strategy="fusetrain_ddp", ours="bf16-mixed", optimizer="adamw",
         strategy_kwargs=dict(ddp_comm_hook="bf16")),
    dict(name="ft_bf16_comm_dtype", strategy="fusetrain_ddp", ours="bf16-mixed", optimizer="adamw",
         strategy_kwargs=dict(comm_dtype="bfloat16")),
    # manual optimization (manual_backward inside training_step)
    dict(name="lt_fp16_manual", strategy="ddp", lightning_fp16=True, optimizer="adamw", manual=True),
    dict(name="ft_fp16_manual", strategy="fusetrain_ddp", ours="16-mixed", optimizer="adamw", manual=True),
]

# Both scalers: a small initial scale and a short growth interval, so the
# scale moves (grows, backs off at the inf) and the checkpoint's differs from
# a fresh scaler's.
SCALER = dict(init_scale=2.0**8, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)

# ===================================================================== worker


def _set_layout(layout: str, rank: int) -> tuple:
    """The cluster environment's variables for this fit; returns (devices, num_nodes)."""
    stale = [k for k in os.environ if k.startswith("SLURM_")]
    for key in stale + ["GROUP_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "TORCHELASTIC_RUN_ID"]:
        os.environ.pop(key, None)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD))
    if layout == "torchrun":  # one node, two processes
        os.environ.update(TORCHELASTIC_RUN_ID="fusetrain-test", GROUP_RANK="0", LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(WORLD))
        return WORLD, 1
    if layout == "nodes":  # torchrun --nnodes 2 --nproc-per-node 1
        os.environ.update(TORCHELASTIC_RUN_ID="fusetrain-test", GROUP_RANK=str(rank), LOCAL_RANK="0",
                          LOCAL_WORLD_SIZE="1")
        return 1, WORLD
    if layout == "slurm":  # srun -N 2 --ntasks-per-node 1
        os.environ.update(
            SLURM_NTASKS=str(WORLD), SLURM_NTASKS_PER_NODE="1", SLURM_NNODES=str(WORLD),
            SLURM_PROCID=str(rank), SLURM_LOCALID="0", SLURM_NODEID=str(rank),
            SLURM_JOB_NAME="fusetrain-test", SLURM_JOB_ID="4242", SLURM_NODELIST="127.0.0.1",
            LOCAL_RANK="0",
        )
        return 1, WORLD
    raise ValueError(layout)


def _fit(run: dict, store, rank: int, out: Path) -> dict:
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.plugins.precision import MixedPrecision

    import fusetrain.amp
    import fusetrain.parallel
    from fusetrain.lightning import FusetrainPrecision

    name = run["name"]
    devices, num_nodes = _set_layout(run.get("layout", "torchrun"), rank)
    records = {"steps": [], "sync": [], "scale": [], "grad_norm": []}

    class Recorder(Callback):
        def on_train_start(self, trainer, module):
            records["backend"] = dist.get_backend()
            records["ddp"] = type(trainer.strategy.model).__module__ + "." + type(trainer.strategy.model).__name__
            records["ranks"] = (trainer.global_rank, trainer.world_size, trainer.node_rank, trainer.num_nodes)
            records["environment"] = type(trainer.strategy.cluster_environment).__name__
            records["optimizer"] = type(trainer.optimizers[0]).__name__

        def on_before_optimizer_step(self, trainer, module, optimizer):
            grads = [p.grad.detach().double() for p in module.parameters() if p.grad is not None]
            records["grad_norm"].append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
                                        if grads else None)

        def on_before_backward(self, trainer, module, loss):
            records["sync"].append(bool(trainer.strategy.model.require_backward_grad_sync))

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            records["scale"].append(None if scaler is None else float(scaler.get_scale()))
            checksum = sum(float(p.detach().double().abs().sum()) for p in module.parameters())
            records["steps"].append((trainer.global_step, checksum))

    plugins = []
    precision = run.get("precision")
    strategy = run["strategy"]
    if "strategy_kwargs" in run:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        from fusetrain.lightning import FusetrainDDPStrategy

        kwargs = {}
        for key, value in run["strategy_kwargs"].items():
            if key == "comm_dtype":
                value = getattr(torch, value)
            elif isinstance(value, str) and value.startswith("torch:"):
                value = getattr(default_hooks, value[len("torch:"):])
            kwargs[key] = value
        strategy = FusetrainDDPStrategy(**kwargs)
    if "ours" in run:
        scaler = fusetrain.amp.GradScaler("cpu", **SCALER) if run["ours"] == "16-mixed" else None
        plugins.append(FusetrainPrecision(run["ours"], scaler=scaler))
    if run.get("lightning_fp16"):
        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **SCALER)))
    callbacks = [Recorder()]
    ckpt_dir = out / "ckpt" / name
    if run.get("checkpoint"):
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1, every_n_epochs=1))
    pl.seed_everything(0, verbose=False)
    model = _model_class()(
        run["optimizer"],
        inject_inf_at=INJECT_AT if run.get("inject") else None,
        skip_step_at=run.get("skip_step_at"),
        manual=run.get("manual", False),
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        precision=precision,
        plugins=plugins or None,
        max_epochs=EPOCHS,
        accumulate_grad_batches=run.get("accumulate", 1),
        gradient_clip_val=run.get("clip"),
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(run.get("checkpoint")),
        default_root_dir=str(out / "root" / name),
    )
    # The process group the strategy would make, on a prefix of the shared
    # store (Lightning's own set-up then sees it and keeps it).
    backend = trainer.strategy._get_process_group_backend()
    dist.init_process_group(backend, store=dist.PrefixStore(name, store), rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=PG_TIMEOUT_S))
    ckpt_path = None
    if run.get("resume"):
        ckpt_path = str(out / "ckpt" / run["resume"] / "epoch=0.ckpt")
    try:
        trainer.fit(model, train_dataloaders=_loader(), ckpt_path=ckpt_path)
    finally:
        dist.destroy_process_group()
    records["weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    records["global_step"] = trainer.global_step
    records["losses"] = list(model.losses)
    optimizer = trainer.optimizers[0]
    records["took_scale"] = list(getattr(optimizer, "took_scale", []))
    local = getattr(optimizer, "optim", None) or optimizer  # ZeRO's local optimizer
    records["optimizer_steps"] = sorted({float(s["step"]) for s in local.state.values() if "step" in s})
    if run.get("checkpoint"):
        saved = torch.load(ckpt_dir / "epoch=0.ckpt", map_location="cpu", weights_only=False)
        records["checkpoint_scaler"] = saved.get("FusetrainPrecision")
        records["checkpoint_keys"] = sorted(saved)
    return records


def _worker(argv) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", default="gloo")  # ddp_harness.launch passes it; each fit picks its own
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import warnings

    import torch.distributed as dist

    import fusetrain.lightning  # noqa: F401  (registers the strategies)

    warnings.filterwarnings("ignore", message=r".*(num_workers|does not have many workers|sync_dist).*")
    rank = int(os.environ["RANK"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["FT_STORE_PORT"]), is_master=False,
                          timeout=timedelta(seconds=60))
    out = Path(args.out)
    faulthandler.dump_traceback_later(float(os.environ.get("FT_DDP_DEADLINE_S", DEADLINE_S)) - 10, exit=True)
    only = os.environ.get("FT_LIGHTNING_ONLY")  # debugging: a comma-separated subset
    results = {}
    for run in RUNS:
        if only and run["name"] not in only.split(","):
            continue
        t0 = time.monotonic()
        try:
            results[run["name"]] = {"ok": True, "data": _fit(run, store, rank, out)}
        except Exception:
            results[run["name"]] = {"ok": False, "error": traceback.format_exc()}
            if dist.is_initialized():
                dist.destroy_process_group()
        results[run["name"]]["seconds"] = time.monotonic() - t0
        torch.save(results, out / f"rank{rank}.pt")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _worker(sys.argv[1:])
    sys.exit(0)


# ===================================================================== tests

pytest.importorskip("lightning", reason='PyTorch Lightning is not installed: pip install "fusetrain[lightning]"')

import ddp_harness  # noqa: E402
from conftest import assert_bits_equal  # noqa: E402


class _Fits:
    """What each rank found in each fit: ``fits[name]`` is one entry per
    rank, and fails the test (with the rank's traceback) where a fit raised."""

    def __init__(self, results):
        self._results = results

    def __getitem__(self, name: str) -> list:
        return ddp_harness.findings(self._results, name)


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning")
    return _Fits(ddp_harness.launch(Path(__file__), WORLD, "all", out, deadline_s=DEADLINE_S))


def _distance(a: dict, b: dict) -> float:
    """L2 distance between two models' weights (all tensors, float64)."""
    return math.sqrt(sum(float((a[k].double() - b[k].double()).square().sum()) for k in a))


def _assert_same_weights(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for k in expected:
        assert_bits_equal(actual[k], expected[k], f"{what}: {k}")


def _assert_within_twice_lightning(fits, ours: str, lightning: str, reference: str) -> None:
    """Ours is at most twice as far from the float32 run as Lightning's own
    low-precision run is (every rank)."""
    for rank in range(WORLD):
        ref = fits[reference][rank]["weights"]
        theirs = _distance(fits[lightning][rank]["weights"], ref)
        mine = _distance(fits[ours][rank]["weights"], ref)
        assert theirs > 0, f"{lightning} is identical to {reference}: the tolerance would be 0"
        assert mine <= 2 * theirs, (
            f"rank {rank}: {ours} is {mine:.3g} from the float32 run {reference}, more than twice "
            f"{lightning}'s {theirs:.3g}"
        )


def test_ranks_agree(fits):
    """Every fit ends with the same weights on both ranks."""
    for run in RUNS:
        per_rank = fits[run["name"]]
        _assert_same_weights(per_rank[1]["weights"], per_rank[0]["weights"], f"{run['name']}, rank 1 vs rank 0")


def test_strategy_wraps_fusetrain_ddp_over_the_fusetrain_backend(fits):
    for name in ("ft_bf16_adamw", "ft_bf16_fused", "ft_zero_bf16_fused", "ft_fp16_inf_fused"):
        for rank, found in enumerate(fits[name]):
            assert found["ddp"] == "fusetrain.parallel.DistributedDataParallel", (name, found["ddp"])
            assert found["backend"] == "fusetrain", (name, found["backend"])
    for found in fits["lt_bf16_adamw"]:
        assert found["ddp"] == "torch.nn.parallel.distributed.DistributedDataParallel"
        assert found["backend"] == "gloo"


def test_cluster_environments_and_num_nodes(fits):
    """torchrun with one node of 2 processes, torchrun with 2 nodes of one
    process, SLURM with 2 nodes: Lightning's environments give the ranks."""
    for name, env, num_nodes in (("ft_bf16_adamw", "TorchElasticEnvironment", 1),
                                 ("ft_bf16_fused", "TorchElasticEnvironment", 2),
                                 ("ft_zero_bf16_fused", "SLURMEnvironment", 2)):
        for rank, found in enumerate(fits[name]):
            assert found["environment"] == env, (name, found["environment"])
            node = rank if num_nodes == WORLD else 0
            assert found["ranks"] == (rank, WORLD, node, num_nodes), (name, found["ranks"])


def test_bf16_bit_for_bit_with_lightning_ddp_bf16_mixed(fits):
    """FusetrainPrecision("bf16-mixed") + fusetrain_ddp + torch's AdamW ends
    bit for bit where Lightning's ddp + precision="bf16-mixed" does."""
    for rank in range(WORLD):
        _assert_same_weights(fits["ft_bf16_adamw"][rank]["weights"], fits["lt_bf16_adamw"][rank]["weights"],
                             f"rank {rank}")
        assert fits["ft_bf16_adamw"][rank]["losses"] == fits["lt_bf16_adamw"][rank]["losses"]
    assert fits["ft_bf16_adamw"][0]["global_step"] == EPOCHS * STEPS_PER_EPOCH


def test_bf16_fused_adamw_within_bf16_tolerance(fits):
    """With FusedAdamW (2 nodes x 1 process) the weights are as close to the
    float32 run as Lightning's bf16 run is, within 2x; and the loss falls."""
    _assert_within_twice_lightning(fits, "ft_bf16_fused", "lt_bf16_adamw", "ref32_adamw")
    losses = fits["ft_bf16_fused"][0]["losses"]
    assert losses[-1] < losses[0]


def test_zero_matches_unsharded_bit_for_bit(fits):
    """fusetrain_ddp_zero (sharded gradients and optimizer state) ends with
    the weights of the unsharded FusedAdamW run."""
    for rank in range(WORLD):
        assert fits["ft_zero_bf16_fused"][rank]["optimizer"] == "ZeroRedundancyOptimizer"
        _assert_same_weights(fits["ft_zero_bf16_fused"][rank]["weights"], fits["ft_bf16_fused"][rank]["weights"],
                             f"rank {rank}")


def test_zero_checkpoint_resumes_to_the_uninterrupted_run(fits):
    for rank in range(WORLD):
        assert "optimizer_states" in fits["ft_zero_bf16_fused"][rank]["checkpoint_keys"]
        _assert_same_weights(fits["ft_zero_resumed"][rank]["weights"], fits["ft_zero_bf16_fused"][rank]["weights"],
                             f"rank {rank}")
        assert fits["ft_zero_resumed"][rank]["global_step"] == EPOCHS * STEPS_PER_EPOCH


def test_gradient_accumulation_blocks_the_sync_as_lightning_does(fits):
    """accumulate_grad_batches=2: the first backward of each pair runs
    without gradient synchronisation (no_sync), the second with it, in
    fusetrain's DDP as in torch's; 4 optimizer steps for 8 batches."""
    expected = [False, True] * (EPOCHS * STEPS_PER_EPOCH // 2)
    for name in ("lt_bf16_sgd_clip", "ft_bf16_fused_sgd_clip", "ft_bf16_sgd_clip"):
        for found in fits[name]:
            assert found["sync"] == expected, (name, found["sync"])
            assert found["global_step"] == EPOCHS * STEPS_PER_EPOCH // 2, name


def test_gradient_clip_val_and_accumulation_match_lightning(fits):
    """gradient_clip_val with accumulation: fusetrain's FusedSGD (clipping
    folded into its step) and torch's SGD (clipped by
    fusetrain.utils.clip_grad_norm_) land as close to the float32 run as
    Lightning's bf16 run, within 2x; clipping is active (the gradients'
    norm exceeds gradient_clip_val at every step)."""
    for name in ("lt_bf16_sgd_clip", "ft_bf16_sgd_clip"):
        assert min(fits[name][0]["grad_norm"]) > 2 * CLIP, (name, fits[name][0]["grad_norm"])
    _assert_within_twice_lightning(fits, "ft_bf16_fused_sgd_clip", "lt_bf16_sgd_clip", "ref32_sgd_clip")
    _assert_within_twice_lightning(fits, "ft_bf16_sgd_clip", "lt_bf16_sgd_clip", "ref32_sgd_clip")


def test_fp16_overflow_skipped_bit_for_bit_as_lightning(fits):
    """fp16 with an inf in rank 0's loss at step INJECT_AT: with torch's
    AdamW, FusetrainPrecision("16-mixed") skips that step and moves the
    scale exactly as Lightning's MixedPrecision with torch's GradScaler:
    same weights, scales and losses, bit for bit."""
    for rank in range(WORLD):
        ours, theirs = fits["ft_fp16_inf_adamw"][rank], fits["lt_fp16_inf_adamw"][rank]
        _assert_same_weights(ours["weights"], theirs["weights"], f"rank {rank}")
        assert ours["scale"] == theirs["scale"]
        assert ours["steps"] == theirs["steps"]
        assert ours["optimizer_steps"] == theirs["optimizer_steps"] == [EPOCHS * STEPS_PER_EPOCH - 1]


def test_fp16_overflow_skipped_by_fused_adamw_without_host_sync(fits):
    """With FusedAdamW the skip happens on the device: every step was handed
    the scale as a tensor; the weights did not move at the inf's step; the
    scale trajectory and step counts are Lightning's; the weights are within
    2x of Lightning's fp16 distance from the float32 run that leaves out the
    same step."""
    ours, theirs = fits["ft_fp16_inf_fused"][0], fits["lt_fp16_inf_adamw"][0]
    assert ours["took_scale"] == [True] * (EPOCHS * STEPS_PER_EPOCH)
    assert ours["scale"] == theirs["scale"]
    assert ours["scale"][INJECT_AT] == ours["scale"][INJECT_AT - 1] / 2  # backed off at the inf
    assert max(ours["scale"]) > SCALER["init_scale"]  # and grew
    checksums = [c for _, c in ours["steps"]]
    assert checksums[INJECT_AT] == checksums[INJECT_AT - 1], "the weights moved at the overflow's step"
    assert all(a != b for a, b in zip(checksums[:INJECT_AT], checksums[1:INJECT_AT]))
    assert [s for s, _ in ours["steps"]] == [s for s, _ in theirs["steps"]]  # the skipped step counts, as in Lightning
    assert ours["optimizer_steps"] == [EPOCHS * STEPS_PER_EPOCH - 1]
    _assert_within_twice_lightning(fits, "ft_fp16_inf_fused", "lt_fp16_inf_adamw", "ref32_adamw_skip")


def test_fp16_checkpoint_resumes_to_the_uninterrupted_run(fits):
    """A checkpoint saved after epoch 0 (scaler state included, under
    "FusetrainPrecision") resumes to the uninterrupted run's weights and
    scale, bit for bit."""
    for rank in range(WORLD):
        full, resumed = fits["ft_fp16_inf_fused"][rank], fits["ft_fp16_resumed"][rank]
        saved = full["checkpoint_scaler"]
        assert saved is not None, "no FusetrainPrecision state in the checkpoint"
        fresh = (SCALER["init_scale"], 0)
        assert (float(saved["scale"]), int(saved["_growth_tracker"])) != fresh, saved  # restoring it matters
        assert float(saved["scale"]) == full["scale"][STEPS_PER_EPOCH - 1]
        _assert_same_weights(resumed["weights"], full["weights"], f"rank {rank}")
        assert resumed["scale"] == full["scale"][STEPS_PER_EPOCH:]
        assert resumed["global_step"] == EPOCHS * STEPS_PER_EPOCH


def test_comm_hooks_and_comm_dtype(fits):
    """ddp_comm_hook (torch's bf16_compress_hook; allreduce_hook through
    ddp_comm_wrapper=bf16_compress_wrapper; fusetrain's builtin "bf16") and
    comm_dtype=torch.bfloat16 reach fusetrain's DDP: the four runs end bit for
    bit alike, and apart from the run that communicates in float32."""
    names = ("ft_bf16_hook_python", "ft_bf16_hook_wrapper", "ft_bf16_hook_builtin", "ft_bf16_comm_dtype")
    for rank in range(WORLD):
        first = fits[names[0]][rank]["weights"]
        for name in names[1:]:
            _assert_same_weights(fits[name][rank]["weights"], first, f"{name} vs {names[0]}, rank {rank}")
        assert _distance(first, fits["ft_bf16_adamw"][rank]["weights"]) > 0, "the hook changed nothing"


def test_manual_optimization_bit_for_bit_as_lightning(fits):
    """automatic_optimization=False (manual_backward and optimizer.step()
    in training_step), fp16 with a scaler: the same weights as Lightning's."""
    for rank in range(WORLD):
        ours, theirs = fits["ft_fp16_manual"][rank], fits["lt_fp16_manual"][rank]
        _assert_same_weights(ours["weights"], theirs["weights"], f"rank {rank}")
        assert ours["scale"] == theirs["scale"]
        assert ours["global_step"] == EPOCHS * STEPS_PER_EPOCH


# ------------------------------------------------------------ in this process


def test_registry_and_backend_choice():
    """Importing fusetrain.lightning registers the strategies; the Trainer of
    the issue builds with them, on the "fusetrain" backend on CPUs."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import StrategyRegistry

    from fusetrain.lightning import FusetrainDDPStrategy, FusetrainDDPZeroStrategy, FusetrainPrecision

    assert {"fusetrain_ddp", "fusetrain_ddp_zero"} <= set(StrategyRegistry.available_strategies())
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="fusetrain_ddp",
                         plugins=[FusetrainPrecision("bf16-mixed")], logger=False)
    assert type(trainer.strategy) is FusetrainDDPStrategy
    assert isinstance(trainer.precision_plugin, FusetrainPrecision)
    assert trainer.precision == "bf16-mixed"
    assert trainer.strategy._get_process_group_backend() == "fusetrain"
    zero = pl.Trainer(accelerator="cpu", devices=2, strategy="fusetrain_ddp_zero", logger=False)
    assert type(zero.strategy) is FusetrainDDPZeroStrategy
    assert zero.strategy._ddp_kwargs["shard_gradients"] is True


def test_precision_arguments():
    import fusetrain.amp
    from fusetrain.lightning import FusetrainDDPStrategy, FusetrainPrecision

    assert FusetrainPrecision("16-mixed").scaler is not None
    assert FusetrainPrecision("bf16-mixed").scaler is None
    assert FusetrainPrecision("fp8-mixed").policy.is_float8
    with pytest.raises(ValueError, match="precision must be one of"):
        FusetrainPrecision("16-true")
    with pytest.raises(TypeError, match="fusetrain.amp.GradScaler"):
        FusetrainPrecision("16-mixed", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="takes no scaler"):
        FusetrainPrecision("32-true", scaler=fusetrain.amp.GradScaler("cpu"))
    with pytest.raises(TypeError, match="unknown arguments"):
        FusetrainDDPStrategy(bucket_cap=5)


def test_policy_islands_float8_and_init_dtype():
    """float32_modules stay float32 inside the forward context, "fp8-mixed"
    swaps the eligible Linear layers for Float8Linear, module_init_context
    makes float32 parameters."""
    from fusetrain.amp import Float8Linear
    from fusetrain.lightning import FusetrainPrecision

    Net = _model_class()
    plugin = FusetrainPrecision("bf16-mixed", float32_modules=["net.4"], device="cpu")
    model = plugin.convert_module(Net())
    seen = {}
    for name in ("net.0", "net.4"):
        model.get_submodule(name).register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, o.dtype))
    with plugin.forward_context():
        model(torch.randn(3, 16))
    assert seen == {"net.0": torch.bfloat16, "net.4": torch.float32}

    fp8 = FusetrainPrecision("fp8-mixed", fp8_min_features=16, device="cpu").convert_module(Net())
    assert isinstance(fp8.net[0], Float8Linear) and isinstance(fp8.net[2], Float8Linear)
    assert type(fp8.net[4]) is torch.nn.Linear  # 5 outputs: not a multiple of 16

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with FusetrainPrecision("bf16-mixed").module_init_context():
            layer = torch.nn.Linear(4, 4)
    finally:
        torch.set_default_dtype(previous)
    assert layer.weight.dtype == torch.float32


def test_import_without_lightning():
    """``import fusetrain`` never imports Lightning; ``import
    fusetrain.lightning`` without it is a one-line ImportError naming the extra."""
    code = (
        "import sys\n"
        "import fusetrain\n"
        "assert not [m for m in sys.modules if m.startswith('lightning')], 'fusetrain imported Lightning'\n"
        "for name in ('lightning', 'pytorch_lightning', 'lightning_fabric'):\n"
        "    sys.modules[name] = None  # what an interpreter without them finds\n"
        "try:\n"
        "    import fusetrain.lightning\n"
        "except ImportError as e:\n"
        "    print('ERROR:' + str(e))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("ERROR:")]
    assert len(line) == 1, done.stdout
    assert 'pip install "fusetrain[lightning]"' in line[0] and "\n" not in line[0]


# ------------------------------------------------------------ self.log(sync_dist=True)


def _launch(script: Path, args: list, cwd: Path, **extra_env: str) -> str:
    """Starts ``script`` as a user does (Lightning's launcher starts the
    second process, its own set-up makes the process group); its output, or
    the test fails with it."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                        "LOCAL_WORLD_SIZE", "NODE_RANK") and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p), **extra_env)
    proc = subprocess.Popen([sys.executable, str(script), *args], env=env, cwd=str(cwd),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=EXAMPLE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's child rank too
        output, _ = proc.communicate()
        pytest.fail(f"{script.name} {' '.join(args)} ran past {EXAMPLE_TIMEOUT_S:.0f} s (killed):\n{output[-3000:]}")
    assert proc.returncode == 0, f"{script.name} {' '.join(args)}:\n{output[-3000:]}"
    return output


def test_sync_dist_logging_as_lightning_ddp(tmp_path):
    """Lightning's own logging with sync_dist=True (float and int64 tensors,
    a Python int, sums, maxima, a torchmetrics object; training and
    validation) on 2 ranks: fusetrain_ddp and fusetrain_ddp_zero log what
    strategy="ddp" logs, bit for bit. Lightning sends ReduceOp.AVG for an
    epoch mean to any backend not named "gloo", and the "fusetrain" backend
    (gloo underneath) cannot average Lightning's int64 counters: this
    crashed with "result type Float can't be cast to the desired output type
    Long" on both ranks."""
    logged = {}
    for strategy in ("ddp", "fusetrain_ddp", "fusetrain_ddp_zero"):
        _launch(LOGGING, [strategy, str(tmp_path / f"{strategy}.pt")], tmp_path)
        logged[strategy] = torch.load(tmp_path / f"{strategy}.pt", weights_only=False)
    reference = logged["ddp"]
    assert len(reference["epochs"]) == 2
    # What the data says, counted here: 96 samples an epoch; validation
    # batches 1..4 on rank 0 and 2..5 on rank 1 average to 3.
    assert float(reference["last"]["train_samples"]) == 96.0
    assert float(reference["last"]["val_batch"]) == 3.0
    for strategy in ("fusetrain_ddp", "fusetrain_ddp_zero"):
        ours = logged[strategy]
        for epoch, (a, b) in enumerate(zip(ours["epochs"], reference["epochs"])):
            assert sorted(a) == sorted(b), (strategy, epoch)
            for name in b:
                assert_bits_equal(a[name], b[name], f"{strategy} epoch {epoch} {name}")


# ------------------------------------------------------------ the example


def test_example_trains_and_the_loss_falls(tmp_path):
    """examples/lightning_train.py at its tiny size, started as a user starts
    it: Lightning's launcher starts the second process, its own set-up makes
    the process group. It finishes and the loss falls by 2% at least."""
    output = _launch(EXAMPLE, ["--root", str(tmp_path)], tmp_path, FUSETRAIN_EXAMPLE_TINY="1")
    found = re.search(r"loss ([0-9.]+) -> ([0-9.]+)", output)
    assert found, output[-3000:]
    first, last = float(found.group(1)), float(found.group(2))
    assert last < first * (1 - MIN_FALL), output[-3000:]

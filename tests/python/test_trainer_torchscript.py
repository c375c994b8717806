"""`fusetrain train` on the user's own model (issue 13): a module scripted
in Python (torch.jit.script, torch.jit.save), model.name=torchscript, trained
by the C++ trainer, and `fusetrain export` back to Python.

The reference is the same training in Python: full-batch steps (so the data
order cannot matter), torch.optim.AdamW at a constant learning rate, the
same initial module; the trainer's per-step losses must follow Python's
within float32 rounding (the rows of a batch are summed in another order).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from trainer_cli import BIN, ROOT, ok, run

TINY = ROOT / "configs" / "tiny.yaml"
USAGE = 2

safetensors_torch = pytest.importorskip("safetensors.torch")
pytestmark = pytest.mark.skipif(not BIN.exists(), reason=f"{BIN} is missing: build it first (make build)")

# Modules are scripted from a file: torch.jit.script needs their source.
MODELS_SRC = textwrap.dedent('''
    import torch
    from torch import nn

    class SmallCnn(nn.Module):
        def __init__(self, classes: int = 3):
            super().__init__()
            self.conv = nn.Conv2d(1, 4, 3, padding=1, bias=False)  # BN follows: a bias would get only rounding noise as gradient
            self.bn = nn.BatchNorm2d(4)
            self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 8 * 8, classes))

        def forward(self, x):
            return self.head(torch.relu(self.bn(self.conv(x))))

    class SmallTransformer(nn.Module):
        """Sequence classifier: [N, T, F] features -> [N, classes]."""
        def __init__(self, features: int = 6, classes: int = 3):
            super().__init__()
            self.proj = nn.Linear(features, 16)
            self.pos = nn.Parameter(torch.randn(10, 16) * 0.1)
            self.block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            self.norm = nn.LayerNorm(16)
            self.head = nn.Linear(16, classes)

        def forward(self, x):
            h = self.proj(x) + self.pos[: x.size(1)]
            return self.head(self.norm(self.block(h)).mean(1))

    class Block(nn.Module):
        def __init__(self, features: int):
            super().__init__()
            self.ln = nn.LayerNorm(features)
            self.fc = nn.Linear(features, features)

        def forward(self, x):
            return x + self.fc(self.ln(x))

    class TwoBlocks(nn.Module):
        """Two instances of one module type (TorchScript gives them one graph)."""
        def __init__(self, features: int = 6, classes: int = 3):
            super().__init__()
            self.blocks = nn.ModuleList([Block(features), Block(features)])
            self.head = nn.Linear(features, classes)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x.mean(1))

    class ReturnsTuple(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 3)

        def forward(self, x):
            y = self.fc(x.flatten(1))
            return y, y

    class WrongClasses(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 5)

        def forward(self, x):
            return self.fc(x.flatten(1))

    class WantsVectors(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(10, 3)

        def forward(self, x):
            return self.fc(x)
''')

STEPS = 8
LR = 0.01


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    (d / "user_models.py").write_text(MODELS_SRC)
    sys.path.insert(0, str(d))
    try:
        import user_models
    finally:
        sys.path.remove(str(d))
    return user_models, d


def data_files(tmp_path: Path, shape, n=96, n_val=48, classes=3):
    g = torch.Generator().manual_seed(0)
    files = []
    for name, count in (("train", n), ("val", n_val)):
        y = torch.randint(0, classes, (count,), generator=g)
        x = torch.randn(count, *shape, generator=g) + y.view(-1, *([1] * len(shape))).float()
        path = tmp_path / f"{name}.safetensors"
        safetensors_torch.save_file({"inputs": x.contiguous(), "labels": y}, str(path))
        files.append((path, x, y))
    return files


def full_batch_args(run_dir, model_path, train, val, n, *extra):
    return ("train", "--config", TINY, "--run-dir", run_dir, "--set", "data.name=tensors",
            "--set", f"data.path={train}", "--set", f"data.val_path={val}",
            "--set", "model.name=torchscript", "--set", f"model.path={model_path}",
            "--set", f"data.batch_size={n}", "--set", "data.eval_batch_size=64",
            "--set", f"train.max_steps={STEPS}", "--set", "train.log_every=1",
            "--set", f"optimizer.lr={LR}", "--set", "optimizer.weight_decay=0",
            "--set", "schedule.warmup_steps=0", "--set", "schedule.decay=none",
            "--set", "output.checkpoint_every=4", *extra)


def python_losses(module: nn.Module, x, y):
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.0, eps=1e-8)
    losses = []
    for _ in range(STEPS):
        loss = nn.functional.cross_entropy(module(x), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses


def trainer_losses(run_dir: Path):
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"]


@pytest.mark.parametrize("arch,shape", [("SmallCnn", (1, 8, 8)), ("SmallTransformer", (10, 6))])
def test_scripted_model_trains_as_in_python(tmp_path, models, arch, shape):
    user_models, _ = models
    (train, x, y), (val, val_x, _) = data_files(tmp_path, shape)
    torch.manual_seed(0)
    eager = getattr(user_models, arch)()
    path = tmp_path / "model.pt"
    torch.jit.script(eager).save(str(path))
    reference = python_losses(eager, x, y)  # the same initial weights as the file
    run_dir = tmp_path / "run"
    ok(run(*full_batch_args(run_dir, path, train, val, len(y))))
    losses = trainer_losses(run_dir)
    assert len(losses) == STEPS
    # float32 CE of 96 rows summed in another order, then AdamW's sqrt and
    # division: a few ulps a step, far below the 1e-4 the loss moves by.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=2e-5, atol=2e-6)
    assert reference[-1] < reference[0] - 1e-3  # it did learn

    # Export: the TorchScript file and the state dict both hold the trained model.
    ckpt = sorted((run_dir / "checkpoints").glob("step_*.pt"))[-1]
    ok(run("export", "--checkpoint", ckpt, "--torchscript", tmp_path / "trained.pt",
           "--state-dict", tmp_path / "state.pt"))
    trained = torch.jit.load(str(tmp_path / "trained.pt"))
    fresh = getattr(user_models, arch)()
    fresh.load_state_dict(torch.load(tmp_path / "state.pt"))  # strict: every key, no extra
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, trained.state_dict()[k]), k
    # Trained as Python trains: the same function (parameters the loss does
    # not depend on, as attention's key bias, drift apart on rounding noise
    # that AdamW scales up, so the outputs are compared, not those).
    xv = val_x.contiguous()
    eager.eval()
    fresh.eval()
    with torch.no_grad():
        torch.testing.assert_close(fresh(xv), eager(xv), rtol=1e-3, atol=1e-4)


def test_resume_is_exact_and_two_ranks_agree(tmp_path, models):
    user_models, _ = models
    (train, x, y), (val, _, _) = data_files(tmp_path, (1, 8, 8))
    torch.manual_seed(0)
    path = tmp_path / "model.pt"
    torch.jit.script(user_models.SmallCnn()).save(str(path))
    full, resumed, two = tmp_path / "full", tmp_path / "resumed", tmp_path / "two"
    ok(run(*full_batch_args(full, path, train, val, len(y))))
    ok(run(*full_batch_args(resumed, path, train, val, len(y), "--set", "train.max_steps=4")))
    ok(run(*full_batch_args(resumed, path, train, val, len(y), "--resume",
                            resumed / "checkpoints" / "step_00000004.pt")))
    a = torch.load(sorted((full / "checkpoints").glob("*.pt"))[-1])
    b = torch.load(sorted((resumed / "checkpoints").glob("*.pt"))[-1])
    model_keys = [k for k in a if k.startswith(("model.", "optim."))]
    assert model_keys and all(torch.equal(a[k], b[k]) for k in model_keys)
    # Two ranks (DDP) on the same global batch: a model without batch norm
    # (whose statistics would be per rank) follows the one-rank losses.
    (train, x, y), (val, _, _) = data_files(tmp_path, (10, 6))
    torch.manual_seed(0)
    torch.jit.script(user_models.SmallTransformer()).save(str(path))
    one = tmp_path / "one"
    ok(run(*full_batch_args(one, path, train, val, len(y))))
    ok(run(*full_batch_args(two, path, train, val, len(y), "--nproc", "2")))
    torch.testing.assert_close(torch.tensor(trainer_losses(two)), torch.tensor(trainer_losses(one)),
                               rtol=2e-5, atol=2e-6)


def test_master_weights_keep_layers_in_16_bits(tmp_path, models):
    """The Conv and Linear layers are found by their classes, also where
    TorchScript mangled the name of a class it compiled again in one process
    (a Linear of other sizes scripted first: what a user who scripts two
    models gets; the trainer kept such a layer float32 without a word)."""
    _, models_dir = models
    (train, x, y), (val, _, _) = data_files(tmp_path, (1, 8, 8))
    path = tmp_path / "model.pt"
    # In a process of its own, so that no Linear compiled earlier decides the names.
    script = ("import torch, user_models\n"
              "torch.jit.script(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(5, 7)))\n"
              f"torch.jit.script(user_models.SmallCnn()).save({str(path)!r})\n")
    subprocess.run([sys.executable, "-c", script], check=True, cwd=models_dir, capture_output=True, timeout=120,
                   env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(models_dir), *filter(None, sys.path)])))
    names = [m._c._type().qualified_name() for m in torch.jit.load(str(path)).modules()]
    assert any("___torch_mangle_" in n and n.endswith(".Linear") for n in names), names
    run_dir = tmp_path / "run"
    ok(run(*full_batch_args(run_dir, path, train, val, len(y), "--precision", "mixed_bfloat16",
                            "--set", "precision.master_weights=true")))
    state = torch.load(sorted((run_dir / "checkpoints").glob("*.pt"))[-1])
    assert state["model.conv.weight"].dtype == torch.bfloat16
    assert state["model.head.1.weight"].dtype == torch.bfloat16
    assert state["model.bn.weight"].dtype == torch.float32  # normalisation stays float32
    assert all(torch.isfinite(torch.tensor(trainer_losses(run_dir))))


def test_float32_islands_by_submodule_name(tmp_path, models):
    # Under mixed_bfloat16, the submodules named in precision.float32_modules
    # run in float32, as fusetrain.amp.apply_policy(float32_modules=...) runs
    # them in Python: the same ops on the same values, so the losses agree to
    # float32 rounding, as in float32 (rtol 2e-5). With the head left in
    # bfloat16 the logits are rounded to 8 significant bits (relative error
    # up to 2^-9, about 2e-3) and the losses move apart by far more.
    import fusetrain.amp

    user_models, _ = models
    (train, x, y), (val, _, _) = data_files(tmp_path, (10, 6))
    torch.manual_seed(0)
    eager = user_models.TwoBlocks()
    path = tmp_path / "model.pt"
    torch.jit.script(eager).save(str(path))
    islands = ["head", "blocks.0.fc", "blocks.1.fc"]
    fusetrain.amp.apply_policy(eager, "mixed_bfloat16", float32_modules=islands)
    reference = python_losses(eager, x, y)
    run_dir = tmp_path / "run"
    ok(run(*full_batch_args(run_dir, path, train, val, len(y), "--precision", "mixed_bfloat16",
                            "--set", "precision.float32_modules=" + ",".join(islands))))
    torch.testing.assert_close(torch.tensor(trainer_losses(run_dir)), torch.tensor(reference),
                               rtol=2e-5, atol=2e-6)
    # Without the islands the same run is another run: the check above can fail.
    plain = tmp_path / "plain"
    ok(run(*full_batch_args(plain, path, train, val, len(y), "--precision", "mixed_bfloat16")))
    gap = (torch.tensor(trainer_losses(plain)) - torch.tensor(reference)).abs().max().item()
    assert gap > 1e-4, gap


@pytest.mark.parametrize("names,needle", [
    ("nope", 'has no submodule named "nope"; it has blocks, blocks.0, blocks.0.ln'),
    ("blocks.0.ln", "blocks.0.ln and blocks.1.ln through one graph"),
    ("blocks", "is never called through its forward()"),  # a container
])
def test_float32_island_errors(tmp_path, models, names, needle):
    user_models, _ = models
    (train, x, y), (val, _, _) = data_files(tmp_path, (10, 6))
    path = tmp_path / "model.pt"
    torch.jit.script(user_models.TwoBlocks()).save(str(path))
    run_dir = tmp_path / "run"
    p = run(*full_batch_args(run_dir, path, train, val, len(y), "--precision", "mixed_bfloat16",
                             "--set", f"precision.float32_modules={names}"))
    assert p.returncode == USAGE, p.stdout + p.stderr
    assert "precision.float32_modules" in p.stderr and needle in p.stderr, p.stderr
    assert not run_dir.exists()


def test_float32_modules_is_for_torchscript_models(tmp_path):
    p = run("train", "--config", TINY, "--set", "precision.float32_modules=head",
            "--run-dir", tmp_path / "run")
    assert p.returncode == USAGE and "precision.float32_head" in p.stderr, p.stderr


@pytest.mark.parametrize("arch,needle", [
    ("ReturnsTuple", "returned a Tuple"),
    ("WrongClasses", "returned [2, 5] Float; the trainer needs floating-point logits of shape [2, 3]"),
    ("WantsVectors", "raised"),
])
def test_bad_modules_fail_before_training(tmp_path, models, arch, needle):
    user_models, _ = models
    (train, x, y), (val, _, _) = data_files(tmp_path, (1, 8, 8))
    path = tmp_path / f"{arch}.pt"
    torch.jit.script(getattr(user_models, arch)()).save(str(path))
    run_dir = tmp_path / "run"
    p = run(*full_batch_args(run_dir, path, train, val, len(y)))
    assert p.returncode == USAGE, p.stderr
    assert "model.path" in p.stderr and path.name in p.stderr and needle in p.stderr, p.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize("where", ["train", "val"])
def test_a_stray_label_is_named_when_the_classes_disagree(tmp_path, models, where):
    """A label 12 by mistake in a 3-class file. In the training file the
    trainer infers 13 classes and the 3-output model disagrees: the error
    says where the 13 came from (the file, the label's index and value) and
    which key sets the count. In the validation file it is a label the
    training labels do not have: an error naming it, before the model runs
    (issue 49: it used to grow the class count silently)."""
    user_models, _ = models
    (train, x, y), (val, xv, yv) = data_files(tmp_path, (1, 8, 8))
    path, labels, inputs = (train, y, x) if where == "train" else (val, yv, xv)
    labels = labels.clone()
    labels[17] = 12
    safetensors_torch.save_file({"inputs": inputs.contiguous(), "labels": labels}, str(path))
    model = tmp_path / "cnn.pt"
    torch.jit.script(user_models.SmallCnn()).save(str(model))
    run_dir = tmp_path / "run"
    p = run(*full_batch_args(run_dir, model, train, val, len(y)))
    assert p.returncode == USAGE, p.stderr
    if where == "train":
        want = (f"Its 13 classes: inferred from the training labels (data.num_classes=0): the largest "
                f"is 12, at index 17 of data.path {path}")
        assert want in p.stderr, p.stderr
    else:
        want = (f"data.val_path {path}: label 12 at index 17 is not among the training labels' classes 0 .. 2")
        assert want in p.stderr and "set data.num_classes=13" in p.stderr, p.stderr
    # Set explicitly, the count is the key's, and the stray label is named.
    p = run(*full_batch_args(run_dir, model, train, val, len(y)), "--set", "data.num_classes=3")
    assert p.returncode == USAGE and "label 12 at index 17 is out of range for data.num_classes=3" in p.stderr, p.stderr


def test_missing_or_foreign_model_files(tmp_path):
    (train, x, y), (val, _, _) = data_files(tmp_path, (1, 8, 8))
    not_script = tmp_path / "weights.pt"
    torch.save({"w": torch.ones(2)}, not_script)
    for path, needle in ((tmp_path / "nope.pt", "no such file"),
                         (not_script, "is not a TorchScript module")):
        p = run(*full_batch_args(tmp_path / "run", path, train, val, len(y)))
        assert p.returncode == USAGE and "model.path" in p.stderr and needle in p.stderr, p.stderr
    p = run("export", "--checkpoint", tmp_path / "none.pt", "--state-dict", tmp_path / "o.pt")
    assert p.returncode == USAGE and "no such file" in p.stderr


# ---------------------------------------------------------------- a language model

LM_SRC = textwrap.dedent('''
    import torch
    from torch import nn

    class TinyLm(nn.Module):
        """Byte-level causal transformer: [N, T] ids -> [N, T, 256] logits."""
        def __init__(self, vocab: int = 256, d: int = 32, t: int = 16):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(torch.randn(t, d) * 0.02)
            self.block = nn.TransformerEncoderLayer(d, 2, 64, dropout=0.0, batch_first=True)
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab)

        def forward(self, idx):
            t = idx.size(1)
            mask = torch.triu(torch.full((t, t), float("-inf")), 1)
            h = self.block(self.emb(idx) + self.pos[:t], src_mask=mask)
            return self.head(self.norm(h))
''')

_MASK64 = (1 << 64) - 1


def mix_seed(x: int) -> int:
    """splitmix64, as trainer/data.cpp's mix_seed."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def window_starts(seed: int, epoch: int, step: int, windows: int, batch: int) -> torch.Tensor:
    """The random windows of a step, drawn as BatchSampler's random-window mode draws them."""
    s = mix_seed(seed ^ mix_seed(epoch)) ^ mix_seed(0x5354 + step)
    g = torch.Generator().manual_seed(mix_seed(s))
    return torch.randint(windows, (batch,), generator=g)


def test_scripted_language_model_trains_as_in_python(tmp_path):
    """A scripted causal transformer on the bytes of a text: the trainer's
    random windows reproduced in Python (splitmix64 seeds, the CPU
    generator), the same AdamW steps, the same per-step losses."""
    (tmp_path / "lm_src.py").write_text(LM_SRC)
    sys.path.insert(0, str(tmp_path))
    try:
        import lm_src
    finally:
        sys.path.remove(str(tmp_path))
    text = bytes(range(32, 127)) * 40  # 3800 bytes
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(text)
    t, batch = 16, 8
    torch.manual_seed(0)
    eager = lm_src.TinyLm(t=t)
    path = tmp_path / "lm.pt"
    torch.jit.script(eager).save(str(path))
    run_dir = tmp_path / "run"
    ok(run("train", "--config", ROOT / "configs" / "gpt_tiny.yaml", "--run-dir", run_dir,
           "--set", "model.name=torchscript", "--set", f"model.path={path}",
           "--set", f"data.path={corpus}", "--set", f"model.seq_len={t}",
           "--set", f"data.batch_size={batch}", "--set", f"train.max_steps={STEPS}",
           "--set", "train.log_every=1", "--set", "train.clip_grad_norm=0",
           "--set", f"optimizer.lr={LR}", "--set", "optimizer.weight_decay=0",
           "--set", "optimizer.beta2=0.999", "--set", "schedule.warmup_steps=0",
           "--set", "schedule.decay=none", "--set", "output.checkpoint_every=0",
           "--set", "precision.policy=float32"))  # as the reference (auto: bf16 on AVX512-BF16)
    # Python: the same split (the last 10% held out), windows and steps.
    stream = torch.tensor(list(text), dtype=torch.long)
    train = stream[: len(stream) - round(len(stream) * 0.1)]
    windows = len(train) - t  # window i starts at byte i
    opt = torch.optim.AdamW(eager.parameters(), lr=LR, weight_decay=0.0, eps=1e-8)
    reference = []
    for step in range(STEPS):
        starts = window_starts(0, 0, step, windows, batch)
        idx = starts[:, None] + torch.arange(t)
        x, y = train[idx], train[idx + 1]
        loss = nn.functional.cross_entropy(eager(x).reshape(-1, 256), y.reshape(-1))
        reference.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.testing.assert_close(torch.tensor(trainer_losses(run_dir)), torch.tensor(reference),
                               rtol=2e-5, atol=2e-6)


# ---------------------------------------------------------------- built-in models


GPT_CONFIG = ROOT / "configs" / "gpt_tiny.yaml"
TEXT = Path("/usr/share/common-licenses/GPL-3")
FASHION = Path(os.environ.get("FUSETRAIN_FASHION_MNIST", "/usr/share/datasets/fashion-mnist"))


@pytest.mark.parametrize("model", ["mlp", "cnn", "cnn2", "cnn12", "resnet", "gpt"])
def test_builtin_models_export_as_torchscript(tmp_path, model):
    # `export --torchscript` traces a built-in model in eval mode; the
    # reference is the same checkpoint rebuilt as a Python module by
    # fusetrain.load_checkpoint: same state-dict keys, same logits (float32
    # rounding: the same ops, a few in another order) on a batch size, and
    # for gpt a length, other than the trace's, so that no size was frozen.
    from fusetrain.load_checkpoint import load_model

    if model == "gpt":
        args = ("--config", GPT_CONFIG, "--set", "data.name=text", "--set", f"data.path={TEXT}",
                "--set", "model.d_model=32", "--set", "model.n_layer=2", "--set", "model.n_head=2",
                "--set", "model.seq_len=32", "--set", "train.max_steps=6")
        inputs = [torch.randint(0, 256, (3, 17)), torch.randint(0, 256, (1, 32))]
    elif model == "resnet":
        args = ("--config", TINY, "--set", "model.name=resnet", "--set", "model.depth=18",
                "--set", "model.width=8", "--set", "data.name=synthetic_images", "--set", "data.image_size=8",
                "--set", "data.train_samples=128", "--set", "data.test_samples=64", "--set", "train.max_steps=4")
        inputs = [torch.randn(5, 3, 8, 8)]
    else:
        if not (FASHION / "train-images-idx3-ubyte.gz").exists():
            pytest.skip("Fashion-MNIST is not installed")
        args = ("--config", TINY, "--set", f"model.name={model.rstrip('12')}", "--set", "train.max_steps=8")
        if model == "cnn2":  # two conv layers a block (model.convs_per_block)
            args += ("--set", "model.convs_per_block=2")
        if model == "cnn12":  # one conv layer in the first block, two in the second
            args += ("--set", "model.convs_per_block=[1,2]")
        inputs = [torch.randn(5, 1, 28, 28)]
    run_dir = tmp_path / "run"
    ok(run("train", *args, "--run-dir", run_dir))
    ckpt = sorted((run_dir / "checkpoints").glob("step_*.pt"))[-1]
    p = ok(run("export", "--checkpoint", ckpt, "--torchscript", tmp_path / "m.pt"))
    assert f"{model.rstrip('12')} traced in eval mode" in p.stdout
    traced = torch.jit.load(str(tmp_path / "m.pt"))
    reference = load_model(str(ckpt)).eval()
    assert sorted(traced.state_dict()) == sorted(reference.state_dict())
    with torch.no_grad():
        for x in inputs:
            torch.testing.assert_close(traced(x), reference(x), rtol=1e-5, atol=1e-5)

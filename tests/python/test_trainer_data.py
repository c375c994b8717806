"""`fusetrain train` on the user's own data (issue 13): classification
tensors (.safetensors written by the safetensors package, or a torch.save'd
dict), token files (flat uint16/uint32 ids, with or without llm.c's header)
and text, validation splits, train.eval_every and the val_* keys of
metrics.jsonl, and every kind of bad input.

The references are other paths to the same numbers: the tensors reader fed
the Fashion-MNIST subset the built-in reader uses must train the same bits;
a token file holding a text's bytes must train what the text trains.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer_cli import BIN, ROOT, assert_same_state, final_state, ok, records, run

TINY = ROOT / "configs" / "tiny.yaml"
GPT = ROOT / "configs" / "gpt_tiny.yaml"
FASHION = Path(os.environ.get("FUSETRAIN_FASHION_MNIST", "/usr/share/datasets/fashion-mnist"))
TEXT = Path("/usr/share/common-licenses/GPL-3")
USAGE = 2

safetensors_torch = pytest.importorskip("safetensors.torch")
pytestmark = pytest.mark.skipif(not BIN.exists(), reason=f"{BIN} is missing: build it first (make build)")

# A small GPT, a few steps: seconds.
SMALL_GPT = ("--set", "model.d_model=32", "--set", "model.n_layer=1", "--set", "model.n_head=2",
             "--set", "model.seq_len=32", "--set", "train.max_steps=12", "--set", "train.log_every=4")


def idx(path: Path) -> torch.Tensor:
    data = gzip.open(path).read()
    ndim = data[3]
    shape = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return torch.frombuffer(bytearray(data[4 + 4 * ndim:]), dtype=torch.uint8).reshape(shape)


# ---------------------------------------------------------------- tensors


@pytest.fixture(scope="module")
def fashion_subset():
    if not (FASHION / "train-images-idx3-ubyte.gz").exists():
        pytest.skip("Fashion-MNIST is missing: apt-get install dataset-fashion-mnist")
    train_x = idx(FASHION / "train-images-idx3-ubyte.gz")
    scaled = train_x.double().div(255)
    # The built-in reader's normalisation: statistics of the whole training set.
    return {"train_x": train_x[:1024], "train_y": idx(FASHION / "train-labels-idx1-ubyte.gz")[:1024],
            "test_x": idx(FASHION / "t10k-images-idx3-ubyte.gz")[:256],
            "test_y": idx(FASHION / "t10k-labels-idx1-ubyte.gz")[:256],
            "mean": scaled.mean().item(), "std": scaled.std().item()}


@pytest.mark.parametrize("fmt", ["safetensors", "torch.save"])
def test_tensors_train_what_the_built_in_reader_trains(tmp_path, fashion_subset, fmt):
    """The tiny run's Fashion-MNIST subset as a file: [N, 28, 28] uint8
    images, int64 labels, the t10k subset as data.val_path, the built-in
    normalisation as data.mean/std: the same parameters bit for bit."""
    f = fashion_subset
    train, val = tmp_path / f"train.{fmt}", tmp_path / f"val.{fmt}"
    save = (safetensors_torch.save_file if fmt == "safetensors"
            else lambda d, p: torch.save(d, p))
    save({"inputs": f["train_x"].contiguous(), "labels": f["train_y"].long()}, str(train))
    save({"inputs": f["test_x"].contiguous(), "labels": f["test_y"].long()}, str(val))
    ref = tmp_path / "ref"
    ok(run("train", "--config", TINY, "--run-dir", ref, "--set", f"data.path={FASHION}"))
    mine = tmp_path / "mine"
    p = ok(run("train", "--config", TINY, "--run-dir", mine, "--set", "data.name=tensors",
               "--set", f"data.path={train}", "--set", f"data.val_path={val}",
               "--set", f"data.mean={f['mean']!r}", "--set", f"data.std={f['std']!r}"))
    assert "1024 train / 256 validation" in p.stdout and "10 classes" in p.stdout, p.stdout
    assert_same_state(final_state(mine), final_state(ref))
    evals = records(mine, "eval")
    assert evals and all(r["val_loss"] == r["test_loss"] and "val_accuracy" in r for r in evals)
    assert [r["val_accuracy"] for r in evals] == [r["accuracy"] for r in records(ref, "eval")]


def make_classes(tmp_path: Path, n=400, classes=3, dtype=torch.uint8, name="cls.safetensors"):
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, classes, (n,), generator=g)
    x = (torch.randn(n, 6, 6, generator=g) * 20 + y.view(-1, 1, 1).float() * 50 + 60).clamp(0, 255)
    x = x.to(dtype) if dtype == torch.uint8 else (x / 255).to(dtype)
    path = tmp_path / name
    safetensors_torch.save_file({"inputs": x, "labels": y}, str(path))
    return path, x, y


def test_val_fraction_holds_out_a_seeded_subset_and_classes_are_inferred(tmp_path):
    path, x, y = make_classes(tmp_path, n=400, classes=3)
    run_dir = tmp_path / "run"
    p = ok(run("train", "--config", TINY, "--run-dir", run_dir, "--set", "data.name=tensors",
               "--set", f"data.path={path}", "--set", "data.val_fraction=0.25",
               "--set", "model.name=mlp", "--set", "data.batch_size=50", "--epochs", "3",
               "--set", "train.eval_every=2"))
    assert "300 train / 100 validation" in p.stdout and "3 classes" in p.stdout, p.stdout
    evals = records(run_dir, "eval")
    # every 2 steps (6 per epoch) and at each epoch's end, no step twice
    steps = [r["step"] for r in evals]
    assert steps == [2, 4, 6, 8, 10, 12, 14, 16, 18], steps
    assert all(0 <= r["val_accuracy"] <= 1 and r["val_loss"] == r["test_loss"] for r in evals)
    # the model head has one output per class found
    state = torch.load(sorted((run_dir / "checkpoints").glob("*.pt"))[-1])
    assert state["model.head.weight"].shape[0] == 3


def test_float_feature_vectors_train_an_mlp(tmp_path):
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, 2, (256,), generator=g)
    x = torch.randn(256, 5, generator=g) + y.view(-1, 1).float() * 2
    path = tmp_path / "vec.pt"
    torch.save({"inputs": x, "labels": y.int()}, path)
    ok(run("train", "--config", TINY, "--run-dir", tmp_path / "run", "--set", "data.name=tensors",
           "--set", f"data.path={path}", "--set", "model.name=mlp", "--set", "data.batch_size=32"))
    p = run("train", "--config", TINY, "--run-dir", tmp_path / "cnn", "--set", "data.name=tensors",
            "--set", f"data.path={path}", "--set", "model.name=cnn")
    assert p.returncode == USAGE and "model.name=mlp" in p.stderr, p.stderr


def bad_tensor_files(tmp_path: Path):
    """(file maker, what the message must say) for each kind of bad input."""
    good, x, y = make_classes(tmp_path)
    raw = good.read_bytes()
    cases = {}

    def write(name, data):
        p = tmp_path / name
        p.write_bytes(data) if isinstance(data, bytes) else safetensors_torch.save_file(data, str(p))
        return p

    cases["missing"] = (tmp_path / "nope.safetensors", "does not exist")
    cases["empty"] = (write("empty.safetensors", b""), "is empty")
    cases["truncated"] = (write("cut.safetensors", raw[:-100]), "data_offsets")
    cases["short header"] = (write("hdr.safetensors", raw[:5]), "truncated")
    cases["bad json"] = (write("json.safetensors", struct.pack("<Q", 4) + b"{{{{"), "not valid JSON")
    cases["no labels"] = (write("nolabels.safetensors", {"inputs": x}), 'no tensor "labels"')
    cases["float labels"] = (write("flab.safetensors", {"inputs": x, "labels": y.float()}),
                             "must be integers")
    cases["int inputs"] = (write("iin.safetensors", {"inputs": x.int(), "labels": y}),
                           "uint8 (scaled to [0, 1]) or floating point")
    cases["shape"] = (write("shape.safetensors", {"inputs": x, "labels": y[:-1]}), "one label per input")
    neg = y.clone()
    neg[7] = -1
    cases["negative"] = (write("neg.safetensors", {"inputs": x, "labels": neg}), "label -1 at index 7")
    cases["not a dict"] = (tmp_path / "list.pt", "not a dict of tensors")
    torch.save([x, y], cases["not a dict"][0])
    return cases


@pytest.mark.parametrize("nproc", [1, 2])
def test_bad_tensor_files_fail_with_the_file_and_nothing_written(tmp_path, nproc):
    for case, (path, needle) in bad_tensor_files(tmp_path).items():
        run_dir = tmp_path / f"run-{case.replace(' ', '_')}"
        p = run("train", "--config", TINY, "--run-dir", run_dir, "--nproc", nproc,
                "--set", "data.name=tensors", "--set", f"data.path={path}", "--set", "model.name=mlp")
        assert p.returncode == USAGE, (case, p.returncode, p.stderr[-2000:])
        assert "data.path" in p.stderr and path.name in p.stderr and needle in p.stderr, (case, p.stderr)
        assert not run_dir.exists(), f"{case}: {run_dir} was written"


def test_labels_out_of_range_name_the_index(tmp_path):
    path, _, y = make_classes(tmp_path, classes=3)
    first = int((y >= 2).nonzero()[0])
    p = run("train", "--config", TINY, "--run-dir", tmp_path / "run", "--set", "data.name=tensors",
            "--set", f"data.path={path}", "--set", "data.num_classes=2", "--set", "model.name=mlp")
    assert p.returncode == USAGE
    assert f"label {int(y[first])} at index {first} is out of range for data.num_classes=2" in p.stderr, p.stderr
    val, _, _ = make_classes(tmp_path, n=50, name="val.safetensors")
    p = run("train", "--config", TINY, "--run-dir", tmp_path / "run2", "--set", "data.name=tensors",
            "--set", f"data.path={path}", "--set", f"data.val_path={tmp_path / 'nothere.pt'}")
    assert p.returncode == USAGE and "data.val_path" in p.stderr and "nothere.pt" in p.stderr


# ---------------------------------------------------------------- tokens and text


def llmc_header(n: int, uint32: bool) -> bytes:
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (20240801, 7, n) if uint32 else (20240520, 1, n)
    return header.tobytes()


@pytest.mark.parametrize("layout", ["uint16", "uint16+header", "uint32", "uint32+header"])
def test_token_file_trains_what_the_same_text_trains(tmp_path, layout):
    """The GPL's bytes as token ids in every layout the reader takes, with a
    byte vocabulary: the same windows, the same bits as data.name=text."""
    ids = np.frombuffer(TEXT.read_bytes(), dtype=np.uint8)
    wide = layout.startswith("uint32")
    data = ids.astype(np.uint32 if wide else np.uint16).tobytes()
    if layout.endswith("header"):
        data = llmc_header(len(ids), wide) + data
    tokens = tmp_path / "ids.bin"
    tokens.write_bytes(data)
    text_run, token_run = tmp_path / "text", tmp_path / "tokens"
    ok(run("train", "--config", GPT, "--run-dir", text_run, *SMALL_GPT))
    ok(run("train", "--config", GPT, "--run-dir", token_run, *SMALL_GPT, "--set", "data.name=tokens",
           "--set", f"data.path={tokens}", "--set", f"data.token_dtype={'uint32' if wide else 'uint16'}",
           "--set", "model.vocab_size=256"))
    assert_same_state(final_state(token_run), final_state(text_run))
    ev = records(text_run, "eval")[-1]
    assert ev["val_bits_per_byte"] == pytest.approx(ev["val_loss"] / math.log(2), rel=1e-5)
    tev = records(token_run, "eval")[-1]
    assert tev["val_loss"] == ev["val_loss"] and "val_bits_per_token" in tev


def test_windows_are_random_and_depend_only_on_the_seed(tmp_path):
    """Two runs with one data.seed train the same; another seed draws other
    windows (other parameters)."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    # float32: the tolerance below is float32 reduction order; gpt_tiny's
    # precision auto would be bf16 on a CPU with AVX512-BF16.
    fp32 = (*SMALL_GPT, "--set", "precision.policy=float32")
    ok(run("train", "--config", GPT, "--run-dir", a, *fp32))
    ok(run("train", "--config", GPT, "--run-dir", b, *fp32, "--nproc", "2"))
    ok(run("train", "--config", GPT, "--run-dir", c, *fp32, "--set", "data.seed=1"))
    sa, sb, sc = final_state(a), final_state(b), final_state(c)
    # Another world size: the same global batches (up to reduction order).
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], rtol=1e-4, atol=1e-6)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


def bad_token_files(tmp_path: Path):
    cases = {}
    good = np.arange(1000, dtype=np.uint16) % 50

    def write(name, data):
        p = tmp_path / name
        p.write_bytes(data)
        return p

    cases["empty"] = (write("empty.bin", b""), "is empty", ())
    cases["odd bytes"] = (write("odd.bin", good.tobytes() + b"\x01"), "not a whole number of uint16 ids", ())
    cases["truncated header"] = (write("cut.bin", llmc_header(1000, False) + good.tobytes()[:-10]),
                                 "announces 1000 tokens", ())
    cases["header dtype"] = (write("h32.bin", llmc_header(1000, False) + good.tobytes()),
                             "set data.token_dtype=uint16", ("--set", "data.token_dtype=uint32"))
    big = good.copy()
    big[321] = 77
    cases["id >= vocab"] = (write("vocab.bin", big.tobytes()),
                            "token id 77 at position 321 is not below model.vocab_size=50",
                            ("--set", "model.vocab_size=50"))
    cases["too short"] = (write("short.bin", good[:20].tobytes()), "fewer than", ())
    cases["missing"] = (tmp_path / "nope.bin", "does not exist", ())
    return cases


def test_bad_token_files_fail_with_the_file_and_offset(tmp_path):
    for case, (path, needle, extra) in bad_token_files(tmp_path).items():
        run_dir = tmp_path / f"run-{case.replace(' ', '_')}"
        p = run("train", "--config", GPT, "--run-dir", run_dir, *SMALL_GPT, "--set", "data.name=tokens",
                "--set", f"data.path={path}", *extra)
        assert p.returncode == USAGE, (case, p.returncode, p.stderr[-2000:])
        assert path.name in p.stderr and needle in p.stderr, (case, p.stderr)
        assert not run_dir.exists(), f"{case}: {run_dir} was written"


def test_context_longer_than_the_model_is_an_error(tmp_path):
    p = run("train", "--config", GPT, "--run-dir", tmp_path / "r", *SMALL_GPT, "--set", "data.context=64")
    assert p.returncode == USAGE and "data.context" in p.stderr and "model.seq_len=32" in p.stderr


# ---------------------------------------------------------------- time budget


def test_max_time_stops_evaluates_and_checkpoints(tmp_path):
    # A run planned for far more steps than 3 s allow: it stops at the budget
    # with a final validation and checkpoint (exit 0), and --resume takes it on.
    args = ("--config", GPT, "--set", "data.name=text", "--set", f"data.path={TEXT}", *SMALL_GPT,
            "--set", "train.max_steps=100000", "--set", "train.eval_every=0",
            "--set", "output.checkpoint_every=0")
    cut = tmp_path / "cut"
    p = ok(run("train", *args, "--set", "train.max_time_s=3", "--set", f"output.run_dir={cut}"))
    assert "train.max_time_s=3 s reached at step" in p.stdout, p.stdout
    last = records(cut, "eval")[-1]
    assert 0 < last["step"] < 100000 and "val_bits_per_byte" in last
    assert records(cut, "train")[-1]["time_s"] < 60
    ckpt = sorted((cut / "checkpoints").glob("step_*.pt"))[-1]
    assert int(torch.load(ckpt)["trainer.step"]) == last["step"]
    resumed = tmp_path / "resumed"
    p = ok(run("train", *args, "--set", "train.max_time_s=2", "--resume", ckpt,
               "--set", f"output.run_dir={resumed}"))
    assert records(resumed, "eval")[-1]["step"] > last["step"]

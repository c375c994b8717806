"""What a new user tripped on with `fusetrain train` (issue 49), through the
CLI as they met it: non-finite losses (train.nonfinite), labels a validation
file has and the training file has not, paths in config files, what
--resume auto says, the printed config and key list, messages for a state
dict given as a TorchScript model and for a model of another input width,
and a machine too busy for the intra-op threads.

The references are other runs: the first non-finite step the error names
is checked by running up to the step before it (finite) and up to it with
train.nonfinite=ignore (not finite); skip's count is the epochs in which
the one bad sample is drawn (once an epoch).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer_cli import BIN, ROOT, final_state, ok, records, run

TINY = ROOT / "configs" / "tiny.yaml"
USAGE = 2
FAILED = 1

safetensors_torch = pytest.importorskip("safetensors.torch")
pytestmark = pytest.mark.skipif(not BIN.exists(), reason=f"{BIN} is missing: build it first (make build)")

# Images [N, 1, 8, 8] of 3 classes for the CNN (batch norm: its statistics
# are what a skipped step must also leave alone); 256 samples, batch 32:
# 8 steps an epoch, each sample drawn once an epoch.
N, BATCH, CLASSES = 256, 32, 3
BAD_ROW = 37


def image_file(tmp_path: Path, bad_rows=(BAD_ROW,), name="images.pt") -> Path:
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, CLASSES, (N,), generator=g)
    x = torch.randn(N, 1, 8, 8, generator=g) + y.view(-1, 1, 1, 1).float()
    for r in bad_rows:
        x[r, 0, 3, 3] = float("nan")
    path = tmp_path / name
    torch.save({"inputs": x, "labels": y}, path)
    return path


def image_run(path: Path, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    """The CNN on `path`, validated on a clean file beside it (so every row
    of `path` is a training sample)."""
    val = path.parent / "clean_val.pt"
    if not val.exists():
        image_file(path.parent, bad_rows=(), name=val.name)
    return run("train", "--config", TINY, "--run-dir", run_dir, "--set", "data.name=tensors",
               "--set", f"data.path={path}", "--set", f"data.val_path={val}",
               "--set", f"data.batch_size={BATCH}", "--set", "model.channels=4,8",
               "--set", "model.hidden=16", "--set", "output.checkpoint_every=2",
               "--set", "output.curves=false", *extra)


def newest_checkpoint(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints").glob("step_*.pt"))[-1]


def all_finite(state: dict) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point())


# ------------------------------------------------------------- non-finite losses


def test_nonfinite_error_names_the_step_and_sample_and_keeps_the_last_good_checkpoint(tmp_path):
    data = image_file(tmp_path)
    p = image_run(data, tmp_path / "run", "--epochs", "2")
    assert p.returncode == FAILED, f"exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    error = [ln for ln in p.stderr.splitlines() if "non-finite" in ln]
    assert len(error) == 1, p.stderr
    line = error[0]
    step = int(re.search(r"at step (\d+) of", line).group(1))
    assert f"the inputs of sample {BAD_ROW} of {data} hold NaN or inf" in line, line
    assert "train.nonfinite=skip" in line, line
    # The newest checkpoint is from before the bad step, with finite weights.
    newest = newest_checkpoint(tmp_path / "run")
    saved_step = int(torch.load(newest)["trainer.step"])
    assert saved_step < step, (saved_step, step)
    assert all_finite(final_state(tmp_path / "run"))
    assert str(newest) in line or newest.name in line, line
    # The named step is the first bad one: up to the step before it every
    # loss is finite; with train.nonfinite=ignore the named step poisons the weights.
    before = image_run(data, tmp_path / "before", "--set", f"train.max_steps={step - 1}")
    ok(before)
    assert all_finite(final_state(tmp_path / "before"))
    ignored = ok(image_run(data, tmp_path / "ignored", "--set", f"train.max_steps={step}",
                           "--set", "train.nonfinite=ignore"))
    assert not all_finite(final_state(tmp_path / "ignored")), ignored.stdout


def test_nonfinite_skip_skips_each_bad_step_and_leaves_batch_norm_alone(tmp_path):
    data = image_file(tmp_path)
    run_dir = tmp_path / "run"
    p = ok(image_run(data, run_dir, "--epochs", "3", "--set", "train.nonfinite=skip",
                     "--set", "train.log_every=1"))
    # Row 37 is drawn once an epoch: three skipped steps.
    trains = records(run_dir, "train")
    assert trains[-1]["nonfinite"] == 3, trains[-1]
    assert len(re.findall(r"1 non-finite step skipped", p.stdout)) == 3, p.stdout
    assert all(math.isfinite(r["loss"]) for r in trains), [r["loss"] for r in trains]
    state = torch.load(newest_checkpoint(run_dir))
    buffers = {k: v for k, v in state.items() if "running_" in k}
    assert buffers and all_finite(buffers), "batch-norm statistics took the NaN batch"
    assert all_finite(final_state(run_dir))


def test_nonfinite_error_on_two_ranks_names_the_rank(tmp_path):
    data = image_file(tmp_path)
    p = image_run(data, tmp_path / "run", "--nproc", "2", "--epochs", "1")
    assert p.returncode == FAILED, f"exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    line = [ln for ln in p.stderr.splitlines() if "non-finite" in ln]
    assert len(line) == 1, p.stderr
    assert re.search(r"the loss on rank [01] was not finite", line[0]), line[0]
    assert f"sample {BAD_ROW} of" in line[0], line[0]


# ------------------------------------------------------------- labels


def label_files(tmp_path: Path, train_labels, val_labels):
    g = torch.Generator().manual_seed(3)
    paths = []
    for name, labels in (("train.pt", train_labels), ("val.pt", val_labels)):
        y = torch.tensor(labels)
        torch.save({"inputs": torch.randn(len(labels), 5, generator=g), "labels": y}, tmp_path / name)
        paths.append(tmp_path / name)
    return paths


def label_run(tmp_path, train, val, *extra):
    return run("train", "--config", TINY, "--run-dir", tmp_path / "run", "--set", "data.name=tensors",
               "--set", f"data.path={train}", "--set", f"data.val_path={val}", "--set", "model.name=mlp",
               "--set", "data.batch_size=8", "--epochs", "1", "--set", "output.curves=false", *extra)


def test_a_validation_label_beyond_the_training_classes_is_an_error_naming_file_index_value(tmp_path):
    train, val = label_files(tmp_path, [0, 1, 2, 1] * 8, [0, 1, 2, 1, 2, 7, 0, 1])
    p = label_run(tmp_path, train, val)
    assert p.returncode == USAGE, p.stdout[-2000:]
    assert f"data.val_path {val}: label 7 at index 5" in p.stderr, p.stderr
    assert "0 .. 2" in p.stderr and "data.num_classes=8" in p.stderr, p.stderr
    # With the class count given, the same files train (the head has 8 outputs).
    ok(label_run(tmp_path, train, val, "--set", "data.num_classes=8"))


def test_classes_missing_from_training_are_a_warning_and_the_header_says_where_classes_came_from(tmp_path):
    train, val = label_files(tmp_path, [0, 1, 3, 1] * 8, [0, 1, 3, 2, 0, 1, 3, 1])
    p = ok(label_run(tmp_path, train, val))
    assert re.search(r"classes: 4, inferred from the training labels \(data.num_classes=0\): the largest is 3, "
                     r"at index 2 of data.path " + re.escape(str(train)), p.stdout), p.stdout
    warning = [ln for ln in p.stdout.splitlines() if "warning:" in ln and "no training sample" in ln]
    assert len(warning) == 1 and "class 2 of 0 .. 3" in warning[0] and "1 validation sample is of it" in warning[0], \
        p.stdout


# ------------------------------------------------------------- paths


def test_paths_in_a_config_file_are_relative_to_it_and_set_paths_to_the_working_directory(tmp_path):
    (tmp_path / "project" / "configs").mkdir(parents=True)
    (tmp_path / "project" / "data").mkdir()
    (tmp_path / "elsewhere").mkdir()
    image_file(tmp_path / "project" / "data", bad_rows=())
    config = tmp_path / "project" / "configs" / "mine.yaml"
    text = TINY.read_text().replace("  name: fashion_mnist\n", "  name: tensors\n  path: ../data/images.pt\n")
    text = text.replace("  name: cnn\n", "  name: mlp\n")
    config.write_text(text)
    p = ok(run("train", "--config", config, "--print-config", cwd=tmp_path / "elsewhere"))
    assert f'path: "{tmp_path / "project" / "data" / "images.pt"}"' in p.stdout, p.stdout
    ok(run("train", "--config", config, "--run-dir", tmp_path / "run", "--epochs", "1",
           "--set", "output.curves=false", cwd=tmp_path / "elsewhere"))
    # --set: relative to the working directory, resolved there (the ranks of
    # a run read the resolved config from a private file elsewhere).
    p = ok(run("train", "--config", config, "--set", "data.path=here.pt", "--print-config", cwd=tmp_path / "elsewhere"))
    assert f'path: "{tmp_path / "elsewhere" / "here.pt"}"' in p.stdout, p.stdout
    # The shipped GPT-on-text config reads the repository's data/ from anywhere.
    p = ok(run("train", "--config", "gpt_text", "--print-config", cwd=tmp_path / "elsewhere"))
    assert f'path: "{ROOT / "data" / "kjv.txt"}"' in p.stdout, p.stdout


# ------------------------------------------------------------- --resume auto


def test_resume_auto_names_the_run_on_its_first_line(tmp_path):
    args = ("train", "--config", TINY, "--set", "train.max_steps=4", "--set", "output.curves=false",
            "--set", "data.train_samples=256")
    p = ok(run(*args, "--resume", "auto", cwd=tmp_path))
    assert p.stdout.splitlines()[0] == ('--resume auto: no run of config "tiny" to resume (no runs/tiny-* '
                                        'directory here): starting a new one'), p.stdout
    first_run = next((tmp_path / "runs").iterdir())
    p = ok(run(*args, "--set", "train.max_steps=6", "--resume", "auto", cwd=tmp_path))
    assert p.stdout.splitlines()[0] == (f'--resume auto: resuming runs/{first_run.name}, the newest run of config '
                                        f'"tiny" at step 4 from runs/{first_run.name}/checkpoints/'
                                        'step_00000004.pt'), p.stdout


# ------------------------------------------------------------- printed config and keys


def test_print_config_and_list_keys_print_numbers_as_written(tmp_path):
    p = ok(run("train", "--config", TINY, "--set", "train.max_time_s=600", "--set", "optimizer.lr=3e-4",
               "--print-config"))
    assert re.search(r"^  max_time_s: 600$", p.stdout, re.M), p.stdout
    assert re.search(r"^  lr: 0.0003$", p.stdout, re.M), p.stdout
    keys = ok(run("train", "--list-keys")).stdout
    assert "e+" not in "".join(ln for ln in keys.splitlines() if "an integer" in ln), keys
    assert "train.log_every = 50" in keys and "an integer in [1, 1000000000000000]" in keys, keys
    # What --print-config writes reads back to the same configuration.
    (tmp_path / "again.yaml").write_text(p.stdout)
    assert ok(run("train", "--config", tmp_path / "again.yaml", "--print-config")).stdout == p.stdout


# ------------------------------------------------------------- messages


def test_a_state_dict_given_as_a_torchscript_model_says_so(tmp_path):
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, CLASSES))
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    data = image_file(tmp_path, bad_rows=())
    p = image_run(data, tmp_path / "run", "--set", "model.name=torchscript",
                  "--set", f"model.path={tmp_path / 'weights.pt'}")
    assert p.returncode == USAGE
    assert (f"model.path: {tmp_path / 'weights.pt'} is not a TorchScript module but a state dict "
            "(torch.save(model.state_dict()))") in p.stderr, \
        p.stderr
    assert "torch.jit.save(torch.jit.script(model), path)" in p.stderr


def test_a_model_of_another_input_width_names_both_widths_in_one_line(tmp_path):
    model = torch.jit.script(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 16), torch.nn.ReLU(),
                                                 torch.nn.Linear(16, CLASSES)))
    torch.jit.save(model, str(tmp_path / "m.pt"))
    data = image_file(tmp_path, bad_rows=())
    p = image_run(data, tmp_path / "run", "--set", "model.name=torchscript", "--set", f"model.path={tmp_path / 'm.pt'}")
    assert p.returncode == USAGE
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    assert "a layer takes inputs of width 784 and was given width 64" in lines[0], lines[0]


# ------------------------------------------------------------- a busy machine


def test_info_and_the_header_warn_when_other_work_leaves_too_few_cores(tmp_path):
    cores = len(os.sched_getaffinity(0))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        info = ok(run("info")).stdout
        assert "CPU load from other work" in info, info
        threads = int(re.search(r"intra-op threads: (\d+)", info).group(1))
        if threads > 1:
            assert "warning: other work keeps about" in info and "--threads 1" in info, info
        p = ok(run("train", "--config", TINY, "--run-dir", tmp_path / "run", "--threads", "2",
                   "--set", "train.max_steps=2", "--set", "data.train_samples=128", "--set", "output.curves=false"))
        warning = [ln for ln in p.stdout.splitlines() if "warning: other work keeps about" in ln]
        assert len(warning) == 1 and "2 intra-op threads" in warning[0] and "--threads 1" in warning[0], p.stdout
    finally:
        for s in spinners:
            s.kill()
            s.wait()

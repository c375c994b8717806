"""Beyond one machine (issue 12): fusetrain across hosts, under torchrun and
under its own launcher, and the faults a multi-host run must survive.

The hosts are network namespaces (``netns_hosts.py``): two machines' worth
of network stacks, joined by a bridge, each with one address in
10.231.0.0/24 and its own loopback, sharing this machine's filesystem (as a
cluster's shared run directory). Every reference is the same global batch on
one host (the launcher's ``--nproc``, or torchrun ``--standalone``); on the
CPU the results must agree bit for bit. Each fault test bounds its time and
checks that no process is left behind.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest
import torch

from netns_hosts import assert_no_orphans, kill_tree, make_hosts_fixture

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("FUSETRAIN_BUILD_DIR", ROOT / "build")) / "fusetrain"
TINY = ROOT / "configs" / "tiny.yaml"
TORCHRUN = Path(sys.executable).parent / "torchrun"
PY_SCRIPT = Path(__file__).with_name("multihost_train.py")
FASHION = Path(os.environ.get("FUSETRAIN_FASHION_MNIST", "/usr/share/datasets/fashion-mnist"))

pytestmark = [
    pytest.mark.skipif(not BIN.exists(), reason=f"{BIN} is missing: build it first (make build)"),
    pytest.mark.skipif(not (FASHION / "train-images-idx3-ubyte.gz").exists(),
                       reason="Fashion-MNIST is missing: apt-get install dataset-fashion-mnist"),
]

hosts = make_hosts_fixture(2)

# Collective timeout of the fault tests: a lost peer must be reported within it.
TIMEOUT_S = 10
# Slack on top of it for process start, the data load and the exit.
SLACK_S = 40
RUN_DEADLINE_S = 240
_ports = itertools.count(29610)

# torchrun's own variables would make a reference run join a group.
# The folder this interpreter imports fusetrain from (python/, or a build
# tree's own for another torch: scripts/install-python.sh).
PACKAGE_ROOT = str(Path(importlib.util.find_spec("fusetrain").submodule_search_locations[0]).parent)

_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "GROUP_RANK", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT")


def clean_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    env["PYTHONPATH"] = PACKAGE_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def train_args(run_dir: Path, *extra: str) -> List[str]:
    args = ["train", "--config", str(TINY), "--run-dir", str(run_dir)]
    if "FUSETRAIN_FASHION_MNIST" in os.environ:
        args += ["--set", f"data.path={FASHION}"]
    return args + list(extra)


def finish(procs: Sequence[subprocess.Popen], deadline_s: float) -> List[subprocess.CompletedProcess]:
    """Waits for every process (killing all of them past the deadline) and
    returns their exit codes and output."""
    end = time.monotonic() + deadline_s
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=max(1.0, end - time.monotonic()))
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    except subprocess.TimeoutExpired:
        for p in procs:
            kill_tree(p)
        pytest.fail(f"the run did not finish within {deadline_s:.0f} s (every process killed)")
    return out


def ok(p: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    return p


def final_state(run_dir: Path) -> Dict[str, torch.Tensor]:
    """The model and optimizer entries of the run's newest checkpoint."""
    ckpts = sorted((run_dir / "checkpoints").glob("step_*.pt"))
    assert ckpts, f"no checkpoint in {run_dir}"
    state = torch.load(ckpts[-1])
    return {k: v for k, v in state.items() if k.startswith(("model.", "optim.", "trainer."))}


def assert_same_state(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    differ = [k for k in expected if not torch.equal(actual[k], expected[k])]
    assert not differ, f"{len(differ)} of {len(expected)} entries differ from the one-host run: {differ[:5]}"


def train_steps(run_dir: Path) -> List[int]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if r["kind"] == "train"]


_reference_cache: Dict[tuple, Path] = {}


def reference(tmp_path_factory, world: int, *extra: str) -> Path:
    """The run on one host with `world` processes (fusetrain's launcher, loopback),
    all over gloo: ranks on one host would allreduce through shared memory,
    which sums in rank order, not in gloo's ring order (other bits from 3
    ranks on)."""
    key = (world, extra)
    if key not in _reference_cache:
        run_dir = tmp_path_factory.mktemp("reference") / "run"
        argv = [str(BIN), *train_args(run_dir, "--nproc", str(world), "--set",
                                      "parallel.shared_memory=false", *extra)]
        ok(subprocess.run(argv, capture_output=True, text=True, env=clean_env(), timeout=RUN_DEADLINE_S))
        _reference_cache[key] = run_dir
    return _reference_cache[key]


def torchrun_argv(hosts, i: int, nproc: int, port: int, *extra: str) -> List[str]:
    """torchrun on host i of 2 with the c10d rendezvous on host 0. Namespaces
    share this machine's hostname, which resolves to loopback, so each agent
    is told its address (--local-addr) and host 0 that it hosts the store
    (is_host), as on any cluster whose hostnames do not resolve to the NIC."""
    return [str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.addr(0)}:{port}",
            "--rdzv-id", f"ft{port}", "--rdzv-conf", f"is_host={'true' if i == 0 else 'false'}",
            "--local-addr", hosts.addr(i), *extra]


def launcher_argv(hosts, i: int, port: int, run_dir: Path, *extra: str) -> List[str]:
    return [str(BIN), *train_args(run_dir, "--nnodes", "2", "--node-rank", str(i),
                                  "--master-addr", hosts.addr(0), "--master-port", str(port),
                                  *extra)]


def children(pid: int) -> List[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def trainer_ranks(root: int) -> List[int]:
    """The fusetrain processes under `root` that are ranks (their launcher excluded)."""
    found, todo = [], children(root)
    while todo:
        pid = todo.pop()
        todo += children(pid)
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            continue
        if exe == str(BIN.resolve()) and any(e.startswith(b"RANK=") for e in env):
            found.append(pid)
    return found


def wait_for(path: Path, procs: Sequence[subprocess.Popen], within_s: float) -> None:
    end = time.monotonic() + within_s
    while not path.exists():
        if any(p.poll() is not None for p in procs) or time.monotonic() > end:
            for p in procs:
                kill_tree(p)
            outs = [p.communicate()[1][-2000:] for p in procs]
            pytest.fail(f"{path.name} did not appear within {within_s:.0f} s\n" + "\n---\n".join(outs))
        time.sleep(0.05)


# ---------------------------------------------------------------- across hosts


@pytest.mark.parametrize("nproc", [1, 2], ids=["2x1", "2x2"])
def test_torchrun_cli_trainer_matches_one_host(hosts, tmp_path, tmp_path_factory, nproc):
    """torchrun --nnodes 2 ... fusetrain train: the CLI joins the group from
    torchrun's environment, gloo finds the interface to the master without
    GLOO_SOCKET_IFNAME, and the parameters equal one host's bit for bit."""
    port = next(_ports)
    run_dir = tmp_path / "run"
    procs = [hosts.popen(i, [*torchrun_argv(hosts, i, nproc, port), "--no-python",
                             *[str(BIN), *train_args(run_dir)]], env=clean_env(), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in (0, 1)]
    outs = finish(procs, RUN_DEADLINE_S)
    for p in outs:
        ok(p)
    # Ranks in other network namespaces are other hosts: no shared memory.
    assert f"{2 * nproc} ranks on cpu (gloo), " in outs[0].stdout, outs[0].stdout[-2000:]
    assert_same_state(final_state(run_dir), final_state(reference(tmp_path_factory, 2 * nproc)))
    assert train_steps(run_dir) == train_steps(reference(tmp_path_factory, 2 * nproc))


def test_torchrun_static_rendezvous(hosts, tmp_path, tmp_path_factory):
    """The form of the issue's report: torchrun --nnodes 2 --node-rank R
    --master-addr HOST0 (static rendezvous), no GLOO_SOCKET_IFNAME: gloo
    connected to 127.0.0.1 before; now the run equals one host's."""
    port = next(_ports)
    run_dir = tmp_path / "run"
    procs = [hosts.popen(i, [str(TORCHRUN), "--nnodes", "2", "--node-rank", str(i),
                             "--master-addr", hosts.addr(0), "--master-port", str(port),
                             "--nproc-per-node", "1", "--no-python", str(BIN), *train_args(run_dir)],
                         env=clean_env(), text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE) for i in (0, 1)]
    for p in finish(procs, RUN_DEADLINE_S):
        ok(p)
    assert_same_state(final_state(run_dir), final_state(reference(tmp_path_factory, 2)))


def test_gloo_honours_socket_ifname(hosts, tmp_path):
    """GLOO_SOCKET_IFNAME names the interface as in torch.distributed: the
    host's eth0 works; an interface that does not exist is an error naming
    the variable's value."""
    port = next(_ports)
    good = [hosts.popen(i, launcher_argv(hosts, i, port, tmp_path / "good", "--epochs", "1"),
                        env=clean_env({"GLOO_SOCKET_IFNAME": "eth0"}), text=True,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in (0, 1)]
    for p in finish(good, RUN_DEADLINE_S):
        ok(p)
    port = next(_ports)
    bad = [hosts.popen(i, launcher_argv(hosts, i, port, tmp_path / "bad", "--epochs", "1",
                                        "--set", f"runtime.timeout_s={TIMEOUT_S}"),
                       env=clean_env({"GLOO_SOCKET_IFNAME": "nosuch0"}), text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in (0, 1)]
    for p in finish(bad, TIMEOUT_S + SLACK_S):
        assert p.returncode != 0
        assert "nosuch0" in p.stderr and "GLOO_SOCKET_IFNAME" in p.stderr, p.stderr[-2000:]


def test_python_ddp_script_under_torchrun_matches_one_host(hosts, tmp_path):
    """A user's script with fusetrain's DDP, GradScaler and FusedAdamW under
    torchrun on 2 hosts x 2 processes: the same bits as torchrun --standalone
    with 4 processes on one host. (torch.distributed's own gloo device needs
    GLOO_SOCKET_IFNAME where the hostname resolves to loopback, as here.)"""
    one = tmp_path / "one_host.pt"
    ok(subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", "4", str(PY_SCRIPT),
                       "--out", str(one)], capture_output=True, text=True, env=clean_env(),
                      timeout=RUN_DEADLINE_S))
    two = tmp_path / "two_hosts.pt"
    port = next(_ports)
    procs = [hosts.popen(i, [*torchrun_argv(hosts, i, 2, port), str(PY_SCRIPT), "--out", str(two)],
                         env=clean_env({"GLOO_SOCKET_IFNAME": "eth0"}), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in (0, 1)]
    for p in finish(procs, RUN_DEADLINE_S):
        ok(p)
    a, b = torch.load(one), torch.load(two)
    assert (a["world"], b["world"], b["hosts"]) == (4, 4, "2")
    for key, t in a["model"].items():
        assert torch.equal(b["model"][key], t), key
    for pid, st in a["optimizer"]["state"].items():
        for name, t in st.items():
            assert torch.equal(b["optimizer"]["state"][pid][name], t), (pid, name)
    assert a["scaler"] == b["scaler"]


@pytest.mark.parametrize("nproc", [1, 2], ids=["2x1", "2x2"])
def test_own_launcher_across_hosts(hosts, tmp_path, tmp_path_factory, nproc):
    """fusetrain train --nnodes 2 --node-rank R --master-addr A --master-port
    P [--nproc 2]: host 0's launcher hosts the store on A only (not on every
    interface), and the result equals one host's."""
    port = next(_ports)
    run_dir = tmp_path / "run"
    procs = [hosts.popen(i, launcher_argv(hosts, i, port, run_dir, "--nproc", str(nproc)),
                         env=clean_env(), text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE) for i in (0, 1)]
    listening = ""
    end = time.monotonic() + 60
    while port_text(port) not in listening and time.monotonic() < end and procs[0].poll() is None:
        listening = hosts.run(0, ["ss", "-Hltn"], timeout=10).stdout
        time.sleep(0.1)
    for p in finish(procs, RUN_DEADLINE_S):
        ok(p)
    bound = [line.split()[3] for line in listening.splitlines() if line.split()[3].endswith(port_text(port))]
    assert bound == [f"{hosts.addr(0)}{port_text(port)}"], f"the store listens on {bound}"
    assert_same_state(final_state(run_dir), final_state(reference(tmp_path_factory, 2 * nproc)))


def port_text(port: int) -> str:
    return f":{port}"


def test_runtime_keys_start_the_launcher_across_hosts(hosts, tmp_path, tmp_path_factory):
    """The runtime.* keys do what the flags do."""
    port = next(_ports)
    run_dir = tmp_path / "run"
    procs = [hosts.popen(i, [str(BIN), *train_args(
        run_dir, "--set", "runtime.nnodes=2", "--set", f"runtime.node_rank={i}",
        "--set", f"runtime.master_addr={hosts.addr(0)}", "--set", f"runtime.master_port={port}")],
        env=clean_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in (0, 1)]
    for p in finish(procs, RUN_DEADLINE_S):
        ok(p)
    assert_same_state(final_state(run_dir), final_state(reference(tmp_path_factory, 2)))


def test_launcher_flag_errors():
    """Several hosts need a port, and the node rank must be below nnodes."""
    p = subprocess.run([str(BIN), *train_args(Path("/nonexistent/run"), "--nnodes", "2")],
                       capture_output=True, text=True, env=clean_env(), timeout=60)
    assert p.returncode == 2 and "runtime.master_port" in p.stderr, p.stderr
    p = subprocess.run([str(BIN), *train_args(Path("/nonexistent/run"), "--nnodes", "2",
                                              "--node-rank", "2", "--master-port", "29500")],
                       capture_output=True, text=True, env=clean_env(), timeout=60)
    assert p.returncode == 2 and "runtime.node_rank" in p.stderr, p.stderr


# ---------------------------------------------------------------- faults

LONG = ("--epochs", "12", "--set", f"runtime.timeout_s={TIMEOUT_S}")  # 192 steps, checkpoint every 8


def test_killed_rank_fails_every_host_naming_the_peer(hosts, tmp_path):
    """SIGKILL of host 1's rank mid-run: rank 0 reports the broken connection
    to rank 1 at host 1's address within the collective timeout, and both
    launchers exit non-zero; nothing is left running."""
    port = next(_ports)
    run_dir = tmp_path / "run"
    procs = [hosts.popen(i, launcher_argv(hosts, i, port, run_dir, *LONG), env=clean_env(),
                         text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in (0, 1)]
    wait_for(run_dir / "checkpoints" / "step_00000016.pt", procs, RUN_DEADLINE_S)
    victims = trainer_ranks(procs[1].pid)
    assert len(victims) == 1, victims
    os.kill(victims[0], signal.SIGKILL)
    killed_at = time.monotonic()
    results = finish(procs, TIMEOUT_S + SLACK_S)
    took = time.monotonic() - killed_at
    assert took < TIMEOUT_S + 15, f"the group took {took:.1f} s to stop"
    host0, host1 = results
    assert host0.returncode == 1, host0.stderr[-2000:]
    assert f"rank 1 at {hosts.addr(1)}" in host0.stderr, host0.stderr[-2000:]
    assert host1.returncode != 0 and "rank 1 was killed by signal 9" in host1.stderr, host1.stderr[-2000:]
    assert_no_orphans(str(run_dir))


def test_network_partition_fails_every_rank_within_the_timeout(hosts, tmp_path):
    """Host 1's link down for longer than runtime.timeout_s: every rank
    stops with a timeout error naming the key, no hang."""
    port = next(_ports)
    run_dir = tmp_path / "run"
    procs = [hosts.popen(i, launcher_argv(hosts, i, port, run_dir, *LONG), env=clean_env(),
                         text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in (0, 1)]
    wait_for(run_dir / "checkpoints" / "step_00000016.pt", procs, RUN_DEADLINE_S)
    hosts.link(1, up=False)
    cut_at = time.monotonic()
    try:
        results = finish(procs, TIMEOUT_S + SLACK_S)
    finally:
        hosts.link(1, up=True)
    took = time.monotonic() - cut_at
    assert took < 2 * TIMEOUT_S + 15, f"the ranks took {took:.1f} s to stop"
    for host, p in enumerate(results):
        assert p.returncode == 1, (host, p.stderr[-2000:])
        assert f"runtime.timeout_s={TIMEOUT_S}" in p.stderr, (host, p.stderr[-2000:])
    assert_no_orphans(str(run_dir))


def test_elastic_restart_resumes_bit_identical(hosts, tmp_path, tmp_path_factory):
    """torchrun --max-restarts 1, host 1's rank SIGKILLed mid-run: torchrun
    restarts the group, the trainer (--resume auto) continues from the newest
    complete checkpoint, and the run ends with the uninterrupted run's
    parameters and a metrics.jsonl without a duplicated or missing step."""
    port = next(_ports)
    run_dir = tmp_path / "run"
    trainer = [str(BIN), *train_args(run_dir, *LONG, "--resume", "auto")]
    procs = [hosts.popen(i, [*torchrun_argv(hosts, i, 1, port, "--max-restarts", "1",
                                            "--monitor-interval", "0.5"), "--no-python", *trainer],
                         env=clean_env(), text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE) for i in (0, 1)]
    wait_for(run_dir / "checkpoints" / "step_00000024.pt", procs, RUN_DEADLINE_S)
    victims = trainer_ranks(procs[1].pid)
    assert len(victims) == 1, victims
    os.kill(victims[0], signal.SIGKILL)
    results = finish(procs, RUN_DEADLINE_S)
    for p in results:
        ok(p)
    log = results[0].stdout
    assert "resumed from" in log, log[-3000:]
    expected = reference(tmp_path_factory, 2, *LONG)
    assert_same_state(final_state(run_dir), final_state(expected))
    assert train_steps(run_dir) == train_steps(expected)
    assert_no_orphans(str(run_dir))


def test_killed_while_writing_a_checkpoint_resumes_from_the_previous(tmp_path, tmp_path_factory):
    """A rank killed halfway through writing its third checkpoint (step 24)
    leaves a torn temporary file; --resume auto ignores it, resumes from step
    16 and ends where the uninterrupted run ends."""
    run_dir = tmp_path / "run"
    killed = subprocess.run([str(BIN), *train_args(run_dir, "--nproc", "2")], capture_output=True,
                            text=True, env=clean_env({"FUSETRAIN_FAULT_KILL_IN_CHECKPOINT": "3"}),
                            timeout=RUN_DEADLINE_S)
    assert killed.returncode == 128 + signal.SIGKILL, killed.stderr[-2000:]
    left = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert left[:2] == ["step_00000008.pt", "step_00000016.pt"], left
    assert any(".pt.tmp" in name for name in left), left  # the torn one
    resumed = ok(subprocess.run([str(BIN), *train_args(run_dir, "--nproc", "2", "--resume", "auto")],
                                capture_output=True, text=True, env=clean_env(), timeout=RUN_DEADLINE_S))
    assert "step_00000016.pt at step 16" in resumed.stdout, resumed.stdout[-2000:]
    assert not any(".pt.tmp" in p.name for p in (run_dir / "checkpoints").iterdir())
    expected = reference(tmp_path_factory, 2)
    assert_same_state(final_state(run_dir), final_state(expected))
    assert train_steps(run_dir) == train_steps(expected)


@pytest.mark.parametrize("shaping", ["loss_rate", "netem"])
def test_lossy_slow_link_trains_the_same_bits(hosts, tmp_path, tmp_path_factory, shaping):
    """1% loss on host 1's link (with a 50 Mbit/s rate limit, or netem's 100
    ms latency where the kernel has netem): slower, bit-identical."""
    applied = (hosts.shape(1, loss_pct=1, rate_mbit=50) if shaping == "loss_rate"
               else hosts.shape(1, delay_ms=100, loss_pct=1))
    if not applied:
        pytest.skip("this kernel has no netem (CONFIG_NET_SCH_NETEM): latency cannot be added; "
                    "the loss_rate case covers 1% loss")
    try:
        port = next(_ports)
        run_dir = tmp_path / "run"
        procs = [hosts.popen(i, launcher_argv(hosts, i, port, run_dir, "--epochs", "1"),
                             env=clean_env(), text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE) for i in (0, 1)]
        for p in finish(procs, RUN_DEADLINE_S):
            ok(p)
    finally:
        hosts.unshape(1)
    assert_same_state(final_state(run_dir), final_state(reference(tmp_path_factory, 2, "--epochs", "1")))


def test_different_config_fails_every_rank_before_any_step(hosts, tmp_path):
    """Host 1 started with another model width: every rank stops at start
    with the same message naming the key and both values, before a step."""
    port = next(_ports)
    run_dir = tmp_path / "run"
    procs = [hosts.popen(i, launcher_argv(hosts, i, port, run_dir,
                                          *(["--set", "model.hidden=64"] if i == 1 else [])),
                         env=clean_env(), text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE) for i in (0, 1)]
    for host, p in enumerate(finish(procs, TIMEOUT_S + SLACK_S)):
        assert p.returncode == 2, (host, p.stderr[-2000:])
        assert "rank 1 differs from rank 0 (model.hidden is 32 on rank 0 but 64 on rank 1)" in p.stderr, (host, p.stderr[-2000:])
    assert not list((run_dir / "checkpoints").glob("step_*.pt"))
    assert not (run_dir / "metrics.jsonl").exists() or not train_steps(run_dir)

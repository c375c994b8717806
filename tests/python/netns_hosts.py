"""Several hosts on one machine for multi-host tests (Linux network namespaces).

``scripts/netns-hosts.sh up N`` makes hosts ``fth0`` .. ``fth{N-1}``: network
namespaces whose ``eth0`` (address ``10.231.0.{i+1}/24``) hangs on one bridge
in the root namespace; nothing is routed out of them. ``Hosts`` runs
processes inside them and cuts or shapes a host's link; a test module asks
for its hosts with a fixture made by ``make_hosts_fixture``::

    from netns_hosts import assert_no_orphans, kill_tree, make_hosts_fixture

    hosts = make_hosts_fixture(2)        # fixture "hosts": Hosts(n=2), module scope

    def test_something(hosts):
        server = hosts.popen(1, [sys.executable, "server.py", "--bind", hosts.addr(1)])
        ...
        hosts.link(1, up=False)          # partition host 1
        kill_tree(server)

The fixture skips (with the reason: not root, no ``ip``, namespaces not
permitted) where namespaces cannot be made, runs ``up N`` before the
module's first test and ``down`` after its last, also when a test failed.
Hosts are machine-wide names, so one set exists at a time: a fixture holds a
lock file for its lifetime and a second pytest run waits for it.

Shaping: ``shape(i, loss_pct=..., rate_mbit=...)`` works on any kernel with
tbf and nftables; anything with ``delay_ms`` needs netem and returns False
where the kernel has none (as on the CI box), so the caller can skip.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator, List, Mapping, Optional, Sequence, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "netns-hosts.sh"
SUBNET = "10.231.0"
NS_PREFIX = "fth"
IFACE = "eth0"
EXIT_UNSUPPORTED = 3  # the script's exit code for "this kernel/host lacks it"
SCRIPT_TIMEOUT_S = 60.0
SESSION_LOCK = Path("/run/lock/fusetrain-netns-hosts.session.lock")
SESSION_LOCK_TIMEOUT_S = 600.0


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here; the message says why."""


def _ip() -> str:
    return shutil.which("ip") or next(
        (p for p in ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip") if os.access(p, os.X_OK)), "ip"
    )


def _script(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Runs scripts/netns-hosts.sh; raises RuntimeError (with its stderr) on a
    non-zero exit when ``check``."""
    proc = subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S
    )
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"netns-hosts.sh {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}"
        )
    return proc


def netns_check() -> Optional[str]:
    """None when network namespaces can be made here, else the reason."""
    if not SCRIPT.is_file():
        return f"{SCRIPT} is missing"
    try:
        proc = _script("check", check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"netns-hosts.sh check failed to run: {e}"
    if proc.returncode == 0:
        return None
    reason = proc.stderr.strip() or proc.stdout.strip() or f"exit code {proc.returncode}"
    return reason.removeprefix("netns-hosts: ")


class Hosts:
    """Hosts ``0 .. n-1`` made by ``scripts/netns-hosts.sh up n``."""

    iface: str = IFACE
    #: the script's message from the last shape() that returned False
    shape_unsupported_reason: str = ""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def _check_index(self, i: int) -> None:
        if not 0 <= i < self.n:
            raise IndexError(f"host {i} out of range 0..{self.n - 1}")

    def addr(self, i: int) -> str:
        """Host i's IPv4 address on its eth0, "10.231.0.{i+1}"."""
        self._check_index(i)
        return f"{SUBNET}.{i + 1}"

    def ns(self, i: int) -> str:
        """Host i's network namespace, "fth{i}"."""
        self._check_index(i)
        return f"{NS_PREFIX}{i}"

    @property
    def addrs(self) -> List[str]:
        return [self.addr(i) for i in range(self.n)]

    def exec_argv(self, i: int, argv: Sequence[str]) -> List[str]:
        """``argv`` prefixed to run inside host i's namespace."""
        return [_ip(), "netns", "exec", self.ns(i), *[str(a) for a in argv]]

    def popen(self, i: int, argv: Sequence[str], env: Optional[Mapping[str, str]] = None,
              **kw) -> subprocess.Popen:
        """Starts ``argv`` inside host i's namespace (``ip netns exec`` execs
        it, so the Popen's pid is the program's). It leads a new session and
        process group (``start_new_session=True`` unless ``kw`` says
        otherwise), so ``kill_tree`` ends it and all its children. ``env``:
        the whole environment (default: this process's)."""
        kw.setdefault("start_new_session", True)
        return subprocess.Popen(self.exec_argv(i, argv), env=None if env is None else dict(env), **kw)

    def run(self, i: int, argv: Sequence[str], timeout: float,
            env: Optional[Mapping[str, str]] = None, check: bool = False,
            capture_output: bool = True, text: bool = True, **kw) -> subprocess.CompletedProcess:
        """Runs ``argv`` inside host i's namespace to completion. Past
        ``timeout`` seconds its whole process group is killed and
        subprocess.TimeoutExpired raised."""
        if capture_output:
            kw.setdefault("stdout", subprocess.PIPE)
            kw.setdefault("stderr", subprocess.PIPE)
        p = self.popen(i, argv, env=env, text=text, **kw)
        try:
            out, err = p.communicate(timeout=timeout)
        except BaseException:  # TimeoutExpired, KeyboardInterrupt
            kill_tree(p)
            raise
        done = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        if check:
            done.check_returncode()
        return done

    def link(self, i: int, up: bool) -> None:
        """Sets host i's eth0 up, or down (partitions the host from all others)."""
        _script("link", self.ns(i), "up" if up else "down")

    def shape(self, i: int, delay_ms: Optional[float] = None, loss_pct: Optional[float] = None,
              rate_mbit: Optional[float] = None) -> bool:
        """Shapes what host i sends, replacing its earlier shaping. True when
        applied; False when this machine lacks what it takes (``delay_ms``
        needs the kernel's netem; loss needs nftables) and nothing was
        applied. Other failures raise RuntimeError."""
        args = ["shape", self.ns(i)]
        for flag, value in (("--delay-ms", delay_ms), ("--loss-pct", loss_pct),
                            ("--rate-mbit", rate_mbit)):
            if value is not None:
                args += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
        if len(args) == 2:
            raise ValueError("shape: give delay_ms, loss_pct and/or rate_mbit")
        proc = _script(*args, check=False)
        if proc.returncode == EXIT_UNSUPPORTED:
            self.shape_unsupported_reason = proc.stderr.strip()
            return False
        if proc.returncode != 0:
            raise RuntimeError(f"netns-hosts.sh {' '.join(args)} exited {proc.returncode}: "
                               f"{proc.stderr.strip()}")
        return True

    def unshape(self, i: int) -> None:
        """Removes host i's shaping (qdisc and nftables table)."""
        _script("unshape", self.ns(i))

    def reset(self) -> None:
        """Every host's link up and unshaped."""
        for i in range(self.n):
            self.unshape(i)
            self.link(i, up=True)


_lock_held = False  # by this process


@contextlib.contextmanager
def _session_lock(timeout_s: float = SESSION_LOCK_TIMEOUT_S) -> Iterator[None]:
    """Holds the machine-wide lock on the hosts (one set at a time)."""
    global _lock_held
    if _lock_held:
        raise RuntimeError("netns hosts are already up in this process (one set at a time: "
                           "give the fixtures module scope, or share one)")
    SESSION_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(SESSION_LOCK, "w") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another run holds {SESSION_LOCK} for over {timeout_s:.0f} s")
                time.sleep(0.2)
        _lock_held = True
        try:
            yield
        finally:
            _lock_held = False
            fcntl.flock(f, fcntl.LOCK_UN)


def leftovers() -> List[str]:
    """The hosts' namespaces and root-side links that exist now."""
    ns = subprocess.run([_ip(), "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    links = subprocess.run([_ip(), "-o", "link", "show"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in ns if line.strip()]
    names += [ln.split(": ")[1].split("@")[0] for ln in links.splitlines() if ": " in ln]
    return [x for x in names
            if x == "ftbr0" or (x.startswith(NS_PREFIX) and x[len(NS_PREFIX):].split("-")[0].isdigit())]


@contextlib.contextmanager
def netns_hosts_up(n: int) -> Iterator[Hosts]:
    """``up n`` on entry, ``down`` on exit (always). Raises NetnsUnavailable
    where namespaces cannot be made, and RuntimeError when ``down`` left
    something behind."""
    reason = netns_check()
    if reason is not None:
        raise NetnsUnavailable(reason)
    with _session_lock():
        try:
            _script("up", str(n))
            yield Hosts(n)
        finally:
            _script("down")
            left = leftovers()
            if left:
                raise RuntimeError(f"netns-hosts.sh down left {left}")


def make_hosts_fixture(n: int, scope: str = "module", name: Optional[str] = None) -> Callable:
    """A pytest fixture yielding ``Hosts(n)`` for the ``scope``: assign it at
    module level (``hosts = make_hosts_fixture(2)``) and the fixture takes
    that name (or ``name``). Skips with the reason where namespaces cannot
    be made; tears the hosts down after the scope, also on failure."""

    def fixture() -> Iterator[Hosts]:
        reason = netns_check()
        if reason is not None:
            pytest.skip(f"needs network namespaces (scripts/netns-hosts.sh check): {reason}")
        with netns_hosts_up(n) as hosts:
            yield hosts

    fixture.__name__ = name or f"netns_hosts{n}"
    fixture.__doc__ = f"Hosts(n={n}) in network namespaces ({scope} scope)."
    return pytest.fixture(scope=scope, name=name)(fixture)


def kill_tree(popen: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGKILLs ``popen``'s process group (the process and every child that
    stayed in it; ``Hosts.popen`` makes each process a group leader), then
    reaps ``popen``. A child that started its own session escapes: check
    with ``assert_no_orphans``."""
    try:
        os.killpg(popen.pid, signal.SIGKILL)  # ESRCH unless popen.pid leads a group
    except (ProcessLookupError, PermissionError):
        pass
    if popen.poll() is None:
        popen.kill()
    popen.wait(timeout=timeout)


def _ancestors() -> set:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def processes_matching(marker: str) -> List[Tuple[int, str]]:
    """(pid, command line) of every live process, other than this one and
    its ancestors, whose command line contains ``marker``."""
    skip = _ancestors()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in skip:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile
            continue
        if marker in cmdline:  # a zombie's cmdline is empty: it does not count
            found.append((int(entry), cmdline))
    return found


def assert_no_orphans(marker: str, timeout: float = 5.0) -> None:
    """Fails unless, within ``timeout`` seconds, no process whose command
    line contains ``marker`` is left (this process and its ancestors
    excepted). Give each test's processes a unique marker in their argv."""
    deadline = time.monotonic() + timeout
    while True:
        left = processes_matching(marker)
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    assert not left, f"orphan processes matching {marker!r}: " + "; ".join(
        f"pid {pid}: {cmd}" for pid, cmd in left
    )

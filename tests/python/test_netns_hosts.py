"""Self-test of netns_hosts: two hosts in network namespaces talk TCP/UDP
across the bridge; a link taken down partitions a host; loss and rate
shaping apply and go away again; netem delay applies or is reported
missing; kill_tree / assert_no_orphans find every process.

Skips where network namespaces cannot be made (not root, no ``ip``, not
permitted in this container). A few seconds.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import uuid
from typing import Optional

import pytest

from netns_hosts import (
    Hosts,
    assert_no_orphans,
    kill_tree,
    leftovers,
    make_hosts_fixture,
    processes_matching,
)

hosts = make_hosts_fixture(2)

# Reads a connection to EOF, then sends it all back and closes; one
# connection at a time. Prints its port once listening.
SERVER = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 0))
s.listen(8)
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    with c:
        c.settimeout(30)
        chunks = []
        while True:
            d = c.recv(1 << 16)
            if not d:
                break
            chunks.append(d)
        c.sendall(b"".join(chunks))
"""

# Connects (timeout argv[3]), sends argv[4] bytes, shuts down its write side
# and reads the echo; prints {"ok", "error", "connect_s", "total_s"}.
CLIENT = r"""
import json, socket, sys, time
host, port, timeout, size = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
payload = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
out = {"ok": False, "error": None}
t0 = time.monotonic()
try:
    c = socket.create_connection((host, port), timeout=timeout)
    out["connect_s"] = time.monotonic() - t0
    c.settimeout(30)
    c.sendall(payload)
    c.shutdown(socket.SHUT_WR)
    got = bytearray()
    while True:
        d = c.recv(1 << 16)
        if not d:
            break
        got += d
    out["ok"] = bytes(got) == payload
    if not out["ok"]:
        out["error"] = f"echo of {len(got)} bytes differs from the {size} sent"
except OSError as e:
    out["error"] = f"{type(e).__name__}: {e}"
out["total_s"] = time.monotonic() - t0
print(json.dumps(out), flush=True)
"""

# Counts UDP datagrams on argv[1] until 0.5 s pass without one; prints the count.
UDP_SINK = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
s.bind((sys.argv[1], 0))
print(s.getsockname()[1], flush=True)
s.settimeout(5)
n = 0
try:
    while True:
        s.recv(2048)
        n += 1
        s.settimeout(0.5)
except socket.timeout:
    pass
print(n, flush=True)
"""

UDP_SEND = r"""
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(int(sys.argv[3])):
    try:
        s.sendto(b"%06d" % i + b"." * 58, (sys.argv[1], int(sys.argv[2])))
    except PermissionError:  # dropped in the inet output hook (kernels without netdev egress)
        pass
    if i % 50 == 49:
        time.sleep(0.002)
"""


def _marker() -> str:
    return f"ft-netns-selftest-{uuid.uuid4().hex[:12]}"


class EchoServer:
    """SERVER on host ``i``; ``port`` once it listens."""

    def __init__(self, hosts: Hosts, i: int) -> None:
        self.marker = _marker()
        self.proc = hosts.popen(i, [sys.executable, "-c", SERVER, hosts.addr(i), self.marker],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            kill_tree(self.proc)
            raise AssertionError(f"echo server did not start: {line!r} {self.proc.stderr.read()}")
        self.port = int(line)

    def __enter__(self) -> "EchoServer":
        return self

    def __exit__(self, *exc) -> None:
        kill_tree(self.proc)
        assert_no_orphans(self.marker)


def client(hosts: Hosts, i: int, addr: str, port: int, timeout: float = 2.0,
           size: int = 64) -> dict:
    """Runs CLIENT on host ``i`` against ``addr:port``; its findings."""
    done = hosts.run(i, [sys.executable, "-c", CLIENT, addr, str(port), str(timeout), str(size)],
                     timeout=timeout + 30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def wait_connected(hosts: Hosts, i: int, addr: str, port: int, within_s: float = 10.0) -> dict:
    """CLIENT until it succeeds (links coming back up take a moment)."""
    deadline = time.monotonic() + within_s
    while True:
        out = client(hosts, i, addr, port, timeout=1.0)
        if out["ok"] or time.monotonic() > deadline:
            return out


def tc_qdisc(hosts: Hosts, i: int) -> str:
    return hosts.run(i, ["tc", "qdisc", "show", "dev", hosts.iface], timeout=10, check=True).stdout


@pytest.fixture
def clean(hosts: Hosts):
    """Every link up and unshaped again after the test."""
    yield hosts
    hosts.reset()


def test_layout(hosts: Hosts):
    assert (hosts.ns(0), hosts.ns(1)) == ("fth0", "fth1")
    assert (hosts.addr(0), hosts.addr(1)) == ("10.231.0.1", "10.231.0.2")
    for i in range(2):
        addrs = hosts.run(i, ["ip", "-4", "-o", "addr", "show"], timeout=10, check=True).stdout
        assert f"inet {hosts.addr(i)}/24" in addrs and f" {hosts.iface} " in addrs
        routes = hosts.run(i, ["ip", "route", "show", "default"], timeout=10, check=True).stdout
        assert routes.strip() == "", f"host {i} has a default route: {routes}"
    root = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, check=True).stdout
    assert "10.231." not in root
    assert not [ln for ln in root.splitlines() if " ftbr0 " in ln or " fth" in ln], root
    assert set(leftovers()) == {"ftbr0", "fth0", "fth1", "fth0-br", "fth1-br"}


def test_tcp_echo_across_namespaces(hosts: Hosts):
    with EchoServer(hosts, 1) as srv:
        out = client(hosts, 0, hosts.addr(1), srv.port, size=100_000)
        assert out["ok"], out
        # and host 1 reaches itself on its own address
        assert client(hosts, 1, hosts.addr(1), srv.port)["ok"]


def test_link_down_partitions_host(clean: Hosts):
    hosts = clean
    with EchoServer(hosts, 1) as srv:
        assert client(hosts, 0, hosts.addr(1), srv.port)["ok"]
        hosts.link(1, up=False)
        out = client(hosts, 0, hosts.addr(1), srv.port, timeout=2.0)
        assert not out["ok"], out
        assert out["total_s"] <= 2.5, out  # timed out (or unreachable) within the 2 s
        hosts.link(1, up=True)
        out = wait_connected(hosts, 0, hosts.addr(1), srv.port)
        assert out["ok"], out


def _udp_received(hosts: Hosts, count: int) -> int:
    marker = _marker()
    sink = hosts.popen(1, [sys.executable, "-c", UDP_SINK, hosts.addr(1), marker],
                       stdout=subprocess.PIPE, text=True)
    try:
        port = int(sink.stdout.readline())
        hosts.run(0, [sys.executable, "-c", UDP_SEND, hosts.addr(1), str(port), str(count)],
                  timeout=30, check=True)
        return int(sink.stdout.readline())
    finally:
        kill_tree(sink)
        assert_no_orphans(marker)


def test_loss_and_rate_shaping(clean: Hosts):
    hosts = clean
    if shutil.which("nft") is None:
        pytest.skip("loss shaping needs nft (apt-get install nftables; scripts/install-deps.sh)")
    with EchoServer(hosts, 1) as srv:
        size = 1_000_000
        plain = client(hosts, 0, hosts.addr(1), srv.port, size=size)
        assert plain["ok"], plain

        # 100 % loss on what host 0 sends: no connection.
        assert hosts.shape(0, loss_pct=100, rate_mbit=100) is True
        assert "tbf" in tc_qdisc(hosts, 0)
        out = client(hosts, 0, hosts.addr(1), srv.port, timeout=1.0)
        assert not out["ok"], out

        # 50 %: about half the datagrams arrive.
        assert hosts.shape(0, loss_pct=50) is True
        assert "tbf" not in tc_qdisc(hosts, 0)  # a new shape replaces the last
        got = _udp_received(hosts, 400)
        assert 100 <= got <= 300, f"{got} of 400 datagrams arrived at 50 % loss"

        # 16 Mbit/s: 1 MB takes about 0.5 s.
        assert hosts.shape(0, rate_mbit=16) is True
        slow = client(hosts, 0, hosts.addr(1), srv.port, size=size)
        assert slow["ok"], slow
        assert slow["total_s"] >= 0.35, (slow, plain)

        hosts.unshape(0)
        assert "tbf" not in tc_qdisc(hosts, 0)
        out = client(hosts, 0, hosts.addr(1), srv.port, size=size)
        assert out["ok"], out
        assert out["total_s"] < slow["total_s"], (out, slow)
        assert _udp_received(hosts, 200) == 200


def test_netem_delay_applies_or_reports_missing(clean: Hosts):
    hosts = clean
    delay_ms = 150
    with EchoServer(hosts, 1) as srv:
        applied = hosts.shape(0, delay_ms=delay_ms)
        out: Optional[dict] = client(hosts, 0, hosts.addr(1), srv.port, timeout=5.0)
        assert out["ok"], out
        if applied:
            assert "netem" in tc_qdisc(hosts, 0)
            # the SYN leaves host 0 delay_ms late
            assert out["connect_s"] >= 0.9 * delay_ms / 1000, out
        else:
            assert "netem" in hosts.shape_unsupported_reason, hosts.shape_unsupported_reason
            assert "netem" not in tc_qdisc(hosts, 0)
        hosts.unshape(0)
        assert "netem" not in tc_qdisc(hosts, 0)


def test_kill_tree_and_orphans(hosts: Hosts):
    marker = _marker()
    # a parent that starts a child in its process group, then waits
    code = ("import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', sys.argv[1]]); "
            "print('up', flush=True); time.sleep(60)")
    p = hosts.popen(0, [sys.executable, "-c", code, marker], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up"
    deadline = time.monotonic() + 5
    while len(processes_matching(marker)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(processes_matching(marker)) == 2
    with pytest.raises(AssertionError, match="orphan"):
        assert_no_orphans(marker, timeout=0.2)
    kill_tree(p)
    assert p.returncode is not None
    assert_no_orphans(marker)


def test_run_timeout_kills(hosts: Hosts):
    marker = _marker()
    with pytest.raises(subprocess.TimeoutExpired):
        hosts.run(1, [sys.executable, "-c", "import time; time.sleep(60)", marker], timeout=0.5)
    assert_no_orphans(marker)

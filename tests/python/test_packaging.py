"""The wheel, installed the way Python users install packages: built with
``pip wheel --no-build-isolation --no-deps`` by this interpreter (whose torch
is the pinned one), checked for its contents and RUNPATHs, then installed
with torch into a fresh virtual environment (no system site packages) where
tests/python/wheel_smoke.py imports every module and runs one scaled fused
step and one 2-rank DDP step.

Why the explicit RUNPATH check: the venv the wheel was built in still exists
while this runs, so a library that recorded its absolute torch path would
still load in the fresh venv. Only a RUNPATH relative to the package
(``$ORIGIN``) is right once the build environment is gone (pip's isolated
builds delete theirs).

Costs, measured on 2 cores: the CMake build folder build-wheel/ (repo root,
ignored by git) is kept between runs, so a rebuild with nothing changed takes
~6 s; beside a `make build` of the same checkout most compiles hit ccache
(1m47 measured); a cold build takes ~11 min. Torch and its dependencies
(2.6 GB of wheels) are downloaded once into a wheelhouse (FUSETRAIN_WHEELHOUSE,
default ~/.cache/fusetrain/wheels; 35 s) because pip's own HTTP cache stores
nothing here (the index sends no caching headers), then installed from it
offline (~60 s, 4.6 GB unpacked, deleted after the test). The smoke script
takes 10-30 s. In all, 2.5-4 min with a warm build folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SMOKE = Path(__file__).resolve().parent / "wheel_smoke.py"
TORCH_VERSION = torch.__version__.split("+")[0]
WHEELHOUSE = Path(os.environ.get("FUSETRAIN_WHEELHOUSE", Path.home() / ".cache" / "fusetrain" / "wheels"))

BUILD_TIMEOUT_S = 2400  # a cold build (no ccache hits) is 15-20 min on 2 cores
DOWNLOAD_TIMEOUT_S = 900
INSTALL_TIMEOUT_S = 600
SMOKE_TIMEOUT_S = 300

_missing = [tool for tool in ("cmake", "ninja", "readelf") if shutil.which(tool) is None]
pytestmark = pytest.mark.skipif(
    bool(_missing), reason=f"building the wheel needs {', '.join(_missing)} on PATH (scripts/install-deps.sh)")


def _clean_env() -> dict:
    """The environment without what would hide a wrong RUNPATH or leak this
    checkout's package into another interpreter."""
    env = dict(os.environ)
    # FUSETRAIN_BUILD_DIR (the tests' CLI build) would also be setup.py's
    # CMake folder: the wheel would be built over `make build`'s.
    for var in ("LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONPATH", "PYTHONHOME", "FUSETRAIN_BUILD_DIR"):
        env.pop(var, None)
    return env


def _run(cmd, timeout, what, log: Path, cwd=None) -> None:
    """Runs cmd with its output in log; fails the test with the log's tail."""
    with open(log, "w") as out:
        try:
            rc = subprocess.run([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT,
                                timeout=timeout, env=_clean_env(), cwd=cwd).returncode
        except subprocess.TimeoutExpired:
            rc = None
    if rc != 0:
        status = f"timed out after {timeout} s" if rc is None else f"exit {rc}"
        pytest.fail(f"{what}: {status}\n{log.read_text(errors='replace')[-6000:]}")


def _source_modules() -> set:
    """Every Python module under python/fusetrain, as dotted names."""
    pkg_root = ROOT / "python"
    names = set()
    for path in (pkg_root / "fusetrain").rglob("*.py"):
        parts = path.relative_to(pkg_root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if "__pycache__" not in parts:
            names.add(".".join(parts))
    return names


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-v", ROOT, "-w", dist],
         BUILD_TIMEOUT_S, "pip wheel", dist / "build.log", cwd=ROOT)
    wheels = list(dist.glob("fusetrain-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory, wheel):
    """A new venv holding torch (from the wheelhouse) and the wheel only;
    deleted afterwards (it is 4.6 GB)."""
    tmp = tmp_path_factory.mktemp("fresh")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], 120, "python -m venv", tmp / "venv.log")
    python = venv / "bin" / "python"
    # This interpreter's pip installs into the new venv (--python): one pip
    # version, and the venv needs no pip of its own.
    install = [sys.executable, "-m", "pip", "--python", python, "install", "--no-index", "--find-links",
               WHEELHOUSE, "--no-compile", f"torch=={TORCH_VERSION}", wheel]
    try:
        with open(tmp / "install.log", "w") as out:
            offline = subprocess.run([str(c) for c in install], stdout=out, stderr=subprocess.STDOUT,
                                     timeout=INSTALL_TIMEOUT_S, env=_clean_env()).returncode == 0
        if not offline:  # the first run on a machine: fill the wheelhouse
            WHEELHOUSE.mkdir(parents=True, exist_ok=True)
            _run([sys.executable, "-m", "pip", "download", "-d", WHEELHOUSE, f"torch=={TORCH_VERSION}"],
                 DOWNLOAD_TIMEOUT_S, f"pip download torch=={TORCH_VERSION}", tmp / "download.log")
            _run(install, INSTALL_TIMEOUT_S, "pip install torch and the wheel", tmp / "install.log")
        yield python
    finally:
        shutil.rmtree(venv, ignore_errors=True)


def test_wheel_holds_every_module_and_both_libraries(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    modules = {n[:-3].replace("/", ".").removesuffix(".__init__") for n in names if n.endswith(".py")}
    missing = _source_modules() - modules
    assert not missing, f"the wheel lacks {sorted(missing)} (setup.py's packages)"
    libs = {n for n in names if n.endswith(".so")}
    # The C++ core where torch keeps its own: a lib/ folder that is not a package.
    assert "fusetrain/lib/libfusetrain.so" in libs, libs
    assert "fusetrain/libfusetrain.so" not in libs and "fusetrain/lib/__init__.py" not in names, libs
    assert any(n.startswith("fusetrain/_C.") for n in libs), libs


def test_wheel_offers_the_tpu_extra(wheel):
    """`pip install "fusetrain[tpu]"` pulls torch_tpu in; plain installs do not."""
    archive = zipfile.ZipFile(wheel)
    metadata = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA")))
    lines = metadata.decode().splitlines()
    assert "Provides-Extra: tpu" in lines
    requires = [line for line in lines if line.startswith("Requires-Dist: torch-tpu")]
    assert requires and all('extra == "tpu"' in line for line in requires), requires


def _runpath(lib: Path) -> list:
    out = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, timeout=60, check=True).stdout
    entries = []
    for line in out.splitlines():
        if "(RUNPATH)" in line or "(RPATH)" in line:
            entries += line.split("[", 1)[1].rsplit("]", 1)[0].split(":")
    return entries


def test_wheel_libraries_find_torch_relative_to_themselves(wheel, tmp_path):
    """site-packages/fusetrain/_C*.so and fusetrain/lib/libfusetrain.so must
    find each other and torch/lib through $ORIGIN, and record no absolute (or
    empty, meaning the current directory) entry: those are paths of the build
    machine."""
    with zipfile.ZipFile(wheel) as z:
        libs = [n for n in z.namelist() if n.endswith(".so")]
        z.extractall(tmp_path, members=libs)
    for name in libs:
        runpath = _runpath(tmp_path / name)
        bad = [e for e in runpath if not e.startswith("$ORIGIN")]
        assert not bad, f"{name}: RUNPATH {runpath} has entries outside the package: {bad}"
        needs = ("$ORIGIN/../../torch/lib",) if name.startswith("fusetrain/lib/") else (
            "$ORIGIN/lib", "$ORIGIN/../torch/lib")
        for needed in needs:
            assert needed in runpath, f"{name}: RUNPATH {runpath} lacks {needed}"


def test_wheel_imports_and_trains_in_a_fresh_venv(fresh_venv, tmp_path):
    script = tmp_path / SMOKE.name  # a copy: nothing of this checkout beside it
    shutil.copy(SMOKE, script)
    log = tmp_path / "smoke.log"
    _run([fresh_venv, "-I", script], SMOKE_TIMEOUT_S, "wheel_smoke.py in the fresh venv", log, cwd=tmp_path)
    out = log.read_text()
    imported = next(line.split()[1:] for line in out.splitlines() if line.startswith("modules:"))
    optional = next(line.split()[1:] for line in out.splitlines() if line.startswith("optional:"))
    expected = (_source_modules() - {"fusetrain"}) | {"fusetrain._C"}
    found = set(imported) | set(optional)
    assert found == expected, f"found {sorted(found)}, expected {sorted(expected)}"
    # Only the integrations may need more than torch (their extras).
    extras = [n for n in optional if not n.startswith(("fusetrain.lightning", "fusetrain.integrations"))]
    assert not extras, f"{extras} failed to import with torch alone"
    for check in ("imports: ok", "scaled step: ok", "ddp step: ok"):
        assert check in out, out

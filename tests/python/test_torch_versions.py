"""fusetrain on the torch releases it supports (python/fusetrain/_torch_versions.py),
and one clear line wherever the torch is the wrong one: configuring against a
torch outside the range, installing without build isolation into an
environment without torch, importing under a torch other than the one the
extension was built for, and asking install-deps for an unsupported torch.

The wrong torches are stand-ins: a ``torch`` package of a few lines put first
on PYTHONPATH, which is all the configure step and setup.py ask of torch before
they decide. The import check is also run for real where another supported
torch's venv is on the machine (CI's second leg makes one): its interpreter
imports this build and must raise the ImportError, not crash.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fusetrain
from fusetrain import _compat, _torch_versions

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(fusetrain.__file__).parent  # python/fusetrain, or a TORCH_VERSION build's
RUNNING = torch.__version__


def _minor(version: str) -> tuple:
    return tuple(int(p) for p in version.split("+")[0].split(".")[:2])


def _fake_torch(tmp_path: Path, version: str) -> Path:
    """A folder holding a stand-in ``torch`` of this version (for PYTHONPATH)."""
    package = tmp_path / "fake" / "torch"
    (package / "utils").mkdir(parents=True)
    (package / "__init__.py").write_text(
        f"__version__ = {version!r}\nfrom . import utils, version\n")
    (package / "version.py").write_text("cuda = None\n")
    (package / "utils" / "__init__.py").write_text(f"cmake_prefix_path = {str(tmp_path / 'nowhere')!r}\n")
    return tmp_path / "fake"


def _env(**extra) -> dict:
    # FUSETRAIN_BUILD_DIR would also be setup.py's CMake folder.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "FUSETRAIN_BUILD_DIR")}
    env.update(extra)
    return env


def test_the_running_torch_is_supported_and_the_default_is_the_newest():
    assert _minor(_torch_versions.OLDEST) <= _minor(RUNNING) <= _minor(_torch_versions.NEWEST)
    assert _minor(_torch_versions.DEFAULT) == _minor(_torch_versions.NEWEST)


def test_pyproject_build_requirement_is_the_supported_range():
    """pyproject.toml cannot read _torch_versions.py: the two must agree."""
    text = (ROOT / "pyproject.toml").read_text()
    req = re.search(r'"torch>=([0-9.]+),<([0-9.]+)"', text)
    assert req, "pyproject.toml's build requirements name no torch range"
    newest = _minor(_torch_versions.NEWEST)
    assert req.group(1) == _torch_versions.OLDEST
    assert _minor(req.group(2)) == (newest[0], newest[1] + 1)


# ------------------------------------------------------------- import check
def _record(tmp_path: Path, torch_version: str, cuda=None, rebuild="make -C /src build PYTHON={python}") -> Path:
    record = tmp_path / "build-info.json"
    record.write_text(json.dumps({"fusetrain": "0.1.0", "torch": torch_version, "cuda": cuda,
                                  "rebuild": rebuild}))
    return record


def test_build_record_of_this_torch_passes(tmp_path):
    _compat.check_torch_build(_record(tmp_path, RUNNING, torch.version.cuda))
    # A patch release of the same minor keeps the ABI (the wheel requires X.Y.*).
    major, minor = _minor(RUNNING)
    _compat.check_torch_build(_record(tmp_path, f"{major}.{minor}.9", torch.version.cuda))


@pytest.mark.parametrize("built", ["2.11.0+cu130", "2.13.1", "2.15.0+cu132"])
def test_build_record_of_another_torch_raises_naming_both_and_the_fix(tmp_path, built):
    if _minor(built) == _minor(RUNNING):
        pytest.skip("that build is this torch's")
    with pytest.raises(ImportError) as err:
        _compat.check_torch_build(_record(tmp_path, built))
    message = str(err.value)
    # The command rebuilds for the Python that failed to import.
    assert built in message and RUNNING in message, message
    assert message.endswith(f"make -C /src build PYTHON={sys.executable}"), message
    assert "\n" not in message


def test_build_record_with_cuda_under_a_torch_without_cuda_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ImportError, match=r"built with CUDA kernels .* has no CUDA"):
        _compat.check_torch_build(_record(tmp_path, RUNNING, cuda="13.2"))


def test_import_of_a_build_for_another_torch_is_an_import_error(tmp_path):
    """The package as built, its record changed to another torch's: `import
    fusetrain` in a fresh interpreter raises the ImportError before the
    extension is loaded."""
    copy = tmp_path / "site" / "fusetrain"
    shutil.copytree(PACKAGE, copy, symlinks=False, ignore=shutil.ignore_patterns("__pycache__"))
    record = json.loads((copy / "lib" / "build-info.json").read_text())
    other = "2.11.0" if _minor(RUNNING) != (2, 11) else "2.15.0"
    record["torch"] = other
    (copy / "lib" / "build-info.json").write_text(json.dumps(record))
    p = subprocess.run([sys.executable, "-c", "import fusetrain"], capture_output=True, text=True,
                       env=_env(PYTHONPATH=str(copy.parent)), timeout=120)
    assert p.returncode == 1, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: fusetrain was built for torch " + other), last
    assert RUNNING in last and record["rebuild"].replace("{python}", sys.executable) in last, last


def _other_torch_pythons():
    """Interpreters of this checkout's other venvs whose torch has another
    minor version (CI's second leg leaves .venv and .venv-torch2.11.0)."""
    found = []
    for venv in sorted(ROOT.glob(".venv*")):
        python = venv / "bin" / "python"
        if not os.access(python, os.X_OK) or python.resolve() == Path(sys.executable).resolve():
            continue
        p = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                           text=True, timeout=120, env=_env())
        if p.returncode == 0 and _minor(p.stdout.strip()) != _minor(RUNNING):
            found.append((python, p.stdout.strip()))
    return found


def test_import_under_a_real_other_torch_is_an_import_error():
    """Another torch for real: its Python imports this build, whose extension
    would otherwise fail on an undefined symbol or run with the wrong ABI."""
    others = _other_torch_pythons()
    if not others:
        pytest.skip("no venv with another supported torch here (TORCH_VERSION=2.11.0 make test makes one)")
    for python, version in others:
        p = subprocess.run([python, "-c", "import fusetrain"], capture_output=True, text=True, timeout=120,
                           env=_env(PYTHONPATH=str(PACKAGE.parent)))
        assert p.returncode == 1, (python, p.stderr[-3000:])
        last = p.stderr.strip().splitlines()[-1]
        assert last.startswith(f"ImportError: fusetrain was built for torch {RUNNING}, but this Python "
                               f"has torch {version}"), last


BUILD = Path(os.environ.get("FUSETRAIN_BUILD_DIR", ROOT / "build"))


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
def test_cmake_package_under_a_real_other_torch_fails_to_configure(tmp_path):
    """find_package(fusetrain) beside another torch's find_package(Torch): a
    configure error naming both, not a link or load failure later."""
    others = _other_torch_pythons()
    if not others:
        pytest.skip("no venv with another supported torch here (TORCH_VERSION=2.11.0 make test makes one)")
    python, version = others[0]
    prefix = subprocess.run([python, "-c", "import torch; print(torch.utils.cmake_prefix_path)"],
                            capture_output=True, text=True, timeout=120, env=_env()).stdout.strip()
    subprocess.run(["cmake", "--install", BUILD, "--prefix", tmp_path / "prefix"], check=True,
                   capture_output=True, timeout=300)
    p = subprocess.run(["cmake", "-S", ROOT / "tests" / "consumer", "-B", tmp_path / "build",
                        f"-DCMAKE_PREFIX_PATH={tmp_path / 'prefix'};{prefix}"],
                       capture_output=True, text=True, timeout=300, env=_env())
    assert p.returncode != 0
    out = " ".join((p.stdout + p.stderr).split())
    assert f"fusetrain was built against torch {RUNNING}, and find_package(Torch) found torch " \
           f"{version.split('+')[0]}" in out, out[-3000:]


# ------------------------------------------------------------ configure check
@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
@pytest.mark.parametrize("version", ["2.10.1", "2.16.0"])
def test_configure_against_an_unsupported_torch_fails_in_one_line(tmp_path, version):
    fake = _fake_torch(tmp_path, version)
    p = subprocess.run(["cmake", "-S", ROOT, "-B", tmp_path / "build", f"-DPython3_EXECUTABLE={sys.executable}",
                        "-DFUSETRAIN_CUDA=OFF"], capture_output=True, text=True, timeout=300,
                       env=_env(PYTHONPATH=str(fake)))
    assert p.returncode != 0
    lines = [line.strip() for line in p.stderr.splitlines() if "fusetrain supports torch" in line]
    assert len(lines) == 1, p.stderr[-3000:]
    line = lines[0]
    assert f"torch {_torch_versions.OLDEST} through {_torch_versions.NEWEST}" in line, line
    assert f"has torch {version}" in line and f"pip install torch=={_torch_versions.DEFAULT}" in line, line


# ------------------------------------------------------------ setup.py checks
def test_no_build_isolation_install_without_torch_says_what_to_do(tmp_path):
    """pip install --no-build-isolation in an environment with no torch: one
    line that says so, names the range and the way out."""
    # This interpreter's pip and setuptools, with torch hidden behind a
    # package that cannot be imported.
    hide = tmp_path / "hide"
    (hide / "torch").mkdir(parents=True)
    (hide / "torch" / "__init__.py").write_text("raise ImportError('No module named torch')\n")
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                        "-w", tmp_path / "dist", ROOT],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env=_env(PYTHONPATH=str(hide)))
    assert p.returncode != 0
    out = p.stdout + p.stderr
    lines = [line.strip() for line in out.splitlines() if line.strip().startswith("fusetrain: no torch in")]
    assert len(lines) == 1, out[-4000:]
    assert f"torch {_torch_versions.OLDEST} through {_torch_versions.NEWEST}" in lines[0]
    assert f"pip install torch=={_torch_versions.DEFAULT}" in lines[0]


@pytest.mark.parametrize("version", ["2.10.0", "2.16.0"])
def test_setup_refuses_an_unsupported_torch(tmp_path, version):
    fake = _fake_torch(tmp_path, version)
    p = subprocess.run([sys.executable, ROOT / "setup.py", "--name"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=_env(PYTHONPATH=str(fake)))
    assert p.returncode != 0
    assert (f"fusetrain supports torch {_torch_versions.OLDEST} through {_torch_versions.NEWEST}, and "
            f"{sys.executable} has torch {version}") in p.stderr, p.stderr[-3000:]


def test_setup_requires_the_minor_version_it_builds_against(tmp_path):
    """The metadata's torch requirement, as a fresh wheel's METADATA would
    carry it (test_packaging checks the built wheel's)."""
    p = subprocess.run([sys.executable, ROOT / "setup.py", "-q", "egg_info", "--egg-base", tmp_path],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=_env())
    assert p.returncode == 0, p.stderr[-3000:]
    requires = (tmp_path / "fusetrain.egg-info" / "requires.txt").read_text().splitlines()
    major, minor = _minor(RUNNING)
    assert requires[0] == f"torch=={major}.{minor}.*", requires


# -------------------------------------------------------------- install-deps
@pytest.mark.parametrize("version", ["2.10.0", "2.16.0"])
def test_install_deps_refuses_an_unsupported_torch(version):
    p = subprocess.run([ROOT / "scripts" / "install-deps.sh"], capture_output=True, text=True, timeout=60,
                       env=_env(TORCH_VERSION=version, PYTHON=sys.executable))
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.strip() == (f"install-deps: TORCH_VERSION={version} is outside the supported torch "
                                f"{_torch_versions.OLDEST} through {_torch_versions.NEWEST}")

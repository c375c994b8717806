"""The Python-side differences between the torch releases fusetrain supports
(``_torch_versions.py``), each named by the feature it adapts, and the check
that the torch being imported is the one the extension was built for.

Note [torch compat] (csrc/compat.h has the C++ side): every difference between
torch releases lives here, detected from what torch has rather than from its
version number where that is possible, so that the rest of the package reads
as if there were one torch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from . import _torch_versions

# Not resolved: a TORCH_VERSION build links the modules in from python/ and
# keeps its own lib/ (scripts/install-python.sh).
_BUILD_RECORD = Path(__file__).parent / "lib" / "build-info.json"


def _minor(version: str) -> str:
    """'2.15.0+cu132' -> '2.15'."""
    return ".".join(version.split("+")[0].split(".")[:2])


def _as_tuple(minor: str) -> tuple:
    return tuple(int(p) for p in minor.split("."))


def check_torch_build(record: Path = _BUILD_RECORD) -> None:
    """Raises ImportError when the running torch is not the one the extension
    was built for (Note [Build record] in CMakeLists.txt): loading it would
    fail on an undefined symbol, or worse, run with another ABI. The message
    names both versions and the command that rebuilds."""
    try:
        built = json.loads(record.read_text())
    except FileNotFoundError:
        return  # no build record: loading _C reports what is missing
    running = torch.__version__
    rebuild = (built.get("rebuild") or "{python} -m pip install --no-build-isolation --force-reinstall "
               "--no-deps <fusetrain's source>").replace("{python}", sys.executable)
    if _minor(built["torch"]) != _minor(running):
        supported = ""
        if not (_as_tuple(_torch_versions.OLDEST) <= _as_tuple(_minor(running))
                <= _as_tuple(_torch_versions.NEWEST)):
            supported = (f" (fusetrain supports torch {_torch_versions.OLDEST} through "
                         f"{_torch_versions.NEWEST})")
        raise ImportError(
            f"fusetrain was built for torch {built['torch']}, but this Python has torch {running}"
            f"{supported}; rebuild it against this torch: {rebuild}")
    cuda = built.get("cuda")
    if cuda and torch.version.cuda is None:
        raise ImportError(
            f"fusetrain was built with CUDA kernels for torch {built['torch']} (CUDA {cuda}), but this "
            f"Python's torch {running} has no CUDA; install a CUDA build of torch {_minor(running)}, "
            f"or rebuild fusetrain against this torch: {rebuild}")
    if cuda and cuda.split(".")[0] != torch.version.cuda.split(".")[0]:
        raise ImportError(
            f"fusetrain was built for CUDA {cuda} (torch {built['torch']}), but this Python's torch "
            f"{running} uses CUDA {torch.version.cuda}; rebuild it against this torch: {rebuild}")

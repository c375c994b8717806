"""Which torch devices this process can train on, and the TPU through torch_tpu.

fusetrain's ops have CPU and CUDA kernels and a device-generic implementation
in ATen operations (Note [Device-generic ops] in csrc/ops/generic.h) that the
dispatcher runs on every other backend: an out-of-tree PrivateUse1 device such
as torch_tpu's ``"tpu"``, XPU, MPS. This module names those devices:
:func:`devices` lists them, :func:`device_type` parses a device the way torch
does but explains a ``"tpu"`` that torch cannot parse yet (torch_tpu missing,
or not imported), and :func:`autocast_device_types` is what a float32 island
switches autocast off on.

torch_tpu (``pip install "fusetrain[tpu]"``, or ``pip install torch-tpu``)
registers itself as torch's PrivateUse1 backend under the name ``"tpu"`` when
imported; fusetrain imports it on first need where it is installed. No TPU
has been reachable from where fusetrain is developed: the TPU paths are
tested against a stand-in PrivateUse1 backend named "tpu" on the CPU
(tests/python/test_tpu.py), never on a TPU.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import List, Tuple, Union

import torch

__all__ = ["devices", "device_type", "autocast_device_types", "tpu_available"]

TPU = "tpu"
TPU_INSTALL = 'pip install "fusetrain[tpu]" (or pip install torch-tpu)'

# The in-tree device types torch's autocast can run on, besides PrivateUse1.
_AUTOCAST_CANDIDATES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "maia", "xla", "ipu")


def _privateuse1() -> str:
    """The name of torch's PrivateUse1 backend ("privateuseone" until a
    backend such as torch_tpu renames it)."""
    return torch._C._get_privateuse1_backend_name()


def _import_torch_tpu() -> bool:
    """Imports torch_tpu where it is installed (which registers the "tpu"
    backend); False where it is not."""
    if _privateuse1() == TPU:
        return True
    if importlib.util.find_spec("torch_tpu") is None:
        return False
    importlib.import_module("torch_tpu")
    return _privateuse1() == TPU


def tpu_available() -> bool:
    """True when the "tpu" backend is registered and sees at least one TPU."""
    if not _import_torch_tpu():
        return False
    module = getattr(torch, TPU, None)
    return module is not None and _count(module) > 0


def _count(module) -> int:
    counter = getattr(module, "device_count", None)
    if counter is None:
        available = getattr(module, "is_available", None)
        return int(bool(available())) if available is not None else 0
    return int(counter())


def device_type(device: Union[torch.device, str, None], where: str = "fusetrain") -> str:
    """The type of ``device`` ("cpu", "cuda", "tpu", ...), as
    ``torch.device(device).type``; ``None`` is the default device (CUDA when
    visible, else the CPU). A ``"tpu"`` imports torch_tpu first where it is
    installed; where it is not, the error says how to install it rather than
    listing torch's in-tree device types."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, torch.device):
        return device.type
    text = str(device)
    if text.split(":", 1)[0] == TPU and not _import_torch_tpu():
        raise RuntimeError(
            f'{where}: device "{text}" needs torch_tpu, the TPU backend of torch, which is not '
            f"installed here: {TPU_INSTALL}"
        )
    return torch.device(text).type


@functools.lru_cache(maxsize=None)
def _autocast_types(privateuse1: str) -> Tuple[str, ...]:
    names = list(_AUTOCAST_CANDIDATES)
    if privateuse1 != "privateuseone":
        names.append(privateuse1)
    return tuple(n for n in names if torch.amp.is_autocast_available(n))


def autocast_device_types() -> Tuple[str, ...]:
    """The device types torch's autocast can be enabled on in this process:
    the in-tree ones and the PrivateUse1 backend under its current name."""
    return _autocast_types(_privateuse1())


def devices() -> List[torch.device]:
    """Every device this process can train on: ``cpu``, then ``cuda:i`` for
    each visible GPU, ``tpu:i`` for each TPU (importing torch_tpu where it is
    installed), ``xpu:i``, ``mps``, and the devices of any other registered
    PrivateUse1 backend. fusetrain runs on each (its own kernels on CPU and
    CUDA, the device-generic ops elsewhere)."""
    found = [torch.device("cpu")]
    found += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    _import_torch_tpu()
    name = _privateuse1()
    if name != "privateuseone":
        module = getattr(torch, name, None)
        if module is not None:
            found += [torch.device(name, i) for i in range(_count(module))]
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        found += [torch.device("xpu", i) for i in range(xpu.device_count())]
    if torch.backends.mps.is_available():
        found.append(torch.device("mps"))
    return found

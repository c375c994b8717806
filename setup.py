"""Builds the fusetrain Python package by driving the project's one CMake
build (CMakeLists.txt); the extension and libfusetrain come from there.

    pip install .                             # build requirements: pyproject.toml
    pip install --no-build-isolation .        # with those already installed
    pip wheel --no-build-isolation --no-deps . -w dist/

The wheel's libraries find torch's beside them in site-packages through a
RUNPATH relative to their folder (FUSETRAIN_RELOCATABLE_RPATH, Note [Wheel
RUNPATH] in CMakeLists.txt), so a wheel built in one environment works in any
other with the same torch. An editable install (`pip install -e .`) copies
libraries that record this environment's torch into python/fusetrain/ instead,
as `make build` does.

fusetrain is compiled against the torch of the environment that builds it
(any of the releases python/fusetrain/_torch_versions.py names), and the
package requires that torch's minor version (torch==2.15.* when built against
2.15.0), as torchvision's wheels do: a C++ extension only loads into the torch
whose ABI it was compiled for, so pip refuses or flags a later torch upgrade
instead of leaving a package that no longer imports.

FUSETRAIN_BUILD_DIR picks the CMake build folder (default: build-wheel/, or
build-editable/ for an editable install; build/ is `make build`'s). It is
kept between builds (ccache and ninja make a rebuild quick) and configured
afresh when the torch it was configured for is no longer the one building.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
STAGING = ROOT / "build-wheel" / "setuptools"
STAGING.mkdir(parents=True, exist_ok=True)  # egg_info wants its folder to exist


def torch_range() -> dict:
    """OLDEST, NEWEST and DEFAULT of python/fusetrain/_torch_versions.py
    (read as text: the package cannot be imported before it is built)."""
    fields = {}
    exec((ROOT / "python" / "fusetrain" / "_torch_versions.py").read_text(), {}, fields)
    return fields


def build_torch() -> str:
    """The version of the torch this build compiles against, or an exit with
    one line saying what to do: without build isolation, pip runs this with
    the environment's own packages, which must hold a supported torch."""
    supported = torch_range()
    found = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        sys.exit(f"fusetrain: no torch in {sys.executable}, and fusetrain is compiled against the torch "
                 f"it will run with: install one of torch {supported['OLDEST']} through "
                 f"{supported['NEWEST']} first (pip install torch=={supported['DEFAULT']}), or build "
                 f"with isolation (pip install . without --no-build-isolation)")
    version = found.stdout.strip().splitlines()[-1]
    minor = tuple(int(p) for p in version.split("+")[0].split(".")[:2])
    oldest, newest = (tuple(int(p) for p in supported[k].split(".")) for k in ("OLDEST", "NEWEST"))
    if not oldest <= minor <= newest:
        sys.exit(f"fusetrain supports torch {supported['OLDEST']} through {supported['NEWEST']}, and "
                 f"{sys.executable} has torch {version}: install a supported one "
                 f"(pip install torch=={supported['DEFAULT']})")
    return version


def cmake_build_dir(editable: bool) -> Path:
    default = ROOT / ("build-editable" if editable else "build-wheel")
    return Path(os.environ.get("FUSETRAIN_BUILD_DIR", default)).resolve()


def cached(build_dir: Path, name: str):
    """The value of NAME in BUILD_DIR's CMakeCache.txt, or None."""
    cache = build_dir / "CMakeCache.txt"
    if not cache.exists():
        return None
    for line in cache.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and key.split(":")[0] == name:
            return value
    return None


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def run(self):
        # build_ext.run clears `inplace` while it builds (and copies the
        # extension into the source tree afterwards): note it first.
        self.editable = bool(self.inplace or getattr(self, "editable_mode", False))
        super().run()

    def build_extension(self, ext):
        editable = self.editable
        build_dir = cmake_build_dir(editable)
        relocatable = "OFF" if editable else "ON"
        torch_dir = subprocess.check_output(
            [sys.executable, "-c", "import torch, os; print(os.path.join(torch.utils.cmake_prefix_path, 'Torch'))"],
            text=True).strip()
        # pip's isolated builds bring a new torch each time: a cache that
        # points at another one (or another RUNPATH mode) is configured afresh.
        if (cached(build_dir, "Torch_DIR") != torch_dir
                or cached(build_dir, "FUSETRAIN_RELOCATABLE_RPATH") != relocatable):
            fresh = ["--fresh"] if (build_dir / "CMakeCache.txt").exists() else []
            generator = ["-G", "Ninja"] if shutil.which("ninja") else []
            subprocess.check_call(
                ["cmake", *fresh, "-S", str(ROOT), "-B", str(build_dir), *generator,
                 f"-DPython3_EXECUTABLE={sys.executable}",
                 f"-DFUSETRAIN_RELOCATABLE_RPATH={relocatable}", "-DFUSETRAIN_TESTS=OFF"]
            )
        subprocess.check_call(
            ["cmake", "--build", str(build_dir), "--target", "_C", "-j", str(os.cpu_count() or 2)]
        )
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        target.parent.mkdir(parents=True, exist_ok=True)
        built = next(build_dir.glob("_C.*.so"))
        shutil.copy2(built, target)
        # The C++ core in fusetrain/lib, not a package (Note [Wheel RUNPATH]).
        (target.parent / "lib").mkdir(exist_ok=True)
        shutil.copy2(build_dir / "libfusetrain.so", target.parent / "lib" / "libfusetrain.so")
        # The build record (Note [Build record] in CMakeLists.txt), with the
        # command that rebuilds an installed package: this one, against the
        # environment's torch.
        record = json.loads((build_dir / "build-info.json").read_text())
        record["rebuild"] = f"{{python}} -m pip install --no-build-isolation --force-reinstall --no-deps {ROOT}"
        (target.parent / "lib" / "build-info.json").write_text(json.dumps(record, indent=2) + "\n")
        if editable:
            # Only _C is copied into the source tree by setuptools. Copied,
            # then renamed over the old one, so a running Python keeps its
            # mapped copy (as scripts/install-python.sh does).
            dest = ROOT / "python" / "fusetrain" / "lib" / "libfusetrain.so"
            dest.parent.mkdir(exist_ok=True)
            shutil.copy2(build_dir / "libfusetrain.so", f"{dest}.new")
            os.replace(f"{dest}.new", dest)
            shutil.copy2(target.parent / "lib" / "build-info.json", dest.parent / "build-info.json")


TORCH_VERSION = build_torch()

setup(
    name="fusetrain",
    version="0.1.0",
    description="Fast mixed-precision, data-parallel PyTorch training",
    package_dir={"": "python"},
    packages=find_packages(where="python"),
    ext_modules=[CMakeExtension("fusetrain._C")],
    cmdclass={"build_ext": CMakeBuild},
    # setuptools' own staging would default to build/ (`make build`'s) and
    # python/fusetrain.egg-info (which would make python/ look installed).
    options={"build": {"build_base": str(STAGING)}, "egg_info": {"egg_base": str(STAGING)}},
    python_requires=">=3.10",
    # The torch this build compiled against, to its minor version (above).
    install_requires=["torch=={}.{}.*".format(*TORCH_VERSION.split("+")[0].split(".")[:2])],
    # `pip install "fusetrain[tpu]"`: torch's TPU backend (device "tpu"),
    # built for torch 2.11 and later; fusetrain's ops run on it through their
    # device-generic kernels. Not installed or run where fusetrain is built.
    # `pip install "fusetrain[hf]"` (alias "transformers"): the Hugging Face
    # Trainer helpers of fusetrain.integrations (the Trainer needs accelerate);
    # "accelerate": use_grad_scaler. Minimum versions only: transformers 4.47
    # brought Trainer(optimizer_cls_and_kwargs=...).
    # `pip install "fusetrain[lightning]"`: fusetrain.lightning's precision
    # plugin and strategies (PyTorch Lightning 2.x; tested with 2.6).
    extras_require={
        "tpu": ["torch-tpu"],
        "lightning": ["lightning>=2.4"],
        "hf": ["transformers>=4.47", "accelerate>=0.26"],
        "transformers": ["transformers>=4.47", "accelerate>=0.26"],
        "accelerate": ["accelerate>=0.26"],
        "docs": ["sphinx>=7.2", "myst-parser>=3.0", "furo>=2024.1.29"],
    },
    zip_safe=False,
)

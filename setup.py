"""Builds the fusetrain Python package by driving the project's one CMake
build (CMakeLists.txt); the extension and libfusetrain come from there.

    pip install --no-build-isolation .        # a wheel
    pip install --no-build-isolation -e .     # editable, as `make build` does

FUSETRAIN_BUILD_DIR picks the CMake build folder (default: build/).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build_dir = Path(os.environ.get("FUSETRAIN_BUILD_DIR", ROOT / "build")).resolve()
        if not (build_dir / "CMakeCache.txt").exists():
            generator = ["-G", "Ninja"] if shutil.which("ninja") else []
            subprocess.check_call(
                ["cmake", "-S", str(ROOT), "-B", str(build_dir), *generator,
                 f"-DPython3_EXECUTABLE={sys.executable}"]
            )
        subprocess.check_call(
            ["cmake", "--build", str(build_dir), "--target", "_C", "-j", str(os.cpu_count() or 2)]
        )
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        target.parent.mkdir(parents=True, exist_ok=True)
        built = next(build_dir.glob("_C.*.so"))
        shutil.copy2(built, target)
        shutil.copy2(build_dir / "libfusetrain.so", target.parent / "libfusetrain.so")


setup(
    name="fusetrain",
    version="0.1.0",
    description="Fast mixed-precision, data-parallel PyTorch training",
    package_dir={"": "python"},
    packages=["fusetrain"],
    ext_modules=[CMakeExtension("fusetrain._C")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.10",
    install_requires=["torch==2.11.*"],
    zip_safe=False,
)

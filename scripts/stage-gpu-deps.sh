#!/usr/bin/env bash
# Stages into .gpu-deps/ the Debian-packaged headers and libraries the build
# needs and the GPU box lacks (it has torch, nvcc, cmake and ninja, but no
# apt and no network): cxxopts, Catch2, gloo's headers, yaml-cpp, nlohmann-json, zlib's
# header, Debian's Fashion-MNIST files (32 MB) for the trainer's runs, and
# Lightning's wheels for its benchmark. `make gpu-check` carries the folder there; CMake finds it through
# CMAKE_PREFIX_PATH (cmake/Dependencies.cmake).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh >/dev/null
D=.gpu-deps
rm -rf "$D"
mkdir -p "$D/include" "$D/lib"
cp /usr/include/cxxopts.hpp /usr/include/zlib.h /usr/include/zconf.h "$D/include/"
cp -r /usr/include/catch2 /usr/include/gloo /usr/include/yaml-cpp /usr/include/nlohmann "$D/include/"
lib=/usr/lib/x86_64-linux-gnu
cp -L "$lib"/libyaml-cpp.so.0.7 "$D/lib/"
ln -sf libyaml-cpp.so.0.7 "$D/lib/libyaml-cpp.so"
cp -L "$lib"/libz.so.1 "$D/lib/"
ln -sf libz.so.1 "$D/lib/libz.so"
# Lightning for the integration benchmark (bench_lightning.py): its pure-Python
# wheels, as installed here, for gpu_check.sh to install offline. (numpy and
# PyYAML, also needed, are binary and come with the box's torch setup.) The
# Hugging Face stack is not staged: its binary wheels (tokenizers, regex,
# pydantic-core...) are built per Python version and would not fit the 64 MiB
# carried; its benchmark runs where the box already has transformers.
wheels=()
for dist in lightning lightning-utilities pytorch-lightning torchmetrics tqdm packaging; do
  wheels+=("$dist==$(.venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$dist")")
done
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: -d "$D/wheels" "${wheels[@]}"
if ls "$D"/wheels/*.whl | grep -qv -- "-none-any.whl$"; then
  echo "stage-gpu-deps: a Lightning wheel is not pure Python" >&2; exit 1
fi
mkdir -p "$D/datasets"
cp -r /usr/share/datasets/fashion-mnist "$D/datasets/"
du -sh "$D"
